"""[Reassign] a refresh that stores what the attribute already holds (category: AS).

## What it rewrites
A statement that stores a module attribute computed from itself, the way
code keeps a cache on the input's device and dtype:

* ``self.<attr> = <expression reading self.<attr>>``
  (transformers' CTRL: ``self.pos_encoding = self.pos_encoding.to(device=device, dtype=...)``).

## Why the original breaks
Dynamo cannot trace the store of a tensor onto a module's buffer
(``Unsupported python_type() call``, GB4841), although ``.to()`` hands back
the very tensor it was called on whenever nothing needs converting, as on
every call after the first.

## Example
```python
self.pos_encoding = self.pos_encoding.to(device=device, dtype=x.dtype)       # before

_gm_value0 = self.pos_encoding.to(device=device, dtype=x.dtype)              # after
if _gm_value0 is not self.pos_encoding:
    self.pos_encoding = _gm_value0
```
Dynamo decides ``is not`` while tracing: when the value is the attribute's
own object there is no store and no break; when it is not (the first call on
another device or dtype), the store happens as before.

## When it declines
- the statement is not one store to ``self.<attr>`` of an expression that
  reads ``self.<attr>``;
- storing the object the attribute already holds could do something: a
  module running this function whose class overrides ``__setattr__``,
  ``__getattr__`` or ``__getattribute__``, or has a descriptor (a property)
  for the attribute; or a global module, parameter or buffer registration
  hook of ``torch.nn`` is installed (``nn.Module.__setattr__`` calls them
  for every store of such a value);
- the live model has no module that runs the function.

## Fix safety
``setattr(self, attr, value)`` with the value already there changes
nothing, so skipping it is exact; the expression is evaluated once, as
before, and the attribute read once more (a plain lookup, proven above).
"""

from __future__ import annotations

import ast
import inspect

from graphmend.analysis.effects import reassigned_attribute
from graphmend.rules import Decline, RewriteContext, Rule, register
from graphmend.rules._live import owners


@register
class Reassign(Rule):
    name = "reassign"
    categories = frozenset({"AS"})
    summary = "store an attribute refreshed from itself only when the value is a new object"
    verdict = "[Reassign] store only when the value is not the object the attribute holds"
    rank = 6
    style = "blue"

    def rewrite(self, stmt: ast.stmt, ctx: RewriteContext) -> list[ast.stmt]:
        attr = reassigned_attribute(stmt)
        if attr is None:
            raise Decline("not `self.<attr> = <expression reading self.<attr>>`")
        reason = _store_may_act(attr, ctx)
        if reason:
            raise Decline(f"storing the object the attribute already holds could do something: {reason}")
        value = ctx.fresh("value")
        target = stmt.targets[0]  # type: ignore[attr-defined]
        first = ast.Assign(targets=[ast.Name(id=value, ctx=ast.Store())], value=stmt.value)  # type: ignore[attr-defined]
        changed = ast.Compare(
            left=ast.Name(id=value, ctx=ast.Load()), ops=[ast.IsNot()],
            comparators=[ast.Attribute(value=ast.Name(id="self", ctx=ast.Load()), attr=attr, ctx=ast.Load())],
        )
        store = ast.Assign(targets=[target], value=ast.Name(id=value, ctx=ast.Load()))
        ctx.notes.append(f"`self.{attr}` stored only when the value is not the object it holds")
        new = [first, ast.If(test=changed, body=[store], orelse=[])]
        return [ast.fix_missing_locations(ast.copy_location(n, stmt)) for n in new]


def _store_may_act(attr: str, ctx: RewriteContext) -> str | None:
    """Why storing ``self.<attr>``'s own object again, or reading it, could act; None when it cannot."""
    import torch
    from torch.nn.modules import module as nn_module

    if not isinstance(ctx.model, torch.nn.Module):
        return "the target is not a module"
    running = owners(ctx.model, ctx.fdef, ctx.filename)
    if not running:
        return f"no module of the model runs `{ctx.fdef.name}`"
    for name in ("_global_module_registration_hooks", "_global_parameter_registration_hooks",
                 "_global_buffer_registration_hooks"):
        if getattr(nn_module, name, None):
            return f"a global registration hook is installed (torch.nn.modules.module.{name})"
    for cls in {type(m) for m in running}:
        for method in ("__setattr__", "__getattr__", "__getattribute__"):
            if getattr(cls, method) is not getattr(torch.nn.Module, method):
                return f"{cls.__name__} overrides {method}"
        if inspect.isdatadescriptor(inspect.getattr_static(cls, attr, None)):
            return f"{cls.__name__}.{attr} is a descriptor"
    return None


__all__ = ["Reassign"]
