"""Long-mode differential fuzzing: ``python -m tests.fuzz`` (``make fuzz``)."""

from __future__ import annotations

import argparse
import os
import sys

from .runner import run_many


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--programs", type=int, default=5000, help="programs to generate and check (default 5000)")
    parser.add_argument("--seed", type=int, default=1, help="hypothesis seed (default 1)")
    parser.add_argument("--grad-every", type=int, default=3, help="check gradients on every Nth program (0: never)")
    parser.add_argument("--inductor-every", type=int, default=50, help="add an Inductor arm on every Nth program (0: never)")
    parser.add_argument("--max-statements", type=int, default=8, help="top-level statements per forward (at most)")
    parser.add_argument("--failures", default="build/fuzz-failures", help="folder for failing programs")
    parser.add_argument("--progress-every", type=int, default=100)
    parser.add_argument("--summary", default="build/fuzz-summary.txt", help="the summary so far, rewritten at each progress line")
    args = parser.parse_args(argv)

    def progress(summary):
        os.makedirs(os.path.dirname(args.summary) or ".", exist_ok=True)
        with open(args.summary, "w") as fh:
            fh.write(summary.render() + "\n")
        print(
            f"[fuzz] {summary.programs} programs, {summary.checked} checked, "
            f"{len(summary.mismatches)} mismatches, {summary.seconds:.0f} s",
            flush=True,
        )

    summary = run_many(
        args.programs,
        seed=args.seed,
        grad_every=args.grad_every,
        inductor_every=args.inductor_every,
        max_statements=args.max_statements,
        failures=args.failures,
        progress=progress,
        progress_every=args.progress_every,
    )
    print(summary.render(), flush=True)
    with open(args.summary, "w") as fh:
        fh.write(summary.render() + "\n")
    if summary.mismatches or summary.mend_errors or summary.harness_errors:
        print(f"failing programs written to {args.failures}/")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
