"""Which breaks no rewrite may remove: one between a read of a tensor and an
in-place update of another that may share its storage on some calls only, both
bound where a compiled frame may start (``SharedUpdates``).

Where two such tensors enter a compiled frame as inputs (Dynamo resuming after
a break) sharing storage on one call and not on the next, AOTAutograd reuses
the graph it built for the shared inputs and rebuilds one from the other's
storage (pytorch #139789, docs/torch-issues.md): values read from it are stale.
The original's break keeps the read and the update in separate graphs, each
right; a rewrite that removes it would put them in one. The rewrite engine asks
this before every rule, of the site's function, of the calls that pass its
parameters (``callers.shared_entry_in_calls``) and of each caller on its chains
(``callers.shared_update_in_callers``).

Before: ``s = h[0, 0]``, ``h = self.block(h)`` (``block`` hands ``h`` back on one
path), ``print("h is", h, s)``, ``s.add_(1)``: [Defer] would join the print's read
of ``h`` and the update of ``s``; the break stays, with the reason shown. Views
bound alike on every call (``s = h[0, 0]`` with ``h`` not rebound) are
AOTAutograd's handled case and keep nothing.
"""

from __future__ import annotations

import ast
from typing import Any, Callable

from graphmend.analysis.aliasing import has_self, own_nodes
from graphmend.analysis.facts import (
    FunctionFacts,
    live_after,
    live_at_start,
    path_to,
    updated_after,
    updated_later,
)
from graphmend.analysis.purity import is_layer
from graphmend.analysis.sharing import DISPLAYS, Sharing
from graphmend.analysis.source import (
    RUNTIME_NAME,
    definition_of,
    header_expr,
    in_place_argument,
    in_place_method,
)


