"""``explain``: every graph break of a target, why, and which rule can fix it.

The pipeline, top to bottom::

    target --run eagerly--> ok? --trace_breaks--> Trace --group_sites--> sites
           --> ExplainReport (graphs, breaks, sites, recompiles, warnings)

``breaks`` is the paper's measure, ``max(0, graphs - 1)`` over the first call.
It can exceed the number of sites: a break inside a callee splits the caller
and, when the callee is then compiled as its own frame, the callee too.

JSON schema (``ExplainReport.to_dict``, ``schema`` = 1)::

    {
      "schema": 1, "target": str, "torch": str,
      "graphs": int,            # graphs compiled by the first call
      "breaks": int,            # max(0, graphs - 1)
      "graphs_per_call": [int], # new graphs on each call
      "ops_per_graph": [int],
      "recompiles": int,
      "break_events": int,      # events in Dynamo's graph_breaks log
      "frames_skipped": int,    # frames Dynamo abandoned and ran eagerly
      "fallbacks_to_eager": int,  # the same count, by the name torch's benchmarks give it
      "calls_captured": int,    # ops in the graphs (torch's count; what a break costs in capture)
      "gave_up": bool,          # graphs == 0: Dynamo skipped the whole frame
      "seconds": float,
      "categories": {CAT: int}, # sites per category
      "warnings": [str],
      "sites": [{"file", "path", "line", "function", "code", "category",
                 "reason", "gb_id", "rule" (null when out of scope),
                 "verdict", "events", "frames": [{"file","line","function","code"}]}]
    }
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from graphmend.discover.isolation import random_state_kept
from graphmend.discover.sites import (
    BreakSite,
    assert_sites,
    compiler_check_sites,
    group_sites,
)
from graphmend.discover.trace import Trace, trace_breaks
from graphmend.discover.weights import private
from graphmend.errors import CompileFailure, GraphmendError, describe, root_cause
from graphmend.models.targets import Target, run_eager, target_from_objects

SCHEMA_VERSION = 1


@dataclass
class ExplainReport:
    target: str
    graphs: int
    graphs_per_call: list[int]
    ops_per_graph: list[int]
    recompiles: int
    break_events: int
    frames_skipped: int
    seconds: float
    calls_captured: int = 0
    dynamic: bool | None = False  # torch.compile's `dynamic`: False each shape static, None automatic
    sites: list[BreakSite] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    scalar_asserts: list[str] = field(default_factory=list)  # asserts on captured scalars (trace._scalar_asserts)

    @property
    def breaks(self) -> int:
        return max(0, self.graphs - 1)

    @property
    def fallbacks_to_eager(self) -> int:
        """Frames Dynamo saw and ran eagerly (torch's benchmarks' name for it, #191357)."""
        return self.frames_skipped

    @property
    def gave_up(self) -> bool:
        return self.graphs == 0

    @property
    def categories(self) -> dict[str, int]:
        return dict(Counter(s.category for s in self.sites))

    @property
    def fixable(self) -> list[BreakSite]:
        """Sites a rule addresses and, where the rule was offered them (``graphmend
        explain``, ``graphmend.explain``), accepts."""
        return [s for s in self.sites if s.rule is not None and not s.declined]

    @property
    def declined(self) -> list[BreakSite]:
        """Sites whose rule, offered them, declines (each says why)."""
        return [s for s in self.sites if s.rule is not None and s.declined]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "target": self.target,
            "torch": torch.__version__,
            "graphs": self.graphs,
            "breaks": self.breaks,
            "graphs_per_call": list(self.graphs_per_call),
            "ops_per_graph": list(self.ops_per_graph),
            "recompiles": self.recompiles,
            "dynamic": "static" if self.dynamic is False else "auto",
            "break_events": self.break_events,
            "frames_skipped": self.frames_skipped,
            "fallbacks_to_eager": self.fallbacks_to_eager,
            "calls_captured": self.calls_captured,
            "gave_up": self.gave_up,
            "seconds": round(self.seconds, 3),
            "categories": self.categories,
            "warnings": list(self.warnings),
            "sites": [s.to_dict() for s in self.sites],
        }


