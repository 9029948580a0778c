"""Lowering tensor tests shared by [Where] and [Trap]: Python ``and`` / ``or`` /
``not`` over tensor predicates become ``torch.logical_and/or/not`` (Python's
would convert each operand to bool, which breaks the graph). Where an operand
is not provably a tensor (a name assigned more than once, a parameter), the
runtime's ``tensor_and/or/not`` decide while tracing: the tensor result when
every operand is a tensor, else None, which no guard accepts, so the test runs
as written. Either way every operand is evaluated: the rules check that with
``speculation_blockers`` first."""

from __future__ import annotations

import ast
import copy

from graphmend.analysis.dtypes import KINDS
from graphmend.analysis.facts import FunctionFacts, is_tensor_expr
from graphmend.analysis.purity import Emptiness, speculation_blockers
from graphmend.rules import Decline, RewriteContext
from graphmend.rules._ast import all_of, assign_to, load_name, store_name


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


def is_static_test(node: ast.expr, facts: FunctionFacts) -> bool:
    """A test Dynamo decides while tracing: metadata comparisons, ``is`` tests,
    flags and ``hasattr``/``isinstance``, with no tensor value in it."""
    if is_tensor_expr(node, facts):
        return False
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            if not (
                isinstance(func, ast.Name) and func.id in ("hasattr", "isinstance", "len")
                or isinstance(func, ast.Attribute) and func.attr in ("dim", "size", "numel", "is_floating_point")
            ):
                return False
        if isinstance(sub, ast.Attribute) and sub.attr in ("sum", "any", "all", "item", "max", "min"):
            return False
    return True


def may_guard(node: ast.expr) -> bool:
    """A static test that can protect what follows it from an error the rules do not
    check for: ``x is None``, ``isinstance`` / ``hasattr`` / ``callable``, an object's
    truth (``mask and ...``). Metadata comparisons (``h.dim() > 2``, ``h.dtype ==
    torch.float16``) are not: what they could protect (an index, a reduction of an
    empty tensor) ``speculation_blockers`` checks in the operands after them."""
    if is_not(node):
        return may_guard(node.operand)  # type: ignore[attr-defined]
    if isinstance(node, (ast.Name, ast.Attribute)):
        return True
    for sub in ast.walk(node):
        if isinstance(sub, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for op in sub.ops):
            return True
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in ("isinstance", "hasattr", "callable"):
            return True
    return False


def needs_runtime(test: ast.expr, facts: FunctionFacts) -> bool:
    """Whether ``lower`` gives ``test`` to the runtime's ``tensor_and/or/not``
    (which may answer None: the original must then evaluate the test itself)."""
    return has_boolops(test) and not tensor_atom(test, facts)


def lower(node: ast.expr, facts: FunctionFacts, ctx: RewriteContext) -> ast.expr:
    """The test as one tensor expression (the node itself when it has no and/or/not)."""
    if isinstance(node, ast.BoolOp):
        if not tensor_atom(node, facts):
            values = []
            for index, value in enumerate(node.values):
                if index < len(node.values) - 1 and is_static_test(value, facts) and may_guard(value):
                    values.append(_guarded_rest(node, index, facts, ctx))
                    break
                values.append(lower(value, facts, ctx))
            if len(values) == 1:
                return values[0]
            fn = "tensor_and" if isinstance(node.op, ast.And) else "tensor_or"
            return ast.Call(func=ctx.runtime(fn), args=values, keywords=[])
        values = [lower(v, facts, ctx) for v in node.values]
        fn = "logical_and" if isinstance(node.op, ast.And) else "logical_or"
        out = values[0]
        for v in values[1:]:
            out = ast.Call(func=ctx.torch(fn), args=[out, v], keywords=[])
        return out
    if is_not(node):
        operand = node.operand  # type: ignore[attr-defined]
        func = ctx.torch("logical_not") if tensor_atom(operand, facts) else ctx.runtime("tensor_not")
        return ast.Call(func=func, args=[lower(operand, facts, ctx)], keywords=[])
    if has_boolops(node):
        raise Decline("and/or nested inside another expression")
    return node


