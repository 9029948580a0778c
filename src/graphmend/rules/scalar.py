"""[Scalar] data-dependent scalars and shapes (categories: TI, DO).

## What it rewrites
Source rewrites first, then measured capture for what is left; each proven
or declined:

1. **Source rewrites** (a rewrite beats a captured host read: no sync):

   * *a loop over a filtered index list* (mixture-of-experts routing):
     ``hit = (M.sum(dim=(-1, -2)) > 0).nonzero(as_tuple=True)[0].tolist()``
     followed by ``for e in hit:`` whose body selects ``torch.where(M[e])``
     and only writes through that selection. The list becomes
     ``range(n)``: the loop visits every index in the same ascending order,
     and for an index the filter dropped the selection is empty, so the body
     is a no-op there. An ``if sel.numel() == 0: continue`` guard in such a
     body is dropped (it is a no-op by the same proof).
   * *a scalar fed to tensor arithmetic*: ``x * t.item()`` (also ``+``, ``-``)
     becomes ``x * t.detach()`` when ``x`` is a tensor and ``t`` is 0-dim with
     ``x``'s dtype and device (checked while tracing, the original runs
     otherwise): a 0-dim tensor takes part in type promotion like a Python
     scalar and its value reaches the kernel unchanged, so the result is
     bit-identical.
   * *a count tested by a Python if*: ``n = int((h > 0).sum().item())`` whose
     only uses are ``if n > <Python int>:`` keeps ``n`` as the 0-dim integer
     tensor; the ``if`` becomes a tensor test that [Where] predicates.
2. **Measured capture** (``graphmend/discover/capture.py``). For the remaining
   ``.item()`` / int ``.tolist()`` (TI) and ``nonzero`` / ``torch.where(mask)``
   (DO) sites, discovery runs again with ``capture_scalar_outputs`` and/or
   ``capture_dynamic_output_shape_ops`` on. A setting is kept only when it
   gives fewer graphs with no more recompiles, no more abandoned frames and
   no tracing error; ``graphmend.compile`` then applies it around every call
   (``report.capture``). Sites it removes are reported as "removed by" the
   flag. A loop rewrite that leaves the program worse than the original
   (no capture setting helps) is reverted.

## Why the original breaks
``.tolist()`` of ``nonzero`` makes a Python list whose length depends on
values: Dynamo breaks (GB0036) and, with capture on, fails on
``GuardOnDataDependentSymNode``; the loop over it then breaks again inside
(``graph break in loop`` makes Dynamo run the whole frame eagerly).
``.item()`` breaks (GB0124) unless scalars are captured.

## Example
```python
hit = (mask.sum(dim=(-1, -2)) > 0).nonzero(as_tuple=True)[0].tolist()    # before
for e in hit:
    idx, top_x = torch.where(mask[e])
    out.index_add_(0, top_x, self.experts[e](x[top_x]) * w[top_x, idx, None])

_gm_hit0 = mask.sum(dim=(-1, -2)) > 0                                     # after
if _gm_hit0.dim() == 1 and mask.dim() == 3 and len(self.experts) >= _gm_hit0.shape[0]:
    hit = range(_gm_hit0.shape[0])
else:
    hit = _gm_hit0.nonzero(as_tuple=True)[0].tolist()
for e in hit:
    ...                                    # unchanged; with capture_dynamic_output_shape_ops: 1 graph
```
The ``if`` is on shapes only, so Dynamo decides it while tracing (no break).

## When it declines
- the list is used other than as the iterable of the loop right after it,
  or the loop has an ``else``, ``break`` or ``return``;
- the filter is not ``M.sum(dims) > 0`` over a provably non-negative ``M``
  (``one_hot`` through reshapes, or a comparison) or ``M.any(dims)``;
- the loop body does anything that is not provably a no-op on an empty
  selection: a statement other than pure assignments, ``torch.where(M[e])``
  / ``nonzero``, ``index_add_`` / ``index_copy_`` / indexed stores through
  the selection; a reduction that raises on an empty tensor (``max``,
  ``argmin``, ``item``, ...); a module call whose forward (and submodules')
  is not pure; a name the loop assigns read after the loop;
- ``.item()`` whose value reaches a container, a call, a slice or any use
  other than an operand of ``*``/``+``/``-`` (the other operand must be a
  tensor at run time, else the original runs) or, as an integer count, an
  ``if`` comparison with Python ints;
- any other TI / DO site: only measured capture can help there (reported).

## Fix safety
The loop computes exactly what it did for every index the filter kept, in
the same order; for the others, the selection is empty and the only writes
go through it. Verification compares outputs and state bit for bit on the
example inputs (give inputs where some index is filtered out).
"""

from __future__ import annotations

import ast
import builtins
import copy

import torch

