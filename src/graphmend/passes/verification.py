"""Verification: the mended model, run eagerly inside a region, against the
original's behaviour (outputs, state, printed text, log records, warnings,
exceptions; rewrite/verify.py compares). On a difference every patch is
taken off and put back one at a time, each kept only if the target still
verifies with it (``bisect``); its sites become ``reverted`` with the
difference.

Capture flags change nothing in an eager run: with a flag kept, the mended
model runs once more through ``torch.compile`` (eager backend) with it on
(``verify_capture``); on a difference the flag is dropped, with the
difference as the reason, and the sites it removed break again.
"""

from __future__ import annotations

import torch

from graphmend import runtime
from graphmend.analysis.source import RUNTIME_NAME
from graphmend.passes.capturing import with_capture
from graphmend.rewrite.session import Session, SiteOutcome, Status, dropped


def verify(session: Session) -> None:
    if not (session.verify and session.mending.patches):
        return
    assert session.baseline is not None
    session.differences = session.differences_from(session.baseline)
    session.verified = not session.differences
    if session.differences:
        session.plain = bisect(session)
        session.current, session.capture = with_capture(session, session.plain)
        session.verified = True  # what remains installed verified on its own


def verify_capture(session: Session) -> None:
    if not (session.verify and session.capture.flags):
        return
    assert session.baseline is not None
    diff = session.differences_from(session.baseline, compiled=session.capture.flags)
    if diff:
        session.capture = dropped(session.capture, "verification under torch.compile found a difference: " + "; ".join(diff[:3]))
        session.plain = session.current = session.retrace()
    elif session.verified is None:
        session.verified = True  # nothing rewritten: the flags alone, verified


def bisect(session: Session):
    """Keep each patched function only if the target verifies with it installed;
    the report of what is left, traced without capture."""
    mending, outcomes = session.mending, session.outcomes
    patches, groups = list(mending.patches), dict(mending.groups)
    for patch in reversed(patches):
        patch.uninstall()
    mending.patches.clear()
    mending.groups.clear()
    for index, patch in enumerate(patches):
        for fn in patch.located.functions:
            fn.__code__ = patch.new_code
        patch.located.namespace.setdefault(RUNTIME_NAME, runtime)
        torch._dynamo.reset()
        diff = session.differences_from(session.baseline)
        if diff:
            for fn in patch.located.functions:
                fn.__code__ = patch.original_code
            for k in groups.get(index, []):
                old = outcomes[k]
                outcomes[k] = SiteOutcome(
                    file=old.file, line=old.line, function=old.function, code=old.code,
                    category=old.category, rule=old.rule, status=Status.REVERTED,
                    reason="verification found a difference: " + "; ".join(diff[:3]), notes=old.notes,
                )
        else:
            mending.groups[len(mending.patches)] = groups.get(index, [])  # its sites, at its new place
            mending.patches.append(patch)
    torch._dynamo.reset()
    return session.retrace()
