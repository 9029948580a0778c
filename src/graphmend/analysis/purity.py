"""Purity: what running code can do besides computing its result. The one
effect and purity analysis the rules share (effects.py names the effects
themselves: print, logging, warnings, guards).

Each question is asked of source, or of the live objects a rule resolved:

* ``stores`` and ``mutating_method``: the attribute/item stores in an
  assignment and the in-place or mutating method calls, the two ways a
  statement changes an object (each caller decides whose objects count).
* ``speculation_blockers``: why evaluating an expression on a path where the
  original would not have evaluated it could raise or have an effect (empty
  when it is safe): only names bound before the statement, attribute reads,
  constants, arithmetic, comparisons, safe slices, and calls of pure torch
  functions and tensor methods. [Where], [Trap], [Speculate].
* ``function_impurities``: why calling a Python function could have an
  effect beyond its return value (two calls deep). [Where] callees, hoisted
  memo initialisers.
* ``module_impurity``: why calling a module could ([Scalar]'s full loop).
* ``is_layer`` over ``STATELESS_LAYERS`` / ``STATELESS_CONTAINERS`` /
  ``EMPTY_SAFE_LAYERS``, ``STATEFUL_BUILTINS``, ``pure_torch_builtin``: the
  torch.nn layers, builtins and torch C functions known by name.

``rules/_state.py``'s ``StateScan`` follows the code that runs after a point
through the calls it makes on the live model, asking these questions.
All of them are conservative: an unproven fact makes a rule decline.
"""

from __future__ import annotations

import ast
import builtins
from typing import Any, Iterable, Iterator

import torch

from graphmend.analysis.dtypes import dtype_blockers, tested_kinds
from graphmend.analysis.effects import MUTATING_METHODS
from graphmend.analysis.facts import (
    PURE_BUILTINS,
    PURE_TENSOR_METHODS,
    PURE_TORCH_FUNCTIONS,
    FunctionFacts,
    is_safe_index,
    is_tensor_expr,
    is_torch_attr,
)
from graphmend.analysis.shapes import shape_blockers
from graphmend.analysis.source import (
    always_evaluated,
    bound_names,
    in_place_method,
    is_runtime_call,
    source_tree,
)
from graphmend.analysis.speculated import Emptiness, Tested

# Builtins that change state outside the caller's locals (an iterator's position, attributes, files).
STATEFUL_BUILTINS = frozenset({"setattr", "delattr", "next", "exec", "eval", "open", "input"})

# torch.nn layers whose call changes no state and raises on no well-formed
# input ([Where] runs a branch's call on the path not taken; StateScan skips them).
STATELESS_LAYERS = frozenset(
    {"Linear", "Bilinear", "Identity", "Conv1d", "Conv2d", "Conv3d", "LayerNorm", "RMSNorm", "GroupNorm",
     "Embedding", "ReLU", "GELU", "SiLU", "Tanh", "Sigmoid", "Softmax", "LogSoftmax", "LeakyReLU", "ELU",
     "Mish", "Hardtanh", "Dropout", "Flatten", "Sequential", "ModuleList"}
)
# Containers that hold layers and change no state, but raise when called.
STATELESS_CONTAINERS = frozenset({"ModuleDict"})
# Layers that are also total on an empty input ([Scalar]'s full loop runs them on every index).
EMPTY_SAFE_LAYERS = frozenset(
    {"Linear", "Identity", "Dropout", "LayerNorm", "Embedding", "SiLU", "GELU", "ReLU", "Tanh", "Sigmoid", "Softmax"}
)
# Reductions with no identity element: pure, but they raise on an empty tensor.
# [Scalar]'s full loop would run them on an index the filter dropped, and an
# expression on the path not taken may meet an empty tensor the taken path never
# reduces ([Where]'s other branch, [Trap]'s message, every operand of and/or).
RAISE_ON_EMPTY = frozenset({"max", "min", "amax", "amin", "argmax", "argmin", "item", "median", "mode", "kthvalue"})


def stores(targets: Iterable[ast.AST]) -> Iterator[ast.Attribute | ast.Subscript]:
    """The attribute and item stores (``x.a = ...``, ``x[i] += ...``) in assignment targets."""
    for target in targets:
        for sub in ast.walk(target):
            if isinstance(sub, (ast.Attribute, ast.Subscript)) and isinstance(sub.ctx, ast.Store):
                yield sub


