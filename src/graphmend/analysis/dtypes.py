"""Dtypes on the path not taken: a speculated expression must not raise for
the dtype its tensors have where the original would not have evaluated it.

[Where] computes both branches; [Trap] evaluates a message; an elif's later
test is evaluated before the earlier one is known false. ``purity._spec``
proves each operation pure, but a pure torch operation still raises for some
dtypes: ``h - 1`` on a bool tensor, ``h.relu()`` on a complex one, ``h.mean()``
on an integer one, ``h // d`` on integers where ``d`` holds a zero,
``h.masked_fill(m, -1e9)`` on float16. With eager taking the other branch the
original never met the raise::

    if h.sum() > 0:          # h is a bool tensor: h.sum() is 1
        h = h * 2
    else:
        h = h - 1            # never run eagerly; raises if computed

``dtype_blockers`` reads each operation's operands as sets of dtype *kinds*
(bool, integer, floating, complex), from constants, casts, comparisons and
the kinds each operation returns, through locals assigned once. Where an
operand may be a kind the operation raises on, it narrows a *root* (a name
bound before the speculated code and not rebound in it, or an attribute
chain of one) to the kinds that cannot raise: ``empty.kinds[root]``, which
``rules/_predicate.add_guards`` turns into ``runtime.is_kind(root, ...)``.
Dtypes are fixed while Dynamo traces (and guarded by it), so the guard costs
nothing in the graph; a tensor of another kind takes the original statement.
Where no root can be narrowed, the expression is declined with the reason.

``RAISES`` is the one table of which kinds each operation raises on, measured
on torch (``tests/test_dtypes.py`` measures it again on every torch a lane
runs). A pure operation missing from it is declined, never assumed total.
"""

from __future__ import annotations

import ast
import copy
import itertools
from typing import Iterator

from graphmend.analysis.facts import PURE_TENSOR_METHODS, FunctionFacts, is_torch_attr
from graphmend.analysis.source import always_evaluated, is_runtime_call
from graphmend.analysis.speculated import Emptiness

BOOL, INT, FLOAT, COMPLEX = "bool", "integer", "floating", "complex"
KINDS = (BOOL, INT, FLOAT, COMPLEX)  # in promotion order
ANY = frozenset(KINDS)
_B, _I, _F, _C = frozenset({BOOL}), frozenset({INT}), frozenset({FLOAT}), frozenset({COMPLEX})

# The kinds a method or torch function raises on, for its receiver or first
# argument (measured on torch 2.12-2.15; value-dependent ones below).
RAISES: dict[str, frozenset[str]] = {
    **dict.fromkeys(["abs", "absolute", "neg", "negative", "sub", "subtract", "addcmul", "matmul", "bmm", "einsum"], _B),
    **dict.fromkeys(
        "amax amin max min clamp clamp_min clamp_max clip sign maximum minimum erf isneginf isposinf atan2 lt le gt ge "
        "fmod remainder"
        .split(), _C),
    **dict.fromkeys(["argmax", "argmin", "ceil", "floor", "round", "relu"], _B | _C),
    **dict.fromkeys(["mean", "norm", "lerp", "finfo"], _B | _I),
    **dict.fromkeys(["softmax", "log_softmax"], _B | _I | _C),
    "iinfo": _B | _F | _C,
    **dict.fromkeys(["bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not"], _F | _C),
    # total on every kind
    **dict.fromkeys(
        """add mul div all any bool bfloat16 double float half int long clone contiguous detach cos cosh sin sinh tan
        tanh acos asin atan exp expm1 log log10 log1p log2 sigmoid sqrt rsqrt square reciprocal isfinite isinf isnan
        logical_not logical_and logical_or logical_xor eq ne sum prod cumsum cumprod flatten squeeze unsqueeze t
        transpose permute view view_as reshape expand expand_as broadcast_to chunk flip tril triu cat stack where
        nan_to_num to type_as isclose allclose empty_like zeros_like ones_like zeros ones arange tensor full
        full_like masked_fill pow dim numel size""".split(),
        frozenset()),
}
# Value-dependent, on top of RAISES: a divisor that may hold a zero raises on
# integers; a negative exponent on integers; a fill value that does not fit.
_DIVIDES = frozenset({"fmod", "remainder"})
_HALF_MAX = 65504.0  # the largest float16; a larger fill value raises there

