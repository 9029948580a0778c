"""Graph breaks kept before asserts that Dynamo compiles into the graph.

What it does
    When the mended model records anything (a print / log / warning that
    [Defer] deferred, a check that [Trap] turned into a flag), the test of
    each ``assert`` of the model's code that may be on tensor values and
    stays in the code goes through ``__graphmend_rt__.held(...)``: while
    Dynamo traces, a tensor test makes a graph break right before the assert
    (``runtime.barrier``, a ``torch.compiler.disable``-d no-op); a Python
    value makes none. Covered: the functions graphmend rewrote, and the
    ``forward`` of the model's module classes with the methods and
    module-level functions of their files that it calls, and the functions
    of the model's other files it calls through a global name
    (``model_lines``).

Why the mended code would lose behaviour without it
    Dynamo compiles ``assert <tensor>, "literal"`` into the graph
    (``torch._assert_async``; ``torch._assert(<tensor>, msg)`` too from torch
    2.15). When it fails, the graph raises before it
    returns, and Dynamo applies a graph's side effects (the records) only
    when the graph completes: the output deferred and the checks trapped
    earlier in that graph are lost, and the assert's error replaces the
    trapped exception. The records may come from another function traced
    into the same graph (the caller's print, a sibling submodule's trapped
    check: fuzzer seed 15). The break ends the graph before the assert, so
    the records made so far reach the region, which performs them (and
    raises a set trap) when the assert then fails.

Example
    ::

        class Guard(nn.Module):              # [Trap] declines: a state change follows
            def forward(self, h):
                assert (h.abs() <= 1e3).all(), "value out of range"
                self.calls += 1
                return h * 2

    in a model whose other code records, becomes::

            def forward(self, h):
                assert __graphmend_rt__.held((h.abs() <= 1e3).all()), "value out of range"
                self.calls += 1
                return h * 2

When it does not
    A model that records nothing needs no break. passes/held.py measures the
    breaks on the example inputs: when they leave more graphs than the
    mended program had without them, the record-making rewrites are reverted
    instead (then nothing is recorded). Asserts Dynamo cannot compile (a
    message that is not a constant, a test under ``not``) and asserts on
    shapes, sizes, dtypes and other values settled while tracing are left
    alone (asserts.py); so is an assert the model reaches another way (a
    callback, a method of an object from another file), unless graphmend
    rewrote that function.
"""

from __future__ import annotations

import ast
import inspect
import types
from typing import Any

import torch

from graphmend.analysis.asserts import (
    compiled_assert_calls,
    held_asserts,
    is_assert_call,
)
from graphmend.analysis.source import (
    RUNTIME_NAME,
    dotted_name,
    first_line,
    is_runtime_call,
    parse_file,
)
from graphmend.discover.sites import display_path
from graphmend.discover.trace import is_model_code
from graphmend.rewrite import engine
from graphmend.rules import recording_calls

RECORDS = recording_calls()  # the runtime calls that record into the region

def records(node: ast.AST) -> set[str]:
    """The record-making runtime calls in ``node`` (``print_``, ``log``, ``warn``, ``trap``)."""
    return {c.func.attr for c in ast.walk(node) if is_runtime_call(c, *RECORDS)}  # type: ignore[attr-defined]


def guards(node: ast.AST) -> bool:
    """Whether ``node`` keeps a graph break before an assert (``held``, ``barrier``)."""
    return any(is_runtime_call(c, "held", "barrier") for c in ast.walk(node))


def owners(located: engine.Located, model: Any) -> list[Any]:
    """The live modules whose class (or a base) runs the located function."""
    if not isinstance(model, torch.nn.Module):
        return []
    name = located.node.name
    return [
        m for m in model.modules() if any(base.__dict__.get(name) in located.functions for base in type(m).__mro__)
    ]


def test_of(node: ast.AST) -> ast.expr | None:
    """The tested value of a held assert: an ``assert``'s test, or the first
    argument of a ``torch._assert_async`` (or compiled ``torch._assert``) call."""
    if isinstance(node, ast.Assert):
        return node.test
    if isinstance(node, ast.Call) and node.args:
        return node.args[0]
    return None


def guarded(node: ast.AST) -> bool:
    """Whether the assert's test already goes through ``__graphmend_rt__.held``."""
    test = test_of(node)
    return test is not None and is_runtime_call(test, "held")


