"""Terminal rendering of reports with rich. Pure presentation: no analysis here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from graphmend.discover.explain import ExplainReport

if TYPE_CHECKING:
    from graphmend.pipeline import MendReport
    from graphmend.tools.bench import BenchReport
    from graphmend.tools.suite import SuiteReport
    from graphmend.tools.survey import SurveyReport
from graphmend.discover.sites import CATEGORIES, verdict_for
from graphmend.rules import load_rules

_CATEGORY_ORDER = ["DC", "LC", "VG", "TI", "DO", "AS", "DS", "UNSUP", "OTHER"]


def _style(rule: str | None) -> str:
    """A rule's colour (the registry's); out-of-scope sites are yellow."""
    found = load_rules().get(rule or "")
    return found.style if found is not None else "yellow"


def _shorten(code: str, width: int = 70) -> str:
    code = " ".join(code.split())
    if "  #" in code or " # " in code:
        code = code.split(" # ", 1)[0].rstrip()
    return code if len(code) <= width else code[: width - 1] + "…"


def plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def summary_line(report: ExplainReport) -> str:
    if report.gave_up:
        head = f"{report.target}: 0 graphs - Dynamo gave up on the whole frame"
    else:
        head = (
            f"{report.target}: {plural(report.graphs, 'graph')}, {plural(report.breaks, 'break')} "
            f"at {plural(len(report.sites), 'site')}, {report.calls_captured} ops captured"
        )
        if report.fallbacks_to_eager:
            head += f", {plural(report.fallbacks_to_eager, 'frame')} run eagerly"
    out = len(report.sites) - len(report.fixable) - len(report.declined)
    parts = [head]
    if report.sites:
        fix = _by_rule(report.fixable)
        parts.append(f"{len(report.fixable)} fixable" + (f" ({fix})" if fix else ""))
        if report.declined:
            rules = load_rules()
            measured = any("capture" in getattr(rules.get(s.rule), "passes", ()) for s in report.declined)
            parts.append(
                f"{len(report.declined)} declined by their rule ({_by_rule(report.declined)}"
                + ("; `mend` measures capture for those" if measured else "") + ")"
            )
        parts.append(f"{out} out of scope")
    parts.append(plural(report.recompiles, "recompile"))
    parts.append(f"{report.seconds:.1f} s")
    return " | ".join(parts)


def _by_rule(sites: list) -> str:
    counts: dict[str, int] = {}
    for s in sites:
        counts[s.rule] = counts.get(s.rule, 0) + 1
    return ", ".join(f"{r} {n}" for r, n in sorted(counts.items()))


def render_explain(report: ExplainReport, console: Console | None = None) -> None:
    console = console or terminal()
    if report.sites:
        table = Table(title=f"graph breaks in {report.target}", title_justify="left", expand=False)
        table.add_column("cat", no_wrap=True)
        table.add_column("site", overflow="fold", ratio=3)
        table.add_column("code", overflow="fold", ratio=3)
        table.add_column("Dynamo reason", overflow="fold", ratio=2)
        table.add_column("rule", no_wrap=True)
        order = {c: i for i, c in enumerate(_CATEGORY_ORDER)}
        sites = sorted(report.sites, key=lambda s: (order.get(s.category, 99), s.path, s.line))
        previous = None
        for site in sites:
            if previous is not None and site.category != previous:
                table.add_section()
            previous = site.category
            where = f"{site.path}:{site.line} in {site.function}"
            if len(site.frames) > 1:
                where += "\nvia " + " > ".join(f"{f.function}:{f.line}" for f in site.frames[:-1])
            reason = site.reason + (f" ({site.gb_id})" if site.gb_id else "")
            if site.events > 1:
                reason += f"\n{site.events} events"
            verdict = Text(site.rule or "out of scope", style=_style(site.rule))
            if site.declined:
                verdict = Text(f"{site.rule}\ndeclines", style="yellow")
            table.add_row(  # Text, not markup: `h[mask]` is code, not a style tag
                Text(site.category, style="bold"),
                Text(where),
                Text(_shorten(site.code)),
                Text(reason),
                verdict,
            )
        console.print(table)
        for site in sites:  # the rule's own words, as `mend` reports them
            if site.declined:
                console.print(Text(f"{site.path}:{site.line}: [{site.rule}] declines: {site.declined}", style="yellow"))
        for cat in _CATEGORY_ORDER:
            if cat in report.categories:
                rule, verdict = verdict_for(cat)
                console.print(Text(f"{cat}  {CATEGORIES[cat]}: {verdict}", style="dim"))
    per_graph = ", ".join(str(n) for n in report.ops_per_graph)
    console.print(
        Text(
            f"graphs per call {report.graphs_per_call}; ops per graph [{per_graph}]; "
            f"{report.break_events} break events in Dynamo's log",
            style="dim",
        )
    )
    for warning in report.warnings:
        console.print(Text("warning: " + warning, style="yellow"))
    console.print(Text(summary_line(report), style="bold"), soft_wrap=True)


_STATUS_STYLE = {"applied": "green", "declined": "yellow", "reverted": "red", "out of scope": "dim"}


def mend_summary(report: "MendReport") -> str:
    before, after = report.before, report.after
    removed = before.breaks - after.breaks
    verified = {True: "verified identical to eager", False: "verification failed", None: "not verified"}[
        report.verified
    ]
    mode = " (autograd on)" if report.grad else ""
    fallbacks = (
        f", eager fallbacks {before.fallbacks_to_eager} -> {after.fallbacks_to_eager}"
        if before.fallbacks_to_eager or after.fallbacks_to_eager else ""
    )
    return (
        f"{report.target}{mode}: graphs {before.graphs} -> {after.graphs}, breaks {before.breaks} -> {after.breaks} "
        f"({removed} removed), ops captured {before.calls_captured} -> {after.calls_captured}{fallbacks} | "
        f"{len(report.applied)} applied, {len(report.declined)} not | {verified} | {report.seconds:.1f} s"
        + ("" if report.from_cache else f", {plural(report.traces, 'trace')}")
    )


def render_mend(report: "MendReport", console: Console | None = None) -> None:
    console = console or terminal()
    if report.outcomes:
        table = Table(title=f"mending {report.target}", title_justify="left")
        table.add_column("status", no_wrap=True)
        table.add_column("rule", no_wrap=True)
        table.add_column("site", overflow="fold", ratio=3)
        table.add_column("code", overflow="fold", ratio=3)
        table.add_column("what / why", overflow="fold", ratio=4)
        for o in report.outcomes:
            table.add_row(
                Text(o.status, style=_STATUS_STYLE.get(o.status, "")),
                o.rule or "-",
                Text(f"{o.path}:{o.line} in {o.function}"),
                Text(_shorten(o.code)),
                # A later rule's word on the site (passes/speculation.py) shows with the first one's.
                Text("; ".join([o.reason] + [n for n in o.notes if n.startswith(("still breaks", "no longer breaks", "[speculate]"))])),
            )
        console.print(table)
    for line in report.kept:
        console.print(Text("note: " + line, style="yellow"), soft_wrap=True)
    for line in report.capture.notes:  # each capture setting measured: kept, or why not
        console.print(Text("capture: " + line, style="dim"), soft_wrap=True)
    for diff in report.differences:
        console.print(Text("verification: " + diff, style="red"), soft_wrap=True)
    for warning in report.after.warnings:
        console.print(Text("warning: " + warning, style="yellow"))
    console.print(Text(mend_summary(report), style="bold"), soft_wrap=True)


def render_bench(report: "BenchReport", console: Console | None = None) -> None:
    console = console or terminal()
    mode = "" if report.mode == "default" else f", mode={report.mode}"
    warm = ", mend cache warm" if report.mend_cache == "warm" else ""
    table = Table(title=f"bench {report.target} ({report.backend}, {report.device}{mode}{warm})", title_justify="left")
    table.add_column("metric")
    table.add_column("original", justify="right")
    table.add_column("mended", justify="right")
    table.add_column("original / mended", justify="right")
    a, b = report.arms.get("original", {}), report.arms.get("mended", {})

    def fmt(value: object, digits: int = 3) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.{digits}g}"
        return str(value)

    def row(label: str, key: str, sub: str | None = None, ratio: bool = True) -> None:
        x, y = a.get(key), b.get(key)
        if sub is not None:
            x, y = (x or {}).get(sub), (y or {}).get(sub)
        r = report.ratio(key, sub) if ratio else None
        table.add_row(label, fmt(x), fmt(y), f"{r:.2f}x" if r else "-")

    row("graphs", "graphs", ratio=False)
    row("breaks", "breaks", ratio=False)
    row("ops captured", "calls_captured", ratio=False)
    row("frames run eagerly", "fallbacks_to_eager", ratio=False)
    row("recompiles", "recompiles", ratio=False)
    row("cold start (mending included), s", "cold_start_s")
    split = b.get("mend_split") or {}
    table.add_row("  of which mending, s", "-", fmt(b.get("mend_s")),
                  ", ".join(f"{k} {v:.2f}" for k, v in split.items()) if split else "-")
    row("  first call alone, s", "first_call_s")
    row("cold start excl. compile, s", "cold_start_excl_compile_s")
    row("time to steady, s", "time_to_steady_s")
    row("compile, s", "compile_s")
    row("steady median, ms", "steady_ms", "median")
    row("steady mean, ms", "steady_ms", "mean")
    row("steady p10, ms", "steady_ms", "p10")
    row("steady p90, ms", "steady_ms", "p90")
    for batch in report.batches:
        x = (a.get("throughput") or {}).get(str(batch))
        y = (b.get("throughput") or {}).get(str(batch))
        ratio = (y / x) if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x else None
        table.add_row(f"throughput b={batch}, samples/s", fmt(x), fmt(y), f"{ratio:.2f}x (mended / original)" if ratio else "-")
    per_forward = ("compiled_regions", "compiled_graph_calls", "cuda_graph_launches", "kernel_launches", "syncs")
    for key in per_forward:
        x, y = (a.get("per_forward") or {}).get(key), (b.get("per_forward") or {}).get(key)
        if x is not None or y is not None:
            table.add_row(f"{key.replace('_', ' ')} per forward", fmt(x), fmt(y), "-")
    row("peak RSS, MB", "peak_rss_mb", ratio=False)
    if "peak_cuda_mb" in a or "peak_cuda_mb" in b:
        row("peak CUDA allocated, MB", "peak_cuda_mb", ratio=False)
    console.print(table)
    same = {True: "bit-identical", False: "different", None: "not compared"}[report.outputs_identical]
    console.print(Text(f"outputs: {same}; max abs diff {fmt(report.max_abs_diff)}", style="dim"), soft_wrap=True)
    if b.get("ok"):
        console.print(Text(f"mended arm: {b.get('applied_sites', 0)} site(s) mended; explain counted "
                           f"{b.get('fixable_sites', 0)} of the original's breaks fixable", style="dim"))
    for problem in report.problems:
        console.print(Text("problem: " + problem, style="red"), soft_wrap=True)
    for other in report.modes.values():
        render_bench(other, console)


def terminal() -> Console:
    """The terminal's width; a wide one when piped, so tables stay readable in logs."""
    console = Console()
    return console if console.is_terminal else Console(width=180)


