"""Verification: the mended model, run eagerly inside a region, against the
original's behaviour (outputs, state, printed text, log records, warnings,
exceptions; rewrite/verify.py compares). On a difference every patch is
taken off and put back one at a time, each kept only if the target still
verifies with it (``bisect``); its sites become ``reverted`` with the
difference.

Capture flags change nothing in an eager run: with a flag kept, the mended
model runs once more through ``torch.compile`` (eager backend) with it on
(``verify_capture``); on a difference the flag is dropped, with the
difference as the reason, and the next candidate that helped is tried the
same way (torchvision's R-CNNs: both flags make a runtime assert fail where
eager does not, one alone does not); with none left the sites break again.
"""

from __future__ import annotations

import torch

from graphmend import runtime
from graphmend.analysis.source import RUNTIME_NAME
from graphmend.discover.capture import Capture
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
    """The kept capture flags, run compiled against eager; where they change what the
    program does, the next candidate that helps (``Capture.fallbacks``), else none."""
    if not (session.verify and session.capture.flags):
        return
    assert session.baseline is not None
    capture = session.capture
    for flags in (capture.flags, *capture.fallbacks):
        diff = session.differences_from(session.baseline, compiled=flags)
        if not diff:
            break
        capture = dropped(Capture(flags=flags, notes=capture.notes), "verification under torch.compile found a difference: " + "; ".join(diff[:3]))
    else:
        session.capture = capture
        session.plain = session.current = session.retrace()
        return
    if flags != session.capture.flags:  # a fallback verified: kept instead, measured again
        capture.notes.append(f"{' + '.join(flags)}: kept instead (it helps too)")
        session.capture = Capture(flags=flags, notes=capture.notes)
        session.current = session.retrace(flags)
    if session.verified is None:
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
