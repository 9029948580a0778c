"""One mend of one target: the state every pass of the pipeline reads and changes.

A :class:`Session` owns the target, the installed patches (a
:class:`Mending`, each patch knowing the sites it applies), every site's
outcome, and the measurements so far. Two ways back, and only two:

- ``checkpoint()`` / ``Checkpoint.restore()``: the patches, their sites and
  the outcomes exactly as they were (a trial, a round that failed);
- ``take_back(patches, reason)``: undo chosen patches for good; their
  applied sites become ``reverted`` with the reason the user reads.

The measures (``trial``, ``retrace``, ``worse``) trace a private copy of the
target (sharing its parameters: discover/weights.py), so a pass never runs
the user's model itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from graphmend import runtime
from graphmend.analysis import source
from graphmend.analysis.source import RUNTIME_NAME
from graphmend.discover.capture import Capture, Trial
from graphmend.discover.explain import ExplainReport, report_from_trace
from graphmend.discover.sites import BreakSite, display_path
from graphmend.discover.trace import trace_breaks
from graphmend.discover.weights import ParameterWritten, private
from graphmend.errors import describe
from graphmend.models.targets import Target
from graphmend.rewrite import engine
from graphmend.rewrite.verify import Observation, compare, observe, quiet

Key = tuple  # (file, line) of a site


class Status(str, enum.Enum):
    """How a site ended: what code and tests match on (``reason`` is for people).
    A str, so it prints, compares and serialises as its value."""

    APPLIED = "applied"
    DECLINED = "declined"  # the rule's reason says why
    REVERTED = "reverted"  # verification found a difference, or the program got worse with it
    OUT_OF_SCOPE = "out of scope"  # no rule addresses its category

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass
class SiteOutcome:
    file: str
    line: int
    function: str
    code: str
    category: str
    rule: str | None
    status: Status
    reason: str
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.status = Status(self.status)

    @property
    def path(self) -> str:
        return display_path(self.file)

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "path": self.path,
            "line": self.line,
            "function": self.function,
            "code": self.code,
            "category": self.category,
            "rule": self.rule,
            "status": self.status.value,
            "reason": self.reason,
            "notes": list(self.notes),
        }


def key(site: BreakSite) -> Key:
    return (site.file, site.line)


def outcome(site: BreakSite, status: Status, reason: str, rule: str | None, notes: Any = ()) -> SiteOutcome:
    return SiteOutcome(
        file=site.file,
        line=site.line,
        function=site.function,
        code=site.code,
        category=site.category,
        rule=rule,
        status=status,
        reason=reason,
        notes=list(notes),
    )


def copy_outcome(found: SiteOutcome) -> SiteOutcome:
    return dataclasses.replace(found, notes=list(found.notes))


class Mending:
    """The patches installed for one target; ``undo`` restores every original."""

    def __init__(self) -> None:
        self.patches: list[engine.Patch] = []
        self.memo_attrs: set[str] = set()  # attributes rewrites may create early (not state differences)
        self.unalias: set[str] = set()  # buffers rewrites update in place: given their own storage (engine.unalias_buffers)
        self.target: Target | None = None  # what was mended, with its example inputs
        self.report: Any = None  # the MendReport, set by the API that made it
        self.groups: dict[int, list[Key]] = {}  # patch index -> the sites it applies
        self.touched: dict[int, Any] = {}  # id -> every function a patch was installed in (``Session.state``)

    @contextlib.contextmanager
    def original_code(self) -> Any:
        """The original code of every patched function, for the block."""
        codes = [(fn, fn.__code__) for p in self.patches for fn in p.located.functions]
        for patch in self.patches:
            for fn in patch.located.functions:
                fn.__code__ = patch.original_code
        torch._dynamo.reset()
        try:
            yield
        finally:
            for fn, code in codes:
                fn.__code__ = code
            torch._dynamo.reset()

    def applied_in(self, index: int, outcomes: dict[Key, "SiteOutcome"]) -> bool:
        """Whether patch ``index`` holds an applied site (not only graph breaks before asserts)."""
        return any(outcomes[k].status == Status.APPLIED for k in self.groups.get(index, []) if k in outcomes)

    def by_code(self) -> dict[int, engine.Patch]:
        return {id(p.new_code): p for p in self.patches}

    def add(self, patch: engine.Patch, keys: list[Key]) -> None:
        """Install ``patch`` for the sites ``keys``; a later round's patch of the
        same function takes its earlier one's place and adds to its sites."""
        self.touched.update((id(fn), fn) for fn in patch.located.functions)
        previous = patch.located.previous
        if previous is not None:
            index = self.patches.index(previous)
            self.patches[index] = patch
            self.groups[index] = self.groups.get(index, []) + keys
        else:
            self.patches.append(patch)
            self.groups[len(self.patches) - 1] = keys

    def undo(self) -> None:
        for patch in reversed(self.patches):
            patch.uninstall()
        self.patches.clear()
        self.groups.clear()
        torch._dynamo.reset()

    def __enter__(self) -> "Mending":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()


