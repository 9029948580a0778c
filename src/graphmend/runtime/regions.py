"""Regions: the records of one call, the lock that keeps calls apart, the
watchers that perform the records before an effect that was not deferred,
and the checks of [Speculate]'s guesses (see the package doc)."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import random
import sys
import threading
import types
import warnings
from typing import Any, Iterator

import torch

from graphmend.runtime.records import Guess, Observed, Site, flush


class _Cell:
    """One record of a region and the cell before it (see ``_SINK``)."""

    def __init__(self, record: Any, older: Any) -> None:
        self.record = record
        self.older = older


# The first cell of every region's records.
_START = _Cell(None, None)

# The region's records, newest first, as linked cells (``_Cell``: a record,
# the older cell) ending in ``_START``; None outside a region.
# Traced code adds a record by putting a new cell in the slot and never looks
# inside one, so Dynamo has nothing to guard on but the slot's type. (A
# growing list would do, but Dynamo guards on a list's length: a frame that
# records and runs more than once per call, a layer compiled as a frame of its
# own, would compile once per record count.) A one-slot list, not an attribute
# of an object: torch 2.13 and 2.14 drop an object's attribute stores made
# after a ``torch.cond`` in a frame that stored one of its attributes before it
# (docs/torch-issues.md); an item store is kept.
_SINK: list = [None]


class _State:
    """Process-wide deferral state, set and read by eager code only."""

    owner: int | None = None
    depth: int = 0
    performed: _Cell = _START  # the newest cell performed already (before an effect that was not deferred)
    flushing: bool = False
    speculating: bool = False  # [Speculate] may guess host values in this region (``call``)


def _records(head: _Cell | None, stop: _Cell = _START) -> list:
    """The records of the cells from ``head`` back to ``stop``, oldest first."""
    out = []
    while head is not None and head is not stop and head is not _START:
        out.append(head.record)
        head = head.older
    out.reverse()
    return out


_STATE = _State()
_LOCK = threading.RLock()


# --------------------------------------------------------------------------
# regions


@contextlib.contextmanager
def region(speculating: bool = False) -> Iterator[None]:
    """Defer effects recorded inside; perform them when the outermost region exits.

    ``speculating`` (``call`` sets it): [Speculate] sites may guess; the exit
    checks the guesses before performing anything and raises ``Mispredicted``
    (nothing performed) when one was wrong, when the body raised, or when an
    effect that was not deferred was about to happen."""
    _LOCK.acquire()
    outermost = _STATE.depth == 0
    if outermost:
        _refresh_levels()
        _SINK[0] = _START
        _STATE.performed = _START
        _STATE.owner = threading.get_ident()
        _STATE.speculating = speculating
        _watch()
    _STATE.depth += 1
    raised = False
    try:
        yield
    except BaseException:
        raised = True
        raise
    finally:
        _STATE.depth -= 1
        records: list = []
        guessed = False
        if outermost:
            records = _records(_SINK[0], _STATE.performed)
            guessed = _STATE.speculating
            _SINK[0] = None
            _STATE.owner = None
            _STATE.speculating = False
        try:
            if outermost:
                if guessed and raised:
                    # A graph that raised lost its records, a guess among them maybe: run again, not guessing.
                    if not isinstance(sys.exc_info()[1], Mispredicted):
                        RERUNS["raised"] += 1
                    raise Mispredicted(again=False)
                if _wrong_guesses(records) and guessed:
                    RERUNS["wrong guess"] += 1
                    raise Mispredicted(again=True)
                flush(records)
        finally:
            if outermost:
                _forget_compile_tracebacks()
            _LOCK.release()


def _forget_compile_tracebacks() -> None:
    """Drop the tracebacks Dynamo's thread-local metrics context keeps of each
    metric it set (torch 2.12-2.15 never clear them), here, under the regions'
    lock, rather than when the thread ends: torch frees them holding a mutex
    while a Dynamo weakref callback runs Python, and a thread that takes or frees
    a traceback meanwhile, holding the GIL, deadlocks the process (two threads
    that called a compiled model and end at once; docs/torch-issues.md)."""
    utils = sys.modules.get("torch._dynamo.utils")
    context = getattr(getattr(utils, "_metrics_context_tls", None), "metrics_context", None)
    edits = getattr(context, "_edits", None)
    if isinstance(edits, list) and edits and not context.in_progress():
        edits.clear()


def exclusive() -> Any:
    """The lock that serialises regions (re-entrant): held around a call, it keeps
    process-wide settings the call depends on (Dynamo's capture flags) from
    other threads' calls, as a region does."""
    return _LOCK


# --------------------------------------------------------------------------
# effects that were not deferred: perform the records first


@torch.compiler.disable
def _before_effect(origin: str | None = None) -> None:
    """An effect that was not deferred is about to happen: perform the records so far.

    Not while torch compiles: user code does not run then (Dynamo traces it),
    so a warning or log record is torch's own, and a set trap must not raise
    inside the compiler."""
    sink = _SINK[0]
    if sink is None or _STATE.flushing or _STATE.owner != threading.get_ident() or compiling_here():
        return
    if _STATE.speculating:
        # Nothing of a speculating call may happen before its guesses are
        # checked (it may run again): stop here, run it again without guessing.
        if origin is not None and _is_torch_file(origin):
            return  # torch's own message (a recompile warning): not the model's effect
        RERUNS["effect"] += 1
        raise Mispredicted(again=False)
    records = _records(sink, _STATE.performed)
    if not records:
        return
    _STATE.performed = sink  # a set trap raises below: what follows it is never performed
    _STATE.flushing = True
    try:
        flush(records)
    finally:
        _STATE.flushing = False


class _Stream:
    """``sys.stdout`` / ``sys.stderr`` once a region has opened: a write of the
    region's thread performs the records made so far first. Everything else,
    and every write outside a region, is the stream's own."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._graphmend = "runtime"

    @torch.compiler.disable
    def write(self, text: str) -> int:
        _before_effect(_log_record_written())
        return self._inner.write(text)

    @torch.compiler.disable
    def writelines(self, lines: Any) -> None:
        _before_effect(_log_record_written())
        self._inner.writelines(lines)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _log_record_written() -> str | None:
    """Where the log record a logging handler is writing was made (a write from
    inside ``Handler.emit``), else None. torch 2.14's stderr handler writes to
    the current ``sys.stderr``, so torch's own warnings ("hit recompile_limit")
    reach this stream; 2.13 keeps the stream it started with."""
    if not _STATE.speculating:
        return None  # only a speculating call tells torch's lines from the model's
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_code.co_name == "emit":
            record = frame.f_locals.get("record")
            if isinstance(record, logging.LogRecord):
                return record.pathname
        frame = frame.f_back
    return None


def _watching(obj: Any, tag: str) -> bool:
    """Whether a wrapper tagged ``tag`` is ``obj`` or lies below it under
    graphmend's wrappers only (each tagged ``_graphmend``, keeping what it
    wraps as ``_inner``: the runtime's, and those graphmend's analysis puts
    there). One under someone else's wrapper would see their writes too late."""
    for _ in range(64):
        own = getattr(obj, "__dict__", None)
        if not isinstance(own, dict) or "_graphmend" not in own:
            return False
        if own["_graphmend"] == tag:
            return True
        obj = own.get("_inner")
    return False


