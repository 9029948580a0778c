"""Run a target under TorchDynamo and collect every graph break.

This is the measuring pass every other part of graphmend stands on. It
compiles the target with a *counting backend* (each FX graph is recorded and
run as plain Python, no Inductor), calls it on the example inputs, and reads
every break from Dynamo's ``graph_breaks`` log artifact, which is complete
where ``torch._dynamo.explain`` is not (it drops breaks that compiled no graph,
see ``dynamo-behaviour.md`` section 10). Dynamo suppresses the traceback of a
break it has already logged once in the process; discovery turns that
suppression off for its own run so that every event carries its frame chain.

The result is a :class:`Trace`: graphs (with op counts and compile ids),
graphs per call, recompiles, and the raw :class:`BreakEvent` list. Turning
events into user-facing sites with categories is ``sites.py``'s job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sysconfig
import time
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Iterator

import torch
import torch._dynamo

from graphmend import runtime
from graphmend.discover.capture import patched

_GB_LINK = re.compile(r"/gb/gb(\d{4})\.html")
_AT = re.compile(r"in user code at (?P<file>.+):(?P<line>\d+)\s*$")
_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+), in (?P<func>\S+)\s*$')
_RESUME = re.compile(r"^torch_dynamo_resume_in_(?P<name>.+)_at_\d+$")
_REASON_PREFIXES = (
    "Encountered graph break when attempting to trace",
    "Failed to handle graph break gracefully",
)


@dataclass(frozen=True)
class Frame:
    """One frame of a break's user stack."""

    file: str
    line: int
    function: str
    code: str


@dataclass(frozen=True)
class BreakEvent:
    """One graph break as Dynamo logged it."""

    file: str  # where Dynamo stopped tracing (may be inside logging/ or torch)
    line: int
    gb_id: str | None  # "GB0170"
    gb_type: str  # "Data-dependent branching"
    detail: str  # explanation and debug context, first lines
    frames: tuple[Frame, ...]  # outermost -> innermost, from the compiled entry on
    compile_id: str | None  # "frame/recompile" of the compile that broke


@dataclass(frozen=True)
class GraphInfo:
    compile_id: str | None
    ops: int  # call_function + call_method + call_module nodes
    asserts: tuple[tuple[str, int, str], ...] = ()  # (file, line, function) of captured asserts
    scalar_asserts: tuple[str, ...] = ()  # asserts on captured scalars (_scalar_asserts)


@dataclass
class Trace:
    """What one discovery run observed."""

    graphs: list[GraphInfo] = field(default_factory=list)
    graphs_per_call: list[int] = field(default_factory=list)
    events: list[BreakEvent] = field(default_factory=list)
    recompiles: int = 0
    frames_skipped: int = 0  # frames Dynamo abandoned and ran eagerly
    calls_captured: int = 0  # ops (FX call nodes) in the graphs Dynamo made, Dynamo's own count
    seconds: float = 0.0

    @property
    def entry_captured(self) -> bool:
        """Whether any graph came from the first frame Dynamo saw (the entry)."""
        return any((g.compile_id or "").startswith("0/") for g in self.graphs)

    @property
    def graph_count(self) -> int:
        """Graphs compiled by the first call (the paper's measure)."""
        return self.graphs_per_call[0] if self.graphs_per_call else len(self.graphs)


@lru_cache(maxsize=1)
def graph_break_registry() -> dict[str, str]:
    """The installed torch's graph-break ids and their types (empty if it has none)."""
    path = os.path.join(os.path.dirname(torch._dynamo.__file__), "graph_break_registry.json")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return {key: entries[0].get("Gb_type", "") for key, entries in data.items() if entries}


def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if k in paths}
    return tuple(sorted(dirs))


_TORCH_DIR = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep
_STDLIB_DIRS = _stdlib_dirs()


_RUNTIME_DIR = os.path.dirname(os.path.realpath(runtime.__file__)) + os.sep  # the runtime package


def is_library_internal(path: str) -> bool:
    """True for torch's own files, graphmend's runtime, and the standard library
    (not site-packages): a break there belongs to the user line that called it."""
    real = os.path.realpath(path)
    if real.startswith((_TORCH_DIR, _RUNTIME_DIR)):
        return True
    if "site-packages" in real or "dist-packages" in real:
        return False
    return any(real.startswith(d) for d in _STDLIB_DIRS)


_GRAPHMEND_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep  # the package, not discover/


def is_model_code(path: str) -> bool:
    """Not torch's, the standard library's (``is_library_internal``) nor graphmend's own."""
    return not is_library_internal(path) and not os.path.realpath(path).startswith(_GRAPHMEND_DIR)


def _function_name(raw: str) -> str:
    match = _RESUME.match(raw)
    return match.group("name") if match else raw


_DISCOVERY_FILE = os.path.realpath(__file__)


