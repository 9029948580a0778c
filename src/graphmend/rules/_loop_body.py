"""[Scalar]'s full loop, its body: ``for var in <index list>`` is a no-op for
an index the filter dropped, so the loop may visit every index. Part of the
[Scalar] rule (scalar.py, _full_loop.py).

The proof, statement by statement: a selection ``torch.where(M[var])`` (or
``nonzero``) is empty for a dropped index; everything else only assigns
pure values to loop-local names, or writes through that empty selection
(``index_add_``, ``acc[sel] = ...``); a ``continue`` guard on the selection's
size or on the index is dropped or kept. Module calls, methods and the
index itself are checked on the live model (``module_impurity``,
``function_impurities``).

Over ``nonzero()`` rows (transformers 5's form) the loop visits ``[i]`` for
each index where the original visited a one-element tensor; the body sees
``var`` as that list (``M[var]`` selects the same ``[1, ...]`` slice) and
``var[0]`` (or ``var`` after ``var = var[0]``) as an int where it was a 0-dim
tensor: the same as the index of a tensor or ModuleList of the model, on the
left of an index guard, and formatted into a ModuleDict key.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types

import torch

from graphmend.analysis.facts import PURE_TENSOR_METHODS, PURE_TORCH_FUNCTIONS
from graphmend.analysis.purity import (
    RAISE_ON_EMPTY,
    function_impurities,
    module_impurity,
)
from graphmend.rules import Decline, RewriteContext
from graphmend.rules._live import owners

SHAPE_METHODS = frozenset({"permute", "transpose", "view", "reshape", "flatten", "contiguous", "unsqueeze", "squeeze"})
_INDEX_MUTATORS = {"index_add_": 1, "index_copy_": 1, "index_fill_": 1}  # method -> position of the index arg
_F_PURE = frozenset(
    """linear silu gelu relu softmax log_softmax sigmoid tanh layer_norm rms_norm dropout embedding
    normalize pad one_hot""".split()
)
_SCALAR_USE = (
    "used other than to index a tensor or module list of the model, in an index guard or in a module key "
    "(a Python int would differ from the 0-dim tensor there)"
)


class LoopBody:
    """What the loop body does, checked; ``containers`` and ``keys`` are the
    guards the rewrite adds (each index it visits must exist there)."""

    def __init__(self, ctx: RewriteContext, loop: ast.For, var: str, mask: str, rows: bool) -> None:
        self.ctx, self.loop, self.var, self.mask, self.rows = ctx, loop, var, mask, rows
        self.containers: list[ast.expr] = []  # C of C[var] besides the mask: len(C) >= n
        self.keys: list[ast.JoinedStr] = []  # self[f"...{var[0]}..."]: each key exists
        self.dropped: list[ast.stmt] = []  # empty-selection guards to remove
        self.assigned: set[str] = {var}
        first = loop.body[0]
        self.unpacked = rows and (
            isinstance(first, ast.Assign) and len(first.targets) == 1 and isinstance(first.targets[0], ast.Name)
            and first.targets[0].id == var and ast.unparse(first.value) == f"{var}[0]"
        )
        self._owners: list | None = None

    def check(self) -> None:
        body = self.loop.body[1:] if self.unpacked else self.loop.body
        empty: set[str] = set()
        modules: dict[str, ast.expr] = {}
        for st in body:
            where = f"line {st.lineno}: `{ast.unparse(st).splitlines()[0]}`"
            selected = self._selection(st)
            if selected is not None:
                empty |= set(selected)
                self.assigned |= set(selected)
                continue
            if _empty_guard(st, empty):
                self.dropped.append(st)
                continue
            if self._index_guard(st):
                continue
            if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                target = st.targets[0].id
                if target == self.mask:
                    raise Decline(f"{where} rebinds `{self.mask}`")
                if self._module_lookup(st.value):
                    self._add_container(st.value.value)
                    modules[target] = st.value.value
                else:
                    self._pure(st.value, modules, where)
                self.assigned.add(target)
                continue
            if self._index_write(st, empty, modules, where):
                continue
            raise Decline(f"{where} is not provably a no-op when the selection is empty")
        if not empty:
            raise Decline(f"the loop body never selects with `torch.where({self.mask}[{self.var}])` or `nonzero`")
        self._indexed()
        if self.rows:
            self._scalar_uses()

    # -- what the index may be used for ----------------------------------------

    def _scalars(self) -> list[ast.expr]:
        """Where the body reads the index as a number: ``var`` after ``var = var[0]``, else each ``var[0]``."""
        var, first = self.var, self.loop.body[0]
        if self.unpacked:
            return [
                n for n in ast.walk(self.loop)
                if isinstance(n, ast.Name) and n.id == var and isinstance(n.ctx, ast.Load) and n is not first.value.value
            ]
        return [n for n in ast.walk(self.loop) if isinstance(n, ast.Subscript) and ast.unparse(n) == f"{var}[0]"]

    def _scalar_uses(self) -> None:
        """The rows form: each read of the index is one whose meaning an int keeps."""
        var = self.var
        read = self._scalars()
        scalars = {id(n) for n in read}
        allowed: set[int] = set()
        rows: set[int] = set()  # `var` itself (a list where it was a one-element tensor): tensor indices only
        for node in ast.walk(self.loop):
            if isinstance(node, ast.Subscript):
                if self._tensor_or_modules(node.value, lists=False):
                    allowed.add(id(node.slice))
                if self._tensor_or_modules(node.value, lists=True):
                    rows.add(id(node.slice))
            elif isinstance(node, ast.If) and self._index_guard(node):
                allowed.add(id(node.test.left))
            elif isinstance(node, ast.FormattedValue) and node.conversion == -1 and node.format_spec is None:
                allowed.add(id(node.value))  # f"{t}" of a 0-dim tensor is f"{t.item()}" (Tensor.__format__)
        for node in ast.walk(self.loop):
            if id(node) in scalars and id(node) not in allowed:
                raise Decline(f"`{ast.unparse(node)}` is {_SCALAR_USE}")
        inner = {id(self.loop.body[0].value.value)} if self.unpacked else {id(n.value) for n in read}
        for node in ast.walk(self.loop):
            if (
                isinstance(node, ast.Name) and node.id == var and isinstance(node.ctx, ast.Load)
                and id(node) not in inner and id(node) not in (scalars if self.unpacked else rows)
            ):
                raise Decline(f"`{var}` is {_SCALAR_USE}")
        stores = [n for n in ast.walk(self.loop) if isinstance(n, ast.Name) and n.id == var and isinstance(n.ctx, ast.Store)]
        if len(stores) != 1 + self.unpacked:  # the loop target, and `var = var[0]`
            raise Decline(f"`{var}` is rebound in the loop body")

    def _tensor_or_modules(self, node: ast.expr, lists: bool) -> bool:
        """The mask, or ``self.<attr>`` whose every live value is a tensor (or,
        for an int index, a ModuleList)."""
        if isinstance(node, ast.Name):
            return node.id == self.mask
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
            return False
        kinds = (torch.Tensor,) if lists else (torch.Tensor, torch.nn.ModuleList)
        values = self._values(node.attr)
        return bool(values) and all(isinstance(v, kinds) for v in values)

    def _index_guard(self, st: ast.stmt) -> bool:
        """``if var == <int constant or self.<int attribute>>: continue``: the same
        decision for an index the filter kept; for one it dropped, the body is
        a no-op whether it continues or not."""
        if not (isinstance(st, ast.If) and not st.orelse and len(st.body) == 1 and isinstance(st.body[0], ast.Continue)):
            return False
        test = st.test
        if not (
            isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name)
            and test.left.id == self.var
            and isinstance(test.ops[0], (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE))
        ):
            return False
        other = test.comparators[0]
        if isinstance(other, ast.Constant):
            return type(other.value) is int
        if isinstance(other, ast.Attribute) and isinstance(other.value, ast.Name) and other.value.id == "self":
            values = self._values(other.attr)
            return bool(values) and all(type(v) is int for v in values)
        return False

    def _indexed(self) -> None:
        """Each ``C[var]`` besides the mask: ``C`` is bound before the loop, and
        guarded ``len(C) >= n`` (an index the filter dropped must exist in it)."""
        for node in ast.walk(self.loop):
            if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name) and node.slice.id == self.var):
                continue
            container = node.value
            if isinstance(container, ast.Name) and container.id == self.mask:
                continue
            plain = isinstance(container, ast.Name) and container.id not in self.assigned
            if not (plain or _under_self(container)):
                raise Decline(f"`{ast.unparse(node)}` indexes something the loop binds, not a container bound before it")
            self._add_container(container)

    def _add_container(self, node: ast.expr) -> None:
        if not any(ast.dump(node) == ast.dump(c) for c in self.containers):
            self.containers.append(node)

    def _values(self, attr: str) -> list:
        """The live values of ``self.<attr>`` over the modules that run this function (all, if none is found)."""
        return self.ctx.attribute_values(attr, self._running() or None)

    def _running(self) -> list:
        """The live modules that run this function (looked up once)."""
        if self._owners is None:
            self._owners = owners(self.ctx.model, self.ctx.fdef, self.ctx.filename)
        return self._owners

    # -- statements --------------------------------------------------------------

    def _selection(self, st: ast.stmt) -> list[str] | None:
        """The names ``torch.where(M[var])`` / ``nonzero`` binds (``M[var]`` through reshapes)."""
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
        while (  # M[e].squeeze(0): the same values, so the same emptiness
            isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr in SHAPE_METHODS
            and not arg.keywords and all(isinstance(a, ast.Constant) for a in arg.args)
        ):
            arg = arg.func.value
        if not (
            isinstance(arg, ast.Subscript)
            and isinstance(arg.value, ast.Name)
            and arg.value.id == self.mask
            and isinstance(arg.slice, ast.Name)
            and arg.slice.id == self.var
        ):
            return None
        return names

    def _module_lookup(self, node: ast.expr) -> bool:
        """``self.<attr>[var]``."""
        return (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Name)
            and node.slice.id == self.var
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"
        )

    def _index_write(self, st: ast.stmt, empty: set[str], modules: dict, where: str) -> bool:
        """``acc.index_add_(d, sel, src)`` and friends, ``acc[sel] = v`` / ``acc[sel] += v``."""
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Attribute):
            call = st.value
            position = _INDEX_MUTATORS.get(call.func.attr)
            if position is None or call.keywords or len(call.args) != 3:
                return False
            index = call.args[position]
            if not (isinstance(index, ast.Name) and index.id in empty):
                raise Decline(f"{where} writes through an index that is not the empty selection")
            self._accumulator(call.func.value, where)
            for arg in call.args:
                self._pure(arg, modules, where)
            return True
        if isinstance(st, (ast.Assign, ast.AugAssign)):
            target = st.targets[0] if isinstance(st, ast.Assign) and len(st.targets) == 1 else getattr(st, "target", None)
            if not isinstance(target, ast.Subscript):
                return False
            if not (isinstance(target.slice, ast.Name) and target.slice.id in empty):
                raise Decline(f"{where} stores through an index that is not the empty selection")
            self._accumulator(target.value, where)
            self._pure(st.value, modules, where)
            return True
        return False

    def _accumulator(self, node: ast.expr, where: str) -> None:
        if not isinstance(node, ast.Name) or node.id in self.assigned or node.id == self.mask:
            raise Decline(f"{where} writes into something other than a tensor bound before the loop")

    # -- expressions ---------------------------------------------------------------

    def _pure(self, node: ast.expr, modules: dict[str, ast.expr], where: str) -> None:
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
            if self._module_lookup(func):  # self.experts[e](...)
                self._modules_pure(func.value, where)
                self._add_container(func.value)
                continue
            if self._keyed_module(func, where):  # self[f"expert_{e[0]}"](...)
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

    def _keyed_module(self, func: ast.expr, where: str) -> bool:
        """``self[f"expert_{var[0]}"]`` where the module running this is a
        ModuleDict of pure modules; the rewrite guards that every key exists."""
        if not (
            isinstance(func, ast.Subscript) and isinstance(func.value, ast.Name) and func.value.id == "self"
            and isinstance(func.slice, ast.JoinedStr)
        ):
            return False
        scalars = {id(n) for n in self._scalars()} if self.rows else set()
        parts = func.slice.values
        holes = [p.value for p in parts if isinstance(p, ast.FormattedValue)]
        if not holes or not all(id(h) in scalars or (not self.rows and ast.unparse(h) == self.var) for h in holes):
            raise Decline(f"{where}: the module key `{ast.unparse(func.slice)}` holds something besides the index")
        running = self._running()
        if not running or not all(isinstance(m, torch.nn.ModuleDict) for m in running):
            raise Decline(f"{where}: `self[...]` is not a ModuleDict of the model")
        for owner in running:
            for module in owner.values():
                reason = module_impurity(module)
                if reason:
                    raise Decline(f"{where}: {reason}")
        self.keys.append(func.slice)
        return True

    def _modules_pure(self, node: ast.expr, where: str, single: bool = False) -> None:
        """Every module ``self.<attr>`` can be (each element of a ModuleList) is
        pure; or every method it names is."""
        attr = node.attr if isinstance(node, ast.Attribute) else None
        if attr is None:
            raise Decline(f"{where}: the called module is not `self.<attribute>`")
        values = self._values(attr)
        if not values:
            raise Decline(f"{where}: `self.{attr}` cannot be found on the live model")
        if single and all(isinstance(v, types.FunctionType) for v in values):
            for value in values:
                _method_pure(value, where)
            return
        for value in values:
            members = [value] if single or not isinstance(value, (torch.nn.ModuleList, torch.nn.ModuleDict)) else (
                list(value.values()) if isinstance(value, torch.nn.ModuleDict) else list(value)
            )
            for module in members:
                reason = module_impurity(module)
                if reason:
                    raise Decline(f"{where}: {reason}")

    def not_read_after(self) -> None:
        """The loop's names are not read outside it: their last value would change."""
        inside = {id(n) for n in ast.walk(self.loop)}
        outside = [
            n.id for n in ast.walk(self.ctx.fdef)
            if id(n) not in inside and isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
        ]
        leaked = sorted(set(outside) & self.assigned)
        if leaked:
            raise Decline(f"the loop's names {', '.join(leaked)} are read outside it (their last value would change)")


def _under_self(node: ast.expr) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


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


def _method_pure(fn: types.FunctionType, where: str) -> None:
    """A method the loop body calls: pure, no ``raise``/``assert``, nothing that raises on an empty input."""
    reasons = function_impurities(fn)
    if reasons:
        raise Decline(f"{where}: {reasons[0]}")
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        raise Decline(f"{where}: the source of {fn.__qualname__} is not available") from None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Raise, ast.Assert)):
            raise Decline(f"{where}: {fn.__qualname__} may raise")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in RAISE_ON_EMPTY:
            raise Decline(f"{where}: {fn.__qualname__} calls `{ast.unparse(node.func)}`, which raises on an empty input")