class SharedUpdates:
    """The pairs of a function (a name it updates in place, another it reads that
    may share its storage) and, per site, whether one keeps its break.

    A pair counts at a site when a frame may start before it (right after a
    statement Dynamo can break on that may have run: not one in the other branch of
    an ``if`` holding the site, nor one in a block that returns first; a loop's
    next pass counts) with the two names bound there, sharing storage with a
    relation that may differ from call to call (``_varying``: a binding in a branch,
    by an unknown callee, ``a if c else b``, ``reshape``, ``h[i]``), the tensor of
    one updated in place later (``facts.updated_later``) and the other read later;
    the read or the update must be at the site or after it (both before it: the
    original has them in one graph too). Which other breaks stay is not known here,
    so every such start counts. Sharing is judged with ``Sharing(storage=True)``, as
    bound by the code that may have run at that start (``prefix``): arithmetic,
    pure torch ops and layers known to make new tensors share nothing, a view or
    in-place method shares only its receiver, a same-module function's or a live
    method's returns are followed element by element. Two parameters are judged at
    the calls that pass them (``entry_pairs``). Left out: ``self`` (the module;
    its parameters and buffers are taken not to share the inputs' storage),
    attribute stores (``out.logits = ...``), updates through an expression
    (``items[0].add_(1)``) and ``+=`` of a tuple or list display."""

    def __init__(self, fdef: ast.AST, facts: FunctionFacts, new_result: Any = None, callees: Any = None) -> None:
        self._fdef, self._facts, self._new_result, self._callees = fdef, facts, new_result, callees
        sharing = Sharing(fdef, facts, storage=True, new_result=new_result, callees=callees)
        module = {fdef.args.args[0].arg} if has_self(fdef) else set()  # type: ignore[attr-defined]
        called = {id(n.func) for n in own_nodes(fdef) if isinstance(n, ast.Call)}  # `layer(h)`: no tensor read
        reads = {n.id for n in own_nodes(fdef) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and id(n) not in called}
        self._statements = sorted((n for n in own_nodes(fdef) if isinstance(n, ast.stmt)), key=lambda n: (n.lineno, n.col_offset))
        args = fdef.args  # type: ignore[attr-defined]
        self._params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        updated = sorted({name for stmt in self._statements for name in _updated(stmt)} - module - _containers(fdef))
        self._pairs = [(name, other) for name in updated for other in sorted((reads & sharing.sharers(name)) - {name} - module)]
        # Two parameters share storage where the caller passes tensors that do (judged at the calls: entry_pairs).
        self._entry = [
            (name, other) for name in updated if name in self._params
            for other in sorted((reads & self._params) - {name} - module)
        ]
        self._prefixes: dict[tuple[int, bool], tuple[Sharing, set[str]]] = {}
        # Each statement's holders (the statements whose blocks it is in) and its path of blocks.
        self._holders: dict[int, set[int]] = {}
        self._paths = {id(stmt): path_to(fdef.body, stmt) for stmt in self._statements}  # type: ignore[attr-defined]
        for stmt in self._statements:
            self._holders[id(stmt)] = {id(block[index]) for block, index in (self._paths[id(stmt)] or [])[:-1]}
        self._loops = {id(n) for n in self._statements if isinstance(n, (ast.For, ast.AsyncFor, ast.While))}

    def at(self, site: ast.stmt) -> str | None:
        """Why the break at ``site`` (a statement of the function) must stay, or None.
        Two parameters are left to the calls (``entry_pairs``)."""
        fdef = self._fdef
        before = [s for s in self._statements if self._precedes(s, site) and _may_break(s)]
        for name, other in self._pairs:
            if not self._counts(site, name, other):
                continue  # both before the site: in one graph in the original too
            for after in before:
                update = updated_after(fdef, after, name)  # type: ignore[arg-type]
                if update is None or not updated_later(fdef, after, name) or not live_after(fdef, after, other):  # type: ignore[arg-type]
                    continue  # no update of the tensor `name` holds there, or `other`'s not read
                prefix, varies = self.prefix(after)
                if not prefix.may_share(name, other):
                    continue  # they may share only through what later code binds
                together = prefix.sharers(name)
                if varies & together or len(together & self._params) >= 2:
                    return self.reason(other, name, update)
                # else bound once each, by views: they share alike on every call (AOTAutograd's case)
        return None

    def entry_pairs(self, site: ast.stmt) -> list[tuple[str, str]]:
        """The pairs of parameters (one updated in place, the other read) that keep the
        break at ``site`` where a call passes them tensors that may share storage with
        a relation that differs from call to call (``callers.shared_entry_in_calls``)."""
        return [
            (name, other) for name, other in self._entry
            if self._counts(site, name, other) and all(live_at_start(self._fdef, n) for n in (name, other))  # type: ignore[arg-type]
        ]

    def prefix(self, point: ast.stmt, including: bool = True) -> tuple[Sharing, set[str]]:
        """Sharing as bound by the code that may have run when ``point`` ends (when it
        starts: ``including=False``): the statements that may precede it, its own, and
        the headers of those holding it (an ``if``'s test); and the names bound there
        whose relation to the others may differ from call to call (``_varying``)."""
        key = (id(point), including)
        if key not in self._prefixes:
            ran = [s for s in self._statements if (including and self._holds(point, s)) or self._precedes(s, point)]
            kept: set[int] = set()
            for stmt in self._statements:
                if any(stmt is s for s in ran):
                    kept |= {id(n) for n in ast.walk(stmt)}
                elif id(stmt) in self._holders_of(point):
                    kept |= {id(n) for n in ast.walk(header_expr(stmt))}
            kept -= {id(stmt) for stmt in ran if self._overwritten(stmt, point, ran, including)}  # its calls still count
            sharing = Sharing(
                self._fdef, self._facts, storage=True, only=lambda node: id(node) in kept,
                new_result=self._new_result, callees=self._callees,
            )
            self._prefixes[key] = (sharing, _varying(self._fdef, sharing, lambda node: id(node) in kept))
        return self._prefixes[key]

    def _precedes(self, stmt: ast.stmt, point: ast.stmt) -> bool:
        """Whether ``stmt`` may have ended, in the same call, when ``point`` starts:
        a loop holds both (its next pass), or ``stmt`` comes first, neither in the
        other branch of an ``if`` holding ``point`` nor in a block that returns or
        raises on its way out."""
        if self._holds(stmt, point):
            return False  # not ended yet
        path = self._paths.get(id(stmt)) or path_to(self._fdef.body, stmt)  # type: ignore[attr-defined]
        looped = bool(self._loops & self._holders_of(stmt) & self._holders_of(point))  # the next pass
        if path is None or not looped and stmt.end_lineno >= point.lineno:  # type: ignore[operator]
            return path is None
        for depth in range(len(path) - 1, -1, -1):
            block, index = path[depth]
            if any(self._holds(s, point) for s in block):
                return True  # the block leading to `point`: `stmt`'s part first, or a loop's next pass
            if any(isinstance(s, (ast.Return, ast.Raise)) for s in block[index:]):
                return False  # the block leaves the function first
            holder = path[depth - 1][0][path[depth - 1][1]] if depth else None
            if isinstance(holder, ast.If) and self._holds(holder, point) and not looped:
                return False  # the other branch
        return True

    def _overwritten(self, stmt: ast.stmt, point: ast.stmt, ran: list[ast.stmt], including: bool) -> bool:
        """An assignment of names each bound again, on every path, after it and before
        ``point`` (or by it, ``including``), from values that do not read the name (``s
        = h[0, 0]``, then ``s = h.amax()`` on ``point``'s path), none read in between (``t = s`` would carry
        the old value on) and no loop holding both: what it bound is no name's at
        ``point``, and can have gone nowhere else."""
        if not (isinstance(stmt, ast.Assign) and all(isinstance(t, (ast.Name, ast.Tuple)) for t in stmt.targets)):
            return False
        if self._loops & self._holders_of(stmt) & self._holders_of(point):
            return False
        if any(isinstance(n, ast.Starred) for t in stmt.targets for n in ast.walk(t)):
            return False
        names = {n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        path = self._paths.get(id(point)) or path_to(self._fdef.body, point) or []  # type: ignore[attr-defined]
        for depth, (block, index) in enumerate(path):
            for later in block[: index + (depth == len(path) - 1 and including)]:  # `point` itself, where it has run
                if later.lineno <= stmt.end_lineno or self._holds(later, stmt):  # type: ignore[operator]
                    continue
                between = [s for s in ran if stmt.end_lineno < s.lineno and s.end_lineno < later.lineno]  # type: ignore[operator]
                names -= {n for n in _rebinds(later) if not any(_reads_name(s, n) for s in [*between, later])}
        return not names

    def _holds(self, stmt: ast.stmt, point: ast.stmt) -> bool:
        """``point`` is ``stmt`` or in one of its blocks."""
        return stmt is point or id(stmt) in self._holders_of(point)

    def _holders_of(self, stmt: ast.stmt) -> set[int]:
        if id(stmt) not in self._holders:  # a statement a rewrite made
            self._holders[id(stmt)] = {id(b[i]) for b, i in (path_to(self._fdef.body, stmt) or [])[:-1]}  # type: ignore[attr-defined]
        return self._holders[id(stmt)]

    def entry_reason(self, name: str, other: str) -> str:
        """``reason`` for two parameters, naming the first update."""
        return self.reason(other, name, _first_update(self._statements, name))

    def _counts(self, site: ast.stmt, name: str, other: str) -> bool:
        """Whether the update of ``name`` or the read of ``other`` is at ``site`` or after it."""
        fdef = self._fdef
        return (
            name in _updated_within(site) or updated_after(fdef, site, name) is not None  # type: ignore[arg-type]
            or _reads_name(site, other) or live_after(fdef, site, other)  # type: ignore[arg-type]
        )

    def reason(self, other: str, name: str, update: ast.stmt | None) -> str:
        update = _first_update(sorted(_statements_in(update), key=lambda n: n.lineno), name) or update if update else None
        where = f" (`{ast.unparse(update).splitlines()[0]}`, line {update.lineno})" if update is not None else ""
        return (
            f"`{other}` may share storage with `{name}`, which the function updates in place{where}: a compiled "
            "graph that reads one and changes the other may read stale values when the two share storage on "
            "some calls only (torch's AOTAutograd)"
        )


# torch.nn layers whose call returns new storage (an ``inplace=True`` one excepted).
NEW_STORAGE_LAYERS = frozenset(
    {"Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "LayerNorm", "RMSNorm", "GroupNorm", "Embedding", "ReLU",
     "GELU", "SiLU", "Tanh", "Sigmoid", "Softmax", "LogSoftmax", "LeakyReLU", "ELU", "Mish", "Hardtanh"}
)


def new_from_layers(attribute_values: Callable[[str], list]) -> Callable[[ast.Call], bool]:
    """``self.lin(h)``, ``self.layers[i](h)``: new storage where every module the
    attribute holds on the live model (``attribute_values``) is such a layer."""

    def new(call: ast.Call) -> bool:
        func = call.func.value if isinstance(call.func, ast.Subscript) else call.func
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"):
            return False
        modules = [m for v in attribute_values(func.attr) for m in (v.children() if is_layer(v, _LISTS) else [v])]
        return bool(modules) and all(is_layer(m, NEW_STORAGE_LAYERS) and not getattr(m, "inplace", False) for m in modules)

    return new


_LISTS = frozenset({"ModuleList", "Sequential"})


def callees_from(attribute_values: Callable[[str], list]) -> Callable[[ast.Call], list | None]:
    """``self.helper(h)``, ``self.block(h)``, ``self.blocks[i](h)``: the defs the call may
    run on the live model (a method, a submodule's ``forward``), each with ``self``
    bound; None where one has no source. Hooks and an overridden ``__call__`` are not seen."""
    import torch

    def callees(call: ast.Call) -> list | None:
        func = call.func
        target = func.value if isinstance(func, ast.Subscript) else func
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"):
            return None
        found = []
        for value in attribute_values(target.attr):
            items = list(value.children()) if isinstance(func, ast.Subscript) and isinstance(value, torch.nn.Module) else [value]
            for item in items:
                function = type(item).forward if isinstance(item, torch.nn.Module) else item
                code = getattr(function, "__code__", None)
                fdef = definition_of(code) if code is not None else None
                if fdef is None:
                    return None
                found.append((fdef, True))
        return found or None

    return callees
# View methods whose result is always a view of the receiver (never a copy).
_ALWAYS_VIEWS = frozenset(
    {"view", "view_as", "transpose", "permute", "squeeze", "unsqueeze", "expand", "expand_as", "narrow", "select",
     "detach", "t", "unflatten", "movedim", "swapaxes", "diagonal", "real", "imag"}
)


def _varying(fdef: ast.AST, sharing: Sharing, counts: Callable[[ast.AST], bool]) -> set[str]:
    """The names whose storage relation to the others may differ from call to call:
    bound off the function's straight path (in a branch, loop, ``try`` or ``with``),
    or bound to what may or may not be another tensor (an unknown callee's result,
    ``a if c else b``, ``reshape``/``contiguous``/``to``, an index not a constant), or
    bound by a ``for`` or unpacking. A parameter does not vary as such: two of them
    sharing a class do (the caller may pass views of one tensor)."""
    varying: set[str] = set()
    top = {id(stmt) for stmt in fdef.body}  # type: ignore[attr-defined]
    for node in own_nodes(fdef):
        if isinstance(node, ast.stmt) and not counts(node):
            continue  # bound after the site: not what a frame starting before it gets
        if isinstance(node, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith, ast.NamedExpr, ast.comprehension)):
            varying |= {n.id for n in ast.walk(getattr(node, "target", node)) if isinstance(n, ast.Name)}
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        simple = len(targets) == 1 and isinstance(targets[0], ast.Name) and not isinstance(node, ast.AugAssign)
        unpacked = len(targets) == 1 and isinstance(targets[0], ast.Tuple) and isinstance(node, ast.Assign)
        if id(node) in top and unpacked:  # `h, s = self.helper(h, s)`: each element as its callee hands it back
            aliases = sharing.handed_back(node.value, len(targets[0].elts), _steady)  # type: ignore[attr-defined]
            varying |= {
                root for i, (root, sources) in enumerate(sharing.element_sources(targets[0], node.value))
                if sources and not (aliases and aliases[i])
            }
        elif id(node) not in top or not simple or not always_alike(node.value, sharing):  # type: ignore[arg-type]
            varying |= names
    return varying


