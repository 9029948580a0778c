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
  methods, indexing that can go out of range, names unbound on that path;
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

from graphmend.analysis.facts import (
    FunctionFacts,
    bound_before,
    is_tensor_expr,
    speculation_blockers,
)
from graphmend.rules import Decline, RewriteContext, Rule, register
from graphmend.rules._predicate import check_lowerable, has_boolops, lower


def _load(name: str) -> ast.Name:
    return ast.Name(id=name, ctx=ast.Load())


def _store(name: str) -> ast.Name:
    return ast.Name(id=name, ctx=ast.Store())


def _assign(target: ast.expr, value: ast.expr) -> ast.Assign:
    return ast.Assign(targets=[target], value=value, lineno=0)


def _is_self_attr(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


class _Substitute(ast.NodeTransformer):
    """Replace loads of names / self attributes already speculated into temporaries."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if isinstance(node.ctx, ast.Load) and node.id in self.env:
            return ast.copy_location(_load(self.env[node.id]), node)
        return node

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        key = ast.unparse(node) if _is_self_attr(node) else None
        if key is not None and isinstance(node.ctx, ast.Load) and key in self.env:
            return ast.copy_location(_load(self.env[key]), node)
        self.generic_visit(node)
        return node


@register
class Where(Rule):
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
            for reason in speculation_blockers(tensor_test, facts, bound):
                raise Decline(f"the test: {reason}")
        check_lowerable(tensor_test, facts)
        lowered = lower(tensor_test, facts, ctx)
        cond = ctx.fresh("c")
        original_test = _load(cond) if lowered is tensor_test else copy.deepcopy(tensor_test)
        fallback = ast.If(test=original_test, body=copy.deepcopy(stmt.body), orelse=copy.deepcopy(stmt.orelse))

        guards: list[ast.expr] = []
        if self._is_return_form(stmt):
            predicated = self._returns(stmt, cond, facts, bound, ctx)
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
        check: ast.expr = ast.Call(func=ctx.runtime("predicable"), args=[_load(cond)], keywords=[])
        if guards:
            check = ast.BoolOp(op=ast.And(), values=[check, *guards])
        guarded: list[ast.stmt] = [
            _assign(_store(cond), lowered),
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

    def _returns(self, stmt: ast.If, cond: str, facts: FunctionFacts, bound: set[str], ctx: RewriteContext) -> list[ast.stmt]:
        values = []
        body: list[ast.stmt] = []
        for ret, side in ((stmt.body[0], "t"), (stmt.orelse[0], "f")):
            assert isinstance(ret, ast.Return) and ret.value is not None
            for reason in speculation_blockers(ret.value, facts, bound):
                raise Decline(f"a returned value: {reason}")
            temp = ctx.fresh(side)
            body.append(_assign(_store(temp), copy.deepcopy(ret.value)))
            values.append(temp)
        where = ast.Call(func=ctx.torch("where"), args=[_load(cond), _load(values[0]), _load(values[1])], keywords=[])
        body.append(
            ast.If(
                test=ast.Call(func=ctx.runtime("same_meta"), args=[_load(values[0]), _load(values[1])], keywords=[]),
                body=[ast.Return(value=where)],
                orelse=[ast.Return(value=ast.IfExp(test=_load(cond), body=_load(values[0]), orelse=_load(values[1])))],
            )
        )
        return body

    # -- torch.cond: branches that call modules or functions -----------------------

    def _cond(
        self,
        stmt: ast.If,
        cond: str,
        facts: FunctionFacts,
        bound: set[str],
        ctx: RewriteContext,
        guards: list[ast.expr],
    ) -> list[ast.stmt]:
        """Run only the branch the test picks, inside the graph, with torch.cond.

        Chosen when a branch calls modules or functions: computing both sides
        would double their cost (or run effects). The callees must be pure:
        standard stateless torch.nn layers in eval mode (checked while
        tracing), or functions whose source is pure."""
        targets: list[str] = []
        for block in (stmt.body, stmt.orelse):
            for node in block:
                if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
                    raise Decline("a branch holds a statement other than an assignment to a name")
                if node.targets[0].id not in targets:
                    targets.append(node.targets[0].id)
        read_after = self._read_outside(ctx.fdef, stmt)
        outputs: list[str] = []
        for name in targets:
            in_true = any(n.targets[0].id == name for n in stmt.body)  # type: ignore[attr-defined]
            in_false = any(n.targets[0].id == name for n in stmt.orelse)  # type: ignore[attr-defined]
            if not (in_true and in_false) and name not in bound:
                if name in read_after:
                    raise Decline(f"`{name}` is assigned on one path only and read after the if")
                continue
            outputs.append(name)
        if not outputs:
            raise Decline("the branches only assign temporaries")
        for block in (stmt.body, stmt.orelse):
            known = set(bound)
            for node in block:
                for name in sorted(n.id for n in ast.walk(node.value) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)):  # type: ignore[attr-defined]
                    if name in facts.local_names and name not in known:
                        raise Decline(f"`{name}` may be unbound in a branch")
                for call in (n for n in ast.walk(node.value) if isinstance(n, ast.Call)):  # type: ignore[attr-defined]
                    guard = self._pure_callee(call, facts, ctx)
                    if guard is not None:
                        guards.append(guard)
                known.add(node.targets[0].id)  # type: ignore[attr-defined]
        store = _attribute_store_before(stmt, ctx)
        if store is not None:
            raise Decline(
                f"{store} may run before it in the compiled frame, and Dynamo then drops "
                "attribute stores made after a torch.cond (torch 2.13)"
            )
        functions: list[ast.stmt] = []
        names: list[str] = []
        for side, block in (("true", stmt.body), ("false", stmt.orelse)):
            fname = ctx.fresh(f"{side}_branch")
            names.append(fname)
            env: dict[str, str] = {}
            inner: list[ast.stmt] = []
            for node in block:
                value = _Substitute(env).visit(copy.deepcopy(node.value))  # type: ignore[attr-defined]
                temp = ctx.fresh("t" if side == "true" else "f")
                inner.append(_assign(_store(temp), value))
                env[node.targets[0].id] = temp  # type: ignore[attr-defined]
            # torch.cond forbids returning an input as is: an unchanged value is cloned.
            result = ast.Tuple(
                elts=[
                    _load(env[o]) if o in env
                    else ast.Call(func=ast.Attribute(value=_load(o), attr="clone", ctx=ast.Load()), args=[], keywords=[])
                    for o in outputs
                ],
                ctx=ast.Load(),
            )
            functions.append(
                ast.FunctionDef(
                    name=fname,
                    args=ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]),
                    body=[*inner, ast.Return(value=result)],
                    decorator_list=[],
                    returns=None,
                )
            )
        call = ast.Call(
            func=ctx.torch("cond"),
            args=[_load(cond), _load(names[0]), _load(names[1]), ast.Tuple(elts=[], ctx=ast.Load())],
            keywords=[],
        )
        target = ast.Tuple(elts=[_store(o) for o in outputs], ctx=ast.Store())
        ctx.notes.append(
            f"torch.cond ({', '.join(outputs)}): the branches call modules or functions, so only the taken one runs"
        )
        held = self._held(stmt, outputs, facts, ctx)
        bind = ast.Expr(value=ast.Call(func=ctx.runtime("bind"), args=held, keywords=[]))
        return [*functions, *([bind] if held else []), _assign(target, call)]

    @staticmethod
    def _held(stmt: ast.If, outputs: list[str], facts: FunctionFacts, ctx: RewriteContext) -> list[ast.expr]:
        """The objects the branches reach, to show Dynamo before ``torch.cond``
        (``runtime.bind``): the names they read from outside (not torch, not
        builtins; an output a branch leaves unchanged is read there too) and
        the ``self.<attr>`` values they use, read with
        ``getattr(self, attr, None)`` unless the attribute is a property."""
        import inspect

        import torch

        names: list[str] = []
        attrs: list[str] = []
        for block in (stmt.body, stmt.orelse):
            assigned: set[str] = set()
            for node in block:
                for sub in ast.walk(node.value):  # type: ignore[attr-defined]
                    if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in assigned:
                        local = sub.id in facts.local_names
                        if (local or sub.id in ctx.globals) and not facts.resolves_to_torch(sub.id) and sub.id not in names:
                            names.append(sub.id)
                    if _is_self_attr(sub) and sub.attr not in attrs:  # type: ignore[union-attr]
                        attrs.append(sub.attr)  # type: ignore[union-attr]
                assigned.add(node.targets[0].id)  # type: ignore[attr-defined]
            names += [o for o in outputs if o not in assigned and o not in names]  # cloned as is
        held: list[ast.expr] = [_load(name) for name in names]
        modules = list(ctx.model.modules()) if isinstance(ctx.model, torch.nn.Module) else []
        for attr in attrs:
            if "self" not in names or any(isinstance(inspect.getattr_static(type(m), attr, None), property) for m in modules):
                continue
            held.append(
                ast.Call(func=_load("getattr"), args=[_load("self"), ast.Constant(attr), ast.Constant(None)], keywords=[])
            )
        return held

    _PURE_MODULES = (
        "Linear", "Bilinear", "Identity", "Conv1d", "Conv2d", "Conv3d", "LayerNorm", "RMSNorm", "GroupNorm",
        "Embedding", "ReLU", "GELU", "SiLU", "Tanh", "Sigmoid", "Softmax", "LogSoftmax", "LeakyReLU", "ELU",
        "Mish", "Hardtanh", "Dropout", "Flatten", "Sequential", "ModuleList",
    )

    def _pure_callee(self, call: ast.Call, facts: FunctionFacts, ctx: RewriteContext) -> ast.expr | None:
        """Prove a branch call side-effect free; returns a guard Dynamo checks while tracing."""
        import torch

        from graphmend.analysis.facts import (
            PURE_TENSOR_METHODS,
            PURE_TORCH_FUNCTIONS,
            function_impurities,
        )

        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and facts.resolves_to_torch(func.value.id):
            if func.attr in PURE_TORCH_FUNCTIONS:
                return None
            raise Decline(f"torch.{func.attr} is not on the list of pure torch functions")
        if isinstance(func, ast.Attribute) and func.value is not None and not _is_self_attr(func):
            if func.attr in PURE_TENSOR_METHODS:
                return None
            raise Decline(f"`.{func.attr}(...)` is not a known pure method")
        if _is_self_attr(func):
            modules = ctx.attribute_values(func.attr)  # type: ignore[union-attr]
            if not modules:
                raise Decline(f"`{ast.unparse(func)}` could not be resolved on the live model")
            train_dependent = False
            for module in modules:
                if not isinstance(module, torch.nn.Module):
                    raise Decline(f"`{ast.unparse(func)}` is not a module")
                for sub in module.modules():
                    if type(sub).__module__.startswith("torch.nn") and type(sub).__name__ in self._PURE_MODULES:
                        train_dependent |= type(sub).__name__ == "Dropout"
                        continue
                    raise Decline(f"`{ast.unparse(func)}` contains {type(sub).__name__}, not a known stateless layer")
            if not train_dependent:
                return None
            # Dropout draws random numbers in training mode: Dynamo checks `.training`.
            return ast.UnaryOp(op=ast.Not(), operand=ast.Attribute(value=copy.deepcopy(func), attr="training", ctx=ast.Load()))
        value = ctx.value_of(func)
        if value is None:
            raise Decline(f"`{ast.unparse(func)}` could not be resolved")
        impure = function_impurities(value)
        if impure:
            raise Decline(impure[0])
        return None

    # -- common trailing call (register_buffer) -----------------------------------

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
                for reason in speculation_blockers(value, facts, known):
                    raise Decline(f"`{ast.unparse(value)}`: {reason}")
            ta, tb = ctx.fresh("t"), ctx.fresh("f")
            body.append(_assign(_store(ta), copy.deepcopy(a)))
            body.append(_assign(_store(tb), copy.deepcopy(b)))
            meta.append(ast.Call(func=ctx.runtime("same_meta"), args=[_load(ta), _load(tb)], keywords=[]))
            merged.append(ast.Call(func=ctx.torch("where"), args=[_load(cond), _load(ta), _load(tb)], keywords=[]))
            plain_t.append(_load(ta))
            plain_f.append(_load(tb))
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

        guard = meta[0] if len(meta) == 1 else ast.BoolOp(op=ast.And(), values=meta)
        body.append(
            ast.If(
                test=guard,
                body=[rebuild(merged, in_place=True)],
                orelse=[ast.If(test=_load(cond), body=[rebuild(plain_t, False)], orelse=[rebuild(plain_f, False)])],
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
        from graphmend.analysis.facts import function_impurities

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
        true_env = self._speculate(stmt.body, "t", facts, bound, ctx, body, cond, guards)
        false_env = self._speculate(stmt.orelse, "f", facts, bound, ctx, body, cond, guards)
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
            where = ast.Call(func=ctx.torch("where"), args=[_load(cond), self._ref(t), self._ref(f)], keywords=[])
            predicated.append(self._store_stmt(target, where, ctx))
            if t != target:
                chosen_true.append(self._store_stmt(target, self._ref(t), ctx, plain=True))
            if f != target:
                chosen_false.append(self._store_stmt(target, self._ref(f), ctx, plain=True))
        body.append(
            ast.If(
                test=guard,
                body=predicated,
                orelse=[ast.If(test=_load(cond), body=chosen_true or [ast.Pass()], orelse=chosen_false)],
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
            return ast.Attribute(value=_load("self"), attr=name[5:], ctx=ast.Load())
        return _load(name)

    @staticmethod
    def _store_stmt(target: str, value: ast.expr, ctx: RewriteContext, plain: bool = False) -> ast.stmt:
        if target.startswith("self."):
            if plain:
                return _assign(ast.Attribute(value=_load("self"), attr=target[5:], ctx=ast.Store()), value)
            call = ast.Call(
                func=ctx.runtime("store"), args=[_load("self"), ast.Constant(target[5:]), value], keywords=[]
            )
            return ast.Expr(value=call)
        return _assign(_store(target), value)

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
            elif _is_self_attr(target):
                key = ast.unparse(target)
            else:
                raise Decline(f"assignment to `{ast.unparse(target)}` (only names and self.<attr> are predicated)")
            for reason in speculation_blockers(node.value, facts, known | set(env)):
                raise Decline(f"`{ast.unparse(node)}`: {reason}")
            value = _Substitute(env).visit(copy.deepcopy(node.value))
            temp = ctx.fresh(side)
            out.append(_assign(_store(temp), value))
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
        flag = _Substitute(env).visit(copy.deepcopy(flag))
        taken: ast.expr = _load(cond)
        if side == "f":
            taken = ast.Call(func=ctx.torch("logical_not"), args=[taken], keywords=[])
        ctx.notes.append("a validation check inside the branch fires only when its branch would have run")
        regated = ast.Call(
            func=ctx.runtime("trap"),
            args=[
                copy.deepcopy(site),
                ast.Call(func=ctx.runtime("gate"), args=[taken, flag], keywords=[]),
                copy.deepcopy(exc),
                _Substitute(env).visit(copy.deepcopy(args)),
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


def _attribute_stores(node: ast.AST) -> list[ast.AST]:
    """``x.a = ...``, ``x.a += ...``, ``del x.a`` and ``setattr(...)`` / ``delattr(...)`` calls in ``node``."""
    found: list[ast.AST] = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            found.append(sub)
        elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in ("setattr", "delattr"):
            found.append(sub)
    return found


def _class_stores(cls: type, skip: tuple[str, int]) -> str | None:
    """The first attribute store, as text, in the methods ``forward`` of ``cls``
    runs: ``forward`` and the methods it calls as ``self.name(...)``, through
    the class's own (not torch's) bases, except the function at ``skip`` (file, line)."""
    import inspect
    import os
    import textwrap

    methods: dict[str, tuple[ast.AST, str, int]] = {}
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch.") or klass is object:
            continue
        try:
            lines, start = inspect.getsourcelines(klass)
            path = os.path.abspath(inspect.getsourcefile(klass) or "")
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError):
            return f"a method of {klass.__name__} (no source to check)"
        for node in tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in methods:
                methods[node.name] = (node, path, node.lineno + start - 1)
    todo, seen = ["forward"], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in methods:
            continue
        seen.add(name)
        node, path, line = methods[name]
        if (path, line) != skip:
            stores = _attribute_stores(node)
            if stores:
                return f"`{ast.unparse(stores[0])}` in {cls.__name__}.{name}"
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            if isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) and call.func.value.id == "self":
                todo.append(call.func.attr)
    return None


def _attribute_store_before(stmt: ast.If, ctx: RewriteContext) -> str | None:
    """An attribute store that may run before ``stmt`` in the same compiled frame:
    earlier in the function (anywhere in it when ``stmt`` sits in a loop), or in
    what ``forward`` runs of one of the live model's own module classes."""
    import os

    import torch

    in_loop = any(
        isinstance(node, (ast.For, ast.AsyncFor, ast.While)) and any(sub is stmt for sub in ast.walk(node))
        for node in ast.walk(ctx.fdef)
    )
    for store in _attribute_stores(ctx.fdef):
        if in_loop or store.lineno < stmt.lineno:  # type: ignore[attr-defined]
            return f"`{ast.unparse(store)}`"
    if isinstance(ctx.model, torch.nn.Module):
        skip = (os.path.abspath(ctx.filename), ctx.fdef.lineno)
        for cls in dict.fromkeys(type(m) for m in ctx.model.modules()):
            if cls.__module__.startswith("torch."):
                continue
            found = _class_stores(cls, skip)
            if found is not None:
                return found
    return None


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


