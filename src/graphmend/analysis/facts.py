"""Static facts about expressions that rules need to prove legality.

* ``is_tensor_expr``: the expression provably evaluates to a tensor (a torch
  function, a tensor method of a proven tensor, arithmetic or a comparison with
  a proven tensor, a parameter annotated ``torch.Tensor``, or a local assigned
  once from such an expression, traced up to 10 assignments deep).
* ``is_safe_index``: an index that never raises on a tensor with enough
  dimensions.
* ``bound_before``: names definitely bound before a statement of a function.
* ``live_after``: whether a name's value at the end of a statement may still
  be read (a read before the next assignment on some path; anywhere in an
  enclosing loop, ``try`` or nested function).
* ``updated_after``: a statement that may run after another and update a
  name's tensor in place (``h.add_(1)``, ``h[0] = 0``, ``h += 1``,
  ``F.relu(h, inplace=True)``).

These are deliberately conservative: an unproven fact makes a rule decline.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from graphmend.analysis.memo import recall
from graphmend.analysis.source import as_in_its_file, in_place_argument, in_place_method

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

# tensor.<method>(...) that return tensors (or metadata) without side effects.
PURE_TENSOR_METHODS = frozenset(
    """abs add all amax amin any argmax argmin bfloat16 bool ceil clamp clamp_max clamp_min clip clone contiguous cos
    chunk cumsum detach dim div double eq exp expand expand_as flatten flip float floor ge gt half int isfinite isinf isnan
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


def live_after(fdef: ast.FunctionDef | ast.AsyncFunctionDef, stmt: ast.stmt, name: str) -> bool:
    """Whether the value ``name`` holds when ``stmt`` ends may be read: some path
    from there reads it before assigning it. Conservative: a read anywhere in an
    enclosing loop (the next iteration), ``try`` (a handler) or in a nested
    function or lambda (a closure reads it whenever it is called) counts, as do
    ``locals()``, ``vars()``, ``eval`` and ``exec``."""
    return _used_later(fdef, stmt, name, _reads)


def _read_again(around: ast.stmt, name: str, used: Callable[[ast.AST, str], bool] | None = None) -> bool:
    """Whether the loop or ``try`` around a statement may read ``name`` (``used``: so
    use it) when it runs its body again: a loop's next pass reads it first where its
    first pass does."""
    if isinstance(around, (ast.For, ast.AsyncFor, ast.While)) and not around.orelse:
        return _first_use([around], name, used) is True
    return (used or _reads)(around, name)


def updated_later(fdef: ast.FunctionDef | ast.AsyncFunctionDef, stmt: ast.stmt, name: str) -> bool:
    """Whether the tensor ``name`` holds when ``stmt`` ends may be updated in place
    later (as ``live_after``, with an in-place update for a read: ``name = t`` first
    on every path, then ``name.add_(1)``, updates another tensor)."""
    return _used_later(fdef, stmt, name, _updates_in_place)


def _used_later(
    fdef: ast.FunctionDef | ast.AsyncFunctionDef, stmt: ast.stmt, name: str, used: Callable[[ast.AST, str], bool]
) -> bool:
    """Whether some path from the end of ``stmt`` meets ``used(node, name)`` before
    ``name`` is assigned (``live_after``, ``updated_later``); once per round for a
    function of a file's own tree (a caller: analysis/memo.py)."""
    if as_in_its_file(fdef):
        key = ("used later", id(fdef), id(stmt), name, used.__name__)
        return recall(key, lambda: _used_later_in(fdef, stmt, name, used), fdef, stmt)
    return _used_later_in(fdef, stmt, name, used)


def _used_later_in(
    fdef: ast.FunctionDef | ast.AsyncFunctionDef, stmt: ast.stmt, name: str, used: Callable[[ast.AST, str], bool]
) -> bool:
    if _read_any_time(fdef, name) or path_to(fdef.body, stmt) is None:
        return True
    for around, later in _after(fdef, stmt):
        if around is not None and _read_again(around, name, used):
            return True
        found = _first_use(later, name, used)
        if found is not None:
            return found
    return False


