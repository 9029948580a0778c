"""Scalar and dynamic-output capture, kept only where measurement shows it helps.

TorchDynamo breaks on ``.item()`` / int ``.tolist()`` (category ``TI``) and on
operators whose output shape depends on values, ``nonzero`` or
``torch.where(mask)`` (``DO``), unless two settings are on:
``torch._dynamo.config.capture_scalar_outputs`` and
``capture_dynamic_output_shape_ops``. Turned on blindly they can make things
worse: a captured scalar that a Python ``if`` then tests fails tracing
(Dynamo abandons the frame and runs it eagerly), and a captured ``nonzero``
whose result becomes a Python list raises ``GuardOnDataDependentSymNode``.

So the [Scalar] rule measures. Discovery runs the mended target again with
each candidate setting (only the ones a remaining ``TI`` / ``DO`` site calls
for) and keeps the smallest one that

* removes breaks (fewer graphs on the first call),
* adds no recompile and abandons no more frames than without it,
* raises nothing while tracing,
* leaves no Python ``assert`` testing a captured scalar: Dynamo turns it into
  a runtime assert that raises ``RuntimeError`` (an int), or drops it (a
  float, torch 2.13), where eager raises ``AssertionError``.

The decision (a :class:`Capture`) travels with the :class:`~graphmend.pipeline.MendReport`:
``graphmend.compile`` and ``bench`` apply it around every call through
``report.region()``, so the compiled program that runs is the one measured.
Whoever calls ``torch.compile`` on a mended model directly must set the
reported flags themselves.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch._dynamo

SCALAR = "capture_scalar_outputs"
DYNAMIC = "capture_dynamic_output_shape_ops"
FLAGS = (SCALAR, DYNAMIC)

#: the flag each category calls for
FLAG_FOR = {"TI": SCALAR, "DO": DYNAMIC}


@contextlib.contextmanager
def patched(flags: tuple[str, ...]) -> Iterator[None]:
    """``torch._dynamo.config`` with ``flags`` on, for the block only."""
    if not flags:
        yield
        return
    with torch._dynamo.config.patch(**{flag: True for flag in flags}):
        yield


@dataclass
class Trial:
    """One measured candidate: its graphs, recompiles, abandoned frames, or error."""

    flags: tuple[str, ...]
    graphs: int = 0
    recompiles: int = 0
    frames_skipped: int = 0
    error: str | None = None
    report: Any = None  # the ExplainReport under these flags

    def refusal(self, base: "Trial") -> str | None:
        """Why this candidate is not kept against ``base`` (None: it helps)."""
        if self.error:
            return f"tracing raised {self.error}"
        if self.report is not None and self.report.scalar_asserts:
            return (
                f"an assert tests a captured scalar ({'; '.join(self.report.scalar_asserts[:3])}): compiled, it would "
                "raise RuntimeError (an int) or not at all (a float) where eager raises AssertionError"
            )
        if self.graphs >= base.graphs:
            return f"no fewer graphs ({base.graphs} -> {self.graphs})"
        if self.recompiles > base.recompiles:
            return f"adds recompiles ({base.recompiles} -> {self.recompiles})"
        if self.frames_skipped > base.frames_skipped:
            return f"Dynamo abandons more frames ({base.frames_skipped} -> {self.frames_skipped})"
        return None


@dataclass
class Capture:
    """The capture decision for one mended target."""

    flags: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)  # one line per candidate measured
    # The other candidates that help, best first: verification tries them in turn when
    # the kept one changes what the program does.
    fallbacks: tuple[tuple[str, ...], ...] = ()

    def context(self) -> contextlib.AbstractContextManager:
        return patched(self.flags)

    def to_dict(self) -> dict[str, Any]:
        return {"flags": list(self.flags), "decision": list(self.notes)}


def candidates(categories: set[str]) -> list[tuple[str, ...]]:
    """The flag sets worth measuring for the remaining site categories, smallest first."""
    wanted = [FLAG_FOR[c] for c in ("TI", "DO") if c in categories]
    out: list[tuple[str, ...]] = [(flag,) for flag in wanted]
    if len(wanted) == 2:
        out.append(tuple(wanted))
    return out


def decide(base: Trial, measure: Callable[[tuple[str, ...]], Trial]) -> tuple[Capture, Trial]:
    """Measure each candidate against ``base`` (no capture) and keep the one
    with the fewest graphs among those that help (the smaller set on a tie).

    Returns the decision and the trial to use as the current state."""
    categories = {s.category for s in base.report.sites} if base.report is not None else set()
    trials = [measure(flags) for flags in candidates(categories)]
    helping = [t for t in trials if t.refusal(base) is None]
    helping.sort(key=lambda t: (t.graphs, len(t.flags)))
    best = helping[0] if helping else base
    decision = Capture(flags=best.flags if best is not base else (), fallbacks=tuple(t.flags for t in helping[1:]))
    for trial in trials:
        label = " + ".join(trial.flags)
        refusal = trial.refusal(base)
        if trial is best:
            verdict = "kept"
        elif refusal is None:
            verdict = "helps, but less than or as much as the one kept"
        else:
            verdict = "refused: " + refusal
        decision.notes.append(
            f"{label}: graphs {base.graphs} -> {trial.graphs}, recompiles {base.recompiles} -> "
            f"{trial.recompiles}; {verdict}" if trial.error is None else f"{label}: {verdict}"
        )
    return decision, best


def removed_sites(without: Any, with_capture: Any) -> set[tuple[str, int]]:
    """(file, line) of the sites that break without capture but not with it."""
    present = {(s.file, s.line) for s in with_capture.sites}
    return {(s.file, s.line) for s in without.sites if (s.file, s.line) not in present}


__all__ = ["DYNAMIC", "FLAGS", "SCALAR", "Capture", "Trial", "candidates", "decide", "patched", "removed_sites"]