# What an operation returns for each kind of its receiver.
_TO_BOOL = frozenset(
    "all any isfinite isinf isnan isneginf isposinf logical_not logical_and logical_or logical_xor eq ne lt le gt ge isclose"
    .split())
_TO_FLOATING = frozenset(  # bool and integer come out floating
    "cos cosh sin sinh tan tanh acos asin atan exp expm1 log log10 log1p log2 sigmoid sqrt rsqrt reciprocal erf atan2 "
    "softmax log_softmax mean norm lerp".split())
_SUMS = frozenset({"sum", "prod", "cumsum", "cumprod", "square"})  # bool comes out integer
_CASTS = {"bool": _B, "int": _I, "long": _I, "float": _F, "double": _F, "half": _F, "bfloat16": _F}
_DTYPES = {
    **dict.fromkeys(["bool"], BOOL),
    **dict.fromkeys("uint8 int8 int16 int32 int64 short int long".split(), INT),
    **dict.fromkeys("float16 float32 float64 bfloat16 half float double".split(), FLOAT),
    **dict.fromkeys("complex32 complex64 complex128 chalf cfloat cdouble".split(), COMPLEX),
}
_SCALAR = {bool: BOOL, int: INT, float: FLOAT, complex: COMPLEX}
_SHAPES = frozenset({"shape", "dtype", "device", "ndim", "layout"})


def promote(*kinds: frozenset[str]) -> frozenset[str]:
    """The kinds arithmetic over operands of these kinds can give (the higher kind wins)."""
    out: set[str] = set()
    for choice in _product(kinds):
        out.add(max(choice, key=KINDS.index))
    return frozenset(out)


def _product(kinds: tuple[frozenset[str], ...]) -> Iterator[tuple[str, ...]]:
    present = [k for k in kinds if k]
    if present:
        yield from itertools.product(*present)


