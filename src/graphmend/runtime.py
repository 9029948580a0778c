"""The graphmend runtime: what mended code calls while it runs.

This module is the whole dependency of mended code (in memory, and in patches
that ``graphmend fix`` writes), so it stays small, documented and stable. It
imports only the standard library and torch.

**Regions.** ``region()`` opens a deferral region around one call of a
compiled model; ``graphmend.compile`` opens it for you. Inside a region the
[Defer] calls below *record* their effect, with tensor arguments snapshotted
at the call; when the outermost region closes (normally or by an exception)
the records are performed in FIFO order. Outside a region they perform the
effect at once, exactly as the original code did, so an eager call of a
mended function behaves like the original.

Dynamo traces these functions: the record is a new cell of a linked list whose tensors
become graph outputs, so the compiled region has no break. Regions are
serialised by one process-wide lock: records of two threads can never mix.

**Effects that were not deferred.** A print, warning or log call that no
rule rewrote (a callee's, on a path the example inputs did not take; a
library's) runs at once. Deferred output must never be overtaken by it, so
from the first region on graphmend watches the three channels such effects
go through (``sys.stdout`` / ``sys.stderr``, ``warnings._showwarnmsg`` and
the log record factory): on a region's thread, the first write, shown
warning or created log record performs the records made so far (a set trap
among them raises there, before the effect, as the eager code would have)
and then lets the effect through. Outside a region, and on other threads,
the watchers only pass it through; they stay installed (see ``_watch``).
Writes that bypass Python (a C extension's) are not seen, nor are torch's
own warnings and logs while it compiles.

**Speculation.** ``call(fn, ...)`` runs ``fn`` in a speculating region:
a [Speculate] site (``speculate``) returns the value it had last as a
constant Dynamo compiles for, and records the actual one; when the call ends
the guesses are checked before anything is performed, and a wrong one runs the
call again (``Mispredicted``), nothing of the first run performed and the
random state restored. A call that raises, or that reaches an effect that was
not deferred, runs once more without guessing.

**Export.** Under ``torch.export`` nothing is recorded. A trap becomes
``torch._assert_async`` in the exported program: it raises RuntimeError
with the original exception type and message in its text (a message that is
not a constant refuses the export with one error naming the site). A deferred
print, log or warning runs at trace time in non-strict export, as the
original's does; strict export, where the original's effect is a graph break
that fails the export too, stops with one ``ExportError`` naming the site.
``barrier`` breaks no graph there.

**Sites.** Each call carries ``site = (module_name, line, function)`` of the
original statement, so that a replayed warning or log record reports the
original file, line and function.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import threading
import warnings
from typing import Any, Iterator

import torch

Site = tuple  # (module __name__, line, function name)

API_VERSION = 1


class _Cell:
    """One record of a region and the cell before it (see ``_State.sink``)."""

    def __init__(self, record: Any, older: Any) -> None:
        self.record = record
        self.older = older


# The first cell of every region's records.
_START = _Cell(None, None)


class _State:
    """Process-wide deferral state.

    ``sink`` holds the region's records, newest first, as linked cells
    (``_Cell``: a record, the older cell) ending in ``_START``; None outside
    a region.
    Traced code adds a record by rebinding ``sink`` to a new cell and never
    looks inside one, so Dynamo has nothing to guard on but the attribute's
    type. (A list would do, but Dynamo guards on a list's length: a frame that
    records and runs more than once per call, a layer compiled as a frame of
    its own, would compile once per record count.)"""

    sink: _Cell | None = None
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

class _Marker:
    """Heads a tuple that stands for a value formatted at flush: (_DEFER, kind, ...)."""

    def __repr__(self) -> str:
        return "<graphmend deferred value>"


_DEFER = _Marker()
_FSTR, _PCT, _FMT, _LAZY = "f-string", "percent", "format", "lazy"


def _is_deferred(value: Any) -> bool:
    return type(value) is tuple and len(value) > 0 and value[0] is _DEFER


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
        _STATE.sink = _START
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
            records = _records(_STATE.sink, _STATE.performed)
            guessed = _STATE.speculating
            _STATE.sink = None
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
            _LOCK.release()


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
    sink = _STATE.sink
    if sink is None or _STATE.flushing or _STATE.owner != threading.get_ident() or _compiling_here():
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
        _before_effect()
        return self._inner.write(text)

    @torch.compiler.disable
    def writelines(self, lines: Any) -> None:
        _before_effect()
        self._inner.writelines(lines)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


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
    return _STATE.sink is not None


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


class ExportError(RuntimeError):
    """torch.export met a mended call whose behaviour an exported program cannot keep."""


def _exported(site: Site, what: str) -> None:
    """A deferred effect under torch.export. Not under Dynamo (non-strict
    export): nothing, the effect runs now, at trace time, as the original's
    does. Under Dynamo (strict export, where the original's effect is a graph
    break and fails the export too): one error that names the site."""
    if torch.compiler.is_exporting() and torch.compiler.is_dynamo_compiling():
        _refuse_export(site, what, "an exported program keeps no output")


@torch._dynamo.assume_constant_result  # Dynamo calls it while tracing: the error reaches the user as is
def _refuse_export(site: Site, what: str, why: str) -> None:
    filename, _ = _module_of(site)
    raise ExportError(
        f"graphmend: torch.export cannot keep the {what} at {filename}:{site[1]} ({site[2]}), mended by graphmend: "
        f"{why}; export the original (graphmend.unmend(model)) or remove it"
    )


def _recording() -> bool:
    """Whether a deferred call records (``_push``) instead of acting at once."""
    if torch.compiler.is_exporting():
        return False  # torch.export: nothing is recorded (see "Export" in the module doc)
    if _STATE.sink is None:
        if _traced():
            _note_unguarded()
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


def _compiling_here() -> bool:
    """Whether this thread is inside a Dynamo compile (its own eager callbacks:
    torch's warnings and logs while it compiles). Thread-local, unlike
    ``torch.compiler.is_compiling()``."""
    return torch._guards.CompileContext.try_get() is not None


def _push(record: tuple) -> None:
    _STATE.sink = _Cell(record, _STATE.sink)


# --------------------------------------------------------------------------
# snapshots and deferred formatting (traced by Dynamo)


def _snap(value: Any) -> Any:
    if isinstance(value, torch.nn.Parameter):
        return value  # a clone would print as a plain tensor
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) is tuple:
        return tuple([_snap(v) for v in value])
    if type(value) is list:
        return [_snap(v) for v in value]
    if type(value) is dict:
        return {k: _snap(v) for k, v in value.items()}
    return value


def fstr(*parts: Any) -> Any:
    """An f-string: parts are str or (value, conversion, spec) tuples."""
    return (_DEFER, _FSTR, parts)


def pct(template: Any, values: Any) -> Any:
    """``template % values`` evaluated at flush."""
    return (_DEFER, _PCT, template, values)


def fmt(template: Any, args: tuple, kwargs: dict) -> Any:
    """``template.format(*args, **kwargs)`` evaluated at flush."""
    return (_DEFER, _FMT, template, args, kwargs)


def lazy(kind: str, value: Any) -> Any:
    """A host conversion (``item``, ``tolist``, ``int``, ``float``, ``bool``) at flush."""
    return (_DEFER, _LAZY, kind, value)


# --------------------------------------------------------------------------
# the deferred calls


def print_(site: Site, args: tuple, kwargs: dict) -> None:
    """``print(*args, **kwargs)``."""
    if not _recording():
        _exported(site, "print")
        _print_now(args, kwargs)
    else:
        _push(("print", site, None, None, _snap(args), _snap(kwargs)))


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "info_once": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "warning_once": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


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


def log(site: Site, logger: Any, method: str, args: tuple, kwargs: dict) -> None:
    """``logger.<method>(*args, **kwargs)``; a disabled level records nothing."""
    if not isinstance(logger, logging.Logger):
        _exported(site, f"call of `{method}`")
        _perform_call(logger, method, args, kwargs)
        return
    if not _recording():
        _exported(site, f"`logger.{method}` call")
        _log_now(site, logger, method, args, kwargs)
        return
    if _ENABLED.get(site, True):
        _push(("log", site, logger, method, _snap(args), _snap(kwargs)))


def warn(site: Site, args: tuple, kwargs: dict) -> None:
    """``warnings.warn(*args, **kwargs)`` (stacklevel 1)."""
    if not _recording():
        _exported(site, "`warnings.warn` call")
        _warn_now(site, args, kwargs)
    else:
        _push(("warn", site, None, None, _snap(args), _snap(kwargs)))


# --------------------------------------------------------------------------
# [Where] guards: pure checks that Dynamo evaluates while tracing (on shapes,
# dtypes and grad mode it already guards on), so the compiled graph holds
# only the predicated form, and eager code takes the original branch whenever
# a check fails.


def predicable(cond: Any) -> bool:
    """A 0-dim bool tensor, with autograd off: torch.where can stand in for ``if``.

    With grad enabled the original branch runs: ``where`` would give zero
    instead of ``None`` gradients to the branch not taken, and NaN gradients
    when that branch has a non-finite derivative."""
    return (
        isinstance(cond, torch.Tensor)
        and cond.dtype == torch.bool
        and cond.dim() == 0
        and not torch.is_grad_enabled()
    )


def same_meta(a: Any, b: Any) -> bool:
    """Both tensors with the same shape, dtype, device and layout, so that
    ``torch.where(c, a, b)`` neither broadcasts nor promotes."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
        and a.layout == b.layout
    )


