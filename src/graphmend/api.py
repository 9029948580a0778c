"""The Python API: ``mend``, ``compile``, ``unmend`` and the ``mended`` context.

``graphmend.compile(model, ...)`` is a drop-in for ``torch.compile``: it
mends the model (at once when ``example_inputs`` is given, else on the first
call, with that call's inputs), then returns ``torch.compile``'s own result
with two hooks on it that open and close the deferral region around every
call. The returned object *is* the compiled model (an ``OptimizedModule`` for
modules, a function for functions), with ``.report`` added. When mending
kept scalar / dynamic-output capture (``report.capture``, measured by
[Scalar]), the same hooks turn those ``torch._dynamo.config`` flags on around
every call, so the compiled program is the one that was measured.

Mending swaps the code of shared function objects: it affects every instance
of a mended class in the process until ``unmend``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from typing import Any, Iterator

import torch

from . import runtime
from .compat import check_environment
from .errors import UnsupportedEnvironment, describe
from .fallback import FallbackBackend, compile_kwargs
from .mend import DEFAULT_RULES, Mending, MendReport, mend_target
from .targets import target_from_objects
from .verify import quiet

_ACTIVE: dict[int, tuple[Any, Mending]] = {}
_LOCK = threading.Lock()


def _remember(key: Any, mending: Mending) -> None:
    with _LOCK:
        _ACTIVE[id(key)] = (key, mending)


def mend(model_or_fn: Any, *args: Any, **kwargs: Any) -> MendReport:
    """Mend ``model_or_fn`` in memory (no compile) using ``(*args, **kwargs)`` as
    example inputs; every rule, verification on. Returns the report; undo with
    ``graphmend.unmend(model_or_fn)``."""
    return _mend(model_or_fn, args, kwargs)


def _mend(
    model: Any,
    args: tuple,
    kwargs: dict,
    *,
    rules: tuple[str, ...] = DEFAULT_RULES,
    verify: bool = True,
    silent: bool = False,
) -> MendReport:
    check_environment()
    target = target_from_objects(model, args, kwargs)
    with quiet() if silent else contextlib.nullcontext():
        report, mending = mend_target(target, rules=tuple(rules), verify=verify)
    _remember(model, mending)
    report.undo = mending.undo  # type: ignore[attr-defined]
    internal = [o for o in report.outcomes if "internal error" in o.reason]
    if internal:  # the sites kept their original code; say so, once per mending
        warnings.warn(
            f"graphmend: an internal error declined {len(internal)} site(s), which keep their original code "
            f"(first: {internal[0].path}:{internal[0].line}: {internal[0].reason}); please report it",
            RuntimeWarning,
            stacklevel=3,
        )
    return report


def unmend(obj: Any = None) -> None:
    """Restore every original function mended for ``obj`` (a model, function,
    or the result of ``graphmend.compile``); with no argument, for everything."""
    with _LOCK:
        if obj is None:
            items = list(_ACTIVE.values())
            _ACTIVE.clear()
        else:
            key = getattr(obj, "_graphmend_source", obj)
            if isinstance(key, torch.nn.Module) and hasattr(key, "_orig_mod"):
                key = key._orig_mod
            entry = _ACTIVE.pop(id(key), None)
            items = [entry] if entry else []
    for _, mending in items:
        mending.undo()


@contextlib.contextmanager
def mended(model_or_fn: Any, *args: Any, **kwargs: Any) -> Iterator[MendReport]:
    """``with graphmend.mended(model, x) as report:`` mends, and restores on exit."""
    report = mend(model_or_fn, *args, **kwargs)
    try:
        yield report
    finally:
        unmend(model_or_fn)


def _split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if (
        isinstance(example_inputs, tuple)
        and len(example_inputs) == 2
        and isinstance(example_inputs[0], (tuple, list))
        and isinstance(example_inputs[1], dict)
    ):
        return tuple(example_inputs[0]), dict(example_inputs[1])
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


class _MendedModule(torch._dynamo.eval_frame.OptimizedModule):
    """torch.compile's OptimizedModule, plus ``.report``, with the deferral
    region opened and closed around the whole call.

    ``OptimizedModule`` forwards attribute writes to the wrapped model, which
    would shadow a model attribute named ``report``; a class attribute keeps
    the write on the wrapper. The region wraps ``__call__`` itself rather than
    forward hooks: when the forward raises after a trapped check failed, the
    region's exit must raise the trapped exception (it came first, as in
    eager), and torch silences exceptions raised by an always-called hook."""

    report = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        around = self.__dict__.get("_graphmend_around")
        if around is None:
            return super().__call__(*args, **kwargs)
        return around(super().__call__, args, kwargs)


def _call_region(report: MendReport | None) -> Any:
    """The deferral region, plus the capture flags the mending kept."""
    return report.region() if report is not None else runtime.region()


class _Regions(threading.local):
    def __init__(self) -> None:
        self.stack: list[Any] = []


def compile(
    model: Any,
    *,
    example_inputs: Any = None,
    rules: tuple[str, ...] = DEFAULT_RULES,
    verify: bool = True,
    **torch_compile_kwargs: Any,
) -> Any:
    """``torch.compile`` with graph breaks mended first.

    ``example_inputs``: a tuple of positional args, a dict of keyword args, or
    ``(args, kwargs)``; without it, the first call's inputs are used. The
    result carries ``.report`` (a :class:`MendReport`, None until mended).
    """
    try:
        check_environment()
    except UnsupportedEnvironment as exc:  # never fail where torch.compile alone would work
        warnings.warn(f"{exc.message}; compiling the model unchanged", RuntimeWarning, stacklevel=2)
        return torch.compile(model, **torch_compile_kwargs)
    state: dict[str, Any] = {"report": None, "holder": None, "tried": False}
    mend_lock = threading.Lock()

    def ensure_mended(args: tuple, kwargs: dict) -> None:
        if state["tried"]:
            return
        with mend_lock:
            if state["tried"]:
                return
            state["tried"] = True
            try:
                state["report"] = _mend(model, args, kwargs, rules=rules, verify=verify, silent=True)
            except Exception as exc:  # never fail where torch.compile alone would work
                unmend(model)
                warnings.warn(
                    f"graphmend: could not mend {type(model).__name__} ({describe(exc)}); "
                    "compiling it unchanged",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return
            if state["holder"] is not None:
                state["holder"].report = state["report"]

    if example_inputs is not None:
        ensure_mended(*_split_inputs(example_inputs))

    # Mended graphs are new to the backend: one it fails on runs as captured (fallback.py).
    kwargs = compile_kwargs(torch_compile_kwargs)
    inner = torch.compile(model, **kwargs)
    if isinstance(kwargs.get("backend"), FallbackBackend) and hasattr(inner, "get_compiler_config"):
        inner.get_compiler_config = kwargs["backend"].get_compiler_config  # what torch.compile's would say

    if isinstance(model, torch.nn.Module):
        regions = _Regions()

        def pre_hook(module: Any, args: tuple, kwargs: dict) -> None:
            ensure_mended(args, kwargs)
            region = _call_region(state["report"])
            region.__enter__()
            regions.stack.append(region)

        def post_hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            if regions.stack:
                regions.stack.pop().__exit__(None, None, None)

        def around(call: Any, args: tuple, kwargs: dict) -> Any:
            ensure_mended(args, kwargs)
            report = state["report"]
            if report is not None:
                return report.call(call, model, args, kwargs)
            with _call_region(report):
                return call(*args, **kwargs)

        if type(inner) is torch._dynamo.eval_frame.OptimizedModule:
            inner.__class__ = _MendedModule
            inner.__dict__["_graphmend_around"] = around
        else:  # another wrapper type: hooks (an exception in the forward wins over a trapped one)
            inner.register_forward_pre_hook(pre_hook, with_kwargs=True)
            inner.register_forward_hook(post_hook, with_kwargs=True, always_call=True)
        holder: Any = inner
    else:

        @functools.wraps(model)
        def holder(*args: Any, **kwargs: Any) -> Any:
            ensure_mended(args, kwargs)
            with _call_region(state["report"]):
                return inner(*args, **kwargs)

    holder.report = state["report"]
    if not isinstance(holder, torch.nn.Module):  # a module is found through ._orig_mod
        holder._graphmend_source = model
    state["holder"] = holder
    return holder
