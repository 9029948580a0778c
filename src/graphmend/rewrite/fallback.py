"""The backend ``graphmend.compile`` hands to ``torch.compile``: yours, per graph,
with the captured graph run as it is when yours fails on it.

Mending joins code that graph breaks used to split, so a backend sees graphs
the original never produced. A backend can refuse one that eager Python runs:
under grad, AOTAutograd traces the backward of every output that requires
grad, and fails ("a variable needed for gradient computation has been modified
by an inplace operation") on an output whose history holds a tensor changed in
place later. Eager autograd only fails if that backward is ever run, and in
the original the break had cut the output out of the graph::

    s = h.amax()                  # AmaxBackward saves its result
    logger.info("norm %s", n)     # the break: s leaves graph 1, enters graph 2
    s.add_(1)                     # graph 2: s is a mutated input, no backward traced
    return h, s                   # the caller never uses s

Mended, the log is deferred and the three lines are one graph returning
``s``: ``aot_eager`` and Inductor fail to compile it. ``graphmend.compile``
must never fail where ``torch.compile`` alone works, so when the backend
raises on a graph, that graph runs as Dynamo captured it (what the ``eager``
backend does: the same ops, eager autograd) and a
:class:`BackendFallbackWarning` names it. The other graphs stay compiled.

Exceptions Dynamo turns into its own control flow (a graph break, a restart,
a skipped frame, an ``IndexError`` it shows as the user's) pass through.
``graphmend.with_fallback(backend)`` gives the same backend to a user who
mends with ``graphmend.mend`` and calls ``torch.compile`` themselves.

**Staged graphs.** Mending traces the model under Dynamo to see its breaks;
the last of those traces, of the code as finally installed, is the trace
``torch.compile`` would make on the first call. Made through this backend
(``recording``), its graphs are recorded and run as captured while mending
goes on, and Dynamo keeps them in its cache: the first call then finds them,
and each graph is compiled by the backend on its first run (``Staged``),
inside the tracing context and the global state (grad mode, autocast) Dynamo
compiled it in, so the backend sees what it would have seen during the
trace. A graph whose inputs have symbolic sizes, or share storage (a tensor
and a view of it), is compiled at once instead: the backend's compile then
adds guards (shape guards, AOTAutograd's aliasing guards) that Dynamo
installs when it returns. (Tied weights are one input: Dynamo passes a
tensor once.) A mend whose last trace is not of the final code (a rewrite
was taken back after it) resets Dynamo's cache instead (pipeline.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from typing import Any, Callable, Iterator

import torch

from graphmend.discover.trace import node_origin
from graphmend.errors import describe


class BackendFallbackWarning(RuntimeWarning):
    """The backend failed on a graph of mended code; that graph runs without it."""


def _pass_through() -> tuple[type[BaseException], ...]:
    from torch._dynamo import exc

    names = ("TensorifyScalarRestartAnalysis", "ShortenTraceback", "SkipFrame")
    kinds = tuple(getattr(exc, n) for n in names if hasattr(exc, n))
    return (*kinds, *exc.exceptions_allowed_to_be_fallback, IndexError)


class FallbackBackend:
    """A ``torch.compile`` backend: ``backend`` on each graph, the graph as
    captured where ``backend`` raises. ``failures`` lists (graph, error) seen.

    ``mode`` and ``options`` configure ``backend`` as ``torch.compile`` would
    (given here, the backend is built at once, as ``torch.compile`` builds
    Inductor's; given to ``torch.compile``, they arrive with the first graph)."""

    def __init__(
        self,
        backend: str | Callable[..., Any] | None = "inductor",
        dynamic: bool | None = None,
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.backend = "inductor" if backend is None else backend
        self.dynamic = dynamic
        self.__name__ = self.backend if isinstance(self.backend, str) else getattr(
            self.backend, "__name__", type(self.backend).__name__
        )
        self.failures: list[tuple[str, str]] = []
        self._on_graph: Callable[[torch.fx.GraphModule], None] | None = None  # while graphmend traces: ``recording``
        self._recording: Recording | None = None
        self.staged_seconds = 0.0  # spent compiling staged graphs (outside Dynamo's compile, which times its own)
        self.held: list[Any] = []  # the last recording's traced objects (``Recording.held``)
        self.compile_ahead = True  # ``recording(now=True)`` compiles a graph that cannot wait (a call follows)
        self._compilers: dict[str, Callable[[Any, Any], Any]] = {}
        self._preset: dict[str, Any] = {}  # what torch.compile passes a backend: mode / options when set
        if mode and mode != "default":
            self._preset["mode"] = mode
        if options:
            self._preset["options"] = options
        compiler = self._compiler(self._preset)
        # torch.compile asks Inductor's wrapper for its config at once (importing Inductor then)
        # and serves it as OptimizedModule.get_compiler_config(); graphmend.compile serves this.
        self.compiler_config = compiler.get_compiler_config() if hasattr(compiler, "get_compiler_config") else None

    def get_compiler_config(self) -> Any:
        return self.compiler_config

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``torch.save`` of a compiled model) without the built compilers:
        they are closures, rebuilt on the first graph after loading."""
        return {**self.__dict__, "_compilers": {}, "_on_graph": None, "_recording": None, "held": []}

    @contextlib.contextmanager
    def recording(self, on_graph: Callable[[torch.fx.GraphModule], None], now: bool = False) -> Iterator["Recording"]:
        """graphmend's own trace through this backend: each graph goes to ``on_graph``
        and runs as captured; its compile waits for its first run after the block
        (see the module doc). A graph that cannot wait (``_stageable``) is compiled
        at once with ``now`` (a trace likely to be the last), still run as captured
        until the block ends; else it makes the recording incomplete: what Dynamo
        cached for it must not be kept."""
        recording = Recording(now)
        self._on_graph, self._recording = on_graph, recording
        self.held = recording.held  # what the last recording traced stays alive (see ``Recording``)
        try:
            yield recording
        finally:
            self._on_graph, self._recording = None, None

    def _compiler(self, kwargs: dict[str, Any]) -> Callable[[Any, Any], Any]:
        """What ``torch.compile(backend=self.backend, mode=..., options=...)`` would call."""
        key = repr(sorted(kwargs.items()))
        if key not in self._compilers:
            if self.backend == "inductor":  # mode and options become Inductor config, as torch.compile does
                inductor = torch._TorchCompileInductorWrapper(kwargs.get("mode"), kwargs.get("options"), self.dynamic)
                self._compilers[key] = inductor
            else:
                from torch._dynamo.backends.registry import lookup_backend

                fn = lookup_backend(self.backend)
                self._compilers[key] = lambda gm, example_inputs: fn(gm, example_inputs, **kwargs)
        return self._compilers[key]

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        if self._on_graph is not None:
            self._on_graph(gm)
            if _stageable(example_inputs):
                return Staged(self, gm, example_inputs, kwargs)
            if self._recording is not None and self._recording.now and self.compile_ahead:  # in Dynamo's context
                return Staged(self, gm, example_inputs, kwargs, self.compile(gm, example_inputs, **kwargs))
            if self._recording is not None:
                self._recording.complete = False  # runs as captured: this trace's cache is not kept
            return gm.forward
        return self.compile(gm, example_inputs, **kwargs)

    def compile(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        """The backend's compile of ``gm``; ``gm`` as captured where it raises."""
        compiler = self._compiler({**self._preset, **kwargs})
        try:
            with warnings.catch_warnings():
                # AOTAutograd traces the backward in anomaly mode: one it cannot trace first warns
                # "Error detected in <Op>Backward0 ..."; the notice below says it once instead.
                warnings.filterwarnings("ignore", "Error detected in ", UserWarning, r"torch\.autograd")
                return compiler(gm, example_inputs)
        except _pass_through():  # Dynamo's own control flow
            raise
        except Exception as exc:
            error = describe(exc, limit=160)
            where = _graph_origin(gm)
            self.failures.append((where, error))
            warnings.warn(
                f"graphmend: the {self.__name__} backend failed on the graph of {where} ({error}); "
                "that graph runs as captured, without the backend",
                BackendFallbackWarning,
                stacklevel=2,
            )
            return gm.forward

    def reset(self) -> None:
        for compiler in self._compilers.values():
            if hasattr(compiler, "reset"):
                compiler.reset()


class Recording:
    """One trace through ``FallbackBackend.recording``: ``complete`` while every graph
    it made is ``Staged`` (its cache can stay for the first call); ``now``: a graph
    that cannot wait is compiled at once."""

    def __init__(self, now: bool = False) -> None:
        self.complete, self.now = True, now
        # The model copy and inputs traced: Dynamo drops a cache entry when an object it guards
        # by identity dies, so they live while the backend holds this recording's graphs.
        self.held: list[Any] = []


class Staged:
    """A graph Dynamo traced while graphmend recorded (``FallbackBackend.recording``):
    run as captured while the recording lasts, then compiled by the backend on its
    first run, in the context it was traced in."""

    def __init__(
        self, backend: FallbackBackend, gm: torch.fx.GraphModule, example_inputs: Any, kwargs: dict,
        compiled: Callable[..., Any] | None = None,
    ) -> None:
        self.backend, self.gm, self.compiled, self.lock = backend, gm, compiled, threading.Lock()
        waits = compiled is None  # else compiled already: only the graph as captured is kept, for the recording
        self.example_inputs, self.kwargs = (list(example_inputs), kwargs) if waits else ([], {})
        self.tracing = torch._guards.TracingContext.try_get() if waits else None
        self.compiling = torch._guards.CompileContext.try_get() if waits else None

    def __call__(self, *args: Any) -> Any:
        gm = self.gm
        if self.backend._on_graph is not None and gm is not None:  # graphmend's trace goes on: as captured
            return gm.forward(*args)
        compiled = self.compiled if self.compiled is not None else self._compile()
        self.gm = None  # (compiled: the graph as captured is not needed again)
        return compiled(*args)  # as Dynamo calls what a backend returns

    def _compile(self) -> Callable[..., Any]:
        with self.lock:
            if self.compiled is None:
                with contextlib.ExitStack() as stack:
                    if self.compiling is not None:
                        stack.enter_context(torch._guards.compile_context(self.compiling))
                    if self.tracing is not None:
                        stack.enter_context(torch._guards.tracing(self.tracing))
                        stack.enter_context(_global_state_of(self.tracing))
                    began = time.perf_counter()
                    self.compiled = self.backend.compile(self.gm, self.example_inputs, **self.kwargs)
                    self.backend.staged_seconds += time.perf_counter() - began
                self.gm, self.example_inputs, self.tracing, self.compiling = None, [], None, None  # type: ignore[assignment]
        return self.compiled


def _aliased(values: Any) -> bool:
    """Whether two tensors of ``values`` are one, or share storage."""
    seen: set[Any] = set()
    for value in values:
        if isinstance(value, torch.Tensor):
            key = _storage_of(value) or id(value)
            if key in seen:
                return True
            seen.add(key)
    return False


def _storage_of(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


# What Dynamo saves of the global state when it starts a trace (OutputGraph.save_global_state)
# and restores around the backend's compile, with how to read each now.
_GLOBAL_STATE: dict[str, Callable[[Any], Any]] = {
    "grad_enabled": lambda setter: torch.is_grad_enabled(),
    "autocast_enabled": lambda setter: torch.is_autocast_enabled(setter.args[0]),
    "autocast_cpu_enabled": lambda setter: torch.is_autocast_enabled("cpu"),
    "autocast_gpu_dtype": lambda setter: torch.get_autocast_dtype(setter.args[0]),
    "autocast_cpu_dtype": lambda setter: torch.get_autocast_dtype("cpu"),
    "autocast_cache_enabled": lambda setter: torch.is_autocast_cache_enabled(),
}


def _stageable(example_inputs: Any) -> bool:
    """Whether a graph's compile can wait for its first run: the global state Dynamo
    saves is one this module can put back, the trace made no symbol (a symbolic
    size, a captured scalar: the backend's compile adds guards on it) and no two
    inputs share storage (AOTAutograd adds guards on how they alias, and compiles
    them through a synthetic base of the inputs it saw)."""
    context = torch._guards.TracingContext.try_get()
    state = getattr(getattr(context, "global_context", None), "global_state", None)
    if context is None or state is None or not set(state) <= set(_GLOBAL_STATE):
        return False
    shape_env = getattr(getattr(context, "fake_mode", None), "shape_env", None)
    if shape_env is not None and getattr(shape_env, "var_to_range", None) != {}:
        return False  # a symbol, or a shape env this module cannot read
    plain = all(isinstance(v, (torch.Tensor, int, float, bool)) or v is None for v in example_inputs)
    return plain and not _aliased(example_inputs)


@contextlib.contextmanager
def _global_state_of(context: Any) -> Iterator[None]:
    """The global state Dynamo compiled in (``OutputGraph.restore_global_state``), for the block."""
    saved = context.global_context.global_state
    now = {key: (setter, _GLOBAL_STATE[key](setter)) for key, (setter, _) in saved.items()}
    try:
        for setter, value in saved.values():
            setter(value)
        yield
    finally:
        for setter, value in now.values():
            setter(value)


def _graph_origin(gm: torch.fx.GraphModule) -> str:
    """``fn (file:line)`` of the graph's first traced line, from the nodes' stack traces."""
    for node in gm.graph.nodes:
        origin = node_origin(node)
        if origin:
            path, line, fn = origin
            return f"{fn} ({os.path.basename(path)}:{line})"
    return "a mended function"


def with_fallback(
    backend: str | Callable[..., Any] | None = "inductor",
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    dynamic: bool | None = None,
) -> FallbackBackend:
    """``torch.compile(model, backend=graphmend.with_fallback("inductor"))``: ``backend`` on every
    graph, and a graph it fails on runs as captured (with a :class:`BackendFallbackWarning`).
    ``mode`` / ``options`` configure ``backend`` (or pass them to ``torch.compile``)."""
    return FallbackBackend(backend, dynamic, mode, options)


def compile_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` keyword arguments with the backend wrapped; the backend's ``mode`` and
    ``options`` move into the wrapper (``guard_filter_fn`` stays: it is Dynamo's). Left as they
    are: both ``mode`` and ``options`` (torch.compile refuses that itself) and AOTInductor."""
    mode, options = kwargs.get("mode"), kwargs.get("options")
    if isinstance(kwargs.get("backend"), FallbackBackend) or (mode is not None and options is not None):
        return kwargs
    if options is not None and (not isinstance(options, dict) or options.get("use_aoti")):
        return kwargs
    options = dict(options or {})
    dynamo_options = {k: options.pop(k) for k in ("guard_filter_fn",) if k in options}
    backend = FallbackBackend(kwargs.get("backend", "inductor"), kwargs.get("dynamic"), mode, options or None)
    out = {k: v for k, v in kwargs.items() if k not in ("mode", "options")}
    out["backend"] = backend
    if dynamo_options:
        out["options"] = dynamo_options
    return out
