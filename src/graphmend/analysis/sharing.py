"""Which names of a function may hold tensors sharing storage (``Sharing``):
flow-insensitive classes over the function's bindings, with callees followed
where they are known.

[Where] asks it whether a select's branch may change, through an alias, a
tensor the other path reads; ``shared.SharedUpdates`` asks it (``storage=True``,
as bound by the code before a point) whether two tensors may enter a compiled
frame sharing storage.
"""

from __future__ import annotations

import ast
from typing import Any, Callable

from graphmend.analysis.aliasing import has_self, own_nodes, returns_receiver
from graphmend.analysis.effects import root_of
from graphmend.analysis.facts import (
    PURE_TENSOR_METHODS,
    PURE_TORCH_FUNCTIONS,
    FunctionFacts,
    is_tensor_expr,
    is_torch_attr,
)
from graphmend.analysis.source import RUNTIME_NAME, definition_of

# What a parameter, an attribute, a global or an unknown callee's result may share:
# one class for all of them.
OUTSIDE = "<outside>"
# Pure methods and torch functions that may hand back their input or a view of it.
_MAY_BE_INPUT = frozenset({"type_as", "bfloat16", "broadcast_to", "flatten", "squeeze", "unsqueeze", "transpose"})
# Functions and methods that may raise (so not pure) but always return new storage (their
# aten schemas return no alias, and no composite form hands back an input): with ``storage``.
NEW_STORAGE = frozenset(
    {"topk", "sort", "argsort", "one_hot", "linear", "embedding", "layer_norm", "group_norm", "rms_norm", "gelu",
     "silu", "softplus", "normalize", "gather", "index_select", "nonzero", "scaled_dot_product_attention",
     "cross_entropy", "bilinear", "conv1d", "conv2d", "conv3d", "multinomial", "cdist", "kthvalue", "mode", "median"}
)
# Tensor attributes that hold no tensor storage (taken so of any receiver: `x.shape`).
_NO_STORAGE = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"})
# Builtins that neither keep nor return their arguments' tensors.
_HOLDS_NOTHING = frozenset({"print", "len", "isinstance", "hasattr", "str", "repr", "format", "range", "float", "int", "bool"})


