"""The select of [Where]: the arms of an ``if/elif/.../else`` chain, when each
runs, the nested ``torch.where`` that picks among them, and under autograd the
gates that keep a branch not taken from changing gradients
(``analysis/gradients.py``). Part of the [Where] rule (where.py)."""

from __future__ import annotations

import ast
import builtins
import copy
import types
from typing import Callable

from graphmend.analysis.facts import FunctionFacts
from graphmend.analysis.gradients import block_reach, signs_kept
from graphmend.analysis.source import RUNTIME_NAME, is_runtime_call
from graphmend.rules import RewriteContext
from graphmend.rules._ast import assign_to, is_self_attr, load_name, store_name

Arm = tuple[str | None, list[ast.stmt]]  # (the name the test is bound to, None for the else; the branch)


def arms(stmt: ast.If, ctx: RewriteContext) -> list[tuple[ast.expr | None, list[ast.stmt]]]:
    """``if t0: B0 elif t1: B1 ... else: E`` -> ``[(t0, B0), (t1, B1), ..., (None, E)]``.
    An ``elif`` an earlier site of this pass already rewrote is read as the original."""
    found: list[tuple[ast.expr | None, list[ast.stmt]]] = []
    node: ast.stmt | None = stmt
    while isinstance(node, ast.If):
        found.append((node.test, node.body))
        inner = ctx.original_of(node.orelse)
        if not isinstance(inner, ast.If):
            found.append((None, node.orelse))
            break
        node = inner
    return found


def assigned(block: list[ast.stmt]) -> list[tuple[str, ast.expr]]:
    """A branch's single-target assignments as ``(target, value)``, target a name or
    ``self.<attr>`` (``_speculate`` declines anything else)."""
    out = []
    for node in block:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) or is_self_attr(target):
                out.append((ast.unparse(target), node.value))
    return out


def functions(facts: FunctionFacts, ctx: RewriteContext) -> Callable[[str], bool]:
    """Whether a bare name is a function or module (``torch``, ``F``, builtins), not a value."""

    def is_function(name: str) -> bool:
        if name in facts.local_names:
            return False
        value = ctx.globals.get(name, getattr(builtins, name, None))
        return callable(value) or isinstance(value, types.ModuleType)

    return is_function


def gated(
    assignments: list[tuple[str, ast.expr]],
    taken: ast.expr,
    is_function: Callable[[str], bool],
    ctx: RewriteContext,
    out: list[ast.stmt],
) -> dict[str, str]:
    """Under autograd, a branch whose operations might not hand the select's
    ``-0.0`` gradients on as ``-0.0`` when it is not taken reads its inputs
    through ``runtime.grad_gate`` (``-0.0`` where not taken): one binding per
    root it reads, appended to ``out``. None needed when ``signs_kept``."""
    if signs_kept([value for _, value in assignments]):
        return {}
    _, reads = block_reach(assignments, is_function)
    gates: dict[str, str] = {}
    for root in sorted(reads):
        temp = ctx.fresh("g")
        call = ast.Call(func=ctx.runtime("grad_gate"), args=[copy.deepcopy(taken), root_expr(root)], keywords=[])
        out.append(assign_to(store_name(temp), call))
        gates[root] = temp
    return gates


def ref(name: str) -> ast.expr:
    """A target's key (``h``, ``self.running``) as an expression."""
    if name.startswith("self."):
        return ast.Attribute(value=load_name("self"), attr=name[5:], ctx=ast.Load())
    return load_name(name)


def root_expr(root: str) -> ast.expr:
    return ast.parse(root, mode="eval").body


def side(index: int, count: int) -> str:
    """The stem of a branch's temporaries: ``t`` first, ``f`` for the else, ``e`` between."""
    return "t" if index == 0 else "f" if index == count - 1 else "e"


def taken(conds: list[str], index: int, ctx: RewriteContext) -> ast.expr:
    """When arm ``index`` runs: its test true (none for the else) and every earlier test false."""
    parts: list[ast.expr] = [ast.Call(func=ctx.torch("logical_not"), args=[load_name(c)], keywords=[]) for c in conds[:index]]
    if index < len(conds):
        parts.append(load_name(conds[index]))
    out = parts[0]
    for part in parts[1:]:
        out = ast.Call(func=ctx.torch("logical_and"), args=[out, part], keywords=[])
    return out