from graphmend.analysis.facts import (
    PURE_TENSOR_METHODS,
    PURE_TORCH_FUNCTIONS,
    FunctionFacts,
    impure_call,
)
from graphmend.rules import Decline, RewriteContext, Rule, register

_SHAPE_METHODS = frozenset({"permute", "transpose", "view", "reshape", "flatten", "contiguous", "unsqueeze", "squeeze"})
_INDEX_MUTATORS = {"index_add_": 1, "index_copy_": 1, "index_fill_": 1}  # method -> position of the index arg
_F_PURE = frozenset(
    """linear silu gelu relu softmax log_softmax sigmoid tanh layer_norm rms_norm dropout embedding
    normalize pad one_hot""".split()
)
_PURE_NN = (
    torch.nn.Linear,
    torch.nn.Identity,
    torch.nn.Dropout,
    torch.nn.LayerNorm,
    torch.nn.Embedding,
    torch.nn.SiLU,
    torch.nn.GELU,
    torch.nn.ReLU,
    torch.nn.Tanh,
    torch.nn.Sigmoid,
    torch.nn.Softmax,
)
_ITEM_OPS = (ast.Mult, ast.Add, ast.Sub)
# Pure, but raise on an empty tensor (no identity element): the loop would now
# run them on an index the filter dropped.
_RAISE_ON_EMPTY = frozenset({"max", "min", "amax", "amin", "argmax", "argmin", "item", "median", "mode", "kthvalue"})


def _load(name: str) -> ast.Name:
    return ast.Name(id=name, ctx=ast.Load())


def _call(func: ast.expr, *args: ast.expr, **kw: ast.expr) -> ast.Call:
    return ast.Call(func=func, args=list(args), keywords=[ast.keyword(arg=k, value=v) for k, v in kw.items()])


def _attr(value: ast.expr, attr: str) -> ast.Attribute:
    return ast.Attribute(value=value, attr=attr, ctx=ast.Load())


def _place(nodes: list[ast.stmt], stmt: ast.stmt) -> list[ast.stmt]:
    """Every new node at the original statement's line (tracebacks, discovery)."""
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, (ast.expr, ast.stmt)):
                sub.lineno, sub.end_lineno = stmt.lineno, stmt.end_lineno
                sub.col_offset, sub.end_col_offset = stmt.col_offset, stmt.end_col_offset
    return nodes


@register
class Scalar(Rule):
    name = "scalar"
    categories = frozenset({"TI", "DO"})
    summary = "measured scalar/dynamic-output capture; full loops over filtered index lists; scalars fed to tensor ops"
    verdict = (
        "[Scalar] capture the value in the graph where measurement shows it helps, "
        "or rewrite the pattern (full loop over a filtered index list, scalar fed to tensor ops); "
        "then [Speculate] guess a flag that steers control flow"
    )
    rank = 4
    codes = {
        "GM401": "tensor to Python scalar (`.item()`, `.tolist()`)",
        "GM402": "data-dependent output shape (`nonzero`, boolean mask)",
    }
    passes = ("capture",)

    def rewrite(self, stmt: ast.stmt, ctx: RewriteContext) -> list[ast.stmt]:
        if isinstance(stmt, ast.Assign) and _index_list(stmt.value, ctx) is not None:
            return _FullLoop(stmt, ctx).rewrite()
        if isinstance(stmt, ast.Assign) and _host_read(stmt.value, ctx) is not None:
            return _TensorTests(stmt, ctx).rewrite()
        items = _ItemOperands(ctx).find(stmt)
        if items:
            return items
        if any(_is_item(n) for n in ast.walk(stmt)):
            raise Decline(
                "the .item() value is used other than in `*`/`+`/`-` (control flow, int(), "
                "a container): no exact source rewrite; capture_scalar_outputs is measured instead"
            )
        raise Decline(
            "the value or shape depends on tensor data and no source pattern applies; "
            "capture_scalar_outputs / capture_dynamic_output_shape_ops are measured instead"
        )


# --------------------------------------------------------------------------
# a loop over a filtered index list


def _index_list(node: ast.expr, ctx: RewriteContext) -> ast.expr | None:
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