def _tagged(fn: Any, inner: Any) -> Any:
    fn._inner, fn._graphmend = inner, "runtime"
    return fn


def _watch() -> None:
    """Watch the three channels an effect that was not deferred goes through.

    Installed once and left in place: outside a region, and on other threads,
    the watchers only pass through. (Putting them back when each region closed
    went wrong with threads: a thread that swapped ``sys.stdout`` meanwhile,
    graphmend's own analysis of another model say, had saved the watcher as
    the stream to restore.) Installed again only where something replaced
    them since."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not _watching(stream, "runtime"):
            setattr(sys, name, _Stream(stream))
    show = getattr(warnings, "_showwarnmsg", None)
    if show is not None and not _watching(show, "runtime"):
        warnings._showwarnmsg = _tagged(_show_watcher(show), show)  # type: ignore[attr-defined]
    factory = logging.getLogRecordFactory()
    if not _watching(factory, "runtime"):
        logging.setLogRecordFactory(_tagged(_factory_watcher(factory), factory))


# Called from eager code (warnings, logging) inside the model's call: Dynamo must not compile
# these frames (it would trace logging.LogRecord into `time.time`: a break and a warning of its own).
def _show_watcher(inner: Any) -> Any:
    @torch.compiler.disable
    def showwarnmsg(msg: Any) -> None:
        _before_effect(getattr(msg, "filename", None))
        inner(msg)

    return showwarnmsg


def _factory_watcher(inner: Any) -> Any:
    @torch.compiler.disable
    def record_factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        _before_effect(args[2] if len(args) > 2 else kwargs.get("pathname"))
        return inner(*args, **kwargs)

    return record_factory


def active() -> bool:
    return _SINK[0] is not None


_UNGUARDED_MESSAGE = (
    "graphmend: a mended function is being compiled outside a deferral region, so its "
    "print/log/warn calls still break the graph; compile the model with graphmend.compile(...) "
    "or call it inside graphmend.runtime.region()"
)
_unguarded_warned = False


@torch.compiler.disable
def _note_unguarded() -> None:
    global _unguarded_warned
    if not _unguarded_warned:
        _unguarded_warned = True
        warnings.warn(_UNGUARDED_MESSAGE, RuntimeWarning, stacklevel=2)


def _recording() -> bool:
    """Whether a deferred call records (``_push``) instead of acting at once."""
    if torch.compiler.is_exporting():
        return False  # torch.export: nothing is recorded (see "Export" in the module doc)
    if _SINK[0] is None:
        if _traced() or torch._C._dynamo.eval_frame.get_eval_frame_callback() is not None:
            _note_unguarded()  # traced, or called by compiled code after a break (skip_frames)
        return False
    if not _traced() and _STATE.owner != threading.get_ident():
        return False  # an eager call from another thread: not this region's effect
    return True


def _traced() -> bool:
    """Whether Dynamo is tracing this code (a constant it folds). Not
    ``torch.compiler.is_compiling()``: in eager code that is a process-wide
    flag, set while any thread compiles, and another thread's eager call of
    mended code would record into this thread's region."""
    return torch.compiler.is_dynamo_compiling()


