"""What the live model holds, for the state scan (``_state.py``) and [Trap]:
attribute values over its modules, which classes run a function, how a
method is bound."""

from __future__ import annotations

import builtins
from typing import Any

from graphmend.rules import RewriteContext


def none_everywhere(ctx: RewriteContext, attr: str) -> bool:
    import torch

    model = ctx.model
    if not isinstance(model, torch.nn.Module):
        return False
    holders = [m for m in model.modules() if attr in vars(m)]
    return bool(holders) and all(vars(m)[attr] is None for m in holders)


def items(value: Any) -> list:
    import torch

    if isinstance(value, (torch.nn.ModuleList, torch.nn.Sequential, list, tuple)):
        return list(value)
    if isinstance(value, (torch.nn.ModuleDict, dict)):
        return list(value.values())
    return [value]


def bound_through_self(ctx: RewriteContext, attr: str) -> bool | None:
    """Whether ``self.<attr>(...)`` passes ``self`` as the first parameter
    (a method) or not (a staticmethod); None when the model's classes disagree."""
    import inspect

    import torch

    if not isinstance(ctx.model, torch.nn.Module):
        return None
    kinds = set()
    for module in ctx.model.modules():
        raw = inspect.getattr_static(type(module), attr, None)
        if raw is None:
            continue
        kinds.add("static" if isinstance(raw, staticmethod) else "method" if inspect.isfunction(raw) else "other")
    if kinds == {"static"}:
        return False
    if kinds == {"method"}:
        return True
    return None


def owners(model: Any, fdef: Any, filename: str) -> list:
    """The live modules of ``model`` whose class runs function ``fdef`` of ``filename``."""
    import torch

    from graphmend.analysis.source import first_line

    if not isinstance(model, torch.nn.Module):
        return []
    line = first_line(fdef)
    return [m for m in model.modules() if runs(type(m), fdef.name, line, filename)]


def own_attrs(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass in (BaseException, Exception, object) or getattr(builtins, klass.__name__, None) is klass:
            break
        names |= set(vars(klass))
    return names


def runs(cls: type, name: str, line: int, filename: str) -> bool:
    """Whether ``cls`` or a base (reached through ``super()``) defines method
    ``name`` from ``filename:line`` (under decorators that keep ``__wrapped__``,
    as transformers' ``forward`` methods have)."""
    import inspect
    import os

    for base in cls.__mro__:
        method = base.__dict__.get(name)
        try:
            method = inspect.unwrap(method) if method is not None else None
        except ValueError:  # a cycle of __wrapped__
            pass
        code = getattr(method, "__code__", None)
        if code is None or code.co_firstlineno != line:
            continue
        try:
            if os.path.samefile(code.co_filename, filename):
                return True
        except OSError:
            if code.co_filename == filename:
                return True
    return False
