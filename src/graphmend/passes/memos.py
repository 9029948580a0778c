"""Memos: hoisted memo attributes set on the user's model at mend time.

A hoisted ``if not hasattr(self, k): self.k = pure_init(...)`` would run in
the first compiled call and flip Dynamo's ``hasattr`` guard, recompiling on
the second. The initialiser is proven pure, so its value is taken from one
eager run of a private copy and set on the user's modules up front.
"""

from __future__ import annotations

import torch

from graphmend.models.targets import Target
from graphmend.rewrite.session import Session, Status, run_copy


def prefill(session: Session) -> None:
    if not session.mending.patches:
        return
    filled = fill(session.target, session.mending.memo_attrs, session.grad)
    if filled:
        for found in session.outcomes.values():
            if found.status == Status.APPLIED and any("memoised" in n for n in found.notes):
                found.notes.append(f"memo {', '.join(filled)} initialised at mend time (no first-call recompile)")


def fill(target: Target, names: set[str], grad: bool) -> list[str]:
    """Set the memo attributes ``names`` on ``target``'s modules from one eager
    run of a private copy (also what a cached mend does: cache.py); the paths set."""
    if not names or not isinstance(target.model, torch.nn.Module):
        return []
    subject = run_copy(target, grad)
    if subject is None:
        return []
    filled = []
    copies = dict(subject.model.named_modules())
    for path, module in target.model.named_modules():
        twin = copies.get(path)
        for name in names:
            if twin is not None and name in vars(twin) and name not in vars(module):
                setattr(module, name, vars(twin)[name])
                filled.append(f"{path}.{name}" if path else name)
    return filled
