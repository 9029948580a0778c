"""[Where] predicated control flow (category: DC).

## What it rewrites
A Python ``if`` whose test is a tensor:

* two branches that assign names (one or several): ``if c: y = a else: y = b``;
* two branches that each ``return`` a value (after assignments to names);
* an early return, ``if c: return a`` at the top level of the function,
  followed by assignments and ``return b``: the rest of the function is
  computed too and one value selected (the original rest stays after it, for
  calls the guards send to the original). Early returns in a row, and a
  return in a nested ``if``, become one return: each path assigns one fresh
  name, the way it would have ended (``_where_branch.one_return``). Likewise when some branches of an
  ``if/else`` or ``elif`` chain return and the others do not: those continue
  with the rest of the function (its prints performed only on their path);
* ``if/elif/.../else`` chains of any length of either kind, as nested
  selects: every test is evaluated up front (so a test after the first must
  be safe to evaluate on every call) and every branch computed (where branches
  call modules, nested ``torch.cond``, one per test);
* in-place updates in a branch (``t.add_(v)``, ``copy_``, ``mul_``...): computed
  out of place, what follows in the branch reading the temporary, and copied
  back, ``t.copy_(torch.where(c, new, t))``;
* an update without ``else``: ``if c: h = f(h)``, including several
  statements, body-local temporaries (a name no later path reads before
  assigning it), and ``self.<attr> = ...`` stores;
* inside a branch: a nested ``if``/``elif``/``else`` of the same kinds (selected with
  ``torch.where`` too, ``_where_branch.py``), prints, logs and warnings
  [Defer] rewrote and checks [Trap] rewrote (performed or raised only when
  their branch would have run), also as a branch's only statements;
* tests built with ``and`` / ``or`` / ``not`` over tensor reductions, lowered
  to ``torch.logical_and/or/not``; where an operand is not provably a tensor
  (a name assigned twice), to the runtime's ``tensor_and/or/not``, which
  Dynamo resolves while tracing (a Python bool operand decides or drops out;
  anything else runs the test as written). Static operands first
  (``h.dtype == torch.float16 and ...``, ``bias is not None and ...``,
  ``flag or ...``) stay a Python ``if`` around the predicated part (for
  ``or``, the static ``if`` runs the branch as written).

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
a branch would lose a later ``self.count += 1``). ``h, s = self._helper(h, s)``:
a method of pure source, and ``type(self)._helper is Owner._helper`` (decided
while tracing) sends a subclass's own method, never proven, to the original.

## When it declines
- ``while`` loops, branches with statements other than assignments (or a
  single ``return`` each), tuple targets (but ``torch.cond``'s); an ``elif`` test that could raise
  or act on a call where the original never reached it (a static operand that
  may guard the next, ``x is not None and ...``, lets what follows run only where
  it holds: ``(...) if x is not None else False``, decided while tracing; a
  metadata operand such as ``h.dim() > 2 or ...`` too); an early return inside a
  loop or block, or in a function that does not end in ``return <value>``;
- a branch value that could raise or act when its branch was not taken:
  calls outside the pure torch functions and tensor methods, in-place
  methods, indexing that can go out of range, names unbound on that path, a
  reduction with no identity element (``amax``, ``max``, ``.item()``, which
  raise on an empty tensor; ``torch.cond`` traces the branch not taken on the
  call's shapes too) of a tensor bound inside the branch. Of a tensor bound
  before the ``if`` it is guarded instead (``runtime.nonempty``: an empty one
  takes the original branch), unless the test reduced it whole already; an
  operation that raises on the tensor's dtype or shape (``h - 1`` on bool,
  ``h.view(2, 2)``, ``h + b`` that does not broadcast) unless the test proves
  it cannot, or a guard decided while tracing checks it (``runtime.is_kind``,
  ``has_dims``, ``broadcastable``: ``analysis/dtypes.py``, ``shapes.py``);
- ``torch.cond`` when an attribute store (``x.a = ...``, ``+=``, ``setattr``)
  may run before it in the compiled frame: earlier in the function (anywhere
  in it inside a loop) or in the ``forward`` of one of the model's own module
  classes and the methods it calls as ``self.name(...)``. Dynamo (torch 2.13
  and 2.14, ``compat.TorchRelease.cond_drops_later_stores``) then drops the
  attribute stores made after the cond (measured with hand-written
  ``torch.cond``); or when a branch or a helper it calls holds what Dynamo
  traces there only with ``fullgraph=True`` (``analysis/traceable.py``): a
  value-shaped operation (``h[h > 0]``, ``.item()``) or a test on tensor values;
- a name assigned on one path only and read after the ``if``; a
  ``self.<attr>`` store where no module of the model has that attribute yet
  (the select reads it on every call) or it holds a Python number;
- an in-place update followed in its branch by a statement that reads a name
  that may share the updated tensor's storage (``v = t[0]`` earlier: eagerly
  ``v`` shows the update) or that may come from outside; of a name a path assigns;
- a selected name updated in place after the ``if`` (``h.add_(1)``,
  ``h[0] = 0``, ``h += 1``): the select makes a new tensor, where the
  original path kept the one it assigned, which other names (the caller's
  input) may share;
- a nested ``if`` on a static test, or assigning a name on some of its
  paths only that is read after the site.

## Autograd
A select of names (not ``self.<attr>`` stores, not ``torch.cond``) also runs
under autograd, with eager's gradients (``runtime.predicable_with_grad``;
``analysis/gradients.py``):
- a branch whose operations could turn the zero gradients the select feeds
  it when not taken into NaN (``0 * inf``: ``sqrt`` at 0, ``exp`` past
  overflow, a product of two tensors) reads its inputs through
  ``runtime.grad_gate`` (the value where it runs, ``value.detach()`` where
  not), so it adds exact zeros; sums, selects, masks and products with a
  constant need no gate;
- what one branch alone may reach (``h * self.w`` with no ``self.w`` on the
  other path) would get a zero ``.grad`` where eager leaves ``None``, which
  optimizers treat differently: ``runtime.grad_free`` sends the call to the
  original branch while such a value requires grad. The report says which.
Other forms run the original branch under autograd.

## Fix safety
Exact by construction when it applies: the original branch is kept for every
case the guards reject.
"""

