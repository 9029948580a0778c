"""The branches of [Where], computed: each statement of a branch into fresh
temporaries, in order, whether or not the branch is taken. Part of the
[Where] rule (where.py); the select among them is in ``_where_select``.

A branch may hold single-target assignments (to names or ``self.<attr>``),
the calls [Defer] and [Trap] wrote (performed or raised only when the branch
would have run: ``when=`` / ``runtime.gate``), one in-place update as its
last statement, and nested ``if``/``elif``/``else`` statements of the same
kinds.

A nested ``if``'s tests are computed like any value (they must be safe to
evaluate where the original would not have), all its branches too, and
each name they assign selected with (nested) ``torch.where``. Whether that test is a
0-dim bool tensor, and whether the two values have the same shape, dtype and
device, is known only once they are computed: the rest of the computation
then sits inside ``if runtime.predicable(c) and runtime.same_meta(a, b):``,
whose ``else`` is the original statement (``FALLBACK``, filled in by
where.py): Dynamo decides it while tracing. An ``assert`` [Trap] rewrote
(``if __debug__: ...``) continues the same way, under ``if __debug__:``.

The deferred effects and checks of the branches are held back (``pending``)
and placed after every check that can fall back to the original statements,
which would perform them again.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass, field

from graphmend.analysis.aliasing import alias_roots
from graphmend.analysis.facts import FunctionFacts, updated_after
from graphmend.analysis.purity import Emptiness, same_numel_name, speculation_blockers
from graphmend.analysis.sharing import Sharing
from graphmend.analysis.speculated import Tested
from graphmend.rules import Decline, RewriteContext
from graphmend.rules import _where_select as select
from graphmend.rules._ast import (
    Substitute,
    all_of,
    assign_to,
    is_self_attr,
    load_name,
    store_name,
)
from graphmend.rules._predicate import (
    add_guards,
    deferred_blockers,
    has_boolops,
    is_static_test,
    item_test,
    lower,
)

FALLBACK = "graphmend: the original statement"  # the marker ``fill_fallback`` replaces


def fallback_marker() -> ast.stmt:
    return ast.Expr(value=ast.Constant(FALLBACK))


def fill_fallback(body: list[ast.stmt], original: ast.stmt) -> None:
    """Put a copy of ``original`` wherever ``body`` holds the marker."""
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        for name in ("body", "orelse"):
            block = getattr(node, name, None)
            if isinstance(block, list):
                block[:] = [
                    copy.deepcopy(original)
                    if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and s.value.value == FALLBACK
                    else s
                    for s in block
                ]


def as_written(block: list[ast.stmt], ctx: RewriteContext) -> list[ast.stmt]:
    """``block`` with each ``if`` an earlier [Where] site of this pass rewrote read as
    written ([Scalar]'s ``if t.item() > c:`` as the tensor test [Where] predicated)."""
    out: list[ast.stmt] = []
    index = 0
    while index < len(block):
        node = block[index]
        found = ctx.replaced.get(id(node))
        by = ctx.replaced_by.get(id(node))
        if found is None or by not in ("where", "scalar") or not isinstance(found[1], ast.If):
            out.append(node)
            index += 1
            continue
        original = found[1]
        while index < len(block) and (ctx.replaced.get(id(block[index])) or (None, None))[1] is original:
            index += 1
        test = item_test(original.test, ctx) if by == "scalar" else None
        out.append(original if test is None else ast.copy_location(ast.If(test=test, body=original.body, orelse=original.orelse), original))
    return out


def one_return(block: list[ast.stmt], ctx: RewriteContext) -> list[ast.stmt]:
    """A path ending in ``return v`` with an ``if`` before its end some of whose
    branches return: each branch that does not continues with the statements after
    the ``if``, every path assigns one fresh name instead of returning, and the path
    returns that name; nested ``if``s likewise. ``[p; if c: return a; q; return b]``
    -> ``[p; if c: r = a else: q; r = b; return r]``. Unchanged when a return sits
    anywhere else (in a loop): the caller declines it. An ``if`` an earlier
    [Where] site of this pass rewrote is read as written."""
    written = as_written(block, ctx)
    for index, node in enumerate(written[:-1]):
        if not (isinstance(node, ast.If) and select.has_return([node])):
            continue
        if not select.returns_a_value(written) or select.has_return(written[:index]):
            return block
        rest = written[index + 1 :]
        name = ctx.fresh("r")

        def path(branch: list[ast.stmt]) -> list[ast.stmt]:
            whole = one_return(branch if select.returns_a_value(branch) else [*branch, *copy.deepcopy(rest)], ctx)
            *setup, last = whole
            if not isinstance(last, ast.Return) or last.value is None or select.has_return(setup):
                raise _Unflattened
            return [*setup, ast.copy_location(assign_to(store_name(name), last.value), last)]

        try:
            branches = path(node.body), path(node.orelse)
        except _Unflattened:
            return block
        flat = ast.copy_location(ast.If(test=node.test, body=branches[0], orelse=branches[1]), node)
        return [*written[:index], flat, ast.copy_location(ast.Return(value=load_name(name)), written[-1])]
    return block


class _Unflattened(Exception):
    """A return ``one_return`` cannot move to the end of its path."""


def has_nested_if(block: list[ast.stmt], ctx: RewriteContext) -> bool:
    """Whether a branch holds an ``if`` (as written) other than a check [Trap] wrote."""
    return any(
        isinstance(n, ast.If) and select.trapped_check(n) is None and not _is_debug_block(n) for n in as_written(block, ctx)
    )


def _one_of(values: list[str]) -> ast.expr:
    """What a merged temporary holds, for the dtype and shape facts: one of ``values``."""
    out = select.ref(values[-1])
    for value in reversed(values[:-1]):
        out = ast.IfExp(test=ast.Constant(True), body=select.ref(value), orelse=out)
    return out


def _is_debug_block(node: ast.stmt) -> bool:
    """``if __debug__: ...`` around a check [Trap] rewrote from an ``assert``."""
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "__debug__"
        and any(select.trapped_check(n) is not None for n in node.body)
    )


