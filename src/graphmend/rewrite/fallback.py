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
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

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
        return {**self.__dict__, "_compilers": {}}

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