def report_from_trace(name: str, trace: Trace, dynamic: bool | None = False) -> ExplainReport:
    sites = group_sites(trace.events)
    asserts = [a for g in trace.graphs for a in g.asserts]
    sites += assert_sites(asserts, {(s.file, s.line) for s in sites})
    sites += compiler_check_sites(sites)
    report = ExplainReport(
        target=name,
        graphs=trace.graph_count,
        graphs_per_call=list(trace.graphs_per_call),
        ops_per_graph=[g.ops for g in trace.graphs],
        recompiles=trace.recompiles,
        break_events=len(trace.events),
        frames_skipped=trace.frames_skipped,
        seconds=trace.seconds,
        calls_captured=trace.calls_captured,
        dynamic=dynamic,
        sites=sites,
        scalar_asserts=list(dict.fromkeys(a for g in trace.graphs for a in g.scalar_asserts)),
    )
    if report.gave_up:
        report.warnings.append(
            "Dynamo compiled no graph: it gave up on the whole frame, so 0 breaks does not mean fixed"
        )
    elif report.graphs > 1 and not trace.events:
        report.warnings.append(
            f"{report.graphs} graphs but no break in Dynamo's log: the split has a cause graphmend cannot see"
        )
    elif not trace.entry_captured:
        report.warnings.append(
            "no graph covers the entry frame: Dynamo ran it eagerly (a break inside a "
            "for/while loop does this, GB7000); the graphs come from frames it calls"
        )
    if trace.frames_skipped:
        report.warnings.append(
            f"Dynamo abandoned {trace.frames_skipped} frame(s) and ran them eagerly; "
            "breaks hidden behind them appear once the visible ones are fixed"
        )
    if report.recompiles and dynamic is False:
        # A frame met again with other shapes (a resumed frame per layer size, or a
        # later call) is one more graph here; torch.compile's default marks those
        # dims dynamic after the first recompile and may compile fewer graphs.
        report.warnings.append(
            f"{report.recompiles} recompile(s) over the example calls, counted with dynamic=False (each new shape "
            "a new graph); torch.compile's default (automatic dynamic shapes) may compile fewer: "
            "`--dynamic auto` counts as it does"
        )
    elif report.recompiles:
        report.warnings.append(f"{report.recompiles} recompile(s) over the example calls")
    return report


def explain_target(
    target: Target, *, calls: int = 1, grad: bool = False, dynamic: bool | None = False, stage: Any = None
) -> ExplainReport:
    """Explain a loaded target: run it eagerly (it must work), then trace it.
    Both runs use private copies (weights.py): the user's model and inputs are
    not touched, nor the random generators. ``stage``: trace through that
    recording backend (trace.trace_breaks)."""
    with random_state_kept():
        with private(target) as subject:
            run_eager(subject, grad)
        try:
            with private(target) as subject:
                trace = trace_breaks(
                    subject.model, subject.args, subject.kwargs, calls=calls, grad=grad, dynamic=dynamic, stage=stage
                )
        except GraphmendError:
            raise
        except Exception as exc:
            frame = getattr(exc, "innermost_user_frame_summary", None)
            where = f" ({os.path.basename(frame.filename)}:{frame.lineno})" if frame is not None else ""
            raise CompileFailure(
                f"{target.name}: torch.compile raises on the model (it runs eagerly): {describe(root_cause(exc), 300)}{where}"
            ) from exc
    return report_from_trace(target.name, trace, stage.dynamic if stage is not None else dynamic)


def explain(model_or_fn: Any, *args: Any, **kwargs: Any) -> ExplainReport:
    """Every graph break of ``model_or_fn(*args, **kwargs)`` under torch.compile.

    Returns an :class:`ExplainReport`; ``report.to_dict()`` gives the JSON form.
    """
    return explain_target(target_from_objects(model_or_fn, args, kwargs))