@dataclass
class Dtypes:
    """What the speculation knows of dtypes at a point of a branch (analysis/dtypes.py)."""

    proven: dict[str, frozenset[str]]
    renamed: dict[str, str]
    aliases: dict[str, ast.expr]


@dataclass
class Speculation:
    """What the branches of one site share while they are computed.

    ``out``: where the next statement goes (a nested ``if`` moves it inside its
    check); ``guards``: checks made before the computation (``runtime.nonempty``
    of names bound before the ``if``; None: none may be added); ``inplace``:
    targets updated in place (None: such updates are declined)."""

    facts: FunctionFacts
    bound: set[str]
    ctx: RewriteContext
    out: list[ast.stmt]
    guards: list[ast.expr] | None = None
    tested: Tested = field(default_factory=Tested)  # what the test proves (non-empty tensors, dtype kinds)
    inplace: set[str] | None = None
    # What each temporary holds, in names bound before the if and earlier temporaries.
    values: dict[str, ast.expr] = field(default_factory=dict)
    nested: int = 0  # nested ifs met
    # Deferred effects and checks, gated by when their branch runs, in order: the caller
    # places them after every check that can fall back to the original statements
    # (which would perform them again).
    pending: list[ast.stmt] = field(default_factory=list)
    # A temporary holding a value with as many elements as the name's value before the
    # if (``h * 2``): a guard on that name (runtime.nonempty) covers it too.
    roots: dict[str, str] = field(default_factory=dict)
    # Names a nested if binds on some of its paths only: no value after it (the caller
    # declines when one is read after the site).
    dropped: set[str] = field(default_factory=set)
    # Names an assignment on some path binds: one also updated in place on another path
    # (or later on the same) is declined, as the copy back would change the tensor the
    # assignment let go (which other names may still hold).
    rebound: set[str] = field(default_factory=set)
    _sharing: Sharing | None = None

    def branch(
        self,
        block: list[ast.stmt],
        side: str,
        taken: ast.expr | None = None,
        gates: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        last: bool = True,
    ) -> dict[str, str]:
        """Each statement of ``block`` computed into fresh temporaries; returns ``env``
        (target -> the temporary holding its value at the end of the block).
        ``taken``: when the branch would have run; ``env``: the values assigned
        before it (a nested branch); ``last``: the block ends its branch (an
        in-place update may close it)."""
        env = {} if env is None else env
        known = set(self.bound)
        todo = as_written(block, self.ctx)
        while todo:
            node = todo.pop(0)
            if _is_debug_block(node):  # an assert [Trap] rewrote: under python -O, the original statement
                rest: list[ast.stmt] = []
                self.out.append(ast.If(test=load_name("__debug__"), body=rest, orelse=[fallback_marker()]))
                self.out = rest
                todo[:0] = node.body  # type: ignore[attr-defined]
                continue
            trapped = select.trapped_check(node)
            if isinstance(node, ast.If) and trapped is None:
                self._nested(node, env, known, side, taken)
                continue
            if trapped is not None and taken is not None and self.guards is not None:
                self.pending.append(self._regate(trapped, copy.deepcopy(taken), env, known))
                continue
            effect = select.deferred_effect(node)
            if effect is not None and taken is not None and self.guards is not None:
                self._effect(node, effect, env, known, taken)
                continue
            update = select.in_place(node) if self.inplace is not None else None
            if update is not None:
                key, computed = update
                if node is not block[-1] or not last:
                    self._before_others(node, key, todo, last)
                if key in self.rebound:
                    raise Decline(f"`{ast.unparse(node)}`: an in-place update of a name a path assigns")
                if not (key.startswith("self.") or key in self.bound):
                    raise Decline(f"`{ast.unparse(node)}`: an in-place update of a value not bound before the if")
                self.inplace.add(key)  # type: ignore[union-attr]
            elif not isinstance(node, ast.Assign) or len(node.targets) != 1:
                raise Decline(f"a branch holds a statement other than a single-target assignment: {select.other_statement(node)}")
            elif isinstance(node.targets[0], ast.Name) or is_self_attr(node.targets[0]):
                key, computed = ast.unparse(node.targets[0]), node.value
            else:
                raise Decline(f"assignment to `{ast.unparse(node.targets[0])}` (only names and self.<attr> are predicated)")
            if update is None:
                if key in (self.inplace or ()):
                    raise Decline(f"`{ast.unparse(node)}`: an assignment to a name a path updates in place")
                self.rebound.add(key)
            value = self._value(computed, env, known, gates, f"`{ast.unparse(node)}`")
            temp = self.ctx.fresh(side)
            root = same_numel_name(computed)
            root = self.roots.get(env[root]) if root in env else root if root in self.bound else None
            if root is not None:
                self.roots[temp] = root
            self.out.append(assign_to(store_name(temp), value))
            self.values[temp] = Substitute(dict(env)).visit(copy.deepcopy(computed))  # not gated: the same dtype
            env[key] = temp
            known.add(key)
        return env

    def _before_others(self, node: ast.stmt, key: str, rest: list[ast.stmt], last: bool) -> None:
        """An in-place update with statements after it in its branch: they read its value
        through ``key`` (the temporary that holds it), so none may read another name that
        could share ``key``'s storage: eagerly that name would show the update, here not
        until the copy back at the end (``sharing.Sharing``)."""
        what = f"`{ast.unparse(node)}`: an in-place update before other statements of its branch"
        if not last or key.startswith("self."):
            raise Decline(what)
        sharing = self.sharing()
        if sharing.is_outside(key):
            raise Decline(f"{what}, of a tensor that may come from outside the function")
        read = {n.id for stmt in rest for n in ast.walk(stmt) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Store)}
        read.discard(key)
        for name in sorted(read):
            if sharing.may_share(key, name):
                raise Decline(f"{what}, which read `{name}`: it may share `{key}`'s storage")

    def sharing(self) -> Sharing:
        """Which names of the function may share storage (built once per site)."""
        if self._sharing is None:
            self._sharing = Sharing(self.ctx.fdef, self.facts)
        return self._sharing

    def view_roots(self, temp: str) -> set[str]:
        """The names bound before the if whose tensor the branch value ``temp`` may be or view."""
        roots: set[str] = set()
        todo = [temp]
        while todo:
            for root in alias_roots(self.values.get(todo.pop(), ast.Constant(None))):
                if root in self.values:
                    todo.append(root)  # an earlier temporary of the branch
                else:
                    roots.add(root)
        return roots

    def kept_after(self, stmt: ast.If, target: str, values: list[str]) -> None:
        """Declines a select of ``target`` whose eager value may change in place after the if."""
        roots = {root for value in values for root in self.view_roots(value)}
        tied_after(self.ctx.fdef, stmt, target, roots, self.sharing(), "the select makes a new tensor")

    def _value(
        self, computed: ast.expr, env: dict[str, str], known: set[str], gates: dict[str, str] | None, what: str
    ) -> ast.expr:
        """``computed`` as evaluated on every call: proven safe, on the branch's values so far."""
        empty = (
            self._emptiness(env) if self.guards is not None
            else Emptiness(self.tested.nonempty - set(env), **vars(self.dtypes(env)))
        )
        for reason in speculation_blockers(computed, self.facts, known | set(env), empty):
            raise Decline(f"{what}: {reason}")
        if self.guards is not None:
            add_guards(empty, self.ctx, self.guards)
        return Substitute({**(gates or {}), **env}).visit(copy.deepcopy(computed))

    def _emptiness(self, env: dict[str, str]) -> Emptiness:
        """What the branch's values so far may be guarded by: a name bound before the
        if and not assigned since, or assigned a value of as many elements."""
        same = {key for key, temp in env.items() if self.roots.get(temp) == key}
        return Emptiness(
            (self.tested.nonempty - set(env)) | (self.tested.nonempty & same),
            (frozenset(self.bound) - set(env)) | same,
            **vars(self.dtypes(env)),
        )

    def dtypes(self, env: dict[str, str]) -> "Dtypes":
        """What is known of dtypes after the branch's assignments in ``env``."""
        return Dtypes(self.tested.kinds, dict(env), self.values)

    def _effect(self, node: ast.stmt, effect: ast.expr, env: dict[str, str], known: set[str], taken: ast.expr) -> None:
        empty = self._emptiness(env)
        for reason in deferred_blockers(effect, self.facts, known | set(env), empty):
            raise Decline(f"`{ast.unparse(node)}` in the branch: {reason}")
        add_guards(empty, self.ctx, self.guards)  # type: ignore[arg-type]
        call = Substitute(env).visit(copy.deepcopy(node.value))  # type: ignore[attr-defined]  # the values, not gated copies
        call.keywords.append(ast.keyword(arg="when", value=copy.deepcopy(taken)))
        self.pending.append(ast.Expr(value=call))
        self._note("a deferred effect in a branch happens only when its branch would have run")

    def _note(self, note: str) -> None:
        """Tell the report once, however many statements it concerns."""
        if note not in self.ctx.notes:
            self.ctx.notes.append(note)

    def _nested(self, node: ast.If, env: dict[str, str], known: set[str], side: str, taken: ast.expr | None) -> None:
        """``if t0: A elif t1: B ... else: E`` inside a branch: every test and branch
        computed, each name they assign selected (nested ``torch.where``); the rest of
        the computation inside the check that the select is exact (``predicable``,
        ``same_meta``), else the original statement. A name one path assigns and no
        other binds is dropped (the caller declines if it is read after the site)."""
        ctx = self.ctx
        arms = select.arms(node, ctx)
        conds: list[str] = []
        if len(arms) == 2 and not has_boolops(node.test) and is_static_test(node.test, self.facts):
            self._static(node, env, known, side)
            return
        for test, _ in arms:
            if test is None:
                break
            code = ast.unparse(test)
            test = item_test(test, ctx) or test  # `t.item() > 0`: a tensor test where exact (runtime.item_of)
            if not has_boolops(test) and is_static_test(test, self.facts):
                raise Decline(f"a nested if on `{code}`, which is not a tensor test, after a tensor test")
            self._value(test, env, known, None, f"the nested test `{code}`")  # safe on every call
            cond = ctx.fresh("c")
            self.out.append(assign_to(store_name(cond), Substitute(env).visit(lower(copy.deepcopy(test), self.facts, ctx))))
            conds.append(cond)
        self.nested += 1
        envs = []
        for index, (_, block) in enumerate(arms):
            when = select.taken(conds, index, ctx)
            if taken is not None:
                when = ast.Call(func=ctx.torch("logical_and"), args=[copy.deepcopy(taken), when], keywords=[])
            envs.append(self.branch(block, side, when, env=dict(env), last=False))
        checks: list[ast.expr] = [ast.Call(func=ctx.runtime("predicable"), args=[load_name(c)], keywords=[]) for c in conds]
        merged: list[ast.stmt] = []
        for target in dict.fromkeys(t for e in envs for t in e):
            values = [e.get(target, env.get(target, target if target in known or target.startswith("self.") else "")) for e in envs]
            if "" in values:
                self.dropped.add(target)  # bound on some paths only: read later, it is unbound here
                continue
            if all(v == values[0] for v in values):
                continue
            refs = [select.ref(v) for v in values]
            checks += [ast.Call(func=ctx.runtime("same_meta"), args=[copy.deepcopy(refs[0]), copy.deepcopy(r)], keywords=[]) for r in refs[1:]]
            temp = ctx.fresh(side)
            merged.append(assign_to(store_name(temp), select.selected(conds, refs, ctx, grad=False)))
            self.values[temp] = _one_of(values)
            env[target] = temp
            known.add(target)
        rest: list[ast.stmt] = [*merged]
        check = all_of(checks)  # a BoolOp of one does not compile
        self.out.append(ast.If(test=check, body=rest, orelse=[fallback_marker()]))
        self.out = rest
        self._note("a nested if is selected with torch.where too")

    def _static(self, node: ast.If, env: dict[str, str], known: set[str], side: str) -> None:
        """``if <static test>: A else: B`` inside a branch (``self.bias is not None``):
        a Python ``if`` Dynamo decides while tracing, each side computed inside it
        and every name they assign brought to one temporary on both sides. Its
        sides may hold assignments only."""
        code = ast.unparse(node.test)
        self._value(node.test, env, known, None, f"the nested test `{code}`")  # safe on every call
        test = Substitute(env).visit(copy.deepcopy(node.test))
        sides: list[list[ast.stmt]] = []
        envs = []
        outer = self.out
        # A guard a side needs holds only where that side runs: `h + self.bias` under
        # `self.bias is not None` (the test is read before the if when no name it reads changed).
        conditional = self.guards is not None and not any(isinstance(n, ast.Name) and n.id in env for n in ast.walk(node.test))
        for index, block in enumerate((node.body, node.orelse)):
            if not all(isinstance(n, ast.Assign) for n in as_written(block, self.ctx)):
                raise Decline(f"the static nested if on `{code}` holds a statement other than an assignment")
            self.out = []
            before = len(self.guards) if self.guards is not None else 0
            envs.append(self.branch(block, side, None, env=dict(env), last=False))  # effects decline (no `taken`)
            sides.append(self.out)
            if conditional and len(self.guards) > before:  # type: ignore[arg-type]
                needed = self.guards[before:]  # type: ignore[index]
                both = all_of(needed)
                taken, other = (both, ast.Constant(True)) if index == 0 else (ast.Constant(True), both)
                self.guards[before:] = [ast.IfExp(test=copy.deepcopy(node.test), body=taken, orelse=other)]  # type: ignore[index]
        self.out = outer
        for target in dict.fromkeys(t for e in envs for t in e):
            values = [e.get(target, env.get(target, target if target in known or target.startswith("self.") else "")) for e in envs]
            if "" in values:
                self.dropped.add(target)
                continue
            temp = self.ctx.fresh(side)
            for out, value in zip(sides, values):
                out.append(assign_to(store_name(temp), select.ref(value)))
            self.values[temp] = _one_of(values)
            env[target] = temp
            known.add(target)
        self.out.append(ast.If(test=test, body=sides[0] or [ast.Pass()], orelse=sides[1]))
        self.nested += 1
        self._note("a nested if on a static test stays a Python if, decided while tracing")

    def _regate(self, trapped: tuple[str, ast.Call], taken: ast.expr, env: dict[str, str], known: set[str]) -> ast.stmt:
        """A check [Trap] already rewrote inside this branch: it may only fire
        when its branch would have run, so its flag is and-ed with the test."""
        ctx = self.ctx
        flag_name, call = trapped
        if flag_name not in env:
            raise Decline("a trapped check whose flag is not computed in the same branch")
        site, flag, exc, args = call.args
        empty = self._emptiness(env)
        for reason in deferred_blockers(args, self.facts, known | set(env), empty):
            raise Decline(f"the message of a check in the branch: {reason}")
        add_guards(empty, ctx, self.guards)  # type: ignore[arg-type]
        flag = Substitute(env).visit(copy.deepcopy(flag))
        ctx.notes.append("a validation check inside the branch fires only when its branch would have run")
        regated = ast.Call(
            func=ctx.runtime("trap"),
            args=[
                copy.deepcopy(site),
                ast.Call(func=ctx.runtime("gate"), args=[taken, flag], keywords=[]),
                copy.deepcopy(exc),
                Substitute(env).visit(copy.deepcopy(args)),
            ],
            keywords=_kept_as_at_check(call.keywords, env),
        )
        return ast.Expr(value=regated)


