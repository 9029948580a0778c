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
The place a warning of torch's own names is not compared where it is a frame
inside torch under torch.compile and the model's line eagerly (same warnings,
same order; ``relocated_by_compile``, diffusers' Mochi: autocast's dtype
warning); the kept flag's note says so.
"""

from __future__ import annotations

import torch

from graphmend import runtime
from graphmend.analysis.source import RUNTIME_NAME
from graphmend.discover.capture import Capture
from graphmend.passes.capturing import with_capture
from graphmend.rewrite.session import Session, SiteOutcome, Status, dropped
from graphmend.rewrite.verify import relocated_by_compile


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
        diff = _compiled_differences(session, flags, capture.notes)
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


def _compiled_differences(session: Session, flags: tuple[str, ...], notes: list[str]) -> list[str]:
    """How the program run through torch.compile with ``flags`` differs from eager;
    nothing where the only difference is the place torch's own warnings name (noted)."""
    assert session.baseline is not None
    diff, flagged = session.compared(session.baseline, compiled=flags)  # one trace: it can be the compile's (staged)
    if diff and all(line.startswith("warnings:") for line in diff):
        if relocated_by_compile(session.baseline, flagged, session.mending.memo_attrs):
            notes.append(f"{' + '.join(flags)}: verified; torch's own warnings name a frame inside torch where "
                         "eager names the model's line (same warnings, same order)")
            return []
    return diff


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
