"""[Speculate] a host value that steers Python control flow (category: TI).

## What it rewrites
``name = <tensor>.item()`` whose value decides Python control flow (an
``if`` that changes shapes, as Longformer's ``is_global_attn``), when no
[Scalar] source pattern applies. It runs after the other rules, on the sites
they left (passes/speculation.py).

## Why the original breaks
``.item()`` reads a tensor's value on the host: a break (GB0124). With
``capture_scalar_outputs`` the value is an unbacked symbol, and the ``if``
on it breaks again (data-dependent guard); ``torch.cond`` cannot take
branches whose shapes differ.

## Example
```python
is_global_attn = is_index_global_attn.flatten().any().item()          # before
is_global_attn = __graphmend_rt__.speculate(site, is_index_global_attn.flatten().any())  # after
```
Compiled inside ``graphmend.compile``, ``speculate`` returns the value the
site had last time as a Python constant: Dynamo guards on it and compiles
the code for that value, with no break; the tensor's actual value is
recorded. When the call ends, the records are checked before any deferred
effect is performed: a wrong guess discards the call's records and runs the
call again with the right value (one more compile per value, as the
original's break would have specialised too). Eagerly, and outside a
speculating call, it is ``.item()``.

## When it declines
- the statement is not ``name = <expr>.item()``;
- running the call twice could be seen: code reachable from the model's
  entry changes state (attribute stores, in-place ops on anything but its own
  fresh tensors, modules whose code does), or the scan cannot resolve a call
  ([Trap]'s scan, strict). A print / warn / log no rule rewrote is not a
  reason: in a speculating call the runtime stops the run before it. Branches
  taken only in training mode are not scanned: a call speculates only when
  every module is in eval mode.

## Fix safety
A call runs again only when a guess was wrong (or it raised while guessing:
then it runs once more without guessing), with the random state restored and
nothing of the first run performed. Only bool and integer values are
guessed; a float goes through ``.item()`` as before.
"""

from __future__ import annotations

import ast

from graphmend.analysis.source import definition_of
from graphmend.rules import Decline, RewriteContext, Rule, register
from graphmend.rules._state import StateScan


@register
class Speculate(Rule):
    name = "speculate"
    categories = frozenset()  # not claimed by category: passes/speculation.py offers it the TI sites [scalar] left
    offered = "TI, after scalar"
    summary = "guess a host value that steers control flow; check it when the call ends, run again if wrong"
    rank = 5
    passes = ("speculation",)

    def rewrite(self, stmt: ast.stmt, ctx: RewriteContext) -> list[ast.stmt]:
        if not (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Attribute)
            and stmt.value.func.attr == "item"
            and not stmt.value.args
            and not stmt.value.keywords
        ):
            raise Decline("not `name = <tensor>.item()`")
        blocker = reexecution_blocker(ctx)
        if blocker:
            raise Decline(f"running the call again could be seen: {blocker}")
        call = ast.Call(func=ctx.runtime("speculate"), args=[ctx.site(stmt), stmt.value.func.value], keywords=[])
        new = ast.Assign(targets=stmt.targets, value=ast.copy_location(call, stmt.value))
        ctx.notes.append(
            f"`{stmt.targets[0].id}` speculated under graphmend.compile (or graphmend.runtime.call): compiled for "
            "the value it had last, checked when the call ends"
        )
        return [ast.copy_location(new, stmt)]


def reexecution_blocker(ctx: RewriteContext) -> str | None:
    """Why running the model's call twice could be observed, or None."""
    import inspect

    import torch

    model = ctx.model
    if not isinstance(model, torch.nn.Module):
        return "the target is not a module"
    forward = inspect.unwrap(type(model).forward)
    code = getattr(forward, "__code__", None)
    fdef = definition_of(code) if code is not None else None
    if fdef is None:
        return "the model's forward source was not found"
    # An effect that was not deferred is accepted as [Trap] accepts it: in a
    # speculating call the runtime stops the run before it (runtime.call).
    return StateScan.in_call(fdef, code.co_filename, forward.__globals__, ctx)


__all__ = ["Speculate", "reexecution_blocker"]
