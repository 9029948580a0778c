"""What a module's source says about its names, without importing it.

* ``static_namespace``: the module's globals as far as the source proves
  them. ``import torch`` (and ``torch.*`` submodules, ``math``, ``warnings``,
  stdlib ``logging``) bind the real, already imported modules, so the shared
  analysis (``FunctionFacts``, the rules) sees ``torch`` exactly as it would
  on the live module. A module-level ``def`` binds a :class:`SourceFunction`
  that the [Trap] continuation scan can read the body of. A module-level
  ``logger = <...>.getLogger(...)`` / ``get_logger(...)`` binds a stand-in
  ``logging.Logger`` (transformers' ``logging.get_logger`` returns one), so
  [Defer] knows a logger call from any other method call. Every other name
  (classes, constants, anything imported from another package) binds
  :data:`UNKNOWN`, which nothing treats as proven.
* ``module_classes``: the ``nn.Module`` subclasses defined in the file.
* ``reachable_from_forward``: ``forward`` of those classes and the functions
  and methods of the same file it calls by name, transitively.
"""

from __future__ import annotations

import ast
import logging
import sys
from dataclasses import dataclass, field

import torch

from graphmend.analysis.source import dotted_name, first_line


class _Unknown:
    """A global the source binds to a value the linter cannot know."""

    def __repr__(self) -> str:
        return "<unknown>"


UNKNOWN = _Unknown()

#: Modules whose real object stands in for the imported name.
_REAL_MODULES = ("torch", "math", "warnings", "logging", "builtins")
#: Packages whose ``Module`` / ``Model`` / ``Layer`` classes are not torch modules.
_FOREIGN_PACKAGES = ("flax", "jax", "tensorflow", "tf_keras", "keras", "numpy", "mlx", "paddle")
#: Suffixes of a base class imported from elsewhere that mark an nn.Module
#: subclass (``PreTrainedModel``, ``GradientCheckpointingLayer``, ``nn.Module``).
_MODULE_SUFFIXES = ("Module", "Model", "Layer")

_STUB_CODE = compile("def _stub():\n    pass\n", "<graphmend check>", "exec").co_consts[0]


class SourceFunction:
    """A module-level function known from its source: enough of a function
    (``__code__`` pointing at its file and first line, ``__globals__``) for the
    [Trap] rule to find and scan its ``def``; never called."""

    def __init__(self, path: str, fdef: ast.FunctionDef | ast.AsyncFunctionDef, namespace: dict) -> None:
        self.__code__ = _STUB_CODE.replace(co_filename=path, co_name=fdef.name, co_firstlineno=first_line(fdef))
        self.__globals__ = namespace
        self.__name__ = self.__qualname__ = fdef.name


@dataclass
class ModuleScope:
    """The static facts of one parsed file."""

    path: str
    tree: ast.Module
    namespace: dict = field(default_factory=dict)
    imported_from: dict[str, str] = field(default_factory=dict)  # global name -> module it was imported from
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)

    @classmethod
    def of(cls, path: str, tree: ast.Module) -> "ModuleScope":
        scope = cls(path=path, tree=tree)
        scope.namespace["__name__"] = _module_name(path)
        for stmt in _module_level(tree.body):
            scope._bind(stmt)
        return scope

    def _bind(self, stmt: ast.stmt) -> None:
        ns = self.namespace
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                name = alias.asname or alias.name.split(".")[0]
                ns[name] = _real_module(alias.name if alias.asname else name)
                self.imported_from[name] = alias.name
        elif isinstance(stmt, ast.ImportFrom):
            module = "." * stmt.level + (stmt.module or "")
            for alias in stmt.names:
                if alias.name == "*":
                    continue
                name = alias.asname or alias.name
                ns[name] = _real_attr(module, alias.name) if stmt.level == 0 else UNKNOWN
                self.imported_from[name] = module
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.functions[stmt.name] = stmt
            ns[stmt.name] = SourceFunction(self.path, stmt, ns)
        elif isinstance(stmt, ast.ClassDef):
            self.classes[stmt.name] = stmt
            ns[stmt.name] = UNKNOWN
        else:
            for target in _assigned(stmt):
                ns[target] = UNKNOWN
                self.imported_from.pop(target, None)
            if _is_logger_assignment(stmt):
                name = stmt.targets[0].id  # type: ignore[attr-defined]
                ns[name] = logging.Logger(f"graphmend check stand-in for {name}")  # not registered anywhere

    def learn(self, namespace: dict) -> None:
        """Take the live value of each global the source left unknown (not the
        file's own functions and classes, nor ``__name__``)."""
        for name, value in namespace.items():
            if name in self.namespace and self.namespace[name] is UNKNOWN and name not in self.classes:
                self.namespace[name] = value

    def is_imported(self, name: str) -> bool:
        """A global imported from a module whose code the linter does not read."""
        return name in self.imported_from and self.namespace.get(name) is UNKNOWN


def _module_name(path: str) -> str:
    """Not the module's real name: sites a rule registers while the linter
    tries it must never match those of an imported module."""
    return f"<graphmend check {path}>"


