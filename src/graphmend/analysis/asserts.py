"""Which asserts of a function Dynamo compiles into its graph.

``assert cond, msg`` on a Python value is decided while Dynamo traces; on a
tensor it becomes ``torch._assert_async`` in the graph (as a direct
``torch._assert_async`` call does), and when it fails at run time the graph
raises before it returns. ``torch._assert(cond, msg)`` on a tensor is a
graph break up to torch 2.14 (the graph before it completes, so nothing
recorded is lost) and compiles the same way from 2.15
(``compat.TorchRelease.assert_in_graph``), whatever its message.
Output [Defer] recorded and checks [Trap] flagged earlier in that graph are
then lost (Dynamo applies side effects when a graph completes), so the pipeline (passes/held.py)
and barriers.py keep them safe where ``held_asserts`` finds such an assert (a
graph break before it, ``runtime.barrier``).

Only an assert Dynamo can compile counts: a constant message or none, and a
test not under an odd number of ``not`` (``_compiled_form``); any other
assert on a tensor is a graph break. A test counts as decided in Python
only when that is shown: constants,
``is`` / ``is not``, shapes, dtypes and sizes (``x.shape``, ``x.size()``,
``x.dim()``...), ``len`` / ``isinstance``-like builtins, arithmetic and
comparisons of those, locals every assignment of which is such a value,
``self.<attr>`` chains whose value is a plain Python value on every live
module that runs the function (not stored to by the function), and module
globals holding one. Anything else may be a tensor and counts.
"""

from __future__ import annotations

import ast
import builtins
from typing import Any

import torch

from graphmend.analysis.source import dotted_name, is_runtime_call
from graphmend.compat import release

_STATIC_ATTRS = {"shape", "ndim", "dtype", "device", "training", "is_cuda", "requires_grad", "layout"}
_STATIC_METHODS = {"dim", "size", "numel", "nelement", "is_contiguous", "element_size", "get_device", "is_floating_point"}
_ALWAYS_STATIC = {"isinstance", "issubclass", "hasattr", "callable", "len", "type"}
# Builtins whose result is a Python value when their arguments are.
_PURE_BUILTINS = {"list", "tuple", "max", "min", "abs", "sum", "range", "int", "float", "bool", "str", "round", "divmod"}
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def held_asserts(node: ast.FunctionDef | ast.AsyncFunctionDef, owners: list[Any], namespace: dict) -> list[ast.AST]:
    """The asserts (``assert`` statements, ``torch._assert_async(...)`` calls,
    ``torch._assert(...)`` calls where the release compiles them) in
    ``node`` whose test may be a tensor, outside a [Trap] rewrite's fallback
    (the ``else`` of ``if __graphmend_rt__.trappable(...)``, which a compiled
    region does not run), in source order. ``owners``: the live modules whose
    class runs the function."""
    fallbacks = {
        id(sub)
        for branch in ast.walk(node)
        if isinstance(branch, ast.If) and is_runtime_call(branch.test, "trappable")
        for stmt in branch.orelse
        for sub in ast.walk(stmt)
    }
    facts = _Facts(node, owners, namespace)
    calls = compiled_assert_calls()
    held = []
    for sub in ast.walk(node):
        if id(sub) in fallbacks:
            continue
        test = None
        if isinstance(sub, ast.Assert):
            test = sub.test if _compiled_form(sub) else None
        elif is_assert_call(sub, calls) and sub.args:  # type: ignore[attr-defined]
            test = sub.args[0]  # type: ignore[attr-defined]
        if test is not None and not facts.static(test):
            held.append(sub)
    return sorted(held, key=lambda n: (n.lineno, n.col_offset))


def compiled_assert_calls() -> frozenset[str]:
    """The ``torch.<name>(test, ...)`` asserts Dynamo compiles into the graph
    on the installed torch: ``_assert_async`` always, ``_assert`` from 2.15
    (any message: one it cannot fold makes a break, which a held test only
    moves)."""
    return frozenset({"_assert_async", "_assert"}) if release().assert_in_graph else frozenset({"_assert_async"})