class _Kinds:
    """Reads kinds of expressions of one function, with ``known`` roots narrowed."""

    def __init__(
        self,
        facts: FunctionFacts,
        guardable: frozenset[str] | None,
        rebound: frozenset[str] = frozenset(),
        aliases: dict[str, ast.expr] | None = None,
    ) -> None:
        self.facts, self.rebound, self.aliases = facts, rebound, aliases or {}
        self.guardable_names = guardable  # None: every name (facts a test proves)
        self.params = {a.arg for a in facts.fdef.args.args + facts.fdef.args.kwonlyargs + facts.fdef.args.posonlyargs}

    def stable(self, name: str) -> bool:
        """A name with one value wherever it is bound (a parameter never
        assigned, or a local assigned once): an expression it was assigned
        from reads the same values at every later point."""
        count = len(self.facts.assignments.get(name, []))
        return count == 0 if name in self.params else count == 1

    def guardable(self, key: str, top: bool) -> bool:
        root = key.split(".")[0]
        if root in self.rebound or (self.guardable_names is not None and root not in self.guardable_names):
            return False
        return top or ("." not in key and self.stable(root))

    def of(self, node: ast.AST, known: dict[str, frozenset[str]], depth: int = 0) -> frozenset[str]:
        """The kinds ``node`` may have (empty: not a number or tensor)."""
        key = key_of(node)
        if key is not None and key in known:
            return known[key]
        if depth > 10:
            return ANY
        if isinstance(node, ast.Constant):
            kind = _SCALAR.get(type(node.value))
            return frozenset({kind}) if kind else frozenset()
        if isinstance(node, ast.Name) and node.id in self.aliases:
            return self.of(self.aliases[node.id], known, depth + 1)
        if isinstance(node, ast.Name):
            values = self.facts.assignments.get(node.id, [])
            if node.id not in self.params and len(values) == 1 and isinstance(values[0], ast.expr):
                # Its value, where a name bound again since meant what it held then:
                # only what is known of names with one value applies there.
                steady = {k: v for k, v in known.items() if "." not in k and self.stable(k)}
                return self.of(values[0], steady, depth + 1)
            return ANY
        if isinstance(node, ast.Attribute):
            if node.attr in _SHAPES:
                return _I if node.attr == "ndim" else frozenset()
            if node.attr in ("T", "mT", "H", "data"):
                return self.of(node.value, known, depth + 1)
            if node.attr in ("real", "imag"):
                return frozenset(FLOAT if k == COMPLEX else k for k in self.of(node.value, known, depth + 1))
            if node.attr in ("min", "max", "eps", "tiny") and _info(node.value, self.facts):
                return _F if _info(node.value, self.facts) == "finfo" else _I
            return ANY
        if isinstance(node, ast.Subscript):
            if isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
                return _I
            return self.of(node.value, known, depth + 1)
        if isinstance(node, ast.UnaryOp):
            return _B if isinstance(node.op, ast.Not) else self.of(node.operand, known, depth + 1)
        if isinstance(node, ast.Compare):
            return _B
        if isinstance(node, (ast.BoolOp, ast.IfExp)):
            parts = node.values if isinstance(node, ast.BoolOp) else [node.body, node.orelse]
            return frozenset().union(*(self.of(p, known, depth + 1) for p in parts))
        if isinstance(node, ast.BinOp):
            both = promote(self.of(node.left, known, depth + 1), self.of(node.right, known, depth + 1))
            if isinstance(node.op, ast.Div):
                return frozenset(FLOAT if k in (BOOL, INT) else k for k in both)
            return both
        if isinstance(node, ast.Call):
            return self._call(node, known, depth)
        return ANY

    def _call(self, node: ast.Call, known: dict[str, frozenset[str]], depth: int) -> frozenset[str]:
        if is_runtime_call(node, "item_of") and node.args:  # the value as a 0-dim tensor, or its .item(): its kind
            return self.of(node.args[0], known, depth + 1)
        name, receiver, args = operation(node, self.facts)
        dtype = next((_dtype_kind(k.value, self.facts) for k in node.keywords if k.arg == "dtype"), None)
        if dtype is not None:
            return frozenset({dtype})
        if name is None:
            builtin = node.func.id if isinstance(node.func, ast.Name) else None
            if builtin in ("float", "int", "bool", "len"):
                return {"float": _F, "bool": _B}.get(builtin, _I)
            if builtin == "abs" and len(node.args) == 1:
                return frozenset(FLOAT if k == COMPLEX else k for k in self.of(node.args[0], known, depth + 1))
            if builtin in ("min", "max") and node.args and not node.keywords:
                return promote(*(self.of(a, known, depth + 1) for a in node.args))
            return ANY
        if name in _CASTS:
            return _CASTS[name]
        if name in ("dim", "numel", "size"):
            return _I
        if name == "to":
            kinds = [_dtype_kind(a, self.facts) for a in args]
            if any(kinds):
                return frozenset(k for k in kinds if k)
            if args and isinstance(args[0], ast.Attribute) and args[0].attr == "dtype":
                return self.of(args[0].value, known, depth + 1)
            if args and all(_is_device(a) for a in args):  # h.to(x.device), h.to("cpu"): the same dtype
                return self.of(receiver, known, depth + 1) if receiver is not None else ANY
            return ANY
        if name == "type_as" and args:
            return self.of(args[0], known, depth + 1)
        if name in ("argmax", "argmin"):
            return _I
        if name in _TO_BOOL:
            return _B
        if name in ("zeros", "ones", "empty", "arange", "tensor", "full") and is_torch_attr(node.func, self.facts):
            return ANY if name in ("arange", "tensor", "full") else _F
        own = self.of(receiver, known, depth + 1) if receiver is not None else ANY
        if name in _TO_FLOATING:
            return frozenset(FLOAT if k in (BOOL, INT) else k for k in own)
        if name in _SUMS:
            return frozenset(INT if k == BOOL else k for k in own)
        if name in ("where",) and len(args) == 2:
            return promote(self.of(args[0], known, depth + 1), self.of(args[1], known, depth + 1))
        if name in ("add", "sub", "mul", "maximum", "minimum", "fmod", "remainder", "pow") and args:
            return promote(own, self.of(args[0], known, depth + 1))
        if name in ("cat", "stack") and isinstance(receiver, (ast.List, ast.Tuple)):
            return promote(*(self.of(e, known, depth + 1) for e in receiver.elts))
        if name in ("max", "min") and args:
            return ANY  # (values, indices) of a dimension, or the elementwise max of two tensors
        if name in RAISES:
            return own
        return ANY