def bind(*objects: Any) -> None:
    """Nothing when it runs; while Dynamo traces, it meets each object here,
    in the frame's own graph, before ``torch.cond`` traces its branches.

    An object Dynamo first meets inside a ``torch.cond`` branch is tracked
    only in that branch's side effects, which are dropped after the branch
    is traced: a later ``obj.attr = ...`` in the same frame is then lost
    (torch 2.13, measured: ``self.count += 1`` after a cond whose branch
    calls ``self.lin``). ``type`` makes Dynamo build its view of each object."""
    for obj in objects:
        type(obj)


def store(module: Any, name: str, value: Any) -> None:
    """``module.<name> = value`` for a predicated attribute update: a registered
    buffer of the same shape and dtype that no other attribute of the module
    shares is updated in place (its identity, which Dynamo guards on, stays);
    anything else is rebound, as the original assignment did."""
    buffers = module.__dict__.get("_buffers", {})
    current = buffers.get(name)
    if current is not None and same_meta(current, value) and not _shared(module, name, current):
        current.copy_(value)
    else:
        setattr(module, name, value)


def register_buffer(module: Any, name: str, value: Any, persistent: bool = True) -> None:
    """``module.register_buffer(name, value, persistent=...)`` for a merged
    branch: an existing buffer with the same persistence is updated in place
    when nothing else shares it; otherwise the original call runs."""
    buffers = module.__dict__.get("_buffers", {})
    current = buffers.get(name)
    same_flag = (name not in module.__dict__.get("_non_persistent_buffers_set", set())) == bool(persistent)
    if current is not None and same_flag and same_meta(current, value) and not _shared(module, name, current):
        current.copy_(value)
    else:
        module.register_buffer(name, value, persistent=persistent)