def wrap(held: list[ast.AST]) -> str:
    """Make the test of each held assert ``__graphmend_rt__.held(<test>)``
    (once): a graph break right before the assert, while tracing, when the
    test is a tensor; the asserts, for the report."""
    shown = describe(held)
    for node in held:
        test = test_of(node)
        if test is None or guarded(node):
            continue
        func = ast.Attribute(ast.Name(RUNTIME_NAME, ast.Load()), "held", ast.Load())
        call = ast.fix_missing_locations(ast.copy_location(ast.Call(func, [test], []), test))
        if isinstance(node, ast.Assert):
            node.test = call
        else:
            node.args[0] = call  # type: ignore[attr-defined]
    return shown


def settle(node: ast.AST, tensors: set[int]) -> list[ast.Assert]:
    """Each ``assert __graphmend_rt__.held(T), msg`` statement of ``node`` whose
    test was a tensor on the example inputs (its line in ``tensors``) becomes
    ``__graphmend_rt__.barrier()`` then ``assert T, msg``: the graph break
    before the test is computed, which at the start of a frame costs no graph
    (``held`` breaks after it). Correct for any test; the settled asserts."""
    settled: list[ast.Assert] = []
    for parent in ast.walk(node):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(parent, name, None)
            if not isinstance(block, list):
                continue
            for index in range(len(block) - 1, -1, -1):
                stmt = block[index]
                if isinstance(stmt, ast.Assert) and guarded(stmt) and stmt.test.lineno in tensors:
                    stmt.test = stmt.test.args[0]  # type: ignore[attr-defined]
                    call = ast.Call(ast.Attribute(ast.Name(RUNTIME_NAME, ast.Load()), "barrier", ast.Load()), [], [])
                    block.insert(index, ast.fix_missing_locations(ast.copy_location(ast.Expr(call), stmt)))
                    settled.append(stmt)
    return settled


def settle_model(mending: Any, probed: set[tuple[str, int]]) -> int:
    """``settle`` each installed function with a held test the eager run saw
    as a tensor (``probed``: (file, line) from ``runtime.HELD_PROBE``);
    how many asserts were settled."""
    count = 0
    for index, patch in enumerate(mending.patches):
        if patch.node is None:
            continue
        lines = {line for file, line in probed if file == patch.new_code.co_filename}
        if not lines:
            continue
        located = engine.locate(patch.located.filename, patch.node.lineno, mending.by_code())
        settled = settle(located.node, lines)
        if settled:
            mending.patches[index] = engine.install(located, engine.build(located, located.node), located.node)
            count += len(settled)
    return count


def describe(held: list[ast.AST]) -> str:
    """```assert ...`` (line N)``, for the first two."""
    shown = ", ".join(f"`{ast.unparse(h).splitlines()[0]}` (line {h.lineno})" for h in held[:2])
    return shown + (f" and {len(held) - 2} more" if len(held) > 2 else "")