def key_of(node: ast.AST) -> str | None:
    """``h`` or ``self.scale``: a name or an attribute chain over one, as source."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def operation(node: ast.Call, facts: FunctionFacts) -> tuple[str | None, ast.expr | None, list[ast.expr]]:
    """``(name, receiver, other arguments)`` of ``torch.fn(x, ...)`` or ``x.fn(...)``."""
    fn = is_torch_attr(node.func, facts)
    if fn is not None:
        return fn, (node.args[0] if node.args else None), list(node.args[1:])
    if isinstance(node.func, ast.Attribute):
        return node.func.attr, node.func.value, list(node.args)
    return None, None, list(node.args)


def _dtype_kind(node: ast.AST, facts: FunctionFacts) -> str | None:
    """The kind of ``torch.float16`` (torch under any name it is imported as: ``th.float16``)."""
    literal = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch"
    name = node.attr if literal else is_torch_attr(node, facts)  # type: ignore[union-attr]
    return _DTYPES.get(name) if name is not None else None


def _is_device(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "device") or (
        isinstance(node, ast.Constant) and isinstance(node.value, str)
    )


def _info(node: ast.AST, facts: FunctionFacts) -> str | None:
    """``finfo`` or ``iinfo`` for ``torch.finfo(...)``."""
    if isinstance(node, ast.Call):
        fn = is_torch_attr(node.func, facts)
        if fn in ("finfo", "iinfo"):
            return fn
    return None


def _number(node: ast.AST) -> float | int | None:
    """A number constant (``2``, ``-1.5``, ``float("-inf")``), or None."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _number(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "float"
        and len(node.args) == 1 and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
    ):
        try:
            return float(node.args[0].value)
        except ValueError:
            return None
    return None


def kinds_of(node: ast.AST, facts: FunctionFacts) -> frozenset[str]:
    """The kinds ``node`` may have anywhere in the function (empty: not a number or tensor)."""
    return _Kinds(facts, None).of(node, {})


def dtype_blockers(node: ast.AST, facts: FunctionFacts, empty: Emptiness) -> list[str]:
    """Why evaluating ``node`` on the path not taken may raise for a dtype no
    guard can rule out (empty when none); the guards it needs go to ``empty.kinds``."""
    reader = _Kinds(facts, empty.guardable | set(empty.renamed), empty.rebound, empty.aliases)  # renamed: see shapes.py
    proven = {k: v for k, v in empty.proven.items() if k.split(".")[0] not in empty.rebound}
    shown = Renamed({temp: key for key, temp in empty.renamed.items()})
    node = Renamed(empty.renamed).visit(copy.deepcopy(node))  # a name the branch assigned: its temporary
    out: list[str] = []
    for sub in ast.walk(node):
        for operand, forbidden, what in _requirements(sub, facts):
            if not forbidden:
                continue
            known = {**proven, **empty.kinds}
            before = dict(known)
            if _narrow(reader, operand, forbidden, known):
                empty.kinds.update({k: v for k, v in known.items() if before.get(k) != v})
            elif forbidden == ANY:
                out.append(f"`{what}` has no measured dtype facts (graphmend's table of what raises)")
            else:
                kinds = sorted(forbidden & reader.of(operand, known), key=KINDS.index)
                text = ast.unparse(shown.visit(copy.deepcopy(operand)))
                out.append(f"`{shown.text(what)}` raises on a {' or '.join(kinds)} tensor, which `{text}` may be there")
    return out