def on_device(tensor: Any, device: Any) -> bool:
    """``tensor.to(device)`` would return ``tensor`` itself."""
    return isinstance(tensor, torch.Tensor) and tensor.device == torch.device(device)


def _shared(module: Any, name: str, tensor: Any) -> bool:
    for key, other in module.__dict__.get("_buffers", {}).items():
        if key != name and other is tensor:
            return True
    for other in module.__dict__.get("_parameters", {}).values():
        if other is tensor:
            return True
    for key, other in module.__dict__.items():
        if other is tensor:
            return True
    return False


def barrier() -> None:
    """A graph break, placed before an assert that may be on tensor values when
    the mended code records (mend.py, barriers.py). Dynamo compiles such an
    assert into the graph, and a graph that raises loses the records made in
    it: the break ends the graph before the assert, so the records made so far
    reach the region, which performs them (and raises a set trap) even when
    the assert then fails. Under torch.export nothing is recorded: no break."""
    if not torch.compiler.is_exporting():
        _break()


@torch.compiler.disable
def _break() -> None:
    """Dynamo cannot trace a call of this: the graph ends before it."""


# While mending runs the model eagerly (barriers.py), the (file, line) of each
# held test that was a tensor; None otherwise (Dynamo guards on it being None).
HELD_PROBE: set | None = None


