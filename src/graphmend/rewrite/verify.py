"""Verification: does the mended target behave exactly like the original?

``observe`` runs a target eagerly on private copies of the model and the
inputs and records everything a user can see: the output, the exception
(type and message), the module state afterwards (parameters, buffers, tensor
and plain attributes), stdout and stderr text, log records (logger, level,
file, line, function, message) and warnings (category, message, file, line),
all in order. ``compare`` lists the differences between two observations;
an empty list means identical. Tensors compare bit for bit.

The mended side runs inside a deferral region, so that the deferred path
(snapshots, replay order, formatting at flush) is what gets checked.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from graphmend import runtime
from graphmend.discover.capture import patched
from graphmend.discover.trace import count_trace
from graphmend.discover.isolation import captured, random_state_kept, seed_everything
from graphmend.discover.weights import private
from graphmend.models.targets import Target

_ONCE_METHODS = ("warning_once", "info_once")
# Attributes torch.compile itself sets on a module: not the model's state.
_TORCH_ATTRS = frozenset({"_is_torch_compile", "_compiled_call_impl", "_torchdynamo_orig_callable", "_torchdynamo_inline"})
# Where the compiler's own warnings come from ("Dynamo detected a call to a
# `functools.lru_cache`-wrapped function"): torch.compile's, not the model's.
_TORCH_DIR = os.path.realpath(os.path.dirname(torch.__file__))
_COMPILER_DIRS = tuple(
    os.path.join(_TORCH_DIR, *part.split("/")) + os.sep
    for part in ("_dynamo", "_inductor", "_functorch", "_subclasses", "_higher_order_ops", "fx", "utils/_sympy")
)


@dataclass
class Observation:
    output: Any = None
    exception: tuple[str, str] | None = None
    state: dict[str, Any] = field(default_factory=dict)
    stdout: str = ""
    stderr: str = ""
    records: list[tuple] = field(default_factory=list)
    warnings: list[tuple] = field(default_factory=list)
    staged: bool = False  # a compiled run through a recording backend, its trace kept in Dynamo's cache


@contextlib.contextmanager
def fresh_once_caches():
    """Give once-only logger methods (transformers' ``warning_once``) a private
    cache for the duration: analysis runs neither see the user's earlier
    messages as already logged nor swallow the user's next one."""
    saved = {}
    for name in _ONCE_METHODS:
        method = vars(logging.Logger).get(name)
        raw = getattr(method, "__wrapped__", None)
        if raw is not None and hasattr(method, "cache_clear"):
            saved[name] = method
            setattr(logging.Logger, name, functools.lru_cache(None)(raw))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(logging.Logger, name, method)


@contextlib.contextmanager
def quiet():
    """Hold back what analysis runs of the user's model print, log and warn on
    this thread: they are extra runs, not the user's calls (other threads'
    output is untouched; isolation.py)."""
    with captured():
        yield


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of an output, in order: a tensor, dicts (``ModelOutput``),
    tuples and lists of them, and the attributes of a plain object."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if hasattr(value, "__dict__") and not callable(value):
        return [t for v in vars(value).values() for t in tensors_in(v)]
    return []


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        new = copy.copy(value)
        for key in list(value.keys()):
            new[key] = _detach(value[key])
        return new
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_detach(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_detach(v) for v in value)
    return value


def module_state(model: Any, held: Callable[[torch.Tensor], bool] = lambda t: False) -> dict[str, Any]:
    """Parameters, buffers and plain attributes of every submodule, each tensor
    copied except where ``held`` says it keeps its values (a parameter shared
    with the user's model that the run did not write: discover/weights.py)."""
    if not isinstance(model, torch.nn.Module):
        return {}
    state: dict[str, Any] = {
        f"tensor:{k}": v.detach() if held(v) else v.detach().clone()
        for k, v in model.state_dict(keep_vars=True).items()
    }
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules") or key in _TORCH_ATTRS or "hook" in key:
                continue
            label = f"attr:{name}.{key}" if name else f"attr:{key}"
            if isinstance(value, torch.Tensor):
                state[label] = value.detach().clone()
            elif isinstance(value, (int, float, str, bool, type(None))):
                state[label] = value
            elif isinstance(value, tuple) and all(isinstance(v, (int, float, str, bool, type(None))) for v in value):
                state[label] = value
    return state


def observe(
    model: Any,
    args: tuple,
    kwargs: dict,
    *,
    in_region: bool,
    grad: bool = False,
    copy_model: bool = True,
    seed: int = 0,
    compiled: tuple[str, ...] | None = None,
    backend: Any = "eager",
    speculating: bool = False,
) -> Observation:
    """Run ``model(*args, **kwargs)`` eagerly on copies and record what is observable.

    ``compiled``: run it through ``torch.compile`` instead (the eager backend,
    so only Dynamo's capture differs from eager; or ``backend``), with those
    capture flags on, inside a region: what the kept flags do to the program
    as it will run. ``speculating``: in a speculating call (``runtime.call``),
    as ``graphmend.compile`` calls a model with [Speculate] sites.
    Warnings the compiler itself issues (from Dynamo, Inductor, FX, ...) are
    left out of that observation: torch.compile's, not the model's. A
    ``backend`` that records (graphmend.compile's, rewrite/fallback.py) runs
    each graph as captured, and what Dynamo traced stays in its cache for the
    first call (``obs.staged``) unless a graph could not be staged."""
    obs = Observation()
    recording = None
    region: Callable[[], Any] = runtime.region if in_region or compiled is not None else contextlib.nullcontext
    grad_ctx = torch.enable_grad if grad else torch.no_grad
    with contextlib.ExitStack() as stack:
        held: Callable[[torch.Tensor], bool] = lambda t: False
        if copy_model:  # a copy sharing the parameters (discover/weights.py), and copied inputs
            own = stack.enter_context(private(Target("the model", model, args, kwargs)))
            subject, call_args, call_kwargs = own.model, own.args, own.kwargs
            held = getattr(own, "untouched", held)
        else:
            subject, call_args, call_kwargs = model, copy.deepcopy(args), copy.deepcopy(kwargs)
        called = subject
        if compiled is not None:
            torch._dynamo.reset()
            if hasattr(backend, "recording"):
                recording = stack.enter_context(backend.recording(lambda gm: None, now=True))
                recording.held.append((subject, call_args, call_kwargs))  # alive with the graphs (fallback.py)
                called = torch.compile(subject, backend=backend, dynamic=backend.dynamic)
            else:
                called = torch.compile(subject, backend=backend)
            count_trace()
        stack.enter_context(random_state_kept())
        seed_everything(seed)
        effects = stack.enter_context(captured())
        stack.enter_context(grad_ctx())
        try:
            if speculating and compiled is not None:
                with patched(compiled):
                    result = runtime.call(called, *call_args, **call_kwargs)
            else:
                with region(), patched(compiled or ()):  # the flags inside the region, as MendReport.region
                    result = called(*call_args, **call_kwargs)
            obs.output = _detach(result)
        except Exception as exc:  # the exception is part of the behaviour
            obs.exception = (type(exc).__qualname__, str(exc))
        obs.state = module_state(subject, held)  # before what the run wrote of the shared weights is put back
    obs.stdout, obs.stderr = effects.stdout.getvalue(), effects.stderr.getvalue()
    obs.records, obs.warnings = effects.records, effects.warnings
    if compiled is not None:
        obs.warnings = [w for w in obs.warnings if not _is_compilers(w[2])]
    obs.staged = recording is not None and recording.complete and obs.exception is None
    if compiled is not None and not obs.staged:
        torch._dynamo.reset()
    return obs


def _is_compilers(path: str) -> bool:
    return isinstance(path, str) and os.path.realpath(path).startswith(_COMPILER_DIRS)


# --------------------------------------------------------------------------
# comparison


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.layout != torch.strided or b.layout != torch.strided:
        return bool(torch.equal(a.to_dense(), b.to_dense()))
    # reshape(-1): a 0-dim tensor cannot be viewed as bytes, a 1-element one can.
    a, b = a.detach().contiguous().cpu().reshape(-1), b.detach().contiguous().cpu().reshape(-1)
    if a.dtype == torch.bool:
        return bool(torch.equal(a, b))
    try:
        return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
    except RuntimeError:
        return bool(torch.equal(a, b))


def _diff_values(a: Any, b: Any, path: str, out: list[str], depth: int = 0) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            out.append(f"{path}: tensor vs {type(b).__name__ if isinstance(a, torch.Tensor) else type(a).__name__}")
        elif not _bits_equal(a, b):
            if a.shape != b.shape or a.dtype != b.dtype:
                out.append(f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
            else:
                delta = (a.double() - b.double()).abs().nan_to_num(nan=math.inf).max().item() if a.numel() else 0.0
                out.append(f"{path}: values differ (max abs diff {delta:.3g})")
        return
    if type(a) is not type(b):
        out.append(f"{path}: {type(a).__name__} vs {type(b).__name__}")
        return
    if isinstance(a, dict):
        if list(a.keys()) != list(b.keys()):
            out.append(f"{path}: keys {list(a.keys())} vs {list(b.keys())}")
            return
        for k in a:
            _diff_values(a[k], b[k], f"{path}.{k}", out, depth)
        return
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} vs {len(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _diff_values(x, y, f"{path}[{i}]", out, depth)
        return
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return
    if depth < 4 and hasattr(a, "__dict__") and not isinstance(a, (type, torch.nn.Module)) and not callable(a):
        _diff_values(vars(a), vars(b), path, out, depth + 1)  # e.g. a transformers Cache: compare its fields
        return
    try:
        same = a == b
        same = bool(same)
    except Exception:
        same = a is b
    if not same:
        out.append(f"{path}: {a!r} vs {b!r}")


def compare(original: Observation, mended: Observation, memo_attrs: Any = frozenset()) -> list[str]:
    """Differences, one line each; empty when the behaviour is identical.

    ``memo_attrs``: attribute names a rewrite declared as private memo state
    it may create early (reported with the rewrite); their presence on the
    mended side alone is not a difference."""
    out: list[str] = []
    if original.exception != mended.exception:
        out.append(f"exception: {original.exception} vs {mended.exception}")
    _diff_values(original.output, mended.output, "output", out)
    extra = {k for k in set(mended.state) - set(original.state) if k.rsplit(".", 1)[-1].split(":")[-1] in memo_attrs}
    mended_keys = set(mended.state) - extra
    if set(original.state) != mended_keys:
        only_a = sorted(set(original.state) - mended_keys)
        only_b = sorted(mended_keys - set(original.state))
        out.append(f"module state: attributes only in the original {only_a}, only when mended {only_b}")
    else:
        for key in original.state:
            _diff_values(original.state[key], mended.state[key], key, out)
    if original.stdout != mended.stdout:
        out.append(f"stdout: {original.stdout!r} vs {mended.stdout!r}")
    if original.stderr != mended.stderr:
        out.append(f"stderr: {original.stderr!r} vs {mended.stderr!r}")
    if original.records != mended.records:
        out.append(f"log records: {original.records} vs {mended.records}")
    if original.warnings != mended.warnings:
        out.append(f"warnings: {original.warnings} vs {mended.warnings}")
    return out


def relocated_by_compile(eager: Observation, compiled: Observation, memo_attrs: Any = frozenset()) -> bool:
    """Whether ``compiled`` (a run through torch.compile) differs from ``eager``
    only in where torch's own warnings say they come from: the same warnings in
    the same order, each one whose place differs issued from a frame inside
    torch. Compiled code enters what the model entered (autocast, whose "target
    dtype is not supported" names the model's line eagerly and torch's
    autocast_mode.py compiled); the user reads the same text."""
    pairs = list(zip(eager.warnings, compiled.warnings))
    if len(eager.warnings) != len(compiled.warnings) or any(a[:2] != b[:2] for a, b in pairs):
        return False
    if not all(a == b or _in_torch(b[2]) for a, b in pairs):
        return False
    return not compare(dataclasses.replace(eager, warnings=compiled.warnings), compiled, memo_attrs)


def _in_torch(path: Any) -> bool:
    return isinstance(path, str) and os.path.realpath(path).startswith(_TORCH_DIR + os.sep)