class Renamed(ast.NodeTransformer):
    """Names and attribute chains read, renamed (``h`` -> ``_gm_t0``)."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.AST:
        new = self.names.get(node.id)
        return ast.Name(id=new, ctx=node.ctx) if new and isinstance(node.ctx, ast.Load) else node

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        new = self.names.get(key_of(node) or "")
        if new and isinstance(node.ctx, ast.Load):
            return ast.Name(id=new, ctx=ast.Load())
        return self.generic_visit(node)

    def text(self, code: str) -> str:
        try:
            return ast.unparse(self.visit(ast.parse(code, mode="eval").body))
        except SyntaxError:
            return code


def tested_kinds(test: ast.expr, facts: FunctionFacts) -> dict[str, frozenset[str]]:
    """What evaluating ``test`` without raising proves of the dtypes it reads
    (``h.sum() > 0``: ``h`` is not complex). Only parts always evaluated count
    (the first operand of and/or, not an ``if`` expression's branches)."""
    reader = _Kinds(facts, None)
    known: dict[str, frozenset[str]] = {}
    for node in always_evaluated(test):
        for operand, forbidden, _ in _requirements(node, facts):
            if forbidden and forbidden != ANY:
                _prove(reader, operand, forbidden, known)
    return known


def _prove(reader: _Kinds, operand: ast.expr, forbidden: frozenset[str], known: dict[str, frozenset[str]]) -> None:
    """Narrow in ``known`` each root of ``operand`` that cannot be of a kind for
    which ``operand`` is surely of a ``forbidden`` one (it would have raised).
    Surely, not maybe: ``(x + y) - 1`` proves nothing of ``x``."""
    before = dict(known)
    for key, _ in _roots(operand, reader, deep=True):
        current = before.get(key, ANY)
        kept = frozenset(k for k in current if not (reader.of(operand, {**before, key: frozenset({k})}) <= forbidden))
        if kept != current:
            known[key] = kept & known.get(key, ANY)


def _requirements(node: ast.AST, facts: FunctionFacts) -> Iterator[tuple[ast.expr, frozenset[str], str]]:
    """(operand, kinds it must not have, what raises) for one operation."""
    if isinstance(node, ast.BinOp):
        what = ast.unparse(node)
        op = node.op
        if isinstance(op, ast.Sub):
            yield node.left, _B, what
            yield node.right, _B, what
        elif isinstance(op, (ast.FloorDiv, ast.Mod)):
            divisor = _number(node.right)
            forbidden = _C if divisor not in (None, 0) else _B | _I | _C
            yield node.left, forbidden, what
            yield node.right, forbidden, what
        elif isinstance(op, ast.Pow):
            exponent = _number(node.right)
            yield node.left, frozenset() if exponent is not None and exponent >= 0 else _B | _I, what
        elif isinstance(op, (ast.BitAnd, ast.BitOr, ast.BitXor, ast.LShift, ast.RShift)):
            yield node.left, _F | _C, what
            yield node.right, _F | _C, what
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Invert)):
        yield node.operand, (_F | _C if isinstance(node.op, ast.Invert) else _B), ast.unparse(node)
    elif isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            if isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)):
                yield operands[i], _C, ast.unparse(node)
                yield operands[i + 1], _C, ast.unparse(node)
    elif isinstance(node, ast.Call):
        yield from _call_requirements(node, facts)


