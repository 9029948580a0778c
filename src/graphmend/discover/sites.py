"""From break events to break sites: where, what kind, and which rule.

A *site* is one source line in user or library code where the graph splits.
Several events can share a site: a logger call with tensor arguments makes
Dynamo trace into ``logging`` and break four more times, all under the same
user line, and a break inside a callee is logged again when that callee is
compiled as its own frame. Each site gets a **category** from the Dynamo
graph-break id, refined by the statement at the line, and a **verdict**: the
rule that addresses it, or why it is out of scope.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field

from graphmend.analysis.effects import (
    is_guard_if,
    is_side_effect_call,
    reassigned_attribute,
)
from graphmend.analysis.source import (
    calls_in,
    compiler_checks,
    defs_containing,
    dotted_name,
    header_expr,
    parse_file,
    source_line,
    statement_at,
    statements_of,
)
from graphmend.discover.trace import (
    BreakEvent,
    Frame,
    innermost_user_frame,
    is_library_internal,
)
from graphmend.rules import rule_for_category

CATEGORIES: dict[str, str] = {
    "DC": "data-dependent control flow",
    "LC": "logging / print / warnings",
    "VG": "validation guard (raise / assert on tensor values)",
    "TI": ".item() / .tolist() / scalar conversion",
    "DO": "data-dependent output shape",
    "AS": "attribute refreshed from itself (a cache kept on the input's device or dtype)",
    "CC": "a compiler check on the way to an exception only the compiled model raises",
    "DS": "dynamic shape",
    "UNSUP": "other unsupported call",
    "OTHER": "other",
}

OUT_OF_SCOPE: dict[str, str] = {
    "DS": "a dynamic-shape limitation of Dynamo, not a source pattern",
    "UNSUP": "a call Dynamo cannot trace; no rule rewrites it",
    "OTHER": "not a pattern any rule addresses",
}


# The graph-break ids classify reads, each with its type in the registry of
# every supported torch (torch/_dynamo/graph_break_registry.json: 455 ids in
# 2.12, 592 in 2.15; tests/test_compat.py checks them against the installed
# one). classify reads the type text of the installed registry too, so an id
# a later release renumbers still sorts by its type.
GRAPH_BREAK_IDS: dict[str, str] = {
    "GB0007": "Attempted to call function marked as skipped",
    "GB0033": "Data dependent operator",
    "GB0036": "Dynamic shape operator",
    "GB0055": "Failed to convert args/kwargs to proxy",
    "GB0059": "Failed to trace builtin operator",
    "GB0088": "Observed exception",
    "GB0109": "Tensor.tolist() with non-integer tensor",
    "GB0124": "Unsupported Tensor.item() call with capture_scalar_outputs=False",
    "GB0170": "Data-dependent branching",
    "GB0291": "logging.Logger method not supported for non-export cases",
}
_TI_IDS = {"GB0124", "GB0109"}
_DO_IDS = {"GB0036"}
_BRANCH_IDS = {"GB0170"}
# torch._assert on a tensor: GB0033, or GB0055 where its message formats a tensor (f"{h.min()}").
_ASSERT_IDS = {"GB0033", "GB0055"}


@dataclass
class BreakSite:
    """One place in source where the graph splits."""

    file: str
    line: int
    function: str
    code: str
    category: str
    reason: str  # Dynamo's gb_type
    gb_id: str | None
    rule: str | None  # "where" / "defer" / "trap", or None when out of scope
    verdict: str  # one line: what the rule will do, or why out of scope
    events: int = 1
    frames: list[Frame] = field(default_factory=list)  # entry -> site (the longest chain seen)
    detail: str = ""
    # Every distinct chain seen: a check reached from two callers has two
    # continuations after it, and [Trap] must check both (chains.py).
    paths: list[list[Frame]] = field(default_factory=list)
    # Why the rule declines the site, when explain offered it (pipeline.judge): "" when it accepts.
    declined: str = ""

    @property
    def path(self) -> str:
        return display_path(self.file)

    def to_dict(self) -> dict:
        return {
            "file": self.file,
            "path": self.path,
            "line": self.line,
            "function": self.function,
            "code": self.code,
            "category": self.category,
            "reason": self.reason,
            "gb_id": self.gb_id,
            "rule": self.rule,
            "verdict": self.verdict,
            "declined": self.declined,
            "events": self.events,
            "frames": [
                {"file": f.file, "line": f.line, "function": f.function, "code": f.code}
                for f in self.frames
            ],
        }


def display_path(path: str) -> str:
    """A short path: relative to site-packages for libraries, to cwd for user files."""
    norm = path.replace(os.sep, "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in norm:
            return norm.split(marker, 1)[1]
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def _detail_is_side_effect(event: BreakEvent) -> bool:
    detail = event.detail
    return (
        event.gb_id == "GB0291"
        or (event.gb_id == "GB0059" and "builtin operator `print`" in detail)
        or (event.gb_id == "GB0007" and "warnings.warn" in detail)
    )


def _names_torch_assert(call: ast.Call) -> bool:
    return (dotted_name(call.func) or "").endswith("_assert")


def classify(event: BreakEvent, stmt: ast.stmt | None) -> str:
    """The category of one event at its user statement."""
    gb = event.gb_id or ""
    gb_type = event.gb_type.lower()
    head = header_expr(stmt) if stmt is not None else None
    calls = calls_in(head) if head is not None else []
    side_effect = any(is_side_effect_call(c) for c in calls)

    if isinstance(stmt, ast.Assert) or (stmt is not None and is_guard_if(stmt)):
        return "VG"  # deciding whether to raise on tensor values, whatever Dynamo's id
    if stmt is not None and reassigned_attribute(stmt) is not None and gb not in _TI_IDS | _DO_IDS | {"GB0033"}:
        # `self.x = self.x.to(...)`: the store breaks, whatever Dynamo calls it (torch 2.12:
        # data-dependent branching inside nn.Module.__setattr__; 2.13: python_type())
        return "AS"
    if gb in _BRANCH_IDS or "data-dependent branching" in gb_type:
        return "DC"
    if any(_names_torch_assert(c) for c in calls) and gb in _ASSERT_IDS:
        return "VG"
    if side_effect:
        # A log/print call is the site even when the break is in its
        # arguments (f"{t.item()}") or inside logging itself.
        return "LC"
    if stmt is None and _detail_is_side_effect(event):
        return "LC"  # no source to read: trust Dynamo's own description
    if gb in _TI_IDS or "item()" in gb_type or "tolist" in gb_type:
        return "TI"
    if gb == "GB0033" or "data dependent operator" in gb_type:
        return "TI"
    if gb in _DO_IDS or "dynamic shape operator" in gb_type:
        return "DO"
    if "dynamic" in gb_type or "data-dependent expression" in gb_type or "symbolic" in gb_type:
        return "DS"
    if gb in ("GB0007", "GB0059") or "skipped" in gb_type or "unsupported" in gb_type:
        return "UNSUP"
    return "OTHER"


def verdict_for(category: str) -> tuple[str | None, str]:
    """The rule that claims ``category`` (the registry's), and what it would do."""
    rule = rule_for_category(category)
    if rule is not None:
        return rule.name, rule.verdict
    return None, "out of scope: " + OUT_OF_SCOPE.get(category, OUT_OF_SCOPE["OTHER"])


_PRIORITY = ["VG", "DC", "LC", "TI", "DO", "AS", "CC", "DS", "UNSUP", "OTHER"]


def _chain(event: BreakEvent, site: Frame) -> list[Frame]:
    frames = [f for f in event.frames if not is_library_internal(f.file)]
    out: list[Frame] = []
    for f in frames:
        out.append(f)
        if (f.file, f.line) == (site.file, site.line):
            break
    return out


def group_sites(events: list[BreakEvent]) -> list[BreakSite]:
    """One site per (file, line) of the innermost user frame, in first-seen order."""
    sites: dict[tuple[str, int], BreakSite] = {}
    cats: dict[tuple[str, int], set[str]] = {}
    for event in events:
        frame = innermost_user_frame(event)
        if frame is None:
            frame = Frame(event.file, event.line, "", "")
        key = (frame.file, frame.line)
        stmt = statement_at(frame.file, frame.line)
        category = classify(event, stmt)
        if key in sites:
            site = sites[key]
            site.events += 1
            cats[key].add(category)
            chain = _chain(event, frame)
            if len(chain) > len(site.frames):
                site.frames = chain
            if chain not in site.paths:
                site.paths.append(chain)
            continue
        code = frame.code or source_line(frame.file, frame.line)
        rule, verdict = verdict_for(category)
        sites[key] = BreakSite(
            file=frame.file,
            line=frame.line,
            function=frame.function,
            code=code,
            category=category,
            reason=event.gb_type,
            gb_id=event.gb_id,
            rule=rule,
            verdict=verdict,
            frames=_chain(event, frame),
            detail=event.detail,
            paths=[_chain(event, frame)],
        )
        cats[key] = {category}
    for key, site in sites.items():
        best = min(cats[key], key=_PRIORITY.index)
        if best != site.category:
            site.category = best
            site.rule, site.verdict = verdict_for(best)
    return list(sites.values())


ASSERT_REASON = "assert captured as torch._assert_async: a failure raises RuntimeError, not AssertionError"


def _is_torch_assert(stmt: ast.stmt | None) -> bool:
    """``torch._assert(test, msg)`` as a statement (captured from torch 2.15)."""
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and _names_torch_assert(stmt.value)


def assert_sites(asserts: list[tuple[str, int, str]], known: set[tuple[str, int]]) -> list[BreakSite]:
    """Sites for asserts Dynamo captured without a break (``assert``; a
    ``torch._assert`` call from torch 2.15): not a break, but the compiled
    model raises a different exception type, which [Trap] restores."""
    out: dict[tuple[str, int], BreakSite] = {}
    for file, line, function in asserts:
        key = (file, line)
        if key in known or key in out:
            continue
        stmt = statement_at(file, line)
        if not (isinstance(stmt, ast.Assert) or _is_torch_assert(stmt)):
            continue
        rule, verdict = verdict_for("VG")
        out[key] = BreakSite(
            file=file, line=stmt.lineno, function=function, code=source_line(file, stmt.lineno),
            category="VG", reason=ASSERT_REASON, gb_id=None, rule=rule, verdict=verdict, events=0,
            frames=[Frame(file, stmt.lineno, function, source_line(file, stmt.lineno))],
        )
    return list(out.values())


def _observed_exception(site: BreakSite) -> bool:
    """Dynamo met an exception no frame it traced catches (GB0088). The model ran
    eagerly without one first, so the compiled code took another path."""
    return site.gb_id == "GB0088" or site.reason.lower().startswith("observed exception")


def compiler_check_sites(sites: list[BreakSite]) -> list[BreakSite]:
    """Sites for the statements that ask whether the compiler is running
    (``is_compiling()``, by name) in the functions on the way to an exception
    only the compiled model raises: each frame of the chains to such a site.
    transformers 5's LongT5 skips building a default mask when
    ``is_torchdynamo_compiling()`` and then reads the mask it did not build."""
    out: dict[tuple[str, int], BreakSite] = {}
    known = {(s.file, s.line) for s in sites}
    rule, verdict = verdict_for("CC")
    for site in filter(_observed_exception, sites):
        for chain in site.paths or [site.frames]:
            for depth, frame in enumerate(chain):
                parsed = parse_file(frame.file)
                defs = defs_containing(parsed.tree, frame.line) if parsed is not None else []
                for stmt in statements_of(defs[0]) if defs else []:
                    key = (frame.file, stmt.lineno)
                    if key in known or key in out or not compiler_checks(header_expr(stmt)):
                        continue
                    code = source_line(frame.file, stmt.lineno)
                    out[key] = BreakSite(
                        file=frame.file, line=stmt.lineno, function=defs[0].name, code=code, category="CC",
                        reason=site.reason, gb_id=None, rule=rule, verdict=verdict, events=0,
                        frames=[*chain[:depth], Frame(frame.file, stmt.lineno, defs[0].name, code)],
                        detail=f"the compiled model raises at {site.path}:{site.line}: {site.code}",
                    )
    return list(out.values())
