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
from graphmend.tools.layout import Layout

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
    a: list[ast.stmt], b: list[ast.stmt], lines: list[str], edits: list[Edit], layout: Layout, comments: dict[int, str],
    elif_block: bool = False,
) -> None:
    """Append to ``edits`` what turns ``a`` (the original statements in ``lines``)
    into ``b``; new statements are written by ``layout`` (one per file and
    function: its lines, indentation step and quote are read once)."""
    matcher = difflib.SequenceMatcher(None, [_key(s) for s in a], [_key(s) for s in b], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if tag == "replace" and i2 - i1 == j2 - j1 and all(_descendable(a[i], b[j1 + i - i1]) for i in range(i1, i2)):
            for i in range(i1, i2):
                _descend(a[i], b[j1 + i - i1], lines, edits, layout, comments)
            continue
        if elif_block:
            raise Coarse("an elif clause changed")
        if tag == "insert":
            anchor = a[i1] if i1 < len(a) else a[-1]
            at = _start(anchor) if i1 < len(a) else anchor.end_lineno + 1
            edits.append(Edit(at, at - 1, layout.render(b[j1:j2], _indent_of(lines, anchor), _newline(lines, anchor))))
            continue
        for old, new in _per_statement(a[i1:i2], b[j1:j2]):
            edits.append(_replacement(old, new, lines, layout, comments))


def _per_statement(a: list[ast.stmt], b: list[ast.stmt]) -> list[tuple[list[ast.stmt], list[ast.stmt]]]:
    """A replaced run split statement by statement where each new statement stands
    at one of the old ones' positions (a rule's output keeps the line of what it
    replaced), in order; else the run whole. An edit per original statement keeps
    comments beside their statement, and lets ``--portable`` leave one out."""
    starts = {(s.lineno, s.col_offset): i for i, s in enumerate(a)}
    owner = [starts.get((getattr(s, "lineno", None), getattr(s, "col_offset", None))) for s in b]
    if None in owner or owner != sorted(owner) or (b and owner[0] != 0):
        return [(a, b)]
    return [(a[i : i + 1], [s for s, o in zip(b, owner) if o == i]) for i in range(len(a))]


def _replacement(a: list[ast.stmt], b: list[ast.stmt], lines: list[str], layout: Layout, comments: dict[int, str]) -> Edit:
    first, last = a[0], a[-1]
    start, end = _start(first), last.end_lineno or last.lineno
    check_alone(lines, first, last)
    indent = _indent_of(lines, first)
    newline = _newline(lines, first)
    written = layout.render(b, indent, newline)
    kept = [comments[n] for n in range(start, end + 1) if n in comments and not any(comments[n] in w for w in written)]
    if start == end and len(written) == 1 and kept:  # one line for one: its comment stays at its end
        code = lines[start - 1].rstrip("\r\n")
        gap = code[: len(code) - len(kept[0])]
        gap = gap[len(gap.rstrip()) :] or "  "
        return Edit(start, end, [written[0][: len(written[0]) - len(newline)] + gap + kept[0] + newline])
    return Edit(start, end, [indent + c + newline for c in kept] + written)


def _descendable(x: ast.stmt, y: ast.stmt) -> bool:
    if type(x) is not type(y) or not blocks(x) or _header(x) != _header(y):
        return False
    return all(bool(p) == bool(q) for p, q in zip(blocks(x), blocks(y)))


def _descend(x: ast.stmt, y: ast.stmt, lines: list[str], edits: list[Edit], layout: Layout, comments: dict[int, str]) -> None:
    for p, q in zip(blocks(x), blocks(y)):
        elif_block = (
            isinstance(x, ast.If) and p is x.orelse and len(p) == 1 and isinstance(p[0], ast.If)
            and lines[p[0].lineno - 1].lstrip().startswith("elif")
        )
        if p:
            diff_body(p, q, lines, edits, layout, comments, elif_block=elif_block)


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


def check_disjoint(edits: list[Edit]) -> None:
    ordered = sorted(edits, key=lambda e: (e.start, e.end))
    for x, y in zip(ordered, ordered[1:]):
        if y.start <= x.end:
            raise Decline("internal: two rewrites overlap in the file")


# --------------------------------------------------------------------------
# the file around the functions



def comments_of(text: str) -> dict[int, str]:
    found: dict[int, str] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text, newline="").readline):
            if tok.type == tokenize.COMMENT:
                found[tok.start[0]] = tok.string
    except (tokenize.TokenError, SyntaxError):
        pass
    return found
