"""How ``graphmend fix`` lays out a statement it writes: in the user's own text
wherever the code is the user's.

A rewrite is built from the original's nodes (they keep their positions in
the file) and new ones. When writing it:

* a statement that is, node for node, the original statement at its position
  (the original branch kept as a guarded form's fallback, a statement inside
  a rewritten block) is written as the user wrote it: its lines, comments
  (also one after it on its last line) and formatting, re-indented;
* in a new statement, every expression that is the original's at its
  position (a log call's message split over three lines, ``1e4``, a string's
  quotes) keeps the user's text; the rest is ``ast.unparse``, its strings in
  the quote the file uses most;
* a line longer than 100 columns that is a call has its arguments one per
  line (an argument in the user's text keeps its lines).

Every statement written is parsed back and must be the rewrite node for node;
if not (an original text that meant something else where it now stands), it
is written by ``ast.unparse`` alone.
"""

from __future__ import annotations

import ast
import copy

from graphmend.tools.spelling import requote

WIDTH = 100  # a replacement line longer than this has its call's arguments one per line
_POSITIONS = ("lineno", "col_offset", "end_lineno", "end_col_offset")
# Expressions that never need parentheses where another expression stood: kept in
# the user's text as a whole (an operator's operands are kept one by one instead).
_ATOMS = (ast.Constant, ast.Call, ast.Attribute, ast.Subscript, ast.List, ast.Dict, ast.Set, ast.JoinedStr,
          ast.ListComp, ast.SetComp, ast.DictComp)


