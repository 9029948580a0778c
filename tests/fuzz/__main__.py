"""Long-mode differential fuzzing: ``python -m tests.fuzz`` (``make fuzz``).

The programs run in chunks of ``--chunk`` (100), each in a fresh worker
process, ``--jobs N`` at a time (chunk c draws its programs with hypothesis
seed ``seed * 1000 + c``); the parent merges their summaries as they go and
writes the combined one. ``--resume`` continues an
interrupted run with the same arguments and the same code (graphmend and the
fuzzer, hashed): the programs already checked are drawn again, not rechecked.
``--chunks A:B`` runs a part of a run too long for one sitting: chunks A to
B-1, exactly as the whole run would check them; with ``--resume`` the parts
finished in the same folder are kept and the summary merges them.

With the threads arm on (``--threads-every``, default 4) every run goes
through worker processes, one chunk included (it draws with ``seed``
itself, as a run in this process would): a worker that dies (a crash, a
signal) is started again after the program it died on, which the summary
counts as crashed (at most ``RESTARTS`` times per chunk)."""

from __future__ import annotations

import argparse
import hashlib
import os
import pickle
import subprocess
import sys
import signal
import time
from typing import Any

from . import runner
from .runner import Summary, run_many


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--programs", type=int, default=5000, help="programs to generate and check (default 5000)")
    parser.add_argument("--seed", type=int, default=1, help="hypothesis seed (default 1)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes at a time (default 1)")
    parser.add_argument("--chunk", type=int, default=100, help="programs per worker process (default 100)")
    parser.add_argument("--grad-every", type=int, default=3, help="check gradients on every Nth program (0: never)")
    parser.add_argument("--inductor-every", type=int, default=50, help="add an Inductor arm on every Nth program (0: never)")
    parser.add_argument("--aot-every", type=int, default=1, help="add the aot_eager arm on every Nth program (0: never)")
    parser.add_argument(
        "--threads-every", type=int, default=4,
        help="add the threads arm (two graphmend.compile copies called from two threads at once) on every Nth program (0: never)",
    )
    parser.add_argument("--max-statements", type=int, default=8, help="top-level statements per forward (at most)")
    parser.add_argument("--failures", default="build/fuzz-failures", help="folder for failing programs")
    parser.add_argument("--progress-every", type=int, default=100)
    parser.add_argument("--summary", default="build/fuzz-summary.txt", help="the summary so far, rewritten at each progress line")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run (same arguments and code)")
    parser.add_argument(
        "--chunks", default=None, metavar="A:B",
        help="check only chunks A to B-1 of the run: a part of a run too long for one sitting (the parts of one"
        " run, at one commit, check exactly the programs the whole run would)",
    )
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # k/N: one worker of --jobs N
    parser.add_argument("--state", default=None, help=argparse.SUPPRESS)  # where a worker pickles its summary
    return parser.parse_args(argv)


RESTARTS = 5  # a chunk's worker is started again this many times after it died


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if (args.jobs > 1 or args.programs > args.chunk or args.threads_every > 0 or args.chunks) and args.part is None:
        return _parallel(args)

    seed = args.seed
    if args.part is not None:
        k, n = (int(v) for v in args.part.split("/"))
        seed = args.seed if n == 1 else args.seed * 1000 + k
    worker = args.part is not None
    state = args.state or (os.path.join(_parts(args), "single.pkl") if args.resume else None)
    key = _key(args, seed)
    resume = _load(state, key) if args.resume and state else None
    if resume is not None and not worker:
        print(f"[fuzz] resuming after {resume.programs} programs", flush=True)

    def progress(summary: Summary) -> None:
        if state:
            _dump(summary, state, key)
        if worker:
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
        aot_every=args.aot_every,
        threads_every=args.threads_every,
        max_statements=args.max_statements,
        failures=args.failures,
        progress=progress,
        progress_every=1 if worker else args.progress_every,  # a worker that dies resumes after its last program
        resume=resume,
        inflight=_inflight(args.state) if worker else None,
    )
    if state:
        _dump(summary, state, key)
    if worker:
        return 0
    return _finish(summary, args)