def _kept_as_at_check(keywords: list[ast.keyword], env: dict[str, str]) -> list[ast.keyword]:
    """A trap's ``keep=(self, names, tensor names)``, the attributes put back when
    it raises, with the attributes the branch stored before the check: the
    merged branch stores them after the trap, so the trap sets each to its
    value at the check when it raises, as the original left it (``(name, value)``
    pairs, ``runtime.records.stored_at_check``; a pair a merge inside the
    branch already wrote stays)."""
    keep = next((k.value for k in keywords if k.arg == "keep"), None)
    parts = [copy.deepcopy(p) for p in keep.elts] if isinstance(keep, ast.Tuple) else [load_name("self"), _strings(()), _strings(())]
    pairs = Substitute(env).visit(parts[3]).elts if len(parts) > 3 else []
    paired = {p.elts[0].value for p in pairs}
    stored = sorted(k[5:] for k in env if k.startswith("self.") and "." not in k[5:] and k[5:] not in paired)
    pairs += [ast.Tuple(elts=[ast.Constant(n), select.ref(env[f"self.{n}"])], ctx=ast.Load()) for n in stored]
    if not pairs:
        return copy.deepcopy(keywords)
    keep = ast.Tuple(elts=[*parts[:3], ast.Tuple(elts=pairs, ctx=ast.Load())], ctx=ast.Load())
    return [k for k in copy.deepcopy(keywords) if k.arg != "keep"] + [ast.keyword(arg="keep", value=keep)]


def _strings(values: tuple) -> ast.Tuple:
    return ast.Tuple(elts=[ast.Constant(v) for v in values], ctx=ast.Load())


def tied_after(fdef: ast.AST, stmt: ast.If, target: str, roots: set[str], sharing: Sharing, made: str) -> None:
    """Declines a new tensor for ``target`` (a select, torch.cond's output) where eager's
    value stays tied to another tensor after the if and that one changes in place later:
    the name itself, or what a path's value may be or view (``roots``: ``v = s.detach()``
    with ``s.add_(1)`` after the if; a local that may share it too)."""
    mutated = updated_after(fdef, stmt, target)  # type: ignore[arg-type]
    if mutated is not None:
        raise Decline(
            f"`{target}` is updated in place after the if (line {mutated.lineno}): {made}, where the original "
            "kept the one the path assigned (which other names may share)"
        )
    for name in sorted(roots | {n for r in roots if not sharing.is_outside(r) for n in sharing.sharers(r)}):
        mutated = updated_after(fdef, stmt, name)  # type: ignore[arg-type]
        if mutated is not None:
            raise Decline(
                f"`{target}` may be `{name}` or a view of it on a path, and `{name}` is updated in place after "
                f"the if (line {mutated.lineno}): {made}"
            )
