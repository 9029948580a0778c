"""Targets: what the user hands graphmend.

One spelling, the same from the CLI and from Python:

``path/to/file.py:factory``
    a file; ``factory()`` returns ``(model, args)`` or ``(model, args, kwargs)``.
``package.module:factory``
    the same, from an importable module.
``demo``
    the bundled example model (``graphmend.models.demo``).
``zoo:NAME``
    a row of the paper's Table 2, built offline (``graphmend zoo`` lists them).
``hf:TYPE``
    any transformers text architecture, tiny with random weights (``tiny.py``).
``tv:NAME``, ``timm:NAME``
    a torchvision detection model or classifier, a timm model, random weights (``vision.py``).
``diffusers:NAME``
    a diffusers denoiser or autoencoder, tiny with random weights (``diffusion.py``).

A model is an ``nn.Module`` or a plain function. Every failure to load or
build a target is a :class:`~graphmend.errors.TargetError` with one line that
names the problem.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from graphmend.errors import EagerFailure, TargetError


@dataclass
class Target:
    name: str
    model: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    speculating: bool = False  # a [Speculate] site is installed: trace it as graphmend.compile calls it

    @property
    def kind(self) -> str:
        return "module" if isinstance(self.model, torch.nn.Module) else "function"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _load_file(path: str) -> types.ModuleType:
    if not os.path.exists(path):
        raise TargetError(f"no such file: {path}")
    if not os.path.isfile(path):
        raise TargetError(f"not a file: {path}")
    try:
        with open(path, "rb") as fh:
            compile(fh.read(), path, "exec")
    except SyntaxError as exc:
        raise TargetError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from exc
    name = "graphmend_target_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    if spec is None or spec.loader is None:
        raise TargetError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)  # sibling imports work as when the file is run
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise TargetError(f"importing {path} failed: {_one_line(exc)}") from exc
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass
    return module


def _load_module(dotted: str) -> types.ModuleType:
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as exc:
        if exc.name and dotted.startswith(exc.name):
            raise TargetError(f"no module named {dotted!r}") from exc
        raise TargetError(f"importing {dotted} failed: {_one_line(exc)}") from exc
    except Exception as exc:
        raise TargetError(f"importing {dotted} failed: {_one_line(exc)}") from exc


def _is_path(spec: str) -> bool:
    return spec.endswith(".py") or "/" in spec or os.sep in spec


def check_built(name: str, built: Any) -> Target:
    """Validate a factory's return value and wrap it as a Target."""
    if not isinstance(built, (tuple, list)) or len(built) not in (2, 3):
        raise TargetError(
            f"{name}: the factory must return (model, args) or (model, args, kwargs), "
            f"got {type(built).__name__}"
        )
    model, args = built[0], built[1]
    kwargs = built[2] if len(built) == 3 else {}
    check_model(name, model)
    if not isinstance(args, (tuple, list)):
        raise TargetError(f"{name}: args must be a tuple or list, got {type(args).__name__}")
    if not isinstance(kwargs, dict):
        raise TargetError(f"{name}: kwargs must be a dict, got {type(kwargs).__name__}")
    check_real(name, model, args, kwargs)
    return Target(name, model, tuple(args), dict(kwargs))


def check_real(name: str, model: Any, args: Any, kwargs: Any) -> None:
    """graphmend runs the model to find breaks and compares real values to
    verify: weights or inputs on the meta device cannot be run or compared."""
    tensors = list(model.parameters()) + list(model.buffers()) if isinstance(model, torch.nn.Module) else []
    leaves = list(args) + list(kwargs.values())
    while leaves:
        leaf = leaves.pop()
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
        elif isinstance(leaf, (tuple, list)):
            leaves.extend(leaf)
        elif isinstance(leaf, dict):
            leaves.extend(leaf.values())
    if any(t.is_meta for t in tensors):
        raise TargetError(
            f"{name}: weights or inputs are on the meta device; graphmend runs the model and compares real "
            "values, so materialise it first (model.to_empty(device=...) and load a state_dict)"
        )


def check_model(name: str, model: Any) -> None:
    if isinstance(model, torch.nn.Module):
        return
    if isinstance(model, (types.FunctionType, types.MethodType)):
        return
    raise TargetError(
        f"{name}: the model must be an nn.Module or a plain function, got {type(model).__name__}"
    )


def _call_factory(name: str, factory: Callable[[], Any]) -> Target:
    try:
        built = factory()
    except TargetError:
        raise
    except Exception as exc:
        raise TargetError(f"{name}: the factory raised {_one_line(exc)}") from exc
    return check_built(name, built)


# A prefix's builder, given the whole spelling: (module of graphmend.models, function), imported when used.
_BUILT = {
    "hf:": ("tiny", "build"), "tv:": ("vision", "build"), "timm:": ("vision", "build_timm"),
    "diffusers:": ("diffusion", "build"),
}


def load_target(spec: str) -> Target:
    """Resolve a target spelling (see the module doc) into a built Target."""
    spec = spec.strip()
    if not spec:
        raise TargetError("empty target; try 'demo', 'zoo:t5' or 'path/to/file.py:factory'")
    if spec == "demo":
        from graphmend.models import demo

        return _call_factory("demo", demo.build)
    if spec.startswith("zoo:"):
        from graphmend.models import zoo

        return _call_factory(spec, lambda: zoo.build(spec[4:]))
    for prefix, (module, builder) in _BUILT.items():
        if spec.startswith(prefix):
            build = getattr(importlib.import_module(f"graphmend.models.{module}"), builder)
            return _call_factory(spec, lambda: build(spec))
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise TargetError(
            f"target {spec!r} is not 'file.py:factory', 'package.module:factory', 'demo', 'zoo:NAME', 'hf:TYPE', 'tv:NAME', 'timm:NAME' or 'diffusers:NAME'"
        )
    module = _load_file(where) if _is_path(where) else _load_module(where)
    factory = getattr(module, attr, None)
    if factory is None:
        raise TargetError(f"{where} has no attribute {attr!r}")
    if not callable(factory):
        raise TargetError(f"{where}:{attr} is not callable")
    return _call_factory(spec, factory)


def target_from_objects(model: Any, args: tuple, kwargs: dict, name: str | None = None) -> Target:
    """A Target for objects passed from Python (``graphmend.explain(model, x)``)."""
    label = name or getattr(model, "__qualname__", None) or type(model).__name__
    check_model(label, model)
    check_real(label, model, args, kwargs)
    return Target(label, model, tuple(args), dict(kwargs))


def private_copy(target: Target) -> Target:
    """The same model and inputs, copied, so analysis runs never change the
    user's module state or input tensors. The copy shares the classes and
    functions (what mending rewrites); a model that cannot be copied is used
    as is, with its parameters and buffers restored afterwards by the caller."""
    import copy

    try:
        model = copy.deepcopy(target.model) if isinstance(target.model, torch.nn.Module) else target.model
        args, kwargs = copy.deepcopy(target.args), copy.deepcopy(target.kwargs)
    except Exception:
        return target
    return Target(target.name, model, args, kwargs)


def run_eager(target: Target, grad: bool = False) -> Any:
    """Run the target once eagerly; a failure is the user's problem, one line."""
    try:
        with torch.enable_grad() if grad else torch.no_grad():
            return target.model(*target.args, **target.kwargs)
    except Exception as exc:
        raise EagerFailure(f"{target.name}: the model fails in eager mode: {_one_line(exc)}") from exc
