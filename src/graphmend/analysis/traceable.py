"""What Dynamo cannot capture inside a ``torch.cond`` branch.

graphmend compiles without ``fullgraph=True``; there, Dynamo must trace a
``torch.cond`` branch whole, or the call fails with
``UncapturedHigherOrderOpError`` (measured on torch 2.13). Two kinds of code
break a branch that the same code outside ``torch.cond`` would only split:

* an operation whose output shape or value depends on tensor data
  (``value_shaped``): ``h[h > 0]`` (an index that may be a boolean mask),
  ``torch.where(mask)``, ``nonzero``, ``masked_select``, ``unique``,
  ``.item()``, ``.tolist()``;
* a test Dynamo cannot decide while tracing (``data_tests``): ``if
  h.max() > 1:`` in a helper the branch calls.

[Where] reads a branch with the function's facts (an index whose dtype kinds
rule bool out is kept: ``idx = torch.arange(2).long()``), and the source of a
helper alone (any tensor index may be a mask; only tests on ``is``/``is not``,
``isinstance``, ``hasattr``, ``self.training`` and constants are static)."""

from __future__ import annotations

import ast

from graphmend.analysis.dtypes import BOOL, kinds_of
from graphmend.analysis.facts import FunctionFacts
from graphmend.analysis.purity import param_names

_VALUE_SHAPED = frozenset("nonzero argwhere masked_select unique unique_consecutive bincount item tolist".split())
_STATIC_CALLS = frozenset({"isinstance", "hasattr", "callable"})


def value_shaped(node: ast.AST, facts: FunctionFacts | None) -> list[str]:
    """The operations in ``node`` whose output shape or value depends on tensor
    data. An index is a mask unless its kinds (through ``facts``) rule bool out;
    without facts, any index other than a constant or slice may be one."""
    out: list[str] = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Subscript) and not (isinstance(sub.value, ast.Attribute) and sub.value.attr == "shape"):
            parts = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
            for part in parts:
                if isinstance(part, ast.Slice):
                    if not all(b is None or _size(b, facts) for b in (part.lower, part.upper, part.step)):
                        out.append(f"`{ast.unparse(sub)}` (`{ast.unparse(part)}` may be bounded by tensor values)")
                elif not _size(part, facts) and (facts is None or BOOL in kinds_of(part, facts)):
                    out.append(f"`{ast.unparse(sub)}` (`{ast.unparse(part)}` may be a boolean mask)")
        elif isinstance(sub, ast.Call) and isinstance(sub.func, (ast.Attribute, ast.Name)):
            name = sub.func.attr if isinstance(sub.func, ast.Attribute) else sub.func.id
            one_arg_where = name == "where" and len(sub.args) + len(sub.keywords) == 1
            if name in _VALUE_SHAPED or one_arg_where:
                out.append(f"`{ast.unparse(sub)}`")
    return list(dict.fromkeys(out))


def data_tests(node: ast.AST) -> list[str]:
    """The tests of ``if``, ``while``, ``assert`` and conditional expressions in
    ``node`` not shown static from their source (they may be tensor values)."""
    out: list[str] = []
    for sub in ast.walk(node):
        test = sub.test if isinstance(sub, (ast.If, ast.While, ast.Assert, ast.IfExp)) else None
        if test is not None and not _static(test):
            out.append(f"the test `{ast.unparse(test)}` may be on tensor values")
    return list(dict.fromkeys(out))


def _static(test: ast.expr) -> bool:
    if isinstance(test, ast.Constant):
        return True
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _static(test.operand)
    if isinstance(test, ast.BoolOp):
        return all(_static(v) for v in test.values)
    if isinstance(test, ast.Compare):
        return all(isinstance(op, (ast.Is, ast.IsNot)) for op in test.ops)
    if isinstance(test, ast.Call):
        return isinstance(test.func, ast.Name) and test.func.id in _STATIC_CALLS
    if isinstance(test, ast.Attribute):  # `self.training`: nn.Module's Python bool
        return isinstance(test.value, ast.Name) and test.value.id == "self" and test.attr == "training"
    return False


def _size(node: ast.expr, facts: FunctionFacts | None, depth: int = 0) -> bool:
    """A Python number Dynamo knows while tracing: a constant, ``x.shape[i]``,
    ``x.size(i)``, ``x.dim()``, ``x.ndim``, ``len(x)``, arithmetic of those, or
    (with ``facts``) a local assigned once from one."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp):
        return _size(node.operand, facts, depth)
    if isinstance(node, ast.BinOp):
        return _size(node.left, facts, depth) and _size(node.right, facts, depth)
    if isinstance(node, ast.Attribute):
        return node.attr == "ndim"
    if isinstance(node, ast.Subscript):
        return isinstance(node.value, ast.Attribute) and node.value.attr == "shape" and _size(node.slice, facts, depth)
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name):
            return node.func.id == "len"
        return isinstance(node.func, ast.Attribute) and node.func.attr in ("size", "dim") and all(
            _size(a, facts, depth) for a in node.args
        )
    if isinstance(node, ast.Name) and facts is not None and depth < 10:
        if node.id in param_names(facts.fdef):
            return False
        values = facts.assignments.get(node.id, [])
        return len(values) == 1 and isinstance(values[0], ast.expr) and _size(values[0], facts, depth + 1)
    return False