def _inflight(state: str) -> str:
    """Where the worker of ``state`` (``chunk-<c>.pkl``) writes the program it is checking."""
    return os.path.splitext(state)[0] + ".inflight.py"


def _died(code: int, log: str | None = None, start: int = 0) -> str:
    if code == 1 and log is not None and _timed_out(log, start):
        return f"hung: no check returned in {runner.PROGRAM_GIVE_UP:.0f} s (its threads' stacks: {log})"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _timed_out(log: str, start: int) -> bool:
    """Whether the worker wrote faulthandler's dump (runner.PROGRAM_GIVE_UP) to its log
    after offset ``start`` (where this worker began writing). Read whole: the dump's
    first line may lie further back than any fixed tail when many threads are dumped."""
    with open(log, "rb") as fh:
        fh.seek(start)
        return any(line.startswith(b"Timeout (") for line in fh)


def _parallel(args: argparse.Namespace) -> int:
    summary = run_parallel(args)
    return 2 if summary is None else _finish(summary, args)


def run_parallel(args: argparse.Namespace) -> Summary | None:
    """Run the programs in chunks of ``--chunk``, each in a fresh worker
    process (a long-lived one grows: every program is a new module, and
    Dynamo keeps code for it), ``args.jobs`` at a time; the merged summary,
    or None if a worker failed. Chunk c draws with hypothesis seed
    ``seed * 1000 + c``; with ``--resume`` finished chunks are kept and an
    interrupted one continues."""
    parts = _parts(args)
    total = -(-args.programs // args.chunk)
    chunks = [(c, min(args.chunk, args.programs - c * args.chunk)) for c in range(total)]
    first, last = (int(v) for v in args.chunks.split(":")) if args.chunks else (0, total)
    states = {c: os.path.join(parts, f"chunk-{c}.pkl") for c, _ in chunks}
    keys = {c: _key(argparse.Namespace(**{**vars(args), "programs": n}), args.seed * 1000 + c) for c, n in chunks}
    for name in os.listdir(parts):
        if name.startswith(("chunk-", "part-")):
            c = int(name.split("-")[1].split(".")[0]) if name.startswith("chunk-") else None
            stale = c not in keys or (name.endswith(".pkl") and _load(os.path.join(parts, name), keys[c]) is None)
            if not args.resume or stale:  # another run's, or this code's no more
                os.remove(os.path.join(parts, name))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # A part (--chunks) runs its chunks; the summary merges every chunk of the run finished here.
    pending = [(c, n) for c, n in chunks if first <= c < last and not _finished(states[c], n, keys[c])]
    running: list[tuple[int, subprocess.Popen, Any]] = []
    failed: list[int] = []
    restarts = {c: 0 for c, _ in chunks}
    log_start: dict[int, int] = {}
    counts = dict(chunks)
    began = time.perf_counter()
    printed = -1
    while pending or running:
        while pending and len(running) < args.jobs:
            c, count = pending.pop(0)
            command = [
                sys.executable, "-m", "tests.fuzz", "--part", f"{c}/{total}", "--state", states[c],
                "--programs", str(count), "--seed", str(args.seed), "--grad-every", str(args.grad_every),
                "--inductor-every", str(args.inductor_every), "--aot-every", str(args.aot_every),
                "--threads-every", str(args.threads_every),
                "--max-statements", str(args.max_statements), "--failures", args.failures, "--resume",
            ]
            log = open(os.path.join(parts, f"chunk-{c}.log"), "a")
            log_start[c] = log.tell()
            running.append((c, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=root), log))
        for entry in list(running):
            c, process, log = entry
            if process.poll() is not None:
                log.close()
                running.remove(entry)
                inflight = _inflight(states[c])
                if process.returncode != 0 and os.path.exists(inflight) and restarts[c] < RESTARTS:
                    # It died checking that program: start it again, after it (runner._died_checking).
                    restarts[c] += 1
                    why = _died(process.returncode, log.name, log_start[c])
                    with open(inflight, "a") as fh:
                        fh.write(f"\n# died: the worker process, {why}\n")
                    print(f"[fuzz] chunk {c}: the worker died ({why}) checking {inflight}; started again after it", flush=True)
                    pending.insert(0, (c, counts[c]))
                elif process.returncode != 0 and _finished(states[c], counts[c], keys[c]):
                    # Every program checked and saved, then it died (at exit): the results stand,
                    # the crash is counted.
                    done = _load(states[c], keys[c])
                    done.crashes.append(f"chunk {c}: the worker process, {_died(process.returncode)}, after its last program")
                    _dump(done, states[c], keys[c])
                    print(f"[fuzz] chunk {c}: the worker died ({_died(process.returncode)}) after its last program", flush=True)
                elif process.returncode != 0:
                    print(f"[fuzz] chunk {c}: the worker died ({_died(process.returncode)})", flush=True)
                    failed.append(c)
        summary = _merged(list(states.values()), time.perf_counter() - began, args.jobs)
        if summary.programs >= printed + args.progress_every or not (pending or running):
            printed = summary.programs
            _write(summary, args.summary)
            print(
                f"[fuzz] {summary.programs} programs, {summary.checked} checked, "
                f"{len(summary.mismatches)} mismatches, {summary.seconds:.0f} s ({args.jobs} jobs)",
                flush=True,
            )
        if pending or running:
            time.sleep(2)
    if failed:
        print(f"chunk(s) {failed} failed: see {parts}/chunk-<c>.log", file=sys.stderr)
        for c in failed:  # written before each check, removed after it: the program a dead worker was checking
            if os.path.exists(_inflight(states[c])):
                print(f"  chunk {c}'s worker died checking {_inflight(states[c])}", file=sys.stderr)
        return None
    return _merged(list(states.values()), time.perf_counter() - began, args.jobs)


