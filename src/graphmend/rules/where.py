"""[Where] predicated control flow (category: DC).

## What it rewrites
A Python ``if`` whose test is a tensor:

* two branches that assign names (one or several): ``if c: y = a else: y = b``;
* two branches that each ``return`` a value;
* an update without ``else``: ``if c: h = f(h)``, including several
  statements, body-local temporaries, and ``self.<attr> = ...`` stores;
* tests built with ``and`` / ``or`` / ``not`` over tensor reductions, lowered
  to ``torch.logical_and/or/not``; a static conjunct
  (``h.dtype == torch.float16 and ...``) stays a Python ``if`` around the
  predicated part.

## Why the original breaks
Python must turn the tensor into a bool to choose a branch, so Dynamo stops
the graph there (GB0170) and compiles each branch separately.

## Example
```python
if h.dtype == torch.float16 and torch.isinf(h).any():      # before
    h = torch.clamp(h, -lim, lim)

if h.dtype == torch.float16:                                # after
    _gm_c0 = torch.isinf(h).any()
    if __graphmend_rt__.predicable(_gm_c0):
        _gm_t0 = torch.clamp(h, -lim, lim)
        if __graphmend_rt__.same_meta(_gm_t0, h):
            h = torch.where(_gm_c0, _gm_t0, h)
        elif _gm_c0:
            h = _gm_t0
    elif _gm_c0:
        h = torch.clamp(h, -lim, lim)                       # the original branch
```
Both sides are computed and the result selected. ``predicable`` (a 0-dim
bool tensor, autograd off) and ``same_meta`` (same shape, dtype, device) are
decided by Dynamo while tracing, so the graph holds only ``torch.where``;
when either fails (grad mode, a Python bool, operands that would broadcast)
the original branch runs, exactly as before. A store to a registered buffer
updates it in place when nothing else shares it (``runtime.store``).

When a branch calls a module or function (``h = self.lin(h)``), computing
both sides would double its cost: only the taken side runs, in
``torch.cond``, after ``__graphmend_rt__.bind(h, self, getattr(self, 'lin',
None))`` shows Dynamo the objects the branches reach (one it first met inside
a branch would lose a later ``self.count += 1``).

## When it declines
- ``elif`` chains, ``while`` loops, branches with statements other than
  assignments (or a single ``return`` each), tuple targets;
- a branch value that could raise or act when its branch was not taken:
  calls outside the pure torch functions and tensor methods, in-place
  methods, indexing that can go out of range, names unbound on that path, a
  reduction with no identity element (``amax``, ``max``, ``.item()``, which
  raise on an empty tensor; ``torch.cond`` traces the branch not taken on the
  call's shapes too) of a tensor bound inside the branch. Of a tensor bound
  before the ``if`` it is guarded instead (``runtime.nonempty``: an empty one
  takes the original branch), unless the test reduced it whole already;
- ``torch.cond`` when an attribute store (``x.a = ...``, ``+=``, ``setattr``)
  may run before it in the compiled frame: earlier in the function (anywhere
  in it inside a loop) or in the ``forward`` of one of the model's own module
  classes and the methods it calls as ``self.name(...)``. Dynamo (torch 2.13)
  then drops the attribute stores made after the cond (measured with
  hand-written ``torch.cond``);
- a test whose atoms are not provably tensors (for ``and``/``or``/``not``);
- a name assigned on one path only and read after the ``if``.

## Fix safety
Exact by construction when it applies: the original branch is kept for every
case the guards reject, and autograd always takes it.
"""

from __future__ import annotations

import ast
import copy

from graphmend.analysis.facts import FunctionFacts, bound_before, is_tensor_expr
from graphmend.analysis.purity import Emptiness, nonempty_names, speculation_blockers
from graphmend.rules import Decline, RewriteContext, Rule, register
from graphmend.rules._ast import (
    Substitute,
    assign_to,
    is_self_attr,
    load_name,
    store_name,
)
from graphmend.rules._predicate import (
    check_lowerable,
    guard_nonempty,
    has_boolops,
    lower,
)
from graphmend.rules._where_call import TrailingCallForm
from graphmend.rules._where_cond import CondForm