def _is_logger_assignment(stmt: ast.stmt) -> bool:
    """``logger = logging.getLogger(...)`` / ``logging.get_logger(...)`` (transformers)."""
    return (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
        and isinstance(stmt.value, ast.Call)
        and (dotted_name(stmt.value.func) or "").rsplit(".", 1)[-1] in ("getLogger", "get_logger")
    )


def _module_level(body: list[ast.stmt]):
    """Module-level statements, through ``if`` / ``try`` / ``with`` blocks."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With)) or type(stmt).__name__ == "TryStar":
            for name in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(stmt, name, []) or [])
            for handler in getattr(stmt, "handlers", []) or []:
                yield from _module_level(handler.body)


def _assigned(stmt: ast.stmt) -> list[str]:
    targets: list[ast.AST] = []
    if isinstance(stmt, ast.Assign):
        targets = list(stmt.targets)
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        targets = [stmt.target]
    elif isinstance(stmt, (ast.For, ast.AsyncFor)):
        targets = [stmt.target]
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _real_module(name: str) -> object:
    if name.split(".")[0] not in _REAL_MODULES:
        return UNKNOWN
    return sys.modules.get(name, UNKNOWN)


def _real_attr(module: str, attr: str) -> object:
    if module.split(".")[0] not in _REAL_MODULES:
        return UNKNOWN
    owner = sys.modules.get(module)
    if owner is None:
        return UNKNOWN
    value = getattr(owner, attr, None)
    if value is None:
        value = sys.modules.get(f"{module}.{attr}")
    return UNKNOWN if value is None else value


# --------------------------------------------------------------------------
# nn.Module subclasses and what their forward reaches


def module_classes(scope: ModuleScope) -> dict[str, ast.ClassDef]:
    """The classes of the file that are ``nn.Module`` subclasses.

    A base counts when it resolves to a torch ``nn.Module`` subclass, is such
    a class of the same file, or is a name imported from another (non-JAX/TF)
    package ending in Module, Model or Layer (``PreTrainedModel``,
    ``GradientCheckpointingLayer``)."""
    verdict: dict[str, bool] = {}

    def is_module(name: str, seen: frozenset[str]) -> bool:
        if name in verdict:
            return verdict[name]
        if name in seen:
            return False
        cls = scope.classes[name]
        verdict[name] = any(_base_is_module(b, scope, lambda n: is_module(n, seen | {name})) for b in cls.bases)
        return verdict[name]

    return {name: cls for name, cls in scope.classes.items() if is_module(name, frozenset())}


def _base_is_module(base: ast.expr, scope: ModuleScope, in_file) -> bool:
    dotted = dotted_name(base)
    if dotted is None:
        return False
    root, _, rest = dotted.partition(".")
    if not rest and root in scope.classes:
        return in_file(root)
    value = scope.namespace.get(root, UNKNOWN)
    for attr in rest.split(".") if rest else []:
        value = getattr(value, attr, UNKNOWN)
    if value is not UNKNOWN:
        return isinstance(value, type) and issubclass(value, torch.nn.Module)
    source = scope.imported_from.get(root, "")
    if source.split(".")[0] in _FOREIGN_PACKAGES:
        return False
    return bool(source) and dotted.endswith(_MODULE_SUFFIXES)


def _methods(cls: ast.ClassDef, scope: ModuleScope, own: bool = True, seen: frozenset[str] = frozenset()) -> dict:
    """Methods of ``cls`` (unless ``own`` is false) and of its bases defined in
    the same file, the nearest definition of each name winning."""
    out: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    for base in cls.bases:
        name = dotted_name(base)
        if name in scope.classes and name not in seen:
            for key, fdef in _methods(scope.classes[name], scope, True, seen | {cls.name}).items():
                out.setdefault(key, fdef)
    if own:
        out.update({s.name: s for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))})
    return out


def reachable_from_forward(scope: ModuleScope, calls_of, nested_of, classes: set[str] | None = None) -> set[int]:
    """ids of the function nodes run by ``forward`` of the file's modules: the
    forwards, the methods they call as ``self.name(...)`` or
    ``super().name(...)``, module functions they call as ``name(...)``, and
    functions defined inside any of these. ``calls_of(fdef)`` / ``nested_of(fdef)``:
    the calls / the function definitions in a function's own body. ``classes``:
    only the modules of these names (all when None)."""
    reached: set[int] = set()
    for name, cls in module_classes(scope).items():
        if classes is not None and name not in classes:
            continue
        methods, inherited = _methods(cls, scope), _methods(cls, scope, own=False)
        forward = methods.get("forward")
        if forward is None:
            continue
        queue = [forward]
        while queue:
            fdef = queue.pop()
            if id(fdef) in reached:
                continue
            reached.add(id(fdef))
            queue.extend(nested_of(fdef))
            for call in calls_of(fdef):
                callee = _callee(call.func, methods, inherited, scope)
                if callee is not None:
                    queue.append(callee)
    return reached


def _callee(func: ast.expr, methods: dict, inherited: dict, scope: ModuleScope):
    if isinstance(func, ast.Name):
        return scope.functions.get(func.id)
    if isinstance(func, ast.Attribute):
        owner = func.value
        if isinstance(owner, ast.Name) and owner.id == "self":
            return methods.get(func.attr)
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            return inherited.get(func.attr)
    return None
