"""[Scalar]'s full loop: ``hit = T.nonzero(as_tuple=True)[0].tolist()`` (or
``T.nonzero()`` rows) and a loop over ``hit`` whose body is a no-op where the
filter is false, rewritten to loop over every index (no host read, no
data-dependent length). Part of the [Scalar] rule (scalar.py): this module
finds the list and its loop, proves the filter and writes the rewrite;
_loop_body.py proves the body."""

from __future__ import annotations

import ast
import builtins
import copy

import torch

from graphmend.analysis.facts import FunctionFacts
from graphmend.analysis.purity import param_names
from graphmend.rules import Decline, RewriteContext
from graphmend.rules._ast import attr_of, load_name, make_call, place_at
from graphmend.rules._loop_body import SHAPE_METHODS, LoopBody

# --------------------------------------------------------------------------
# a loop over a filtered index list


def index_list(node: ast.expr, ctx: RewriteContext) -> ast.expr | None:
    """``T`` of ``T.nonzero(as_tuple=True)[0].tolist()`` / ``torch.nonzero(T, as_tuple=True)[0].tolist()``,
    or of the rows form ``T.nonzero()`` / ``torch.nonzero(T)`` (transformers 5's)."""
    rows = _rows(node, ctx)
    if rows is not None:
        return rows
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


def claims(stmt: ast.stmt, ctx: RewriteContext) -> bool:
    """Whether ``stmt`` is this rewrite's to prove or decline: an index list
    (rows of ``nonzero()`` only when a loop over them follows; elsewhere they are
    any data-dependent shape, for measured capture)."""
    if not (isinstance(stmt, ast.Assign) and index_list(stmt.value, ctx) is not None):
        return False
    if _rows(stmt.value, ctx) is None:
        return True
    loop = loop_after(ctx.fdef, stmt, ctx)
    return isinstance(loop, ast.For) and ast.unparse(loop.iter) == ast.unparse(stmt.targets[0])


def _rows(node: ast.expr, ctx: RewriteContext) -> ast.expr | None:
    """``T`` of ``T.nonzero()`` / ``torch.nonzero(T)``: a ``[k, T.dim()]`` tensor of indices."""
    if not (isinstance(node, ast.Call) and not node.keywords):
        return None
    if isinstance(node.func, ast.Attribute) and node.func.attr == "nonzero" and not node.args:
        return None if ctx.value_of(node.func.value) is torch else node.func.value
    if ctx.value_of(node.func) is torch.nonzero and len(node.args) == 1:
        return node.args[0]
    return None