def live_at_start(fdef: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> bool:
    """Whether the value a parameter ``name`` holds on entry may be read (as ``live_after``)."""
    return _read_any_time(fdef, name) or _first_use(fdef.body, name) is True


def _read_any_time(fdef: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> bool:
    """A read whose time the body does not tell: in a nested function or lambda, through
    ``global`` / ``nonlocal``, ``locals()``, ``vars()``, ``eval`` or ``exec``."""
    for node in ast.walk(fdef):
        if node is not fdef and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and _reads(node, name):
            return True
        if isinstance(node, (ast.Global, ast.Nonlocal)) and name in node.names:
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("locals", "vars", "eval", "exec"):
            return True
    return False


def _after(fdef: ast.FunctionDef | ast.AsyncFunctionDef, stmt: ast.stmt) -> Iterator[tuple[ast.stmt | None, list[ast.stmt]]]:
    """What may run after ``stmt``, block by block outwards: the loop or ``try``
    enclosing the block (which may run whole again; else None), and the statements
    after it in the block."""
    path = path_to(fdef.body, stmt) or []
    for depth in range(len(path) - 1, -1, -1):
        block, index = path[depth]
        inner = depth < len(path) - 1
        around = block[index] if inner and isinstance(block[index], (ast.For, ast.AsyncFor, ast.While, ast.Try)) else None
        yield around, block[index + 1 :]


def updated_after(fdef: ast.FunctionDef | ast.AsyncFunctionDef, stmt: ast.stmt, name: str) -> ast.stmt | None:
    """The first statement that may run after ``stmt`` and update the tensor ``name``
    holds in place: an in-place method (``name.add_(...)``), an item or attribute
    store on it, or ``name += ...``; None if there is none. The search stops at a
    reassignment from arithmetic (``name = name + 1``: a new tensor) on the
    straight path; an enclosing loop or ``try`` counts whole."""
    if path_to(fdef.body, stmt) is None:
        return stmt
    for around, later in _after(fdef, stmt):
        if around is not None and _updates_in_place(around, name):
            return around
        for node in later:
            if _updates_in_place(node, name):
                return node
            if (
                isinstance(node, ast.Assign)
                and [t.id for t in node.targets if isinstance(t, ast.Name)] == [name]
                and len(node.targets) == 1
                and isinstance(node.value, (ast.BinOp, ast.UnaryOp))
            ):
                return None  # from here on the name holds a new tensor
    return None


def _updates_in_place(node: ast.AST, name: str) -> bool:
    """Whether ``node``, at any depth, may update the tensor ``name`` holds: an
    in-place method on it, a call with ``inplace=True`` on it, an item or
    attribute store into it, ``name += ...`` (``shared._updated`` reads one
    statement at a time and leaves out attribute stores, which change no
    storage another tensor sees)."""
    def is_name(n: ast.AST) -> bool:
        return isinstance(n, ast.Name) and n.id == name

    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and is_name(n.func.value):
            if in_place_method(n.func.attr):
                return True
        if isinstance(n, ast.Call) and is_name(in_place_argument(n)):
            return True  # `F.relu(h, inplace=True)`
        if isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.ctx, ast.Store) and is_name(n.value):
            return True
        if isinstance(n, ast.AugAssign) and is_name(n.target):
            return True
    return False


def _reads(node: ast.AST, name: str) -> bool:
    """``name`` is read (or deleted, or updated with ``+=``) somewhere in ``node``."""
    return any(
        isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Store)
        or isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name) and n.target.id == name
        for n in ast.walk(node)
    )


def _names_only(target: ast.expr) -> bool:
    """``h`` or ``a, (b, *c)``: a target that binds names and stores into nothing."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return all(_names_only(e) for e in target.elts)
    if isinstance(target, ast.Starred):
        return _names_only(target.value)
    return isinstance(target, ast.Name)


def _target_of(loop: ast.For | ast.AsyncFor, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(loop.target))


def _first_use(block: list[ast.stmt], name: str, used: Callable[[ast.AST, str], bool] | None = None) -> bool | None:
    """True: ``name`` is read (``used``: so used) before it is assigned on some path
    through ``block``; False: every path assigns it first, or leaves the function;
    None: neither (the paths that fall through the block have not met it)."""
    used = used or _reads
    for stmt in block:
        if isinstance(stmt, ast.Assign) and all(_names_only(t) for t in stmt.targets):
            if used(stmt.value, name):
                return True
            if any(isinstance(n, ast.Name) and n.id == name for t in stmt.targets for n in ast.walk(t)):
                return False
            continue
        if isinstance(stmt, (ast.Return, ast.Raise)):
            return used(stmt, name)
        if isinstance(stmt, ast.If):
            if used(stmt.test, name):
                return True
            body, other = _first_use(stmt.body, name, used), _first_use(stmt.orelse, name, used)
            if body is True or other is True:
                return True
            if body is False and other is False:
                return False
            continue
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)) and not stmt.orelse:
            # Each pass runs the body from its start: read first in a later pass only if in the first.
            head = stmt.iter if isinstance(stmt, (ast.For, ast.AsyncFor)) else stmt.test
            if used(head, name):
                return True
            bound = isinstance(stmt, ast.While) or not _target_of(stmt, name)  # the loop's target: set before each pass
            if bound and _first_use(stmt.body, name, used) is True:
                return True
            continue  # the loop may run no pass: what follows decides
        if used(stmt, name):
            return True
    return None


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
