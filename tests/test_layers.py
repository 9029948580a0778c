"""The shape of the code (docs/design.md): layers whose imports only point
down, no private name used across packages, no import cycle, and a runtime
that mended code can import without loading the tool."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

PACKAGE = os.path.join(os.path.dirname(__file__), os.pardir, "src", "graphmend")

# Bottom first. A module may import from its own layer's package or from a
# layer below it; `graphmend/__init__.py` (lazy names) and `__main__.py`
# stand above them all.
LAYERS = (
    "runtime",
    "errors",
    "compat",
    "analysis",
    "rules",
    "models",
    "discover",
    "rewrite",
    "check",
    "passes",
    "pipeline",
    "cache",
    "api",
    "tools",
)
TOP = ("graphmend", "graphmend.__main__")
LINE_LIMIT = 600


def _modules() -> dict[str, str]:
    out = {}
    root = os.path.normpath(PACKAGE)
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
                out[dotted.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(module: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for every graphmend import, at any depth."""
    path = MODULES[module]
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                target = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    out.append((f"{target}.{alias.name}", "", node.lineno))
                elif target.startswith("graphmend"):
                    out.append((target, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("graphmend")]
    return out


def _layer(module: str) -> int:
    if module in TOP:
        return len(LAYERS)
    return LAYERS.index(module.split(".")[1])


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_every_module_is_in_a_layer():
    unplaced = [m for m in MODULES if m not in TOP and m.split(".")[1] not in LAYERS]
    assert unplaced == []


def test_imports_only_point_down():
    upward = [
        f"{m}:{line} imports {name or target}"
        for m in MODULES
        for target, name, line in _imports(m)
        if (target, name) != ("graphmend", "__version__")  # the package's one plain attribute
        if _package(target) != _package(m) and _layer(target) >= _layer(m)
    ]
    assert upward == []


def test_no_private_name_is_used_across_packages():
    private = [
        f"{m}:{line} imports {name} from {target}"
        for m in MODULES
        for target, name, line in _imports(m)
        if name.startswith("_") and not name.startswith("__") and _package(target) != _package(m)
    ]
    assert private == []


def test_no_import_cycle():
    graph = {m: {t for t, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    # graphmend/__init__ names the API lazily (no import statement), so it is no cycle
    assert cycles == []


def test_modules_stay_short_and_the_top_level_small():
    lengths = {m: sum(1 for _ in open(p, encoding="utf-8")) for m, p in MODULES.items()}
    too_long = {m: n for m, n in lengths.items() if n > LINE_LIMIT}
    assert too_long == {}
    top_level = [m for m, p in MODULES.items() if os.path.dirname(p) == os.path.normpath(PACKAGE)]
    assert len(top_level) <= 12, sorted(top_level)


@pytest.mark.parametrize(
    "statement", ["import graphmend.runtime", "import graphmend", "from graphmend import runtime"]
)
def test_the_runtime_loads_almost_nothing_of_graphmend(statement):
    code = f"import sys; {statement}; print(sorted(m for m in sys.modules if m.startswith('graphmend')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = ast.literal_eval(done.stdout.strip())
    assert len(loaded) <= 4, loaded
    assert all(m == "graphmend" or m.startswith("graphmend.runtime") for m in loaded), loaded


def test_the_lazy_api_gives_the_functions_not_the_modules_of_the_same_name():
    code = (
        "import graphmend, graphmend.pipeline, graphmend.discover.explain, types, sys; "
        "print(all(not isinstance(getattr(graphmend, n), types.ModuleType) for n in graphmend.__all__))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"
