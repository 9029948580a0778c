"""Editing a source file statement by statement: the smallest edits that turn
a function's original body into its rewritten one, keeping everything else
(comments, blank lines, formatting) as the user wrote it. ``graphmend fix``
uses them to write its changes."""

from __future__ import annotations

import ast
import copy
import difflib
import io
import tokenize
from dataclasses import dataclass

from graphmend.rules import Decline

_BODY_FIELDS = ("body", "orelse", "finalbody")


class Coarse(Exception):
    """This block cannot be edited alone; the caller replaces the enclosing statement."""


@dataclass
class Edit:
    start: int  # first line replaced (1-based); for an insertion, the line it goes before
    end: int  # last line replaced; start - 1 for an insertion
    text: list[str]  # the new lines, with line endings


def _key(node: ast.AST) -> str:
    return ast.dump(node)


def _header(node: ast.stmt) -> str:
    """The statement with its bodies emptied: equal headers can be descended into."""
    shell = copy.copy(node)
    for name in _BODY_FIELDS:
        if hasattr(shell, name):
            setattr(shell, name, [])
    if hasattr(shell, "handlers"):
        shell.handlers = [_header(h) for h in node.handlers]  # type: ignore[attr-defined]
    return ast.dump(shell) if not isinstance(shell, str) else shell


def blocks(node: ast.AST) -> list[list[ast.stmt]]:
    found = [getattr(node, name) for name in _BODY_FIELDS if hasattr(node, name)]
    found += [h.body for h in getattr(node, "handlers", []) or []]
    return found


def diff_body(
    a: list[ast.stmt], b: list[ast.stmt], lines: list[str], edits: list[Edit], unit: str, comments: dict[int, str],
    elif_block: bool = False,
) -> None:
    matcher = difflib.SequenceMatcher(None, [_key(s) for s in a], [_key(s) for s in b], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if tag == "replace" and i2 - i1 == j2 - j1 and all(_descendable(a[i], b[j1 + i - i1]) for i in range(i1, i2)):
            for i in range(i1, i2):
                _descend(a[i], b[j1 + i - i1], lines, edits, unit, comments)
            continue
        if elif_block:
            raise Coarse("an elif clause changed")
        if tag == "insert":
            anchor = a[i1] if i1 < len(a) else a[-1]
            at = _start(anchor) if i1 < len(a) else anchor.end_lineno + 1
            edits.append(Edit(at, at - 1, _render(b[j1:j2], _indent_of(lines, anchor), unit, _newline(lines, anchor))))
            continue
        first, last = a[i1], a[i2 - 1]
        start, end = _start(first), last.end_lineno or last.lineno
        check_alone(lines, first, last)
        kept = [comments[n] for n in range(start, end + 1) if n in comments]
        indent = _indent_of(lines, first)
        newline = _newline(lines, first)
        text = [indent + c + newline for c in kept] + _render(b[j1:j2], indent, unit, newline)
        edits.append(Edit(start, end, text))


def _descendable(x: ast.stmt, y: ast.stmt) -> bool:
    if type(x) is not type(y) or not blocks(x) or _header(x) != _header(y):
        return False
    return all(bool(p) == bool(q) for p, q in zip(blocks(x), blocks(y)))


def _descend(x: ast.stmt, y: ast.stmt, lines: list[str], edits: list[Edit], unit: str, comments: dict[int, str]) -> None:
    for p, q in zip(blocks(x), blocks(y)):
        elif_block = (
            isinstance(x, ast.If) and p is x.orelse and len(p) == 1 and isinstance(p[0], ast.If)
            and lines[p[0].lineno - 1].lstrip().startswith("elif")
        )
        if p:
            diff_body(p, q, lines, edits, unit, comments, elif_block=elif_block)


def _start(node: ast.stmt) -> int:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return min([node.lineno] + [d.lineno for d in node.decorator_list])
    return node.lineno


def check_alone(lines: list[str], first: ast.stmt, last: ast.stmt) -> None:
    """The statements own their lines: nothing but indentation before, a comment after."""
    head = lines[_start(first) - 1].encode("utf-8")[: first.col_offset]
    tail = lines[(last.end_lineno or last.lineno) - 1].encode("utf-8")[last.end_col_offset or 0 :]
    if head.strip() or (tail.strip() and not tail.strip().startswith(b"#")):
        raise Coarse("a rewritten statement shares its line with another statement")


def _indent_of(lines: list[str], node: ast.stmt) -> str:
    line = lines[_start(node) - 1]
    return line[: len(line) - len(line.lstrip(" \t"))]


def _newline(lines: list[str], node: ast.stmt) -> str:
    line = lines[_start(node) - 1]
    stripped = line.rstrip("\r\n")
    return line[len(stripped) :] or "\n"


def indent_unit(lines: list[str], fdef: ast.AST) -> str:
    """The file's indentation step, read from the function: tab or N spaces."""
    outer = _indent_of(lines, fdef)  # type: ignore[arg-type]
    inner = _indent_of(lines, fdef.body[0])  # type: ignore[attr-defined]
    step = inner[len(outer) :] if inner.startswith(outer) else ""
    return step or "    "


_WIDTH = 100  # a replacement line longer than this has its call's arguments one per line


def _render(stmts: list[ast.stmt], indent: str, unit: str, newline: str) -> list[str]:
    out: list[str] = []
    for stmt in stmts:
        out.extend(indent + line + newline for line in _stmt_lines(stmt, unit, len(indent)))
    return out


def _stmt_lines(stmt: ast.stmt, unit: str, column: int) -> list[str]:
    """``stmt`` as source lines relative to its own indentation; long calls wrapped."""
    if isinstance(stmt, ast.If):
        lines = [f"if {ast.unparse(stmt.test)}:"] + _block(stmt.body, unit, column)
        if len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If):
            lines += ["el" + line if i == 0 else line for i, line in enumerate(_stmt_lines(stmt.orelse[0], unit, column))]
        elif stmt.orelse:
            lines += ["else:"] + _block(stmt.orelse, unit, column)
        return lines
    text = ast.unparse(stmt)
    if "\n" in text or column + len(text) <= _WIDTH:
        return text.split("\n")
    value = getattr(stmt, "value", None)
    if isinstance(stmt, (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return)) and isinstance(value, ast.Call):
        args = [ast.unparse(a) for a in value.args] + [
            f"{k.arg}={ast.unparse(k.value)}" if k.arg else f"**{ast.unparse(k.value)}" for k in value.keywords
        ]
        head = text[: len(text) - len(ast.unparse(value))] + ast.unparse(value.func) + "("
        if args and all("\n" not in a for a in args):
            return [head] + [unit + a + "," for a in args] + [")"]
    return [text]


def _block(stmts: list[ast.stmt], unit: str, column: int) -> list[str]:
    return [unit + line for stmt in stmts for line in _stmt_lines(stmt, unit, column + len(unit))]


def check_disjoint(edits: list[Edit]) -> None:
    ordered = sorted(edits, key=lambda e: (e.start, e.end))
    for x, y in zip(ordered, ordered[1:]):
        if y.start <= x.end:
            raise Decline("internal: two rewrites overlap in the file")


# --------------------------------------------------------------------------
# the file around the functions


def split_lines(text: str) -> list[str]:
    """Lines with their own endings (\\n, \\r\\n or \\r), as Python counts them."""
    return io.StringIO(text, newline="").readlines()


def comments_of(text: str) -> dict[int, str]:
    found: dict[int, str] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text, newline="").readline):
            if tok.type == tokenize.COMMENT:
                found[tok.start[0]] = tok.string
    except (tokenize.TokenError, SyntaxError):
        pass
    return found
