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
     body is dropped (it is a no-op by the same proof). When ``M`` is not
     provably non-negative (``one_hot`` or a comparison, through reshapes),
     a zero sum does not mean an empty slice: the rewrite zeroes the slices
     the filter drops first (``M.masked_fill(~flags, 0)``, read by the loop
     under a fresh name), so their selection is empty. transformers 5's
     forms are handled too: the list as rows, ``hit = torch.greater(
     M.sum(...), 0).nonzero()`` (in a ``with torch.no_grad():`` block or not),
     visited as ``[[i] for i in range(n)]``. The body reads ``e`` as that
     one-element list (``M[e].squeeze(0)``) and ``e[0]``, or ``e`` after
     ``e = e[0]``, as a Python int where it was a 0-dim tensor; each use is
     one an int keeps: an index into a tensor or ModuleList of the model, an
     index guard ``if e == self.n: continue``, a ModuleDict key
     ``self[f"expert_{e[0]}"]`` (guarded: every key exists).
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
- the rows form: the body uses the index other than as above (``e * 2``,
  a dict key, a row into a ModuleList);
- an index ``C[e]`` into something the loop binds (each other ``C`` is
  guarded ``len(C) >= n`` while tracing);
- the filter is not ``M.sum(dims) > 0`` or ``M.any(dims)`` over every dim
  of ``M`` but the first;
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
import copy

import torch

from graphmend.analysis.facts import (
    FunctionFacts,
)
from graphmend.rules import Decline, RewriteContext, Rule, register
from graphmend.rules._ast import attr_of, load_name, make_call, place_at
from graphmend.rules._full_loop import FullLoop, claims
from graphmend.rules._predicate import is_item_call, item_test
from graphmend.rules.where import Where

_ITEM_OPS = (ast.Mult, ast.Add, ast.Sub)
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
        if claims(stmt, ctx):
            return FullLoop(stmt, ctx).rewrite()
        if isinstance(stmt, ast.Assign) and _host_read(stmt.value, ctx) is not None:
            return _TensorTests(stmt, ctx).rewrite()
        if isinstance(stmt, ast.If) and item_test(stmt.test, ctx) is not None:
            return _predicated_item_test(stmt, ctx)
        items = _ItemOperands(ctx).find(stmt)
        if items:
            return items
        if any(is_item_call(n) for n in ast.walk(stmt)):
            raise Decline(
                "the .item() value is used other than in `*`/`+`/`-` (control flow, int(), "
                "a container): no exact source rewrite; capture_scalar_outputs is measured instead"
            )
        raise Decline(
            "the value or shape depends on tensor data and no source pattern applies; "
            "capture_scalar_outputs / capture_dynamic_output_shape_ops are measured instead"
        )


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
    return node.func.value if is_item_call(node) else None


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
        return place_at([new], stmt)

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
# if t.item() > 0:


def _predicated_item_test(stmt: ast.If, ctx: RewriteContext) -> list[ast.stmt]:
    """``if t.item() > 0:`` predicated by [Where] on the tensor test ``item_test`` makes."""
    original = stmt.test
    stmt.test = item_test(original, ctx)  # type: ignore[assignment]  # Where reads the statement in place
    try:
        out = Where().rewrite(stmt, ctx)
    except Decline as exc:
        raise Decline(f"`{ast.unparse(original)}` as a tensor test (runtime.item_of), [Where]: {exc.reason}") from None
    finally:
        stmt.test = original
    ctx.notes.insert(0, "the .item() comparison is a tensor test where exact (runtime.item_of), predicated by [Where]")
    return out


# --------------------------------------------------------------------------
# x * t.item()


class _ItemOperands(ast.NodeTransformer):
    """``x <op> t.item()`` -> ``(t.detach() if <x is a tensor, t 0-dim with its dtype and device> else t.item())``.

    The test reads only metadata, so Dynamo decides it while tracing."""

    def __init__(self, ctx: RewriteContext) -> None:
        self.ctx = ctx
        self.count = 0

    def find(self, stmt: ast.stmt) -> list[ast.stmt]:
        items = [n for n in ast.walk(stmt) if is_item_call(n)]
        if not items:
            return []
        new = self.visit(copy.deepcopy(stmt))
        if self.count != len(items):
            return []  # some .item() has another use: the caller declines
        self.ctx.notes.append(
            f"{self.count} `.item()` operand(s) of tensor arithmetic kept as 0-dim tensors "
            "(same dtype and device checked while tracing)"
        )
        return place_at([ast.fix_missing_locations(new)], stmt)

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        if not isinstance(node.op, _ITEM_OPS):
            return node
        for side, other in (("right", node.left), ("left", node.right)):
            item = getattr(node, side)
            if not is_item_call(item):
                continue
            if not self._plain(other):
                if side == "left":
                    continue  # the other operand is evaluated after the item: it cannot be read first
                bound = self.ctx.fresh("operand")
                node.left = ast.NamedExpr(target=ast.Name(id=bound, ctx=ast.Store()), value=other)
                other = load_name(bound)
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
        """The test, the 0-dim tensor and ``.item()``. A receiver other than a name
        (``h.sum().item()``) is evaluated once, where the original evaluates it:
        bound by the test's first check, which always runs."""
        t = item.func.value
        first = copy.deepcopy(t)
        if not self._plain(t):
            bound = self.ctx.fresh("item")
            first, t = ast.NamedExpr(target=ast.Name(id=bound, ctx=ast.Store()), value=t), load_name(bound)
            item = make_call(attr_of(copy.deepcopy(t), "item"))
        same = [
            make_call(self.ctx.torch("is_tensor"), first),
            make_call(self.ctx.torch("is_tensor"), copy.deepcopy(other)),
            ast.Compare(left=make_call(attr_of(copy.deepcopy(t), "dim")), ops=[ast.Eq()], comparators=[ast.Constant(0)]),
            ast.Compare(left=attr_of(copy.deepcopy(t), "dtype"), ops=[ast.Eq()], comparators=[attr_of(copy.deepcopy(other), "dtype")]),
            ast.Compare(left=attr_of(copy.deepcopy(t), "device"), ops=[ast.Eq()], comparators=[attr_of(copy.deepcopy(other), "device")]),
        ]
        return ast.IfExp(
            test=ast.BoolOp(op=ast.And(), values=same),
            body=make_call(attr_of(copy.deepcopy(t), "detach")),
            orelse=item,
        )


__all__ = ["Scalar"]