def loop_after(fdef: ast.AST, stmt: ast.stmt, ctx: RewriteContext) -> ast.stmt | None:
    """The statement right after ``stmt``; after its ``with torch.no_grad():``
    block when ``stmt`` ends one (an index list has no gradient either way)."""
    block = _parent_block(fdef, stmt)
    if block is None:
        return None
    index = next(i for i, s in enumerate(block) if s is stmt)
    if index + 1 < len(block):
        return block[index + 1]
    owner = next((n for n in ast.walk(fdef) if isinstance(n, ast.With) and n.body is block), None)
    if owner is None or not all(
        isinstance(item.context_expr, ast.Call) and not item.context_expr.args and item.optional_vars is None
        and ctx.value_of(item.context_expr.func) is torch.no_grad
        for item in owner.items
    ):
        return None
    return loop_after(fdef, owner, ctx)


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
        self.gated = False  # the filter does not prove M[i] all zero: zero the dropped slices first

    def rewrite(self) -> list[ast.stmt]:
        stmt, ctx = self.stmt, self.ctx
        if len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name):
            raise Decline("the index list is not assigned to one plain name")
        name = stmt.targets[0].id
        loop = loop_after(ctx.fdef, stmt, ctx)
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
        rows = _rows(stmt.value, ctx) is not None
        body = LoopBody(ctx, loop, var, mask, rows)
        body.check()
        body.not_read_after()
        for builtin in ("range", "len", "all"):
            if not ctx.resolves_to(builtin, getattr(builtins, builtin)):
                raise Decline(f"`{builtin}` is shadowed in this function")

        hit = ctx.fresh("hit")
        n = ast.Subscript(value=attr_of(load_name(hit), "shape"), slice=ast.Constant(0), ctx=ast.Load())
        fast, slow = self._paths(stmt, name, hit, n, rows)
        if self.gated:
            gated = ctx.fresh("mask")
            keep = ast.UnaryOp(op=ast.Invert(), operand=make_call(attr_of(load_name(hit), "view"), ast.Constant(-1), *[ast.Constant(1)] * len(dims)))
            fast.insert(0, _assign(gated, make_call(attr_of(load_name(mask), "masked_fill"), keep, ast.Constant(0))))
            slow.insert(0, _assign(gated, load_name(mask)))
            for node in ast.walk(loop):
                if isinstance(node, ast.Name) and node.id == mask and isinstance(node.ctx, ast.Load):
                    node.id = gated
        out: list[ast.stmt] = [
            _assign(hit, copy.deepcopy(flags)),
            ast.If(test=ast.BoolOp(op=ast.And(), values=self._guards(body, hit, mask, dims, n)), body=fast, orelse=slow),
        ]
        for guard in body.dropped:
            loop.body.remove(guard)
        as_int = f"`{var}`" if body.unpacked else f"`{var}[0]`"
        ctx.notes.append(
            f"`for {var} in {name}` visits every index of `{ast.unparse(flags)}` in order ({kind})"
            + (f", as a Python int where {as_int} was a 0-dim tensor (used only to index, compare and name)" if rows else "")
            + "; "
            f"the body only writes through the selection of `{mask}[{var}]`, empty for the indices the filter dropped"
            + (f"; {len(body.dropped)} empty-selection guard(s) removed" if body.dropped else "")
        )
        return place_at(out, stmt)

    def _paths(self, stmt: ast.Assign, name: str, hit: str, n: ast.expr, rows: bool) -> tuple[list[ast.stmt], list[ast.stmt]]:
        """``name`` bound to every index (``range(n)``; ``[[i] for i in range(n)]``
        for rows) on the fast path, to the original's list on the other."""
        original = copy.deepcopy(stmt.value)
        if rows:
            original = _replace_flags(original, hit)
            index = self.ctx.fresh("i")
            every: ast.expr = _for_each_index(ast.List(elts=[load_name(index)], ctx=ast.Load()), index, n)
        else:
            original.func.value.value = _replace_flags(original.func.value.value, hit)
            every = make_call(load_name("range"), copy.deepcopy(n))
        return [_assign(name, every)], [_assign(name, original)]

    def _guards(self, body: LoopBody, hit: str, mask: str, dims: tuple[int, ...], n: ast.expr) -> list[ast.expr]:
        """Shapes Dynamo decides while tracing: a 1-dim filter, the mask's rank,
        every index in each container, every module key."""
        guards: list[ast.expr] = [
            ast.Compare(left=make_call(attr_of(load_name(hit), "dim")), ops=[ast.Eq()], comparators=[ast.Constant(1)]),
            ast.Compare(left=make_call(attr_of(load_name(mask), "dim")), ops=[ast.Eq()], comparators=[ast.Constant(len(dims) + 1)]),
        ]
        for container in body.containers:
            guards.append(ast.Compare(left=make_call(load_name("len"), copy.deepcopy(container)), ops=[ast.GtE()], comparators=[n]))
        for key in body.keys:
            index = self.ctx.fresh("key")
            key = copy.deepcopy(key)
            for part in key.values:
                if isinstance(part, ast.FormattedValue):
                    part.value = load_name(index)
            exists = ast.Compare(left=key, ops=[ast.In()], comparators=[load_name("self")])
            guards.append(make_call(load_name("all"), _for_each_index(exists, index, n)))
        return guards

    # -- the filter: T[i] is False exactly when M[i] is all zero ----------------

    def _filter(self, flags: ast.expr) -> tuple[str, tuple[int, ...], str]:
        if (
            isinstance(flags, ast.Call) and not flags.keywords and len(flags.args) == 2
            and any(self.ctx.value_of(flags.func) is f for f in (torch.greater, torch.gt))
        ):
            flags = ast.Compare(left=flags.args[0], ops=[ast.Gt()], comparators=[flags.args[1]])
        if isinstance(flags, ast.Compare) and len(flags.ops) == 1 and isinstance(flags.ops[0], ast.Gt):
            right = flags.comparators[0]
            if not (isinstance(right, ast.Constant) and right.value == 0):
                raise Decline("the filter compares with something other than 0")
            mask, dims = self._reduction(flags.left, "sum")
            if self._non_negative(mask):
                return mask, dims, f"`{mask}` is non-negative, so a zero sum means an all-zero slice"
            self.gated = True
            return mask, dims, (
                f"`{mask}` is not proven non-negative, so the slices the filter drops are zeroed first "
                "(`masked_fill`) and their selection is empty"
            )
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

    def _non_negative(self, mask: str) -> bool:
        """Every value ``mask`` is bound to is one_hot or a comparison, through
        reshapes, or a reshape of ``mask`` itself after such a value."""
        values = sorted(self.facts.assignments.get(mask, []), key=lambda v: (v.lineno, v.col_offset))
        if not values or mask in param_names(self.ctx.fdef):
            return False
        for position, node in enumerate(values):
            while (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SHAPE_METHODS
            ):
                node = node.func.value
            if isinstance(node, ast.Compare):
                continue  # a bool tensor
            if isinstance(node, ast.Call) and self.ctx.value_of(node.func) is torch.nn.functional.one_hot:
                continue
            if position and isinstance(node, ast.Name) and node.id == mask:
                continue  # a reshape of the earlier, non-negative value
            return False
        return True


def _for_each_index(elt: ast.expr, index: str, n: ast.expr) -> ast.ListComp:
    """``[elt for index in range(n)]``."""
    return ast.ListComp(
        elt=elt,
        generators=[ast.comprehension(
            target=ast.Name(id=index, ctx=ast.Store()), iter=make_call(load_name("range"), copy.deepcopy(n)),
            ifs=[], is_async=0,
        )],
    )


def _assign(name: str, value: ast.expr) -> ast.Assign:
    return ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=value)


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