class _FullLoop:
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
        flags = _index_list(stmt.value, ctx)
        assert flags is not None
        mask, dims, kind = self._filter(flags)
        var = loop.target.id
        self._check_body(loop, var, mask)
        self._check_not_read_after(loop, var)

        hit = ctx.fresh("hit")
        n = ast.Subscript(value=_attr(_load(hit), "shape"), slice=ast.Constant(0), ctx=ast.Load())
        for builtin in ("range", "len"):
            if not ctx.resolves_to(builtin, getattr(builtins, builtin)):
                raise Decline(f"`{builtin}` is shadowed in this function")
        guards: list[ast.expr] = [
            ast.Compare(left=_call(_attr(_load(hit), "dim")), ops=[ast.Eq()], comparators=[ast.Constant(1)]),
            ast.Compare(left=_call(_attr(_load(mask), "dim")), ops=[ast.Eq()], comparators=[ast.Constant(len(dims) + 1)]),
        ]
        for container in self.containers:
            guards.append(ast.Compare(left=_call(_load("len"), copy.deepcopy(container)), ops=[ast.GtE()], comparators=[n]))
        original = copy.deepcopy(stmt.value)
        original.func.value.value = _replace_flags(original.func.value.value, hit)
        out: list[ast.stmt] = [
            ast.Assign(targets=[ast.Name(id=hit, ctx=ast.Store())], value=copy.deepcopy(flags)),
            ast.If(
                test=ast.BoolOp(op=ast.And(), values=guards),
                body=[ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=_call(_load("range"), copy.deepcopy(n)))],
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
        return _place(out, stmt)

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
            if isinstance(func, ast.Attribute) and func.attr in _RAISE_ON_EMPTY:
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
        call.func.value = _load(hit)
    else:
        call.args[0] = _load(hit)
    return call


def module_impurity(module: torch.nn.Module, depth: int = 0) -> str | None:
    """Why calling ``module`` could have an effect besides its result (None: pure)."""
    from torch.nn.modules import module as module_mod

    name = type(module).__name__
    if module._forward_hooks or module._forward_pre_hooks or module_mod._global_forward_hooks or (
        module_mod._global_forward_pre_hooks
    ):
        return f"{name} has forward hooks"
    if isinstance(module, torch.nn.Dropout):
        return f"{name} draws random numbers in training" if module.training and module.p > 0 else None
    if type(module) in _PURE_NN:
        return None
    if depth > 3:
        return f"{name} nests modules too deep to check"
    import inspect
    import textwrap

    forward = type(module).forward
    try:
        fdef = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return f"the source of {name}.forward is not available"
    from graphmend.analysis.source import bound_names

    local = bound_names(fdef)
    namespace = getattr(forward, "__globals__", {})
    for node in ast.walk(fdef):
        if isinstance(node, (ast.Global, ast.Nonlocal, ast.Yield, ast.YieldFrom, ast.Await)):
            return f"{name}.forward uses `{type(node).__name__.lower()}`"
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, (ast.Attribute, ast.Subscript)) for tgt in targets for t in ast.walk(tgt)):
                return f"{name}.forward stores into an attribute or item"
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _RAISE_ON_EMPTY:
                return f"{name}.forward calls `{ast.unparse(func)}`, which raises on an empty input"
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
                child = getattr(module, func.attr, None)
                if isinstance(child, torch.nn.Module):
                    reason = module_impurity(child, depth + 1)
                    if reason:
                        return reason
                    continue
            reason = impure_call(node, namespace, local, 0, f"{name}.forward")
            if reason:
                return reason
    return None


# --------------------------------------------------------------------------
# n = int(t.item()) used only in `if` tests