def render_suite(report: "SuiteReport", console: Console | None = None) -> None:
    console = console or terminal()
    table = Table(title="graphmend suite: the paper's Table 2 beside ours" + (" (quick)" if report.quick else ""),
                  title_justify="left")
    for name, justify in (("row", "left"), ("categories", "left"), ("breaks", "right"), ("fix", "right"),
                          ("paper breaks", "right"), ("paper fix", "right"), ("rules", "left")):
        table.add_column(name, justify=justify)
    warm = any("cold_start_warm_ratio" in r for r in report.rows)
    if not report.quick:
        for name in ("cold x", *(["cold x, warm cache"] if warm else []), "cold-compile x", "steady x", "regions/fwd",
                     "outputs"):
            table.add_column(name, justify="right")
    for r in report.rows:
        if not r.get("ok"):
            table.add_row(r["row"], Text("failed: " + str(r.get("error")), style="red"))
            continue
        cats = " ".join(f"{k} {v}" for k, v in sorted((r.get("categories") or {}).items()))
        fix = "-" if r.get("fix_rate") is None else f"{r['fix_rate']}%"
        paper = "-" if r.get("paper_before") is None else f"{r['paper_before']} -> {r['paper_after']}"
        paper_fix = "-" if r.get("paper_fix_rate") is None else f"{r['paper_fix_rate']}%"
        cells = [r["row"], cats or "-", f"{r['breaks_before']} -> {r['breaks_after']}", fix, paper, paper_fix,
                 ", ".join(r.get("rules") or []) or "-"]
        if not report.quick:
            def ratio(v: object) -> str:
                return f"{v:.2f}" if isinstance(v, (int, float)) else "-"

            same = {True: "identical", False: f"max diff {r.get('max_abs_diff')}", None: "-"}[r.get("outputs_identical")]
            regions = r.get("regions_per_forward") or [None, None]
            regions_cell = "-" if None in regions else f"{regions[0]} -> {regions[1]}"
            cells += [ratio(r.get("cold_start_ratio")), *([ratio(r.get("cold_start_warm_ratio"))] if warm else []),
                      ratio(r.get("cold_start_excl_compile_ratio")), ratio(r.get("steady_state_ratio")), regions_cell, same]
        table.add_row(*cells)
    console.print(table)
    t = report.totals()
    console.print(
        Text(
            f"totals: breaks {t['breaks_before']} -> {t['breaks_after']} ({t['breaks_eliminated']} eliminated, "
            f"{t['fix_rate']}%); {t['rows_fully_fixed']} of {t['rows_with_breaks']} rows fully fixed; "
            f"paper rows: {t['paper_breaks_before']} -> {t['paper_breaks_after']} in Table 2; "
            f"{t['rows_failed']} failed; {report.seconds:.0f} s",
            style="bold",
        ),
        soft_wrap=True,
    )


