"""[Where] with ``torch.cond``: a branch that calls modules or functions
(proven pure, or guarded on what Dynamo checks) runs as ``torch.cond`` of
two branch functions, where plain ``torch.where`` of values cannot serve.
Part of the [Where] rule (where.py)."""

from __future__ import annotations

import ast
import copy
import inspect
import textwrap

from graphmend.analysis.aliasing import alias_roots
from graphmend.analysis.callers import updated_by_callers
from graphmend.analysis.facts import FunctionFacts, live_after
from graphmend.analysis.purity import Emptiness, empty_reduction
from graphmend.analysis.shapes import shape_blockers
from graphmend.analysis.sharing import Sharing
from graphmend.analysis.source import source_tree
from graphmend.analysis.speculated import Tested
from graphmend.analysis.traceable import data_tests, value_shaped
from graphmend.compat import release
from graphmend.rules import Decline, RewriteContext
from graphmend.rules._ast import (
    Substitute,
    assign_to,
    is_self_attr,
    load_name,
    store_name,
)
from graphmend.rules._predicate import add_guards
from graphmend.rules._where_branch import tied_after
from graphmend.rules._where_select import side as select_side


class CondForm:
    """The ``torch.cond`` form of :class:`~graphmend.rules.where.Where`."""

    def _cond_instead(
        self,
        stmt: ast.If,
        arms: list[tuple[str | None, list[ast.stmt]]],
        where_reason: Decline,
        facts: FunctionFacts,
        bound: set[str],
        ctx: RewriteContext,
        guards: list[ast.expr],
        proof: Tested,
    ) -> list[ast.stmt]:
        """The torch.cond form where torch.where declined (``where_reason``) and a branch
        calls something; where it declines too, both reasons."""
        if not any(isinstance(n, ast.Call) for _, block in arms for node in block for n in ast.walk(node)):
            raise where_reason
        try:
            return self._cond(stmt, arms, facts, bound, ctx, guards, proof.nonempty)
        except Decline as cond_reason:
            raise Decline(f"torch.where: {where_reason.reason}; torch.cond: {cond_reason.reason}") from None

    def _cond(
        self,
        stmt: ast.If,
        arms: list[tuple[str | None, list[ast.stmt]]],
        facts: FunctionFacts,
        bound: set[str],
        ctx: RewriteContext,
        guards: list[ast.expr],
        nonempty: frozenset[str],
    ) -> list[ast.stmt]:
        """Run only the branch the tests pick, inside the graph, with torch.cond
        (an ``elif`` chain: nested, ``torch.cond(c0, b0, rest)`` where ``rest()`` returns
        ``torch.cond(c1, b1, b2)``).

        Chosen when a branch calls modules or functions: computing every side
        would multiply their cost (or run effects). The callees must be pure:
        standard stateless torch.nn layers in eval mode (checked while
        tracing), or functions whose source is pure. ``arms``: each test's name
        (None for the else) and its block; ``nonempty``: what the tests prove."""
        blocks = [block for _, block in arms]
        targets: list[str] = []
        for block in blocks:
            for node in block:
                names = _assigned(node)
                if names is None:
                    raise Decline("a branch holds a statement other than an assignment to a name or a tuple of names")
                targets += [name for name in names if name not in targets]
        outputs: list[str] = []
        sharing = Sharing(ctx.fdef, facts)
        made = "torch.cond's output is a new tensor"
        for name in targets:
            if not all(any(name in (_assigned(n) or ()) for n in block) for block in blocks) and name not in bound:
                if live_after(ctx.fdef, stmt, name):
                    raise Decline(f"`{name}` is assigned on one path only and read after the if")
                continue
            tied_after(ctx.fdef, stmt, name, _view_roots(blocks, name), sharing, made)
            handed = updated_by_callers(ctx.chains, ctx.fdef, name)
            if handed:
                raise Decline(f"`{name}` is returned as it is and {handed}: {made}")
            outputs.append(name)
        if not outputs:
            raise Decline("the branches only assign temporaries")
        for block in blocks:
            known = set(bound)
            assigned: set[str] = set()  # in this branch so far: no longer what the test reduced
            for node in block:
                for name in sorted(n.id for n in ast.walk(node.value) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)):  # type: ignore[attr-defined]
                    if name in facts.local_names and name not in known:
                        raise Decline(f"`{name}` may be unbound in a branch")
                for call in (n for n in ast.walk(node.value) if isinstance(n, ast.Call)):  # type: ignore[attr-defined]
                    empty = Emptiness(nonempty - assigned, frozenset(bound) - assigned)
                    if empty_reduction(call, facts, empty):
                        raise Decline(
                            f"`{ast.unparse(call)}` raises on an empty tensor, and torch.cond traces the branch "
                            "not taken on the shapes of the call"
                        )
                    add_guards(empty, ctx, guards)
                    guard = self._pure_callee(call, facts, ctx)
                    if guard is not None:
                        guards.append(guard)
                empty = Emptiness(nonempty - assigned, frozenset(bound) - assigned, rebound=frozenset(assigned))
                for reason in shape_blockers(node.value, facts, empty):  # type: ignore[attr-defined]
                    raise Decline(f"torch.cond traces the branch not taken on the shapes of the call: {reason}")
                for found in value_shaped(node.value, facts):  # type: ignore[attr-defined]
                    raise Decline(f"{found}: its shape or value depends on tensor data, which {_UNTRACEABLE}")
                for found in data_tests(node.value):  # type: ignore[attr-defined]
                    raise Decline(f"{found}, which {_UNTRACEABLE}")
                add_guards(empty, ctx, guards)
                known.update(_assigned(node) or ())
                assigned.update(_assigned(node) or ())
        store = _attribute_store_before(stmt, ctx) if release().cond_drops_later_stores else None
        if store is not None:
            raise Decline(
                f"{store} may run before it in the compiled frame, and Dynamo then drops "
                "attribute stores made after a torch.cond (torch 2.13 and 2.14)"
            )
        functions: list[ast.stmt] = []
        names: list[str] = []
        for index, block in enumerate(blocks):
            side = "true" if index == 0 else "false" if index == len(blocks) - 1 else "elif"
            fname = ctx.fresh(f"{side}_branch")
            names.append(fname)
            env: dict[str, str] = {}
            inner: list[ast.stmt] = []
            for node in block:
                value = Substitute(env).visit(copy.deepcopy(node.value))  # type: ignore[attr-defined]
                temps = {name: ctx.fresh(select_side(index, len(blocks))) for name in _assigned(node) or ()}
                target = node.targets[0]  # type: ignore[attr-defined]
                if isinstance(target, ast.Tuple):  # `h, s = helper(h, s)`: unpacked as written, into temporaries
                    inner.append(assign_to(ast.Tuple(elts=[store_name(t) for t in temps.values()], ctx=ast.Store()), value))
                else:
                    inner.append(assign_to(store_name(temps[target.id]), value))
                env.update(temps)
            # torch.cond forbids returning an input as is: an unchanged value is cloned.
            result = ast.Tuple(
                elts=[
                    load_name(env[o]) if o in env
                    else ast.Call(func=ast.Attribute(value=load_name(o), attr="clone", ctx=ast.Load()), args=[], keywords=[])
                    for o in outputs
                ],
                ctx=ast.Load(),
            )
            functions.append(_function(fname, [*inner, ast.Return(value=result)]))
        conds = [cond for cond, _ in arms[:-1]]
        call = _cond_call(ctx, conds[-1], names[-2], names[-1])
        for index in range(len(conds) - 2, -1, -1):  # an elif chain: each test's else is the next torch.cond
            rest = ctx.fresh("rest")
            functions.append(_function(rest, [ast.Return(value=call)]))
            call = _cond_call(ctx, conds[index], names[index], rest)  # type: ignore[arg-type]
        target = ast.Tuple(elts=[store_name(o) for o in outputs], ctx=ast.Store())
        nested = " (nested, one per test)" if len(arms) > 2 else ""
        ctx.notes.append(
            f"torch.cond{nested} ({', '.join(outputs)}): the branches call modules or functions, so only the taken one runs"
        )
        held = self._held(blocks, outputs, facts, ctx)
        bind = ast.Expr(value=ast.Call(func=ctx.runtime("bind"), args=held, keywords=[]))
        return [*functions, *([bind] if held else []), assign_to(target, call)]

    @staticmethod
    def _held(blocks: list[list[ast.stmt]], outputs: list[str], facts: FunctionFacts, ctx: RewriteContext) -> list[ast.expr]:
        """The objects the branches reach, to show Dynamo before ``torch.cond``
        (``runtime.bind``): the names they read from outside (not torch, not
        builtins; an output a branch leaves unchanged is read there too) and
        the ``self.<attr>`` values they use, read with
        ``getattr(self, attr, None)`` unless the attribute is a property."""
        import torch

        names: list[str] = []
        attrs: list[str] = []
        for block in blocks:
            assigned: set[str] = set()
            for node in block:
                for sub in ast.walk(node.value):  # type: ignore[attr-defined]
                    if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in assigned:
                        local = sub.id in facts.local_names
                        if (local or sub.id in ctx.globals) and not facts.resolves_to_torch(sub.id) and sub.id not in names:
                            names.append(sub.id)
                    if is_self_attr(sub) and sub.attr not in attrs:  # type: ignore[union-attr]
                        attrs.append(sub.attr)  # type: ignore[union-attr]
                assigned.update(_assigned(node) or ())
            names += [o for o in outputs if o not in assigned and o not in names]  # cloned as is
        held: list[ast.expr] = [load_name(name) for name in names]
        modules = list(ctx.model.modules()) if isinstance(ctx.model, torch.nn.Module) else []
        for attr in attrs:
            if "self" not in names or any(isinstance(inspect.getattr_static(type(m), attr, None), property) for m in modules):
                continue
            held.append(
                ast.Call(func=load_name("getattr"), args=[load_name("self"), ast.Constant(attr), ast.Constant(None)], keywords=[])
            )
        return held

    def _pure_callee(self, call: ast.Call, facts: FunctionFacts, ctx: RewriteContext) -> ast.expr | None:
        """Prove a branch call side-effect free; returns a guard Dynamo checks while tracing."""
        import torch

        from graphmend.analysis.facts import PURE_TENSOR_METHODS, PURE_TORCH_FUNCTIONS
        from graphmend.analysis.purity import (
            STATELESS_LAYERS,
            function_impurities,
            is_layer,
        )

        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and facts.resolves_to_torch(func.value.id):
            if func.attr in PURE_TORCH_FUNCTIONS:
                return None
            raise Decline(f"torch.{func.attr} is not on the list of pure torch functions")
        if isinstance(func, ast.Attribute) and func.value is not None and not is_self_attr(func):
            if func.attr in PURE_TENSOR_METHODS:
                return None
            raise Decline(f"`.{func.attr}(...)` is not a known pure method")
        if is_self_attr(func):
            modules = ctx.attribute_values(func.attr)  # type: ignore[union-attr]
            if not modules:
                raise Decline(f"`{ast.unparse(func)}` could not be resolved on the live model")
            if all(inspect.isfunction(m) or inspect.ismethod(m) for m in modules):  # `self._helper(h, s)`
                return self._pure_method(func, modules, ctx)
            train_dependent = False
            for module in modules:
                if not isinstance(module, torch.nn.Module):
                    raise Decline(f"`{ast.unparse(func)}` is not a module")
                for sub in module.modules():
                    if is_layer(sub, STATELESS_LAYERS):
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
        impure = function_impurities(value) or _untraceable_in(value)
        if impure:
            raise Decline(impure[0])
        return None

    @staticmethod
    def _pure_method(func: ast.Attribute, found: list, ctx: RewriteContext) -> ast.expr:
        """``self._helper(...)``: one method of the model's class, its source pure.
        Another class sharing the mended function (a subclass's own ``_helper``) was
        never proven: the guard ``type(self)._helper is Owner._helper``, decided while
        tracing, sends it to the original statement."""
        from graphmend.analysis.purity import function_impurities

        fn = getattr(found[0], "__func__", found[0])
        if len({id(getattr(m, "__func__", m)) for m in found}) != 1:
            raise Decline(f"`{ast.unparse(func)}` is more than one function over the model's modules")
        impure = function_impurities(fn) or _untraceable_in(fn)
        if impure:
            raise Decline(impure[0])
        owner, _, name = fn.__qualname__.rpartition(".")
        cls = ctx.globals.get(owner)
        if name != func.attr or not isinstance(cls, type) or cls.__dict__.get(name) is not fn or not ctx.resolves_to("type", type):
            raise Decline(f"`{ast.unparse(func)}`: its class is not a global of the module, to check it is the method proven")
        mine = ast.Attribute(value=ast.Call(func=load_name("type"), args=[copy.deepcopy(func.value)], keywords=[]), attr=name, ctx=ast.Load())
        return ast.Compare(left=mine, ops=[ast.Is()], comparators=[ast.Attribute(value=load_name(owner), attr=name, ctx=ast.Load())])


