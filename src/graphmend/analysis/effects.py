"""Which statements and calls are effects a rule cares about: print, logging
and warnings calls, and ``if`` statements that only raise (validation guards).

Read from source alone; break classification, the rules and ``graphmend
check`` share these facts."""

from __future__ import annotations

import ast
import builtins
import copy
from typing import Any

from graphmend.analysis.source import dotted_name

LOG_METHODS = frozenset(
    {
        "debug",
        "info",
        "warning",
        "warn",
        "error",
        "exception",
        "critical",
        "fatal",
        "log",
        "warning_once",
        "info_once",
    }
)


def _is_print(call: ast.Call) -> bool:
    return isinstance(call.func, ast.Name) and call.func.id == "print"


def is_side_effect_call(call: ast.Call) -> bool:
    """print(...), warnings.warn(...), logger.<method>(...), logging.getLogger(...)."""
    if _is_print(call):
        return True
    if _receiver_is_logger_call(call):
        return True
    name = dotted_name(call.func)
    if name is None:
        return False
    leaf = name.rsplit(".", 1)[-1]
    if name in ("warnings.warn", "warn", "warnings.warn_explicit"):
        return True
    if leaf in ("getLogger", "get_logger"):
        return True
    if leaf not in LOG_METHODS or "." not in name:
        return False
    receiver = name.rsplit(".", 1)[0]
    last = receiver.rsplit(".", 1)[-1].lower()
    if last in ("torch", "math", "np", "numpy", "f", "functional"):
        return False  # torch.log, math.log: arithmetic, not logging
    return "log" in last or last == "warnings"


def _receiver_is_logger_call(call: ast.Call) -> bool:
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Call)
        and (dotted_name(func.value.func) or "").rsplit(".", 1)[-1] in ("getLogger", "get_logger")
        and func.attr in LOG_METHODS
    )


def _raises_only(body: list[ast.stmt]) -> bool:
    return bool(body) and all(isinstance(s, ast.Raise) for s in body)


def is_guard_if(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If):
        return False
    return _raises_only(node.body) or (bool(node.orelse) and _raises_only(node.orelse))


# --------------------------------------------------------------------------
# what a call or a store reaches (the state scan of rules/_state.py)

# Methods that change their receiver's state (containers, module registries).
MUTATING_METHODS = frozenset(
    {"register_buffer", "register_parameter", "update", "append", "extend", "insert", "pop", "clear",
     "setdefault", "add_module", "popitem", "remove"}
)


def root_of(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def self_attribute(node: ast.AST) -> str | None:
    """``self.<attr>`` or a slice of it (whose items are among its items);
    of a callee, ``self.x(...)`` or ``self.x[i](...)`` -> ``"x"``."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def reassigned_attribute(stmt: ast.stmt) -> str | None:
    """``attr`` of ``self.<attr> = <expression reading self.<attr>>`` (a
    cache refreshed from itself, category AS), else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
        return None
    attr = self_attribute(stmt.targets[0])
    if attr is None or isinstance(stmt.targets[0], ast.Subscript):
        return None
    reads = any(
        isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and self_attribute(n) == attr
        for n in ast.walk(stmt.value)
    )
    return attr if reads else None


def loop_attribute(loop: ast.For, name: str) -> str | None:
    """The ``self`` attribute whose items the loop binds to ``name``:
    ``for name in self.X``, ``for i, name in enumerate(self.X)``,
    ``for a, name in zip(self.X, self.Y)``."""
    target, source = loop.target, loop.iter
    if isinstance(target, ast.Name):
        return self_attribute(source) if target.id == name else None
    if not isinstance(target, ast.Tuple) or not isinstance(source, ast.Call) or not isinstance(source.func, ast.Name):
        return None
    names = [e.id if isinstance(e, ast.Name) else None for e in target.elts]
    if source.func.id == "enumerate" and len(names) == 2 and names[1] == name and len(source.args) == 1:
        return self_attribute(source.args[0])
    if source.func.id == "zip" and len(names) == len(source.args) and name in names:
        return self_attribute(source.args[names.index(name)])
    return None


def loop_attributes(scope: ast.AST, name: str) -> list[str] | None:
    """The ``self`` attributes whose items the loops in ``scope`` bind to
    ``name`` (``loop_attribute``), in source order: a call of ``name`` may reach
    an item of any of them (two loops may reuse ``layer``). None when no loop
    binds it that way, or ``scope`` also binds it otherwise (an assignment, a
    loop over something else, a comprehension, a parameter, ``with ... as``):
    what the call reaches is then not known from the loops."""
    attrs: list[str] = []
    by_loops: set[int] = set()  # the loops' own target names
    for loop in ast.walk(scope):
        attr = loop_attribute(loop, name) if isinstance(loop, ast.For) else None
        if attr is not None:
            attrs.append(attr)
            by_loops |= {id(n) for n in ast.walk(loop.target)}
    for node in ast.walk(scope) if attrs else ():
        if isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load) and id(node) not in by_loops:
            return None
        if isinstance(node, ast.arg) and node.arg == name:
            return None
        if isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name == name:
            return None
        if isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) == name:
            return None
        if isinstance(node, (ast.Global, ast.Nonlocal)) and name in node.names:
            return None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name and node is not scope:
            return None
    return attrs or None


