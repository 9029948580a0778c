"""Which statements and calls are effects a rule cares about: print, logging
and warnings calls, and ``if`` statements that only raise (validation guards).

Read from source alone; break classification, the rules and ``graphmend
check`` share these facts."""

from __future__ import annotations

import ast

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
