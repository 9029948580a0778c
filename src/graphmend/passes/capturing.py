"""Measured capture: Dynamo's capture flags, kept only where a measured trace
of the mended code shows they help (discover/capture.py decides).

Once, after the source rewrite rounds (a source rewrite beats a captured host
read): the flags are measured on the code as installed; when the program is
still worse than the original, the capture rule's source rewrites are taken
back and capture measured again. With a flag kept, more rounds run traced
with it, since a frame Dynamo skipped before can compile now and show breaks
it hid. At the end, sites that break without the kept flags and not with
them are credited to the capture rule.
"""

from __future__ import annotations

from graphmend.discover.capture import Capture, Trial, decide, removed_sites
from graphmend.discover.explain import ExplainReport
from graphmend.passes.rounds import rounds
from graphmend.rewrite.session import Session, Status, key, outcome, worse
from graphmend.rules import rule_with_pass, rules_that

CAPTURE_RULE = rule_with_pass("capture")  # the rule whose mechanism includes measured capture


def capture(session: Session) -> None:
    """Measure capture once on the mended code; when the program is still
    worse than the original, without the capture rule's rewrites."""
    session.plain = session.current
    session.current, session.capture = with_capture(session, session.plain)
    reason = (
        f"with this rewrite and no capture setting that helps, the program got worse (graphs {session.before.graphs} "
        f"-> {session.current.graphs}, recompiles {session.before.recompiles} -> {session.current.recompiles})"
    )
    if worse(session.current, session.before) and session.take_back_rules({CAPTURE_RULE}, reason):
        session.plain = session.retrace()
        session.current, session.capture = with_capture(session, session.plain)


def rounds_with_capture(session: Session) -> None:
    """With a flag kept, more rounds traced with it. Not [Trap]: a captured
    conversion that raises in the flag's graph would lose the check's
    exception (``with_capture``)."""
    if session.capture.flags:
        later = tuple(r for r in session.rules if r not in rules_that("defers_raise"))
        session.rounds += rounds(session, later, session.capture.flags)


def with_capture(session: Session, plain: ExplainReport) -> tuple[ExplainReport, Capture]:
    """(report under the kept flags, decision); ``plain`` was traced without capture.

    Not measured when a [Trap] rewrite is applied: capture pulls scalar
    conversions (``int(t.item())``, which raises on NaN) into the graph that
    computes the trapped flag, and a graph that raises loses the flag, so the
    later error would replace the check's exception."""
    if CAPTURE_RULE not in session.rules:
        return plain, Capture()
    trapped = [o for o in session.outcomes.values() if o.status == Status.APPLIED and o.rule in rules_that("defers_raise")]
    if trapped and any(s.category in ("TI", "DO") for s in plain.sites):
        return plain, Capture(notes=[
            f"not measured: {len(trapped)} trapped check(s) applied; a captured scalar conversion that raises "
            "in the same graph would lose the check's exception"
        ])
    base = Trial((), plain.graphs, plain.recompiles, plain.frames_skipped, report=plain)
    decision, best = decide(base, session.trial)
    return best.report, decision


def credit(session: Session) -> None:
    """Sites that break without the kept flags but not with them: applied by capture."""
    if not session.capture.flags:
        return
    by_key = {key(s): s for s in session.plain.sites}
    reason = "removed by " + " + ".join(session.capture.flags) + " (measured; applied by graphmend.compile)"
    for k in sorted(removed_sites(session.plain, session.current)):
        old = session.outcomes.get(k)
        if old is not None and old.status == Status.APPLIED:
            continue
        notes = [f"no source rewrite: {old.reason}"] if old is not None and old.status == Status.DECLINED else []
        session.outcomes[k] = outcome(by_key[k], Status.APPLIED, reason, CAPTURE_RULE, notes)