def _below_the_call(frames: list[Frame], entry: tuple[str, str] | None) -> tuple[Frame, ...]:
    """The frames inside the compiled call. Dynamo's traceback starts with the
    real stack above it (the caller's script, graphmend's explain and
    discovery), which ends at ``trace_breaks``: it makes every compiled call.
    Cutting at the entry's (file, function) is only the fallback (a message
    from elsewhere): the entry's frame is missing from a frame compiled on its
    own, and with Dynamo's own folding (``_collapse_resume_frames``) from a
    break in an inlined ``forward``; a ``forward`` in the entry's file then
    matched in its place, while a child class in another file matched nothing
    and left the caller's stack at the head of the chain, where chains.py
    could not place it ([Trap] declined: callers not known)."""
    for i in range(len(frames) - 1, -1, -1):
        frame = frames[i]
        if frame.function == "trace_breaks" and os.path.realpath(frame.file) == _DISCOVERY_FILE:
            return tuple(frames[i + 1 :])
    if entry is not None:
        for i, frame in enumerate(frames):
            if (frame.file, frame.function) == entry:
                return tuple(frames[i:])
    return tuple(frames)


def parse_event(message: str, compile_id: str | None, entry: tuple[str, str] | None) -> BreakEvent | None:
    """Parse one ``graph_breaks`` log message; ``entry`` is the compiled
    entry's (file, function), used to cut the frames above the compiled call."""
    lines = message.splitlines()
    if not lines:
        return None
    head = _AT.search(lines[0])
    if head is None or "graph break" not in lines[0].lower():
        return None
    link = _GB_LINK.search(message)
    gb_id = f"GB{link.group(1)}" if link else None
    gb_type = graph_break_registry().get(gb_id or "", "")
    detail_lines: list[str] = []
    frames: list[Frame] = []
    in_tb = False
    pending: tuple[str, int, str] | None = None
    for raw in lines[1:]:
        if raw.startswith("User code traceback:"):
            in_tb = True
            continue
        if in_tb:
            match = _FRAME.match(raw)
            if match:
                if pending:
                    frames.append(Frame(pending[0], pending[1], pending[2], ""))
                pending = (match["file"], int(match["line"]), _function_name(match["func"]))
            elif pending and raw.strip() and set(raw.strip()) - set("^~ "):
                frames.append(Frame(pending[0], pending[1], pending[2], raw.strip()))
                pending = None
            continue
        text = raw.strip()
        if text.startswith("Graph Break Reason:"):
            text = text[len("Graph Break Reason:") :].strip()
            if text.startswith(_REASON_PREFIXES):
                continue
        if text and not text.startswith(("Hint:", "For more details")):
            detail_lines.append(text)
    if pending:
        frames.append(Frame(pending[0], pending[1], pending[2], ""))
    if not gb_type and detail_lines:
        gb_type = detail_lines[0]
    return BreakEvent(
        file=head["file"],
        line=int(head["line"]),
        gb_id=gb_id,
        gb_type=gb_type,
        detail="\n".join(detail_lines[:6]),
        frames=_below_the_call(frames, entry),
        compile_id=compile_id,
    )


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.items: list[tuple[str, str | None]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            cid = torch._guards.CompileContext.current_compile_id()
            self.items.append((record.getMessage(), str(cid) if cid is not None else None))
        except Exception:  # a handler must never raise into Dynamo
            pass


@contextlib.contextmanager
def _quiet_dynamo() -> Iterator[None]:
    """Hold back Dynamo's own warnings (its hints about .item() and untraceable
    builtins) while discovery runs; they describe the breaks discovery reports.
    Left alone when the user asked for torch logs with TORCH_LOGS."""
    if os.environ.get("TORCH_LOGS"):
        yield
        return
    log = logging.getLogger("torch._dynamo")
    saved = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"torch\._dynamo(\..*)?$")
            yield
    finally:
        log.setLevel(saved)


@contextlib.contextmanager
def _graph_break_log() -> Iterator[_Collect]:
    """Collect Dynamo's ``graph_breaks`` log, whatever the process's logging
    configuration says: for this logger only, and only for the block, it is
    enabled at every level (``logging.disable``, levels), not disabled, and
    without filters. Discovery must never read "no break logged" as "no break"."""
    from torch._dynamo import symbolic_convert
    from torch._dynamo import utils as dynamo_utils

    log = symbolic_convert.graph_break_log
    handler = _Collect()
    saved = (log.level, log.propagate, log.disabled, log.filters, vars(log).get("isEnabledFor"))
    checker = dynamo_utils.graph_break_dup_warning_checker
    had_add = "add" in vars(checker)
    saved_add = vars(checker).get("add")
    log.setLevel(logging.DEBUG)
    log.propagate = False
    log.disabled = False
    log.filters = []
    log.isEnabledFor = lambda level: True  # type: ignore[method-assign]
    log.addHandler(handler)
    checker.add = lambda key: True  # log every event with its full user stack
    collapse = getattr(symbolic_convert, "collapse_resume_frames", None)
    if collapse is not None:
        symbolic_convert.collapse_resume_frames = _collapse_resume_frames
    try:
        yield handler
    finally:
        if collapse is not None:
            symbolic_convert.collapse_resume_frames = collapse
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate, log.disabled, log.filters = saved[1], saved[2], saved[3]
        if saved[4] is None:
            del log.isEnabledFor
        else:
            log.isEnabledFor = saved[4]  # type: ignore[method-assign]
        if had_add:
            checker.add = saved_add
        else:
            del checker.add