def _first_call(row: dict) -> str:
    """``plain s -> mended s (ratio)`` of a survey row's first calls."""
    plain, mended = (row.get("first_call_s") or [None, None])[:2]
    if not plain or mended is None:
        return "-"
    return f"{plain:.1f} -> {mended:.1f} ({mended / plain:.1f}x)"


def render_survey(report: "SurveyReport", console: Console | None = None) -> None:
    console = console or terminal()
    table = Table(title=f"graphmend survey: {report.library}" + (" (long)" if report.long else ""),
                  title_justify="left")
    for name in ("model", "graphs", "breaks", "rules", "capture", "verified", "outputs", "first call", "traces", "s"):
        table.add_column(name, justify="left" if name in ("model", "rules", "capture") else "right")
    failed = [r for r in report.rows if not r.get("ok")]
    for r in report.rows:
        if r.get("ok"):
            mended = bool(r["rules"] or r["capture"])
            table.add_row(
                r["model"], f"{r['graphs_plain']} -> {r['graphs_mended']}",
                f"{r['breaks_before']} -> {r['breaks_after']}", ", ".join(r["rules"]) or "-",
                ", ".join(r["capture"]) or "-", ("yes" if r["verified"] else "no") if mended else "-",
                Text("MISMATCH", style="red") if r["mismatch"] else "identical", _first_call(r),
                str(r.get("traces", "-")), f"{r['seconds']:.0f}",
            )
    console.print(table)
    for r in failed:  # a model that does not build or run eagerly is not graphmend's result
        console.print(Text(f"{r['model']}: {r.get('error')}", style="red"), soft_wrap=True)
    t = report.totals()
    console.print(Text(
        f"totals: {t['models']} models ({t['models_failed']} failed, {t['models_breaking']} breaking); graphs "
        f"{t['graphs_plain']} -> {t['graphs_mended']}; breaks {t['breaks_before']} -> {t['breaks_after']} "
        f"({t['fix_rate']}% eliminated); {t['verified']} verified; {t['mismatches']} mismatches; "
        f"{t['worse']} worse; first call at most {t['first_call_ratio_max']}x plain's; {report.seconds:.0f} s",
        style="bold"), soft_wrap=True)