def _call_requirements(node: ast.Call, facts: FunctionFacts) -> Iterator[tuple[ast.expr, frozenset[str], str]]:
    name, receiver, args = operation(node, facts)
    builtin = node.func.id if isinstance(node.func, ast.Name) else None
    if builtin == "abs":  # a tensor's abs; min and max compare
        yield from ((a, _B, "abs(...)") for a in node.args)
    if builtin in ("min", "max"):
        yield from ((a, _C, f"{builtin}(...)") for a in node.args)
    if name is None or receiver is None:
        return
    function = is_torch_attr(node.func, facts) is not None
    what = f"{name}(...)" if function else f".{name}(...)"
    if name in ("finfo", "iinfo"):
        if isinstance(receiver, ast.Attribute) and receiver.attr == "dtype":
            yield receiver.value, RAISES[name], what
        return
    if name not in RAISES:
        if function or name in PURE_TENSOR_METHODS:
            yield receiver, ANY, what
        return  # a layer or a runtime call: not a tensor operation (purity._spec judges it)
    yield receiver, RAISES[name], what
    if name in ("sub", "subtract", "lerp", "atan2", "maximum", "minimum", "bitwise_and", "bitwise_or", "bitwise_xor"):
        for arg in args[:1]:
            yield arg, RAISES[name], what
    rounding = any(k.arg == "rounding_mode" for k in node.keywords)
    if name in _DIVIDES or (name == "div" and rounding):
        divisor = _number(args[0]) if args else None
        yield receiver, _C if divisor not in (None, 0) else _B | _I | _C, what
        for arg in args[:1]:
            yield arg, _B | _I | _C, what
    if name == "pow" and args:
        exponent = _number(args[0])
        yield receiver, frozenset() if exponent is not None and exponent >= 0 else _B | _I, what
    if name in ("masked_fill", "full_like") and len(args) >= (2 if name == "masked_fill" else 1):
        yield receiver, _fill_raises(args[-1], receiver, facts), what


def _fill_raises(value: ast.expr, receiver: ast.expr, facts: FunctionFacts) -> frozenset[str]:
    """The kinds a fill ``value`` does not fit: infinite or NaN not in an
    integer, beyond float16's range not in a float16 (a ``torch.finfo`` of the
    receiver's own dtype fits it)."""
    number = _number(value)
    if number is None:
        if (
            isinstance(value, ast.Attribute) and value.attr in ("min", "max") and _info(value.value, facts) == "finfo"
            and value.value.args and key_of(value.value.args[0]) == f"{key_of(receiver)}.dtype" and key_of(receiver)
        ):
            return _B | _I
        return ANY
    if number != number or number in (float("inf"), float("-inf")):
        return _I
    return _I | _F if abs(number) > _HALF_MAX else frozenset()


def _narrow(reader: _Kinds, operand: ast.expr, forbidden: frozenset[str], known: dict[str, frozenset[str]]) -> bool:
    """Whether ``operand`` cannot have a ``forbidden`` kind, once one root is
    narrowed to the kinds that make it so (recorded in ``known``)."""
    if not (reader.of(operand, known) & forbidden):
        return True
    for key, top in _roots(operand, reader):
        current = known.get(key, ANY)
        allowed = frozenset(k for k in current if not (reader.of(operand, {**known, key: frozenset({k})}) & forbidden))
        if allowed and not (reader.of(operand, {**known, key: allowed}) & forbidden):
            known[key] = allowed
            return True
    return False


def _roots(
    node: ast.AST, reader: _Kinds, top: bool = True, depth: int = 0, deep: bool = False
) -> Iterator[tuple[str, bool]]:
    """Names and attribute chains ``node`` reads whose kinds a guard before
    the speculated code can test: read directly, or through locals assigned
    once from them (``deep``: those locals and what they were assigned from)."""
    if depth > 10:
        return
    if isinstance(node, ast.Name) and node.id in reader.aliases:  # what the speculated code assigned it
        yield from _roots(reader.aliases[node.id], reader, top, depth + 1, deep)
        return
    key = key_of(node)
    if key is not None:
        found = reader.guardable(key, top)
        if found:
            yield key, top
        if (not found or deep) and isinstance(node, ast.Name) and reader.stable(node.id) and node.id not in reader.params:
            value = reader.facts.assignments[node.id][0]
            if isinstance(value, ast.expr):
                yield from _roots(value, reader, False, depth + 1, deep)
        return
    children = list(ast.iter_child_nodes(node))
    if isinstance(node, ast.Call):  # the receiver, not the method's own attribute chain
        func = node.func
        children = [*([func.value] if isinstance(func, ast.Attribute) else []), *node.args, *(k.value for k in node.keywords)]
    for child in children:
        yield from _roots(child, reader, top, depth + 1, deep)
