"""[Speculate] last: the ``.item()`` sites still breaking once the other
rewrites are installed (its proof reads the code that will run).

The round is taken back when the code does not compile, or when no guess
removed its break (a float value). ``may_run_twice`` is what the proof
assumed and a later call can change: every module in eval mode, no hooks.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from graphmend.models.targets import Target
from graphmend.passes.rounds import apply_round
from graphmend.rewrite.session import Key, Session, SiteOutcome, Status, key, run_copy
from graphmend.rules import rule_with_pass

RULE = rule_with_pass("speculation")  # the rule whose last round this is


def speculate(session: Session) -> None:
    if RULE not in session.rules:
        return
    current, outcomes, target = session.current, session.outcomes, session.target
    left = [s for s in current.sites if s.category == "TI" and (key(s) not in outcomes or outcomes[key(s)].status != Status.APPLIED)]
    if not left:
        return
    flags = session.capture.flags
    checkpoint = session.checkpoint()
    trial: dict[Key, SiteOutcome] = {}
    saved, session.outcomes = session.outcomes, trial
    try:
        applied = apply_round(session, left, (RULE,), only=RULE)
    finally:
        session.outcomes = saved
    for k, found in trial.items():
        if found.status == Status.APPLIED or k not in outcomes:
            outcomes[k] = found
        else:
            outcomes[k].notes.append(f"[speculate] {found.reason}")
    if not applied:
        return
    target.speculating = True  # later traces call it as graphmend.compile will
    _learn(target, session.grad)
    try:
        after = session.retrace(flags)
    except Exception as exc:
        target.speculating = False
        checkpoint.restore(failed=exc)
        session.current = session.retrace(flags)
        return
    remaining = {key(s) for s in after.sites}
    guessed = [k for k, o in trial.items() if o.status == Status.APPLIED]
    if all(k in remaining for k in guessed):  # no guess removed its break (a float value): undo
        target.speculating = False
        checkpoint.restore(failed=RuntimeError("no break removed"))
        for k in guessed:
            outcomes[k] = checkpoint.outcomes[k] if k in checkpoint.outcomes else outcomes[k]
            outcomes[k].notes.append(
                "[speculate] undone: the guess did not remove the break (the value is not a bool or an "
                "integer, or Dynamo breaks there for another reason)"
            )
        session.current = session.retrace(flags)
        return
    session.current = after


def _learn(target: Target, grad: bool) -> None:
    """One eager call of a private copy in a region: each [Speculate] site
    learns the value it has on the example (the first guess)."""
    run_copy(target, grad)


def may_run_twice(model: Any) -> bool:
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
