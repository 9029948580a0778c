"""Whether a caller may update in place what a function hands back: followed
on the call chains Dynamo showed (``RewriteContext.chains``).

[Where] replaces the tensor a path assigned with a new one (``torch.where``'s
output). Where the function returns that name as it is, the original handed
the path's own tensor back; a caller's ``h.add_(1)`` then changed it, with
every name sharing it, and under autograd a tensor some op saved (eager
refuses that backward; after the select it would not: a fuzzer find, seed 24).

Followed: ``h, s = helper(h, s)`` and ``h = helper(h)`` (the name that gets
the value, then ``facts.updated_after`` in the caller and, where the caller
returns it as it is, that caller's callers); ``out = layer(h)`` then ``h =
out[0]`` (other elements of ``out`` are not followed); ``return helper(h)``
(the next caller's statement); the result as an operand of arithmetic or a
comparison (a new tensor). Not followed, and not counted as an update (a
known gap, docs/limits.md): the result passed to another call in the same
statement (``self.b1(self.b0(x))``: the callee could change its argument in
place), stored, or a statement that could not be read; callers not known.

The callers' part of ``shared.SharedUpdates`` lives here too: a caller on the
chains reading one tensor and updating another that may share its storage
(``shared_update_in_callers``), and the calls that pass a function two
parameters it reads and updates (``shared_entry_in_calls``).
"""

from __future__ import annotations

import ast
from typing import Any

from graphmend.analysis.aliasing import has_self, own_nodes, passed
from graphmend.analysis.effects import root_of
from graphmend.analysis.facts import FunctionFacts, updated_after
from graphmend.analysis.memo import recall
from graphmend.analysis.shared import SharedUpdates, always_alike
from graphmend.analysis.source import (
    defs_containing,
    frame_statement,
    module_namespace,
    parse_file,
    statement_in,
)

Position = int | None  # the element of a returned tuple, or None: the value returned itself


def returned_as_is(fdef: ast.AST, name: str) -> set[Position]:
    """Where ``fdef`` returns ``name`` itself: ``return h`` (None), ``return h, s`` (0)."""
    found: set[Position] = set()
    for node in own_nodes(fdef):
        if isinstance(node, ast.Return) and node.value is not None:
            if isinstance(node.value, ast.Name) and node.value.id == name:
                found.add(None)
            elif isinstance(node.value, ast.Tuple):
                found |= {i for i, e in enumerate(node.value.elts) if isinstance(e, ast.Name) and e.id == name}
    return found


def updated_by_callers(chains: list | None, fdef: ast.AST, name: str) -> str | None:
    """Why a caller updates ``name``, returned as it is by ``fdef``, in place
    (the caller's file and line), or None. ``chains`` None: no run, not judged."""
    positions = returned_as_is(fdef, name)
    if not positions or chains is None:
        return None
    for chain in chains:
        reason = _follow(list(chain), positions)
        if reason:
            return reason
    return None


def _judged(caller: ast.AST, path: str, new_result: Any, callees: Any) -> SharedUpdates:
    """``SharedUpdates`` of a caller, once per round (analysis/memo.py)."""
    def judge() -> SharedUpdates:
        return SharedUpdates(caller, FunctionFacts.of(caller, module_namespace(path), set()), new_result, callees)

    return recall(("shared updates", id(caller), id(new_result), id(callees)), judge, caller, new_result, callees)


def shared_update_in_callers(chains: list | None, new_result: Any = None, callees: Any = None) -> str | None:
    """``shared.SharedUpdates`` of each caller on the chains, at the call it
    stands on (Dynamo inlines the callers into the frame the site's break
    splits, so removing it splits none of theirs either): the first reason, with
    the caller's file and line, or None. A caller whose source cannot be read is
    not judged."""
    for chain in chains or []:
        for frame in list(chain)[:-1]:
            found = frame_statement(frame.file, frame.line)
            if found is None:
                continue
            caller, block, index = found
            reason = _judged(caller, frame.file, new_result, callees).at(block[index])
            if reason:
                return f"in the caller {caller.name} ({frame.file.rsplit('/', 1)[-1]}:{frame.line}), {reason}"
    return None