def selected(conds: list[str], values: list[ast.expr], ctx: RewriteContext, grad: bool) -> ast.expr:
    """``torch.where(c0, v0, torch.where(c1, v1, ... v_else))``; with ``grad``,
    ``runtime.select`` (``torch.where`` whose backward gives the side not chosen
    ``-0.0``). A path that leaves the value as the next one does is no select:
    ``where(c1, y, y)`` is ``y`` (and one tensor passed twice to one
    ``autograd.Function`` loses a gradient under torch 2.12's Dynamo)."""
    where = ctx.runtime("select") if grad else ctx.torch("where")
    out = values[-1]
    for cond, value in reversed(list(zip(conds, values))):
        if ast.dump(value) != ast.dump(out):
            out = ast.Call(func=copy.deepcopy(where), args=[load_name(cond), value, out], keywords=[])
    return out


# In-place updates a branch may end with: ``t.<name>(...)`` becomes ``t.copy_(v)``
# of the value computed out of place (``None``: ``copy_``'s argument itself).
IN_PLACE = {
    "copy_": None,
    "add_": "add",
    "sub_": "sub",
    "mul_": "mul",
    "div_": "div",
    "clamp_": "clamp",
    "clamp_min_": "clamp_min",
    "clamp_max_": "clamp_max",
    "masked_fill_": "masked_fill",
}


def in_place(node: ast.stmt) -> tuple[str, ast.expr] | None:
    """``t.add_(v)`` (a name or ``self.<attr>``, ``IN_PLACE``) -> ("t", ``t.add(v)``)."""
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return None
    call = node.value
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr in IN_PLACE):
        return None
    receiver = func.value
    if not (isinstance(receiver, ast.Name) or is_self_attr(receiver)):
        return None
    if func.attr == "copy_":
        if len(call.args) != 1 or call.keywords:
            return None
        return ast.unparse(receiver), call.args[0]
    method = ast.Attribute(value=copy.deepcopy(receiver), attr=IN_PLACE[func.attr], ctx=ast.Load())
    return ast.unparse(receiver), ast.Call(func=method, args=call.args, keywords=call.keywords)


def original(arms: list[Arm], tests: dict[str, ast.expr] | None = None) -> ast.stmt:
    """``if c0: B0 elif c1: B1 ... else: E`` again, on the tests' names (or, for a
    name in ``tests``, that test as written)."""
    out: list[ast.stmt] = copy.deepcopy(arms[-1][1])
    for cond, block in reversed(arms[:-1]):
        test = copy.deepcopy(tests[cond]) if tests and cond in tests else load_name(cond)  # type: ignore[index]
        out = [ast.If(test=test, body=copy.deepcopy(block), orelse=out)]
    return out[0]


# The deferred calls [Defer] writes (``runtime.print_``, ``log``, ``warn``) and
# the positions of what they evaluate in the graph: (args, kwargs).
DEFERRED = {"print_": (1, 2), "log": (3, 4), "warn": (1, 2)}


def deferred_effect(node: ast.stmt) -> ast.expr | None:
    """For a call [Defer] wrote (``__graphmend_rt__.print_(site, args, kwargs)``...)
    with no ``when`` yet: its evaluated arguments, as one tuple; else None."""
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return None
    call = node.value
    func = call.func
    if not (
        isinstance(func, ast.Attribute)
        and func.attr in DEFERRED
        and isinstance(func.value, ast.Name)
        and func.value.id == RUNTIME_NAME
        and not call.keywords
        and len(call.args) == max(DEFERRED[func.attr]) + 1
    ):
        return None
    args, kwargs = (call.args[i] for i in DEFERRED[func.attr])
    values = [v for v in kwargs.values if v is not None] if isinstance(kwargs, ast.Dict) else [kwargs]
    return ast.Tuple(elts=[args, *values], ctx=ast.Load())


