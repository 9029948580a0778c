"""Mending: discover the breaks, rewrite the functions that hold them, verify,
never worse. ``mend_target`` runs the passes below over one ``Session``
(rewrite/session.py); each pass reads the session, changes it, and can be
run alone on one.

    observe_baseline               the original's behaviour (eager), or EagerFailure
    discover                       the original's breaks, with categories and rules
    rewrite_rounds                 sites a rule claims: rewritten, installed, traced again (passes/rounds.py)
    capturing.capture              capture flags kept only where measured to help (passes/capturing.py)
    capturing.rounds_with_capture  with a flag kept, more rounds traced with it
    speculation.speculate          [Speculate] on the .item() sites still breaking (passes/speculation.py)
    held.guard_held_asserts        records kept safe from asserts that fail in the graph (passes/held.py)
    verification.verify            the mended model against the original, bisected on a difference
    verification.verify_capture    with capture flags kept, the same compiled with them; dropped on a difference
    never_worse.never_worse        taken back until no more graphs, recompiles or abandoned frames
    memos.prefill                  hoisted memo attributes set now (passes/memos.py)
    capturing.credit               sites capture removed, credited to its rule
    note_still_breaking            applied sites that still break say so

Every site ends with one outcome: ``applied``, ``declined`` (with the
rule's reason), ``reverted`` (verification found a difference, or the
program got worse with it; shown), or ``out of scope`` (no rule addresses
its category). A site that capture removes is ``applied`` by [scalar] with
the flag named; the kept flags are ``report.capture`` and
``report.region()`` applies them around a call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from graphmend import runtime
from graphmend.discover.capture import Capture
from graphmend.discover.explain import ExplainReport, explain_target
from graphmend.discover.isolation import random_state_kept
from graphmend.discover.sites import BreakSite
from graphmend.discover.trace import tally
from graphmend.errors import CompileFailure, EagerFailure
from graphmend.models.targets import Target
from graphmend.passes import (
    capturing,
    held,
    memos,
    never_worse,
    speculation,
    verification,
)
from graphmend.passes.capturing import CAPTURE_RULE
from graphmend.passes.rounds import apply_round, chains_seen, rounds
from graphmend.passes.speculation import RULE as SPECULATE
from graphmend.passes.speculation import may_run_twice
from graphmend.rewrite.session import (
    Mending,
    Session,
    SiteOutcome,
    Status,
    copy_outcome,
    key,
)
from graphmend.rules import default_rules

DEFAULT_RULES = default_rules()


def mend_target(
    target: Target,
    *,
    rules: tuple[str, ...] = DEFAULT_RULES,
    verify: bool = True,
    max_rounds: int = 3,
    grad: bool = False,
    mending: Mending | None = None,
    stage: Any = None,
) -> tuple["MendReport", Mending]:
    """Mend ``target`` in memory. Returns the report and the undo handle.
    If anything fails midway, every function already rewritten is restored.
    ``stage``: ``graphmend.compile``'s backend; every trace goes through it,
    and the last one's graphs stay in Dynamo's cache for the first call
    when they are of the code as finally installed (``report.staged``)."""
    session = Session(target, tuple(rules), grad, verify, max_rounds, mending or Mending(), stage=stage)
    try:
        with random_state_kept():  # mending runs the model: the user's generators stay where they are
            for step in PASSES:
                began, (traces, frames) = time.perf_counter(), tally()
                step(session)
                session.pass_seconds[step.__name__] = time.perf_counter() - began
                now = tally()
                session.pass_traces[step.__name__] = (now[0] - traces, now[1] - frames)
            session.keeps_staged()
    except BaseException:
        session.mending.undo()
        raise
    session.mending.target = target
    return report_of(session), session.mending


def observe_baseline(session: Session) -> None:
    session.started = time.perf_counter()
    if not session.verify:
        return
    session.baseline = session.observe(in_region=False)
    if session.baseline.exception is not None:
        kind, message = session.baseline.exception
        first = (message.strip().splitlines() or [""])[0]
        raise EagerFailure(f"{session.target.name}: the model fails in eager mode: {kind}: {first}".rstrip(": "))


def discover(session: Session) -> None:
    session.before = session.current = explain_original(session)
    session.staged = session.state(()) if session.stage is not None else None


def explain_original(session: Session) -> ExplainReport:
    """The original's breaks, traced through the compile's backend (staged) where
    that works. Where Dynamo fails under the compile's settings but not under a
    counting trace's (torch 2.14's symbolic float formatted, pytorch #197093, under
    automatic dynamic shapes), the session goes on unstaged: mended as a counting
    trace sees the model, compiled afterwards as it would be without graphmend."""
    try:
        return explain_target(session.target, grad=session.grad, stage=session.stage)
    except CompileFailure:
        if session.stage is None:
            raise
        session.stage = None
        return explain_target(session.target, grad=session.grad)


def rewrite_rounds(session: Session) -> None:
    """Rounds trace without capture: a source rewrite beats a captured host read."""
    session.rounds += rounds(session, session.rules)


_STILL = "still breaks: "
GONE = "no longer breaks after mending (another site's mend removed it)"


def note_still_breaking(session: Session) -> None:
    """Sites still breaking after their rewrite keep "applied" but say so; a
    declined site, or an out-of-scope break of the original, that no longer
    breaks (a loop rewrite removed the branch in its body, a [Compiling] rewrite
    the exception) keeps its status, as no rule of its own applied, and says so."""
    remaining = {key(s): s for s in session.current.sites}
    original = {key(s) for s in session.before.sites} if session.before is not None else set()
    for found in session.outcomes.values():
        found.notes = [n for n in found.notes if not n.startswith(_STILL) and n != GONE]
        at = (found.file, found.line)
        if found.status == Status.APPLIED and at in remaining:
            found.notes.append(_STILL + _why(remaining[at]))
        elif at not in remaining and (
            found.status == Status.DECLINED or (found.status == Status.OUT_OF_SCOPE and at in original)
        ):  # (an out-of-scope break only a mend taken back made is no break of the original)
            found.notes.append(GONE)


def _why(site: BreakSite) -> str:
    """A break's reason; for graphmend's own runtime running an effect at once, what
    the runtime gave as the reason (``runtime.records.AT_ONCE``)."""
    marker = "(reason: graphmend: "
    if marker in site.detail:
        return site.detail.split(marker, 1)[1].split("\n", 1)[0].removesuffix(")")
    return site.reason


PASSES: tuple[Callable[[Session], None], ...] = (
    observe_baseline,
    discover,
    rewrite_rounds,
    capturing.capture,
    capturing.rounds_with_capture,
    speculation.speculate,
    held.guard_held_asserts,
    verification.verify,
    verification.verify_capture,
    never_worse.never_worse,
    memos.prefill,
    capturing.credit,
    note_still_breaking,
)


def judge(report: ExplainReport, target: Target, rules: tuple[str, ...] = DEFAULT_RULES) -> ExplainReport:
    """``report`` with each site offered to its rule as mend's first round offers
    it, every rewrite then undone (nothing is traced or run): a site is
    fixable only where its rule accepts it, else ``site.declined`` says why,
    in the words ``mend`` would use. [Scalar]'s measured capture is not tried
    here: ``mend`` measures it."""
    session = Session(target, tuple(rules), False, False, 1, Mending())
    session.before = session.current = report
    session.observed = chains_seen(report.sites)
    try:
        with random_state_kept():
            apply_round(session, [s for s in report.sites if s.rule is not None], session.rules)
    finally:
        session.mending.undo()
    for site in report.sites:
        found = session.outcomes.get(key(site))
        site.declined = found.reason if found is not None and found.status == Status.DECLINED else ""
    return report


def report_of(session: Session) -> "MendReport":
    return MendReport(
        target=session.target.name,
        before=session.before,
        after=session.current,
        outcomes=sorted(session.outcomes.values(), key=lambda o: (o.path, o.line)),
        rounds=session.rounds,
        verified=session.verified,
        differences=session.differences,
        seconds=time.perf_counter() - session.started,
        rules=session.rules,
        capture=session.capture,
        kept=session.kept,
        grad=session.grad,
        pass_seconds=dict(session.pass_seconds),
        pass_traces=dict(session.pass_traces),
        staged=session.staged is not None,
    )


def report_in_mode(
    report: "MendReport", mending: Mending, grad: bool, args: tuple, kwargs: dict, stage: Any = None
) -> tuple["MendReport", bool]:
    """``report``'s mending measured with autograd ``grad`` on a call's inputs:
    the original and the mended program traced in that mode (a [Where]
    rewrite runs the original branch under grad, say), and never worse there
    either (passes/never_worse.py). Returns the report and whether rewrites
    were taken back (a report of the other mode is then out of date).
    ``stage``: as for ``mend_target``, the traces go through it."""
    assert mending.target is not None, "a mending knows its target once mend_target returns"
    target = dataclasses.replace(mending.target, args=tuple(args), kwargs=dict(kwargs))
    session = Session(
        target, report.rules, grad, mending=mending, capture=report.capture, kept=list(report.kept),
        outcomes={(o.file, o.line): copy_outcome(o) for o in report.outcomes}, stage=stage,
    )
    with random_state_kept():
        with mending.original_code():
            session.before = explain_original(session)
            baseline = session.observe(in_region=False)
        session.current = session.retrace(session.capture.flags)
        taken = never_worse.take_back_worse(session, baseline if report.verified else None)
        session.keeps_staged()
    note_still_breaking(session)
    mended = dataclasses.replace(
        report, before=session.before, after=session.current, capture=session.capture, kept=session.kept, grad=grad,
        outcomes=sorted(session.outcomes.values(), key=lambda o: (o.path, o.line)), staged=session.staged is not None,
    )
    return mended, taken


_VERIFYING = {"observe_baseline", "verify", "verify_capture"}


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
    from_cache: bool = False  # installed from the mend cache (cache.py): measured by an earlier process
    pass_seconds: dict[str, float] = field(default_factory=dict)  # each pass's wall time (PASSES)
    pass_traces: dict[str, tuple[int, int]] = field(default_factory=dict)  # each pass's (model calls, frames) under Dynamo
    staged: bool = False  # the last trace's graphs were left for the first call to compile (graphmend.compile)

    @property
    def traces(self) -> int:
        """Calls of the model under Dynamo the mend made (discovery's trace included; none from the cache)."""
        return 0 if self.from_cache else sum(t for t, _ in self.pass_traces.values())

    @property
    def frames_traced(self) -> int:
        """Frames Dynamo traced for the mend (each call traces the entry and every frame a break resumes or skips)."""
        return 0 if self.from_cache else sum(f for _, f in self.pass_traces.values())

    @property
    def mend_passes(self) -> dict[str, dict[str, float]]:
        """Each pass that took time or traced: its seconds, model calls under Dynamo and frames traced
        (none for a mend from the cache)."""
        out: dict[str, dict[str, float]] = {}
        if self.from_cache:
            return out
        for name, seconds in self.pass_seconds.items():
            traces, frames = self.pass_traces.get(name, (0, 0))
            if traces or frames or seconds >= 0.001:
                out[name] = {"seconds": round(seconds, 3), "traces": traces, "frames": frames}
        return out

    @property
    def mend_split(self) -> dict[str, float]:
        """Where the mend's seconds went: ``discovery`` (tracing the original),
        ``verify`` (eager observations and comparisons) and ``rewrite`` (the rest:
        rounds, capture, speculation, asserts, never-worse), from ``pass_seconds``;
        for a mend from the cache, ``install`` alone."""
        if self.from_cache:
            return {"install": round(self.seconds, 3)}
        split = {"discovery": 0.0, "rewrite": 0.0, "verify": 0.0}
        for name, seconds in self.pass_seconds.items():
            part = "discovery" if name == "discover" else "verify" if name in _VERIFYING else "rewrite"
            split[part] += seconds
        return {k: round(v, 3) for k, v in split.items()}

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
        return any(o.rule == SPECULATE and o.status == Status.APPLIED for o in self.outcomes)

    def call(self, fn: Any, model: Any, args: tuple, kwargs: dict) -> Any:
        """One call of compiled ``fn`` (of ``model``) as ``graphmend.compile``
        makes it: in ``region()``; with [Speculate] sites applied and every
        module in eval mode, as a speculating call (``runtime.call``)."""
        if self.speculates and may_run_twice(model):
            # Held through the capture flags, which are process-wide, as region() holds them.
            with runtime.exclusive(), self.capture.context():
                return runtime.call(fn, *args, **kwargs)
        with self.region():
            return fn(*args, **kwargs)

    @property
    def applied(self) -> list[SiteOutcome]:
        return [o for o in self.outcomes if o.status == Status.APPLIED]

    @property
    def declined(self) -> list[SiteOutcome]:
        return [o for o in self.outcomes if o.status != Status.APPLIED]

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
            "calls_captured_before": self.before.calls_captured,
            "calls_captured_after": self.after.calls_captured,
            "fallbacks_to_eager_before": self.before.fallbacks_to_eager,
            "fallbacks_to_eager_after": self.after.fallbacks_to_eager,
            "rounds": self.rounds,
            "verified": self.verified,
            "differences": list(self.differences),
            "seconds": round(self.seconds, 3),
            "from_cache": self.from_cache,
            "mend_split": self.mend_split,
            "traces": self.traces,
            "frames_traced": self.frames_traced,
            "staged": self.staged,
            "mend_passes": self.mend_passes,
            "sites": [o.to_dict() for o in self.outcomes],
            "capture": self.capture.to_dict(),
            "kept": list(self.kept),
            "before": self.before.to_dict(),
            "after": self.after.to_dict(),
        }


__all__ = ["CAPTURE_RULE", "DEFAULT_RULES", "Mending", "MendReport", "SiteOutcome", "Status", "mend_target", "report_in_mode"]