@dataclass
class Session:
    """What the passes share while one target is mended (pipeline.py)."""

    target: Target
    rules: tuple[str, ...]
    grad: bool = False
    verify: bool = True
    max_rounds: int = 3
    mending: Mending = field(default_factory=Mending)
    outcomes: dict[Key, SiteOutcome] = field(default_factory=dict)
    observed: list[tuple[Any, ...]] = field(default_factory=list)  # frame chains of every break seen (chains.py)
    baseline: Observation | None = None  # the original's behaviour (eager)
    before: ExplainReport | None = None  # the original's breaks
    current: ExplainReport | None = None  # as installed, traced with the kept capture flags
    plain: ExplainReport | None = None  # as installed, traced without capture
    capture: Capture = field(default_factory=Capture)
    rounds: int = 0
    kept: list[str] = field(default_factory=list)  # graph breaks kept before asserts, or why not (barriers.py)
    differences: list[str] = field(default_factory=list)
    verified: bool | None = None  # None: verification off
    started: float = field(default_factory=time.perf_counter)
    stage: Any = None  # graphmend.compile's backend: traces go through it, recording (rewrite/fallback.py)
    staged: tuple | None = None  # ``state()`` as the last trace through ``stage`` saw it; None: none kept
    pass_seconds: dict[str, float] = field(default_factory=dict)  # each pass's wall time (pipeline.mend_target)
    pass_traces: dict[str, tuple[int, int]] = field(default_factory=dict)  # each pass's (model calls, frames) under Dynamo

    @property
    def groups(self) -> dict[int, list[Key]]:
        return self.mending.groups

    # -- running the target ------------------------------------------------

    def observe(self, in_region: bool, compiled: tuple[str, ...] | None = None) -> Observation:
        """One eager run of the target as installed: the original's behaviour
        when nothing is (``in_region=False``), the mended one's in a region;
        with ``compiled``, through torch.compile with those capture flags (through
        ``stage`` when there is one: that run's trace can be the compile's)."""
        t = self.target
        if compiled is None:
            return observe(t.model, t.args, t.kwargs, in_region=in_region, grad=self.grad)
        self.staged = None
        backend = self.stage if self.stage is not None else "eager"
        found = observe(t.model, t.args, t.kwargs, in_region=in_region, grad=self.grad, compiled=compiled, backend=backend)
        if found.staged:
            self.staged = self.state(compiled)
        return found

    def differences_from(self, baseline: Observation, compiled: tuple[str, ...] | None = None) -> list[str]:
        """What the installed code does differently from ``baseline``; with
        ``compiled``, run through torch.compile with those capture flags."""
        return self.compared(baseline, compiled)[0]

    def compared(self, baseline: Observation, compiled: tuple[str, ...] | None = None) -> tuple[list[str], Observation]:
        """``differences_from``'s lines and the run they were read from (one run,
        where a caller reads more of it: one trace, which can be the compile's)."""
        observed = self.observe(in_region=True, compiled=compiled)
        return compare(baseline, observed, memo_attrs=self.mending.memo_attrs), observed

    def trial(self, flags: tuple[str, ...] = ()) -> Trial:
        self.staged = None
        found = trial(self.target, self.grad, flags, self.stage)
        if self.stage is not None and found.report is not None:
            self.staged = self.state(flags)
        return found

    def retrace(self, flags: tuple[str, ...] = ()) -> ExplainReport:
        """The breaks of the code as installed, traced with capture ``flags``."""
        found = self.trial(flags)
        if found.report is None:  # only with flags: a tracing error is recorded, not raised
            raise RuntimeError(found.error)
        return found.report

    def state(self, flags: tuple[str, ...]) -> tuple:
        """What a trace's graphs depend on beyond Dynamo's guards: the code of every
        function a patch was ever installed in (Dynamo guards an inlined function by
        identity, not its ``__code__``), the capture flags, speculation, the grad mode."""
        codes = tuple((fn, fn.__code__) for _, fn in sorted(self.mending.touched.items()))
        return (codes, tuple(flags), self.target.speculating, self.grad)

    def keeps_staged(self) -> bool:
        """Whether Dynamo's cache holds the last trace through ``stage`` of the code as
        installed now, with the kept capture flags (the first call then compiles it);
        else the cache is reset, and the first call traces again."""
        same = self.staged is not None and _same_state(self.staged, self.state(self.capture.flags))
        if self.stage is not None and not same:
            torch._dynamo.reset()
        if not (same and _cached()):  # (a reset since, with no trace after it: nothing kept)
            self.staged = None
        return self.staged is not None

    # -- the ways back -----------------------------------------------------

    def checkpoint(self) -> "Checkpoint":
        return Checkpoint(self)

    def applied_in(self, index: int) -> bool:
        return self.mending.applied_in(index, self.outcomes)

    def take_back(self, doomed: set[int], reason: str) -> bool:
        """Undo the patches at the indices ``doomed`` for good; each applied
        site of those patches becomes ``reverted`` with ``reason``. Whether any went."""
        if not doomed:
            return False
        kept: list[engine.Patch] = []
        groups: dict[int, list[Key]] = {}
        for index, patch in enumerate(self.mending.patches):
            if index in doomed:
                patch.uninstall()
                for k in self.groups.get(index, []):
                    if self.outcomes[k].status == Status.APPLIED:
                        self.outcomes[k].status = Status.REVERTED
                        self.outcomes[k].reason = reason
            else:
                groups[len(kept)] = self.groups.get(index, [])
                kept.append(patch)
        self.mending.patches[:] = kept
        self.groups.clear()
        self.groups.update(groups)
        torch._dynamo.reset()
        return True

    def take_back_rules(self, rules: set[str], reason: str) -> bool:
        """``take_back`` every patch holding a site one of ``rules`` applied."""
        doomed = {
            index for index, keys in self.groups.items()
            if any(self.outcomes[k].status == Status.APPLIED and self.outcomes[k].rule in rules for k in keys if k in self.outcomes)
        }
        return self.take_back(doomed, reason)