def _host_read(node: ast.expr, ctx: RewriteContext) -> ast.expr | None:
    """``t`` of ``int(t.item())`` or ``t.item()``."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "int"
        and ctx.resolves_to("int", int)
        and len(node.args) == 1
        and not node.keywords
    ):
        node = node.args[0]
    return node.func.value if _is_item(node) else None


_HOST_INT_METHODS = frozenset({"numel", "dim", "size"})


class _TensorTests:
    """``n = int(c.sum().item())`` whose every use is ``if n <op> <host int>:``
    -> ``n = c.sum()``: the tests become tensor tests that [Where] predicates."""

    def __init__(self, stmt: ast.Assign, ctx: RewriteContext) -> None:
        self.stmt, self.ctx = stmt, ctx

    def rewrite(self) -> list[ast.stmt]:
        stmt, ctx = self.stmt, self.ctx
        tensor = _host_read(stmt.value, ctx)
        if len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name):
            raise Decline("the scalar is not assigned to one plain name")
        name = stmt.targets[0].id
        facts = FunctionFacts.of(ctx.fdef, ctx.globals, ctx.local_names)
        if len(facts.assignments.get(name, [])) != 1:
            raise Decline(f"`{name}` is assigned more than once")
        parents = {id(child): node for node in ast.walk(ctx.fdef) for child in ast.iter_child_nodes(node)}
        uses = [n for n in ast.walk(ctx.fdef) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]
        if not uses:
            raise Decline(f"`{name}` is never used")
        for use in uses:
            compare = parents.get(id(use))
            owner = parents.get(id(compare))
            if not (isinstance(compare, ast.Compare) and isinstance(owner, ast.If) and owner.test is compare):
                raise Decline(f"`{name}` is used other than directly in an `if` comparison (line {use.lineno})")
            for operand in [compare.left, *compare.comparators]:
                if operand is not use and not self._host_int(operand):
                    raise Decline(f"`{ast.unparse(operand)}` is not provably a Python int (line {use.lineno})")
        if not self._integer_count(tensor):
            raise Decline(
                f"`{ast.unparse(tensor)}` is not provably an integer count (a comparison's .sum() or count_nonzero), "
                "so comparing the tensor could differ from comparing the Python number"
            )
        ctx.notes.append(
            f"`{name}` kept as the 0-dim integer tensor `{ast.unparse(tensor)}`; its only uses are `if` "
            "comparisons with Python ints, now tensor tests for [Where]"
        )
        new = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=copy.deepcopy(tensor))
        return _place([new], stmt)

    def _integer_count(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args and not node.keywords:
            if node.func.attr == "sum":
                return isinstance(node.func.value, ast.Compare)
            if node.func.attr == "count_nonzero":
                return self.ctx.value_of(node.func.value) is None  # a tensor method, not torch.count_nonzero
        if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
            fn = self.ctx.value_of(node.func)
            return fn is torch.count_nonzero or (fn is torch.sum and isinstance(node.args[0], ast.Compare))
        return False

    def _host_int(self, node: ast.expr) -> bool:
        """Constants, ``t.numel()`` / ``t.dim()`` / ``t.size(i)``, ``t.shape[i]``, ``len(x)`` and int arithmetic on them."""
        if isinstance(node, ast.Constant):
            return type(node.value) is int
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)):
            return self._host_int(node.left) and self._host_int(node.right)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
            return isinstance(node.slice, ast.Constant) and type(node.slice.value) is int
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _HOST_INT_METHODS:
            if node.func.attr == "size" and not (len(node.args) == 1 and isinstance(node.args[0], ast.Constant)):
                return False
            return self.ctx.value_of(node.func.value) is None and not node.keywords
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len":
            return self.ctx.resolves_to("len", len)
        return False


# --------------------------------------------------------------------------
# x * t.item()


def _is_item(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "item"
        and not node.args
        and not node.keywords
    )


class _ItemOperands(ast.NodeTransformer):
    """``x <op> t.item()`` -> ``(t.detach() if <x is a tensor, t 0-dim with its dtype and device> else t.item())``.

    The test reads only metadata, so Dynamo decides it while tracing."""

    def __init__(self, ctx: RewriteContext) -> None:
        self.ctx = ctx
        self.count = 0

    def find(self, stmt: ast.stmt) -> list[ast.stmt]:
        items = [n for n in ast.walk(stmt) if _is_item(n)]
        if not items:
            return []
        new = self.visit(copy.deepcopy(stmt))
        if self.count != len(items):
            return []  # some .item() has another use: the caller declines
        self.ctx.notes.append(
            f"{self.count} `.item()` operand(s) of tensor arithmetic kept as 0-dim tensors "
            "(same dtype and device checked while tracing)"
        )
        return _place([ast.fix_missing_locations(new)], stmt)

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        if not isinstance(node.op, _ITEM_OPS):
            return node
        for side, other in (("right", node.left), ("left", node.right)):
            item = getattr(node, side)
            if not (_is_item(item) and self._plain(item.func.value)):
                continue
            if not self._plain(other):
                if side == "left":
                    continue  # the other operand is evaluated after the item: it cannot be read first
                bound = self.ctx.fresh("operand")
                node.left = ast.NamedExpr(target=ast.Name(id=bound, ctx=ast.Store()), value=other)
                other = _load(bound)
            setattr(node, side, self._guarded(item, other))
            self.count += 1
            break
        return node


    @staticmethod
    def _plain(node: ast.expr) -> bool:
        """A name or ``self.<attr>`` chain: evaluating it twice is harmless."""
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name)

    def _guarded(self, item: ast.Call, other: ast.expr) -> ast.expr:
        t = item.func.value
        same = [
            _call(self.ctx.torch("is_tensor"), copy.deepcopy(other)),
            ast.Compare(left=_call(_attr(copy.deepcopy(t), "dim")), ops=[ast.Eq()], comparators=[ast.Constant(0)]),
            ast.Compare(left=_attr(copy.deepcopy(t), "dtype"), ops=[ast.Eq()], comparators=[_attr(copy.deepcopy(other), "dtype")]),
            ast.Compare(left=_attr(copy.deepcopy(t), "device"), ops=[ast.Eq()], comparators=[_attr(copy.deepcopy(other), "device")]),
        ]
        return ast.IfExp(
            test=ast.BoolOp(op=ast.And(), values=same),
            body=_call(_attr(copy.deepcopy(t), "detach")),
            orelse=item,
        )


__all__ = ["Scalar", "module_impurity"]
