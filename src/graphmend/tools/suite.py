"""``graphmend suite``: the paper's Table 2 beside ours, row by row.

Each row (every ``zoo:`` target and ``demo``) runs in its own process:
explain and mend with the counting backend (breaks before and after, rules
that fired, verification), then, unless ``--quick``, ``bench`` with Inductor
(cold-start and steady-state ratios, output agreement). ``--jobs N`` runs
rows in parallel processes. The table puts the paper's breaks, fix rate and
our own side by side, with totals; ``--json PATH`` writes the data and a PNG
chart next to it (breaks before/after and the cold-start ratio per row).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

ROW_MODULE = "graphmend.tools.suite"


@dataclass
class SuiteReport:
    quick: bool
    rows: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def totals(self) -> dict[str, Any]:
        ok = [r for r in self.rows if r.get("ok")]
        before = sum(r["breaks_before"] for r in ok)
        after = sum(r["breaks_after"] for r in ok)
        paper = [r for r in ok if r.get("paper_before") is not None]
        return {
            "rows": len(self.rows),
            "rows_failed": len(self.rows) - len(ok),
            "breaks_before": before,
            "breaks_after": after,
            "breaks_eliminated": before - after,
            "calls_captured_before": sum(r["calls_captured_before"] for r in ok),
            "calls_captured_after": sum(r["calls_captured_after"] for r in ok),
            "fallbacks_to_eager_before": sum(r["fallbacks_to_eager_before"] for r in ok),
            "fallbacks_to_eager_after": sum(r["fallbacks_to_eager_after"] for r in ok),
            "fix_rate": round(100 * (before - after) / before, 1) if before else None,
            "rows_fully_fixed": sum(1 for r in ok if r["breaks_before"] and not r["breaks_after"]),
            "rows_with_breaks": sum(1 for r in ok if r["breaks_before"]),
            "paper_rows": len(paper),
            "paper_breaks_before": sum(r["paper_before"] for r in paper),
            "paper_breaks_after": sum(r["paper_after"] for r in paper),
        }

    def to_dict(self) -> dict[str, Any]:
        return {"schema": 1, "quick": self.quick, "seconds": round(self.seconds, 1), "rows": self.rows, "totals": self.totals()}


def default_rows() -> list[str]:
    from graphmend.models import zoo

    return list(zoo.ROWS) + ["demo"]


def run_suite(
    rows: list[str] | None = None,
    *,
    quick: bool = False,
    jobs: int = 1,
    timeout: float = 1200.0,
    progress: Callable[[str], None] | None = None,
    warm: bool = False,
) -> SuiteReport:
    """``warm``: each row's timing also with a warm mend cache (bench --mend-cache warm)."""
    rows = rows or default_rows()
    report = SuiteReport(quick=quick)
    start = time.perf_counter()
    report.rows = run_each(rows, lambda name: _run_row(name, quick, timeout, warm), jobs, progress)
    report.seconds = time.perf_counter() - start
    return report


def run_each(
    names: list[str], one: Callable[[str], dict[str, Any]], jobs: int, progress: Callable[[str], None] | None
) -> list[dict[str, Any]]:
    """``one(name)`` for every name, ``jobs`` at a time, in order; ``progress(name)`` as each ends."""

    def each(name: str) -> dict[str, Any]:
        result = one(name)
        if progress is not None:
            progress(name)
        return result

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(each, names))


def _run_row(name: str, quick: bool, timeout: float, warm: bool = False) -> dict[str, Any]:
    flags = (["--quick"] if quick else []) + (["--warm"] if warm else [])
    return run_in_process(ROW_MODULE, [name, *flags], timeout, {"row": name})


def run_in_process(module: str, argv: list[str], timeout: float, label: dict[str, Any]) -> dict[str, Any]:
    """``python -m module *argv`` in a fresh process: the JSON object it prints
    last, or ``label`` with ``ok: False`` and why (a timeout, a crash)."""
    try:
        proc = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**label, "ok": False, "error": f"timed out after {timeout:.0f} s"}
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {**label, "ok": False, "error": tail}
    return json.loads(lines[-1])