def _guarded_rest(node: ast.BoolOp, index: int, facts: FunctionFacts, ctx: RewriteContext) -> ast.expr:
    """``x is not None and x.sum() > 0`` from the static guard at ``index`` on: what
    follows it evaluated only where the guard lets the original evaluate it,
    ``(x.sum() > 0) if x is not None else False`` (``or``: ``True if g else ...``),
    decided while tracing. A Python bool takes the original branch."""
    rest = node.values[index + 1 :]
    after = lower(rest[0] if len(rest) == 1 else ast.BoolOp(op=node.op, values=rest), facts, ctx)
    guard = copy.deepcopy(node.values[index])
    if isinstance(node.op, ast.And):
        return ast.IfExp(test=guard, body=after, orelse=ast.Constant(False))
    return ast.IfExp(test=guard, body=ast.Constant(True), orelse=after)


def add_guards(empty: Emptiness, ctx: RewriteContext, guards: list[ast.expr]) -> None:
    """Append to ``guards`` ``runtime.nonempty(name)`` for each tensor the
    speculated code reduces only when it holds an element (``empty.needed``),
    and ``runtime.has_dims(name, n)`` for each it indexes the shape of
    (``empty.dims``), and ``runtime.is_kind(name, ...)`` for each whose dtype
    an operation needs confined (``empty.kinds``: ``h - 1`` raises on bool): an
    empty tensor, one with fewer dimensions or of another dtype kind takes the
    original statement instead; likewise ``runtime.broadcastable(a, b)`` /
    ``broadcasts_to(mask, h)`` for shapes the speculated code combines
    (``empty.broadcasts``)."""
    found = [ast.Call(func=ctx.runtime("nonempty"), args=[ast.Name(id=n, ctx=ast.Load())], keywords=[]) for n in sorted(empty.needed)]
    found += [
        ast.Call(func=ctx.runtime("has_dims"), args=[ast.Name(id=n, ctx=ast.Load()), ast.Constant(count)], keywords=[])
        for n, count in sorted(empty.dims.items())
    ]
    found += [
        ast.Call(
            func=ctx.runtime("is_kind"),
            args=[ast.parse(key, mode="eval").body, *(ast.Constant(k) for k in KINDS if k in kinds)],
            keywords=[],
        )
        for key, kinds in sorted(empty.kinds.items())
    ]
    found += [
        ast.Call(func=ctx.runtime(check), args=[ast.parse(k, mode="eval").body for k in (a, b) if k], keywords=[])
        for check, a, b in sorted(empty.broadcasts)
    ]
    for guard in found:
        if not any(ast.dump(g) == ast.dump(guard) for g in guards):
            guards.append(guard)


def pre_guarded(ctx: RewriteContext, pre: list[ast.expr]) -> tuple[ast.stmt, str]:
    """``_gm_ok = guard and ...``: the guards a speculated test needs (``add_guards``),
    evaluated before it, and the name holding them; ``when_ok`` evaluates the test
    only where they hold (else None, which no check accepts: the original runs it)."""
    ok = ctx.fresh("ok")
    return assign_to(store_name(ok), all_of(pre)), ok


def when_ok(ok: str, test: ast.expr) -> ast.expr:
    """``test if _gm_ok else None`` (``pre_guarded``)."""
    return ast.IfExp(test=load_name(ok), body=test, orelse=ast.Constant(None))


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


_ITEM_TESTS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq)


def item_test(test: ast.expr, ctx: RewriteContext) -> ast.expr | None:
    """``runtime.item_of(t, c) > c`` for ``t.item() > c`` (``c`` a numeric constant
    or a name, maybe negated; either side; one comparison): ``item_of`` keeps
    ``t`` a 0-dim tensor while tracing where ``c`` is a Python number exact in
    its dtype, so the test is a tensor test; else it is ``t.item()``, as
    written. A name is read twice, which reading a local cannot tell."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], _ITEM_TESTS)):
        return None
    left, right = test.left, test.comparators[0]
    for item, other in ((left, right), (right, left)):
        constant = other.operand if isinstance(other, ast.UnaryOp) and isinstance(other.op, ast.USub) else other
        number = isinstance(constant, ast.Constant) and type(constant.value) in (int, float)
        if is_item_call(item) and (number or isinstance(constant, ast.Name)):
            call = ast.Call(func=ctx.runtime("item_of"), args=[copy.deepcopy(item.func.value), copy.deepcopy(other)], keywords=[])  # type: ignore[attr-defined]
            sides = [call, copy.deepcopy(other)] if item is left else [copy.deepcopy(other), call]
            out = ast.Compare(left=sides[0], ops=[copy.deepcopy(test.ops[0])], comparators=[sides[1]])
            return ast.fix_missing_locations(ast.copy_location(out, test))
    return None


def is_item_call(node: ast.AST) -> bool:
    """``t.item()``."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "item" and not node.args and not node.keywords
