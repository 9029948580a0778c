"""Never worse: a mended program never has more graphs, recompiles or
abandoned frames than the original.

A verified rewrite can still cost graphs: Dynamo guards on the length of a
region's record list, so a frame that records and runs more than once per
call (a resumed layer body) compiles once per record count. Greedily, the
patch (with what cannot stay without it) or the capture flags whose removal,
measured, helps most is taken back, until the program is no worse; when none
helps, everything (the original program). What is left is verified against
the original's behaviour: it never ran without what was taken back.
"""

from __future__ import annotations

import contextlib

from graphmend.discover.explain import ExplainReport
from graphmend.passes import barriers
from graphmend.passes.held import recording_rules
from graphmend.passes.speculation import RULE as SPECULATE
from graphmend.rewrite import engine
from graphmend.rewrite.session import (
    Mending,
    Session,
    Status,
    dropped,
    excess,
    measure,
    shown,
    worse,
)
from graphmend.rewrite.verify import Observation


def never_worse(session: Session) -> None:
    """The pipeline's pass: with what was taken back, the report and capture as installed."""
    if take_back_worse(session, session.baseline if session.verified else None):
        session.plain = session.retrace() if session.capture.flags else session.current


def take_back_worse(session: Session, baseline: Observation | None) -> bool:
    """Take back until ``session.current`` is no worse than ``session.before``;
    whether anything was (``session.current`` and ``session.capture`` are then
    as installed). What is left is verified against ``baseline`` when given:
    when it differs, the original program."""
    before = session.before
    if not worse(session.current, before):
        return False
    while worse(session.current, before) and (session.mending.patches or session.capture.flags):
        why = f"the mended program was worse than the original ({shown(before)} -> {shown(session.current)})"
        ways = _ways_back(session)
        best = min(ways, key=lambda m: (excess(m[0], before), measure(m[0]), len(m[1])), default=None)
        if best is not None and excess(best[0], before) < excess(session.current, before):
            report, doomed, flags = best
            what = "the capture flags" if not doomed else "this rewrite" if len(doomed) == 1 else "these rewrites"
            reason = f"{why}; without {what}: {shown(report)}"
        else:  # the original program
            report, doomed, flags = before, set(range(len(session.mending.patches))), ()
            reason = (
                f"{why}; taking back one rewrite or the capture flags alone makes it no less worse (one that "
                "defers a warnings.warn is not taken back alone): every rewrite is reverted"
            )
        _take_back(session, doomed, reason, session.kept)
        session.capture = session.capture if flags == session.capture.flags else dropped(session.capture, reason)
        session.current = report
    # What is left never ran without the rewrites taken back (bisect verifies growing sets).
    left = session.differences_from(baseline) if baseline is not None and session.mending.patches else []
    if left:
        why = "with the rewrites that left the program worse reverted, the rest did not verify: " + "; ".join(left[:3])
        _take_back(session, set(range(len(session.mending.patches))), why, session.kept)
        session.current, session.capture = before, dropped(session.capture, why)
    if not session.mending.patches and not session.capture.flags:
        session.current = before
    return True


def _ways_back(session: Session) -> list[tuple[ExplainReport, set[int], tuple[str, ...]]]:
    """Each way to take something back, measured and undone again: (report,
    patches taken back, capture flags traced with). The capture flags dropped,
    or one applied patch with what cannot stay without it. Not a patch that
    defers a ``warnings.warn``: left in a frame Dynamo compiles, the warning
    can report another line (docs/torch-issues.md), and with the other
    rewrites installed that frame is not the original's; it goes only with
    everything, when nothing else helps."""
    mending, capture = session.mending, session.capture
    ways = {frozenset(with_dependants(mending, session.outcomes, i))
            for i in range(len(mending.patches)) if session.applied_in(i)}
    ways = {w for w in ways if not any(_defers_warning(mending.patches[i]) for i in w)}
    trials = ([(set(), ())] if capture.flags else []) + [(set(doomed), capture.flags) for doomed in ways]
    checkpoint = session.checkpoint()
    measured = []
    for doomed, flags in trials:
        _take_back(session, doomed, "")
        with contextlib.suppress(Exception):  # a way that does not trace is no way back
            measured.append((session.retrace(flags), doomed, flags))
        checkpoint.restore()
    return measured


def _defers_warning(patch: engine.Patch) -> bool:
    return patch.node is not None and "warn" in barriers.records(patch.node)


def with_dependants(mending: Mending, outcomes: dict, index: int) -> set[int]:
    """Patch ``index`` and what cannot stay without it (barriers.py): when it
    keeps graph breaks before asserts and others record, the rewrites that
    record (its asserts would fail inside their graph, unguarded); once
    nothing records, the patches that only keep such breaks."""
    recording = {i for i, p in enumerate(mending.patches) if p.node is not None and barriers.records(p.node)}
    node = mending.patches[index].node
    doomed = {index} | (recording if node is not None and barriers.guards(node) else set())
    if not recording - doomed:
        doomed |= {i for i in range(len(mending.patches)) if not mending.applied_in(i, outcomes)}
    return doomed


def _take_back(session: Session, doomed: set[int], reason: str, kept: list[str] | None = None) -> None:
    """Revert the patches ``doomed``; calls speculate only while a [Speculate]
    site stays. With ``kept`` (the report's lines on asserts): when patches that
    only keep graph breaks before asserts go, one line says why instead."""
    if kept is not None and any(not session.applied_in(i) for i in doomed):
        breaks = "with the graph breaks before asserts kept for them"
        kept[:] = [f"the rewrites that record ({recording_rules()}) are reverted, {breaks}: {reason}"]
    session.take_back(doomed, reason)
    target = session.target
    target.speculating = target.speculating and any(
        o.rule == SPECULATE and o.status == Status.APPLIED for o in session.outcomes.values()
    )