def _collapse_resume_frames(stack: Any) -> Any:
    """Dynamo's ``collapse_resume_frames`` for the break log, folding only
    what it is meant to fold: a ``torch_dynamo_resume_in_<fn>`` frame into the
    frame of ``<fn>`` just above it. Dynamo's own merges *any* two adjacent
    frames of the same name, and it inlines a submodule's ``forward`` with no
    ``nn.Module.__call__`` frame between, so ``Parent.forward > Child.forward``
    was reported as ``Child.forward`` alone: the callers whose code runs after
    the call ([Trap] must check it, chains.py) went missing."""
    import traceback

    out = traceback.StackSummary()
    for frame in stack:
        if frame.filename is None:
            continue
        name = _function_name(frame.name)
        resumed = name != frame.name
        frame.name = name
        if resumed and out and (out[-1].name, out[-1].filename) == (name, frame.filename):
            out[-1] = frame
        else:
            out.append(frame)
    return out


def entry_of(fn: Callable[..., Any]) -> tuple[str, str] | None:
    """(file, function name) of the code Dynamo compiles first for ``fn``."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    target = getattr(target, "__func__", target)
    code = getattr(target, "__code__", None)
    if code is None:
        return None
    return (code.co_filename, code.co_name)


_STACK_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def node_origin(node: torch.fx.Node) -> tuple[str, int, str] | None:
    """(file, line, function) of the user line an FX node was traced from; a
    resume function is named after the function it resumes."""
    frames = _STACK_FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return None
    file, line, func = frames[-1]
    return file, int(line), _function_name(func)


def _captured_asserts(gm: torch.fx.GraphModule) -> tuple[tuple[str, int, str], ...]:
    """Asserts Dynamo turned into ``_assert_async`` (no break, but a compiled
    failure raises RuntimeError where eager raises AssertionError)."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and "_assert_async" in getattr(node.target, "__name__", str(node.target)):
            origin = node_origin(node)
            if origin:
                found.append(origin)
    return tuple(found)


def _scalar_asserts(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """Python ``assert`` statements on a captured scalar (``capture_scalar_outputs``):
    Dynamo defers them as runtime asserts on an unbacked symbol, which the
    compiled graph raises as ``RuntimeError`` (an int) or drops (a float, on
    torch 2.13), where eager raises ``AssertionError``. Told apart from
    ``torch._check`` and torch's own size checks by where Dynamo made them
    (its bytecode interpreter). Each as "`expr` (the value read at file:line)",
    the line of the node that made the symbol when the graph holds it."""
    context = torch._guards.TracingContext.try_get()
    shape_env = getattr(getattr(context, "fake_mode", None), "shape_env", None)
    made = getattr(shape_env, "deferred_runtime_asserts", None) or {}
    from_asserts = [ra for asserts in made.values() for ra in asserts if "symbolic_convert" in str(getattr(ra, "msg", ""))]
    if not from_asserts:  # every trace comes here: the graph is read only when there is something to place
        return ()
    origins = {}
    for node in gm.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        origin = node_origin(node) if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) else None
        if origin:
            origins.setdefault(str(value.node.expr), f"{os.path.basename(origin[0])}:{origin[1]}")
    found = []
    for ra in from_asserts:
        symbols = sorted(str(s) for s in getattr(ra.expr, "free_symbols", ()))
        where = [origins[s] for s in symbols if s in origins]
        found.append(f"`{ra.expr}`" + (f" (the value read at {', '.join(where)})" if where else ""))
    return tuple(found)


_TRACES = [0]  # calls of a model graphmend made under Dynamo in this process (made under the regions' lock)


def count_trace() -> None:
    """One more call of a model under Dynamo (``trace_breaks``, a compiled observation)."""
    _TRACES[0] += 1


def tally() -> tuple[int, int]:
    """(calls of a model graphmend made under Dynamo, frames Dynamo traced) so far in
    this process: what a pass cost in traces is the difference across it."""
    from torch._dynamo.utils import counters

    return _TRACES[0], counters["frames"].get("total", 0)


def _op_count(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))


