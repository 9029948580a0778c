"""Shapes on the path not taken: a speculated expression must not raise for
the shapes its tensors have where the original would not have evaluated it.

``purity._spec`` proves each operation pure, and ``dtypes.py`` that no dtype
makes it raise; a pure operation still raises on shapes: ``h.view(2, 2)`` of
three elements, ``h + b`` where the shapes do not broadcast, ``h.sum(2)`` of a
2-D ``h``. With eager taking the other branch the original never met them::

    if h.sum() > 0:          # h has 3 elements: h.sum() is -1 here
        h = h.view(2, 2)     # never run eagerly; fails while Dynamo traces it
    else:
        h = h - 1

``shape_blockers`` reads each operand's shape as a *form*: a number or 0-dim
tensor (``SCALAR``: broadcasts with anything), the shape of a root (a name
bound before the speculated code and not rebound, or an attribute chain of
one), that shape with some dimensions kept as 1 (``h.sum(-1, keepdim=True)``),
or unknown. Elementwise steps keep the form; whole reductions give a scalar.
What an operation needs becomes a guard decided while tracing (shapes are
static there, or symbolic with Dynamo's guards):

* a dimension argument (``h.sum(2)``, ``h.transpose(0, 1)``, ``h[:, 0]``):
  ``runtime.has_dims(h, 3)`` (``empty.dims``);
* two operands of different roots: ``runtime.broadcastable(a, b)``; a mask
  filling a tensor: ``runtime.broadcasts_to(mask, h)`` (``empty.broadcasts``).

An operation whose needs no guard can state (``view`` and ``reshape`` to
given sizes, ``expand``, ``permute``, ``cat``, matrix products, an operand of
unknown shape against another tensor) is declined with the reason.
"""

from __future__ import annotations

import ast
import copy
import types

import torch

from graphmend.analysis.dtypes import Renamed, key_of, operation
from graphmend.analysis.facts import PURE_TENSOR_METHODS, FunctionFacts, is_torch_attr
from graphmend.analysis.speculated import Emptiness

SCALAR = ("number", "")  # a number or a 0-dim tensor
UNKNOWN = ("unknown", "")
Form = tuple[str, str]  # ("same", root), ("kept", root), SCALAR or UNKNOWN

# Same shape as the receiver, whatever the (number, dtype or keyword) arguments.
_ELEMENTWISE = frozenset(
    """abs absolute neg negative relu sigmoid tanh exp expm1 log log10 log1p log2 sqrt rsqrt square reciprocal sign
    sin sinh cos cosh tan acos asin atan erf floor ceil round clamp clamp_min clamp_max clip nan_to_num isnan isinf
    isfinite isneginf isposinf logical_not bitwise_not float double half bfloat16 bool int long clone detach
    contiguous to type_as full_like zeros_like ones_like empty_like""".split()
)
# Elementwise over the receiver and tensor arguments: they must broadcast.
_BROADCASTING = frozenset(
    """add sub subtract mul div maximum minimum atan2 fmod remainder pow eq ne lt le gt ge logical_and logical_or
    logical_xor bitwise_and bitwise_or bitwise_xor isclose allclose lerp addcmul""".split()
)
_REDUCTIONS = frozenset("sum mean amax amin max min any all norm prod argmax argmin".split())
_ALONG = frozenset({"softmax", "log_softmax", "cumsum", "cumprod"})  # along a dimension, same shape
_NON_TENSOR = frozenset({"dim", "numel", "finfo", "iinfo", "item"})