_UNTRACEABLE = "Dynamo captures in a torch.cond branch only with fullgraph=True"


def _untraceable_in(fn: object) -> list[str]:
    """Why a helper a branch calls cannot be traced in a torch.cond branch
    (``analysis/traceable.py``; its source read alone)."""
    name = getattr(fn, "__qualname__", fn)
    tree = source_tree(fn)
    if tree is None:
        return [f"the source of {name} is not available"]
    found = [f"{f}: its shape or value depends on tensor data" for f in value_shaped(tree, None)] + data_tests(tree)
    return [f"{name}: {f}, which {_UNTRACEABLE}" for f in found]


def _function(name: str, body: list[ast.stmt]) -> ast.FunctionDef:
    """``def name(): <body>``."""
    args = ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[])
    return ast.FunctionDef(name=name, args=args, body=body, decorator_list=[], returns=None)


def _cond_call(ctx: RewriteContext, cond: str, true: str, false: str) -> ast.Call:
    """``torch.cond(cond, true, false, ())``."""
    args = [load_name(cond), load_name(true), load_name(false), ast.Tuple(elts=[], ctx=ast.Load())]
    return ast.Call(func=ctx.torch("cond"), args=args, keywords=[])


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
    import os

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


def _view_roots(blocks: list[list[ast.stmt]], name: str) -> set[str]:
    """The names from before the if whose tensor a branch's value of ``name`` may be or
    view (through the branch's own assignments; a tuple's parts are not followed)."""
    roots: set[str] = set()
    for block in blocks:
        env: dict[str, set[str]] = {}
        for node in block:
            names = _assigned(node) or []
            found = set().union(*(env.get(r, {r}) for r in alias_roots(node.value)))  # type: ignore[attr-defined]
            env.update({n: found if len(names) == 1 else set() for n in names})
        roots |= env.get(name, set())
    return roots


def _assigned(node: ast.stmt) -> list[str] | None:
    """The names ``h = ...`` or ``h, s = ...`` assigns (each once), else None."""
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
        return None
    target = node.targets[0]
    names = target.elts if isinstance(target, ast.Tuple) else [target]
    if not all(isinstance(n, ast.Name) for n in names) or len({n.id for n in names}) != len(names):  # type: ignore[attr-defined]
        return None
    return [n.id for n in names]  # type: ignore[attr-defined]