def watched_effect(call: ast.Call, namespace: dict) -> bool:
    """A print to stdout / stderr, a ``warnings.warn``, or a call on a logger
    known now: while a region is open, the runtime performs the records made
    before it first (a set trap raises there, before the effect), as the
    original would have stopped at the check (runtime module doc)."""
    import logging
    import sys
    import warnings

    func = call.func
    if isinstance(func, ast.Name) and func.id == "print":
        if namespace.get("print", builtins.print) is not builtins.print:
            return False
        file = next((k.value for k in call.keywords if k.arg == "file"), None)
        if any(k.arg is None for k in call.keywords):
            return False
        return file is None or (
            isinstance(file, ast.Attribute) and file.attr in ("stdout", "stderr")
            and isinstance(file.value, ast.Name) and namespace.get(file.value.id) is sys
        )
    if isinstance(func, ast.Name):
        return namespace.get(func.id) in (warnings.warn, warnings.warn_explicit)
    if not isinstance(func, ast.Attribute):
        return False
    if isinstance(func.value, ast.Name):
        receiver = namespace.get(func.value.id)
        if receiver is warnings and func.attr in ("warn", "warn_explicit"):
            return True
        if receiver is logging and func.attr == "getLogger":
            return True  # not an effect
        return isinstance(receiver, logging.Logger) and func.attr in LOG_METHODS
    return False


def _is_self_training(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute) and node.attr == "training"
        and isinstance(node.value, ast.Name) and node.value.id == "self"
    )


def _never_in_eval(test: ast.AST) -> bool | None:
    """True: ``test`` is false whenever ``self.training`` is; False: true then; None: unknown."""
    if _is_self_training(test):
        return True
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and _is_self_training(test.operand):
        return False
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and any(_never_in_eval(v) is True for v in test.values):
        return True
    return None


def without_training_branches(node: ast.AST) -> ast.AST:
    """``node`` with the branches that only run in training mode removed (a
    speculating call runs only with every module in eval mode: runtime.call)."""
    if not any(isinstance(n, ast.If) and _never_in_eval(n.test) is not None for n in ast.walk(node)):
        return node

    class Prune(ast.NodeTransformer):
        def visit_If(self, branch: ast.If) -> Any:
            verdict = _never_in_eval(branch.test)
            self.generic_visit(branch)
            if verdict is True:
                return branch.orelse or ast.Pass()
            if verdict is False:
                return branch.body
            return branch

    return Prune().visit(copy.deepcopy(node))