def held(value: Any) -> Any:
    """The test of an assert Dynamo may compile into the graph (barriers.py):
    a graph break first when it is a tensor (decided while tracing), so what
    was recorded before it is performed even when the assert fails; the value
    unchanged."""
    if isinstance(value, torch.Tensor):
        if HELD_PROBE is not None:
            caller = sys._getframe(1)
            HELD_PROBE.add((caller.f_code.co_filename, caller.f_lineno))
        barrier()
    return value


# --------------------------------------------------------------------------
# [Trap]: a validation check becomes a flag; the exception is raised when the
# region closes, in the place its record holds in the effect order.


def trappable(flag: Any) -> bool:
    """A 0-dim bool tensor: the check can be deferred (decided while tracing)."""
    return isinstance(flag, torch.Tensor) and flag.dtype == torch.bool and flag.dim() == 0


def equal(a: Any, b: Any) -> Any:
    """``torch.equal(a, b)`` as a 0-dim bool tensor (or a bool when it cannot be).

    Shapes are compared first, so broadcasting can never make tensors of
    different shapes compare equal, and shapes that do not broadcast do not
    raise; values are compared as torch.equal does (with type promotion; NaN
    is never equal)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.device != b.device:
        return torch.equal(a, b)  # the original call, with its own behaviour
    if a.shape != b.shape:
        return torch.zeros((), dtype=torch.bool, device=a.device)
    return torch.logical_not((a != b).any())


def gate(taken: Any, flag: Any) -> Any:
    """The flag of a check inside a branch: set only if the branch is taken.

    Two 0-dim bool tensors combine in the graph; anything else is decided as
    the original would (the flag is only looked at when the branch is taken)."""
    if trappable(taken) and trappable(flag):
        return torch.logical_and(taken, flag)
    return bool(taken) and bool(flag)


def trap(site: Site, flag: Any, exc_type: Any, args: tuple) -> None:
    """``if flag: raise exc_type(*args)``, deferred to the end of the region.

    Effects recorded before it are performed; those recorded after it are
    not (the eager code would not have reached them)."""
    if torch.compiler.is_exporting():
        _export_trap(site, flag, exc_type, args)
        return
    if not _recording():
        if bool(flag):
            raise exc_type(*_resolve(args))
        return
    _push(("trap", site, exc_type, None, (flag,), _snap(args)))


def _export_trap(site: Site, flag: Any, exc_type: Any, args: tuple) -> None:
    """A trap under torch.export: an assert the exported program keeps
    (``torch._assert_async``: it raises RuntimeError, with the original type
    and message in its text), or, when the message is not a constant, one
    error that names the site; a Python bool decides at once, as the original."""
    if not isinstance(flag, torch.Tensor):
        if flag:
            raise exc_type(*_resolve(args))
        return
    if not all(isinstance(a, str) for a in args):
        _refuse_export(site, f"check raising {exc_type.__name__}", "its message is computed from values")
    text = args[0] if len(args) == 1 else str(args) if args else ""
    torch._assert_async(torch.logical_not(flag), f"{exc_type.__name__}: {text}" if text else exc_type.__name__)


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


def speculate(site: Site, value: Any) -> Any:
    """``value.item()``; compiled inside a speculating call, the value the site
    had last (a constant Dynamo guards on), recorded to be checked at the end."""
    if not _traced():
        result = value.item()
        if _STATE.sink is not None and _STATE.owner == threading.get_ident():
            _PREDICTED.setdefault(site, result)  # learn: eagerly, in a region
        return result
    guess = _PREDICTED.get(site)
    if not _recording() or value.dtype not in _GUESSABLE or value.numel() != 1:
        return value.item()
    if not _STATE.speculating or guess is None:
        # Not guessing (a rerun, a plain region): the value read is the next guess.
        _push(("observe", site, None, None, (value.detach().clone(),), None))
        return value.item()
    _push(("speculate", site, guess, None, (value.detach().clone(),), None))
    return guess


def _wrong_guesses(records: list) -> bool:
    """Check each guess of the call (a wrong one is corrected for the next
    call) and learn each value read without guessing; whether one was wrong."""
    wrong = False
    for kind, site, guess, _, args, _ in records:
        if kind == "observe":
            _PREDICTED[site] = args[0].item()
        elif kind == "speculate":
            actual = args[0].item()
            if actual != guess:
                _PREDICTED[site] = actual
                wrong = True
    return wrong


def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a speculating region: a wrong guess runs the
    call again with the right one, anything else that would make a second run
    visible runs it once more without guessing. The random state is restored
    before each run again; nothing a discarded run recorded is performed."""
    state = _rng_state()
    speculating = True
    for attempt in range(3):
        try:
            with region(speculating=speculating and attempt < 2):
                return fn(*args, **kwargs)
        except Mispredicted as miss:
            speculating = miss.again
            _set_rng_state(state)
    raise AssertionError("unreachable: the last run does not guess")


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.random.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