class Sharing:
    """Which names of a function may hold tensors sharing storage, at any point of it
    (flow-insensitive classes, built once over the whole function).

    Two names share a class when one is assigned a value that may be, view or hold
    the other's (``v = s[0]``, ``v = s.view(-1)``, ``v = s if c else h``), when a call
    may keep one in the other (``items.append(h)``, ``s.copy_(h)``, any call not known
    to make a new tensor), or when both may come from outside the call (parameters,
    attributes, globals, what an unknown callee returns). ``new_tensor`` tells the calls
    whose result is a new tensor and that keep nothing (``h.mean()``, ``torch.relu(h)``);
    a nested function, lambda, ``global`` or ``nonlocal`` puts every name it reads
    outside. A runtime call's result may share its arguments; it keeps none in another.
    ``storage``: only sharing storage counts: arithmetic makes a new value unless a
    side is a container display (else ``x * 2`` may repeat a list ``x`` and hold its
    items), and a view or in-place tensor method keeps nothing of its arguments.
    ``only``: the nodes whose bindings count (the code that runs before a point).
    ``new_result``: calls the caller knows to return new storage (live modules);
    ``callees``: the functions a call of ``self.<name>`` may run (live modules)."""

    def __init__(
        self, fdef: ast.AST, facts: FunctionFacts, *, storage: bool = False,
        only: Callable[[ast.AST], bool] | None = None, depth: int = 0,
        new_result: Callable[[ast.Call], bool] | None = None,
        callees: Callable[[ast.Call], list[tuple[Any, bool]] | None] | None = None,
        _judged: dict[tuple[int, int], tuple[Any, "Sharing"]] | None = None,
    ) -> None:
        self._parent: dict[str, str] = {}
        self._judged = {} if _judged is None else _judged  # callees judged below this one: ``of``
        self._facts = facts
        self._storage = storage  # only storage counts: `a * 2` is new, `out.add_(y)` keeps nothing of `y`
        args = fdef.args  # type: ignore[attr-defined]
        params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
        params += [extra.arg for extra in (args.vararg, args.kwarg) if extra is not None]
        self._locals = set(params) | {
            n.id for n in own_nodes(fdef) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        }
        self._depth, self._new_result, self._resolve = depth, new_result, callees
        self._module = params[0] if params and has_self(fdef) else None  # `self`: its methods keep nothing
        for name in params:
            if not storage or (name == params[0] and has_self(fdef)):
                self._union(name, OUTSIDE)  # with ``storage`` each tensor parameter is its own (entry pairs: shared.py)
        for node in own_nodes(fdef):
            if only is None or only(node):
                self._visit(node)

    def may_share(self, a: str, b: str) -> bool:
        """Whether ``a`` and ``b`` may hold tensors sharing storage."""
        return self._find(self._name(a)) == self._find(self._name(b))

    def is_outside(self, name: str) -> bool:
        """Whether ``name`` may share storage with something from outside the call."""
        return self.may_share(name, OUTSIDE)

    def sources_of(self, node: ast.AST) -> list[str]:
        """The names whose tensors the value of ``node`` may be, view or hold."""
        return self._sources(node)

    def sharers(self, name: str) -> set[str]:
        """The function's names that may share storage with ``name`` (``name`` too)."""
        return {n for n in self._locals if self.may_share(n, name)}

    def _visit(self, node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            self._union(OUTSIDE, *(n.id for n in ast.walk(node) if isinstance(n, ast.Name)))
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            self._union(OUTSIDE, *node.names)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and self._storage:  # `v, i = h.topk(2)`: each target its own
                for target in targets:
                    for root, sources in self.element_sources(target, node.value):
                        self._union(root, *sources)
            elif node.value is not None:
                self._union(*(r for t in targets for r in self._roots(t)), *self._sources(node.value))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            self._union(*self._roots(node.target), *self._sources(node.iter))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            self._union(OUTSIDE, *self._roots(node.optional_vars))
        elif isinstance(node, ast.Call) and not self._new_tensor(node) and not self._holds_nothing(node):
            if not _is_runtime(node) and not self._receiver_only(node) and not self._keeps_nothing(node):
                self._union(*self._sources(node))  # a call may keep one argument in another

    def _roots(self, target: ast.AST) -> list[str]:
        """The names a store to ``target`` binds or changes (``h``, ``cache[i]``: cache)."""
        if isinstance(target, (ast.Tuple, ast.List)):
            return [r for e in target.elts for r in self._roots(e)]
        while isinstance(target, (ast.Attribute, ast.Subscript, ast.Starred)):
            target = target.value
        return [self._name(target.id)] if isinstance(target, ast.Name) else [OUTSIDE]

    def _sources(self, node: ast.AST) -> list[str]:
        """The names whose tensors the value of ``node`` may be, view or hold."""
        if isinstance(node, ast.Name):
            return [self._name(node.id)]
        if isinstance(node, (ast.Constant, ast.JoinedStr, ast.Compare, ast.UnaryOp)):
            return []
        if isinstance(node, ast.BinOp):  # a new tensor, but `a + b` of lists (or `a | b` of sets) holds their items
            if not _may_hold_items(node) or any(self._tensorish(side) for side in (node.left, node.right)):
                return []
            if self._storage and not any(isinstance(side, DISPLAYS) for side in (node.left, node.right)):
                return []
            return self._sources(node.left) + self._sources(node.right)
        if isinstance(node, ast.Call):
            if self._new_tensor(node) or self._holds_nothing(node):
                return []
            parts = [*node.args, *(k.value for k in node.keywords)]
            if _is_runtime(node):
                return [r for part in parts for r in self._sources(part)]
            if self._receiver_only(node):
                return self._sources(node.func.value)  # type: ignore[attr-defined]
            if self._storage:
                passed = self._returned_arguments(node, None)
                if passed is not None:  # a known callee: what it may hand back of its arguments
                    return [r for arg in passed[0] for r in self._sources(arg)]
            unknown = [] if isinstance(node.func, ast.Attribute) and returns_receiver(node.func.attr) else [OUTSIDE]
            return unknown + [r for part in [node.func, *parts] for r in self._sources(part)]
        if isinstance(node, (ast.Lambda, ast.Await, ast.Yield, ast.YieldFrom)):
            return [OUTSIDE]
        if isinstance(node, ast.Subscript) and self._storage:
            return self._sources(node.value)  # `h[i]` views `h` or copies it: never `i`
        if isinstance(node, ast.Attribute) and node.attr in _NO_STORAGE:
            return []  # `x.shape`, `x.dtype`: no tensor storage
        return [r for child in ast.iter_child_nodes(node) for r in self._sources(child)]

    def _new_tensor(self, call: ast.Call) -> bool:
        """A pure method or torch function whose result is a new tensor (``h.mean()``, ``torch.relu(h)``)."""
        if any(k.arg in ("out", "inplace") for k in call.keywords):
            return False
        if self._storage and self._new_result is not None and self._new_result(call):
            return True
        fn = is_torch_attr(call.func, self._facts)
        if self._storage and fn is None:
            fn = self._functional(call.func)
        if fn is not None:
            fn = fn.removeprefix("nn.functional.") if self._storage else fn
            return (fn in PURE_TORCH_FUNCTIONS or self._storage and fn in NEW_STORAGE) and fn not in _MAY_BE_INPUT
        method = call.func.attr if isinstance(call.func, ast.Attribute) else None
        if self._storage and method in NEW_STORAGE:
            return True
        return method in PURE_TENSOR_METHODS and not returns_receiver(method) and method not in _MAY_BE_INPUT

    def _functional(self, func: ast.AST) -> str | None:
        """``F.softmax`` with ``F`` torch.nn.functional in the module: ``softmax``."""
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id not in self._locals:
            owner = self._facts.globals.get(func.value.id)
            if getattr(owner, "__name__", None) == "torch.nn.functional":
                return func.attr
        return None

    def _tensorish(self, node: ast.AST, assumed: frozenset[str] = frozenset()) -> bool:
        """A tensor or a float (no container joins with it): a float literal, what a pure
        method or torch function makes, arithmetic on one, a name only ever assigned one
        (``h = h * 2`` taken as one while ``h`` is being judged)."""
        if isinstance(node, ast.UnaryOp):
            return self._tensorish(node.operand, assumed)
        if isinstance(node, ast.Constant):
            return isinstance(node.value, float)
        if isinstance(node, ast.Call):
            method = node.func.attr if isinstance(node.func, ast.Attribute) else None
            return self._new_tensor(node) and method not in ("dim", "numel", "size", "max", "min")
        if isinstance(node, ast.BinOp):
            return self._tensorish(node.left, assumed) or self._tensorish(node.right, assumed)
        if isinstance(node, ast.Name):
            if node.id in assumed or node.id in self._facts.tensor_params:
                return True
            values = self._facts.assignments.get(node.id, [])
            return bool(values) and all(self._tensorish(v, assumed | {node.id}) for v in values)
        return is_tensor_expr(node, self._facts)

    def _keeps_nothing(self, call: ast.Call) -> bool:
        """With ``storage``: a call of a module or function (``self.block(h, s)``,
        ``helper(h, s)``) makes no argument share another's storage (only ``set_`` or
        ``.data =`` on a tensor could: not followed); a method of a local (``items.append(h)``,
        ``cache.update(k, v)``) may keep one argument in its receiver."""
        func = call.func
        if not self._storage:
            return False
        if isinstance(func, ast.Name):
            return True
        root = root_of(func) or OUTSIDE
        return isinstance(func, ast.Attribute) and (self._name(root) == OUTSIDE or root == self._module)

    def element_sources(self, target: ast.AST, value: ast.AST) -> list[tuple[str, list[str]]]:
        """(root, sources) for each name a store of ``value`` to ``target`` binds; with a
        tuple target and a call of a same-module function, element by element, as the
        callee's returns pass its parameters on (``h, s = helper(h, s)`` with ``return h,
        s``: ``h`` gets only what ``h`` passed)."""
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, ast.Call):
            passed = self._returned_arguments(value, len(target.elts))
            if passed is not None:
                return [
                    (root, [r for arg in passed[i] for r in self._sources(arg)])
                    for i, element in enumerate(target.elts)
                    for root in self._roots(element)
                ]
        sources = self._sources(value)
        return [(root, sources) for root in self._roots(target)]

    def _returned_arguments(self, call: ast.Call, count: int | None) -> list[list[ast.AST]] | None:
        """The argument expressions each of ``count`` returned elements (``None``: the
        value itself) may be or view, for a call whose callees are known: a module-level
        function, or what ``callees`` resolves (a method of ``self``, a submodule's
        ``forward``); None where not known (``*args``, a deeper call chain, a return of
        another shape)."""
        if self._depth > 2 or any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            return None
        found = self._callees(call)
        if not found:
            return None
        passed: list[list[ast.AST]] = [[] for _ in range(count or 1)]
        for callee, bound_self in found:
            args = callee.args
            if args.vararg or args.kwarg or args.posonlyargs:
                return None
            names = [a.arg for a in args.args + args.kwonlyargs][1 if bound_self else 0 :]
            bound = dict(zip(names, call.args)) | {k.arg: k.value for k in call.keywords}
            returns = [n for n in own_nodes(callee) if isinstance(n, ast.Return)]
            if count is not None and any(not (isinstance(r.value, ast.Tuple) and len(r.value.elts) == count) for r in returns):
                return None
            if not returns:
                continue  # returns None
            inner = self.of(callee)
            for ret in returns:
                elements = ret.value.elts if count is not None else [ret.value]  # type: ignore[union-attr]
                for i, element in enumerate(elements):
                    for source in inner._sources(element) if element is not None else []:
                        passed[i] += [bound[n] for n in names if n in bound and inner.may_share(n, source)]
        return passed

    def handed_back(
        self, call: ast.AST, count: int, steady: Callable[[Any, "Sharing", str], bool] | None = None
    ) -> list[bool] | None:
        """For a known callee, whether returned element ``i`` is always one parameter as
        it came in (``return h, s`` with ``h`` never rebound): an alias, the same relation
        on every call; or a name ``steady`` tells is bound alike on every call (``s =
        h[0, 0]`` on the callee's straight path). None where the callees are not known."""
        if not isinstance(call, ast.Call):
            return None
        found = self._callees(call)
        if not found:
            return None
        always = [True] * count
        for callee, bound_self in found:
            params = {a.arg for a in callee.args.args + callee.args.kwonlyargs}
            rebound = {n.id for n in own_nodes(callee) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            returns = [n for n in own_nodes(callee) if isinstance(n, ast.Return)]
            if not returns or any(not (isinstance(r.value, ast.Tuple) and len(r.value.elts) == count) for r in returns):
                return None
            for i in range(count):
                names = {r.value.elts[i].id if isinstance(r.value.elts[i], ast.Name) else None for r in returns}  # type: ignore[union-attr]
                only = names.pop() if len(names) == 1 else None
                alias = only in params and only not in rebound
                alike = only is not None and steady is not None and self._depth < 2 and steady(callee, self.of(callee), only)
                always[i] = always[i] and only is not None and (alias or alike)
        return always

    def of(self, callee: Any) -> "Sharing":
        """The same judgement of a callee's body (with ``storage``, one call deeper),
        made once per callee and depth for this judgement and the ones below it."""
        key = (id(callee), self._depth + 1)
        if key not in self._judged:  # the def is kept with it: its id is not reused meanwhile
            judged = Sharing(callee, FunctionFacts.of(callee, self._facts.globals, set()), storage=self._storage,
                             depth=self._depth + 1, new_result=self._new_result, callees=self._resolve,
                             _judged=self._judged)
            self._judged[key] = (callee, judged)
        return self._judged[key][1]

    def _callees(self, call: ast.Call) -> list[tuple[Any, bool]] | None:
        """(def, whether ``self`` is bound) for each function the call may run, or None."""
        func = call.func
        if isinstance(func, ast.Name) and func.id not in self._locals:
            code = getattr(self._facts.globals.get(func.id), "__code__", None)
            callee = definition_of(code) if code is not None else None
            return [(callee, False)] if callee is not None else None
        return self._resolve(call) if self._resolve is not None else None

    def _receiver_only(self, call: ast.Call) -> bool:
        """With ``storage``: a view method (``h.view(-1, d)``) or an in-place one
        (``out.index_add_(0, i, y)``), whose result is its receiver or a view of it and
        which shares no argument's storage with it (``set_`` does: not one of them)."""
        func = call.func
        return self._storage and isinstance(func, ast.Attribute) and returns_receiver(func.attr) and func.attr != "set_"

    def _holds_nothing(self, call: ast.Call) -> bool:
        return isinstance(call.func, ast.Name) and call.func.id in _HOLDS_NOTHING and call.func.id not in self._locals

    def _name(self, name: str) -> str:
        return name if name in self._locals else OUTSIDE

    def _find(self, name: str) -> str:
        while self._parent.get(name, name) != name:
            name = self._parent[name]
        return name

    def _union(self, *names: str) -> None:
        roots = [self._find(n) for n in names]
        for root in roots[1:]:
            if root != roots[0]:
                self._parent[root] = roots[0]


def _is_runtime(call: ast.Call) -> bool:
    """A call of graphmend's runtime (``__graphmend_rt__.print_(...)``)."""
    func = call.func
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == RUNTIME_NAME


DISPLAYS = (ast.List, ast.Tuple, ast.Set, ast.Dict, ast.ListComp, ast.SetComp, ast.DictComp)


def _may_hold_items(node: ast.BinOp) -> bool:
    """Whether the operator joins containers too (lists, tuples, sets, dicts)."""
    return isinstance(node.op, (ast.Add, ast.Mult, ast.BitOr, ast.BitAnd, ast.BitXor, ast.Sub))
