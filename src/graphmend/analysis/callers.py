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
"""

from __future__ import annotations

import ast

from graphmend.analysis.aliasing import own_nodes
from graphmend.analysis.facts import updated_after
from graphmend.analysis.source import frame_statement

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