def shared_entry_in_calls(
    shared: SharedUpdates, pairs: list[tuple[str, str]], fdef: ast.AST, path: str, chains: list | None,
    new_result: Any = None, callees: Any = None,
) -> str | None:
    """Two parameters of ``fdef`` (``SharedUpdates.entry_pairs``: one updated in
    place, the other read), judged at every call of it: a reason where a call may
    pass tensors sharing storage and the relation may differ from call to call
    (bound in a branch, by an unknown callee, ``h[i]``, ...; or the function has
    more than one call), or where its calls are not all known (the model's
    ``forward``, a function used as a value or called from another file); followed
    up through callers that pass two of their own parameters. None where every call
    passes unrelated tensors, or views of one tensor alike on every call."""
    found = _entry_calls(pairs, fdef, path, chains, new_result, callees, 0) if pairs else None
    if found is None:
        return None
    (name, other), why = found
    return f"{shared.entry_reason(name, other)}; {why}"


def _entry_calls(
    pairs: list[tuple[str, str]], fdef: ast.AST, path: str, chains: list | None, new_result: Any, callees: Any, depth: int
) -> tuple[tuple[str, str], str] | None:
    calls = _calls_of(fdef, path, chains)
    if calls is None or depth > 3:
        name, other = pairs[0]
        return pairs[0], f"`{other}` and `{name}` are parameters whose callers are not all known"
    for caller, stmt, call, where, bound in calls:
        prefix, varies = _judged(caller, where, new_result, callees).prefix(stmt, including=False)
        args = dict(passed(call, fdef, bound=bound))
        params = {a.arg for a in caller.args.posonlyargs + caller.args.args + caller.args.kwonlyargs} - {"self"}
        for name, other in pairs:
            if name not in args or other not in args:
                continue  # a default: a value bound once, alike on every call
            ours, theirs = (
                {n for source in prefix.sources_of(args[p]) for n in prefix.sharers(source)} for p in (name, other)
            )
            alike = all(always_alike(args[n], prefix) for n in (name, other))
            if ours & theirs and (varies & (ours | theirs) or len(calls) > 1 or not alike):
                line = f"{where.rsplit('/', 1)[-1]}:{stmt.lineno}"
                return (name, other), f"the call at {line} may pass them sharing storage on some calls only"
            up = [(a, b) for a in sorted(ours & params) for b in sorted(theirs & params) if a != b]
            if up:  # the caller's own parameters, which its callers may pass sharing storage: judged at its calls
                outer = [list(c)[:-1] for c in chains or [] if len(c) >= 2]
                found = _entry_calls(up, caller, where, outer or None, new_result, callees, depth + 1)
                if found:
                    return (name, other), found[1]
    return None


def _calls_of(fdef: ast.AST, path: str, chains: list | None) -> list[tuple] | None:
    """Every call of ``fdef`` as ``(caller, statement, call, caller's file, bound)``:
    found by name in its file (``helper(...)`` for a module function, any
    ``self.helper(...)`` for a method: a subclass's too), or else the chains'
    callers (a submodule's ``forward``); None where some call cannot be known (the
    model's own entry, a function used as a value)."""
    name = fdef.name  # type: ignore[attr-defined]
    parsed = parse_file(path)
    method = has_self(fdef)
    if parsed is not None and name != "forward":
        found, funcs = [], set()
        for node in ast.walk(parsed.tree):
            if isinstance(node, ast.Call) and _names(node.func, name, method):
                funcs.add(id(node.func))
                holders = defs_containing(parsed.tree, node.lineno)
                spot = statement_in(holders[0].body, node.lineno, into_classes=False) if holders else None
                if spot is None:
                    return None  # called at a module's or class's top level
                found.append((holders[0], spot[0][spot[1]], node, path, method))
        if any(_names(n, name, method) and id(n) not in funcs for n in ast.walk(parsed.tree)):
            return None  # used as a value (`fn = helper`): its calls are not all seen
        if found:
            return found
    calls = []
    for chain in chains or []:
        if len(chain) < 2:
            return None  # called from outside the model
        frame = list(chain)[-2]
        spot = frame_statement(frame.file, frame.line)
        call = _module_call(spot[1][spot[2]], name) if spot is not None else None
        if call is None:
            return None
        if all(c[2] is not call for c in calls):
            calls.append((spot[0], spot[1][spot[2]], call, frame.file, method))
    return calls or None


