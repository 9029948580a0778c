"""The ``graphmend`` command line.

Exit codes, like a linter: 0 nothing to report, 1 breaks found, 2 usage or
target error (one line on stderr, no traceback unless ``--debug``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from typing import Callable, Sequence

from graphmend import __version__  # noqa: F401  (used by --version)
from graphmend.errors import GraphmendError

EXIT_CLEAN, EXIT_FOUND, EXIT_ERROR = 0, 1, 2


def _target_help() -> str:
    return ("file.py:factory, package.module:factory, demo, zoo:NAME (see `graphmend zoo`), hf:TYPE (a tiny transformers "
            "model), tv:NAME, timm:NAME or diffusers:NAME")


def cmd_explain(ns: argparse.Namespace) -> int:
    from graphmend.compat import check_environment
    from graphmend.discover.explain import explain_target
    from graphmend.models.targets import load_target
    from graphmend.pipeline import judge

    check_environment()
    # The model's own prints go to stderr under --json so stdout stays valid JSON.
    redirect = contextlib.redirect_stdout(sys.stderr) if ns.json else contextlib.nullcontext()
    with redirect:
        target = load_target(ns.target)
        dynamic = None if ns.dynamic == "auto" else False
        report = judge(explain_target(target, calls=ns.calls, grad=ns.grad, dynamic=dynamic), target)
    if ns.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        from graphmend.tools.render import render_explain

        render_explain(report)
    return EXIT_FOUND if report.breaks or report.gave_up else EXIT_CLEAN


def _rules_arg(text: str | None) -> tuple[str, ...]:
    from graphmend.pipeline import DEFAULT_RULES
    from graphmend.rules import load_rules

    if not text:
        return DEFAULT_RULES
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    known = set(DEFAULT_RULES) | set(load_rules())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise GraphmendError(f"unknown rule(s) {', '.join(unknown)}; rules are {', '.join(sorted(known))}")
    return names


def cmd_mend(ns: argparse.Namespace) -> int:
    from graphmend.compat import check_environment
    from graphmend.models.targets import load_target
    from graphmend.pipeline import mend_target
    from graphmend.rewrite.verify import quiet

    check_environment()
    rules = _rules_arg(ns.rules)
    redirect = contextlib.redirect_stdout(sys.stderr) if ns.json else contextlib.nullcontext()
    with redirect:
        target = load_target(ns.target)
        with quiet():  # analysis runs of the model: their output is not the user's
            report, mending = mend_target(target, rules=rules, verify=not ns.no_verify, grad=ns.grad)
        mending.undo()
    if ns.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        from graphmend.tools.render import render_mend

        render_mend(report)
    return EXIT_FOUND if report.after.breaks or report.after.gave_up else EXIT_CLEAN


def cmd_fix(ns: argparse.Namespace) -> int:
    import time

    from graphmend.compat import check_environment
    from graphmend.models.targets import load_target
    from graphmend.rewrite.verify import quiet
    from graphmend.tools.fix import fix_target, write_changes, write_patches

    check_environment()
    if not os.path.isdir(ns.root):
        raise GraphmendError(f"--root {ns.root}: no such directory")
    started = time.time()
    with contextlib.redirect_stdout(sys.stderr):  # the model's prints never mix with the diff
        target = load_target(ns.target)
        with quiet():
            report = fix_target(target, root=ns.root, started=started, portable=ns.portable)
    project = [c for c in report.changes if c.kind == "project"]
    packages = [c for c in report.changes if c.kind == "package"]
    if ns.write:
        write_changes(report, force=ns.force)
    if ns.patch_dir:
        write_patches(report, ns.patch_dir)
    shown = [] if ns.write else project + ([] if ns.patch_dir else packages)
    if ns.json:
        data = report.to_dict()
        data["diff"] = "".join(c.diff() for c in shown)
        print(json.dumps(data, indent=2))
    else:
        sys.stdout.flush()
        for change in shown:
            sys.stdout.buffer.write(change.diff().encode(change.encoding))
        sys.stdout.flush()
    mend = report.mend
    status = {True: "verified", False: "NOT verified", None: "nothing to verify"}[mend.verified]
    print(f"graphmend fix {report.target}: breaks {mend.before.breaks} -> {mend.after.breaks}, {status}; "
          f"{len(report.changes)} file(s) to change", file=sys.stderr)
    if report.alone:
        print(f"  {report.alone}", file=sys.stderr)
    for change in report.changes:
        for form in change.forms:
            print(f"  {change.display}:{form.line} [where] {form.why}", file=sys.stderr)
        for line in change.needs_runtime:
            print(f"  {line}: left out (--portable)", file=sys.stderr)
    for path in report.written:
        print(f"  wrote {path}", file=sys.stderr)
    for path in report.backups:
        print(f"  backup {path}", file=sys.stderr)
    for path in report.patches:
        print(f"  patch {path}", file=sys.stderr)
    if ns.write and packages and not ns.patch_dir:
        print(f"  {len(packages)} file(s) of installed packages not touched: pass --patch-dir DIR for patches",
              file=sys.stderr)
    for line in report.skipped + report.notes:
        print(f"  note: {line}", file=sys.stderr)
    return EXIT_FOUND if shown else EXIT_CLEAN


def cmd_bench(ns: argparse.Namespace) -> int:
    from graphmend.compat import check_environment
    from graphmend.models.targets import load_target
    from graphmend.tools.bench import bench

    check_environment()
    try:
        batches = tuple(int(b) for b in ns.batch.split(",") if b.strip())
    except ValueError:
        raise GraphmendError(f"--batch takes comma-separated integers, got {ns.batch!r}") from None
    if not batches or min(batches) < 1:
        raise GraphmendError("--batch needs positive sizes")
    import torch

    device = ns.device if ns.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise GraphmendError("--device cuda: this torch build or machine has no CUDA device")
    modes = None if ns.mode == "auto" else (("default", "reduce-overhead") if ns.mode == "both" else (ns.mode,))
    if modes and "reduce-overhead" in modes and (device != "cuda" or ns.backend != "inductor"):
        raise GraphmendError("--mode reduce-overhead needs --device cuda and the inductor backend (CUDA graphs)")
    with contextlib.redirect_stdout(sys.stderr):
        from graphmend.rewrite.verify import quiet

        with quiet():
            load_target(ns.target)  # a bad target is a one-line error here, not two failed arms
    report = bench(ns.target, backend=ns.backend, batches=batches, iters=ns.iters, timeout=ns.timeout,
                   device=device, modes=modes, mend_cache=ns.mend_cache)
    if ns.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        from graphmend.tools.render import render_bench

        render_bench(report)
    reports = [report, *report.modes.values()]
    return EXIT_ERROR if any(not arm.get("ok") for r in reports for arm in r.arms.values()) else EXIT_CLEAN


def _json_folder(path: str | None) -> None:
    """The folder ``--json PATH`` writes to, made before the run (not an error after an hour)."""
    folder = os.path.dirname(path) if path else ""
    try:
        if folder:
            os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise GraphmendError(f"--json {path}: cannot make its folder: {exc.strerror}") from None


def cmd_suite(ns: argparse.Namespace) -> int:
    from rich.progress import Progress

    from graphmend.compat import check_environment
    from graphmend.tools.suite import default_rows, run_suite, write_chart

    check_environment()
    _json_folder(ns.json)
    rows = [r.strip() for r in ns.rows.split(",")] if ns.rows else default_rows()
    known = set(default_rows())
    unknown = [r for r in rows if r not in known]
    if unknown:
        raise GraphmendError(f"unknown row(s) {', '.join(unknown)}; rows are {', '.join(sorted(known))}")
    with Progress(transient=True) as bar:
        task = bar.add_task("suite" + (" --quick" if ns.quick else ""), total=len(rows))
        report = run_suite(rows, quick=ns.quick, jobs=ns.jobs, progress=lambda name: bar.advance(task), warm=ns.warm)
    from graphmend.tools.render import render_suite

    render_suite(report)
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as fh:
            json.dump(report.to_dict(), fh, indent=2)
        chart = write_chart(report, os.path.splitext(ns.json)[0] + ".png")
        print(f"wrote {ns.json}" + (f" and {chart}" if chart else " (no chart: matplotlib is not installed)"))
    return EXIT_ERROR if report.totals()["rows_failed"] else EXIT_CLEAN


def cmd_survey(ns: argparse.Namespace) -> int:
    from rich.progress import Progress

    from graphmend.compat import check_environment
    from graphmend.tools.render import render_survey
    from graphmend.tools.survey import LIBRARIES, models_of, run_survey

    check_environment()
    if ns.library not in LIBRARIES:
        raise GraphmendError(f"unknown library {ns.library!r}; libraries are {', '.join(LIBRARIES)}")
    _json_folder(ns.json)
    models = [m.strip() for m in ns.models.split(",")] if ns.models else models_of(ns.library, ns.long)
    with Progress(transient=True) as bar:
        task = bar.add_task(f"survey {ns.library}", total=len(models))
        report = run_survey(ns.library, models, long=ns.long, jobs=ns.jobs, timeout=ns.timeout,
                            progress=lambda name: bar.advance(task))
    render_survey(report)
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as fh:
            json.dump(report.to_dict(), fh, indent=2)
        print(f"wrote {ns.json}")
    totals = report.totals()
    return EXIT_ERROR if totals["mismatches"] or totals["worse"] else EXIT_CLEAN


def cmd_check(ns: argparse.Namespace) -> int:
    from graphmend.check import check_paths, parse_select

    report = check_paths(ns.paths, select=parse_select(ns.select))
    if ns.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        for line in report.lines():
            print(line)
    print(report.summary(), file=sys.stderr)
    return EXIT_FOUND if report.findings else EXIT_CLEAN


def cmd_rules(ns: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markdown import Markdown

    from graphmend.rules import load_rules

    rules = load_rules()
    if ns.name:
        rule = rules.get(ns.name)
        if rule is None:
            raise GraphmendError(f"no rule named {ns.name!r}; rules are {', '.join(sorted(rules))}")
        Console().print(Markdown(rule.doc))
        return EXIT_CLEAN
    rows = [(name, "/".join(sorted(rule.categories)) or f"({rule.offered})", rule.summary) for name, rule in sorted(rules.items())]
    widths = [max(len(row[i]) for row in rows) for i in (0, 1)]
    for name, categories, summary in rows:
        print(f"{name:{widths[0]}}  {categories:{widths[1]}}  {summary}")
    return EXIT_CLEAN


def cmd_cache(ns: argparse.Namespace) -> int:
    import time

    from graphmend import cache

    if ns.action == "clear":
        removed = cache.clear()
        print(f"removed {removed} mend cache entr{'y' if removed == 1 else 'ies'} from {os.path.join(cache.root(), 'mends')}")
        return EXIT_CLEAN
    rows = []
    for path, entry, size in cache.entries():
        row = {"key": os.path.basename(path).removesuffix(".pkl"), "path": path, "bytes": size, "readable": entry is not None}
        if entry is not None:
            row.update(target=entry.target, torch=entry.torch, created=entry.created,
                       graphs=[entry.report.before.graphs, entry.report.after.graphs],
                       functions=len(entry.rewrites), files=len(entry.files))
        rows.append(row)
    if ns.json:
        print(json.dumps({"folder": os.path.join(cache.root(), "mends"), "enabled": cache.enabled(), "entries": rows}, indent=2))
        return EXIT_CLEAN
    from rich.console import Console
    from rich.table import Table

    state = "" if cache.enabled() else " (off: GRAPHMEND_CACHE=0)"
    table = Table(title=f"mend cache in {os.path.join(cache.root(), 'mends')}{state}", title_justify="left")
    for column in ("key", "target", "torch", "graphs", "rewritten", "files read", "age", "size"):
        table.add_column(column)
    for r in rows:
        if not r["readable"]:
            table.add_row(r["key"][:12], "(unreadable: replaced when next used)", "", "", "", "", "", f"{r['bytes'] // 1024} KB")
            continue
        age = time.time() - r["created"]
        ago = f"{age / 3600:.1f} h" if age >= 3600 else f"{age / 60:.0f} min"
        table.add_row(r["key"][:12], r["target"], r["torch"], f"{r['graphs'][0]} -> {r['graphs'][1]}", str(r["functions"]),
                      str(r["files"]), ago, f"{r['bytes'] // 1024} KB")
    Console().print(table)
    return EXIT_CLEAN


def cmd_zoo(ns: argparse.Namespace) -> int:
    from graphmend.models import zoo

    rows = list(zoo.ROWS.values())
    if ns.json:
        print(
            json.dumps(
                [
                    {
                        "name": r.name,
                        "target": f"zoo:{r.name}",
                        "paper_models": list(r.paper_models),
                        "categories": r.categories,
                        "scope": r.scope,
                        "paper_before": r.paper_before,
                        "paper_fix_rate": r.paper_fix_rate,
                        "rules": r.rules,
                        "note": r.note,
                    }
                    for r in rows
                ],
                indent=2,
            )
        )
        return EXIT_CLEAN
    from rich.console import Console
    from rich.table import Table

    table = Table(title="graphmend zoo: offline rows of the paper's Table 2", title_justify="left")
    table.add_column("target", no_wrap=True)
    table.add_column("stands for (Table 2)")
    table.add_column("categories")
    table.add_column("paper breaks / fix")
    table.add_column("rules")
    for r in rows:
        paper = "-" if r.paper_before is None else f"{r.paper_before} / {r.paper_fix_rate}%"
        table.add_row(f"zoo:{r.name}", ", ".join(r.paper_models), r.categories, paper, r.rules)
    Console().print(table)
    return EXIT_CLEAN


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphmend",
        description="Find and fix torch.compile graph breaks by rewriting source.",
    )
    parser.add_argument("--version", action="version", version=f"graphmend {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("explain", help="list every graph break of a target, why, and which rule fixes it")
    p.add_argument("target", help=_target_help())
    p.add_argument("--json", action="store_true", help="print the report as JSON (schema: docs/cli.md)")
    p.add_argument("--calls", type=int, default=1, help="calls on the example inputs (default 1)")
    p.add_argument("--grad", action="store_true", help="run with autograd enabled (default: no_grad)")
    p.add_argument(
        "--dynamic", choices=("static", "auto"), default="static",
        help="count graphs as torch.compile(dynamic=False) does (static, the default: as mend counts them) "
        "or as torch.compile() does (auto: automatic dynamic shapes)",
    )
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("mend", help="mend a target in memory, verify it, and show what was fixed and why")
    p.add_argument("target", help=_target_help())
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--rules", help="comma-separated rules to apply (default: all)")
    p.add_argument("--no-verify", action="store_true", help="skip the eager comparison with the original")
    p.add_argument("--grad", action="store_true", help="measure and verify with autograd enabled, as training calls run (default: no_grad)")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_mend)

    p = sub.add_parser("fix", help="write the verified rewrites as source: a diff, the files, or package patches")
    p.add_argument("target", help=_target_help())
    how = p.add_mutually_exclusive_group()
    how.add_argument("--diff", action="store_true", help="print a unified diff (the default); exit 1 when non-empty")
    how.add_argument("--write", action="store_true", help="rewrite the project's files in place, atomically")
    p.add_argument("--patch-dir", metavar="DIR", help="write one <package>.patch per installed package changed")
    p.add_argument("--root", default=".", help="the project: files under it are yours, others are packages (default .)")
    p.add_argument("--force", action="store_true", help="--write even files with uncommitted changes in git")
    p.add_argument("--portable", action="store_true",
                   help="only the rewrites that need nothing but torch (patches for upstream); the rest are listed")
    p.add_argument("--json", action="store_true", help="print the report (and the diff) as JSON")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_fix)

    p = sub.add_parser("bench", help="measure the original and the mended target side by side")
    p.add_argument("target", help=_target_help())
    p.add_argument("--backend", choices=["inductor", "eager"], default="inductor")
    p.add_argument("--batch", default="1,4", help="batch sizes for throughput (default 1,4)")
    p.add_argument("--iters", type=int, default=20, help="timed steady-state calls per arm (default 20)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per arm (default 600)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the arms run (default: cuda when available)")
    p.add_argument("--mode", choices=["auto", "default", "reduce-overhead", "both"], default="auto",
                   help="torch.compile mode(s); auto = default on CPU, default and reduce-overhead on CUDA")
    p.add_argument("--mend-cache", choices=["cold", "warm"], default="cold",
                   help="cold: the mended arm mends (default); warm: it installs an unmeasured process's mend from the cache")
    p.add_argument("--json", action="store_true")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("suite", help="explain, mend and bench every zoo row and the demo: Table 2 beside ours")
    p.add_argument("--quick", action="store_true", help="counting backend only, no timing")
    p.add_argument("--rows", help="comma-separated rows (default: all zoo rows and demo)")
    p.add_argument("--jobs", type=int, default=1, help="rows run in parallel processes (default 1)")
    p.add_argument("--warm", action="store_true", help="also time each row with a warm mend cache (a restarted process)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON, and a PNG chart beside it")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_suite)

    p = sub.add_parser("survey", help="graphmend.compile against torch.compile on a library's models, each in its own process")
    p.add_argument("--library", default="transformers", help="transformers (the default: hf:TYPE models), torchvision, timm or diffusers")
    p.add_argument("--long", action="store_true", help="every model the installed release offers, not the CI subset")
    p.add_argument("--models", help="comma-separated targets instead (hf:xlm,hf:ctrl)")
    p.add_argument("--jobs", type=int, default=1, help="models run in parallel processes (default 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per model (default 600)")
    p.add_argument("--json", metavar="PATH", help="write the rows and totals as JSON")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_survey)

    p = sub.add_parser("check", help="list candidate break sites in source files, statically (no model, no run)")
    p.add_argument("paths", nargs="+", metavar="PATH", help="Python files or folders")
    p.add_argument("--json", action="store_true", help="print the findings as JSON (schema: docs/cli.md)")
    p.add_argument("--select", help="comma-separated codes or prefixes (GM101,GM2; ALL adds the opt-in [Scalar] GM4xx)")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("rules", help="list the rules, or show one rule's documentation")
    p.add_argument("name", nargs="?")
    p.set_defaults(func=cmd_rules)

    p = sub.add_parser("cache", help="list or clear the mend cache graphmend.compile keeps for restarted processes")
    p.add_argument("action", nargs="?", choices=("list", "clear"), default="list")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("zoo", help="list the zoo: targets built from the paper's Table 2")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_zoo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(ns, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    try:
        return func(ns)
    except GraphmendError as exc:
        if ns.debug:
            traceback.print_exc()
        print(f"graphmend: error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("graphmend: interrupted", file=sys.stderr)
        return 130