_TORCH_DIR = os.path.dirname(torch.__file__)


def _is_torch_file(path: str) -> bool:
    return isinstance(path, str) and path.startswith(_TORCH_DIR)


# --------------------------------------------------------------------------
# flush (plain Python, never traced)


def _resolve(value: Any) -> Any:
    if _is_deferred(value):
        kind = value[1]
        if kind == _FSTR:
            out = []
            for part in value[2]:
                if isinstance(part, str):
                    out.append(part)
                    continue
                item, conversion, spec = part
                item = _resolve(item)
                if conversion == "r":
                    item = repr(item)
                elif conversion == "s":
                    item = str(item)
                elif conversion == "a":
                    item = ascii(item)
                out.append(format(item, _resolve(spec) if spec else ""))
            return "".join(out)
        if kind == _PCT:
            return _resolve(value[2]) % _resolve(value[3])
        if kind == _FMT:
            return _resolve(value[2]).format(*_resolve(value[3]), **_resolve(value[4]))
        if kind == _LAZY:
            conv, item = value[2], _resolve(value[3])
            if conv in ("item", "tolist"):
                return getattr(item, conv)()
            return {"int": int, "float": float, "bool": bool}[conv](item)
    if type(value) is tuple:
        return tuple(_resolve(v) for v in value)
    if type(value) is list:
        return [_resolve(v) for v in value]
    if type(value) is dict:
        return {k: _resolve(v) for k, v in value.items()}
    return value


def _module_of(site: Site) -> tuple[str, dict]:
    module = sys.modules.get(site[0])
    namespace = vars(module) if module is not None else {"__name__": site[0]}
    filename = namespace.get("__file__") or site[0]
    return filename, namespace


_RELOCATE = threading.local()
_RELOCATING = threading.RLock()


def _find_caller(logger: logging.Logger, original: Any) -> Any:
    def find_caller(stack_info: bool = False, stacklevel: int = 1) -> tuple:
        where = getattr(_RELOCATE, "where", None)
        if where is not None and getattr(_RELOCATE, "logger", None) is logger:
            return where
        return original(stack_info, stacklevel)

    return find_caller


