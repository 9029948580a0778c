"""How code that ``graphmend fix`` writes spells what it needs, as a person would.

* **The runtime import**: ``from graphmend import runtime as gm``, once per
  file, after its leading imports (``graphmend_rt`` when the file already
  uses the name ``gm``; a file fixed before keeps the import it has).
* **Site keys**: each recording call's ``(module, line, function)`` names
  the module as ``__name__``, whatever name graphmend loaded it under, and
  its line is the line the call stands on in the written file.
* **Temporaries**: graphmend's ``_gm_c0``, ``_gm_t0``... become names a
  person would pick (``cond``, ``h_then``, ``h_else``), free in the file.
* **Quotes**: string constants in replaced lines use the quote the file
  uses most (``ast.unparse`` writes ``'...'``).
"""

from __future__ import annotations

import ast
import builtins
import copy
import io
import re
import textwrap
import tokenize

from graphmend.analysis.source import RUNTIME_NAME
from graphmend.rules import Decline

ALIASES = ("gm", "graphmend_rt")


def existing_alias(tree: ast.Module) -> str | None:
    """The name a file already imports the runtime as, if it does."""
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "graphmend.runtime" and a.asname:
                    return a.asname
        if isinstance(node, ast.ImportFrom) and node.module == "graphmend" and not node.level:
            for a in node.names:
                if a.name == "runtime":
                    return a.asname or "runtime"
    return None


def alias_for(tree: ast.Module) -> str:
    """The runtime's name in the written file: the one it imports already, else the first free alias."""
    found = existing_alias(tree)
    if found:
        return found
    used = names_in(tree)
    for alias in ALIASES:
        if alias not in used:
            return alias
    raise Decline(f"the module already uses the names {', '.join(ALIASES)}")


def names_in(tree: ast.AST) -> set[str]:
    used = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            used.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            used.add(n.name)
        elif isinstance(n, ast.alias):
            used.add(n.asname or n.name.split(".")[0])
        elif isinstance(n, ast.arg):
            used.add(n.arg)
    return used


def spelled(node: ast.AST, alias: str, module: str | None) -> ast.AST:
    """A copy with the runtime named ``alias`` and site keys naming ``module`` as ``__name__``."""
    node = copy.deepcopy(node)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == RUNTIME_NAME:
            sub.id = alias
    for call in site_calls(node, alias):
        key = call.args[0].elts  # type: ignore[attr-defined]
        if module is not None and isinstance(key[0], ast.Constant) and key[0].value == module:
            key[0] = ast.copy_location(ast.Name(id="__name__", ctx=ast.Load()), key[0])
    return node


_TEMPORARY = re.compile(r"_gm_([a-z][a-z_]*?)(\d+)$")
_SIDES = {"t": "then", "e": "elif", "f": "else"}  # a [Where] branch's value of a name: `h_then`
_STEMS = {"c": "cond", "ok": "guards_hold", "g": "gate"}  # others keep their stem: `hit`, `mask`, `key`


def readable_temporaries(node: ast.AST, taken: set[str]) -> ast.AST:
    """``node`` with each graphmend temporary renamed as a person would name it:
    a test ``cond``; a branch's value of ``h`` ``h_then`` / ``h_elif`` / ``h_else``
    (the name the value is assigned to); others by their stem. A name the file
    or builtins use already gets ``_2``, ``_3``..."""
    temps = list(dict.fromkeys(_name_of(n) for n in _in_order(node) if _TEMPORARY.match(_name_of(n))))
    used = taken | names_in(node) | set(dir(builtins))
    names: dict[str, str] = {}
    for temp in temps:
        stem = _TEMPORARY.match(temp).group(1)  # type: ignore[union-attr]
        base = f"{_assigned_from(node, temp)}_{_SIDES[stem]}" if stem in _SIDES else _STEMS.get(stem, stem)
        name, count = base, 1
        while name in used:
            count += 1
            name = f"{base}_{count}"
        used.add(name)
        names[temp] = name
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in names:
            sub.id = names[sub.id]
        elif isinstance(sub, ast.FunctionDef) and sub.name in names:  # torch.cond's branch functions
            sub.name = names[sub.name]
    return node


def _name_of(node: ast.AST) -> str:
    """The name a node reads, binds or defines (a function's), else ``""``."""
    return node.id if isinstance(node, ast.Name) else node.name if isinstance(node, ast.FunctionDef) else ""


def _in_order(node: ast.AST):
    """``node`` and what it holds, in the order of the source (``ast.walk`` goes breadth first)."""
    yield node
    for child in ast.iter_child_nodes(node):
        yield from _in_order(child)


def _assigned_from(node: ast.AST, temp: str) -> str:
    """The user's name a temporary's value is assigned to (``h = gm.select(c, _gm_t0, h)``: ``h``)."""
    for sub in _in_order(node):
        if isinstance(sub, ast.Assign) and len(sub.targets) == 1 and isinstance(sub.targets[0], ast.Name):
            target = sub.targets[0].id
            if not target.startswith("_gm_") and any(isinstance(n, ast.Name) and n.id == temp for n in ast.walk(sub.value)):
                return target
    return "value"


def uses(node: ast.AST, alias: str) -> bool:
    return any(isinstance(s, ast.Name) and s.id == alias for s in ast.walk(node))