def _steady(callee: ast.AST, sharing: Sharing, name: str) -> bool:
    """A callee's returned ``name`` is bound alike on every call (``_varying``)."""
    return name not in _varying(callee, sharing, lambda node: True)


def always_alike(value: ast.AST, sharing: Sharing) -> bool:
    """A value that is new storage, or always a view of one name: the same relation on every call."""
    if not sharing.sources_of(value):
        return True  # new storage (arithmetic, a pure torch op, a layer known to make a new tensor)
    if isinstance(value, ast.Name):
        return True
    if isinstance(value, ast.Subscript):
        index = value.slice.elts if isinstance(value.slice, ast.Tuple) else [value.slice]
        constant = all(isinstance(i, (ast.Constant, ast.Slice)) and all(
            isinstance(p, ast.Constant) or p is None for p in (getattr(i, "lower", None), getattr(i, "upper", None), getattr(i, "step", None))
        ) for i in index)
        return constant and always_alike(value.value, sharing)
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _ALWAYS_VIEWS:
        return always_alike(value.func.value, sharing)
    return False


def _may_break(stmt: ast.stmt) -> bool:
    """Whether a frame may start right after ``stmt`` (Dynamo resuming after a break
    in it): any statement but one that only moves names and constants (``t = s``,
    ``a, b = b, a``, ``x = None``), where Dynamo has nothing to break on."""
    if not isinstance(stmt, (ast.Assign, ast.Pass, ast.Break, ast.Continue)):
        return True
    return any(not isinstance(n, _INERT) for n in ast.walk(stmt) if n is not stmt)


