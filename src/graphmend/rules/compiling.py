"""[Compiling] answer a compiler check as eager does, where the compiled path raises (category: CC).

## What it rewrites
A statement that asks whether the compiler is running, in a function on the
way to an exception that only the compiled model raises:

* ``torch.compiler.is_compiling()``, ``torch.compiler.is_dynamo_compiling()``,
  ``torch._dynamo.is_compiling()``, ``torch._utils.is_compiling()`` and
  transformers' ``is_torchdynamo_compiling()`` become ``False``, the answer
  every eager run gets.

## Why the original breaks
Code asks the question to leave out, under the compiler, work that would
break the graph. When what it leaves out is needed later, the compiled code
raises where eager does not (transformers 5's LongT5 builds no default
attention mask "if not is_torchdynamo_compiling()", then reads its shape):
Dynamo sees the exception escape ("Observed exception", GB0088), gives up
on every frame up to the entry and runs them eagerly, compiling only the
frames they call (8 graphs for one encoder-decoder call).

## Example
```python
if attention_mask is None and not is_torchdynamo_compiling():               # before
    attention_mask = torch.ones(batch_size, seq_length, device=device)

if attention_mask is None and not False:                                    # after
    attention_mask = torch.ones(batch_size, seq_length, device=device)
```

## When it declines
- no call in the statement is one of the checks above (a function of the
  same name that is something else: the name alone proves nothing);
- the check is called with arguments.

The sites are found only on the frame chains of an "Observed exception"
break: elsewhere a check usually keeps the compiler off a path that breaks.

## Fix safety
An eager run of the original answers ``False`` at every one of these checks,
so the rewritten code computes exactly what eager computes, compiled or not:
the reference graphmend verifies against. What changes is what the compiler
sees: the path eager takes. Where that path breaks the graph more than the
exception did, the mend leaves more graphs and is taken back (never worse).
``torch.export`` of a mended model also takes eager's path at the check.
"""

from __future__ import annotations

import ast
import sys
from typing import Any

from graphmend.analysis.source import compiler_checks, header_expr
from graphmend.rules import Decline, RewriteContext, Rule, register


def known_checks() -> list[Any]:
    """The compiler checks of the installed torch (and transformers, when imported)."""
    import torch
    import torch._dynamo
    import torch._utils

    found = [
        getattr(torch.compiler, "is_compiling", None),
        getattr(torch.compiler, "is_dynamo_compiling", None),
        getattr(torch._dynamo, "is_compiling", None),
        getattr(torch._utils, "is_compiling", None),
    ]
    transformers = sys.modules.get("transformers.utils.import_utils")
    found.append(getattr(transformers, "is_torchdynamo_compiling", None))
    return [f for f in found if f is not None]


@register
class Compiling(Rule):
    name = "compiling"
    categories = frozenset({"CC"})
    summary = "answer a compiler check as eager does where the compiled path raises"
    verdict = "[Compiling] take eager's path at the check: the path taken under the compiler raises"
    rank = 7
    style = "green"

    def rewrite(self, stmt: ast.stmt, ctx: RewriteContext) -> list[ast.stmt]:
        calls = compiler_checks(header_expr(stmt))
        if not calls:
            raise Decline("the statement asks no compiler check")
        checks = known_checks()
        proven = [c for c in calls if any(ctx.value_of(c.func) is check for check in checks)]
        if not proven:
            raise Decline(
                f"`{ast.unparse(calls[0].func)}` is not one of torch's or transformers' compiler checks "
                "(torch.compiler.is_compiling and the like)"
            )
        new = _Answer(proven).visit(stmt)
        ctx.notes.append(
            ", ".join(f"`{ast.unparse(c)}`" for c in proven) + " answered False, as in every eager run"
        )
        return [ast.fix_missing_locations(new)]


class _Answer(ast.NodeTransformer):
    """Replaces the given call nodes with ``False``."""

    def __init__(self, calls: list[ast.Call]) -> None:
        self.ids = {id(c) for c in calls}

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if id(node) in self.ids:
            return ast.copy_location(ast.Constant(False), node)
        return self.generic_visit(node)


__all__ = ["Compiling"]
