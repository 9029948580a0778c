"""Whether a check cannot fail first when its function is called from a
given line: the caller made the same check on the same values just before
the call (XLM's ``forward`` asserts ``lengths.max().item() <= slen`` and then
calls ``get_masks(slen, lengths, ...)``, which asserts it again).

On such a call the callee's check fails only where the caller's failed
before it, and the caller's check, as written or as [Trap] rewrote it
(proven for all the code after it), decides what happens. So [Trap] need not
scan that caller's code after the call for the callee's check.

Shown only in a narrow form, the one the source spells out: both checks are
``assert`` statements; the caller's is in the same block as the call, with
nothing between them; the call statement passes the test's values as plain
names and evaluates nothing that could run code before the call (names,
constants, attribute loads); the callee's test reads only its parameters,
which it never rebinds, and the callee's statements before the check call
only pure torch functions and tensor methods.
"""

from __future__ import annotations

import ast
import copy
from typing import Any

from graphmend.analysis.facts import PURE_TENSOR_METHODS, PURE_TORCH_FUNCTIONS, path_to
from graphmend.analysis.source import frame_statement


def implied_by_caller(check: ast.stmt, callee: ast.FunctionDef | ast.AsyncFunctionDef, namespace: dict, frame: Any) -> bool:
    """Whether ``check`` (an assert of ``callee``) cannot fail first when
    ``callee`` is called from ``frame`` (a caller's file and line)."""
    if not isinstance(check, ast.Assert):
        return False
    params = [a.arg for a in callee.args.posonlyargs + callee.args.args + callee.args.kwonlyargs]
    names = {n.id for n in ast.walk(check.test) if isinstance(n, ast.Name)}
    if not names or not names <= set(params) or _rebinds(callee, names) or not _pure_before(callee, check, namespace):
        return False
    found = frame_statement(frame.file, frame.line)
    if found is None or found[2] == 0:
        return False
    _, block, index = found
    calls = [c for c in ast.walk(block[index]) if isinstance(c, ast.Call)]
    if len(calls) != 1 or not (isinstance(calls[0].func, ast.Name) and calls[0].func.id == callee.name):
        return False
    call = calls[0]
    if any(not _inert(a) for a in [*call.args, *(k.value for k in call.keywords)]):
        return False
    passed = dict(zip(params, call.args)) | {k.arg: k.value for k in call.keywords if k.arg is not None}
    if any(not isinstance(passed.get(n), ast.Name) for n in names):
        return False
    expected = _Renamed({n: passed[n].id for n in names}).visit(copy.deepcopy(check.test))  # type: ignore[union-attr]
    before = block[index - 1]
    return isinstance(before, ast.Assert) and ast.dump(before.test) == ast.dump(expected)


def _inert(node: ast.expr) -> bool:
    """Evaluating it runs no code: a name, a constant, an attribute of one."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, (ast.Name, ast.Constant))


def _rebinds(fdef: ast.AST, names: set[str]) -> bool:
    for node in ast.walk(fdef):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)) and node.id in names:
            return True
        if isinstance(node, (ast.Global, ast.Nonlocal)) and set(node.names) & names:
            return True
    return False


def _pure_before(fdef: ast.FunctionDef | ast.AsyncFunctionDef, check: ast.stmt, namespace: dict) -> bool:
    """The statements that run before ``check`` call only pure torch functions
    and tensor methods (nothing can change the test's values in place)."""
    import torch

    path = path_to(fdef.body, check)
    if path is None:
        return False
    before: list[ast.AST] = []
    for block, index in path:
        before += block[:index]
        if block[index] is not check:
            before.append(getattr(block[index], "test", ast.Pass()))  # an enclosing if's test (a loop: refused below)
            if not isinstance(block[index], ast.If):
                return False
    for node in (n for stmt in before for n in ast.walk(stmt)):
        if isinstance(node, ast.Call):
            func = node.func
            if not isinstance(func, ast.Attribute):
                return False
            if isinstance(func.value, ast.Name) and namespace.get(func.value.id) is torch:
                if func.attr not in PURE_TORCH_FUNCTIONS:
                    return False
            elif func.attr not in PURE_TENSOR_METHODS:
                return False
    return True


class _Renamed(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Name(id=self.names.get(node.id, node.id), ctx=node.ctx)