def compiling_here() -> bool:
    """Whether this thread is inside a Dynamo compile (its own eager callbacks:
    torch's warnings and logs while it compiles). Thread-local, unlike
    ``torch.compiler.is_compiling()``."""
    return torch._guards.CompileContext.try_get() is not None


def _push(record: tuple) -> None:
    _SINK[0] = _Cell(record, _SINK[0])


def skip_frames() -> None:
    """Dynamo compiles a function as a frame of its own when eager code calls
    it (a mended function resumed after a graph break): each runtime call there
    would be a small graph, guarded on its constant arguments (one recompile per
    site). The runtime's functions and methods run as they are there; traced
    code still inlines them."""
    package = __name__.rsplit(".", 1)[0]
    modules = [m for name, m in list(sys.modules.items()) if name == package or name.startswith(package + ".")]
    for module in modules:
        for value in list(vars(module).values()):
            for fn in vars(value).values() if isinstance(value, type) else [value]:
                fn = getattr(fn, "__func__", fn)  # a staticmethod's or classmethod's function
                if isinstance(fn, types.FunctionType) and fn.__module__.startswith(package):
                    codes = [fn.__code__]
                    while codes:  # with the generator expressions and lambdas in it
                        code = codes.pop()
                        torch._dynamo.eval_frame.skip_code(code)
                        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]


# --------------------------------------------------------------------------
# logger levels


# Dynamo refuses to read a Logger's attributes, so the level test cannot run
# in the graph. Sites whose logger is known when the code is mended register it
# here; each region refreshes the flags once, and the traced code reads a plain
# dict (Dynamo guards on the entry: a level change recompiles, as it should).
_LOG_SITES: dict[Site, tuple[logging.Logger, int]] = {}
_ENABLED: dict[Site, bool] = {}


def register_log_site(site: Site, logger: logging.Logger, level: int) -> None:
    """Let the level test of a logger call site run outside the graph."""
    _LOG_SITES[site] = (logger, level)
    _ENABLED[site] = logger.isEnabledFor(level)


def _refresh_levels() -> None:
    for site, (logger, level) in list(_LOG_SITES.items()):
        _ENABLED[site] = logger.isEnabledFor(level)


# --------------------------------------------------------------------------
# [Speculate]: a host value that steers Python control flow, guessed


# site -> the value the site had last (a bool or an int); Dynamo guards on it.
_PREDICTED: dict[Site, Any] = {}
_GUESSABLE = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


# Why speculating calls ran again, for reports and tests: "wrong guess",
# "raised", "effect" (an effect that was not deferred was about to happen).
RERUNS: "collections.Counter[str]" = collections.Counter()


class Mispredicted(BaseException):
    """A speculating call must run again (``call`` catches it): a guess was
    wrong (``again``: guess again, with the corrected values), or the call
    raised or met an effect that was not deferred (run once more, not guessing).
    A BaseException, so that a model's ``except Exception`` cannot swallow it."""

    def __init__(self, again: bool) -> None:
        super().__init__(again)
        self.again = again


def _wrong_guesses(records: list) -> bool:
    """Check each guess of the call (a wrong one is corrected for the next
    call) and learn each value read without guessing; whether one was wrong."""
    wrong = False
    for record in records:
        if type(record) is Observed:
            _PREDICTED[record.site] = record.value.item()
        elif type(record) is Guess:
            actual = record.value.item()
            if actual != record.guess:
                _PREDICTED[record.site] = actual
                wrong = True
    return wrong


def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a speculating region: a wrong guess runs the
    call again with the right one, anything else that would make a second run
    visible runs it once more without guessing. The random state is restored
    before each run again; nothing a discarded run recorded is performed."""
    state = random_state()
    speculating = True
    for attempt in range(3):
        try:
            with region(speculating=speculating and attempt < 2):
                return fn(*args, **kwargs)
        except Mispredicted as miss:
            speculating = miss.again
            set_random_state(state)
    raise AssertionError("unreachable: the last run does not guess")


def random_state() -> tuple:
    """torch's generators (CPU, CUDA once initialised), Python's and numpy's (once imported);
    ``set_random_state`` puts them back (discover.isolation keeps them around a mend too)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    numpy = sys.modules.get("numpy")
    return torch.random.get_rng_state(), cuda, random.getstate(), numpy.random.get_state() if numpy else None


def set_random_state(state: tuple) -> None:
    cpu, cuda, python, numpy = state
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(python)
    if numpy is not None:
        sys.modules["numpy"].random.set_state(numpy)


_TORCH_DIR = os.path.dirname(torch.__file__)


def _is_torch_file(path: str) -> bool:
    return isinstance(path, str) and path.startswith(_TORCH_DIR)