_INERT = (ast.Name, ast.Constant, ast.Tuple, ast.List, ast.Starred, ast.expr_context)


def _rebinds(stmt: ast.stmt) -> set[str]:
    """The names ``stmt`` binds to new values on every path through it (an
    assignment; an ``if`` whose branches both do; not ``+=``, which may update)."""
    if isinstance(stmt, ast.Assign):
        return {n.id for t in stmt.targets if isinstance(t, (ast.Name, ast.Tuple)) for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(stmt, ast.If) and stmt.orelse:
        return {n for s in stmt.body for n in _rebinds(s)} & {n for s in stmt.orelse for n in _rebinds(s)}
    return set()


def _containers(fdef: ast.AST) -> set[str]:
    """Names that only ever hold a list, tuple, dict or set (``*args``, ``**kwargs``,
    ``args = list(args)``, ``outs = []``): an item store or ``+=`` on one updates
    no tensor."""
    args = fdef.args  # type: ignore[attr-defined]
    found = {extra.arg for extra in (args.vararg, args.kwarg) if extra is not None}
    bindings: dict[str, list[ast.AST]] = {}
    for node in own_nodes(fdef):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in (n for n in ast.walk(target) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)):
                    bindings.setdefault(name.id, []).append(node.value if target is name else None)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.withitem, ast.NamedExpr)):
            for name in ast.walk(getattr(node, "target", None) or getattr(node, "optional_vars", None) or ast.Pass()):
                if isinstance(name, ast.Name) and isinstance(name.ctx, ast.Store):
                    bindings.setdefault(name.id, []).append(None)
    if {"list", "tuple", "dict", "set"} & bindings.keys():
        return found  # a builtin's name taken by a local
    params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    for name, values in bindings.items():
        if name not in params and all(_container_value(v) for v in values):
            found.add(name)
        elif name in found and not all(_container_value(v) for v in values):
            found.discard(name)
    return found


