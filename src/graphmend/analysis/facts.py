"""Static facts about expressions that rules need to prove legality.

* ``is_tensor_expr``: the expression provably evaluates to a tensor (a torch
  function, a tensor method of a proven tensor, arithmetic or a comparison with
  a proven tensor, a parameter annotated ``torch.Tensor``, or a local assigned
  once from such an expression, traced up to 10 assignments deep).
* ``is_safe_index``: an index that never raises on a tensor with enough
  dimensions.
* ``bound_before``: names definitely bound before a statement of a function.

These are deliberately conservative: an unproven fact makes a rule decline.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

import torch

# torch.<fn>(...) calls that return tensors, have no side effects and do not
# raise on well-formed tensor inputs of matching shapes.
PURE_TORCH_FUNCTIONS = frozenset(
    """abs absolute acos add addcmul all allclose amax amin any arange argmax argmin asin atan atan2 bitwise_and
    bitwise_not bitwise_or bitwise_xor bmm broadcast_to cat ceil clamp clamp_max clamp_min clip clone cos cosh
    cumprod cumsum div einsum empty_like eq erf exp expm1 flatten flip floor fmod full full_like ge gt isclose
    isfinite isinf isnan isneginf isposinf le lerp log log10 log1p log2 log_softmax logical_and logical_not
    logical_or logical_xor lt masked_fill matmul max maximum mean min minimum mul nan_to_num ne neg norm ones
    ones_like pow prod reciprocal relu remainder round rsqrt sigmoid sign sin sinh softmax sqrt square squeeze
    stack sub sum tan tanh tensor transpose tril triu unsqueeze where zeros zeros_like finfo iinfo""".split()
)

# tensor.<method>(...) that return a tensor (or metadata) without side effects.
PURE_TENSOR_METHODS = frozenset(
    """abs all amax amin any argmax argmin bfloat16 bool ceil clamp clamp_max clamp_min clip clone contiguous cos
    cumsum detach dim div double eq exp expand expand_as flatten float floor ge gt half int isfinite isinf isnan
    le log log_softmax logical_and logical_not logical_or long lt masked_fill max maximum mean min minimum mul
    nan_to_num ne neg norm numel permute pow prod reciprocal relu reshape round rsqrt sigmoid sign sin size
    softmax sqrt square squeeze sub sum t tanh to transpose type_as unsqueeze view view_as""".split()
)

# Methods whose result is not a tensor (metadata); safe but not tensor-valued.
_NON_TENSOR_METHODS = frozenset({"dim", "numel", "size"})

PURE_BUILTINS = frozenset({"abs", "min", "max", "len", "float", "int", "bool", "isinstance", "hasattr", "getattr"})

_MAX_TRACE = 10


@dataclass
class FunctionFacts:
    """What the analysis knows about one function definition."""

    fdef: ast.FunctionDef | ast.AsyncFunctionDef
    globals: dict[str, Any]
    local_names: set[str]
    assignments: dict[str, list[ast.AST]] = field(default_factory=dict)  # name -> value nodes assigned
    tensor_params: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, fdef: ast.FunctionDef | ast.AsyncFunctionDef, namespace: dict[str, Any], local_names: set[str]) -> "FunctionFacts":
        facts = cls(fdef=fdef, globals=namespace, local_names=local_names)
        for node in ast.walk(fdef):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for name in _target_names(target):
                        facts.assignments.setdefault(name, []).append(
                            node.value if isinstance(target, ast.Name) else ast.Constant(None)
                        )
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name):
                facts.assignments.setdefault(node.target.id, []).append(
                    node.value if isinstance(node, ast.AnnAssign) and node.value is not None else ast.Constant(None)
                )
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.NamedExpr)):
                targets = []
                if isinstance(node, (ast.For, ast.AsyncFor)):
                    targets = [node.target]
                elif isinstance(node, ast.NamedExpr):
                    targets = [node.target]
                else:
                    targets = [i.optional_vars for i in node.items if i.optional_vars is not None]
                for target in targets:
                    for name in _target_names(target):
                        facts.assignments.setdefault(name, []).append(ast.Constant(None))
        args = fdef.args
        for a in args.posonlyargs + args.args + args.kwonlyargs:
            if a.annotation is not None and is_tensor_annotation(a.annotation, facts):
                facts.tensor_params.add(a.arg)
        return facts

    def resolves_to_torch(self, name: str) -> bool:
        return name not in self.local_names and self.globals.get(name) is torch


def _target_names(target: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


def is_tensor_annotation(node: ast.AST, facts: FunctionFacts) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in ("torch.Tensor", "Tensor")
    if isinstance(node, ast.Attribute) and node.attr == "Tensor" and isinstance(node.value, ast.Name):
        return facts.resolves_to_torch(node.value.id)
    if isinstance(node, ast.Name):
        return facts.globals.get(node.id) is torch.Tensor
    return False


def is_torch_attr(node: ast.AST, facts: FunctionFacts) -> str | None:
    """``torch.<name>`` (or ``torch.nn.functional.<name>``) -> name, when torch is the real module."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and facts.resolves_to_torch(node.value.id):
        return node.attr
    return None


