"""Long-mode differential fuzzing: ``python -m tests.fuzz`` (``make fuzz``).

``--jobs N`` splits the programs over N worker processes (worker k draws its
programs with hypothesis seed ``seed * 1000 + k``); the parent merges their
summaries as they go and writes the combined one."""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import time

from .runner import Summary, run_many


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--programs", type=int, default=5000, help="programs to generate and check (default 5000)")
    parser.add_argument("--seed", type=int, default=1, help="hypothesis seed (default 1)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--grad-every", type=int, default=3, help="check gradients on every Nth program (0: never)")
    parser.add_argument("--inductor-every", type=int, default=50, help="add an Inductor arm on every Nth program (0: never)")
    parser.add_argument("--max-statements", type=int, default=8, help="top-level statements per forward (at most)")
    parser.add_argument("--failures", default="build/fuzz-failures", help="folder for failing programs")
    parser.add_argument("--progress-every", type=int, default=100)
    parser.add_argument("--summary", default="build/fuzz-summary.txt", help="the summary so far, rewritten at each progress line")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # k/N: one worker of --jobs N
    parser.add_argument("--state", default=None, help=argparse.SUPPRESS)  # where a worker pickles its summary
    args = parser.parse_args(argv)
    if args.jobs > 1 and args.part is None:
        return _parallel(args)

    seed = args.seed
    if args.part is not None:
        k, _ = (int(v) for v in args.part.split("/"))
        seed = args.seed * 1000 + k

    def progress(summary: Summary) -> None:
        if args.state:
            _dump(summary, args.state)
            return
        _write(summary, args.summary)
        print(
            f"[fuzz] {summary.programs} programs, {summary.checked} checked, "
            f"{len(summary.mismatches)} mismatches, {summary.seconds:.0f} s",
            flush=True,
        )

    summary = run_many(
        args.programs,
        seed=seed,
        grad_every=args.grad_every,
        inductor_every=args.inductor_every,
        max_statements=args.max_statements,
        failures=args.failures,
        progress=progress,
        progress_every=args.progress_every if not args.state else 5,
    )
    if args.state:
        _dump(summary, args.state)
        return 0
    return _finish(summary, args)


def _parallel(args: argparse.Namespace) -> int:
    parts = os.path.join(os.path.dirname(args.summary) or ".", "fuzz-parts")
    os.makedirs(parts, exist_ok=True)
    workers = []
    for k in range(args.jobs):
        count = args.programs // args.jobs + (k < args.programs % args.jobs)
        state = os.path.join(parts, f"part-{k}.pkl")
        if os.path.exists(state):
            os.remove(state)
        command = [
            sys.executable, "-m", "tests.fuzz", "--part", f"{k}/{args.jobs}", "--state", state,
            "--programs", str(count), "--seed", str(args.seed), "--grad-every", str(args.grad_every),
            "--inductor-every", str(args.inductor_every), "--max-statements", str(args.max_statements),
            "--failures", args.failures,
        ]
        log = open(os.path.join(parts, f"part-{k}.log"), "w")
        workers.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), state, log))
    began = time.perf_counter()
    printed = 0
    while True:
        done = all(p.poll() is not None for p, _, _ in workers)
        summary = _merged([state for _, state, _ in workers], time.perf_counter() - began)
        if done or summary.programs >= printed + args.progress_every:
            printed = summary.programs
            _write(summary, args.summary)
            print(
                f"[fuzz] {summary.programs} programs, {summary.checked} checked, "
                f"{len(summary.mismatches)} mismatches, {summary.seconds:.0f} s ({args.jobs} jobs)",
                flush=True,
            )
        if done:
            break
        time.sleep(10)
    for _, _, log in workers:
        log.close()
    failed = [k for k, (p, _, _) in enumerate(workers) if p.returncode != 0]
    if failed:
        print(f"worker(s) {failed} failed: see {parts}/part-<k>.log", file=sys.stderr)
        return 2
    return _finish(summary, args)


def _merged(states: list[str], seconds: float) -> Summary:
    total = Summary()
    for state in states:
        try:
            with open(state, "rb") as fh:
                total.merge(pickle.load(fh))
        except (OSError, EOFError, pickle.UnpicklingError):
            continue  # not written yet, or being rewritten
    total.seconds = seconds
    return total


def _dump(summary: Summary, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        pickle.dump(summary, fh)
    os.replace(tmp, path)


def _write(summary: Summary, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        fh.write(summary.render() + "\n")


def _finish(summary: Summary, args: argparse.Namespace) -> int:
    print(summary.render(), flush=True)
    _write(summary, args.summary)
    if summary.mismatches or summary.mend_errors or summary.harness_errors:
        print(f"failing programs written to {args.failures}/")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