def _container_value(value: ast.AST | None) -> bool:
    """A display, a comprehension, or ``list(...)``/``tuple(...)``/``dict(...)``/``set(...)``."""
    if isinstance(value, DISPLAYS):
        return True
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("list", "tuple", "dict", "set")


def _updated_within(stmt: ast.stmt) -> set[str]:
    return {name for s in _statements_in(stmt) for name in _updated(s)}


def _reads_name(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in ast.walk(node))


def _first_update(statements: list[ast.stmt], name: str) -> ast.stmt | None:
    return next((stmt for stmt in statements if name in _updated(stmt)), None)


def _statements_in(stmt: ast.stmt) -> list[ast.stmt]:
    return [n for n in ast.walk(stmt) if isinstance(n, ast.stmt)]


def _updated(stmt: ast.stmt) -> list[str]:
    """The names whose tensor ``stmt`` itself updates in place (``h.add_(1)``,
    ``F.relu(h, inplace=True)``, ``h[0] = 0``, ``h += 1``), not nested statements'."""
    names = []
    for node in (stmt, *_expressions(stmt)):
        func = getattr(node, "func", None)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and in_place_method(func.attr):
            if func.value.id == RUNTIME_NAME:
                continue  # graphmend's runtime (`print_`): no tensor method
            names.append(func.value.id)
        elif isinstance(node, ast.Call) and isinstance(in_place_argument(node), ast.Name):
            names.append(in_place_argument(node).id)  # type: ignore[union-attr]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name):
            names.append(node.value.id)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and not isinstance(node.value, DISPLAYS):
            names.append(node.target.id)  # not `outs += (h,)`: a tuple or list, no tensor
    return names


def _expressions(stmt: ast.stmt):
    """The nodes of ``stmt`` that are not inside a nested statement."""
    todo = [c for c in ast.iter_child_nodes(stmt) if not isinstance(c, ast.stmt)]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, (ast.stmt, ast.Lambda)))