def trapped_check(node: ast.stmt) -> tuple[str, ast.Call] | None:
    """``if __graphmend_rt__.trappable(x): __graphmend_rt__.trap(site, flag, E, args) else: ...``
    as [Trap] emits it (also ``trappable(x) and nonempty(t)``..., its guards of the
    message, which the branch's select guards again) -> (x, the trap call)."""
    if not (isinstance(node, ast.If) and len(node.body) == 1):
        return None
    test, inner = node.test, node.body[0]
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and all(_message_guard(v) for v in test.values[1:]):
        test = test.values[0]
    if not isinstance(test, ast.Call):
        return None
    if not (
        isinstance(test.func, ast.Attribute)
        and test.func.attr == "trappable"
        and isinstance(test.func.value, ast.Name)
        and test.func.value.id == "__graphmend_rt__"
        and len(test.args) == 1
        and isinstance(test.args[0], ast.Name)
        and isinstance(inner, ast.Expr)
        and isinstance(inner.value, ast.Call)
        and isinstance(inner.value.func, ast.Attribute)
        and inner.value.func.attr == "trap"
        and len(inner.value.args) == 4
    ):
        return None
    return test.args[0].id, inner.value


_KINDS = {
    ast.If: "an if", ast.For: "a for loop", ast.While: "a while loop", ast.AugAssign: "an augmented assignment",
    ast.Expr: "a call statement", ast.Assign: "an assignment to several targets", ast.With: "a with block",
    ast.Raise: "a raise", ast.Assert: "an assert", ast.Return: "a return", ast.Try: "a try block",
}


def other_statement(node: ast.stmt) -> str:
    """What a branch statement [Where] does not predicate is, for the reason the user reads:
    ``an if (`if t.any(): ...`)``."""
    head = ast.unparse(node).splitlines()[0]
    head = head + " ..." if head.endswith(":") else head
    return f"{_KINDS.get(type(node), 'a ' + type(node).__name__)} (`{head}`)"


def _message_guard(node: ast.expr) -> bool:
    """``__graphmend_rt__.nonempty(t)``, ``has_dims(t, n)``, ``is_kind(t, ...)``...: a guard
    [Trap] adds for its message (``_predicate.add_guards`` makes these)."""
    return is_runtime_call(node, "nonempty", "has_dims", "is_kind", "broadcastable", "broadcasts_to")


def returns_a_value(block: list[ast.stmt]) -> bool:
    return bool(block) and isinstance(block[-1], ast.Return) and block[-1].value is not None


def has_return(block: list[ast.stmt]) -> bool:
    return any(isinstance(node, ast.Return) for stmt in block for node in ast.walk(stmt))


def same_meta_checks(values: list[str], ctx: RewriteContext) -> list[ast.expr]:
    """``runtime.same_meta(first, other)`` for each other value a target takes on the
    paths (a temp, or the target unchanged): the select of them neither broadcasts nor promotes."""
    return [
        ast.Call(func=ctx.runtime("same_meta"), args=[ref(values[0]), ref(v)], keywords=[])
        for v in dict.fromkeys(values[1:])
        if v != values[0]
    ]


def by_path(conds: list[str], blocks: list[list[ast.stmt]]) -> list[ast.stmt]:
    """Each path's statements under the tests that choose it: ``if c0: B0 elif c1: B1 else: E``."""
    chain = blocks[-1]
    for cond, block in reversed(list(zip(conds, blocks))):
        chain = [ast.If(test=load_name(cond), body=block or [ast.Pass()], orelse=chain)]
    return chain


def placed(out: list[ast.stmt], origin: ast.stmt) -> list[ast.stmt]:
    for node in out:
        ast.copy_location(node, origin)
    return [ast.fix_missing_locations(relocate(node, origin)) for node in out]  # type: ignore[misc]


def relocate(node: ast.AST, origin: ast.stmt) -> ast.AST:
    """Give generated nodes the original statement's location (tracebacks and
    warnings keep pointing at the user's line)."""
    for sub in ast.walk(node):
        if "lineno" in sub._attributes and getattr(sub, "lineno", 0) in (None, 0):
            ast.copy_location(sub, origin)
    return node
