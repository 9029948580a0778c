"""Mending: explain, rewrite the functions that hold fixable sites, verify, repeat.

The pipeline, top to bottom (``mend_target``)::

    observe original (eager)          -> the behaviour to keep
    explain                           -> sites with categories
    for each round (a fixpoint, at most ``max_rounds``):
        sites a rule claims, not tried yet
        locate -> rewrite -> build -> install, per function; a rule may
            rewrite ahead there and in the model's other functions
            (Rule.ahead: [defer] takes every print / log / warning)
        explain again                 -> breaks that remain, or were hidden
    with [scalar] enabled, measure capture once on the mended code (capture.py):
        scalar / dynamic-output capture kept only if it helps; [scalar]
        rewrites reverted if the result is still worse than the original
    with a flag kept, more rounds traced with it (not [trap]): a frame
        Dynamo skipped before can compile now and show breaks it hid
    with anything recorded ([defer], [trap]): a graph break before each
        assert of the model's code that Dynamo compiles into the graph, or
        the record-making rewrites reverted where that leaves fewer graphs
        (barriers.py; ``report.kept`` says which)
    verify: observe mended (eager, inside a region) and compare
        on a difference: revert, then keep only the functions that verify alone
    never worse: while the mended program has more graphs, recompiles or
        abandoned frames than the original, take back the patch (or the
        capture flags) whose removal helps most, measured (``_never_worse``)

Every site ends with one outcome: ``applied``, ``declined`` (with the
rule's reason), ``reverted`` (verification found a difference, or the
program got worse with it; shown), or
``out of scope`` (no rule addresses its category). A site that capture
removes is ``applied`` by [scalar] with the flag named; the kept flags are
``report.capture`` and ``report.region()`` applies them around a call.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import inspect
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from graphmend import runtime
from graphmend.analysis import source
from graphmend.analysis.asserts import held_asserts
from graphmend.analysis.source import (
    EFFECTS,
    RUNTIME_NAME,
    is_runtime_call,
    statement_in,
)
from graphmend.check.find import find_in_source
from graphmend.discover.capture import Capture, Trial, decide, removed_sites
from graphmend.discover.chains import complete_all, entry_keys
from graphmend.discover.explain import ExplainReport, explain_target, report_from_trace
from graphmend.discover.isolation import random_state_kept
from graphmend.discover.sites import BreakSite, display_path
from graphmend.discover.trace import is_model_code, trace_breaks
from graphmend.errors import EagerFailure, describe
from graphmend.models.targets import Target, private_copy
from graphmend.passes import barriers
from graphmend.rewrite import engine
from graphmend.rewrite.verify import Observation, compare, observe
from graphmend.rules import Decline, Rule, default_rules, load_rules, rule_with_pass

DEFAULT_RULES = default_rules()
CAPTURE_RULE = rule_with_pass("capture")  # the rule whose mechanism includes measured capture


@dataclass
class SiteOutcome:
    file: str
    line: int
    function: str
    code: str
    category: str
    rule: str | None
    status: str  # applied | declined | reverted (a difference, or the program got worse) | out of scope
    reason: str
    notes: list[str] = field(default_factory=list)

    @property
    def path(self) -> str:
        return display_path(self.file)

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "path": self.path,
            "line": self.line,
            "function": self.function,
            "code": self.code,
            "category": self.category,
            "rule": self.rule,
            "status": self.status,
            "reason": self.reason,
            "notes": list(self.notes),
        }


@dataclass
class MendReport:
    target: str
    before: ExplainReport
    after: ExplainReport
    outcomes: list[SiteOutcome]
    rounds: int
    verified: bool | None  # None: verification off
    differences: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rules: tuple[str, ...] = DEFAULT_RULES
    capture: Capture = field(default_factory=Capture)
    kept: list[str] = field(default_factory=list)  # graph breaks kept before asserts, or why not (barriers.py)
    grad: bool = False  # the autograd mode the graphs were measured in

    @contextlib.contextmanager
    def region(self) -> Any:
        """What ``graphmend.compile`` opens around every call: the deferral
        region and the capture flags the mending was measured with (inside
        the region, whose lock keeps other threads' calls from them)."""
        with runtime.region(), self.capture.context():
            yield

    @property
    def speculates(self) -> bool:
        """Whether a [Speculate] site is applied: calls go through ``call``."""
        return any(o.rule == "speculate" and o.status == "applied" for o in self.outcomes)

    def call(self, fn: Any, model: Any, args: tuple, kwargs: dict) -> Any:
        """One call of compiled ``fn`` (of ``model``) as ``graphmend.compile``
        makes it: in ``region()``; with [Speculate] sites applied and every
        module in eval mode, as a speculating call (``runtime.call``)."""
        if self.speculates and _may_run_twice(model):
            # Held through the capture flags, which are process-wide, as region() holds them.
            with runtime.exclusive(), self.capture.context():
                return runtime.call(fn, *args, **kwargs)
        with self.region():
            return fn(*args, **kwargs)

    @property
    def applied(self) -> list[SiteOutcome]:
        return [o for o in self.outcomes if o.status == "applied"]

    @property
    def declined(self) -> list[SiteOutcome]:
        return [o for o in self.outcomes if o.status != "applied"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": 1,
            "target": self.target,
            "rules": list(self.rules),
            "grad": self.grad,
            "graphs_before": self.before.graphs,
            "graphs_after": self.after.graphs,
            "breaks_before": self.before.breaks,
            "breaks_after": self.after.breaks,
            "rounds": self.rounds,
            "verified": self.verified,
            "differences": list(self.differences),
            "seconds": round(self.seconds, 3),
            "sites": [o.to_dict() for o in self.outcomes],
            "capture": self.capture.to_dict(),
            "kept": list(self.kept),
            "before": self.before.to_dict(),
            "after": self.after.to_dict(),
        }


class Mending:
    """The patches installed for one target; ``undo`` restores every original."""

    def __init__(self) -> None:
        self.patches: list[engine.Patch] = []
        self.memo_attrs: set[str] = set()  # attributes rewrites may create early (not state differences)
        self.target: Target | None = None  # what was mended, with its example inputs
        self.report: MendReport | None = None  # set by the API that made it
        self.groups: dict[int, list[tuple[str, int]]] = {}  # patch index -> the sites it applies

    @contextlib.contextmanager
    def original_code(self) -> Any:
        """The original code of every patched function, for the block."""
        codes = [(fn, fn.__code__) for p in self.patches for fn in p.located.functions]
        for patch in self.patches:
            for fn in patch.located.functions:
                fn.__code__ = patch.original_code
        torch._dynamo.reset()
        try:
            yield
        finally:
            for fn, code in codes:
                fn.__code__ = code
            torch._dynamo.reset()

    def by_code(self) -> dict[int, engine.Patch]:
        return {id(p.new_code): p for p in self.patches}

    def undo(self) -> None:
        for patch in reversed(self.patches):
            patch.uninstall()
        self.patches.clear()
        torch._dynamo.reset()

    def __enter__(self) -> "Mending":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()


def _key(site: BreakSite) -> tuple[str, int]:
    return (site.file, site.line)


def _outcome(site: BreakSite, status: str, reason: str, rule: str | None, notes: Iterable[str] = ()) -> SiteOutcome:
    return SiteOutcome(
        file=site.file,
        line=site.line,
        function=site.function,
        code=site.code,
        category=site.category,
        rule=rule,
        status=status,
        reason=reason,
        notes=list(notes),
    )


def _apply_round(
    model: Any,
    sites: list[BreakSite],
    enabled: tuple[str, ...],
    outcomes: dict[tuple[str, int], SiteOutcome],
    mending: Mending,
    groups: dict[int, list[tuple[str, int]]],
    observed: list[tuple[Any, ...]] = (),
    only: str | None = None,
) -> int:
    """Rewrite the functions holding ``sites``; returns how many sites were applied.

    ``observed``: every frame chain seen so far, to complete the chains of
    breaks reported from a frame compiled on its own (chains.py). ``only``:
    offer every site to that rule instead of the one its category names."""
    rules = load_rules()
    entries = entry_keys(model)
    by_function: dict[int, tuple[engine.Located, list[tuple[BreakSite, engine.SiteRewrite]]]] = {}

    def rule_of(site: BreakSite) -> str | None:
        return only or site.rule

    for site in sites:
        rule = rules.get(rule_of(site) or "")
        if rule is None or rule.name not in enabled:
            reason = (
                site.verdict if site.rule is None else f"rule {site.rule!r} is not enabled or not built yet"
            )
            outcomes[_key(site)] = _outcome(site, "out of scope" if site.rule is None else "declined", reason, site.rule)
            continue
        try:
            located = engine.locate(site.file, site.line, mending.by_code())
        except Decline as exc:
            outcomes[_key(site)] = _outcome(site, "declined", exc.reason, rule_of(site))
            continue
        except Exception as exc:  # never fail the user's model for an internal error
            outcomes[_key(site)] = _outcome(site, "declined", f"internal error locating the function: {exc}", rule_of(site))
            continue
        entry = by_function.setdefault(id(located.code), (located, []))
        chains = complete_all(site.paths or [site.frames], observed, entries)
        entry[1].append((site, engine.SiteRewrite(line=site.line, rule=rule, frames=list(site.frames), chains=chains)))
    if only is None:  # the model's functions that showed no break: only what rules rewrite ahead
        for file, line in _model_statements(model, rules, enabled):
            try:
                located = engine.locate(file, line, mending.by_code())
            except Exception:  # Decline or internal: nothing was seen there, nothing to report
                continue
            if located.previous is None:  # a function already rewritten had its turn
                by_function.setdefault(id(located.code), (located, []))
    applied = 0
    for located, pairs in by_function.values():
        node, pairs = _rewrite_function(located, pairs, rules, enabled, outcomes, model, only)
        ok = [(s, r) for s, r in pairs if r.ok]
        for site, rw in pairs:
            if not rw.ok:
                outcomes[_key(site)] = _outcome(site, "declined", rw.reason, rule_of(site))
        if not ok:
            continue
        try:
            code = engine.build(located, node)
            patch = engine.install(located, code, node)
        except Decline as exc:
            for site, _ in ok:
                outcomes[_key(site)] = _outcome(site, "declined", exc.reason, rule_of(site))
            continue
        except Exception as exc:
            for site, _ in ok:
                outcomes[_key(site)] = _outcome(
                    site, "declined", f"internal error building the rewrite: {type(exc).__name__}: {exc}",
                    rule_of(site),
                )
            continue
        if located.previous is not None:  # a later round on the same function
            index = mending.patches.index(located.previous)
            mending.patches[index] = patch
            groups[index] = groups.get(index, []) + [_key(s) for s, _ in ok]
        else:
            mending.patches.append(patch)
            groups[len(mending.patches) - 1] = [_key(s) for s, _ in ok]
        unaliased = engine.unalias_buffers(model, set().union(*(rw.unalias for _, rw in ok)))
        for site, rw in ok:
            mending.memo_attrs |= rw.memo_attrs
            if unaliased:
                rw.notes.append(f"gave buffer(s) {', '.join(unaliased)} their own storage (values unchanged)")
            outcomes[_key(site)] = _outcome(
                site, "applied", "; ".join(rw.notes) or f"rewritten by [{rule_of(site)}]", rule_of(site),
                rw.notes,
            )
            applied += 1
    torch._dynamo.reset()
    return applied


def _rewrite_function(
    located: engine.Located,
    pairs: list[tuple[BreakSite, engine.SiteRewrite]],
    rules: dict[str, Rule],
    enabled: tuple[str, ...],
    outcomes: dict[tuple[str, int], SiteOutcome],
    model: Any,
    only: Any,
) -> tuple[Any, list[tuple[BreakSite, engine.SiteRewrite]]]:
    """Apply the rules to one function: its sites, then what they rewrite ahead.

    Deferred effects are recorded by the graph and performed after it returns.
    An ``assert`` that may be on tensor values and stays in the function (no
    [Trap] rewrite) compiles into the graph (``torch._assert_async``); when it
    fails, the graph raises before returning, and the output recorded in it is
    lost. A graph break (``runtime.barrier()``) goes before each such assert,
    so the records made so far reach the region first, when that leaves fewer
    breaks than the effects would (a tie goes to the breaks when a warning is
    among them); otherwise, or where one cannot be placed (the assert call
    sits inside an expression), the function is rewritten again without
    [Defer]."""

    def rewrite(pairs: list[tuple[BreakSite, engine.SiteRewrite]], enabled: tuple[str, ...]) -> tuple[Any, list]:
        node = engine.rewrite(located, [r for _, r in pairs], model)
        if only is None:  # then what the rules rewrite ahead in the function
            more = _ahead_sites(located, pairs, rules, enabled, outcomes)
            node = engine.rewrite(located, [r for _, r in more], model)
            # One that declined stays as it was, unreported: no break was seen there.
            pairs = pairs + [(s, r) for s, r in more if r.ok]
            for site, rw in more:
                rw.notes.append(site.verdict)
        return node, pairs

    pristine = copy.deepcopy(located.node)
    node, done = rewrite(pairs, enabled)
    deferred = [r for _, r in done if r.ok and r.rule.name == "defer"]
    held = held_asserts(node, barriers.owners(located, model), located.namespace) if deferred else []
    if not held:
        return node, done
    effects = [c.func.attr for c in ast.walk(node) if is_runtime_call(c, *EFFECTS)]
    # A break per assert, or one per effect left in place: the fewer. On a tie a warning tips it to
    # the breaks: one left in a frame Dynamo compiled can report another line (docs/torch-issues.md).
    needed = sum(1 for h in held if not barriers.guarded(h))
    barrier = needed < len(effects) or (needed == len(effects) and "warn" in effects)
    if barrier:
        placed = barriers.wrap(held)
        for rw in deferred:
            rw.notes.append(
                f"a graph break is kept before {placed}: an assert that may be on tensor values fails inside "
                "the graph, which would lose the output recorded before it"
            )
        return node, done
    first = held[0]
    reason = (
        f"`{ast.unparse(first).splitlines()[0]}` (line {first.lineno}) stays an assert that may be on tensor values, "
        "which Dynamo compiles into the graph: when it fails, the graph raises before the output recorded in it "
        "is performed; a graph break before it would save no graph"
    )
    located.node = pristine
    kept = []
    for site, rw in pairs:
        if rw.rule.name == "defer":
            rw.ok, rw.reason, rw.notes = False, reason, []
        else:
            rw.ok, rw.reason, rw.notes, rw.memo_attrs, rw.unalias = False, "", [], set(), set()
            kept.append((site, rw))
    node, done = rewrite(kept, tuple(name for name in enabled if name != "defer"))
    return node, done + [(s, r) for s, r in pairs if r.rule.name == "defer"]


def _ahead_sites(
    located: engine.Located,
    pairs: list[tuple[BreakSite, engine.SiteRewrite]],
    rules: dict[str, Rule],
    enabled: tuple[str, ...],
    outcomes: dict[tuple[str, int], SiteOutcome],
) -> list[tuple[BreakSite, engine.SiteRewrite]]:
    """Sites for the statements enabled rules rewrite ahead in a function of
    the model (``Rule.ahead``): no break was seen at them on the example inputs."""
    taken = {site.line for site, _ in pairs}
    if pairs:
        why = f"the function breaks (line {', '.join(str(line) for line in sorted(taken))})"
    else:
        why = "the model's code (a `forward` or a helper it calls) breaks the graph wherever an input reaches it"
    made: list[tuple[BreakSite, engine.SiteRewrite]] = []
    for rule in rules.values():
        if rule.name not in enabled:
            continue
        for line in rule.ahead(located.node):
            if line in taken or (located.filename, line) in outcomes:
                continue
            taken.add(line)
            found = statement_in(located.node.body, line, into_classes=False)
            code = ast.unparse(found[0][found[1]]).splitlines()[0] if found else ""
            site = BreakSite(
                file=located.filename, line=line, function=located.node.name, code=code,
                category=min(rule.categories, default=""), reason="", gb_id=None, rule=rule.name,
                verdict=f"no break seen here on the example inputs; rewritten ahead because {why}",
            )
            made.append((site, engine.SiteRewrite(line=line, rule=rule)))
    return made


def _model_statements(model: Any, rules: dict[str, Rule], enabled: tuple[str, ...]) -> list[tuple[str, int]]:
    """(file, line) of each statement ``graphmend check`` finds for a rule that
    rewrites ahead, in the source files of the model's own module classes
    (torch's and graphmend's excluded): ``forward`` and the helpers it calls."""
    ahead = {name for name, rule in rules.items() if name in enabled and type(rule).ahead is not Rule.ahead}
    if not ahead:
        return []
    found: list[tuple[str, int]] = []
    for path, (namespace, classes) in sorted(_model_files(model).items()):
        try:
            with open(path, "rb") as fh:
                findings = find_in_source(path, fh.read(), opt_in=False, namespace=namespace, classes=classes)
        except Exception:  # unreadable, or a finder bug: that file gets no ahead rewrites
            continue
        found += [(path, f.line) for f in findings if f.rule in ahead]
    return found


def _model_files(model: Any, bases: bool = False) -> dict[str, tuple[dict, set[str]]]:
    """The source files of the model's own module classes (torch's and
    graphmend's excluded): path -> the module's globals, the qualnames of the
    model's classes there (with ``bases``, also of their base classes)."""
    files: dict[str, tuple[dict, set[str]]] = {}
    if not isinstance(model, torch.nn.Module):
        return files
    for module in model.modules():
        for cls in type(module).__mro__ if bases else (type(module),):
            try:
                path = inspect.getsourcefile(cls)
            except (TypeError, OSError):
                continue
            owner = sys.modules.get(cls.__module__)
            if path and owner is not None and is_model_code(path):
                files.setdefault(path, (vars(owner), set()))[1].add(cls.__qualname__)
    return files


def _verify(target: Target, baseline: Observation, grad: bool, memo_attrs: set[str] = frozenset()) -> list[str]:
    mended = observe(target.model, target.args, target.kwargs, in_region=True, grad=grad)
    return compare(baseline, mended, memo_attrs=memo_attrs)


def mend_target(
    target: Target,
    *,
    rules: tuple[str, ...] = DEFAULT_RULES,
    verify: bool = True,
    max_rounds: int = 3,
    grad: bool = False,
    mending: Mending | None = None,
) -> tuple[MendReport, Mending]:
    """Mend ``target`` in memory. Returns the report and the undo handle.
    If anything fails midway, every function already rewritten is restored."""
    mending = mending or Mending()
    try:
        with random_state_kept():  # mending runs the model: the user's generators stay where they are
            return _mend_target(target, rules=rules, verify=verify, max_rounds=max_rounds, grad=grad, mending=mending)
    except BaseException:
        mending.undo()
        raise


def _mend_target(
    target: Target,
    *,
    rules: tuple[str, ...],
    verify: bool,
    max_rounds: int,
    grad: bool,
    mending: Mending,
) -> tuple[MendReport, Mending]:
    start = time.perf_counter()
    baseline = observe(target.model, target.args, target.kwargs, in_region=False, grad=grad) if verify else None
    if baseline is not None and baseline.exception is not None:
        kind, message = baseline.exception
        first = (message.strip().splitlines() or [""])[0]
        raise EagerFailure(f"{target.name}: the model fails in eager mode: {kind}: {first}".rstrip(": "))
    before = explain_target(target, grad=grad)
    outcomes: dict[tuple[str, int], SiteOutcome] = {}
    groups: dict[int, list[tuple[str, int]]] = {}
    observed: list[tuple[Any, ...]] = []  # frame chains of every break seen (chains.py)
    # Rounds trace without capture: a source rewrite beats a captured host read.
    current, rounds = _rounds(target, before, rules, outcomes, mending, groups, observed, grad, max_rounds)
    # Then, once, capture for what is left (capture.py), measured on the mended code.
    capture_on = CAPTURE_RULE in rules
    plain, (current, capture) = current, _with_capture(target, grad, current, capture_on, outcomes)
    worse = (
        f"with this rewrite and no capture setting that helps, the program got worse (graphs {before.graphs} -> "
        f"{current.graphs}, recompiles {before.recompiles} -> {current.recompiles})"
    )
    if _worse(current, before) and _revert_rules(mending, groups, outcomes, {CAPTURE_RULE}, worse):
        plain = _retrace(target, grad)
        current, capture = _with_capture(target, grad, plain, capture_on, outcomes)
    if capture.flags:
        # A frame Dynamo skipped before (a break in a loop) can compile now and
        # show breaks it hid: mend those too, traced with the kept flags. Not
        # [Trap]: a captured conversion that raises in the flag's graph would
        # lose the check's exception (_with_capture).
        later = tuple(r for r in rules if r != "trap")
        current, more = _rounds(target, current, later, outcomes, mending, groups, observed, grad, max_rounds, capture.flags)
        rounds += more
    if SPECULATE_RULE in rules:
        current = _speculation_round(target, current, outcomes, mending, groups, observed, grad, capture.flags)
    current, kept = _guard_held_asserts(target, grad, current, capture.flags, mending, groups, outcomes)
    if kept and capture.flags:
        plain = _retrace(target, grad)
    elif kept:
        plain = current
    differences: list[str] = []
    verified: bool | None = None
    if verify and mending.patches:
        assert baseline is not None
        differences = _verify(target, baseline, grad, mending.memo_attrs)
        verified = not differences
        if differences:
            plain = _bisect(target, baseline, grad, mending, groups, outcomes)
            current, capture = _with_capture(target, grad, plain, capture_on, outcomes)
            verified = True  # what remains installed verified on its own
    taken = _never_worse(target, grad, before, current, capture, mending, groups, outcomes, kept,
                         baseline if verified else None)
    if taken is not None:
        current, capture = taken
        plain = _retrace(target, grad) if capture.flags else current
    if mending.memo_attrs and mending.patches:
        _prefill_memos(target, grad, mending.memo_attrs, outcomes)
    _credit_capture(capture, plain, current, outcomes)
    _note_still_breaking(outcomes.values(), current)
    mending.target, mending.groups = target, groups
    report = MendReport(
        target=target.name,
        before=before,
        after=current,
        outcomes=sorted(outcomes.values(), key=lambda o: (o.path, o.line)),
        rounds=rounds,
        verified=verified,
        differences=differences,
        seconds=time.perf_counter() - start,
        rules=tuple(rules),
        capture=capture,
        kept=kept,
        grad=grad,
    )
    return report, mending


_STILL = "still breaks: "


def _note_still_breaking(outcomes: Iterable[SiteOutcome], current: ExplainReport) -> None:
    """Sites still breaking after their rewrite keep "applied" but say so."""
    remaining = {_key(s): s for s in current.sites}
    for outcome in outcomes:
        outcome.notes = [n for n in outcome.notes if not n.startswith(_STILL)]
        if outcome.status == "applied" and (outcome.file, outcome.line) in remaining:
            outcome.notes.append(_STILL + remaining[(outcome.file, outcome.line)].reason)


def report_in_mode(
    report: MendReport, mending: Mending, grad: bool, args: tuple, kwargs: dict
) -> tuple[MendReport, bool]:
    """``report``'s mending measured with autograd ``grad`` on a call's inputs:
    the original and the mended program traced in that mode (a [Where]
    rewrite runs the original branch under grad, say), and never worse there
    either (``_never_worse``). Returns the report and whether rewrites were taken
    back (a report of the other mode is then out of date)."""
    assert mending.target is not None, "a mending knows its target once mend_target returns"
    target = dataclasses.replace(mending.target, args=tuple(args), kwargs=dict(kwargs))
    outcomes = {(o.file, o.line): _copy_outcome(o) for o in report.outcomes}
    kept, capture = list(report.kept), report.capture
    with random_state_kept():
        with mending.original_code():
            before = explain_target(target, grad=grad)
            baseline = observe(target.model, target.args, target.kwargs, in_region=False, grad=grad)
        after = _retrace(target, grad, capture.flags)
        taken = _never_worse(target, grad, before, after, capture, mending, mending.groups, outcomes, kept,
                             baseline if report.verified else None)
    if taken is not None:
        after, capture = taken
    _note_still_breaking(outcomes.values(), after)
    mended = dataclasses.replace(
        report, before=before, after=after, capture=capture, kept=kept, grad=grad,
        outcomes=sorted(outcomes.values(), key=lambda o: (o.path, o.line)),
    )
    return mended, taken is not None


def _guard_held_asserts(
    target: Target,
    grad: bool,
    current: ExplainReport,
    flags: tuple[str, ...],
    mending: Mending,
    groups: dict[int, list[tuple[str, int]]],
    outcomes: dict[tuple[str, int], SiteOutcome],
) -> tuple[ExplainReport, list[str]]:
    """Keep what the mended code records safe from an assert that fails inside
    the graph (barriers.py): a graph break before each such assert of the
    model's code, or, when the breaks leave more graphs than without them
    (measured) or one cannot be placed, the record-making rewrites ([Defer],
    [Trap]) reverted. Returns the report as installed and a line per choice."""
    checkpoint = _Checkpoint(mending, groups, outcomes)
    why = (
        "an assert that may be on tensor values stays in the graph, and when it fails there it loses the "
        "output and checks recorded before it in that graph"
    )
    try:
        changed, failed = barriers.guard_model(target.model, mending, groups, _model_files(target.model, bases=True))
    except Exception as exc:  # never fail the user's model for an internal error: the safe way
        checkpoint.restore()
        changed, failed = [], [f"the asserts (internal error: {type(exc).__name__}: {exc})"]
    if not changed and not failed:
        return current, []
    with_breaks = None
    if not failed:
        try:
            _settle_held(target, grad, mending)
            with_breaks = _retrace(target, grad, flags)
        except Exception:  # the guarded code does not compile: the other way
            with_breaks = None
        if with_breaks is not None and with_breaks.graphs <= current.graphs:
            return with_breaks, [_kept(c, why) for c in changed]
    breaks = _Checkpoint(mending, groups, outcomes)
    checkpoint.restore()
    recording = {k for p in mending.patches if p.node is not None for k in barriers.records(p.node)}
    if with_breaks is None:
        reason = f"no graph break could be put before {(failed or changed)[0]}, and {why}"
    else:
        reason = (
            f"graph breaks before {'; '.join(changed)} would leave {with_breaks.graphs - current.graphs} "
            f"more graph(s), and without them {why}"
        )
    _revert_rules(mending, groups, outcomes, {"defer", "trap"}, reason)
    without = _retrace(target, grad, flags)
    # On a tie a warning tips it to the breaks: one left in a frame Dynamo compiled can
    # report another line (docs/torch-issues.md).
    if with_breaks is not None and (
        with_breaks.graphs < without.graphs or (with_breaks.graphs == without.graphs and "warn" in recording)
    ):
        breaks.restore()
        return with_breaks, [_kept(c, why) for c in changed]
    return without, [f"the rewrites that record ([defer], [trap]) are reverted: {reason}"]


def _settle_held(target: Target, grad: bool, mending: Mending) -> None:
    """Run the guarded model once eagerly (output captured, in a region) to
    see which held tests are tensors, and give those a graph break before the
    test (barriers.settle): cheaper than ``held``'s at the start of a frame."""
    runtime.HELD_PROBE = probed = set()
    try:
        observe(target.model, target.args, target.kwargs, in_region=True, grad=grad)
    finally:
        runtime.HELD_PROBE = None
    if probed and barriers.settle_model(mending, probed):
        torch._dynamo.reset()


def _kept(change: str, why: str) -> str:
    return f"a graph break goes before {change} whenever its test is a tensor (runtime.held): {why}"


def _never_worse(
    target: Target,
    grad: bool,
    before: ExplainReport,
    current: ExplainReport,
    capture: Capture,
    mending: Mending,
    groups: dict[int, list[tuple[str, int]]],
    outcomes: dict[tuple[str, int], SiteOutcome],
    kept: list[str],
    baseline: Observation | None,
) -> tuple[ExplainReport, Capture] | None:
    """Never leave the program worse than the original (``_worse``: more
    graphs, recompiles or abandoned frames). A verified rewrite can still cost
    graphs: Dynamo guards on the length of the region's record list, so a
    frame that records and runs more than once per call (a resumed layer
    body) compiles once per record count. Greedily, take back the patch (with
    what cannot stay without it) or the capture flags whose removal, measured,
    helps most, until the program is no worse; when none helps, everything
    (the original program). What is left is verified against ``baseline``
    (when given): it never ran without the rewrites taken back, and when it
    differs, the original program. None when nothing was taken back; else the
    report as installed and the capture kept."""
    if not _worse(current, before):
        return None
    while _worse(current, before) and (mending.patches or capture.flags):
        worse = f"the mended program was worse than the original ({_shown(before)} -> {_shown(current)})"
        ways = _ways_back(target, grad, capture, mending, groups, outcomes)
        best = min(ways, key=lambda m: (_excess(m[0], before), _measure(m[0]), len(m[1])), default=None)
        if best is not None and _excess(best[0], before) < _excess(current, before):
            report, doomed, flags = best
            what = "the capture flags" if not doomed else "this rewrite" if len(doomed) == 1 else "these rewrites"
            reason = f"{worse}; without {what}: {_shown(report)}"
        else:  # the original program
            report, doomed, flags = before, set(range(len(mending.patches))), ()
            reason = (
                f"{worse}; taking back one rewrite or the capture flags alone makes it no less worse (one that "
                "defers a warnings.warn is not taken back alone): every rewrite is reverted"
            )
        _take_back(target, mending, groups, outcomes, doomed, reason, kept)
        capture = capture if flags == capture.flags else _dropped(capture, reason)
        current = report
    # What is left never ran without the rewrites taken back (bisect verifies growing sets).
    left = _verify(target, baseline, grad, mending.memo_attrs) if baseline is not None and mending.patches else []
    if left:
        why = "with the rewrites that left the program worse reverted, the rest did not verify: " + "; ".join(left[:3])
        _take_back(target, mending, groups, outcomes, set(range(len(mending.patches))), why, kept)
        current, capture = before, _dropped(capture, why)
    return (before if not mending.patches and not capture.flags else current), capture


def _ways_back(
    target: Target,
    grad: bool,
    capture: Capture,
    mending: Mending,
    groups: dict[int, list[tuple[str, int]]],
    outcomes: dict[tuple[str, int], SiteOutcome],
) -> list[tuple[ExplainReport, set[int], tuple[str, ...]]]:
    """Each way to take something back, measured and undone again: (report,
    patches taken back, capture flags traced with). The capture flags dropped,
    or one applied patch with what cannot stay without it. Not a patch that
    defers a ``warnings.warn``: left in a frame Dynamo compiles, the warning
    can report another line (docs/torch-issues.md), and with the other
    rewrites installed that frame is not the original's; it goes only with
    everything, when nothing else helps."""
    ways = {frozenset(_with_dependants(mending, groups, outcomes, i))
            for i in range(len(mending.patches)) if _applied_in(groups, outcomes, i)}
    ways = {w for w in ways if not any(_defers_warning(mending.patches[i]) for i in w)}
    trials = ([(set(), ())] if capture.flags else []) + [(set(doomed), capture.flags) for doomed in ways]
    checkpoint, speculating = _Checkpoint(mending, groups, outcomes), target.speculating
    measured = []
    for doomed, flags in trials:
        _take_back(target, mending, groups, outcomes, doomed, "")
        with contextlib.suppress(Exception):  # a way that does not trace is no way back
            measured.append((_retrace(target, grad, flags), doomed, flags))
        checkpoint.restore()
        target.speculating = speculating
    return measured


def _defers_warning(patch: engine.Patch) -> bool:
    return patch.node is not None and "warn" in barriers.records(patch.node)


def _applied_in(
    groups: dict[int, list[tuple[str, int]]], outcomes: dict[tuple[str, int], SiteOutcome], index: int
) -> bool:
    """Whether patch ``index`` holds an applied site (not only graph breaks before asserts)."""
    return any(outcomes[k].status == "applied" for k in groups.get(index, []) if k in outcomes)


def _with_dependants(
    mending: Mending, groups: dict[int, list[tuple[str, int]]], outcomes: dict[tuple[str, int], SiteOutcome], index: int
) -> set[int]:
    """Patch ``index`` and what cannot stay without it (barriers.py): when it
    keeps graph breaks before asserts and others record, the rewrites that
    record (its asserts would fail inside their graph, unguarded); once
    nothing records, the patches that only keep such breaks."""
    recording = {i for i, p in enumerate(mending.patches) if p.node is not None and barriers.records(p.node)}
    node = mending.patches[index].node
    doomed = {index} | (recording if node is not None and barriers.guards(node) else set())
    if not recording - doomed:
        doomed |= {i for i in range(len(mending.patches)) if not _applied_in(groups, outcomes, i)}
    return doomed


def _take_back(
    target: Target,
    mending: Mending,
    groups: dict[int, list[tuple[str, int]]],
    outcomes: dict[tuple[str, int], SiteOutcome],
    doomed: set[int],
    reason: str,
    kept: list[str] | None = None,
) -> None:
    """Revert the patches ``doomed``; calls speculate only while a [Speculate]
    site stays. With ``kept`` (the report's lines on asserts): when patches that
    only keep graph breaks before asserts go, one line says why instead."""
    if kept is not None and any(not _applied_in(groups, outcomes, i) for i in doomed):
        breaks = "with the graph breaks before asserts kept for them"
        kept[:] = [f"the rewrites that record ([defer], [trap]) are reverted, {breaks}: {reason}"]
    _revert_patches(mending, groups, outcomes, doomed, reason)
    target.speculating = target.speculating and any(
        o.rule == SPECULATE_RULE and o.status == "applied" for o in outcomes.values()
    )


def _dropped(capture: Capture, reason: str) -> Capture:
    """No capture flags, the decision's lines and why they were dropped."""
    if not capture.flags:
        return capture
    return Capture(notes=capture.notes + [f"{' + '.join(capture.flags)}: dropped, {reason}"])


class _Checkpoint:
    """The installed patches, their groups and the outcomes, to go back to
    exactly (the codes of every patched function, the runtime in their
    globals, the mended sources)."""

    def __init__(self, mending: Mending, groups: dict[int, list[tuple[str, int]]], outcomes: dict[tuple[str, int], SiteOutcome]):
        self.mending, self.groups, self.outcomes = mending, groups, outcomes
        self.patches = list(mending.patches)
        self.saved_groups = {k: list(v) for k, v in groups.items()}
        self.saved_outcomes = {k: _copy_outcome(o) for k, o in outcomes.items()}
        self.codes = [(fn, fn.__code__) for p in mending.patches for fn in p.located.functions]

    def restore(self) -> None:
        for patch in self.mending.patches:
            if not any(patch is p for p in self.patches):
                patch.uninstall()
        for fn, code in self.codes:
            fn.__code__ = code
        for patch in self.patches:
            patch.located.namespace.setdefault(RUNTIME_NAME, runtime)
            source.MENDED[id(patch.new_code)] = patch.node
        self.mending.patches[:] = self.patches
        self.groups.clear()
        self.groups.update({k: list(v) for k, v in self.saved_groups.items()})
        self.outcomes.clear()
        self.outcomes.update({k: _copy_outcome(o) for k, o in self.saved_outcomes.items()})
        torch._dynamo.reset()


def _copy_outcome(outcome: SiteOutcome) -> SiteOutcome:
    return dataclasses.replace(outcome, notes=list(outcome.notes))


def _rounds(
    target: Target,
    current: ExplainReport,
    rules: tuple[str, ...],
    outcomes: dict[tuple[str, int], SiteOutcome],
    mending: Mending,
    groups: dict[int, list[tuple[str, int]]],
    observed: list[tuple[Any, ...]],
    grad: bool,
    max_rounds: int,
    flags: tuple[str, ...] = (),
) -> tuple[ExplainReport, int]:
    """Rewrite the sites of ``current`` not decided yet, retrace (with the
    capture ``flags``), repeat while rewrites apply; (last report, rounds run)."""
    rounds = 0
    for _ in range(max_rounds):
        pending = [s for s in current.sites if _key(s) not in outcomes]
        if not pending:
            break
        rounds += 1
        snapshot, codes = _snapshot(mending, groups, outcomes)
        observed += [p for s in current.sites for p in (s.paths or [s.frames]) if p]
        applied = _apply_round(target.model, pending, rules, outcomes, mending, groups, observed)
        if applied == 0:
            break
        try:
            current = _retrace(target, grad, flags)
        except Exception as exc:  # the mended code does not compile: undo this round
            _undo_round(mending, snapshot, codes, groups, outcomes, exc)
            current = _retrace(target, grad, flags)
            break
    return current, rounds


SPECULATE_RULE = "speculate"


def _may_run_twice(model: Any) -> bool:
    """What [Speculate]'s proof assumed and can change between calls: every
    module in eval mode, and no hooks (a hook's effects were not scanned)."""
    from torch.nn.modules import module as nn_module

    if not isinstance(model, torch.nn.Module):
        return False
    if any(getattr(nn_module, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks", "_global_forward_hooks_always_called",
    )):
        return False
    # The modules as mended (the proof is about them), listed once: walking
    # model.modules() on every call cost 4x more (43 vs 10 us for zoo:longformer's 52).
    modules = _MODULES.get(model)
    if modules is None:
        modules = _MODULES[model] = tuple(model.modules())
    for m in modules:
        if m.training or m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return False
    return True


_MODULES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _speculation_round(
    target: Target,
    current: ExplainReport,
    outcomes: dict[tuple[str, int], SiteOutcome],
    mending: Mending,
    groups: dict[int, list[tuple[str, int]]],
    observed: list[tuple[Any, ...]],
    grad: bool,
    flags: tuple[str, ...],
) -> ExplainReport:
    """Last, [Speculate] on the ``.item()`` sites still breaking: it needs the
    other rewrites installed (its proof reads the code that will run)."""
    left = [s for s in current.sites if s.category == "TI" and (_key(s) not in outcomes or outcomes[_key(s)].status != "applied")]
    if not left:
        return current
    trial: dict[tuple[str, int], SiteOutcome] = {}
    snapshot, codes = _snapshot(mending, groups, outcomes)
    applied = _apply_round(target.model, left, (SPECULATE_RULE,), trial, mending, groups, observed, only=SPECULATE_RULE)
    for key, outcome in trial.items():
        if outcome.status == "applied" or key not in outcomes:
            outcomes[key] = outcome
        else:
            outcomes[key].notes.append(f"[speculate] {outcome.reason}")
    if not applied:
        return current
    target.speculating = True  # later traces call it as graphmend.compile will
    _learn(target, grad)
    try:
        after = _retrace(target, grad, flags)
    except Exception as exc:
        target.speculating = False
        _undo_round(mending, snapshot, codes, groups, outcomes, exc)
        return _retrace(target, grad, flags)
    remaining = {_key(s) for s in after.sites}
    guessed = [k for k, o in trial.items() if o.status == "applied"]
    if all(k in remaining for k in guessed):  # no guess removed its break (a float value): undo
        target.speculating = False
        _undo_round(mending, snapshot, codes, groups, outcomes, RuntimeError("no break removed"))
        for key in guessed:
            outcomes[key] = snapshot[2][key] if key in snapshot[2] else outcomes[key]
            outcomes[key].notes.append(
                "[speculate] undone: the guess did not remove the break (the value is not a bool or an "
                "integer, or Dynamo breaks there for another reason)"
            )
        return _retrace(target, grad, flags)
    return after


def _learn(target: Target, grad: bool) -> None:
    """One eager call of a private copy in a region: each [Speculate] site
    learns the value it has on the example (the first guess)."""
    from graphmend.rewrite.verify import quiet

    subject = private_copy(target)
    try:
        with quiet(), runtime.region(), (torch.enable_grad() if grad else torch.no_grad()):
            subject.model(*subject.args, **subject.kwargs)
    except Exception:
        return


def _prefill_memos(target: Target, grad: bool, names: set[str], outcomes: dict[tuple[str, int], SiteOutcome]) -> None:
    """Initialise hoisted memo attributes on the user's model now.

    A hoisted ``if not hasattr(self, k): self.k = pure_init(...)`` would run in
    the first compiled call and flip Dynamo's ``hasattr`` guard, recompiling
    on the second. The initialiser is proven pure, so its value is taken from
    one eager run of a private copy and set on the user's modules up front."""
    from graphmend.rewrite.verify import quiet
    from graphmend.runtime import region

    if not isinstance(target.model, torch.nn.Module):
        return
    subject = private_copy(target)
    try:
        with quiet(), region(), (torch.enable_grad() if grad else torch.no_grad()):
            subject.model(*subject.args, **subject.kwargs)
    except Exception:
        return
    filled = []
    copies = dict(subject.model.named_modules())
    for path, module in target.model.named_modules():
        twin = copies.get(path)
        for name in names:
            if twin is not None and name in vars(twin) and name not in vars(module):
                setattr(module, name, vars(twin)[name])
                filled.append(f"{path}.{name}" if path else name)
    if filled:
        for outcome in outcomes.values():
            if outcome.status == "applied" and any("memoised" in n for n in outcome.notes):
                outcome.notes.append(f"memo {', '.join(filled)} initialised at mend time (no first-call recompile)")


def _snapshot(
    mending: Mending, groups: dict[int, list[tuple[str, int]]], outcomes: dict[tuple[str, int], SiteOutcome]
) -> tuple[tuple, dict[int, tuple[Any, Any]]]:
    """What ``_undo_round`` needs to take a round back: the patches, groups and
    outcomes before it, and each patched function's code."""
    snapshot = (list(mending.patches), {k: list(v) for k, v in groups.items()}, dict(outcomes))
    codes = {id(fn): (fn, fn.__code__) for p in mending.patches for fn in p.located.functions}
    return snapshot, codes


def _undo_round(
    mending: Mending,
    snapshot: tuple[list[engine.Patch], dict[int, list[tuple[str, int]]], dict[tuple[str, int], SiteOutcome]],
    codes: dict[int, tuple[Any, Any]],
    groups: dict[int, list[tuple[str, int]]],
    outcomes: dict[tuple[str, int], SiteOutcome],
    exc: Exception,
) -> None:
    patches, old_groups, old_outcomes = snapshot
    for patch in mending.patches:
        if patch not in patches:
            patch.uninstall()
    for fn, code in codes.values():
        fn.__code__ = code
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    for key, outcome in outcomes.items():
        if key not in old_outcomes or old_outcomes[key] is not outcome:
            if outcome.status == "applied":
                outcome.status = "reverted"
                outcome.reason = f"the rewritten code failed under torch.compile: {type(exc).__name__}: {message}"
    mending.patches[:] = patches
    groups.clear()
    groups.update(old_groups)
    torch._dynamo.reset()


def _trial(target: Target, grad: bool, flags: tuple[str, ...]) -> Trial:
    """Trace a private copy with ``flags`` on; a tracing error is recorded, not raised."""
    subject = private_copy(target)
    try:
        trace = trace_breaks(
            subject.model, subject.args, subject.kwargs, grad=grad, capture=flags,
            speculating=target.speculating,
        )
    except Exception as exc:
        if not flags:
            raise
        return Trial(flags, error=describe(exc))
    report = report_from_trace(target.name, trace)
    return Trial(flags, report.graphs, report.recompiles, trace.frames_skipped, report=report)


def _with_capture(
    target: Target, grad: bool, plain: ExplainReport, capture_on: bool,
    outcomes: dict[tuple[str, int], SiteOutcome] | None = None,
) -> tuple[ExplainReport, Capture]:
    """(report under the kept flags, decision); ``plain`` was traced without capture.

    Not measured when a [Trap] rewrite is applied: capture pulls scalar
    conversions (``int(t.item())``, which raises on NaN) into the graph that
    computes the trapped flag, and a graph that raises loses the flag, so the
    later error would replace the check's exception."""
    if not capture_on:
        return plain, Capture()
    trapped = [o for o in (outcomes or {}).values() if o.status == "applied" and o.rule == "trap"]
    if trapped and any(s.category in ("TI", "DO") for s in plain.sites):
        return plain, Capture(notes=[
            f"not measured: {len(trapped)} trapped check(s) applied; a captured scalar conversion that raises "
            "in the same graph would lose the check's exception"
        ])
    base = Trial((), plain.graphs, plain.recompiles, plain.frames_skipped, report=plain)
    capture, best = decide(base, lambda flags: _trial(target, grad, flags))
    return best.report, capture


def _retrace(target: Target, grad: bool, flags: tuple[str, ...] = ()) -> ExplainReport:
    trial = _trial(target, grad, flags)
    if trial.report is None:  # only with flags: a tracing error is recorded, not raised
        raise RuntimeError(trial.error)
    return trial.report


def _measure(report: ExplainReport) -> tuple[int, int, int]:
    return report.graphs, report.recompiles, report.frames_skipped


def _worse(after: ExplainReport, before: ExplainReport) -> bool:
    """More graphs, more recompiles or more frames Dynamo abandoned than ``before``."""
    return any(a > b for a, b in zip(_measure(after), _measure(before)))


def _excess(after: ExplainReport, before: ExplainReport) -> int:
    """How much worse ``after`` is than ``before``, summed over the three measures."""
    return sum(max(0, a - b) for a, b in zip(_measure(after), _measure(before)))


def _shown(report: ExplainReport) -> str:
    graphs, recompiles, skipped = _measure(report)
    return f"{graphs} graph(s), {recompiles} recompile(s), {skipped} frame(s) skipped"


def _revert_rules(
    mending: Mending,
    groups: dict[int, list[tuple[str, int]]],
    outcomes: dict[tuple[str, int], SiteOutcome],
    rules: set[str],
    reason: str,
) -> bool:
    """Undo every patch holding a site one of ``rules`` applied; each applied
    site of those patches becomes ``reverted`` with ``reason``."""
    doomed = {
        index for index, keys in groups.items()
        if any(outcomes[k].status == "applied" and outcomes[k].rule in rules for k in keys if k in outcomes)
    }
    return _revert_patches(mending, groups, outcomes, doomed, reason)


def _revert_patches(
    mending: Mending,
    groups: dict[int, list[tuple[str, int]]],
    outcomes: dict[tuple[str, int], SiteOutcome],
    doomed: set[int],
    reason: str,
) -> bool:
    """Undo the patches at the indices ``doomed``; each applied site of those
    patches becomes ``reverted`` with ``reason``. Whether any was undone."""
    if not doomed:
        return False
    kept: list[engine.Patch] = []
    new_groups: dict[int, list[tuple[str, int]]] = {}
    for index, patch in enumerate(mending.patches):
        if index in doomed:
            patch.uninstall()
            for key in groups.get(index, []):
                if outcomes[key].status == "applied":
                    outcomes[key].status = "reverted"
                    outcomes[key].reason = reason
        else:
            new_groups[len(kept)] = groups.get(index, [])
            kept.append(patch)
    mending.patches[:] = kept
    groups.clear()
    groups.update(new_groups)
    torch._dynamo.reset()
    return True


def _credit_capture(
    capture: Capture, plain: ExplainReport, current: ExplainReport, outcomes: dict[tuple[str, int], SiteOutcome]
) -> None:
    """Sites that break without the kept flags but not with them: applied by capture."""
    if not capture.flags:
        return
    by_key = {_key(s): s for s in plain.sites}
    reason = "removed by " + " + ".join(capture.flags) + " (measured; applied by graphmend.compile)"
    for key in sorted(removed_sites(plain, current)):
        old = outcomes.get(key)
        if old is not None and old.status == "applied":
            continue
        notes = [f"no source rewrite: {old.reason}"] if old is not None and old.status == "declined" else []
        outcomes[key] = _outcome(by_key[key], "applied", reason, CAPTURE_RULE, notes)


def _bisect(
    target: Target,
    baseline: Observation,
    grad: bool,
    mending: Mending,
    groups: dict[int, list[tuple[str, int]]],
    outcomes: dict[tuple[str, int], SiteOutcome],
) -> ExplainReport:
    """Keep each patched function only if the target verifies with it installed."""
    patches = list(mending.patches)
    for patch in reversed(patches):
        patch.uninstall()
    mending.patches.clear()
    for index, patch in enumerate(patches):
        for fn in patch.located.functions:
            fn.__code__ = patch.new_code
        patch.located.namespace.setdefault(engine.RUNTIME_NAME, engine.runtime)
        torch._dynamo.reset()
        diff = _verify(target, baseline, grad, mending.memo_attrs)
        if diff:
            for fn in patch.located.functions:
                fn.__code__ = patch.original_code
            for key in groups.get(index, []):
                old = outcomes[key]
                outcomes[key] = SiteOutcome(
                    file=old.file, line=old.line, function=old.function, code=old.code,
                    category=old.category, rule=old.rule, status="reverted",
                    reason="verification found a difference: " + "; ".join(diff[:3]), notes=old.notes,
                )
        else:
            mending.patches.append(patch)
    torch._dynamo.reset()
    return _retrace(target, grad)