@register
class Where(CondForm, TrailingCallForm, Rule):
    name = "where"
    categories = frozenset({"DC"})
    summary = "compute both branches of a tensor-valued if and select with torch.where"
    verdict = "[Where] predicate the branch with torch.where / torch.cond"
    rank = 1
    codes = {
        "GM101": "`if` on a tensor value",
        "GM102": "`while` on a tensor value",
        "GM103": "conditional expression on a tensor value",
    }
    style = "cyan"

    def rewrite(self, stmt: ast.stmt, ctx: RewriteContext) -> list[ast.stmt]:
        if isinstance(stmt, ast.While):
            raise Decline("a while loop on a tensor value cannot be predicated")
        if not isinstance(stmt, ast.If):
            raise Decline("the break is not at an if statement")
        if len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If):
            raise Decline("elif chains are not predicated")
        facts = FunctionFacts.of(ctx.fdef, ctx.globals, ctx.local_names)
        static, tensor_test = self._split_test(stmt.test, facts)
        bound = bound_before(ctx.fdef, stmt)
        if has_boolops(tensor_test):  # lowering evaluates every operand, not just the first
            for reason in speculation_blockers(tensor_test, facts, bound, Emptiness(nonempty_names(tensor_test, facts))):
                raise Decline(f"the test: {reason}")
        check_lowerable(tensor_test, facts)
        lowered = lower(tensor_test, facts, ctx)
        cond = ctx.fresh("c")
        original_test = load_name(cond) if lowered is tensor_test else copy.deepcopy(tensor_test)
        fallback = ast.If(test=original_test, body=copy.deepcopy(stmt.body), orelse=copy.deepcopy(stmt.orelse))

        guards: list[ast.expr] = []
        if self._is_return_form(stmt):
            predicated = self._returns(stmt, cond, facts, bound, ctx, guards)
            ctx.notes.append("if/else returns predicated with torch.where")
        elif self._is_trailing_call_form(stmt):
            predicated = self._trailing_call(stmt, cond, facts, bound, ctx, guards)
        else:
            try:
                predicated = self._assignments(stmt, cond, facts, bound, ctx, guards)
            except Decline as where_reason:
                calls = [n for b in (stmt.body, stmt.orelse) for s in b for n in ast.walk(s) if isinstance(n, ast.Call)]
                if not calls:
                    raise
                try:
                    predicated = self._cond(stmt, cond, facts, bound, ctx, guards)
                except Decline as cond_reason:
                    raise Decline(f"torch.where: {where_reason.reason}; torch.cond: {cond_reason.reason}") from None
        check: ast.expr = ast.Call(func=ctx.runtime("predicable"), args=[load_name(cond)], keywords=[])
        if guards:
            check = ast.BoolOp(op=ast.And(), values=[check, *guards])
        guarded: list[ast.stmt] = [
            assign_to(store_name(cond), lowered),
            ast.If(test=check, body=predicated, orelse=[fallback]),
        ]
        if static is not None:
            ctx.notes.append(f"static test `{ast.unparse(static)}` kept as a Python if")
            out: list[ast.stmt] = [ast.If(test=static, body=guarded, orelse=copy.deepcopy(stmt.orelse))]
        else:
            out = guarded
        for node in out:
            ast.copy_location(node, stmt)
        return [ast.fix_missing_locations(_relocate(node, stmt)) for node in out]

    # -- the test ----------------------------------------------------------------

    def _nonempty(self, stmt: ast.If, facts: FunctionFacts) -> frozenset[str]:
        """The names the tensor part of the test proves non-empty before a branch runs."""
        return nonempty_names(self._split_test(stmt.test, facts)[1], facts)

    def _split_test(self, test: ast.expr, facts: FunctionFacts) -> tuple[ast.expr | None, ast.expr]:
        """(static conjunct or None, tensor part)."""
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            static = [v for v in test.values if self._is_static(v, facts)]
            dynamic = [v for v in test.values if not self._is_static(v, facts)]
            if static and dynamic:
                if test.values.index(dynamic[0]) < test.values.index(static[-1]):
                    raise Decline("a static conjunct after a tensor conjunct would change evaluation order")
                static_expr = static[0] if len(static) == 1 else ast.BoolOp(op=ast.And(), values=static)
                tensor = dynamic[0] if len(dynamic) == 1 else ast.BoolOp(op=ast.And(), values=dynamic)
                return static_expr, tensor
        return None, test

    @staticmethod
    def _is_static(node: ast.expr, facts: FunctionFacts) -> bool:
        """A conjunct Dynamo decides while tracing: metadata comparisons, ``is``
        tests, flags and ``hasattr``/``isinstance``, with no tensor value in it."""
        if is_tensor_expr(node, facts):
            return False
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                if not (isinstance(sub.func, ast.Name) and sub.func.id in ("hasattr", "isinstance", "len")):
                    return False
            if isinstance(sub, ast.Attribute) and sub.attr in ("sum", "any", "all", "item", "max", "min"):
                return False
        return True

    # -- return form -------------------------------------------------------------

    @staticmethod
    def _is_return_form(stmt: ast.If) -> bool:
        return (
            len(stmt.body) == 1
            and len(stmt.orelse) == 1
            and isinstance(stmt.body[0], ast.Return)
            and isinstance(stmt.orelse[0], ast.Return)
            and stmt.body[0].value is not None
            and stmt.orelse[0].value is not None
        )

    def _returns(
        self, stmt: ast.If, cond: str, facts: FunctionFacts, bound: set[str], ctx: RewriteContext, guards: list[ast.expr]
    ) -> list[ast.stmt]:
        values = []
        body: list[ast.stmt] = []
        for ret, side in ((stmt.body[0], "t"), (stmt.orelse[0], "f")):
            assert isinstance(ret, ast.Return) and ret.value is not None
            empty = Emptiness(self._nonempty(stmt, facts), frozenset(bound))
            for reason in speculation_blockers(ret.value, facts, bound, empty):
                raise Decline(f"a returned value: {reason}")
            guard_nonempty(empty, ctx, guards)
            temp = ctx.fresh(side)
            body.append(assign_to(store_name(temp), copy.deepcopy(ret.value)))
            values.append(temp)
        where = ast.Call(func=ctx.torch("where"), args=[load_name(cond), load_name(values[0]), load_name(values[1])], keywords=[])
        body.append(
            ast.If(
                test=ast.Call(func=ctx.runtime("same_meta"), args=[load_name(values[0]), load_name(values[1])], keywords=[]),
                body=[ast.Return(value=where)],
                orelse=[ast.Return(value=ast.IfExp(test=load_name(cond), body=load_name(values[0]), orelse=load_name(values[1])))],
            )
        )
        return body

    # The torch.cond form (CondForm) and the trailing-call forms (TrailingCallForm)
    # are in _where_cond.py and _where_call.py.

    # -- assignment form ---------------------------------------------------------

    def _assignments(
        self,
        stmt: ast.If,
        cond: str,
        facts: FunctionFacts,
        bound: set[str],
        ctx: RewriteContext,
        guards: list[ast.expr] | None = None,
    ) -> list[ast.stmt]:
        body: list[ast.stmt] = []
        guards = guards if guards is not None else []
        nonempty = self._nonempty(stmt, facts)
        true_env = self._speculate(stmt.body, "t", facts, bound, ctx, body, cond, guards, nonempty)
        false_env = self._speculate(stmt.orelse, "f", facts, bound, ctx, body, cond, guards, nonempty)
        targets = list(dict.fromkeys(list(true_env) + list(false_env)))
        if not targets:
            raise Decline("the branches assign nothing")
        read_after = self._read_outside(ctx.fdef, stmt)
        selects: list[tuple[str, str, str]] = []  # (target, true temp/expr, false temp/expr)
        for target in targets:
            is_attr = target.startswith("self.")
            pre_bound = is_attr or target in bound
            if not pre_bound and (target not in true_env or target not in false_env):
                if target in read_after:
                    raise Decline(f"`{target}` is assigned on one path only and read after the if")
                continue  # a temporary of one branch, never read afterwards
            selects.append((target, true_env.get(target, target), false_env.get(target, target)))
        if not selects:
            raise Decline("the branches only assign temporaries")
        meta_checks = [
            ast.Call(func=ctx.runtime("same_meta"), args=[self._ref(t), self._ref(f)], keywords=[])
            for _, t, f in selects
        ]
        guard = meta_checks[0] if len(meta_checks) == 1 else ast.BoolOp(op=ast.And(), values=meta_checks)
        predicated: list[ast.stmt] = []
        chosen_true: list[ast.stmt] = []
        chosen_false: list[ast.stmt] = []
        for target, t, f in selects:
            where = ast.Call(func=ctx.torch("where"), args=[load_name(cond), self._ref(t), self._ref(f)], keywords=[])
            predicated.append(self._store_stmt(target, where, ctx))
            if t != target:
                chosen_true.append(self._store_stmt(target, self._ref(t), ctx, plain=True))
            if f != target:
                chosen_false.append(self._store_stmt(target, self._ref(f), ctx, plain=True))
        body.append(
            ast.If(
                test=guard,
                body=predicated,
                orelse=[ast.If(test=load_name(cond), body=chosen_true or [ast.Pass()], orelse=chosen_false)],
            )
        )
        kinds = "buffer/attribute" if any(t.startswith("self.") for t, _, _ in selects) else "names"
        ctx.notes.append(
            f"{'if/else' if stmt.orelse else 'if'} predicated with torch.where ({', '.join(t for t, _, _ in selects)}; {kinds})"
        )
        return body

    @staticmethod
    def _ref(name: str) -> ast.expr:
        if name.startswith("self."):
            return ast.Attribute(value=load_name("self"), attr=name[5:], ctx=ast.Load())
        return load_name(name)

    @staticmethod
    def _store_stmt(target: str, value: ast.expr, ctx: RewriteContext, plain: bool = False) -> ast.stmt:
        if target.startswith("self."):
            if plain:
                return assign_to(ast.Attribute(value=load_name("self"), attr=target[5:], ctx=ast.Store()), value)
            call = ast.Call(
                func=ctx.runtime("store"), args=[load_name("self"), ast.Constant(target[5:]), value], keywords=[]
            )
            return ast.Expr(value=call)
        return assign_to(store_name(target), value)

    def _speculate(
        self,
        block: list[ast.stmt],
        side: str,
        facts: FunctionFacts,
        bound: set[str],
        ctx: RewriteContext,
        out: list[ast.stmt],
        cond: str | None = None,
        guards: list[ast.expr] | None = None,
        nonempty: frozenset[str] = frozenset(),
    ) -> dict[str, str]:
        env: dict[str, str] = {}
        known = set(bound)
        for node in block:
            trapped = _trapped_check(node)
            if trapped is not None and cond is not None and guards is not None:
                out.append(self._regate(trapped, side, cond, env, facts, known, ctx, guards))
                continue
            if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                raise Decline("a branch holds a statement other than a single-target assignment")
            target = node.targets[0]
            if isinstance(target, ast.Name):
                key = target.id
            elif is_self_attr(target):
                key = ast.unparse(target)
            else:
                raise Decline(f"assignment to `{ast.unparse(target)}` (only names and self.<attr> are predicated)")
            guardable = frozenset(bound) - set(env) if guards is not None else frozenset()
            empty = Emptiness(nonempty - set(env), guardable)
            for reason in speculation_blockers(node.value, facts, known | set(env), empty):
                raise Decline(f"`{ast.unparse(node)}`: {reason}")
            if guards is not None:
                guard_nonempty(empty, ctx, guards)
            value = Substitute(env).visit(copy.deepcopy(node.value))
            temp = ctx.fresh(side)
            out.append(assign_to(store_name(temp), value))
            env[key] = temp
            known.add(key)
        return env

    def _regate(
        self,
        trapped: tuple[str, ast.Call],
        side: str,
        cond: str,
        env: dict[str, str],
        facts: FunctionFacts,
        known: set[str],
        ctx: RewriteContext,
        guards: list[ast.expr],
    ) -> ast.stmt:
        """A check [Trap] already rewrote inside this branch: it may only fire
        when its branch would have run, so its flag is and-ed with the test."""
        from graphmend.rules.trap import _deferred_blockers

        flag_name, call = trapped
        if flag_name not in env:
            raise Decline("a trapped check whose flag is not computed in the same branch")
        site, flag, exc, args = call.args
        for reason in _deferred_blockers(args, facts, known | set(env)):
            raise Decline(f"the message of a check in the branch: {reason}")
        flag = Substitute(env).visit(copy.deepcopy(flag))
        taken: ast.expr = load_name(cond)
        if side == "f":
            taken = ast.Call(func=ctx.torch("logical_not"), args=[taken], keywords=[])
        ctx.notes.append("a validation check inside the branch fires only when its branch would have run")
        regated = ast.Call(
            func=ctx.runtime("trap"),
            args=[
                copy.deepcopy(site),
                ast.Call(func=ctx.runtime("gate"), args=[taken, flag], keywords=[]),
                copy.deepcopy(exc),
                Substitute(env).visit(copy.deepcopy(args)),
            ],
            keywords=[],
        )
        return ast.Expr(value=regated)

    @staticmethod
    def _read_outside(fdef: ast.AST, stmt: ast.stmt) -> set[str]:
        inside = {id(n) for n in ast.walk(stmt)}
        return {
            n.id
            for n in ast.walk(fdef)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and id(n) not in inside
        }


def _trapped_check(node: ast.stmt) -> tuple[str, ast.Call] | None:
    """``if __graphmend_rt__.trappable(x): __graphmend_rt__.trap(site, flag, E, args) else: ...``
    as [Trap] emits it -> (x, the trap call)."""
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Call) and len(node.body) == 1):
        return None
    test, inner = node.test, node.body[0]
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


def _relocate(node: ast.AST, origin: ast.stmt) -> ast.AST:
    """Give generated nodes the original statement's location (tracebacks and
    warnings keep pointing at the user's line)."""
    for sub in ast.walk(node):
        if "lineno" in sub._attributes and getattr(sub, "lineno", 0) in (None, 0):
            ast.copy_location(sub, origin)
    return node