def _perform_print(args: tuple, kwargs: dict) -> None:
    print(*_resolve(args), **_resolve(kwargs))


@torch.compiler.disable
def _perform_call(target: Any, method: str, args: tuple, kwargs: dict) -> None:
    getattr(target, method)(*_resolve(args), **_resolve(kwargs))


def _call_logger(site: Site, logger: logging.Logger, method: str, args: tuple, kwargs: dict) -> None:
    """Call the real logger method, with the record placed where eager put it.

    A method of ``logging.Logger`` itself reports its caller (the original
    site), so the call is relocated there. A method defined elsewhere
    (transformers' ``warning_once``) reports its own frame, as it does when
    called from here: it is called as is."""
    args, kwargs = _resolve(args), _resolve(kwargs)
    function = getattr(getattr(type(logger), method, None), "__module__", None)
    if function != logging.__name__:
        getattr(logger, method)(*args, **kwargs)
        return
    filename, _ = _module_of(site)
    # The patch is on the logger, which other threads share: one relocated call at a time.
    with _RELOCATING:
        _RELOCATE.where = (filename, site[1], site[2], None)
        _RELOCATE.logger = logger
        had = "findCaller" in vars(logger)
        saved = vars(logger).get("findCaller")
        logger.findCaller = _find_caller(logger, type(logger).findCaller.__get__(logger))  # type: ignore[method-assign]
        try:
            getattr(logger, method)(*args, **kwargs)
        finally:
            _RELOCATE.where = None
            _RELOCATE.logger = None
            if had:
                logger.findCaller = saved  # type: ignore[method-assign]
            else:
                del logger.findCaller


def _warn_explicit(site: Site, args: tuple, kwargs: dict) -> None:
    message = args[0] if args else kwargs["message"]
    category = args[1] if len(args) > 1 else kwargs.get("category")
    if isinstance(message, Warning):
        category = message.__class__
    if category is None:
        category = UserWarning
    filename, namespace = _module_of(site)
    registry = namespace.setdefault("__warningregistry__", {}) if site[0] in sys.modules else {}
    warnings.warn_explicit(
        message,
        category,
        filename,
        site[1],
        module=site[0],
        registry=registry,
        # No module_globals: like warnings.warn itself, do not load the module's
        # source on every call (linecache reads it only if the warning is shown).
    )


def _warn_resolved(site: Site, args: tuple, kwargs: dict) -> None:
    _warn_explicit(site, _resolve(args), _resolve(kwargs))


# The immediate paths are reached from traced code (a mended function compiled
# outside a region): Dynamo must not trace into them. The flush below runs
# eagerly and calls the plain functions, without the disable wrappers' cost.
_print_now = torch.compiler.disable(_perform_print)
_log_now = torch.compiler.disable(_call_logger)
_warn_now = torch.compiler.disable(_warn_resolved)


def flush(records: list) -> None:
    """Perform recorded effects in order; a set trap raises and ends the flush."""
    for kind, site, target, method, args, kwargs in records:
        if kind in ("speculate", "observe"):
            continue  # checked before the flush (region)
        if kind == "trap":
            if bool(args[0]):
                error = target(*_resolve(kwargs))
                raise error from None
            continue
        if kind == "print":
            _perform_print(args, kwargs)
        elif kind == "log":
            _call_logger(site, target, method, args, kwargs)
        elif kind == "warn":
            _warn_explicit(site, _resolve(args), _resolve(kwargs))


__all__ = [
    "API_VERSION",
    "on_device",
    "predicable",
    "register_buffer",
    "same_meta",
    "store",
    "torch",
    "active",
    "flush",
    "fmt",
    "fstr",
    "lazy",
    "log",
    "pct",
    "print_",
    "region",
    "exclusive",
    "register_log_site",
    "Mispredicted",
    "call",
    "speculate",
    "equal",
    "gate",
    "trap",
    "trappable",
    "warn",
]
