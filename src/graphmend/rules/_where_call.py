"""[Where] for a branch that ends in a call: a memo initialised on first use
(``if not hasattr(self, k): self.k = init(...)``, hoisted when ``init`` is
proven pure) and a device move (``if t.device != d: t = t.to(d)``).
Part of the [Where] rule (where.py)."""

from __future__ import annotations

import ast
import copy

from graphmend.analysis.facts import FunctionFacts
from graphmend.analysis.purity import (
    Emptiness,
    function_impurities,
    speculation_blockers,
)
from graphmend.rules import Decline, RewriteContext
from graphmend.rules._ast import all_of, assign_to, load_name, store_name
from graphmend.rules._predicate import add_guards


class TrailingCallForm:
    """The trailing-call forms of :class:`~graphmend.rules.where.Where`."""

    @staticmethod
    def _is_trailing_call_form(stmt: ast.If) -> bool:
        if not stmt.body or not stmt.orelse:
            return False
        last_t, last_f = stmt.body[-1], stmt.orelse[-1]
        return (
            isinstance(last_t, ast.Expr)
            and isinstance(last_f, ast.Expr)
            and isinstance(last_t.value, ast.Call)
            and isinstance(last_f.value, ast.Call)
            and ast.dump(last_t.value.func) == ast.dump(last_f.value.func)
        )

    def _trailing_call(
        self,
        stmt: ast.If,
        cond: str,
        facts: FunctionFacts,
        bound: set[str],
        ctx: RewriteContext,
        guards: list[ast.expr],
    ) -> list[ast.stmt]:
        call_t = stmt.body[-1].value  # type: ignore[attr-defined]
        call_f = stmt.orelse[-1].value  # type: ignore[attr-defined]
        if len(call_t.args) != len(call_f.args) or sorted(k.arg or "" for k in call_t.keywords) != sorted(
            k.arg or "" for k in call_f.keywords
        ):
            raise Decline("the branches end in the same call with different argument layouts")
        if any(isinstance(a, ast.Starred) for a in call_t.args + call_f.args) or any(
            k.arg is None for k in call_t.keywords + call_f.keywords
        ):
            raise Decline("*args / **kwargs in the common trailing call")
        body: list[ast.stmt] = []
        written: dict[str, str] = {}
        known = set(bound)
        for side, setups in (("true", stmt.body[:-1]), ("false", stmt.orelse[:-1])):
            for setup in setups:
                emitted, guard, names = self._license(setup, stmt, facts, known, ctx)
                for name in names:
                    if name in written and written[name] != side:
                        raise Decline(f"`{name}` is written by the leading statements of both branches")
                    written[name] = side
                    known.add(name)
                body.extend(emitted)
                if guard is not None:
                    guards.append(guard)
        keywords_f = {k.arg: k.value for k in call_f.keywords}
        pairs = [(a, b) for a, b in zip(call_t.args, call_f.args)] + [
            (k.value, keywords_f[k.arg]) for k in call_t.keywords
        ]
        merged: list[ast.expr] = []
        plain_t: list[ast.expr] = []
        plain_f: list[ast.expr] = []
        meta: list[ast.expr] = []
        for a, b in pairs:
            if ast.dump(a) == ast.dump(b):
                merged.append(copy.deepcopy(a))
                plain_t.append(copy.deepcopy(a))
                plain_f.append(copy.deepcopy(b))
                continue
            for value in (a, b):
                proof = self._tested(stmt, facts)
                empty = Emptiness(
                    proof.nonempty - set(written), frozenset(bound) - set(written), proven=proof.kinds, rebound=frozenset(written)
                )
                for reason in speculation_blockers(value, facts, known, empty):
                    raise Decline(f"`{ast.unparse(value)}`: {reason}")
                add_guards(empty, ctx, guards)
            ta, tb = ctx.fresh("t"), ctx.fresh("f")
            body.append(assign_to(store_name(ta), copy.deepcopy(a)))
            body.append(assign_to(store_name(tb), copy.deepcopy(b)))
            meta.append(ast.Call(func=ctx.runtime("same_meta"), args=[load_name(ta), load_name(tb)], keywords=[]))
            merged.append(ast.Call(func=ctx.torch("where"), args=[load_name(cond), load_name(ta), load_name(tb)], keywords=[]))
            plain_t.append(load_name(ta))
            plain_f.append(load_name(tb))
        if not meta:
            raise Decline("the branches end in the same call with the same arguments")
        npos = len(call_t.args)
        names = [k.arg for k in call_t.keywords]

        def rebuild(values: list[ast.expr], in_place: bool) -> ast.stmt:
            func = copy.deepcopy(call_t.func)
            args, kwargs = values[:npos], [ast.keyword(arg=n, value=v) for n, v in zip(names, values[npos:])]
            if (
                in_place
                and isinstance(func, ast.Attribute)
                and func.attr == "register_buffer"
                and len(args) >= 2
                and isinstance(args[0], ast.Constant)
            ):
                ctx.notes.append(f"buffer `{args[0].value}` updated in place (given its own storage if it shared one)")
                ctx.unalias.add(str(args[0].value))
                return ast.Expr(
                    value=ast.Call(func=ctx.runtime("register_buffer"), args=[func.value, *args], keywords=kwargs)
                )
            return ast.Expr(value=ast.Call(func=func, args=args, keywords=kwargs))

        guard = all_of(meta)
        body.append(
            ast.If(
                test=guard,
                body=[rebuild(merged, in_place=True)],
                orelse=[ast.If(test=load_name(cond), body=[rebuild(plain_t, False)], orelse=[rebuild(plain_f, False)])],
            )
        )
        ctx.notes.append(f"common trailing call `{ast.unparse(call_t.func)}(...)` merged with torch.where")
        return body

    def _license(
        self, setup: ast.stmt, branch: ast.If, facts: FunctionFacts, known: set[str], ctx: RewriteContext
    ) -> tuple[list[ast.stmt], ast.expr | None, list[str]]:
        """A leading statement that may run on both paths: (code, static guard, names written)."""
        memo = self._memo_init(setup)
        if memo is not None:
            owner, key, init = memo
            self._check_private(key, branch, ctx)
            self._check_pure_init(init, owner, facts, known, ctx)
            ctx.notes.append(
                f"memoised `{ast.unparse(owner)}.{key}` initialised on every path (private memo state)"
            )
            ctx.memo_attrs.add(key)
            return [copy.deepcopy(setup)], None, []
        move = self._device_move(setup)
        if move is not None:
            target, device = move
            for reason in speculation_blockers(device, facts, known):
                raise Decline(f"the device move: {reason}")
            ctx.notes.append(f"`{ast.unparse(setup)}` is a no-op (guarded: already on that device)")
            guard = ast.Call(func=ctx.runtime("on_device"), args=[copy.deepcopy(target), copy.deepcopy(device)], keywords=[])
            return [], guard, []
        raise Decline(f"the leading statement `{ast.unparse(setup).splitlines()[0]}` cannot run on both paths")

    @staticmethod
    def _memo_init(setup: ast.stmt) -> tuple[ast.expr, str, ast.Call] | None:
        """``if not hasattr(X, "k"): X.k = f(...)`` (or ``X.k, _ = f(...)``) with no else."""
        if not (isinstance(setup, ast.If) and not setup.orelse and len(setup.body) == 1):
            return None
        test = setup.test
        if not (
            isinstance(test, ast.UnaryOp)
            and isinstance(test.op, ast.Not)
            and isinstance(test.operand, ast.Call)
            and isinstance(test.operand.func, ast.Name)
            and test.operand.func.id == "hasattr"
            and len(test.operand.args) == 2
            and isinstance(test.operand.args[1], ast.Constant)
            and isinstance(test.operand.args[1].value, str)
        ):
            return None
        owner, key = test.operand.args[0], test.operand.args[1].value
        assign = setup.body[0]
        if not (isinstance(assign, ast.Assign) and len(assign.targets) == 1 and isinstance(assign.value, ast.Call)):
            return None
        target = assign.targets[0]
        stored = [target] if not isinstance(target, ast.Tuple) else target.elts
        hit = [
            t for t in stored if isinstance(t, ast.Attribute) and t.attr == key and ast.dump(t.value) == ast.dump(owner)
        ]
        others_ok = all(t in hit or (isinstance(t, ast.Name) and t.id == "_") for t in stored)
        if len(hit) != 1 or not others_ok:
            return None
        return owner, key, assign.value

    @staticmethod
    def _check_private(key: str, branch: ast.If, ctx: RewriteContext) -> None:
        from graphmend.analysis.source import parse_file

        parsed = parse_file(ctx.filename)
        if parsed is None:
            raise Decline("the module source is not available to prove the memo attribute private")
        first, last = branch.lineno, branch.end_lineno or branch.lineno
        for node in ast.walk(parsed.tree):
            if first <= getattr(node, "lineno", 0) <= last:
                continue
            if (isinstance(node, ast.Attribute) and node.attr == key) or (
                isinstance(node, ast.Constant) and node.value == key
            ):
                raise Decline(f"the memo attribute `{key}` is used elsewhere in the module (line {node.lineno})")

    def _check_pure_init(self, init: ast.Call, owner: ast.expr, facts: FunctionFacts, known: set[str], ctx: RewriteContext) -> None:

        for a in list(init.args) + [k.value for k in init.keywords]:
            for reason in speculation_blockers(a.value if isinstance(a, ast.Starred) else a, facts, known):
                raise Decline(f"the memo initialiser's argument: {reason}")
        func = init.func
        callees: list[object] = []
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and ast.dump(func.value) == ast.dump(owner):
            callees = ctx.attribute_values(func.attr)
            if not callees:
                raise Decline(f"`{ast.unparse(func)}` could not be resolved on the live model")
        else:
            value = ctx.value_of(func)
            if value is None:
                raise Decline(f"`{ast.unparse(func)}` could not be resolved")
            callees = [value]
        for callee in callees:
            impure = function_impurities(callee)
            if impure:
                raise Decline(f"the memo initialiser is not provably pure: {impure[0]}")

    @staticmethod
    def _device_move(setup: ast.stmt) -> tuple[ast.expr, ast.expr] | None:
        """``X.a = X.a.to(device)``."""
        if not (isinstance(setup, ast.Assign) and len(setup.targets) == 1):
            return None
        target, value = setup.targets[0], setup.value
        if (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute)
            and value.func.attr == "to"
            and len(value.args) == 1
            and not value.keywords
            and ast.dump(value.func.value) == ast.dump(target).replace("ctx=Store()", "ctx=Load()")
        ):
            load_target = copy.deepcopy(value.func.value)
            return load_target, value.args[0]
        return None
