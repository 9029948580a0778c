"""The rule registry.

A rule is a module in this package that defines one :class:`Rule` subclass
decorated with :func:`register`. It is handed one statement at a time (the
statement at a break site whose category it claims) and returns the
statements that replace it, or raises :class:`Decline` with a reason the user
will read. Rules never walk the tree or install code: the engine does that.
Adding a rule is adding a module; a rule not built yet is simply absent.

The registry is the one source of each rule's facts (the class attributes of
:class:`Rule`): the break categories it claims and what ``explain`` says of
them, whether it is on by default and in which order, its ``graphmend check``
codes, the runtime calls that record, the pipeline passes it brings. Rules
read source facts only (``graphmend.analysis``), so every layer above can ask
the registry.

Each rule module opens with its documentation in the same sections as
ruff's rule docs (what it rewrites, why the original breaks, example, when it
declines); ``graphmend rules`` prints it.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, ClassVar

from graphmend.analysis.memo import recall
from graphmend.analysis.source import RUNTIME_NAME, bound_names


class Decline(Exception):
    """A rule refuses a site; ``reason`` is shown to the user as is."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _attribute_values(modules: Any, attr: str) -> list[Any]:
    """Distinct values of ``<module>.<attr>`` over ``modules``."""
    values: list[Any] = []
    for module in modules:
        value = None
        for store in ("_modules", "_parameters", "_buffers"):
            value = module.__dict__.get(store, {}).get(attr)
            if value is not None:
                break
        if value is None:
            value = module.__dict__.get(attr, getattr(type(module), attr, None))
        if value is not None and not any(value is v for v in values):
            values.append(value)
    return values


