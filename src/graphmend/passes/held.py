"""Held asserts: keep what the mended code records safe from an assert that
fails inside the graph (barriers.py).

Dynamo compiles an ``assert`` that may be on tensor values into the graph;
when it fails there, the graph raises and loses what it recorded before it.
So a graph break goes before each such assert of the model's code, or, when
the breaks leave more graphs than without them (measured) or one cannot be
placed, the rewrites that record ([Defer], [Trap]) are taken back. A tie goes
to the breaks when a warning is recorded: one left in a frame Dynamo compiled
can report another line (docs/torch-issues.md). ``session.kept`` says which.
"""

from __future__ import annotations

import torch

from graphmend import runtime
from graphmend.passes import barriers
from graphmend.passes.rounds import model_files
from graphmend.rewrite.session import Session
from graphmend.rules import rules_that

WHY = (
    "an assert that may be on tensor values stays in the graph, and when it fails there it loses the "
    "output and checks recorded before it in that graph"
)


def guard_held_asserts(session: Session) -> None:
    session.current, session.kept = _guarded(session)
    if session.kept and session.capture.flags:
        session.plain = session.retrace()
    elif session.kept:
        session.plain = session.current


def _guarded(session: Session):
    """The report as installed and a line per choice."""
    current, flags, mending = session.current, session.capture.flags, session.mending
    checkpoint = session.checkpoint()
    try:
        changed, failed = barriers.guard_model(session.target.model, mending, mending.groups, model_files(session.target.model, bases=True))
    except Exception as exc:  # never fail the user's model for an internal error: the safe way
        checkpoint.restore()
        changed, failed = [], [f"the asserts (internal error: {type(exc).__name__}: {exc})"]
    if not changed and not failed:
        return current, []
    with_breaks = None
    if not failed:
        try:
            _settle(session)
            with_breaks = session.retrace(flags)
        except Exception:  # the guarded code does not compile: the other way
            with_breaks = None
        if with_breaks is not None and with_breaks.graphs <= current.graphs:
            return with_breaks, [_kept(c) for c in changed]
    breaks = session.checkpoint()
    checkpoint.restore()
    recording = {k for p in mending.patches if p.node is not None for k in barriers.records(p.node)}
    if with_breaks is None:
        reason = f"no graph break could be put before {(failed or changed)[0]}, and {WHY}"
    else:
        reason = (
            f"graph breaks before {'; '.join(changed)} would leave {with_breaks.graphs - current.graphs} "
            f"more graph(s), and without them {WHY}"
        )
    session.take_back_rules(set(rules_that("records")), reason)
    without = session.retrace(flags)
    if with_breaks is not None and (
        with_breaks.graphs < without.graphs or (with_breaks.graphs == without.graphs and "warn" in recording)
    ):
        breaks.restore()
        return with_breaks, [_kept(c) for c in changed]
    return without, [f"the rewrites that record ({recording_rules()}) are reverted: {reason}"]


def _settle(session: Session) -> None:
    """Run the guarded model once eagerly (output captured, in a region) to
    see which held tests are tensors, and give those a graph break before the
    test (barriers.settle): cheaper than ``held``'s at the start of a frame."""
    runtime.HELD_PROBE = probed = set()
    try:
        session.observe(in_region=True)
    finally:
        runtime.HELD_PROBE = None
    if probed and barriers.settle_model(session.mending, probed):
        torch._dynamo.reset()


def _kept(change: str) -> str:
    return f"a graph break goes before {change} whenever its test is a tensor (runtime.held): {WHY}"


def recording_rules() -> str:
    """``[defer], [trap]``: the rules whose rewrites record into a region."""
    return ", ".join(f"[{name}]" for name in rules_that("records"))