class Layout:
    """Writes statements for one file: ``lines`` its original text, ``unit`` its
    indentation step, ``quote`` the quote its strings use (``spelling.quote_of``)."""

    def __init__(self, lines: list[str], unit: str, quote: str = "'") -> None:
        self.raw = [line.rstrip("\r\n").encode("utf-8") for line in lines]
        self.unit = unit
        self.quote = quote

    def render(self, stmts: list[ast.stmt], indent: str, newline: str) -> list[str]:
        out: list[str] = []
        for stmt in stmts:
            lines = self.statement(stmt, len(indent))
            if not _means(lines, stmt):
                lines = Layout([], self.unit, self.quote).statement(stmt, len(indent))
            out.extend((indent + line if line.strip() else "") + newline for line in lines)
        return out

    # -- statements ------------------------------------------------------------

    def statement(self, stmt: ast.stmt, column: int) -> list[str]:
        """``stmt`` as lines relative to its own indentation."""
        kept = self._verbatim(stmt)
        if kept is not None:
            return kept
        if isinstance(stmt, ast.If):
            lines = [f"if {self.expression(stmt.test)}:"] + self._block(stmt.body, column)
            if len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If) and self._verbatim(stmt.orelse[0]) is None:
                lines += ["el" + line if i == 0 else line for i, line in enumerate(self.statement(stmt.orelse[0], column))]
            elif stmt.orelse:
                lines += ["else:"] + self._block(stmt.orelse, column)
            return lines
        text = self.expression(stmt)
        if "\n" in text or column + len(text) <= WIDTH:
            return text.split("\n")
        value = getattr(stmt, "value", None)
        if isinstance(stmt, (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return)) and isinstance(value, ast.Call):
            args = [self._argument(a) for a in value.args] + [
                [f"{k.arg}={self.expression(k.value)}" if k.arg else f"**{self.expression(k.value)}"] for k in value.keywords
            ]
            head = text[: len(text) - len(self.expression(value))] + self.expression(value.func) + "("
            if args and all("\n" not in line for arg in args for line in arg):
                return [head] + [self.unit + line for arg in args for line in _with_comma(arg)] + [")"]
        return [text]

    def _block(self, stmts: list[ast.stmt], column: int) -> list[str]:
        return [self.unit + line if line else line for stmt in stmts for line in self.statement(stmt, column + len(self.unit))]

    def _verbatim(self, stmt: ast.stmt) -> list[str] | None:
        """The statement's original lines (relative to its indentation) when they are it."""
        parts = self._segment(stmt)
        if parts is None:
            return None
        prefix = self.raw[stmt.lineno - 1][: stmt.col_offset].decode("utf-8")
        if prefix.strip():
            return None
        lines = [parts[0]] + [p[len(prefix) :] if p.startswith(prefix) else p for p in parts[1:]]
        if not _means(lines, stmt):
            return None
        rest = self.raw[stmt.end_lineno - 1][stmt.end_col_offset :].decode("utf-8", "replace")  # type: ignore[attr-defined]
        if rest.strip().startswith("#"):
            lines[-1] += rest  # its comment on the same line
        return lines

    # -- expressions -------------------------------------------------------------

    def expression(self, node: ast.AST) -> str:
        """``ast.unparse(node)`` with each one-line expression that is the original's in the user's text."""
        texts: list[str] = []
        layout = self

        class Keep(ast.NodeTransformer):
            def visit(self, sub: ast.AST) -> ast.AST:
                if sub is not node and isinstance(sub, _ATOMS):
                    parts = layout._segment(sub)
                    if parts is not None and len(parts) == 1 and _means_expression(parts, sub):
                        texts.append(parts[0])
                        return ast.copy_location(ast.Name(id=f"__gm_kept{len(texts) - 1}__", ctx=ast.Load()), sub)
                if isinstance(sub, ast.JoinedStr):
                    return sub
                return self.generic_visit(sub)

        text = "".join(requote([ast.unparse(Keep().visit(copy.deepcopy(node)))], self.quote))
        for index in range(len(texts) - 1, -1, -1):
            text = text.replace(f"__gm_kept{index}__", texts[index])
        return text

    def _argument(self, node: ast.expr) -> list[str]:
        """A call's argument as lines: the user's, continuation lines re-indented, when it is theirs."""
        parts = self._segment(node)
        if parts is not None and len(parts) > 1 and _means_expression(parts, node):
            moved = []
            for part in parts[1:]:
                spaces = len(part) - len(part.lstrip(" "))
                moved.append(" " * max(0, spaces - node.col_offset) + part.lstrip(" "))
            return [parts[0]] + moved
        if isinstance(node, ast.Tuple) and node.elts and any(len(self._argument(e)) > 1 for e in node.elts):
            # a new tuple of the user's arguments (a deferred call's): one per line, each in their text
            inner = [self.unit + line for e in node.elts for line in _with_comma(self._argument(e))]
            return ["("] + inner + [")"]
        return [self.expression(node)]

    def _segment(self, node: ast.AST) -> list[str] | None:
        """The original text at ``node``'s position, a string per line (the first from its column)."""
        if not self.raw or any(getattr(node, name, None) is None for name in _POSITIONS):
            return None
        first, last = node.lineno, node.end_lineno  # type: ignore[attr-defined]
        if not 1 <= first <= last <= len(self.raw):
            return None
        start, end = node.col_offset, node.end_col_offset  # type: ignore[attr-defined]
        try:
            if first == last:
                return [self.raw[first - 1][start:end].decode("utf-8")]
            return (
                [self.raw[first - 1][start:].decode("utf-8")]
                + [line.decode("utf-8") for line in self.raw[first : last - 1]]
                + [self.raw[last - 1][:end].decode("utf-8")]
            )
        except UnicodeDecodeError:
            return None


def _means(lines: list[str], stmt: ast.stmt) -> bool:
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return False
    return len(tree.body) == 1 and ast.dump(tree.body[0]) == ast.dump(stmt)


def _means_expression(parts: list[str], node: ast.expr) -> bool:
    try:
        parsed = ast.parse("(\n" + "\n".join(parts) + "\n)", mode="eval").body
    except SyntaxError:
        return False
    return ast.dump(parsed) == ast.dump(node)


def _with_comma(lines: list[str]) -> list[str]:
    return lines[:-1] + [lines[-1] + ","]
