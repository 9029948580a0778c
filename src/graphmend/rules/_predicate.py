"""Lowering tensor tests shared by [Where] and [Trap]: Python ``and`` / ``or`` /
``not`` over tensor predicates become ``torch.logical_and/or/not`` (Python's
would convert each operand to bool, which breaks the graph)."""

from __future__ import annotations

import ast

from graphmend.analysis.facts import FunctionFacts, is_tensor_expr
from graphmend.analysis.purity import Emptiness, speculation_blockers
from graphmend.rules import Decline, RewriteContext


def is_not(node: ast.AST) -> bool:
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)


def tensor_atom(node: ast.expr, facts: FunctionFacts) -> bool:
    """Every operand of and/or/not is provably a tensor."""
    if isinstance(node, ast.BoolOp):
        return all(tensor_atom(v, facts) for v in node.values)
    if is_not(node):
        return tensor_atom(node.operand, facts)  # type: ignore[attr-defined]
    return is_tensor_expr(node, facts)


def has_boolops(node: ast.AST) -> bool:
    return any(isinstance(n, ast.BoolOp) or is_not(n) for n in ast.walk(node))


def check_lowerable(test: ast.expr, facts: FunctionFacts) -> None:
    if (isinstance(test, ast.BoolOp) or is_not(test)) and not tensor_atom(test, facts):
        raise Decline("and/or/not over values not all provably tensors")


def lower(node: ast.expr, facts: FunctionFacts, ctx: RewriteContext) -> ast.expr:
    """The test as one tensor expression (the node itself when it has no and/or/not)."""
    if isinstance(node, ast.BoolOp):
        fn = "logical_and" if isinstance(node.op, ast.And) else "logical_or"
        values = [lower(v, facts, ctx) for v in node.values]
        out = values[0]
        for v in values[1:]:
            out = ast.Call(func=ctx.torch(fn), args=[out, v], keywords=[])
        return out
    if is_not(node):
        operand = node.operand  # type: ignore[attr-defined]
        if not tensor_atom(operand, facts):
            raise Decline(f"`not` of `{ast.unparse(operand)}`, which is not provably a tensor")
        return ast.Call(func=ctx.torch("logical_not"), args=[lower(operand, facts, ctx)], keywords=[])
    if has_boolops(node):
        raise Decline("and/or nested inside another expression")
    return node


def guard_nonempty(empty: Emptiness, ctx: RewriteContext, guards: list[ast.expr]) -> None:
    """Append ``runtime.nonempty(name)`` to ``guards`` for each tensor the
    speculated code reduces only when it holds an element (``empty.needed``):
    an empty one takes the original branch instead."""
    for name in sorted(empty.needed):
        guard = ast.Call(func=ctx.runtime("nonempty"), args=[ast.Name(id=name, ctx=ast.Load())], keywords=[])
        if not any(ast.dump(g) == ast.dump(guard) for g in guards):
            guards.append(guard)


def deferred_blockers(node: ast.expr, facts: FunctionFacts, bound: set[str], empty: Emptiness | None = None) -> list[str]:
    """Blockers of the parts of a deferred message still evaluated in the graph
    (on every call, after the test)."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "__graphmend_rt__"
    ):
        out: list[str] = []
        for a in node.args:
            if isinstance(a, ast.Constant):
                continue
            out.extend(deferred_blockers(a, facts, bound, empty))
        return out
    if isinstance(node, ast.Tuple):
        return [r for e in node.elts for r in deferred_blockers(e, facts, bound, empty)]
    return speculation_blockers(node, facts, bound, empty)