class Checkpoint:
    """The installed patches, their sites and the outcomes, to go back to
    exactly (the codes of every patched function, the runtime in their
    globals, the mended sources)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        mending = session.mending
        self.patches = list(mending.patches)
        self.groups = {k: list(v) for k, v in mending.groups.items()}
        self.outcomes = dict(session.outcomes)  # the objects themselves: which changed since
        self.saved = {k: copy_outcome(o) for k, o in session.outcomes.items()}
        self.codes = [(fn, fn.__code__) for p in mending.patches for fn in p.located.functions]
        self.speculating = session.target.speculating

    def restore(self, failed: BaseException | None = None) -> None:
        """Back to the checkpoint. With ``failed`` (the installed code failed
        under torch.compile), the outcomes since are kept and each site applied
        since becomes ``reverted``, naming the error."""
        session, mending = self.session, self.session.mending
        for patch in mending.patches:
            if not any(patch is p for p in self.patches):
                patch.uninstall()
        for fn, code in self.codes:
            fn.__code__ = code
        for patch in self.patches:
            patch.located.namespace.setdefault(RUNTIME_NAME, runtime)
            source.MENDED[id(patch.new_code)] = patch.node
        mending.patches[:] = self.patches
        mending.groups.clear()
        mending.groups.update({k: list(v) for k, v in self.groups.items()})
        session.target.speculating = self.speculating
        if failed is None:
            session.outcomes.clear()
            session.outcomes.update({k: copy_outcome(o) for k, o in self.saved.items()})
        else:
            message = str(failed).strip().splitlines()[0] if str(failed).strip() else type(failed).__name__
            for k, found in session.outcomes.items():
                if self.outcomes.get(k) is not found and found.status == Status.APPLIED:
                    found.status = Status.REVERTED
                    found.reason = f"the rewritten code failed under torch.compile: {type(failed).__name__}: {message}"
        torch._dynamo.reset()


def run_copy(target: Target, grad: bool) -> Target | None:
    """One eager call of a private copy of ``target`` in a region, its output
    captured: the copy as the call left it, or None when the call raised."""
    with private(target) as subject:
        try:
            with quiet(), runtime.region(), (torch.enable_grad() if grad else torch.no_grad()):
                subject.model(*subject.args, **subject.kwargs)
        except Exception:
            return None
    return subject


def _cached() -> bool:
    """Whether Dynamo's cache holds code a trace made (``torch._dynamo.reset`` empties
    it): with no trace since the last staged one, that trace's."""
    made = getattr(getattr(torch._dynamo.convert_frame, "output_codes", None), "seen_ids", None)
    return bool(made)


