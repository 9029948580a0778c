"""Which names of a function are provably tensors, read from source alone.

The shared ``analysis.is_tensor_expr`` decides each expression; this module
only gives it more proven names (``FunctionFacts.tensor_params``):

* a parameter annotated ``torch.Tensor`` (or ``torch.LongTensor`` and the
  other typed classes), ``Optional[...]`` of one or ``... | None`` (``None``
  has no value to branch on);
* a parameter *used as a tensor* in the function: it receives a method only
  tensors have (``x.unsqueeze(...)``, ``x.masked_fill(...)``, ``x.isinf()``,
  ``x.dim()``, ...; not ``sum`` / ``view`` / ``to``, which NumPy arrays or
  modules have too), or is the first argument of a torch function that
  rejects anything else (``torch.isinf(x)``). A parameter also tested with
  ``isinstance`` / ``torch.is_tensor`` / ``type`` is never inferred: the
  function expects other types too. A parameter whose default is a constant
  other than ``None`` (``= False``, ``= 1``) is never a tensor, and an
  annotated one that the function tests as a bare truth value (``if
  output_attentions:``) is taken for the flag it is, not for its annotation;
* a local every assignment of which is a tensor expression (a parameter
  counts only when proven as above).

Anything else (attributes such as ``self.weight``, results of module calls,
tuple unpacking, loop variables) is unproven, so a branch on it is not
reported: a missed site is better than a false one.
"""

from __future__ import annotations

import ast

from graphmend.analysis.facts import (
    PURE_TORCH_FUNCTIONS,
    FunctionFacts,
    is_tensor_annotation,
    is_tensor_expr,
    is_torch_attr,
)
from graphmend.analysis.source import bound_names

#: Methods that only tensors have among the values model code passes around.
TENSOR_ONLY_METHODS = frozenset(
    """unsqueeze masked_fill masked_fill_ isinf isnan isfinite isneginf isposinf contiguous detach dim new_zeros
    new_ones new_full new_empty new_tensor type_as view_as expand expand_as permute masked_select numel nelement
    softmax log_softmax logical_not logical_and logical_or clamp clamp_min clamp_max is_floating_point
    element_size masked_scatter index_select gather scatter scatter_add unflatten""".split()
)

#: torch functions that raise unless their first argument is a tensor.
_NOT_TENSOR_FIRST = frozenset(
    {"arange", "cat", "einsum", "finfo", "full", "iinfo", "ones", "stack", "tensor", "zeros", "where", "allclose"}
)
TENSOR_FIRST_FUNCTIONS = PURE_TORCH_FUNCTIONS - _NOT_TENSOR_FIRST

#: The legacy typed tensor classes, as annotations (``torch.LongTensor``).
_TENSOR_TYPES = frozenset(
    "FloatTensor DoubleTensor HalfTensor BFloat16Tensor LongTensor IntTensor ShortTensor ByteTensor BoolTensor".split()
)

_TYPE_TESTS = frozenset({"isinstance", "is_tensor", "is_torch_tensor", "type", "is_torch_fx_proxy"})

#: Comparison-like operations whose result is a boolean tensor.
_BOOL_FUNCTIONS = frozenset(
    """isinf isnan isfinite isneginf isposinf isclose logical_and logical_or logical_not logical_xor eq ne gt
    lt ge le bool""".split()
)


class _Everything(frozenset):
    """Contains every name."""

    def __contains__(self, item: object) -> bool:
        return True


def optimistic_facts(fdef: ast.FunctionDef | ast.AsyncFunctionDef, namespace: dict) -> FunctionFacts:
    """Facts in which every name is a tensor: ``is_tensor_expr`` only grows with
    the names it is given, so an expression that is not a tensor under these
    facts is not one under any. Costs no walk of the function."""
    return FunctionFacts(fdef=fdef, globals=namespace, local_names=set(), tensor_params=_Everything())


def tensor_facts(fdef: ast.FunctionDef | ast.AsyncFunctionDef, namespace: dict) -> FunctionFacts:
    """``FunctionFacts`` whose ``tensor_params`` holds every provably-tensor name."""
    facts = FunctionFacts.of(fdef, namespace, bound_names(fdef))
    params = _param_names(fdef)
    used, type_tested, truth_tested = _param_uses(fdef, facts)
    annotated = (set(facts.tensor_params) | _optional_tensor_params(fdef, facts)) - truth_tested
    proven = ((used & params) | annotated) - type_tested - _constant_defaults(fdef)
    for name in params - proven:
        # A parameter is whatever the caller passes: one later assignment of a
        # tensor must not make it a tensor everywhere (is_tensor_expr trusts a
        # name assigned exactly once).
        facts.assignments.setdefault(name, []).insert(0, ast.Constant(None))
    # The largest set of names such that, if they all hold tensors, every
    # assignment to them stores a tensor (``h = h * 2`` keeps a tensor a
    # tensor): start from every candidate and drop names until none fails.
    # Proven parameters hold tensors on entry and locals start unbound, so each
    # name of the set holds a tensor whenever it is read.
    known = {n for n in facts.assignments if n not in params or n in proven} | proven
    facts.tensor_params = known
    changed = True
    while changed:
        changed = False
        for name in list(known):
            if not all(is_tensor_expr(v, facts) for v in facts.assignments.get(name, [])):
                known.discard(name)
                changed = True
    return facts