def model_lines(model: Any, files: dict[str, tuple[dict, set[str]]]) -> list[tuple[str, int]]:
    """(file, def line) of each function of the model's code whose source has
    an assert that may be on tensor values, among what the ``forward`` of the
    classes in ``files`` (path -> module globals, class qualnames) may run:
    in those files (``_functions``), and the functions of other files of the
    model's code (not torch's, the standard library's or graphmend's) that
    they call through a global name (``helper(...)``, ``utils.check(...)``)."""
    queue: list[tuple[str, dict, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for path, (namespace, names) in sorted(files.items()):
        parsed = parse_file(path)
        if parsed is not None:
            queue += [(path, namespace, fdef) for fdef in _functions(parsed.tree, names)]
    found: list[tuple[str, int]] = []
    seen: set[tuple[str, int]] = set()
    while queue:
        path, namespace, fdef = queue.pop(0)
        if (path, fdef.lineno) in seen:
            continue
        seen.add((path, fdef.lineno))
        if _may_hold(fdef, namespace):
            found.append((path, fdef.lineno))
        for fn in _global_callees(fdef, namespace):
            definition = _definition(fn)
            if definition is not None:
                queue.append((fn.__code__.co_filename, fn.__globals__, definition))
    return found


def _global_callees(fdef: ast.AST, namespace: dict) -> list[types.FunctionType]:
    """The plain functions of the model's code that ``fdef`` calls through a
    global name or a dotted path from one (modules and classes on the way)."""
    out: list[types.FunctionType] = []
    for node in ast.walk(fdef):
        name = dotted_name(node.func) if isinstance(node, ast.Call) else None
        if not name or name.split(".")[0] not in namespace:
            continue
        root, *chain = name.split(".")
        value = namespace[root]
        for attr in chain:
            if not isinstance(value, (types.ModuleType, type)):
                value = None
                break
            value = inspect.getattr_static(value, attr, None)
        if isinstance(value, staticmethod):
            value = value.__func__
        if isinstance(value, types.FunctionType) and is_model_code(value.__code__.co_filename):
            out.append(value)
    return out


def _definition(fn: types.FunctionType) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    parsed = parse_file(fn.__code__.co_filename)
    if parsed is None:
        return None
    for node in ast.walk(parsed.tree):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name == fn.__code__.co_name
            and first_line(node) == fn.__code__.co_firstlineno
        ):
            return node
    return None


def _may_hold(fdef: ast.FunctionDef | ast.AsyncFunctionDef, namespace: dict) -> bool:
    """Whether ``fdef`` may hold an assert on tensor values (``self.<attr>``
    values not known yet: the live modules are looked at later)."""
    calls = compiled_assert_calls()
    return any(isinstance(n, ast.Assert) or is_assert_call(n, calls) for n in ast.walk(fdef)) and bool(
        held_asserts(fdef, [], namespace)
    )


def _functions(tree: ast.Module, classes: set[str]) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """What the ``forward`` of ``classes`` (qualnames) in ``tree`` may run: the
    forwards, the methods of those classes they call (``<obj>.name(...)``)
    and the module-level functions they call by name, through each other."""
    methods: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and prefix and prefix[:-1] in classes:
                methods.setdefault(stmt.name, []).append(stmt)
            elif isinstance(stmt, ast.ClassDef):
                walk(stmt.body, f"{prefix}{stmt.name}.")

    walk(tree.body, "")
    helpers = {s.name: [s] for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found = list(methods.get("forward", []))
    todo, taken = list(found), {id(f) for f in found}
    while todo:
        for node in ast.walk(todo.pop()):
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Name):
                callees = helpers.get(node.func.id, [])
            elif isinstance(node.func, ast.Attribute):
                callees = methods.get(node.func.attr, [])
            else:
                continue
            for callee in callees:
                if id(callee) not in taken:
                    taken.add(id(callee))
                    found.append(callee)
                    todo.append(callee)
    return found


def guard_model(
    model: Any,
    mending: Any,
    groups: dict[int, list[tuple[str, int]]],
    files: dict[str, tuple[dict, set[str]]],
) -> tuple[list[str], list[str]]:
    """When an installed rewrite records, send the test of each held assert of
    the model's code through ``runtime.held`` (see the module doc) and install
    it. Returns a line per function changed and per function that could not
    be (its asserts stay unguarded), for the report."""
    changed: list[str] = []
    failed: list[str] = []
    if not any(records(p.node) for p in mending.patches if p.node is not None):
        return changed, failed
    lines = [
        (p.located.filename, p.node.lineno)
        for p in mending.patches
        if p.node is not None and _may_hold(p.node, p.located.namespace)
    ]
    seen: set[int] = set()
    for file, line in lines + model_lines(model, files):
        try:
            located = engine.locate(file, line, mending.by_code())
        except Exception:  # no live function holds it (or a locate bug): not run by the model
            continue
        if id(located.code) in seen:
            continue
        seen.add(id(located.code))
        todo = [h for h in held_asserts(located.node, owners(located, model), located.namespace) if not guarded(h)]
        if not todo:
            continue
        shown = f"{wrap(todo)} (in {display_path(file)}, {located.qualname})"
        try:
            patch = engine.install(located, engine.build(located, located.node), located.node)
        except Exception as exc:  # a build or install bug: the function is left as it is
            failed.append(f"{shown}: {type(exc).__name__}: {exc}")
            continue
        if located.previous is not None:
            mending.patches[mending.patches.index(located.previous)] = patch
        else:
            mending.patches.append(patch)
            groups[len(mending.patches) - 1] = []
        changed.append(shown)
    return changed, failed