from __future__ import annotations

import ast
import copy

import torch

from graphmend.analysis.callers import updated_by_callers
from graphmend.analysis.facts import (
    FunctionFacts,
    bound_before,
    live_after,
)
from graphmend.analysis.gradients import (
    Reach,
    block_reach,
    checked_at_run_time,
    prior_reach,
    reach,
)
from graphmend.analysis.purity import (
    Emptiness,
    speculation_blockers,
    stores,
    tested,
)
from graphmend.analysis.speculated import Tested
from graphmend.rules import Decline, RewriteContext, Rule, register
from graphmend.rules import _where_select as select
from graphmend.rules._ast import (
    Substitute,
    all_of,
    assign_to,
    load_name,
    store_name,
)
from graphmend.rules._predicate import (
    add_guards,
    has_boolops,
    is_static_test,
    lower,
    pre_guarded,
    when_ok,
)
from graphmend.rules._where_branch import (
    Speculation,
    fill_fallback,
    has_nested_if,
    one_return,
)
from graphmend.rules._where_call import TrailingCallForm
from graphmend.rules._where_cond import CondForm
from graphmend.rules._where_select import Arm


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
        facts = FunctionFacts.of(ctx.fdef, ctx.globals, ctx.local_names)
        arms = select.arms(stmt, ctx)
        if len(arms) > 2:
            return self._chain(stmt, arms, facts, ctx)
        static, tensor_test = self._split_test(stmt.test, facts)
        bound = bound_before(ctx.fdef, stmt)
        pre: list[ast.expr] = []  # guards the lowered test needs, checked before it is evaluated
        if has_boolops(tensor_test):  # lowering evaluates every operand, not just the first
            proof = tested(tensor_test, facts)
            empty = Emptiness(proof.nonempty, frozenset(bound), proven=proof.kinds)
            for reason in speculation_blockers(tensor_test, facts, bound, empty):
                raise Decline(f"the test: {reason}")
            add_guards(empty, ctx, pre)
        lowered = lower(tensor_test, facts, ctx)
        cond = ctx.fresh("c")
        original_test = load_name(cond) if lowered is tensor_test else copy.deepcopy(tensor_test)
        fallback = ast.If(test=original_test, body=copy.deepcopy(stmt.body), orelse=copy.deepcopy(stmt.orelse))
        completed = self._with_rest([stmt.body, stmt.orelse], stmt, ctx)
        two_way = [(cond, stmt.body), (None, stmt.orelse)] if completed is None else [(cond, completed[0]), (None, completed[1])]
        proof = tested(tensor_test, facts)

        guards: list[ast.expr] = []
        if completed is not None:
            predicated, grad = self._returns(stmt, two_way, facts, bound, ctx, guards, proof)
            ctx.notes.append("early return predicated with torch.where: the rest of the function computed too")
        elif all(select.returns_a_value(block) for _, block in two_way):
            predicated, grad = self._returns(stmt, two_way, facts, bound, ctx, guards, proof)
            ctx.notes.append("if/else returns predicated with torch.where")
        elif self._is_trailing_call_form(stmt):
            predicated, grad = self._trailing_call(stmt, cond, facts, bound, ctx, guards), None
        else:
            try:
                predicated, grad = self._assignments(stmt, two_way, facts, bound, ctx, guards, proof)
            except Decline as where_reason:
                predicated, grad = self._cond_instead(stmt, two_way, where_reason, facts, bound, ctx, guards, proof), None
        guarded = self._guarded([(cond, lowered)], guards, grad, predicated, fallback, ctx, pre, {cond} if pre else set())
        if static is not None and isinstance(stmt.test, ast.BoolOp) and isinstance(stmt.test.op, ast.Or):
            ctx.notes.append(f"static test `{ast.unparse(static)}` kept as a Python if, its branch as written")
            out: list[ast.stmt] = [ast.If(test=static, body=copy.deepcopy(stmt.body), orelse=guarded)]
        elif static is not None:
            ctx.notes.append(f"static test `{ast.unparse(static)}` kept as a Python if")
            out = [ast.If(test=static, body=guarded, orelse=copy.deepcopy(stmt.orelse))]
        else:
            out = guarded
        return select.placed(out, stmt)

    def _chain(self, stmt: ast.If, arms: list[Arm], facts: FunctionFacts, ctx: RewriteContext) -> list[ast.stmt]:
        """``if t0: B0 elif t1: B1 ... else: E``: every test evaluated up front, every
        branch computed, the result selected with nested ``torch.where``. A test after
        the first ran only when the ones before were false: it must be safe to
        evaluate on every call (pure, no reduction of a possibly empty tensor)."""
        bound = bound_before(ctx.fdef, stmt)
        tests: list[tuple[str, ast.expr]] = []
        named: list[Arm] = []
        pre: list[ast.expr] = []  # guards the tests evaluated up front need
        speculated: set[str] = set()
        proof = Tested()  # what the tests so far prove
        for index, (test, body) in enumerate(arms):
            if test is None:
                named.append((None, body))
                break
            where = "the test" if index == 0 else f"the elif test `{ast.unparse(test)}`"
            # A static operand (`h.dim() > 2 or ...`) is evaluated up front with the rest: the
            # runtime's tensor_and / tensor_or decide it while tracing (_predicate.lower).
            if index > 0 or has_boolops(test):  # evaluated where the original might not have
                known = tested(test, facts) if index == 0 else proof
                empty = Emptiness(known.nonempty, frozenset(bound), proven=known.kinds)
                for reason in speculation_blockers(test, facts, bound, empty):
                    raise Decline(f"{where}: {reason}")
                add_guards(empty, ctx, pre)
            proof = proof.and_(tested(test, facts))
            cond = ctx.fresh("c")
            if index > 0 or has_boolops(test):
                speculated.add(cond)
            tests.append((cond, lower(test, facts, ctx)))
            named.append((cond, body))
        guards: list[ast.expr] = []
        completed = self._with_rest([body for _, body in named], stmt, ctx)
        if completed is not None or all(select.returns_a_value(body) for _, body in named):
            blocks = completed or [body for _, body in named]
            predicated, grad = self._returns(
                stmt, [(c, b) for (c, _), b in zip(named, blocks)], facts, bound, ctx, guards, proof
            )
            ctx.notes.append(f"if/elif returns ({len(named)} ways) predicated with nested torch.where")
        else:
            try:
                predicated, grad = self._assignments(stmt, named, facts, bound, ctx, guards, proof)
            except Decline as where_reason:
                predicated, grad = self._cond_instead(stmt, named, where_reason, facts, bound, ctx, guards, proof), None
        speculated = speculated if pre else set()  # evaluated only when the guards hold: as written in the original
        as_written = {cond: test for (cond, lowered), (test, _) in zip(tests, arms) if lowered is not test or cond in speculated}
        fallback = select.original(named, as_written)  # a lowered test runs as written there
        return select.placed(self._guarded(tests, guards, grad, predicated, fallback, ctx, pre, speculated), stmt)

    @staticmethod
    def _guarded(
        tests: list[tuple[str, ast.expr]],
        guards: list[ast.expr],
        grad: list[str] | None,
        predicated: list[ast.stmt],
        fallback: ast.stmt,
        ctx: RewriteContext,
        pre: list[ast.expr],
        speculated: set[str],
    ) -> list[ast.stmt]:
        """The tests bound to names, then the predicated code where every test is
        ``predicable`` and every guard holds, else the original. ``grad``: the form
        keeps eager's gradients once these roots are ``grad_free`` (None: it does not,
        and autograd takes the original). ``pre``: guards the ``speculated`` tests
        need, checked first (``ok``); where they fail those tests are not evaluated
        (None) and the original runs them as written."""
        check = "predicable" if grad is None else "predicable_with_grad"
        checks: list[ast.expr] = [ast.Call(func=ctx.runtime(check), args=[load_name(c)], keywords=[]) for c, _ in tests]
        if grad:
            checks.append(ast.Call(func=ctx.runtime("grad_free"), args=[select.root_expr(r) for r in grad], keywords=[]))
            names = ", ".join(f"`{r}`" for r in grad)
            ctx.notes.append(
                f"under autograd only while {names} need no grad: one branch alone reaches them, "
                "and eager leaves their .grad None when it is not taken"
            )
        checks += guards
        if grad is None:
            ctx.notes.append("under autograd the original branch runs")
        before: list[ast.stmt] = []
        if pre:
            assign, ok = pre_guarded(ctx, pre)
            before.append(assign)
            checks.insert(0, load_name(ok))
            tests = [(c, when_ok(ok, t) if c in speculated else t) for c, t in tests]
        check = all_of(checks)
        fill_fallback(predicated, fallback)  # a nested if's check that fails: the original statement
        return [
            *before,
            *(assign_to(store_name(cond), lowered) for cond, lowered in tests),
            ast.If(test=check, body=predicated, orelse=[fallback]),
        ]

    # -- the test ----------------------------------------------------------------

    def _tested(self, stmt: ast.If, facts: FunctionFacts) -> Tested:
        """What the tensor part of the test proves before a branch runs."""
        return tested(self._split_test(stmt.test, facts)[1], facts)

    def _split_test(self, test: ast.expr, facts: FunctionFacts) -> tuple[ast.expr | None, ast.expr]:
        """(static operand or None, tensor part) of ``s and t`` or ``s or t``: the
        static operands (all of them first) become a Python ``if``, their ``and`` /
        ``or`` kept (``isinstance(test, ast.BoolOp)`` and its ``op`` tell which)."""
        if isinstance(test, ast.BoolOp):
            static = [v for v in test.values if is_static_test(v, facts)]
            dynamic = [v for v in test.values if not is_static_test(v, facts)]
            if static and dynamic:
                if test.values.index(dynamic[0]) < test.values.index(static[-1]):
                    raise Decline("a static operand after a tensor operand would change evaluation order")
                static_expr = static[0] if len(static) == 1 else ast.BoolOp(op=copy.deepcopy(test.op), values=static)
                tensor = dynamic[0] if len(dynamic) == 1 else ast.BoolOp(op=copy.deepcopy(test.op), values=dynamic)
                return static_expr, tensor
        return None, test

    # -- return form -------------------------------------------------------------

    @staticmethod
    def _with_rest(blocks: list[list[ast.stmt]], stmt: ast.If, ctx: RewriteContext) -> list[list[ast.stmt]] | None:
        """For an ``if`` some of whose branches return (``if c: ...; return a``) and
        others not (an ``else`` that assigns, or none), at the top level of the
        function and followed by statements that end in ``return b``: each branch
        that does not return followed by those statements (its path to the end).
        None when every branch returns or none does."""
        returning = [select.returns_a_value(block) for block in blocks]
        if all(returning) or not any(select.has_return(block) for block in blocks):
            return None
        index = next((i for i, node in enumerate(ctx.fdef.body) if node is stmt), None)
        if index is None:
            raise Decline("an early return inside a loop or block: the rest of the function is not one straight path")
        rest = ctx.fdef.body[index + 1 :]
        if not select.returns_a_value(rest):
            raise Decline("an early return where the function does not end in `return <value>`")
        return [block if done else [*block, *rest] for block, done in zip(blocks, returning)]  # _returns flattens

    def _returns(
        self,
        stmt: ast.If,
        arms: list[Arm],
        facts: FunctionFacts,
        bound: set[str],
        ctx: RewriteContext,
        guards: list[ast.expr],
        proof: Tested,
    ) -> tuple[list[ast.stmt], list[str] | None]:
        """Each branch (assignments to names, then ``return v``) into temporaries, the
        selected value returned; with the roots ``grad_free`` must clear for autograd."""
        values = []
        body: list[ast.stmt] = []
        spec = Speculation(facts, bound, ctx, body, guards, proof)
        is_function = select.functions(facts, ctx)
        conds = [cond for cond, _ in arms if cond is not None]
        # Gates know assignments only; an attribute store under autograd would keep a graph in the module.
        grad = not any(has_nested_if(block, ctx) or any(isinstance(n, ast.Attribute) for n in stores(block)) for _, block in arms)
        reaches = []
        envs = []
        prior = prior_reach(ctx.fdef.body, stmt, facts.assignments, is_function)  # what names before the if reach
        for index, (_, block) in enumerate(arms):
            *setup, ret = one_return(block, ctx)
            if select.has_return(setup):
                raise Decline("a return before the end of a branch, not under an if")
            assert isinstance(ret, ast.Return) and ret.value is not None
            _handed_back([n.id for n in ast.walk(ret.value) if isinstance(n, ast.Name)], ctx)
            assignments = select.assigned(setup)
            when = select.taken(conds, index, ctx)
            gates = select.gated([*assignments, ("", ret.value)], when, is_function, ctx, spec.out) if grad else {}
            stem = select.side(index, len(arms))
            env = spec.branch(setup, stem, when, gates)
            envs.append(env)
            empty = Emptiness(proof.nonempty - set(env), frozenset(bound) - set(env), **vars(spec.dtypes(env)))
            for reason in speculation_blockers(ret.value, facts, bound | set(env), empty):
                raise Decline(f"a returned value: {reason}")
            add_guards(empty, ctx, guards)
            temp = ctx.fresh(stem)
            spec.out.append(assign_to(store_name(temp), Substitute({**gates, **env}).visit(copy.deepcopy(ret.value))))
            values.append(temp)
            reached, _ = block_reach(assignments, is_function, prior)
            reaches.append(reach(ret.value, reached, is_function))
        same = [ast.Call(func=ctx.runtime("same_meta"), args=[load_name(values[0]), load_name(v)], keywords=[]) for v in values[1:]]
        chosen = load_name(values[-1])
        for cond, value in reversed(list(zip(conds, values))):
            chosen = ast.IfExp(test=load_name(cond), body=load_name(value), orelse=chosen)
        checks, selected_stores, path_stores = self._attribute_stores(envs, conds, ctx)
        spec.out.extend(spec.pending)
        spec.out.append(
            ast.If(
                test=all_of(same + checks),
                body=[*selected_stores, ast.Return(value=select.selected(conds, [load_name(v) for v in values], ctx, grad=True))],
                orelse=[*path_stores, ast.Return(value=chosen)],
            )
        )
        return body, checked_at_run_time(reaches) if grad else None

    def _attribute_stores(
        self, envs: list[dict[str, str]], conds: list[str], ctx: RewriteContext
    ) -> tuple[list[ast.expr], list[ast.stmt], list[ast.stmt]]:
        """The ``self.<attr>`` values the paths of a returning form store: the checks that
        their select is exact, the selected stores, and the stores of the path taken alone
        (where a check fails)."""
        checks: list[ast.expr] = []
        selected: list[ast.stmt] = []
        plain: list[list[ast.stmt]] = [[] for _ in envs]
        for target in dict.fromkeys(t for env in envs for t in env if t.startswith("self.")):
            _selectable_attribute(target, ctx)
            values = [env.get(target, target) for env in envs]
            checks += select.same_meta_checks(values, ctx)
            chosen = select.selected(conds, [select.ref(v) for v in values], ctx, grad=False)
            selected.append(self._store_stmt(target, chosen, ctx))
            for index, value in enumerate(values):
                if value != target:
                    plain[index].append(self._store_stmt(target, select.ref(value), ctx, plain=True))
        if not selected:
            return [], [], []
        ctx.notes.append("the attributes a path stores are selected too")
        return checks, selected, select.by_path(conds, plain)

    # The torch.cond form (CondForm) and the trailing-call forms (TrailingCallForm)
    # are in _where_cond.py and _where_call.py.

    # -- assignment form ---------------------------------------------------------

    def _assignments(
        self,
        stmt: ast.If,
        arms: list[Arm],
        facts: FunctionFacts,
        bound: set[str],
        ctx: RewriteContext,
        guards: list[ast.expr],
        proof: Tested,
    ) -> tuple[list[ast.stmt], list[str] | None]:
        """Each branch's assignments into temporaries, each target selected; with the
        roots ``grad_free`` must clear for autograd (None: autograd takes the original)."""
        body: list[ast.stmt] = []
        conds = [cond for cond, _ in arms if cond is not None]
        is_function = select.functions(facts, ctx)
        inplace: set[str] = set()
        spec = Speculation(facts, bound, ctx, body, guards, proof, inplace)
        # A store to self.<attr> or an in-place update under autograd would keep a graph
        # in the module, or bump a saved tensor's version: autograd takes the original
        # (and for a nested if, whose assignments the gates do not see).
        grad = not any(
            key.startswith("self.") for _, block in arms for key, _ in select.assigned(block)
        ) and not any(select.in_place(node) for _, block in arms for node in block) and not any(
            has_nested_if(block, ctx) for _, block in arms
        )
        envs = []
        for index, (_, block) in enumerate(arms):
            when = select.taken(conds, index, ctx)
            gates = select.gated(select.assigned(block), when, is_function, ctx, spec.out) if grad else {}
            stem = select.side(index, len(arms))
            envs.append(spec.branch(block, stem, when, gates))
        for name in sorted(spec.dropped):
            if live_after(ctx.fdef, stmt, name):
                raise Decline(f"`{name}` is assigned on some paths of a nested if only and read after the if")
        targets = list(dict.fromkeys(target for env in envs for target in env))
        effects = bool(spec.pending)  # a deferred effect or check, gated
        if not targets and not effects:
            raise Decline("the branches assign nothing")
        selects: list[tuple[str, list[str]]] = []  # (target, its value on each path: a temp, or the target unchanged)
        for target in targets:
            is_attr = target.startswith("self.")
            if is_attr:
                _selectable_attribute(target, ctx)
            pre_bound = is_attr or target in bound
            if not pre_bound and not all(target in env for env in envs):
                if live_after(ctx.fdef, stmt, target):
                    raise Decline(f"`{target}` is assigned on one path only and read after the if")
                continue  # a temporary of one branch, never read afterwards
            values = [env.get(target, target) for env in envs]
            if not is_attr and target not in inplace:  # copied back in place: the tensor it was
                spec.kept_after(stmt, target, values)
                _handed_back([target], ctx)
            selects.append((target, values))
        if not selects and effects and not spec.nested:
            ctx.notes.append("effects only: each happens when its branch would have run")
            spec.out.extend(spec.pending)
            return body, []
        if not selects:
            raise Decline("the branches only assign temporaries")
        guard = all_of([check for _, values in selects for check in select.same_meta_checks(values, ctx)])
        predicated: list[ast.stmt] = []
        chosen: list[list[ast.stmt]] = [[] for _ in arms]
        for target, values in selects:
            chosen_value = select.selected(conds, [select.ref(v) for v in values], ctx, grad)
            if target in inplace:
                copy_back = ast.Attribute(value=select.ref(target), attr="copy_", ctx=ast.Load())
                predicated.append(ast.Expr(value=ast.Call(func=copy_back, args=[chosen_value], keywords=[])))
            else:
                predicated.append(self._store_stmt(target, chosen_value, ctx))
            for index, value in enumerate(values):
                if value != target:
                    chosen[index].append(self._store_stmt(target, select.ref(value), ctx, plain=True))
        plain = select.by_path(conds, chosen)
        if inplace:  # the values computed are pure: the original statements run instead (effects too)
            plain = [select.original(arms)]
            predicated[:0] = spec.pending
        else:
            spec.out.extend(spec.pending)
        spec.out.append(ast.If(test=guard, body=predicated, orelse=plain))
        kinds = "in place" if inplace else "buffer/attribute" if any(t.startswith("self.") for t, _ in selects) else "names"
        shape = f"if/elif ({len(arms)} ways)" if len(arms) > 2 else ("if/else" if arms[-1][1] else "if")
        nested = "nested torch.where" if len(arms) > 2 else "torch.where"
        ctx.notes.append(f"{shape} predicated with {nested} ({', '.join(t for t, _ in selects)}; {kinds})")
        if not grad:
            return body, None
        reaches = []
        prior = prior_reach(ctx.fdef.body, stmt, facts.assignments, is_function)  # what names before the if reach
        for index, (_, block) in enumerate(arms):
            reached, _ = block_reach(select.assigned(block), is_function, prior)
            unchanged = [prior.get(t, Reach(frozenset({t}), frozenset({t}))) for t, values in selects if values[index] == t]
            reaches.append(Reach().union(*(reached[t] for t, values in selects if values[index] != t), *unchanged))
        return body, checked_at_run_time(reaches)

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


def _handed_back(names: list[str], ctx: RewriteContext) -> None:
    """Declines where a caller may update in place a tensor a path hands back as it is."""
    for name in names:
        reason = updated_by_callers(ctx.chains, ctx.fdef, name)
        if reason:
            raise Decline(
                f"`{name}` is returned as it is and {reason}: the select hands back a new tensor, where the "
                "original handed back the one the path assigned"
            )


def _selectable_attribute(target: str, ctx: RewriteContext) -> None:
    """Decline a ``self.<attr>`` select the live model cannot take: the attribute holds a
    Python number, or no module has it yet (the select reads it on every call, where the
    original read it only on the path that stores it)."""
    values = ctx.attribute_values(target[5:])
    if any(type(v) in (bool, int, float) for v in values):
        raise Decline(f"`{target}` holds a Python number: a select needs a tensor (the original would always run)")
    if isinstance(ctx.model, torch.nn.Module) and not values:
        raise Decline(f"`{target}` is not set on the model before the if: the select would read it where the original does not")