def _constant_defaults(fdef: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Parameters whose default is a constant other than None (``output_attentions:
    Optional[torch.Tensor] = False`` is a flag, whatever the annotation says)."""
    args = fdef.args
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    return {a.arg for a, d in pairs if isinstance(d, ast.Constant) and d.value is not None}


def _param_names(fdef: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = fdef.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    return names


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _optional_tensor(node: ast.AST | None, facts: FunctionFacts) -> bool:
    """``Tensor``, ``Optional[Tensor]``, ``Union[Tensor, None]``, ``Tensor | None``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return False
    if is_tensor_annotation(node, facts):
        return True  # the shared test: torch.Tensor, a Tensor imported from torch
    if isinstance(node, ast.Attribute) and node.attr in _TENSOR_TYPES and isinstance(node.value, ast.Name):
        return facts.resolves_to_torch(node.value.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        parts = [node.left, node.right]
        return any(_is_none(p) for p in parts) and all(_is_none(p) or _optional_tensor(p, facts) for p in parts)
    if isinstance(node, ast.Subscript):
        wrapper = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
        inner = node.slice
        if wrapper == "Optional":
            return _optional_tensor(inner, facts)
        if wrapper == "Union" and isinstance(inner, ast.Tuple):
            return all(_is_none(p) or _optional_tensor(p, facts) for p in inner.elts) and any(
                not _is_none(p) for p in inner.elts
            )
    return False


def _optional_tensor_params(fdef: ast.FunctionDef | ast.AsyncFunctionDef, facts: FunctionFacts) -> set[str]:
    args = fdef.args
    return {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if _optional_tensor(a.annotation, facts)}


def _param_uses(fdef: ast.FunctionDef | ast.AsyncFunctionDef, facts: FunctionFacts) -> tuple[set[str], set[str], set[str]]:
    """(names used as tensors, names type-tested, names used as a bare truth value)."""
    used: set[str] = set()
    type_tested: set[str] = set()
    truth_tested: set[str] = set()
    for node in ast.walk(fdef):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            truth_tested |= _bare_names(node.test)
        elif isinstance(node, ast.Call):
            func = node.func
            first = node.args[0] if node.args else None
            leaf = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if leaf in _TYPE_TESTS and isinstance(first, ast.Name):
                type_tested.add(first.id)
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.attr in TENSOR_ONLY_METHODS:
                used.add(func.value.id)
            elif isinstance(first, ast.Name) and is_torch_attr(func, facts) in TENSOR_FIRST_FUNCTIONS:
                used.add(first.id)
    return used, type_tested, truth_tested


def _bare_names(test: ast.expr) -> set[str]:
    """Names a test reads the truth of directly: ``x``, ``not x``, ``x and y``."""
    if isinstance(test, ast.Name):
        return {test.id}
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _bare_names(test.operand)
    if isinstance(test, ast.BoolOp):
        return {n for v in test.values for n in _bare_names(v)}
    return set()


# --------------------------------------------------------------------------
# what a test turns into a Python bool


def tensor_truth(test: ast.expr, facts: FunctionFacts) -> ast.expr | None:
    """The part of ``test`` whose truth Python must read from tensor data, or None.

    ``x.any()``, ``mask.sum() > 0``, ``not torch.isinf(h).any()``, the tensor
    operand of ``m is not None and m.any()``, ``torch.equal(a, b)`` (a Python
    bool computed from tensor values), ``0 < t.sum() < 5``."""
    if isinstance(test, ast.BoolOp):
        for value in test.values:
            found = tensor_truth(value, facts)
            if found is not None:
                return found
        return None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return tensor_truth(test.operand, facts)
    if is_tensor_expr(test, facts) or is_data_bool(test, facts):
        return test
    if isinstance(test, ast.Compare) and len(test.ops) > 1:
        if not any(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for op in test.ops):
            if any(is_tensor_expr(v, facts) for v in [test.left, *test.comparators]):
                return test
    return None


def is_data_bool(node: ast.AST, facts: FunctionFacts) -> bool:
    """``torch.equal(a, b)`` / ``torch.allclose(a, b)`` or the tensor methods: a
    Python bool read from tensor values."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if is_torch_attr(func, facts) in ("equal", "allclose"):
        return True
    return (
        isinstance(func, ast.Attribute) and func.attr in ("equal", "allclose") and is_tensor_expr(func.value, facts)
    )


def is_bool_tensor(node: ast.AST, facts: FunctionFacts, depth: int = 0) -> bool:
    """A boolean tensor: a comparison with a tensor, ``isinf`` / ``logical_*`` /
    ``eq`` and friends, ``.bool()``, ``~`` / ``&`` / ``|`` of such, or a local
    assigned once from one."""
    if depth > 10:
        return False
    if isinstance(node, ast.Compare):
        return is_tensor_expr(node, facts)  # one operator, not is / in, a tensor operand
    if isinstance(node, ast.Call):
        func = node.func
        if is_torch_attr(func, facts) in _BOOL_FUNCTIONS:
            return True
        return isinstance(func, ast.Attribute) and func.attr in _BOOL_FUNCTIONS and is_tensor_expr(func.value, facts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
        return is_bool_tensor(node.operand, facts, depth + 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
        return is_bool_tensor(node.left, facts, depth + 1) and is_bool_tensor(node.right, facts, depth + 1)
    if isinstance(node, ast.Name):
        values = facts.assignments.get(node.id, [])
        return len(values) == 1 and is_bool_tensor(values[0], facts, depth + 1)
    return False