def runtime_calls(lines: list[str], alias: str) -> list[str]:
    """The runtime functions ``lines`` call (``alias.<name>``), sorted."""
    text = textwrap.dedent("".join(lines))
    tokens = _tokens(text)
    if not tokens:  # not tokenizable alone: by the text itself (a call in a string counts too)
        return sorted(set(re.findall(rf"\b{re.escape(alias)}\.(\w+)", text)))
    found = set()
    for first, dot, name in zip(tokens, tokens[1:], tokens[2:]):
        if (first.type, first.string, dot.string, name.type) == (tokenize.NAME, alias, ".", tokenize.NAME):
            found.add(name.string)
    return sorted(found)


def import_line(alias: str) -> str:
    return "from graphmend import runtime" + ("" if alias == "runtime" else f" as {alias}")


def add_import(text: str, tree: ast.Module, alias: str) -> str:
    """The runtime's import after the file's leading imports (none when it has one)."""
    if existing_alias(tree) == alias:
        return text
    body = tree.body
    index = 0
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        index = 1  # the docstring
    after = None
    while index < len(body) and isinstance(body[index], (ast.Import, ast.ImportFrom)):
        after = body[index]
        index += 1
    lines = split_lines(text)
    if after is None and index == 0:
        at = 0
    else:
        anchor = after if after is not None else body[0]
        at = anchor.end_lineno or anchor.lineno
        tail = lines[at - 1].encode("utf-8")[anchor.end_col_offset or 0 :].strip()
        if tail and not tail.startswith(b"#"):
            raise Decline("the file's last leading import shares its line with another statement")
    newline = next((l[len(l.rstrip("\r\n")) :] for l in lines if l.endswith(("\n", "\r"))), "\n")
    if at and at == len(lines) and not lines[-1].endswith(("\n", "\r")):
        lines[-1] += newline
    lines[at:at] = [import_line(alias) + newline]
    return "".join(lines)


def site_calls(tree: ast.AST, alias: str) -> list[ast.Call]:
    """The runtime calls whose first argument is a site key ``(module, line, function)``
    (what records, traps and speculates)."""
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == alias
            and node.args
            and isinstance(node.args[0], ast.Tuple)
            and len(node.args[0].elts) == 3
            and isinstance(node.args[0].elts[1], ast.Constant)
            and type(node.args[0].elts[1].value) is int
            and isinstance(node.args[0].elts[2], ast.Constant)
            and type(node.args[0].elts[2].value) is str
        ):
            out.append(node)
    return out


def renumber_sites(text: str, alias: str) -> str:
    """Log records and warnings of a written site report the line the call now stands on."""
    tree = ast.parse(text)
    lines = split_lines(text)
    fixes: dict[int, list[tuple[int, int, str]]] = {}
    for call in site_calls(tree, alias):
        const = call.args[0].elts[1]  # type: ignore[attr-defined]
        if const.value != call.lineno:
            fixes.setdefault(const.lineno, []).append((const.col_offset, const.end_col_offset, str(call.lineno)))
    for number, spans in fixes.items():
        raw = lines[number - 1].encode("utf-8")
        for start, end, value in sorted(spans, reverse=True):
            raw = raw[:start] + value.encode() + raw[end:]
        lines[number - 1] = raw.decode("utf-8")
    return "".join(lines)


def normalised(node: ast.AST, alias: str) -> str:
    """``ast.dump`` with site lines left out (the written file renumbers them)."""
    node = copy.deepcopy(node)
    for call in site_calls(node, alias):
        call.args[0].elts[1].value = 0  # type: ignore[attr-defined]
    return ast.dump(node)


def quote_of(text: str) -> str:
    """The quote the file's one-line strings use most: ``"`` or ``'``."""
    counts = {'"': 0, "'": 0}
    for tok in _tokens(text):
        body = tok.string.lstrip("rbfuRBFU")
        if tok.type == tokenize.STRING and body[:3] not in ('"""', "'''") and body[:1] in counts:
            counts[body[0]] += 1
    return '"' if counts['"'] >= counts["'"] else "'"


def requote(lines: list[str], quote: str) -> list[str]:
    """``lines`` with each simple ``'...'`` string (no quote or backslash inside) in ``quote``."""
    if quote != '"':
        return lines
    text = "".join(lines)
    spans = []
    for tok in _tokens(text):
        prefix = tok.string[: len(tok.string) - len(tok.string.lstrip("rbfuRBFU"))]
        body = tok.string[len(prefix) :]
        inner = body[1:-1]
        if (
            tok.type == tokenize.STRING and tok.start[0] == tok.end[0] and body[:1] == "'" and body[:3] != "'''"
            and '"' not in inner and "'" not in inner and "\\" not in inner and "{" not in inner
        ):
            spans.append((tok.start, tok.end, prefix + '"' + inner + '"'))
    out = split_lines(text)
    for (row, start), (_, end), value in reversed(spans):
        line = out[row - 1]
        out[row - 1] = line[:start] + value + line[end:]
    return out


def split_lines(text: str) -> list[str]:
    """Lines with their own endings (\\n, \\r\\n or \\r), as Python counts them."""
    return io.StringIO(text, newline="").readlines()


def _tokens(text: str) -> list[tokenize.TokenInfo]:
    try:
        return list(tokenize.generate_tokens(io.StringIO(text, newline="").readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return []