class _Shapes:
    def __init__(self, facts: FunctionFacts, empty: Emptiness) -> None:
        self.facts, self.empty = facts, empty
        self.out: list[str] = []
        self.quiet = 0  # inside a temporary's value: its needs were met where it was computed
        # After renaming, a name the speculated code assigned reads its temporary; every
        # other name reads its value from before the speculated code, which a guard can test.
        self.guardable = empty.guardable | set(empty.renamed) | {
            g for g in facts.globals if g not in facts.local_names  # a module-level object: read before, the same
        }
        args = facts.fdef.args
        self.params = {a.arg for a in args.args + args.kwonlyargs + args.posonlyargs}

    def need(self, reason: str) -> None:
        if not self.quiet:
            self.out.append(reason)

    def root(self, node: ast.AST) -> Form:
        """The form of a name or attribute chain."""
        if isinstance(node, ast.Name) and node.id in self.empty.aliases:
            self.quiet += 1
            try:
                return self.form(self.empty.aliases[node.id])
            finally:
                self.quiet -= 1
        key = key_of(node)
        if key is not None and _module_constant(key, self.facts):
            return SCALAR  # torch.pi, math.inf
        if key is not None and key.split(".")[0] in self.guardable:
            return ("same", key)
        if isinstance(node, ast.Name) and node.id not in self.params and self._stable(node.id):
            value = self.facts.assignments[node.id][0]  # a local assigned once, from names with one value each
            if isinstance(value, ast.expr) and all(self._stable(n.id) for n in ast.walk(value) if isinstance(n, ast.Name)):
                return self.form(value)
        return UNKNOWN

    def _stable(self, name: str) -> bool:
        count = len(self.facts.assignments.get(name, []))
        return count == 0 if name in self.params else count == 1

    def form(self, node: ast.AST) -> Form:
        if isinstance(node, ast.Constant):
            return SCALAR
        if isinstance(node, (ast.Name, ast.Attribute)) and key_of(node) is not None:
            if isinstance(node, ast.Attribute) and node.attr in ("shape", "dtype", "device", "ndim", "layout"):
                return SCALAR
            return self.root(node)
        if isinstance(node, ast.Attribute):  # torch.finfo(...).max: a number
            info = isinstance(node.value, ast.Call) and is_torch_attr(node.value.func, self.facts) in ("finfo", "iinfo")
            return SCALAR if info else UNKNOWN
        if isinstance(node, ast.Subscript):
            return self._index(node)
        if isinstance(node, ast.UnaryOp):
            return self.form(node.operand)
        if isinstance(node, ast.BinOp):
            return self.broadcast(node, [node.left, node.right])
        if isinstance(node, ast.Compare):
            return self.broadcast(node, [node.left, *node.comparators])
        if isinstance(node, ast.IfExp):  # one of two values: a form both have
            self.form(node.test)
            body, orelse = self.form(node.body), self.form(node.orelse)
            return body if body == orelse else UNKNOWN
        if isinstance(node, ast.BoolOp):
            for part in node.values:
                self.form(part)
            return UNKNOWN
        if isinstance(node, ast.Call):
            return self._call(node)
        if isinstance(node, (ast.Tuple, ast.List)):
            for e in node.elts:
                self.form(e)
            return UNKNOWN
        return UNKNOWN

    def _index(self, node: ast.Subscript) -> Form:
        value = node.value
        if isinstance(value, ast.Attribute) and value.attr == "shape":  # a size: x must have the dimension
            index = _int(node.slice)
            if index is not None:
                self.dims(self.form(value.value), index + 1 if index >= 0 else -index, node)
            return SCALAR
        form = self.form(value)
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if any(isinstance(p, ast.Constant) and p.value is Ellipsis for p in parts):
            return UNKNOWN  # `...` fits any number of dimensions
        self.dims(form, sum(not (isinstance(p, ast.Constant) and p.value is None) for p in parts), node)
        return UNKNOWN

    def dims(self, form: Form, count: int, node: ast.AST) -> None:
        """``form``'s tensor must have at least ``count`` dimensions."""
        if count <= 0 or self.quiet:
            return
        if form[0] in ("same", "kept") and "." not in form[1] and form[1] in self.guardable:
            self.empty.dims[form[1]] = max(self.empty.dims.get(form[1], 0), count)
            return
        self.need(f"`{self.shown(node)}` needs {count} dimension(s), which no guard can check there")

    def broadcast(self, node: ast.AST, parts: list[ast.expr], result_of: Form | None = None) -> Form:
        """The form of elementwise ``parts``, which must broadcast together."""
        forms = [f for f in (self.form(p) for p in parts) if f != SCALAR]
        if not forms:
            return SCALAR
        roots = {f[1] for f in forms}
        if UNKNOWN in forms:
            known = [f for f in forms if f != UNKNOWN]
            if len(forms) - len(known) > 1:
                self.need(f"`{self.shown(node)}`: operands whose shapes are not proven to broadcast")
            for form in known:  # with a tensor of unknown shape: a number or a 0-dim tensor only
                self.guard("is_scalar", form[1], "", node)
            return UNKNOWN
        if len(roots) == 1:
            return ("same", forms[0][1]) if any(f[0] == "same" for f in forms) else forms[0]
        first, *rest = sorted(roots)
        for other in rest:
            self.guard("broadcastable", first, other, node)
        return UNKNOWN

    def guard(self, check: str, a: str, b: str, node: ast.AST) -> None:
        if self.quiet:
            return
        if all(k.split(".")[0] in self.guardable for k in (a, b) if k):
            self.empty.broadcasts.add((check, a, b))
        else:
            self.need(f"`{self.shown(node)}`: shapes no guard can check there")

    def _call(self, node: ast.Call) -> Form:
        name, receiver, args = operation(node, self.facts)
        keywords = {k.arg: k.value for k in node.keywords}
        if name is None:
            for a in node.args:
                self.form(a)
            builtin = node.func.id if isinstance(node.func, ast.Name) else None
            if builtin in ("float", "int", "bool") and node.args and self.form(node.args[0]) != SCALAR:
                self.need(f"`{self.shown(node)}` raises on a tensor of more than one element")
            if builtin == "len" and node.args:
                self.dims(self.form(node.args[0]), 1, node)
            return SCALAR if builtin in ("float", "int", "bool", "len", "abs", "min", "max") else UNKNOWN
        if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) and node.func.value.id == "__graphmend_rt__":
            return SCALAR  # the runtime's equal / item_of: one element
        function = is_torch_attr(node.func, self.facts) is not None
        if not function and not isinstance(node.func, ast.Attribute):
            return UNKNOWN
        if name in _NON_TENSOR:
            return SCALAR
        if function and name in ("zeros", "ones", "full", "arange", "empty", "tensor"):
            return self._made(node, name)
        if receiver is None:
            return UNKNOWN
        if not function and name not in PURE_TENSOR_METHODS:
            return UNKNOWN  # a layer, a callable attribute: not a tensor operation (purity._spec judges it)
        own = self.form(receiver)
        if name in ("max", "min", "maximum", "minimum") and args and _int(args[0]) is None:
            return self.broadcast(node, [receiver, args[0]])  # elementwise, of two tensors
        positional = args[1] if name == "norm" and len(args) > 1 else args[0] if args and name != "norm" else None
        dim = keywords.get("dim", positional if name in _REDUCTIONS | _ALONG else None)
        if name in _ELEMENTWISE:
            for a in args + list(keywords.values()):
                if name not in ("to", "type_as") and self.form(a) not in (SCALAR,):
                    self.broadcast(node, [receiver, a])
            return own
        if name in _BROADCASTING:
            return self.broadcast(node, [receiver, *args])
        if name in _REDUCTIONS | _ALONG:
            if dim is None:
                return SCALAR if name in _REDUCTIONS else own
            if not self._dims_of(own, dim, node):
                return UNKNOWN
            if name in _ALONG:
                return own
            keep = keywords.get("keepdim", args[1] if len(args) > 1 and name in _REDUCTIONS else None)
            kept = isinstance(keep, ast.Constant) and keep.value is True and own[0] in ("same", "kept")
            return ("kept", own[1]) if kept else UNKNOWN
        if name in ("transpose", "unsqueeze", "squeeze", "flatten", "chunk", "flip", "tril", "triu", "size"):
            return self._reshaped(name, own, args, keywords, node)
        if name == "masked_fill" and len(args) == 2:
            mask, value = self.form(args[0]), self.form(args[1])
            if value != SCALAR:
                self.need(f"`{self.shown(node)}`: a fill value not proven a number or 0-dim tensor")
            if mask not in (SCALAR, own) and not (mask[0] == "kept" and own[0] == "same" and mask[1] == own[1]):
                if mask[0] in ("same", "kept") and own[0] == "same":
                    self.guard("broadcasts_to", mask[1], own[1], node)
                else:
                    self.need(f"`{self.shown(node)}`: a mask not proven to broadcast to the tensor")
            return own
        if name == "where" and function and len(node.args) == 3:
            return self.broadcast(node, list(node.args))
        if name == "reshape" and len(args) == 1 and _int(args[0]) == -1:
            return UNKNOWN
        self.need(f"`{self.shown(node)}` may raise on shapes the path not taken never had")
        return UNKNOWN

    def _dims_of(self, form: Form, dim: ast.expr, node: ast.AST, scalar_ok: bool = True) -> bool:
        """A dimension argument (an int or a tuple of ints): guarded, or declined.
        One dimension 0 or -1 is in range for a 0-dim tensor too (``scalar_ok``),
        except for ``size`` and ``chunk``; a tuple needs as many dimensions as it names."""
        values = [_int(e) for e in dim.elts] if isinstance(dim, (ast.Tuple, ast.List)) else [_int(dim)]
        if any(v is None for v in values):
            self.need(f"`{self.shown(node)}`: a dimension that is not a constant")
            return False
        needed = max([v + 1 if v >= 0 else -v for v in values] + [len(values)])  # type: ignore[operator]
        self.dims(form, 0 if needed == 1 and len(values) == 1 and scalar_ok else needed, node)
        return True

    def _reshaped(self, name: str, own: Form, args: list[ast.expr], keywords: dict, node: ast.AST) -> Form:
        if name in ("tril", "triu"):
            self.dims(own, 2, node)
            return own
        if name in ("squeeze", "flatten") and not args and not keywords:
            return UNKNOWN
        if name == "unsqueeze" and args and _int(args[0]) is not None:
            d = _int(args[0])
            self.dims(own, d if d >= 0 else -d - 1, node)  # type: ignore[operator]
            return UNKNOWN
        if name == "chunk" and args and _int(args[0]) is not None and _int(args[0]) > 0:  # type: ignore[operator]
            dim = args[1] if len(args) > 1 else keywords.get("dim", ast.Constant(0))
            self._dims_of(own, dim, node, scalar_ok=False)
            return UNKNOWN
        if name == "flip":
            self._dims_of(own, args[0] if args else keywords.get("dims", ast.Constant(None)), node)
            return own
        if name in ("transpose", "squeeze", "flatten") and args:
            for arg in args:  # each in range (transpose(0, 0) names one twice, and is fine)
                self._dims_of(own, arg, node)
            return UNKNOWN
        if name == "size" and args:
            self._dims_of(own, args[0], node, scalar_ok=False)
            return SCALAR
        self.need(f"`{self.shown(node)}` may raise on shapes the path not taken never had")
        return UNKNOWN

    def _made(self, node: ast.Call, name: str) -> Form:
        """``torch.zeros(n)``...: sizes that cannot be negative (constants, shapes)."""
        if name == "tensor":
            return SCALAR if node.args and isinstance(node.args[0], ast.Constant) else self._refuse(node)
        sizes = node.args[:1] if name == "full" else node.args
        if len(sizes) == 1 and isinstance(sizes[0], (ast.Tuple, ast.List)):
            sizes = sizes[0].elts
        for size in sizes if name != "arange" else node.args[:1]:
            value = _int(size)
            shape = isinstance(size, ast.Subscript) and isinstance(size.value, ast.Attribute) and size.value.attr == "shape"
            if not (shape or (value is not None and value >= 0)):
                return self._refuse(node)
            if shape:
                self.form(size)
        return UNKNOWN if sizes else SCALAR

    def _refuse(self, node: ast.AST) -> Form:
        self.need(f"`{self.shown(node)}`: sizes not proven non-negative")
        return UNKNOWN

    def shown(self, node: ast.AST) -> str:
        back = Renamed({temp: key for key, temp in self.empty.renamed.items()})
        return ast.unparse(back.visit(copy.deepcopy(node)))


def _module_constant(key: str, facts: FunctionFacts) -> bool:
    """``math.pi``: a number or dtype read from a module the function's globals name."""
    root, *attrs = key.split(".")
    value = facts.globals.get(root) if root not in facts.local_names else None
    if not isinstance(value, types.ModuleType) or not attrs:
        return False
    for attr in attrs:
        value = getattr(value, attr, None)
    return type(value) in (bool, int, float, complex, torch.dtype, torch.device)


def _int(node: ast.AST) -> int | None:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def shape_blockers(node: ast.AST, facts: FunctionFacts, empty: Emptiness) -> list[str]:
    """Why evaluating ``node`` on the path not taken may raise for a shape no
    guard can rule out (empty when none); the guards it needs go to
    ``empty.dims`` and ``empty.broadcasts``."""
    shapes = _Shapes(facts, empty)
    shapes.form(Renamed(empty.renamed).visit(copy.deepcopy(node)))
    return list(dict.fromkeys(shapes.out))
