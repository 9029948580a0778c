"""Gradients: which values a branch reaches through autograd. [Where] under grad.

``torch.where(c, a, b)`` computes both branches; under autograd both are in
the graph. Three things then differ from eager, where only the taken branch
ran, and [Where] handles each:

* the select feeds the branch not taken zero gradients; they reach the
  tensors it read and are added to their gradients. ``x + 0.0`` turns a
  ``-0.0`` into ``+0.0``; ``x + (-0.0)`` is ``x`` for every ``x``. So the
  select gives the side not chosen ``-0.0`` (``runtime.select``), and a
  branch whose operations might not hand ``-0.0`` on as ``-0.0`` (a mask's
  ``+0.0``, ``0 * inf`` = NaN from ``sqrt`` at 0 or ``exp`` past overflow)
  reads its inputs through ``runtime.grad_gate``, whose backward gives
  ``-0.0`` where the branch is not taken (``signs_kept`` says when no gate
  is needed);
* a tensor that requires grad and that only the branch not taken reaches
  gets a zero ``.grad`` where eager leaves ``None`` (optimizers treat the two
  differently: weight decay, momentum). Such values are checked while tracing
  (``runtime.grad_free``): when one requires grad, the original branch runs.

``reach`` tells, for an expression, the roots (names, and ``self.a.b``
chains) autograd may connect it to (``maybe``: every read that is not
provably cut, such as a comparison or ``ones_like``) and the roots it
certainly connects to (``surely``: reads through operations known to keep
the autograd graph, such as arithmetic and the differentiable torch
functions). Both are conservative in the direction that keeps gradients
exact: a root in some branch's ``maybe`` but not in every branch's ``surely``
is checked at run time.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Callable

# Functions and tensor methods whose result keeps an autograd edge to every
# tensor argument (for floating point inputs): their backward is defined. For
# ``where`` and ``masked_fill``, every argument but the condition or mask.
CONNECTING = frozenset(
    """abs absolute acos add addcmul amax amin asin atan atan2 bmm broadcast_to cat ceil clamp clamp_max clamp_min
    clip clone contiguous cos cosh cumprod cumsum div einsum erf exp expand expand_as expm1 flatten flip floor fmod
    lerp linear log log10 log1p log2 log_softmax matmul max maximum mean min minimum mm mul nan_to_num neg norm
    permute pow prod reciprocal relu remainder reshape round rsqrt sigmoid sign sin sinh softmax sqrt square squeeze
    stack sub sum t tan tanh transpose tril triu unsqueeze view view_as gelu silu layer_norm where masked_fill""".split()
)

# Results with no autograd edge to their arguments: booleans, indices, shapes,
# fresh tensors of the same shape, and ``detach``.
CUT = frozenset(
    """all allclose any argmax argmin bitwise_and bitwise_not bitwise_or bitwise_xor bool detach dim empty_like eq
    full full_like ge gt int isclose isfinite isinf isnan isneginf isposinf le logical_and logical_not logical_or
    logical_xor long lt ne numel ones ones_like size zeros zeros_like arange tensor finfo iinfo""".split()
)

_CUT_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "data"})


@dataclass(frozen=True)
class Reach:
    maybe: frozenset[str] = frozenset()
    surely: frozenset[str] = frozenset()

    def __or__(self, other: "Reach") -> "Reach":
        return Reach(self.maybe | other.maybe, self.surely | other.surely)

    def union(self, *others: "Reach") -> "Reach":
        out = self
        for other in others:
            out = out | other
        return out

    @classmethod
    def unknown(cls, inner: "Reach") -> "Reach":
        """Through an operation not known to keep or cut the graph: it may, not surely."""
        return cls(inner.maybe, frozenset())


NOTHING = Reach()


def root_of(node: ast.AST) -> str | None:
    """The root a value read names: ``x``, or ``self.a.b`` (attributes of ``self``)."""
    if isinstance(node, ast.Name):
        return node.id
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and parts:
        return ".".join(["self", *reversed(parts)])
    return None


def reach(node: ast.AST, env: dict[str, Reach], is_function: Callable[[str], bool]) -> Reach:
    """What ``node`` may and surely connects to through autograd. ``env``: the
    branch's own temporaries (what each reaches); ``is_function(name)``: a
    global that is a function or module (``torch``, ``F``), not a value."""
    if isinstance(node, ast.Constant):
        return NOTHING
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        if is_function(node.id):
            return NOTHING
        return Reach(frozenset({node.id}), frozenset({node.id}))
    if isinstance(node, ast.Attribute):
        if node.attr in _CUT_ATTRIBUTES:
            return NOTHING
        root = root_of(node)
        if root is not None and root in env:
            return env[root]
        if root is not None and root.startswith("self."):
            return Reach(frozenset({root}), frozenset({root}))
        inner = reach(node.value, env, is_function)
        return inner if node.attr in ("T", "mT") else Reach.unknown(inner)
    if isinstance(node, ast.BinOp):
        both = reach(node.left, env, is_function) | reach(node.right, env, is_function)
        return Reach.unknown(both) if isinstance(node.op, (ast.FloorDiv, ast.BitAnd, ast.BitOr, ast.BitXor)) else both
    if isinstance(node, ast.UnaryOp):
        inner = reach(node.operand, env, is_function)
        return inner if isinstance(node.op, (ast.USub, ast.UAdd)) else NOTHING
    if isinstance(node, ast.Compare):
        return NOTHING
    if isinstance(node, ast.Subscript):
        return reach(node.value, env, is_function)  # the index is cut
    if isinstance(node, (ast.Tuple, ast.List)):
        out = NOTHING
        for element in node.elts:
            out = out | reach(element, env, is_function)
        return out
    if isinstance(node, ast.IfExp):
        return reach(node.body, env, is_function) | reach(node.orelse, env, is_function)
    if isinstance(node, ast.Call):
        return _call_reach(node, env, is_function)
    out = NOTHING
    for child in ast.iter_child_nodes(node):
        out = out | reach(child, env, is_function)
    return Reach.unknown(out)


def _call_reach(call: ast.Call, env: dict[str, Reach], is_function: Callable[[str], bool]) -> Reach:
    func = call.func
    method = isinstance(func, ast.Attribute) and not (isinstance(func.value, ast.Name) and is_function(func.value.id))
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    operands: list[ast.AST] = ([func.value] if method else []) + list(call.args) + [k.value for k in call.keywords]  # type: ignore[union-attr]
    if name in CUT:
        return NOTHING
    if name == "where" and not method and len(call.args) == 3:
        operands = list(call.args[1:])  # the condition is cut
    elif name == "masked_fill" and len(call.args) == (2 if method else 3):
        operands = [func.value, call.args[1]] if method else [call.args[0], call.args[2]]  # type: ignore[union-attr]
    out = NOTHING
    for operand in operands:
        out = out | reach(operand, env, is_function)
    known = name in CONNECTING
    return out if known and not isinstance(func, ast.Name) else Reach.unknown(out)


def prior_reach(
    body: list[ast.stmt], stmt: ast.stmt, assignments: dict[str, list[ast.AST]], is_function: Callable[[str], bool]
) -> dict[str, Reach]:
    """What each name assigned once in the function, by a statement of ``body``
    (the function's top level) before ``stmt`` there, reaches through that
    assignment (``s = h.mean()``: what ``h`` reaches), when no name it reads is
    assigned again before ``stmt``; parameters, attributes of ``self`` and other
    names stay roots. A branch that reads ``s`` and one that reads ``h`` then
    reach the same tensors."""
    index = next((i for i, node in enumerate(body) if node is stmt), None)
    out: dict[str, Reach] = {}
    if index is None:
        return out
    where = {}
    for i, node in enumerate(body[:index]):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            where[node.targets[0].id] = i

    def stored(nodes: list[ast.stmt]) -> set[str]:
        """Names assigned, or changed in place (``n[i] = v``, ``n.add_(v)``), in ``nodes``."""
        out: set[str] = set()
        for node in (n for s in nodes for n in ast.walk(s)):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
            elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, ast.Store):
                out.add(root_of(node.value) or "")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.endswith("_"):
                out.add(root_of(node.func.value) or "")
        return out

    def of(name: str, depth: int) -> Reach:
        root = Reach(frozenset({name}), frozenset({name}))
        if name in out:
            return out[name]
        if depth > 8 or name not in where or len(assignments.get(name, [])) != 1:
            return root
        value = body[where[name]].value  # type: ignore[attr-defined]
        reads = {n.id for n in ast.walk(value) if isinstance(n, ast.Name) and not is_function(n.id)}
        if (reads | {name}) & stored(body[where[name] + 1 : index]):  # it, or a name it read, changed before stmt
            return root
        out[name] = reach(value, {n: of(n, depth + 1) for n in reads}, is_function)
        return out[name]

    for name in sorted(where):
        of(name, 0)
    return out


def block_reach(
    assignments: list[tuple[str, ast.expr]], is_function: Callable[[str], bool], prior: dict[str, Reach] | None = None
) -> tuple[dict[str, Reach], frozenset[str]]:
    """For a branch's ``(target, value)`` assignments in order: what each target
    reaches at the end, and every root the branch reads (``maybe``). ``prior``:
    what names bound before it reach (``prior_reach``; else each is a root)."""
    env: dict[str, Reach] = dict(prior or {})
    reads: frozenset[str] = frozenset()
    for target, value in assignments:
        found = reach(value, env, is_function)
        reads |= found.maybe
        env[target] = found
    return env, reads


# Operations whose backward hands a gradient of -0.0 on as -0.0, whatever the
# values: sums, products and quotients by a positive constant, reshapes and
# copies. A branch not taken is fed -0.0 (``runtime.select``), the one zero that
# leaves any gradient it is added to bit for bit as it was; through any other
# operation (a mask's +0.0, ``0 * inf``) it is cut at its inputs instead.
_SIGN_KEEPING = frozenset(
    """reshape view view_as flatten transpose permute t unsqueeze squeeze contiguous clone expand expand_as
    broadcast_to sum""".split()
)


def _positive(node: ast.AST, zero: bool = False) -> bool:
    """A numeric constant above 0 (or equal to it, with ``zero``): ``-0.0`` times it is ``-0.0``."""
    return isinstance(node, ast.Constant) and type(node.value) in (int, float) and (node.value > 0 or zero and node.value == 0)


def signs_kept(values: list[ast.expr]) -> bool:
    """Whether every operation in ``values`` hands a ``-0.0`` gradient on as ``-0.0``
    (``_SIGN_KEEPING``; ``+``; ``-`` and ``/`` by a positive constant; ``*`` by a
    constant of at least 0)."""
    for value in values:
        for node in ast.walk(value):
            if isinstance(node, ast.BinOp):
                if isinstance(node.op, ast.Add):
                    continue
                if isinstance(node.op, (ast.Sub, ast.Div)) and _positive(node.right):
                    continue
                if isinstance(node.op, ast.Mult) and (_positive(node.left, zero=True) or _positive(node.right, zero=True)):
                    continue
                return False
            if isinstance(node, (ast.UnaryOp, ast.Subscript, ast.Compare, ast.BoolOp, ast.IfExp)):
                return False
            if isinstance(node, ast.Call):
                func = node.func
                if not (isinstance(func, ast.Attribute) and func.attr in _SIGN_KEEPING):
                    return False
    return True


def checked_at_run_time(arms: list[Reach]) -> list[str]:
    """Roots some branch may reach that not every branch surely reaches: when one
    requires grad, a select would give it a zero ``.grad`` where eager may leave
    ``None``."""
    maybe = frozenset().union(*(a.maybe for a in arms))
    surely = frozenset.intersection(*(a.surely for a in arms)) if arms else frozenset()
    return sorted(maybe - surely)
