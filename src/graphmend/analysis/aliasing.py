"""Which locals of a function hold values it made itself ("fresh"): changing
one in place changes nothing a caller can see, so [Trap] may let the change
happen before a check's exception and [Speculate] may run it twice.

A local is fresh when every value assigned to it is new: arithmetic, a
literal, a torch op, a view of a fresh local, or a call whose result the
caller's resolver proves new (``call_fresh``). A called module or helper may
hand back its argument as it is (``nn.Identity``, dropout in eval, a helper's
``return h, s``): its result is then as fresh as the argument it passed.
What a fresh value holds counts as its own, as ``root_of`` judges a change
through it: ``store = cache.store`` (or ``cache[i]``) is fresh when ``cache``
is, and passing it to a callee passes a fresh value.

A local is not fresh when a value assigned to it may be a parameter, an
attribute or a view of one, or when the function stores it where it outlives
the call (``self.cache = h``, ``self.items.append(h)``).
"""

from __future__ import annotations

import ast
from typing import Any, Callable

from graphmend.analysis.effects import root_of, self_attribute
from graphmend.analysis.source import definition_of, in_place_argument, in_place_method

# Methods whose result may share its receiver's storage (or be the receiver).
VIEW_METHODS = frozenset(
    {"view", "view_as", "reshape", "transpose", "permute", "flatten", "squeeze", "unsqueeze", "expand", "expand_as",
     "narrow", "select", "detach", "t", "contiguous", "to", "as_strided", "unflatten", "split", "chunk", "unbind",
     "movedim", "swapaxes", "diagonal", "real", "imag", "type", "float", "half", "double", "long", "int", "bool"}
)
# Methods that keep their argument inside their receiver.
_KEEPING_METHODS = frozenset({"append", "extend", "insert", "add", "update", "setdefault", "__setitem__"})

# (call, element of its tuple result or None, is_fresh for the caller's expressions) -> whether the result is new.
CallFresh = Callable[[ast.Call, "int | None", Callable[[ast.AST], bool]], bool]


class _Element:
    """``a, b = f(...)``: the value ``a`` gets, element ``index`` of the call's result."""

    def __init__(self, call: ast.Call, index: int) -> None:
        self.call, self.index = call, index


def fresh_locals(
    fdef: ast.AST, fresh_params: frozenset[str] = frozenset(), call_fresh: CallFresh | None = None
) -> set[str]:
    """The fresh locals of ``fdef``. ``fresh_params``: parameters every caller
    passes a fresh value (they count as made here). ``call_fresh`` decides
    calls that are not torch ops; without it every call's result counts as
    new and an unpacked call result as unknown."""
    args = fdef.args  # type: ignore[attr-defined]
    params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    params |= {extra.arg for extra in (args.vararg, args.kwarg) if extra is not None}
    values: dict[str, list[object]] = {}
    stored: list[tuple[str | None, set[str]]] = []  # (where to, names stored): `self.cache = h`, `items.append(h)`
    for node in own_nodes(fdef):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                _bind(target, node.value, values, call_fresh is not None)
                for t in ast.walk(target):
                    if isinstance(t, (ast.Attribute, ast.Subscript)):
                        stored.append((root_of(t), alias_roots(node.value)))
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            if isinstance(node.target, ast.Name):
                values.setdefault(node.target.id, []).append(node.value)
            elif node.value is not None:
                stored.append((root_of(node.target), alias_roots(node.value)))
        elif isinstance(node, (ast.For, ast.With, ast.NamedExpr, ast.comprehension)):
            for sub in ast.walk(getattr(node, "target", None) or ast.Pass()):
                if isinstance(sub, ast.Name):
                    values.setdefault(sub.id, []).append(None)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _KEEPING_METHODS:
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                stored.append((root_of(node.func.value), alias_roots(arg)))

    # The greatest fixpoint: assume every assigned name fresh, then drop names
    # with a definition that is not (a parameter, an attribute, a view of a
    # dropped name) until nothing changes. `x = x.view(...)` keeps x fresh when
    # its other definitions are.
    fresh: set[str] = {n for n in values if n not in params or n in fresh_params} | set(fresh_params)

    def is_fresh(node: object) -> bool:
        if isinstance(node, _Element):
            return call_fresh is not None and call_fresh(node.call, node.index, is_fresh)
        return fresh_expr(node, fresh, call_fresh, is_fresh)  # type: ignore[arg-type]

    changed = True
    while changed:
        changed = False
        for name in sorted(fresh):
            if name in values and not all(v is not None and is_fresh(v) for v in values[name]):
                fresh.discard(name)
                changed = True
        for container, names in stored:  # stored into something not fresh: it outlives the call
            if container not in fresh and names & fresh:
                fresh -= names
                changed = True
    return fresh