def is_assert_call(node: ast.AST, names: frozenset[str]) -> bool:
    """Whether ``node`` is a call ``<obj>.<name>(...)`` with ``name`` in ``names``."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names


def _compiled_form(node: ast.Assert) -> bool:
    """Whether Dynamo can turn this ``assert`` into ``torch._assert_async``: it
    does only for the bytecode ``POP_JUMP_IF_TRUE; LOAD_ASSERTION_ERROR;
    [LOAD_CONST msg]; ...`` (torch 2.13, ``_detect_and_normalize_assert_statement``).
    A message that is not a constant, or a test under an odd number of
    ``not`` (``POP_JUMP_IF_FALSE``), makes a tensor test a graph break
    instead: the graph before it completes, and nothing recorded is lost."""
    nots, test = 0, node.test
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        nots, test = nots + 1, test.operand
    if nots % 2:
        return False
    return node.msg is None or all(isinstance(n, _CONSTANT_PARTS) for n in ast.walk(node.msg))


# What a message the compiler folds to one constant is made of.
_CONSTANT_PARTS = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.Tuple, ast.JoinedStr, ast.operator, ast.unaryop, ast.expr_context)


class _Facts:
    def __init__(self, node: ast.FunctionDef | ast.AsyncFunctionDef, owners: list[Any], namespace: dict):
        self.owners, self.namespace = owners, namespace
        args = node.args
        positional = args.posonlyargs + args.args
        self.receiver = positional[0].arg if positional and owners else None
        self.stored_attrs: set[str] = set()  # self.<attr> the function assigns
        sources: dict[str, list[ast.expr | None]] = {}  # name -> what it is assigned (None: unknown)
        for sub in ast.walk(node):
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = sub.args
                for arg in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]:
                    if arg is not None and not (sub is node and arg.arg == self.receiver):
                        sources.setdefault(arg.arg, []).append(None)
            if isinstance(sub, ast.Assign):
                for target in sub.targets:
                    _bind(target, sub.value, sources)
            elif isinstance(sub, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and sub.value is not None:
                value = sub.value if not isinstance(sub, ast.AugAssign) else ast.BinOp(sub.target, sub.op, sub.value)
                _bind(sub.target, value, sources)
            elif isinstance(sub, (ast.For, ast.AsyncFor)):
                _bind(sub.target, sub.iter if _is_call_of(sub.iter, "range") else None, sources)
            elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                for alias in sub.names:
                    sources.setdefault((alias.asname or alias.name).split(".")[0], []).append(None)
            elif isinstance(sub, ast.ExceptHandler) and sub.name:
                sources.setdefault(sub.name, []).append(None)
            elif isinstance(sub, (ast.Global, ast.Nonlocal)):
                for name in sub.names:
                    sources.setdefault(name, []).append(None)
        bound_by_assignments = {id(n) for sub in ast.walk(node) for n in _stored_names(sub)}
        for sub in ast.walk(node):  # any other binding (with ... as, comprehensions, match): unknown
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store) and id(sub) not in bound_by_assignments:
                sources.setdefault(sub.id, []).append(None)
            if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                root, *chain = (dotted_name(sub) or ".").split(".")
                if root == self.receiver:
                    self.stored_attrs.add(chain[0])
        if self.receiver in sources:  # rebound: not the module any more
            self.receiver = None
        self.locals = set(sources)
        # The largest set of names all of whose assignments are static, shrunk to a fixpoint.
        self.static_names = {name for name, values in sources.items() if None not in values}
        changed = True
        while changed:
            changed = False
            for name in list(self.static_names):
                if not all(self.static(v) for v in sources[name]):  # type: ignore[arg-type]
                    self.static_names.discard(name)
                    changed = True

    def static(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Constant):
            return True
        if isinstance(node, ast.Name):
            if node.id in self.locals:
                return node.id in self.static_names
            if node.id in self.namespace:
                return _plain(self.namespace[node.id])
            return hasattr(builtins, node.id) and _plain(getattr(builtins, node.id))
        if isinstance(node, ast.Attribute):
            return node.attr in _STATIC_ATTRS or self._resolved(node)
        if isinstance(node, (ast.Tuple, ast.List)):
            return all(self.static(e) for e in node.elts)
        if isinstance(node, ast.Starred):
            return self.static(node.value)
        if isinstance(node, ast.Subscript):
            return self.static(node.value) and self.static(node.slice)
        if isinstance(node, ast.Slice):
            return all(part is None or self.static(part) for part in (node.lower, node.upper, node.step))
        if isinstance(node, ast.BinOp):
            return self.static(node.left) and self.static(node.right)
        if isinstance(node, ast.UnaryOp):
            return self.static(node.operand)
        if isinstance(node, ast.BoolOp):
            return all(self.static(v) for v in node.values)
        if isinstance(node, ast.IfExp):  # a tensor test breaks the graph; the value is one of the two
            return self.static(node.body) and self.static(node.orelse)
        if isinstance(node, ast.Compare):
            if all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                return True
            return all(self.static(v) for v in [node.left, *node.comparators])
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _STATIC_METHODS:
                return True
            if isinstance(func, ast.Name) and func.id not in self.locals and func.id not in self.namespace:
                if func.id in _ALWAYS_STATIC:
                    return True
                if func.id in _PURE_BUILTINS:
                    return all(self.static(a) for a in node.args) and all(self.static(k.value) for k in node.keywords)
        return False

    def _resolved(self, node: ast.Attribute) -> bool:
        """``self.a.b`` or ``<global>.a.b``: a plain value on every live owner
        (or in the module namespace), and not stored to by the function."""
        name = dotted_name(node)
        if name is None:
            return False
        root, *chain = name.split(".")
        if root == self.receiver:
            if chain[0] in self.stored_attrs:
                return False
            starts = list(self.owners)
        elif root not in self.locals and root in self.namespace:
            starts = [self.namespace[root]]
        else:
            return False
        for value in starts:
            try:
                for attr in chain:
                    value = getattr(value, attr)
            except Exception:
                return False
            if not _plain(value):
                return False
        return bool(starts)


def _plain(value: Any, depth: int = 0) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (tuple, list)) and depth < 2 and len(value) <= 64:
        return all(_plain(v, depth + 1) for v in value)
    return False


def _bind(target: ast.expr, value: ast.expr | None, sources: dict[str, list[ast.expr | None]]) -> None:
    if isinstance(target, ast.Name):
        sources.setdefault(target.id, []).append(value)
    elif isinstance(target, (ast.Tuple, ast.List)):
        pairs = isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts)
        pairs = pairs and not any(isinstance(e, ast.Starred) for e in [*target.elts, *value.elts])  # type: ignore[union-attr]
        for i, elt in enumerate(target.elts):
            _bind(elt, value.elts[i] if pairs else value, sources)  # type: ignore[union-attr]
    elif isinstance(target, ast.Starred):
        _bind(target.value, value, sources)


def _stored_names(node: ast.AST) -> list[ast.Name]:
    """Name nodes bound by an assignment or loop statement (what ``_bind`` sees)."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr, ast.For, ast.AsyncFor)):
        targets = [node.target]
    else:
        return []
    return [n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]


def _is_call_of(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