def _finished(state: str, count: int, key: str) -> bool:
    saved = _load(state, key)
    return saved is not None and saved.programs >= count


def _merged(states: list[str], seconds: float, jobs: int = 1) -> Summary:
    total = Summary()
    worker_seconds = 0.0
    for state in states:
        part = _load(state, None)
        if part is not None:  # None: not written yet
            total.merge(part)
            worker_seconds += part.seconds
    # Wall time of this run, or of the chunks' own times shared by the jobs when resumed.
    total.seconds = max(seconds, worker_seconds / max(jobs, 1))
    return total


def _parts(args: argparse.Namespace) -> str:
    parts = os.path.join(os.path.dirname(args.summary) or ".", "fuzz-parts")
    os.makedirs(parts, exist_ok=True)
    return parts


def _key(args: argparse.Namespace, seed: int) -> str:
    """What a saved state must match to be resumed: the arguments and the code."""
    digest = hashlib.sha256(
        repr((seed, args.programs, args.grad_every, args.inductor_every, args.aot_every, args.threads_every, args.max_statements)).encode()
    )
    here = os.path.dirname(os.path.abspath(__file__))
    import graphmend

    folders = [here, os.path.dirname(graphmend.__file__)]
    for folder in folders:
        for root, _, files in sorted(os.walk(folder)):
            for name in sorted(files):
                if name.endswith(".py"):
                    with open(os.path.join(root, name), "rb") as fh:
                        digest.update(fh.read())
    with open(os.path.join(os.path.dirname(here), "effects_capture.py"), "rb") as fh:
        digest.update(fh.read())
    return digest.hexdigest()


def _load(path: str | None, key: str | None) -> Summary | None:
    """The summary saved at ``path`` (any key when ``key`` is None), else None."""
    try:
        with open(path, "rb") as fh:  # type: ignore[arg-type]
            saved_key, summary = pickle.load(fh)
    except (OSError, EOFError, TypeError, ValueError, pickle.UnpicklingError):
        return None
    return summary if key is None or saved_key == key else None


def _dump(summary: Summary, path: str, key: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        pickle.dump((key, summary), fh)
    os.replace(tmp, path)


def _write(summary: Summary, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        fh.write(summary.render() + "\n")


def _finish(summary: Summary, args: argparse.Namespace) -> int:
    print(summary.render(), flush=True)
    _write(summary, args.summary)
    if summary.mismatches or summary.mend_errors or summary.harness_errors or summary.crashes or summary.left:
        print(f"failing programs written to {args.failures}/")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