def _module_call(stmt: ast.stmt, function: str) -> ast.Call | None:
    """``_the_call``, or else the statement's only call of ``self.<attr>``,
    ``self.<attr>[i]`` or a local (``layer(h)``): a submodule's ``forward``
    (``self.shout(h, h.mean())``; ``h.mean()`` is a tensor's method)."""
    found = _the_call(stmt, function)
    if found is not None:
        return found
    calls = [
        c for c in ast.walk(stmt)
        if isinstance(c, ast.Call) and (isinstance(c.func, ast.Name) or root_of(c.func) == "self")
    ]
    return calls[0] if len(calls) == 1 else None


def _names(node: ast.AST, name: str, method: bool) -> bool:
    """``helper`` (a module function) or ``self.helper`` (a method)."""
    if method:
        return isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.value, ast.Name) and node.value.id == "self"
    return isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)


def _follow(chain: list, positions: set[Position]) -> str | None:
    while len(chain) >= 2 and positions:
        callee, frame = chain.pop(), chain[-1]
        where = f"{frame.file.rsplit('/', 1)[-1]}:{frame.line}"
        found = frame_statement(frame.file, frame.line)
        if found is None:
            return None  # not followed
        caller, block, index = found
        stmt = block[index]
        call = _the_call(stmt, callee.function)
        if call is None:
            return None  # not followed
        if isinstance(stmt, ast.Return) and stmt.value is call:
            continue  # handed on as it is: the next caller's statement
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and stmt.value is call:
            names = _receivers(caller, stmt, stmt.targets[0], positions)
            if names is None:
                return None  # not followed
            positions = set()
            for received in names:
                if updated_after(caller, stmt, received) is not None:
                    return f"the caller at {where} updates it in place"
                positions |= returned_as_is(caller, received)
            continue
        return None  # an operand of arithmetic (a new value), or not followed
    return None


def _the_call(stmt: ast.stmt, function: str) -> ast.Call | None:
    """The call in ``stmt`` of ``function`` (``helper(...)``, ``self.helper(...)``),
    or the statement's only call (``self.layer(h)`` runs ``forward``)."""
    calls = [n for n in ast.walk(stmt) if isinstance(n, ast.Call)]
    named = [c for c in calls if getattr(c.func, "id", getattr(c.func, "attr", None)) == function]
    return named[0] if len(named) == 1 else calls[0] if len(calls) == 1 else None


def _receivers(caller: ast.AST, stmt: ast.stmt, target: ast.expr, positions: set[Position]) -> list[str] | None:
    """The caller's names that get the returned value; None where it is not followed."""
    if isinstance(target, ast.Name):
        if positions == {None}:
            return [target.id]
        return _elements(caller, stmt, target.id, positions)
    if isinstance(target, ast.Tuple) and None not in positions:
        if any(i >= len(target.elts) or not isinstance(target.elts[i], ast.Name) for i in positions):
            return None
        return [target.elts[i].id for i in positions]  # type: ignore[attr-defined]
    return None


def _elements(caller: ast.AST, stmt: ast.stmt, tuple_name: str, positions: set[Position]) -> list[str] | None:
    """``out = layer(h)`` then ``h = out[0]``: the names elements ``positions`` go to."""
    names = []
    for node in ast.walk(caller):
        if not (isinstance(node, ast.Name) and node.id == tuple_name) or node is getattr(stmt, "targets", [None])[0]:
            continue
        parent = _parent(caller, node)
        if not (isinstance(parent, ast.Subscript) and isinstance(parent.slice, ast.Constant)):
            return None
        if parent.slice.value not in positions:
            continue
        assign = _parent(caller, parent)
        if not (isinstance(assign, ast.Assign) and assign.value is parent and len(assign.targets) == 1):
            return None
        if not isinstance(assign.targets[0], ast.Name):
            return None
        names.append(assign.targets[0].id)
    return names


def _parent(root: ast.AST, child: ast.AST) -> ast.AST | None:
    for node in ast.walk(root):
        if any(c is child for c in ast.iter_child_nodes(node)):
            return node
    return None