def fresh_expr(
    node: ast.AST, fresh: set[str], call_fresh: CallFresh | None = None,
    is_fresh: Callable[[ast.AST], bool] | None = None,
) -> bool:
    """Whether ``node`` evaluates to a new value, given the fresh locals."""
    again = is_fresh or (lambda n: fresh_expr(n, fresh, call_fresh))
    if isinstance(
        node,
        (ast.BinOp, ast.UnaryOp, ast.Compare, ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.Set,
         ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.JoinedStr),
    ):
        return True  # a new value (a container's items are not mutated through it here)
    if isinstance(node, ast.IfExp):
        return again(node.body) and again(node.orelse)
    if isinstance(node, ast.Name):
        return node.id in fresh
    if isinstance(node, (ast.Subscript, ast.Attribute)):
        # What a new object holds is its own, as ``root_of`` judges ``cache.store.update(h)``:
        # ``parts = cache.store; parts.update(h)`` is the same change.
        return again(node.value)
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and returns_receiver(func.attr):
            return again(func.value)  # a view shares its receiver's storage; `h.add_(1)` is h
        if in_place_argument(node) is not None:
            return again(in_place_argument(node))  # `F.relu(h, inplace=True)` is h
        return call_fresh is None or call_fresh(node, None, again)
    return False


def result_fresh(
    fdef: ast.AST, call: ast.Call, index: int | None, is_fresh: Callable[[ast.AST], bool],
    call_fresh: CallFresh | None, *, bound: bool,
) -> bool:
    """Whether what ``fdef`` returns (element ``index`` of its tuple) is new
    for this ``call``: made in the callee, or flowing from parameters the
    call passes fresh values. ``bound``: the call passes ``self`` first.

    Not proven, and taken as new as before this analysis: a name the callee
    assigns (a parameter included) that the proof cannot follow, as ``x`` of
    ``for layer in self.layers: x = layer(x)``; on a path where nothing is
    assigned it is the argument itself (a hole: ``if self.norm is not None:
    x = self.norm(x)``). What is refused: returning a parameter the callee
    never assigns (``return h, s``) or a view of one, or an attribute."""
    if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in own_nodes(fdef)):
        return False
    params = frozenset(p for p, arg in passed(call, fdef, bound=bound) if is_fresh(arg))
    inner = fresh_locals(fdef, params, call_fresh)
    assigned = {n.id for n in own_nodes(fdef) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for ret in (n for n in own_nodes(fdef) if isinstance(n, ast.Return) and n.value is not None):
        value = ret.value
        if index is not None:
            if not isinstance(value, ast.Tuple) or index >= len(value.elts) or any(
                isinstance(e, ast.Starred) for e in value.elts
            ):
                return False
            value = value.elts[index]
        if not fresh_expr(value, inner, call_fresh) and not (isinstance(value, ast.Name) and value.id in assigned):
            return False
    return True


def may_return_input(name: str) -> bool:
    """Whether a torch op or layer of this name may return its input itself (or a view of it)."""
    return returns_receiver(name) or name.lower().rstrip("123d").endswith(("dropout", "identity", "flatten"))


def fresh_arguments(
    call: ast.Call, fn: Any, local: set[str], *, bound: bool
) -> tuple[frozenset[str], frozenset[tuple[str, str]]]:
    """What the call passes the callee: the parameters that receive one of the
    caller's fresh locals (in-place changes to them change nothing the
    caller's caller can see), and (parameter, attr) for each argument passed as
    ``self.<attr>`` (a method or module the callee may call through it)."""
    fdef = definition_of(fn.__code__) if hasattr(fn, "__code__") else None
    if fdef is None:
        return frozenset(), frozenset()
    pairs = passed(call, fdef, bound=bound)
    fresh = frozenset(p for p, arg in pairs if _held_by(arg, local))
    callables = frozenset((p, self_attribute(arg)) for p, arg in pairs if self_attribute(arg) is not None)
    return fresh, callables


def _held_by(arg: ast.AST, local: set[str]) -> bool:
    """``cache``, ``cache[i]``, ``cache.store``: a fresh local or what it holds."""
    while isinstance(arg, (ast.Attribute, ast.Subscript)):
        arg = arg.value
    return isinstance(arg, ast.Name) and arg.id in local


def passed(call: ast.Call, fdef: Any, *, bound: bool) -> list[tuple[str, ast.AST]]:
    """(parameter, argument) for what ``call`` passes ``fdef``: positional
    arguments up to a ``*args``, and keywords naming a parameter."""
    params = [a.arg for a in fdef.args.posonlyargs + fdef.args.args][1 if bound else 0 :]
    pairs = []
    for index, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred) or index >= len(params):
            break
        pairs.append((params[index], arg))
    named = {a.arg for a in fdef.args.args + fdef.args.kwonlyargs}
    return pairs + [(k.arg, k.value) for k in call.keywords if k.arg in named]