def row_result(name: str, quick: bool, warm: bool = False) -> dict[str, Any]:
    """One row, in this process (the suite runs it in a fresh one)."""
    from graphmend.models import zoo
    from graphmend.models.targets import load_target
    from graphmend.pipeline import mend_target
    from graphmend.rewrite.verify import quiet
    from graphmend.tools.bench import bench, default_device

    started = time.perf_counter()
    target_name = name if name == "demo" else f"zoo:{name}"
    row = zoo.ROWS.get(name)
    result: dict[str, Any] = {"row": name, "target": target_name, "ok": True}
    if row is not None and row.paper_before is not None:
        fixed = round(row.paper_before * (row.paper_fix_rate or 0) / 100)
        result.update(
            paper_models=list(row.paper_models),
            paper_before=row.paper_before,
            paper_after=row.paper_before - fixed,
            paper_fix_rate=row.paper_fix_rate,
        )
    with quiet():
        target = load_target(target_name)
        report, mending = mend_target(target)
    mending.undo()
    before, after = report.before, report.after
    result.update(
        categories=before.categories,
        graphs_before=before.graphs,
        graphs_after=after.graphs,
        breaks_before=before.breaks,
        breaks_after=after.breaks,
        calls_captured_before=before.calls_captured,
        calls_captured_after=after.calls_captured,
        fallbacks_to_eager_before=before.fallbacks_to_eager,
        fallbacks_to_eager_after=after.fallbacks_to_eager,
        fix_rate=round(100 * (before.breaks - after.breaks) / before.breaks) if before.breaks else None,
        rules=sorted({o.rule for o in report.applied if o.rule}),
        verified=report.verified,
        remaining=sorted({s.category for s in after.sites}),
        kept=list(report.kept),
    )
    if not quick:
        # Only the example batch (Table 2's readings need no throughput sweep, which
        # would add a recompile per batch size to each arm). On CUDA, the paper's
        # method: reduce-overhead (CUDA graphs).
        device = default_device()
        modes = ("reduce-overhead",) if device == "cuda" else ("default",)
        timing = bench(target_name, backend="inductor", batches=(), iters=10, timeout=900, device=device, modes=modes)
        data = timing.to_dict()
        original, mended = timing.arms.get("original", {}), timing.arms.get("mended", {})
        result.update(
            device=device,
            mode=modes[0],
            cold_start_ratio=data["ratios"]["cold_start"],
            cold_start_excl_compile_ratio=data["ratios"]["cold_start_excl_compile"],
            time_to_steady_ratio=data["ratios"]["time_to_steady"],
            steady_state_ratio=data["ratios"]["steady_state"],
            regions_per_forward=[(arm.get("per_forward") or {}).get("compiled_regions") for arm in (original, mended)],
            cuda_graph_launches=[(arm.get("per_forward") or {}).get("cuda_graph_launches") for arm in (original, mended)],
            outputs_identical=timing.outputs_identical,
            max_abs_diff=timing.max_abs_diff,
            bench_problems=timing.problems,
            mend_s=mended.get("mend_s"),
        )
        if warm:  # a restarted process: the mended arm installs the mend from the cache
            again = bench(target_name, backend="inductor", batches=(), iters=10, timeout=900, device=device, modes=modes,
                          mend_cache="warm")
            result.update(cold_start_warm_ratio=again.to_dict()["ratios"]["cold_start"],
                          bench_problems=timing.problems + [f"warm: {p}" for p in again.problems])
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def write_chart(report: SuiteReport, path: str) -> str | None:
    """A PNG next to the JSON: breaks before/after and the cold-start ratio per row."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in report.rows if r.get("ok")]
    names = [r["row"] for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.7), 5))
    ax.bar([x - 0.2 for x in xs], [r["breaks_before"] for r in rows], width=0.4, label="breaks before")
    ax.bar([x + 0.2 for x in xs], [r["breaks_after"] for r in rows], width=0.4, label="breaks after")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=45, ha="right")
    ax.set_ylabel("graph breaks")
    if not report.quick:
        ax2 = ax.twinx()
        ax2.plot(list(xs), [r.get("cold_start_ratio") or float("nan") for r in rows], "k^", label="cold start x")
        ax2.set_ylabel("cold start, original / mended")
        ax2.legend(loc="upper right")
    ax.legend(loc="upper left")
    ax.set_title("graphmend suite" + (" (quick)" if report.quick else " (Inductor, CPU)"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    name = argv[0]
    quick = "--quick" in argv[1:]
    try:
        result = row_result(name, quick, warm="--warm" in argv[1:])
    except Exception as exc:  # reported as a failed row, never dropped
        result = {"row": name, "ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":  # pragma: no cover - the row subprocess
    sys.exit(main(sys.argv[1:]))