def is_tensor_expr(node: ast.AST, facts: FunctionFacts, depth: int = 0) -> bool:
    if depth > _MAX_TRACE:
        return False
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "__graphmend_rt__":
            return func.attr in ("equal",)  # the runtime's tensor-valued torch.equal
        fn = is_torch_attr(node.func, facts)
        if fn is not None:
            return fn in PURE_TORCH_FUNCTIONS and fn not in ("finfo", "iinfo", "allclose")
        if isinstance(node.func, ast.Attribute) and node.func.attr in PURE_TENSOR_METHODS:
            if node.func.attr in _NON_TENSOR_METHODS:
                return False
            return is_tensor_expr(node.func.value, facts, depth + 1)
        return False
    if isinstance(node, ast.BinOp):
        return is_tensor_expr(node.left, facts, depth + 1) or is_tensor_expr(node.right, facts, depth + 1)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Invert)):
        return is_tensor_expr(node.operand, facts, depth + 1)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and not isinstance(node.ops[0], (ast.Is, ast.IsNot, ast.In, ast.NotIn)):
        return is_tensor_expr(node.left, facts, depth + 1) or is_tensor_expr(node.comparators[0], facts, depth + 1)
    if isinstance(node, ast.Name):
        if node.id in facts.tensor_params:
            return True
        values = facts.assignments.get(node.id, [])
        return len(values) == 1 and is_tensor_expr(values[0], facts, depth + 1)
    if isinstance(node, ast.Subscript):
        return is_tensor_expr(node.value, facts, depth + 1) and is_safe_index(node.slice)
    return False


def is_safe_index(node: ast.AST) -> bool:
    """Slices with constant (or absent) bounds, Ellipsis and None never raise on a tensor
    with enough dimensions."""
    if isinstance(node, ast.Tuple):
        return all(is_safe_index(e) for e in node.elts)
    if isinstance(node, ast.Slice):
        return all(
            part is None or (isinstance(part, ast.Constant) and isinstance(part.value, int))
            or (isinstance(part, ast.UnaryOp) and isinstance(part.operand, ast.Constant))
            for part in (node.lower, node.upper, node.step)
        )
    return isinstance(node, ast.Constant) and (node.value is None or node.value is Ellipsis)


def bound_before(fdef: ast.FunctionDef | ast.AsyncFunctionDef, stmt: ast.stmt) -> set[str]:
    """Names definitely bound when ``stmt`` starts: parameters, and names
    assigned by unconditional statements that precede it in its own block and
    in every enclosing block."""
    args = fdef.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    if args.vararg:
        names.add(args.vararg.arg)
    if args.kwarg:
        names.add(args.kwarg.arg)
    path = path_to(fdef.body, stmt)
    if path is None:
        return names
    for block, index in path:
        for prior in block[:index]:
            names |= _definitely_assigned(prior)
    return names


def path_to(body: list[ast.stmt], stmt: ast.stmt) -> list[tuple[list[ast.stmt], int]] | None:
    for i, node in enumerate(body):
        if node is stmt:
            return [(body, i)]
        for name in ("body", "orelse", "finalbody"):
            inner = getattr(node, name, None)
            if inner and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found = path_to(inner, stmt)
                if found is not None:
                    return [(body, i)] + found
        for handler in getattr(node, "handlers", []) or []:
            found = path_to(handler.body, stmt)
            if found is not None:
                return [(body, i)] + found
    return None


def _definitely_assigned(stmt: ast.stmt) -> set[str]:
    if isinstance(stmt, ast.Assign):
        return {n for t in stmt.targets for n in _target_names(t) if isinstance(t, (ast.Name, ast.Tuple, ast.List))}
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and isinstance(stmt.target, ast.Name):
        return {stmt.target.id} if getattr(stmt, "value", None) is not None or isinstance(stmt, ast.AugAssign) else set()
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names}
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, ast.If):
        body, body_leaves = _block_assigned(stmt.body)
        other, other_leaves = _block_assigned(stmt.orelse)
        if body_leaves and other_leaves:
            return set()
        if body_leaves:
            return other  # after the if, only the else path continues
        if other_leaves:
            return body
        return body & other
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return _block_assigned(stmt.body)[0]
    return set()


def _block_assigned(block: list[ast.stmt]) -> tuple[set[str], bool]:
    """(names assigned, whether the block always leaves by return/raise)."""
    names: set[str] = set()
    for s in block:
        if isinstance(s, (ast.Return, ast.Raise)):
            return names, True
        names |= _definitely_assigned(s)
    return names, False