@dataclass
class RewriteContext:
    """What a rule may know about the function it rewrites."""

    fdef: ast.FunctionDef | ast.AsyncFunctionDef
    globals: dict[str, Any]
    filename: str
    local_names: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)  # what the rule did, for the report
    model: Any = None  # the target, for facts only the live objects know
    memo_attrs: set[str] = field(default_factory=set)  # attributes a rewrite may now create early
    frames: list[Any] = field(default_factory=list)  # the break's frame chain (entry first)
    chains: list[Any] | None = None  # chains from the model's entry to the break ([]: unknown; None: no run, chains.py)
    unalias: set[str] = field(default_factory=set)  # buffers to give their own storage at install
    # What earlier sites of this pass replaced: id(new statement) -> (it, the statement it replaced)
    replaced: dict[int, tuple[ast.stmt, ast.stmt]] = field(default_factory=dict)
    replaced_by: dict[int, str] = field(default_factory=dict)  # id(new statement) -> the rule that wrote it
    # Statements the rewrite needs at the start of the function (a parameter's
    # value at entry, before the body rebinds it); the engine places them.
    entry: list[ast.stmt] = field(default_factory=list)
    entry_kept: list[ast.stmt] = field(default_factory=list)  # those of this pass's sites that applied

    def original_of(self, block: list[ast.stmt]) -> ast.stmt | None:
        """The one statement ``block`` is: itself, or the statement an earlier site's
        rewrite in this pass replaced with all of ``block``."""
        if len(block) == 1 and id(block[0]) not in self.replaced:
            return block[0]
        found = [self.replaced.get(id(node)) for node in block]
        if block and all(f is not None and f[0] is node for f, node in zip(found, block)):
            originals = {id(f[1]) for f in found if f is not None}
            if len(originals) == 1:
                return found[0][1]  # type: ignore[index]
        return None

    def attribute_values(self, attr: str, modules: Any = None) -> list[Any]:
        """Distinct values of ``<module>.<attr>`` over the live target's modules
        (or over ``modules``, a subset of them); once per round (analysis/memo.py)."""
        import torch

        if not isinstance(self.model, torch.nn.Module):
            return []
        if modules is None:
            model = self.model
            return recall(("attribute_values", id(model), attr), lambda: _attribute_values(model.modules(), attr), model)
        return _attribute_values(modules, attr)


    @classmethod
    def for_function(
        cls, fdef: ast.FunctionDef | ast.AsyncFunctionDef, namespace: dict, filename: str, model: Any = None
    ) -> "RewriteContext":
        return cls(fdef=fdef, globals=namespace, filename=filename, local_names=bound_names(fdef), model=model)

    def fresh(self, stem: str) -> str:
        """A local name no code of the function uses."""
        index = 0
        while f"_gm_{stem}{index}" in self.local_names:
            index += 1
        name = f"_gm_{stem}{index}"
        self.local_names.add(name)
        return name

    def at_entry(self, value: ast.expr, stem: str) -> str:
        """A name that holds ``value`` as evaluated at the function's start:
        the one an earlier rewrite placed for it, or a new one (``entry``)."""
        key = ast.dump(value)
        for stmt in [*self.fdef.body, *self.entry_kept, *self.entry]:
            if isinstance(stmt, ast.Assign) and ast.dump(stmt.value) == key:
                target = stmt.targets[0]
                if isinstance(target, ast.Name) and target.id.startswith(f"_gm_{stem}"):
                    return target.id
        name = self.fresh(stem)
        self.entry.append(ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=value))
        return name

    def torch(self, attr: str) -> ast.expr:
        """``torch.<attr>``, through the function's own ``torch`` when that name is
        the real torch module, else through the runtime's."""
        import torch as _torch

        if "torch" not in self.local_names and self.globals.get("torch") is _torch:
            base: ast.expr = ast.Name(id="torch", ctx=ast.Load())
        else:
            base = self.runtime("torch")
        return ast.Attribute(value=base, attr=attr, ctx=ast.Load())

    def runtime(self, attr: str) -> ast.expr:
        """``__graphmend_rt__.<attr>``, the runtime bound in the function's globals."""
        return ast.Attribute(value=ast.Name(id=RUNTIME_NAME, ctx=ast.Load()), attr=attr, ctx=ast.Load())

    def site(self, node: ast.AST) -> ast.expr:
        """``(module name, line, function)`` of a statement, as a constant tuple."""
        module = self.globals.get("__name__", "__main__")
        return ast.Tuple(
            elts=[ast.Constant(module), ast.Constant(node.lineno), ast.Constant(self.fdef.name)],
            ctx=ast.Load(),
        )

    def resolves_to(self, name: str, obj: Any) -> bool:
        """Whether bare ``name`` in this function is ``obj`` (not a local, not shadowed)."""
        if name in self.local_names:
            return False
        if name in self.globals:
            return self.globals[name] is obj
        return getattr(builtins, name, None) is obj

    def value_of(self, node: ast.expr) -> Any:
        """The object a ``Name`` / dotted ``Attribute`` chain of globals refers to, or None."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id in self.local_names:
            return None
        if node.id in self.globals:
            value = self.globals[node.id]
        elif hasattr(builtins, node.id):
            value = getattr(builtins, node.id)
        else:
            return None
        for attr in reversed(parts):
            try:
                value = getattr(value, attr)
            except Exception:
                return None
        return value


class Rule:
    """Base class: subclasses set ``name``, ``categories``, ``summary``."""

    # The rule's facts. Everything else reads them here: discovery's verdicts,
    # the default rule set, ``graphmend check``'s codes, reports, barriers.
    name: ClassVar[str] = ""
    categories: ClassVar[frozenset[str]] = frozenset()  # the break categories (discover.sites) it claims
    offered: ClassVar[str] = ""  # a rule not claiming a category: which sites it is offered, for listings
    summary: ClassVar[str] = ""  # one line, for listings
    verdict: ClassVar[str] = ""  # what `explain` says of a site of its categories
    default: ClassVar[bool] = True  # on unless the user's `rules=` leaves it out
    rank: ClassVar[int] = 0  # its place among the default rules (the order rounds try them)
    codes: ClassVar[dict[str, str]] = {}  # `graphmend check` codes it owns -> what each flags
    records: ClassVar[tuple[str, ...]] = ()  # runtime calls its rewrites make that record into a region
    passes: ClassVar[tuple[str, ...]] = ()  # pipeline passes it brings ("capture": measured capture flags;
    # "speculation": its own last round, once the other rewrites are installed)
    defers_output: ClassVar[bool] = False  # moves print/log/warn to the region's end: an assert failing
    # inside the graph would lose it (held asserts)
    defers_raise: ClassVar[bool] = False  # moves a raise to the call's end: a graph raising before it loses
    # its flag (no capture measured), and a wrapper's work after the module runs first (api)
    proof: ClassVar[str] = ""  # what `graphmend check` proves besides the rewrite (check.safety.PROOFS)
    style: ClassVar[str] = "yellow"  # its colour in reports

    @property
    def doc(self) -> str:
        import sys

        module = sys.modules[type(self).__module__]
        return (module.__doc__ or "").strip()

    def rewrite(self, stmt: ast.stmt, ctx: RewriteContext) -> list[ast.stmt]:
        raise NotImplementedError

    def ahead(self, fdef: ast.FunctionDef | ast.AsyncFunctionDef) -> list[int]:
        """Lines of statements this rule rewrites in a function of the model
        (one that breaks, or one ``graphmend check`` finds a site of this rule
        in) although no break was seen there on the example inputs (other
        inputs may reach them, in a frame Dynamo compiles). Each is offered to
        ``rewrite`` like a site; one that declines is left as it is and not
        reported."""
        return []


RULES: dict[str, Rule] = {}


def register(cls: type[Rule]) -> type[Rule]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    RULES[cls.name] = cls()
    return cls


_LOADED = False


def load_rules() -> dict[str, Rule]:
    """Import every rule module in this package (once) and return the registry.
    Every site's verdict and every report row asks it: the package is read once."""
    global _LOADED
    if not _LOADED:
        for info in pkgutil.iter_modules(__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{__name__}.{info.name}")
        _LOADED = True
    return RULES


def rule_for_category(category: str, enabled: tuple[str, ...] | None = None) -> Rule | None:
    for rule in load_rules().values():
        if category in rule.categories and (enabled is None or rule.name in enabled):
            return rule
    return None


def default_rules() -> tuple[str, ...]:
    """The rules on by default, in the order rounds try them."""
    rules = sorted((r for r in load_rules().values() if r.default), key=lambda r: r.rank)
    return tuple(r.name for r in rules)


def check_codes() -> dict[str, tuple[str, str]]:
    """``graphmend check`` code -> (its rule, what it flags), by code."""
    codes = {code: (r.name, what) for r in load_rules().values() for code, what in r.codes.items()}
    return dict(sorted(codes.items()))


def recording_calls() -> tuple[str, ...]:
    """The runtime calls that record into a region, over every rule."""
    return tuple(call for r in load_rules().values() for call in r.records)


def rule_with_pass(name: str) -> str | None:
    """The rule that brings pipeline pass ``name``, or None."""
    return next((r.name for r in load_rules().values() if name in r.passes), None)


def rules_that(fact: str) -> tuple[str, ...]:
    """The names of the rules whose ``fact`` (a :class:`Rule` attribute) is true, by rank."""
    return tuple(r.name for r in sorted(load_rules().values(), key=lambda r: r.rank) if getattr(r, fact))
