"""What mending costs on the first call, pass by pass (issue 58).

Each target runs in its own process (``graphmend survey``'s): the first call
of plain ``torch.compile`` and of ``graphmend.compile``, both with a backend
that runs each graph as captured, so the time is Dynamo's tracing plus
graphmend's mending (mending included; the plain call measured twice, the
faster kept). Printed as a Markdown table: graphs, first calls and their
ratio, the calls of the model the mend made under Dynamo (``traces``:
discovery's included; the compile's own trace is one of them when the mend
was staged), and the seconds and traces of each pass that took time.

    .venv/bin/python benchmarks/mend_cost.py [TARGET ...] [--json PATH] [--jobs N]

With no target: every zoo row and the demo. For transformers 5.23's breaking
architectures, run it in a venv with that release and name them
(``hf:xlm hf:flaubert ...``; ``graphmend.tools.survey.BREAKING_ON_5_23``).
"""

from __future__ import annotations

import argparse
import json
import sys

from graphmend.tools.suite import default_rows
from graphmend.tools.survey import run_survey

# Passes shown by name; the others are summed as "other".
SHOWN = ("discover", "rewrite_rounds", "capture", "speculate", "guard_held_asserts", "verify_capture", "never_worse")


def _cell(passes: dict, name: str) -> str:
    found = passes.get(name)
    if not found:
        return "-"
    traces = f" ({found['traces']})" if found["traces"] else ""
    return f"{found['seconds']:.1f}{traces}"


def table(rows: list[dict]) -> str:
    head = ["target", "graphs", "first call plain s", "graphmend s", "ratio", "traces", *SHOWN, "other"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['model']} | failed: {r.get('error')} |")
            continue
        plain, mended = r["first_call_s"]
        passes = r.get("mend_passes") or {}
        other = sum(v["seconds"] for k, v in passes.items() if k not in SHOWN)
        lines.append("| " + " | ".join([
            r["model"], f"{r['graphs_plain']} -> {r['graphs_mended']}", f"{plain:.2f}", f"{mended:.2f}",
            f"{mended / plain:.2f}", str(r["traces"]), *(_cell(passes, name) for name in SHOWN), f"{other:.1f}",
        ]) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--jobs", type=int, default=1)
    ns = parser.parse_args(argv)
    targets = ns.targets or [row if row == "demo" else f"zoo:{row}" for row in default_rows()]
    report = run_survey("mend cost", targets, jobs=ns.jobs)
    print(table(report.rows))
    if ns.json_path:
        with open(ns.json_path, "w", encoding="utf-8") as fh:
            json.dump(report.to_dict(), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