def is_super_call(node: ast.AST) -> bool:
    """``super()``."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def has_self(fdef: Any) -> bool:
    """Whether ``fdef``'s first parameter is ``self`` and nothing rebinds it."""
    params = fdef.args.posonlyargs + fdef.args.args
    if not params or params[0].arg != "self":
        return False
    return not any(isinstance(n, ast.Name) and n.id == "self" and isinstance(n.ctx, ast.Store) for n in ast.walk(fdef))


def alias_roots(node: ast.AST) -> set[str]:
    """The names whose value ``node`` may be, or be a view of."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(alias_roots(e) for e in node.elts))
    if isinstance(node, ast.Dict):
        return set().union(*(alias_roots(v) for v in node.values))
    if isinstance(node, ast.IfExp):
        return alias_roots(node.body) | alias_roots(node.orelse)
    if isinstance(node, (ast.Subscript, ast.Starred)):
        return alias_roots(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and returns_receiver(node.func.attr):
        return alias_roots(node.func.value)
    if isinstance(node, ast.Call) and in_place_argument(node) is not None:
        return alias_roots(in_place_argument(node))  # type: ignore[arg-type]
    return set()


def returns_receiver(method: str) -> bool:
    """Whether a tensor method of this name may return its receiver or a view of it."""
    return method in VIEW_METHODS or in_place_method(method)


def _bind(target: ast.AST, value: ast.AST, values: dict[str, list[object]], unpack_calls: bool) -> None:
    if isinstance(target, ast.Name):
        values.setdefault(target.id, []).append(value)
        return
    if isinstance(target, (ast.Tuple, ast.List)) and not any(isinstance(e, ast.Starred) for e in target.elts):
        if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
            for element, part in zip(target.elts, value.elts):
                _bind(element, part, values, unpack_calls)
            return
        if unpack_calls and isinstance(value, ast.Call):
            for i, element in enumerate(target.elts):
                if isinstance(element, ast.Name):
                    values.setdefault(element.id, []).append(_Element(value, i))
                else:
                    _unknown(element, values)
            return
    _unknown(target, values)


def _unknown(target: ast.AST, values: dict[str, list[object]]) -> None:
    for sub in ast.walk(target):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
            values.setdefault(sub.id, []).append(None)  # unpacked: unknown origin


def own_nodes(fdef: ast.AST):
    """The nodes of ``fdef``'s body, not those of functions or lambdas nested in it."""
    todo = list(ast.iter_child_nodes(fdef))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
