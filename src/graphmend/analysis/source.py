"""Reading Python source: parsed modules and the statement at a line.

Shared by break classification (which statement broke?) and by the rewrite
engine (which function holds it?). Parsed files are cached by path and
modification time.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import inspect
import linecache
import os
import sys
import textwrap
import types
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterator


@dataclass(frozen=True)
class ParsedFile:
    path: str
    text: str
    tree: ast.Module
    _defs: dict = field(default_factory=dict, compare=False, repr=False)  # (name, first line) -> def, filled once

    def definition(self, name: str, line: int) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        """The ``def`` named ``name`` whose first line (decorators included) is ``line``."""
        if not self._defs:
            for node in _defs_of(self.tree):
                self._defs.setdefault((node.name, first_line(node)), node)
            self._defs.setdefault(None, None)  # filled, even with no def
        return self._defs.get((name, line))


@lru_cache(maxsize=256)
def _parse(path: str, mtime: float) -> ParsedFile | None:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        text = raw.decode("utf-8")
        return ParsedFile(path, text, ast.parse(text, filename=path))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


# The files read since ``reading()`` began, with their text (the mend cache's key: cache.py).
_READ: list[dict[str, str]] = []


@contextlib.contextmanager
def reading() -> Iterator[dict[str, str]]:
    """Every file ``parse_file`` reads in the block: path -> the text read."""
    seen: dict[str, str] = {}
    _READ.append(seen)
    try:
        yield seen
    finally:
        _READ.remove(seen)


def parse_file(path: str) -> ParsedFile | None:
    """The parsed file, or None when it cannot be read or parsed."""
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return None
    parsed = _parse(path, mtime)
    for seen in _READ:
        seen.setdefault(path, parsed.text if parsed is not None else "")
    return parsed


def source_line(path: str, line: int) -> str:
    return linecache.getline(path, line).strip()


_COMPOUND_HEADERS = {
    ast.If: lambda n: n.test,
    ast.While: lambda n: n.test,
    ast.For: lambda n: n.iter,
    ast.AsyncFor: lambda n: n.iter,
    ast.With: lambda n: n.items[-1].context_expr,
    ast.AsyncWith: lambda n: n.items[-1].context_expr,
}


def statement_at(path: str, line: int) -> ast.stmt | None:
    """The innermost statement of the file that owns ``line``.

    For a compound statement (``if``, ``while``, ``for``, ``with``) a line in
    its header returns the compound statement itself; a line in its body
    descends into the body.
    """
    parsed = parse_file(path)
    if parsed is None:
        return None
    found = statement_in(parsed.tree.body, line)
    return None if found is None else found[0][found[1]]


def frame_statement(path: str, line: int) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef, list[ast.stmt], int] | None:
    """``(function, block, index)`` of the statement at ``line`` in the innermost
    function of the file that holds it (a caller's frame: the call it stands on)."""
    parsed = parse_file(path)
    defs = defs_containing(parsed.tree, line) if parsed is not None else []
    found = statement_in(defs[0].body, line, into_classes=False) if defs else None
    return None if found is None else (defs[0], *found)


def statement_in(body: list[ast.stmt], line: int, into_classes: bool = True) -> tuple[list[ast.stmt], int] | None:
    """``(block, index)`` of the innermost statement of ``body`` that owns
    ``line`` (a header line owns its compound statement, a decorator line its
    ``def``); ``into_classes=False`` stops at a class body (it runs once, at
    definition, so a site there is no statement of a function's)."""
    for i, node in enumerate(body):
        end = getattr(node, "end_lineno", node.lineno) or node.lineno
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        if not (start <= line <= end):
            continue
        header = _COMPOUND_HEADERS.get(type(node))
        if header is not None:
            head = header(node)
            if line <= (head.end_lineno or head.lineno):
                return body, i
        if isinstance(node, ast.ClassDef) and not into_classes:
            return None
        for field in ("body", "orelse", "finalbody"):
            children = getattr(node, field, None)
            if children:
                inner = statement_in(children, line, into_classes)
                if inner is not None:
                    return inner
        for handler in getattr(node, "handlers", None) or []:
            inner = statement_in(handler.body, line, into_classes)
            if inner is not None:
                return inner
        return body, i
    return None


def first_line(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The line a function's code object starts at (its first decorator, if any)."""
    return min([node.lineno] + [d.lineno for d in node.decorator_list])


# Functions graphmend rewrote: id(new code) -> the rewritten def (engine.install
# adds, Patch.uninstall removes), so that analyses of what a call runs read the
# code that runs, not the file's.
MENDED: dict[int, ast.FunctionDef | ast.AsyncFunctionDef] = {}


def definition_of(code: types.CodeType) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The ``def`` that compiled to ``code`` (the rewritten one for code
    graphmend installed), or None."""
    if id(code) in MENDED:
        return MENDED[id(code)]
    parsed = parse_file(code.co_filename)
    return parsed.definition(code.co_name, code.co_firstlineno) if parsed is not None else None


def source_tree(fn: object) -> ast.Module | None:
    """``fn``'s source as ``inspect`` finds it (its file's text, not a rewrite
    graphmend installed), dedented and parsed; None where there is none."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):
        return None


def module_namespace(path: str) -> dict:
    """The globals of the imported module whose file is ``path`` (empty if none)."""
    real = _real(path)
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and _real(file) == real:
            return vars(module)
    return {}


@lru_cache(maxsize=8192)
def _real(path: str) -> str:
    """``os.path.realpath``, once per path (it reads every folder on the way)."""
    return os.path.realpath(path)


def header_expr(node: ast.stmt) -> ast.AST:
    """The part of a statement evaluated before its body (all of a simple one)."""
    header = _COMPOUND_HEADERS.get(type(node))
    return header(node) if header is not None else node


def calls_in(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


# The names of the functions that answer "is the compiler tracing this?"
# (torch.compiler.is_compiling, torch.compiler.is_dynamo_compiling,
# torch._dynamo.is_compiling, transformers' is_torchdynamo_compiling).
COMPILER_CHECKS = ("is_compiling", "is_dynamo_compiling", "is_torchdynamo_compiling")


def compiler_checks(node: ast.AST) -> list[ast.Call]:
    """The argument-less calls in ``node`` named like a compiler check: by name
    only (what a name refers to is for a rule to prove)."""
    return [
        c for c in calls_in(node)
        if not c.args and not c.keywords and (dotted_name(c.func) or "").rsplit(".", 1)[-1] in COMPILER_CHECKS
    ]


def statements_of(fdef: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    """Every statement of ``fdef``'s body at any depth, in source order, not
    descending into nested function or class definitions."""
    out: list[ast.stmt] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                out.append(child)
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case)):
                visit(child)

    visit(fdef)
    return out


def dotted_name(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


# AST facts shared by rules, analysis and the engine

RUNTIME_NAME = "__graphmend_rt__"


EFFECTS = ("print_", "log", "warn")  # the runtime functions that record a deferred effect
STORES = ("store", "register_buffer")  # runtime functions that set a module attribute (or copy into its buffer)


def always_evaluated(node: ast.AST) -> Iterator[ast.AST]:
    """The parts of ``node`` evaluated whenever it is, children first: the first
    operand of and/or, an ``if`` expression's test; not a lambda's or a
    comprehension's body."""
    if isinstance(node, ast.BoolOp):
        yield from always_evaluated(node.values[0])
    elif isinstance(node, ast.IfExp):
        yield from always_evaluated(node.test)
    elif not isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        for child in ast.iter_child_nodes(node):
            yield from always_evaluated(child)
        yield node


def is_runtime_call(node: ast.AST, *names: str) -> bool:
    """``__graphmend_rt__.<name>(...)`` for one of ``names``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in names
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == RUNTIME_NAME
    )


def in_place_method(attr: str) -> bool:
    """Whether a tensor method of this name changes its receiver: ``add_``,
    ``copy_``, ``_coalesced_`` (a trailing underscore); not ``__setitem__``."""
    return attr.endswith("_") and not attr.endswith("__")


def in_place_argument(call: ast.Call) -> ast.AST | None:
    """The argument a call with ``inplace=True`` changes and returns (``F.relu(h, inplace=True)``)."""
    inplace = any(k.arg == "inplace" and not (isinstance(k.value, ast.Constant) and not k.value.value) for k in call.keywords)
    return call.args[0] if inplace and call.args else None


def bound_names(fdef: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Parameters and every name the function assigns (its locals)."""
    names = {a.arg for a in fdef.args.posonlyargs + fdef.args.args + fdef.args.kwonlyargs}
    if fdef.args.vararg:
        names.add(fdef.args.vararg.arg)
    if fdef.args.kwarg:
        names.add(fdef.args.kwarg.arg)
    declared_global: set[str] = set()
    for node in ast.walk(fdef):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fdef:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.Global):
            declared_global.update(node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names - declared_global


def defs_containing(tree: ast.AST, line: int) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Function definitions whose body holds ``line``, innermost first."""
    out = [n for n in _defs_of(tree) if n.lineno <= line <= (n.end_lineno or n.lineno)]
    return sorted(out, key=lambda n: n.lineno, reverse=True)


# id(tree) -> (tree, its defs): the tree is kept, so its id is not reused while the entry lasts.
_DEFS: "collections.OrderedDict[int, tuple[ast.AST, list]]" = collections.OrderedDict()


def _defs_of(tree: ast.AST) -> list:
    """Every function definition in ``tree``, walked once for the last 256 trees asked."""
    found = _DEFS.get(id(tree))
    if found is None or found[0] is not tree:
        found = (tree, [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))])
        _DEFS[id(tree)] = found
        _FILE_DEFS.update((id(d), d) for d in found[1])
        if len(_DEFS) > 256:
            for d in _DEFS.popitem(last=False)[1][1]:
                _FILE_DEFS.pop(id(d), None)
    return found[1]


_FILE_DEFS: dict[int, ast.AST] = {}  # id -> each def of the trees in _DEFS


def as_in_its_file(fdef: ast.AST) -> bool:
    """Whether ``fdef`` is a definition of a parsed file's tree, which nothing
    rewrites (rules rewrite copies): answers about it hold while it lives."""
    return _FILE_DEFS.get(id(fdef)) is fdef


def inside_try(fdef: ast.AST, stmt: ast.stmt) -> bool:
    """Whether ``stmt`` sits in the body of a ``try`` of ``fdef`` (a handler could catch what it raises)."""
    for node in ast.walk(fdef):
        if isinstance(node, ast.Try) and any(stmt is n for b in node.body for n in ast.walk(b)):
            return True
    return False