def mutating_method(attr: str) -> bool:
    """Whether a method of that name changes its receiver: an in-place tensor
    method (``add_``) or a mutating container method (``append``)."""
    return in_place_method(attr) or attr in MUTATING_METHODS


def is_layer(module: Any, names: frozenset[str]) -> bool:
    """Whether ``module``'s class is one of torch.nn's ``names`` (by name, defined under torch.nn)."""
    return type(module).__name__ in names and type(module).__module__.startswith("torch.nn")


# --------------------------------------------------------------------------
# an expression on the path not taken


def speculation_blockers(
    node: ast.AST, facts: FunctionFacts, bound: set[str], empty: Emptiness | None = None
) -> list[str]:
    """Reasons evaluating ``node`` speculatively could raise or have an effect.
    A reduction that raises on an empty tensor is one unless ``empty`` allows
    its tensor (known non-empty, or guarded); an operation that raises on a
    dtype is one unless the dtype is proven or guarded (``dtype_blockers``)."""
    reasons: list[str] = []
    empty = empty or Emptiness()
    _spec(node, facts, bound, reasons, empty)
    return reasons or dtype_blockers(node, facts, empty) or shape_blockers(node, facts, empty)


def _spec(node: ast.AST, facts: FunctionFacts, bound: set[str], out: list[str], empty: Emptiness) -> None:
    if isinstance(node, ast.Constant):
        return
    if isinstance(node, ast.Name):
        if node.id in facts.local_names and node.id not in bound:
            out.append(f"`{node.id}` may be unbound on the path not taken")
        elif node.id not in facts.local_names and node.id not in facts.globals and not hasattr(builtins, node.id):
            out.append(f"`{node.id}` is not defined")
        return
    if isinstance(node, ast.Attribute):
        _spec(node.value, facts, bound, out, empty)
        return
    if isinstance(node, (ast.BinOp,)):
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and not (
            is_tensor_expr(node.left, facts) or is_tensor_expr(node.right, facts)
            or (isinstance(node.right, ast.Constant) and node.right.value not in (0, 0.0))
        ):
            out.append("a division whose operands are not provably tensors can raise ZeroDivisionError")
        if isinstance(node.op, ast.MatMult):
            out.append("a matrix product can fail on shapes the taken path never multiplies")
        _spec(node.left, facts, bound, out, empty)
        _spec(node.right, facts, bound, out, empty)
        return
    if isinstance(node, ast.UnaryOp):
        _spec(node.operand, facts, bound, out, empty)
        return
    if isinstance(node, ast.BoolOp):
        for v in node.values:
            _spec(v, facts, bound, out, empty)
        return
    if isinstance(node, ast.Compare):
        _spec(node.left, facts, bound, out, empty)
        for c in node.comparators:
            _spec(c, facts, bound, out, empty)
        return
    if isinstance(node, ast.IfExp):
        for part in (node.test, node.body, node.orelse):
            _spec(part, facts, bound, out, empty)
        return
    if isinstance(node, (ast.Tuple, ast.List)):
        for e in node.elts:
            _spec(e, facts, bound, out, empty)
        return
    if isinstance(node, ast.JoinedStr):
        for v in node.values:
            if isinstance(v, ast.FormattedValue):
                _spec(v.value, facts, bound, out, empty)
                if v.format_spec is not None:
                    _spec(v.format_spec, facts, bound, out, empty)
        return
    if isinstance(node, ast.Subscript):
        _spec(node.value, facts, bound, out, empty)
        if not is_safe_index(node.slice) and not _shape_index(node):  # x.shape[1]: shapes.py guards x's dims
            out.append("indexing can go out of range on the path not taken")
        return
    if isinstance(node, ast.Call):
        for a in node.args:
            _spec(a.value if isinstance(a, ast.Starred) else a, facts, bound, out, empty)
        for k in node.keywords:
            _spec(k.value, facts, bound, out, empty)
        if (
            isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "__graphmend_rt__"
            and node.func.attr in ("equal",)
        ):
            return  # the runtime's pure, total torch.equal
        if is_runtime_call(node, "item_of") and node.args and _one_element(node.args[0]):
            return  # `.item()` of a whole reduction ([Scalar]'s tensor test, its arguments checked above): one element
        fn = is_torch_attr(node.func, facts)
        if fn is not None:
            if fn not in PURE_TORCH_FUNCTIONS:
                out.append(f"torch.{fn} is not on the list of pure torch functions")
            elif _raises_on_empty(fn, node.args[:1], node.args[1:], facts, empty):
                out.append(f"torch.{fn} raises on an empty tensor, which the path not taken may hold")
            return
        if isinstance(node.func, ast.Attribute):
            if in_place_method(node.func.attr):
                out.append(f"`.{node.func.attr}` mutates its receiver")
            elif node.func.attr not in PURE_TENSOR_METHODS:
                out.append(f"`.{node.func.attr}(...)` is not a known pure tensor method")
            elif _raises_on_empty(node.func.attr, [node.func.value], node.args, facts, empty):
                out.append(f"`.{node.func.attr}(...)` raises on an empty tensor, which the path not taken may hold")
            _spec(node.func.value, facts, bound, out, empty)
            return
        if isinstance(node.func, ast.Name) and node.func.id in PURE_BUILTINS and node.func.id not in facts.local_names and node.func.id not in facts.globals:
            return
        out.append(f"the call `{ast.unparse(node.func)}(...)` is not known to be pure and total")
        return
    out.append(f"`{type(node).__name__}` expressions are not speculated")


