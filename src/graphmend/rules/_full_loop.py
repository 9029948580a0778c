"""[Scalar]'s full loop: ``hit = T.nonzero(as_tuple=True)[0].tolist()`` and a
loop over ``hit`` whose body is a no-op where the filter is false, rewritten
to loop over every index (no host read, no data-dependent length). Part of
the [Scalar] rule (scalar.py); ``module_impurity`` (analysis.purity)
proves the loop's module calls pure."""

from __future__ import annotations

import ast
import builtins
import copy

import torch

from graphmend.analysis.facts import (
    PURE_TENSOR_METHODS,
    PURE_TORCH_FUNCTIONS,
    FunctionFacts,
)
from graphmend.analysis.purity import RAISE_ON_EMPTY, module_impurity
from graphmend.rules import Decline, RewriteContext
from graphmend.rules._ast import attr_of, load_name, make_call, place_at

_SHAPE_METHODS = frozenset({"permute", "transpose", "view", "reshape", "flatten", "contiguous", "unsqueeze", "squeeze"})
_INDEX_MUTATORS = {"index_add_": 1, "index_copy_": 1, "index_fill_": 1}  # method -> position of the index arg
_F_PURE = frozenset(
    """linear silu gelu relu softmax log_softmax sigmoid tanh layer_norm rms_norm dropout embedding
    normalize pad one_hot""".split()
)



# --------------------------------------------------------------------------
# a loop over a filtered index list


def index_list(node: ast.expr, ctx: RewriteContext) -> ast.expr | None:
    """``T`` of ``T.nonzero(as_tuple=True)[0].tolist()`` / ``torch.nonzero(T, as_tuple=True)[0].tolist()``."""
    if not (isinstance(node, ast.Call) and not node.args and not node.keywords):
        return None
    func = node.func
    if not (isinstance(func, ast.Attribute) and func.attr == "tolist"):
        return None
    sub = func.value
    if not (isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant) and sub.slice.value == 0):
        return None
    call = sub.value
    if not isinstance(call, ast.Call):
        return None
    as_tuple = [k for k in call.keywords if k.arg == "as_tuple"]
    if len(call.keywords) != 1 or not as_tuple or not (
        isinstance(as_tuple[0].value, ast.Constant) and as_tuple[0].value.value is True
    ):
        return None
    if isinstance(call.func, ast.Attribute) and call.func.attr == "nonzero" and not call.args:
        if ctx.value_of(call.func.value) is torch:
            return None
        return call.func.value
    if ctx.value_of(call.func) is torch.nonzero and len(call.args) == 1:
        return call.args[0]
    return None


def _parent_block(fdef: ast.AST, stmt: ast.stmt) -> list[ast.stmt] | None:
    for node in ast.walk(fdef):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and any(s is stmt for s in block):
                return block
        for handler in getattr(node, "handlers", []) or []:
            if any(s is stmt for s in handler.body):
                return handler.body
    return None


def _names_loaded(nodes: list[ast.AST]) -> list[str]:
    return [n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]


