"""AST building blocks the rules share: names to load and store, calls and
attributes, an assignment, ``self.<attr>`` tests, substitution of speculated
values, and placing new nodes at the original statement's line."""

from __future__ import annotations

import ast


def load_name(name: str) -> ast.Name:
    return ast.Name(id=name, ctx=ast.Load())


def store_name(name: str) -> ast.Name:
    return ast.Name(id=name, ctx=ast.Store())


def assign_to(target: ast.expr, value: ast.expr) -> ast.Assign:
    return ast.Assign(targets=[target], value=value, lineno=0)


def all_of(values: list[ast.expr]) -> ast.expr:
    """``a and b and ...``; one value alone (a BoolOp of one does not compile)."""
    return values[0] if len(values) == 1 else ast.BoolOp(op=ast.And(), values=values)


def is_self_attr(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _self_chain(node: ast.AST) -> bool:
    """``self.a``, ``self.a.b``, ...: attributes all the way down to ``self``."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "self"


class Substitute(ast.NodeTransformer):
    """Replace loads of names / self attributes already speculated into temporaries."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if isinstance(node.ctx, ast.Load) and node.id in self.env:
            return ast.copy_location(load_name(self.env[node.id]), node)
        return node

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        key = ast.unparse(node) if _self_chain(node) else None
        if key is not None and isinstance(node.ctx, ast.Load) and key in self.env:
            return ast.copy_location(load_name(self.env[key]), node)
        self.generic_visit(node)
        return node


def make_call(func: ast.expr, *args: ast.expr, **kw: ast.expr) -> ast.Call:
    return ast.Call(func=func, args=list(args), keywords=[ast.keyword(arg=k, value=v) for k, v in kw.items()])


def attr_of(value: ast.expr, attr: str) -> ast.Attribute:
    return ast.Attribute(value=value, attr=attr, ctx=ast.Load())


def place_at(nodes: list[ast.stmt], stmt: ast.stmt) -> list[ast.stmt]:
    """Every new node at the original statement's line (tracebacks, discovery)."""
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, (ast.expr, ast.stmt)):
                sub.lineno, sub.end_lineno = stmt.lineno, stmt.end_lineno
                sub.col_offset, sub.end_col_offset = stmt.col_offset, stmt.end_col_offset
    return nodes