_WHOLE_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "any", "all", "norm", "prod"})


def _one_element(node: ast.expr) -> bool:
    """``x.sum()``, ``x.abs().amax()``...: a reduction of the whole tensor (no arguments), one element."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in _WHOLE_REDUCTIONS
        and not node.args
        and not node.keywords
    )


def _shape_index(node: ast.Subscript) -> bool:
    """Whether ``node`` is ``x.shape[1]`` or ``x.shape[-2]``: a constant index into a shape."""
    index = node.slice
    if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub):
        index = index.operand
    shape = isinstance(node.value, ast.Attribute) and node.value.attr == "shape"
    return shape and isinstance(index, ast.Constant) and type(index.value) is int


def _raises_on_empty(
    name: str, receiver: list[ast.expr], rest: list[ast.expr], facts: FunctionFacts, empty: Emptiness
) -> bool:
    """Whether ``name`` called on ``receiver`` with ``rest`` (the arguments after
    it) is a reduction with no identity element (``amax``, ``x.max()``,
    ``x.max(dim)``) that can meet an empty tensor: not when ``empty`` allows the
    receiver's name (through elementwise methods), or for ``max``/``min`` of
    two tensors (elementwise)."""
    if name in ("max", "min") and rest and is_tensor_expr(rest[0], facts):
        return False
    return name in RAISE_ON_EMPTY and not (receiver and empty.allows(same_numel_name(receiver[0])))


def empty_reduction(call: ast.Call, facts: FunctionFacts, empty: Emptiness) -> bool:
    """Whether ``call`` is a reduction that raises on an empty tensor, of a
    tensor ``empty`` does not allow (``_raises_on_empty``)."""
    fn = is_torch_attr(call.func, facts)
    if fn is not None:
        return _raises_on_empty(fn, call.args[:1], call.args[1:], facts, empty)
    if isinstance(call.func, ast.Attribute):
        return _raises_on_empty(call.func.attr, [call.func.value], call.args, facts, empty)
    return False


# Tensor methods whose result has as many elements as their receiver (constant arguments only).
_SAME_NUMEL = frozenset(
    """abs neg relu sigmoid tanh exp log sqrt rsqrt square reciprocal sign sin cos floor ceil round clamp
    clamp_min clamp_max clip nan_to_num isnan isinf isfinite logical_not float double half bfloat16 bool int
    long clone detach contiguous""".split()
)


def same_numel_name(node: ast.expr) -> str | None:
    """``h`` for ``h``, ``h.abs()``, ``h.float().clamp(0, 1)``, ``-h * 2``...:
    the name whose element count ``node`` has, or None."""
    while True:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            node = node.operand
        elif isinstance(node, ast.BinOp) and _is_number(node.right) and not isinstance(node.op, ast.MatMult):
            node = node.left
        elif isinstance(node, ast.BinOp) and _is_number(node.left) and not isinstance(node.op, ast.MatMult):
            node = node.right
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _SAME_NUMEL
            and all(_is_number(a) for a in [*node.args, *(k.value for k in node.keywords)])
        ):
            node = node.func.value
        else:
            return node.id if isinstance(node, ast.Name) else None


def _is_number(node: ast.expr) -> bool:
    """A constant (``2``, ``-1.5``, ``None``)."""
    return isinstance(node, ast.Constant) or (isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant))


def tested(test: ast.expr, facts: FunctionFacts) -> Tested:
    """What evaluating ``test`` without raising proves: ``nonempty_names`` and
    ``dtypes.tested_kinds``."""
    return Tested(nonempty_names(test, facts), tested_kinds(test, facts))


def nonempty_names(test: ast.expr, facts: FunctionFacts) -> frozenset[str]:
    """Names whose tensor ``test`` proves to hold an element once it is
    evaluated: it reduces them whole (``h.amax()``, ``h.abs().max()``,
    ``torch.amax(h)``, ``h.item()``), which raises on an empty tensor. Only
    parts always evaluated count (the first operand of and/or, not an ``if``
    expression's branches)."""
    found: set[str] = set()
    for node in always_evaluated(test):
        if isinstance(node, ast.Call) and not node.keywords:
            fn = is_torch_attr(node.func, facts)
            if fn is not None and fn in RAISE_ON_EMPTY and len(node.args) == 1:
                receiver: ast.expr | None = node.args[0]
            elif fn is None and isinstance(node.func, ast.Attribute) and node.func.attr in RAISE_ON_EMPTY and not node.args:
                receiver = node.func.value
            else:
                receiver = None
            name = same_numel_name(receiver) if receiver is not None else None
            if name is not None:
                found.add(name)
    return frozenset(found)


# --------------------------------------------------------------------------
# a whole function or module


PURE_GLOBAL_CALLS = frozenset(
    {"len", "int", "float", "bool", "str", "getattr", "hasattr", "isinstance", "min", "max", "abs", "range",
     "tuple", "list", "dict", "sorted", "round", "sum", "any", "all", "zip", "enumerate"}
)
_PURE_METHODS_ANY_RECEIVER = frozenset({"get", "keys", "values", "items", "copy"})
_TORCH_FACTORIES = frozenset({"tensor", "arange", "ones", "zeros", "full", "linspace", "empty", "eye", "float32",
                              "int64", "device"})


def function_impurities(fn: Any, depth: int = 0) -> list[str]:
    """Why ``fn`` may have effects beyond its return value (empty: pure).

    Pure here means: it only binds locals, reads attributes and items, and
    calls pure builtins, ``math``, torch's pure functions and factories,
    tensor methods that do not mutate, ``dict.get`` and other functions
    that are pure by the same test (two levels deep). It may raise."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return [f"{getattr(fn, '__name__', fn)!s} has no Python source"]
    tree = source_tree(fn)
    if tree is None:
        return [f"the source of {fn.__qualname__} is not available"]
    fdef = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if fdef is None:
        return [f"{fn.__qualname__} is not a plain function"]
    namespace = getattr(fn, "__globals__", {})
    local = bound_names(fdef)
    out: list[str] = []
    # Building the exception of a `raise` is part of raising, which is allowed.
    in_raise = {id(n) for r in ast.walk(fdef) if isinstance(r, ast.Raise) for n in ast.walk(r)}
    for node in ast.walk(fdef):
        if node is fdef or id(node) in in_raise:
            continue
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            out.append(f"{fn.__qualname__} declares global/nonlocal names")
        elif isinstance(node, (ast.Yield, ast.YieldFrom, ast.Await)):
            out.append(f"{fn.__qualname__} is a generator or coroutine")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for sub in stores(node.targets if isinstance(node, ast.Assign) else [node.target]):
                base = sub.value
                while isinstance(base, (ast.Attribute, ast.Subscript)):
                    base = base.value
                if not (isinstance(base, ast.Name) and base.id in local and base.id not in param_names(fdef)):
                    out.append(f"{fn.__qualname__} stores into `{ast.unparse(sub)}`")
        elif isinstance(node, ast.Call):
            reason = impure_call(node, namespace, local, depth, fn.__qualname__)
            if reason:
                out.append(reason)
    return out


def param_names(fdef: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = fdef.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    for extra in (args.vararg, args.kwarg):
        if extra is not None:
            names.add(extra.arg)
    return names


def impure_call(call: ast.Call, namespace: dict[str, Any], local: set[str], depth: int, owner: str) -> str | None:
    func = call.func
    dotted = ast.unparse(func)
    if isinstance(func, ast.Name):
        if func.id in local:
            return f"{owner} calls the local `{func.id}`"
        if func.id in PURE_GLOBAL_CALLS and func.id not in namespace:
            return None
        target = namespace.get(func.id)
        if target is not None and depth < 2 and callable(target) and hasattr(target, "__code__"):
            inner = function_impurities(target, depth + 1)
            return inner[0] if inner else None
        return f"{owner} calls `{func.id}`, not known to be pure"
    if isinstance(func, ast.Attribute):
        base = func.value
        if isinstance(base, ast.Name) and base.id not in local:
            module = namespace.get(base.id)
            if module is torch and (func.attr in PURE_TORCH_FUNCTIONS or func.attr in _TORCH_FACTORIES):
                return None
            if getattr(module, "__name__", None) == "math":
                return None
        if func.attr in _PURE_METHODS_ANY_RECEIVER or (func.attr in PURE_TENSOR_METHODS and not func.attr.endswith("_")):
            return None
    return f"{owner} calls `{dotted}`, not known to be pure"


def module_impurity(module: torch.nn.Module, depth: int = 0) -> str | None:
    """Why calling ``module`` could have an effect besides its result (None: pure)."""
    from torch.nn.modules import module as module_mod

    name = type(module).__name__
    if module._forward_hooks or module._forward_pre_hooks or module_mod._global_forward_hooks or (
        module_mod._global_forward_pre_hooks
    ):
        return f"{name} has forward hooks"
    if isinstance(module, torch.nn.Dropout):
        return f"{name} draws random numbers in training" if module.training and module.p > 0 else None
    if is_layer(module, EMPTY_SAFE_LAYERS):
        return None
    if depth > 3:
        return f"{name} nests modules too deep to check"
    forward = type(module).forward
    tree = source_tree(forward)
    if tree is None or not tree.body:
        return f"the source of {name}.forward is not available"
    fdef = tree.body[0]
    local = bound_names(fdef)
    namespace = getattr(forward, "__globals__", {})
    for node in ast.walk(fdef):
        if isinstance(node, (ast.Global, ast.Nonlocal, ast.Yield, ast.YieldFrom, ast.Await)):
            return f"{name}.forward uses `{type(node).__name__.lower()}`"
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            if any(stores(node.targets if isinstance(node, ast.Assign) else [node.target])):
                return f"{name}.forward stores into an attribute or item"
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in RAISE_ON_EMPTY:
                return f"{name}.forward calls `{ast.unparse(func)}`, which raises on an empty input"
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
                child = getattr(module, func.attr, None)
                if isinstance(child, torch.nn.Module):
                    reason = module_impurity(child, depth + 1)
                    if reason:
                        return reason
                    continue
            reason = impure_call(node, namespace, local, 0, f"{name}.forward")
            if reason:
                return reason
    return None


# torch's C functions (``self.act = nn.functional.gelu``) that draw no random
# numbers: a check's continuation may call them ([Trap] cannot undo a draw).
DRAWS_NOTHING = PURE_TORCH_FUNCTIONS | frozenset(
    {"gelu", "silu", "elu", "selu", "celu", "leaky_relu", "hardtanh", "hardswish", "hardsigmoid", "mish",
     "softplus", "softsign", "relu6", "glu", "logsigmoid", "tanhshrink", "layer_norm", "group_norm", "linear"}
)


def pure_torch_builtin(value: Any) -> bool:
    """A torch function implemented in C that does not change its arguments in
    place or global settings (``torch.nn.functional.gelu``); random draws are
    undone by the caller that needs it (runtime.call restores the RNG)."""
    import types

    if not isinstance(value, types.BuiltinFunctionType):
        return False
    name = getattr(value, "__name__", "")
    module = getattr(value, "__module__", None) or ""
    owner = getattr(getattr(value, "__self__", None), "__name__", "")
    return (
        (module.startswith("torch") or str(owner).startswith("torch"))
        and not name.endswith("_")
        and not name.startswith(("set_", "_set", "manual_seed", "seed", "use_deterministic"))
    )