class FullLoop:
    """``hit = T.nonzero(as_tuple=True)[0].tolist(); for e in hit: <no-op when M[e] is empty>``."""

    def __init__(self, stmt: ast.Assign, ctx: RewriteContext) -> None:
        self.stmt, self.ctx = stmt, ctx
        self.facts = FunctionFacts.of(ctx.fdef, ctx.globals, ctx.local_names)
        self.containers: list[ast.expr] = []  # C of C[e] in the body, besides M
        self.dropped: list[ast.stmt] = []  # empty-selection guards to remove

    def rewrite(self) -> list[ast.stmt]:
        stmt, ctx = self.stmt, self.ctx
        if len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name):
            raise Decline("the index list is not assigned to one plain name")
        name = stmt.targets[0].id
        block = _parent_block(ctx.fdef, stmt)
        index = next(i for i, s in enumerate(block or []) if s is stmt) if block else None
        loop = block[index + 1] if block is not None and index is not None and index + 1 < len(block) else None
        if not (isinstance(loop, ast.For) and isinstance(loop.iter, ast.Name) and loop.iter.id == name):
            raise Decline(f"`{name}` is not iterated by the statement right after it")
        if _names_loaded([ctx.fdef]).count(name) != 1:
            raise Decline(f"`{name}` is used besides the loop (its length or contents would change)")
        if loop.orelse:
            raise Decline("the loop has an else clause")
        if not isinstance(loop.target, ast.Name):
            raise Decline("the loop target is not one plain name")
        for node in ast.walk(loop):
            if isinstance(node, (ast.Break, ast.Return, ast.Yield, ast.YieldFrom, ast.Raise, ast.Try)):
                raise Decline(f"the loop body has `{type(node).__name__.lower()}`: it must run to completion")
        flags = index_list(stmt.value, ctx)
        assert flags is not None
        mask, dims, kind = self._filter(flags)
        var = loop.target.id
        self._check_body(loop, var, mask)
        self._check_not_read_after(loop, var)

        hit = ctx.fresh("hit")
        n = ast.Subscript(value=attr_of(load_name(hit), "shape"), slice=ast.Constant(0), ctx=ast.Load())
        for builtin in ("range", "len"):
            if not ctx.resolves_to(builtin, getattr(builtins, builtin)):
                raise Decline(f"`{builtin}` is shadowed in this function")
        guards: list[ast.expr] = [
            ast.Compare(left=make_call(attr_of(load_name(hit), "dim")), ops=[ast.Eq()], comparators=[ast.Constant(1)]),
            ast.Compare(left=make_call(attr_of(load_name(mask), "dim")), ops=[ast.Eq()], comparators=[ast.Constant(len(dims) + 1)]),
        ]
        for container in self.containers:
            guards.append(ast.Compare(left=make_call(load_name("len"), copy.deepcopy(container)), ops=[ast.GtE()], comparators=[n]))
        original = copy.deepcopy(stmt.value)
        original.func.value.value = _replace_flags(original.func.value.value, hit)
        out: list[ast.stmt] = [
            ast.Assign(targets=[ast.Name(id=hit, ctx=ast.Store())], value=copy.deepcopy(flags)),
            ast.If(
                test=ast.BoolOp(op=ast.And(), values=guards),
                body=[ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=make_call(load_name("range"), copy.deepcopy(n)))],
                orelse=[ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=original)],
            ),
        ]
        for guard in self.dropped:
            loop.body.remove(guard)
        ctx.notes.append(
            f"`for {var} in {name}` visits every index of `{ast.unparse(flags)}` in order ({kind}); "
            f"the body only writes through the selection of `{mask}[{var}]`, empty for the indices the filter dropped"
            + (f"; {len(self.dropped)} empty-selection guard(s) removed" if self.dropped else "")
        )
        return place_at(out, stmt)

    # -- the filter: T[i] is False exactly when M[i] is all zero ----------------

    def _filter(self, flags: ast.expr) -> tuple[str, tuple[int, ...], str]:
        if isinstance(flags, ast.Compare) and len(flags.ops) == 1 and isinstance(flags.ops[0], ast.Gt):
            right = flags.comparators[0]
            if not (isinstance(right, ast.Constant) and right.value == 0):
                raise Decline("the filter compares with something other than 0")
            mask, dims = self._reduction(flags.left, "sum")
            self._non_negative(mask)
            return mask, dims, f"`{mask}` is non-negative, so a zero sum means an all-zero slice"
        mask, dims = self._reduction(flags, "any")
        return mask, dims, "`any` is false exactly for an all-zero slice"

    def _reduction(self, node: ast.expr, method: str) -> tuple[str, tuple[int, ...]]:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method):
            raise Decline(f"the filter is not `M.sum(dims) > 0` or `M.any(dims)` (it is `{ast.unparse(node)}`)")
        if not isinstance(node.func.value, ast.Name):
            raise Decline("the filtered tensor is not a plain local name")
        dim_nodes = [k.value for k in node.keywords if k.arg == "dim"] + node.args
        if len(dim_nodes) != 1 or len(node.keywords) + len(node.args) != 1:
            raise Decline("the reduction does not name its dims alone")
        dim = dim_nodes[0]
        elts = dim.elts if isinstance(dim, ast.Tuple) else [dim]
        dims = tuple(_int_constant(e) for e in elts)
        if None in dims:
            raise Decline("the reduced dims are not integer constants")
        ndim = len(dims) + 1
        if sorted(d % ndim for d in dims) != list(range(1, ndim)) or any(not -ndim <= d < ndim for d in dims):
            raise Decline("the reduction does not cover every dim but the first (checked: dims are distinct and not 0)")
        return node.func.value.id, dims

    def _non_negative(self, mask: str) -> None:
        values = self.facts.assignments.get(mask, [])
        if len(values) != 1:
            raise Decline(f"`{mask}` is not assigned exactly once, so it is not provably non-negative")
        node = values[0]
        while (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SHAPE_METHODS
        ):
            node = node.func.value
        if isinstance(node, ast.Compare):
            return  # a bool tensor
        if isinstance(node, ast.Call) and self.ctx.value_of(node.func) is torch.nn.functional.one_hot:
            return
        raise Decline(f"`{mask}` is not provably non-negative (only one_hot or a comparison, through reshapes)")

    # -- the body: a no-op when the selection is empty --------------------------

    def _check_body(self, loop: ast.For, var: str, mask: str) -> None:
        empty: set[str] = set()
        assigned: set[str] = {var}
        modules: dict[str, ast.expr] = {}
        for st in loop.body:
            where = f"line {st.lineno}: `{ast.unparse(st).splitlines()[0]}`"
            selected = self._selection(st, var, mask)
            if selected is not None:
                empty |= set(selected)
                assigned |= set(selected)
                continue
            if self._empty_guard(st, empty):
                self.dropped.append(st)
                continue
            if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                target = st.targets[0].id
                if target == mask:
                    raise Decline(f"{where} rebinds `{mask}`")
                if self._module_lookup(st.value, var):
                    self.containers.append(st.value.value)
                    modules[target] = st.value.value
                else:
                    self._pure(st.value, var, mask, modules, where)
                assigned.add(target)
                continue
            if self._index_write(st, empty, assigned, mask, var, modules, where):
                continue
            raise Decline(f"{where} is not provably a no-op when the selection is empty")
        if not empty:
            raise Decline(f"the loop body never selects with `torch.where({mask}[{var}])` or `nonzero`")
        self.assigned = assigned

    def _selection(self, st: ast.stmt, var: str, mask: str) -> list[str] | None:
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1):
            return None
        target, value = st.targets[0], st.value
        if isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts):
            names = [e.id for e in target.elts]
        elif isinstance(target, ast.Name):
            names = [target.id]
        else:
            return None
        if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant) and isinstance(target, ast.Name):
            value = value.value  # torch.where(M[e])[1]
        arg: ast.expr | None = None
        if isinstance(value, ast.Call) and not value.keywords or (
            isinstance(value, ast.Call) and [k.arg for k in value.keywords] == ["as_tuple"]
        ):
            fn = self.ctx.value_of(value.func)
            if fn in (torch.where, torch.nonzero) and len(value.args) == 1:
                arg = value.args[0]
            elif isinstance(value.func, ast.Attribute) and value.func.attr == "nonzero" and not value.args:
                arg = value.func.value
        if not (
            isinstance(arg, ast.Subscript)
            and isinstance(arg.value, ast.Name)
            and arg.value.id == mask
            and isinstance(arg.slice, ast.Name)
            and arg.slice.id == var
        ):
            return None
        return names

    @staticmethod
    def _empty_guard(st: ast.stmt, empty: set[str]) -> bool:
        """``if sel.shape[0] == 0: continue`` / ``numel() == 0`` / ``len(sel) == 0`` / ``not sel.numel()``."""
        if not (isinstance(st, ast.If) and not st.orelse and len(st.body) == 1 and isinstance(st.body[0], ast.Continue)):
            return False
        test = st.test
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            probe = test.operand
        elif (
            isinstance(test, ast.Compare)
            and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == 0
        ):
            probe = test.left
        else:
            return False
        text = ast.unparse(probe)
        return any(text in (f"{n}.shape[0]", f"{n}.numel()", f"len({n})", f"{n}.size(0)") for n in empty)

    @staticmethod
    def _module_lookup(node: ast.expr, var: str) -> bool:
        return (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Name)
            and node.slice.id == var
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"
        )

    def _index_write(
        self, st: ast.stmt, empty: set[str], assigned: set[str], mask: str, var: str, modules: dict, where: str
    ) -> bool:
        """``acc.index_add_(d, sel, src)`` and friends, ``acc[sel] = v`` / ``acc[sel] += v``."""
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Attribute):
            call = st.value
            position = _INDEX_MUTATORS.get(call.func.attr)
            if position is None or call.keywords or len(call.args) != 3:
                return False
            index = call.args[position]
            receiver = call.func.value
            if not (isinstance(index, ast.Name) and index.id in empty):
                raise Decline(f"{where} writes through an index that is not the empty selection")
            self._accumulator(receiver, assigned, mask, where)
            for arg in call.args:
                self._pure(arg, var, mask, modules, where)
            return True
        if isinstance(st, (ast.Assign, ast.AugAssign)):
            target = st.targets[0] if isinstance(st, ast.Assign) and len(st.targets) == 1 else getattr(st, "target", None)
            if not isinstance(target, ast.Subscript):
                return False
            if not (isinstance(target.slice, ast.Name) and target.slice.id in empty):
                raise Decline(f"{where} stores through an index that is not the empty selection")
            self._accumulator(target.value, assigned, mask, where)
            self._pure(st.value, var, mask, modules, where)
            return True
        return False

    @staticmethod
    def _accumulator(node: ast.expr, assigned: set[str], mask: str, where: str) -> None:
        if not isinstance(node, ast.Name) or node.id in assigned or node.id == mask:
            raise Decline(f"{where} writes into something other than a tensor bound before the loop")

    def _pure(self, node: ast.expr, var: str, mask: str, modules: dict[str, ast.expr], where: str) -> None:
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
                raise Decline(f"{where}: `{ast.unparse(sub)}` is not a plain expression")
            if not isinstance(sub, ast.Call):
                continue
            func = sub.func
            if isinstance(func, ast.Attribute) and func.attr in RAISE_ON_EMPTY:
                raise Decline(f"{where}: `{ast.unparse(sub)}` raises on an empty selection")
            if isinstance(func, ast.Name) and func.id in modules:
                self._modules_pure(modules[func.id], where)
                continue
            if self._module_lookup(func, var):  # self.experts[e](...)
                self._modules_pure(func.value, where)
                if not any(ast.dump(func.value) == ast.dump(c) for c in self.containers):
                    self.containers.append(func.value)
                continue
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
                self._modules_pure(func, where, single=True)
                continue
            value = self.ctx.value_of(func)
            if value is not None and (
                any(value is getattr(torch, n, None) for n in PURE_TORCH_FUNCTIONS)
                or any(value is getattr(torch.nn.functional, n, None) for n in _F_PURE)
            ):
                if value is torch.nn.functional.dropout:
                    raise Decline(f"{where}: dropout draws random numbers even on an empty selection")
                continue
            if isinstance(func, ast.Attribute) and func.attr in PURE_TENSOR_METHODS and value is None:
                continue
            raise Decline(f"{where}: `{ast.unparse(func)}` is not known to be pure")

    def _modules_pure(self, node: ast.expr, where: str, single: bool = False) -> None:
        """Every module ``self.<attr>`` can be (each element of a ModuleList) is pure."""
        attr = node.attr if isinstance(node, ast.Attribute) else None
        if attr is None:
            raise Decline(f"{where}: the called module is not `self.<attribute>`")
        values = self.ctx.attribute_values(attr)
        if not values:
            raise Decline(f"{where}: `self.{attr}` cannot be found on the live model")
        for value in values:
            members = [value] if single or not isinstance(value, (torch.nn.ModuleList, torch.nn.ModuleDict)) else (
                list(value.values()) if isinstance(value, torch.nn.ModuleDict) else list(value)
            )
            for module in members:
                reason = module_impurity(module)
                if reason:
                    raise Decline(f"{where}: {reason}")

    def _check_not_read_after(self, loop: ast.For, var: str) -> None:
        inside = {id(n) for n in ast.walk(loop)}
        outside = [
            n.id for n in ast.walk(self.ctx.fdef)
            if id(n) not in inside and isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
        ]
        leaked = sorted(set(outside) & self.assigned)
        if leaked:
            raise Decline(f"the loop's names {', '.join(leaked)} are read outside it (their last value would change)")


def _int_constant(node: ast.expr) -> int | None:
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return None
    return value if type(value) is int else None


def _replace_flags(call: ast.Call, hit: str) -> ast.Call:
    """The original ``.nonzero`` call with its filter replaced by the fresh name."""
    if isinstance(call.func, ast.Attribute) and call.func.attr == "nonzero":
        call.func.value = load_name(hit)
    else:
        call.args[0] = load_name(hit)
    return call