def _same_state(a: tuple, b: tuple) -> bool:
    (codes_a, *rest_a), (codes_b, *rest_b) = a, b
    return rest_a == rest_b and len(codes_a) == len(codes_b) and all(
        fa is fb and ca is cb for (fa, ca), (fb, cb) in zip(codes_a, codes_b)
    )


def trial(target: Target, grad: bool, flags: tuple[str, ...], stage: Any = None) -> Trial:
    """Trace a private copy with ``flags`` on; a tracing error is recorded, not raised.
    ``stage``: through graphmend.compile's backend, recording (trace.trace_breaks)."""
    try:
        with private(target) as subject:
            trace = trace_breaks(
                subject.model, subject.args, subject.kwargs, grad=grad, capture=flags,
                speculating=target.speculating, stage=stage,
            )
    except ParameterWritten:
        raise
    except Exception as exc:
        if not flags:
            raise
        return Trial(flags, error=describe(exc))
    report = report_from_trace(target.name, trace, stage.dynamic if stage is not None else False)
    return Trial(flags, report.graphs, report.recompiles, trace.frames_skipped, report=report)


def measure(report: ExplainReport) -> tuple[int, int, int]:
    return report.graphs, report.recompiles, report.frames_skipped


def worse(after: ExplainReport, before: ExplainReport) -> bool:
    """More graphs, more recompiles or more frames Dynamo abandoned than ``before``."""
    return any(a > b for a, b in zip(measure(after), measure(before)))


def excess(after: ExplainReport, before: ExplainReport) -> int:
    """How much worse ``after`` is than ``before``, summed over the three measures."""
    return sum(max(0, a - b) for a, b in zip(measure(after), measure(before)))


def shown(report: ExplainReport) -> str:
    graphs, recompiles, skipped = measure(report)
    return f"{graphs} graph(s), {recompiles} recompile(s), {skipped} frame(s) skipped"


def dropped(capture: Capture, reason: str) -> Capture:
    """No capture flags, the decision's lines and why they were dropped."""
    if not capture.flags:
        return capture
    return Capture(notes=capture.notes + [f"{' + '.join(capture.flags)}: dropped, {reason}"])