def trace_breaks(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    calls: int = 1,
    grad: bool = False,
    dynamic: bool | None = False,
    inputs: list[tuple[tuple, dict]] | None = None,
    capture: tuple[str, ...] = (),
    speculating: bool = False,
    stage: Any = None,
) -> Trace:
    """Compile ``fn`` with a counting backend, call it, and collect every break.

    ``speculating``: call it as ``graphmend.compile`` calls a mending with
    [Speculate] sites (``runtime.call``), so their guesses are measured.
    ``stage``: the backend ``graphmend.compile`` compiles with, recording
    (``rewrite/fallback.FallbackBackend.recording``): the trace is made through
    it, with its ``dynamic``, and Dynamo's cache keeps what it traced for the
    first call to compile (reset at the end when the trace failed, or a graph
    could not be staged).

    ``inputs`` (a list of ``(args, kwargs)``) overrides ``args``/``kwargs`` and
    ``calls``: each entry is one call, so inputs that take different branches
    show the graphs each one adds. ``capture`` names ``torch._dynamo.config``
    flags (``capture_scalar_outputs``, ``capture_dynamic_output_shape_ops``)
    turned on for this run only. Exceptions raised by the compiled call
    propagate (the caller decides whether that is the user's problem).
    """
    kwargs = kwargs or {}
    calls_list = inputs if inputs is not None else [(args, kwargs)] * max(1, calls)
    trace = Trace()

    def record(gm: torch.fx.GraphModule) -> None:
        cid = torch._guards.CompileContext.current_compile_id()
        trace.graphs.append(
            GraphInfo(str(cid) if cid is not None else None, _op_count(gm), _captured_asserts(gm), _scalar_asserts(gm))
        )

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        record(gm)
        return gm.forward

    entry = entry_of(fn)
    from torch._dynamo.utils import counters

    frames_before = dict(counters["frames"])
    captured_before = counters["stats"]["calls_captured"]
    torch._dynamo.reset()
    start = time.perf_counter()
    grad_ctx = torch.enable_grad if grad else torch.no_grad
    count_trace()
    kept = False
    try:
        # Under the regions' lock: the capture flags and the break log are process-wide,
        # and graphmend.compile's calls in other threads must neither see nor change them.
        with contextlib.ExitStack() as stack:
            stack.enter_context(runtime.exclusive())
            collected = stack.enter_context(_graph_break_log())
            stack.enter_context(_quiet_dynamo())
            stack.enter_context(patched(capture))
            recording = None
            if stage is not None:
                recording = stack.enter_context(stage.recording(record))
                recording.held.append((fn, calls_list))  # kept alive with the graphs (rewrite/fallback.py)
                compiled = torch.compile(fn, backend=stage, dynamic=stage.dynamic)
            else:
                compiled = torch.compile(fn, backend=counting_backend, dynamic=dynamic)
            for a, k in calls_list:
                before = len(trace.graphs)
                # Inside a deferral region, as graphmend.compile calls it, so a
                # mended function is measured the way it will run.
                with grad_ctx():
                    if speculating:  # [Speculate] sites guess as under graphmend.compile
                        runtime.call(compiled, *a, **k)
                    else:
                        with runtime.region():
                            compiled(*a, **k)
                trace.graphs_per_call.append(len(trace.graphs) - before)
        kept = recording is not None and recording.complete  # else a graph ran as captured: not for the first call
    finally:
        trace.seconds = time.perf_counter() - start
        if not kept:
            torch._dynamo.reset()
    frames = counters["frames"]
    total = frames.get("total", 0) - frames_before.get("total", 0)
    ok = frames.get("ok", 0) - frames_before.get("ok", 0)
    trace.frames_skipped = max(0, total - ok)
    trace.calls_captured = counters["stats"]["calls_captured"] - captured_before
    seen_ids = set()
    for g in trace.graphs:
        if g.compile_id and g.compile_id not in seen_ids:
            seen_ids.add(g.compile_id)
            frame_id, _, recompile = g.compile_id.partition("/")
            if recompile.split("_")[0].isdigit() and int(recompile.split("_")[0]) > 0:
                trace.recompiles += 1
    for message, cid in collected.items:
        event = parse_event(message, cid, entry)
        if event is not None:
            trace.events.append(event)
    return trace


def innermost_user_frame(event: BreakEvent) -> Frame | None:
    """The innermost frame outside torch and the standard library."""
    for frame in reversed(event.frames):
        if not is_library_internal(frame.file):
            return frame
    if not is_library_internal(event.file):
        return Frame(event.file, event.line, "", "")
    return None


__all__ = [
    "BreakEvent",
    "Frame",
    "GraphInfo",
    "Trace",
    "count_trace",
    "entry_of",
    "innermost_user_frame",
    "is_library_internal",
    "parse_event",
    "tally",
    "trace_breaks",
]
