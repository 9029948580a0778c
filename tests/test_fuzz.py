"""Differential fuzzing, CI mode: generated programs, mended and compared with
the original eagerly and compiled (counting backend, aot_eager), with a fixed
hypothesis seed. ``make fuzz`` runs the long mode (tests/fuzz/__main__.py)."""

import os

import pytest
import torch

import graphmend
from fuzz.generator import programs
from fuzz.runner import Summary, check_program, run_many

CI_PROGRAMS = int(os.environ.get("GRAPHMEND_FUZZ_CI", "150"))  # CI time: the long runs are the evidence
CI_JOBS = max(1, min(2, os.cpu_count() or 1))
CI_THREADS_EVERY = 8  # the threads arm (two compiled copies mending at once) on every 8th program


@pytest.fixture(autouse=True)
def _restore():
    yield
    graphmend.unmend()
    torch._dynamo.reset()


def test_generated_programs_behave_identically_when_mended(tmp_path):
    """CI mode: 150 small programs over one worker process per core
    (at most two), fixed seeds; ``make fuzz`` is the long mode."""
    from fuzz.__main__ import parse, run_parallel

    args = parse([
        "--programs", str(CI_PROGRAMS), "--seed", "0", "--jobs", str(CI_JOBS), "--max-statements", "4",
        "--grad-every", "4", "--aot-every", "2", "--inductor-every", "0", "--threads-every", str(CI_THREADS_EVERY),
        "--summary", str(tmp_path / "summary.txt"), "--failures", str(tmp_path / "failures"),
    ])
    summary = run_parallel(args) if CI_JOBS > 1 else run_many(
        CI_PROGRAMS, seed=0, grad_every=4, aot_every=2, inductor_every=0, threads_every=CI_THREADS_EVERY, max_statements=4
    )
    assert summary is not None, (tmp_path / "fuzz-parts").glob("*.log")
    text = summary.render()
    print(text)  # pytest -s shows the CI summary
    assert summary.programs == CI_PROGRAMS, text
    assert summary.mismatches == [], text
    assert summary.mend_errors == [] and summary.harness_errors == [], text
    # The generator reaches every rule, and the check has something to check.
    applied = {rule for (rule, status), n in summary.status.items() if status == "applied"}
    assert {"where", "defer", "trap"} <= applied, text
    assert summary.checked >= CI_PROGRAMS * 0.8, text
    # The graphmend.compile arms without example inputs ran: mends under grad, and from two threads at once.
    assert summary.arm_programs["compile+grad"] > 0 and summary.arm_programs["threads"] > 0, text
    assert summary.grad_reports[True] > 0 and summary.grad_reports[False] == 0, text
    # Nothing graphmend wraps while it runs (sys.stdout / stderr, warnings, logging) is left wrapped,
    # and no worker process died (a crash: it is started again after the program, which counts here).
    assert summary.left == [] and summary.crashes == [], text


SWAPPED = '''
import logging

import torch
from torch import nn

logger = logging.getLogger("graphmend.fuzz")


class Model(nn.Module):
    def forward(self, x):
        h = x * 1.0
        s = h.mean()
        if (h > 0).any():
            logger.warning("first %s", h)
        if h.sum() > 0:
            logger.warning("second %s", h)
        return h
'''


def test_the_runner_reports_a_difference(monkeypatch):
    """The harness can fail: a runtime that replays deferred records in reverse
    is caught on an input the example (one record: verification passes) did not cover."""
    from fuzz.generator import Program
    from fuzz.runner import inputs_for

    from graphmend.runtime import regions

    flush = regions.flush  # what a region calls when it closes
    monkeypatch.setattr(regions, "flush", lambda records: flush(list(reversed(records))))
    seed = next(s for s in range(100) if (inputs_for(s)[0] > 0).any() and inputs_for(s)[0].sum() < 0)
    result = check_program(Program(SWAPPED), seed=seed, start=0, aot=False)
    assert result.status == "checked"
    # Both warnings deferred (the second, not reached on the example input, ahead of its if)
    assert [(o[1], o[2]) for o in result.outcomes if o[1] == "defer"] == [("defer", "applied")] * 2
    assert any("log records" in m for m in result.mismatches), result


PRINTS = '''
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        print("h is", h.sum())
        return torch.relu(h)
'''


def test_the_threads_arm_reports_a_print_lost_on_another_thread(monkeypatch):
    """The harness can fail: a runtime that drops the deferred prints of calls made on a
    thread other than the main one (not while graphmend mends: verification would revert
    the rewrite) is caught by the threads arm, and by no other arm."""
    import threading

    from fuzz.generator import Program
    from graphmend.discover import isolation

    from graphmend.runtime import regions
    from graphmend.runtime.records import Print

    flush = regions.flush  # what a region calls when it closes

    def drop_other_threads_prints(records):
        if threading.current_thread() is not threading.main_thread() and isolation._current() is None:
            records = [r for r in records if type(r) is not Print]
        flush(records)

    monkeypatch.setattr(regions, "flush", drop_other_threads_prints)
    result = check_program(Program(PRINTS), seed=1, start=0, aot=False, threads=True)
    assert result.status == "checked" and result.arms == ["threads"], result
    assert [(o[1], o[2]) for o in result.outcomes] == [("defer", "applied")], result
    assert result.mismatches, result
    assert all(m.startswith("threads, thread ") and ": stdout: " in m for m in result.mismatches), result
    assert {m.split(",")[1] for m in result.mismatches} == {" thread 1", " thread 2"}, result


def test_the_compile_grad_arm_reports_a_gradient_difference(monkeypatch):
    """The harness can fail: a graphmend.compile call that nudges the gradient of its output
    by one part in 2**20 under grad is caught by the compile+grad arm (gradients to the bit)."""
    from fuzz.generator import Program
    from graphmend.pipeline import MendReport

    class Nudge(torch.autograd.Function):
        @staticmethod
        def forward(ctx, value):
            return value.view_as(value)

        @staticmethod
        def backward(ctx, grad):
            return grad * (1 + 2**-20)

    call = MendReport.call

    def nudged(self, fn, model, args, kwargs):
        out = call(self, fn, model, args, kwargs)
        return Nudge.apply(out) if torch.is_grad_enabled() and out.requires_grad else out

    monkeypatch.setattr(MendReport, "call", nudged)
    result = check_program(Program(PRINTS), seed=1, start=0, aot=False, grad=True)
    assert result.status == "checked" and result.arms == ["compile+grad"], result
    assert result.grad_report is True, result
    assert result.mismatches, result
    assert all(m.startswith("compile+grad, call ") and "values differ" in m for m in result.mismatches), result
    assert any(".x: values differ" in m for m in result.mismatches) and any(".lin.weight: values differ" in m for m in result.mismatches), result


def test_a_program_a_worker_died_on_counts_as_crashed_and_is_not_checked_again(tmp_path):
    """run_parallel restarts a worker that died, with "# died: ..." added to the program it was
    checking (its in-flight file); the restarted worker counts that program as crashed."""
    from fuzz.generator import Program
    from fuzz.runner import Result, _died_checking, save_failure

    program, other = Program(SWAPPED), Program(PRINTS)
    path = save_failure(str(tmp_path), program, Result(program.digest, "in flight"), {"seed": 1}, name="chunk-0.inflight.py")
    assert _died_checking(path, program) is None  # still running, or stopped: checked again
    with open(path, "a") as fh:
        fh.write("\n# died: the worker process, killed by SIGSEGV\n")
    assert _died_checking(path, program) == "the worker process, killed by SIGSEGV"
    assert _died_checking(path, other) is None
    summary = Summary()
    summary.add(Result(program.digest, "crashed", detail="the worker process, killed by SIGSEGV"))
    assert (summary.programs, summary.checked, summary.crashes) == (1, 0, [f"{program.digest}: the worker process, killed by SIGSEGV"])
    assert "worker process crashes (a program it died on counts here, is not checked again, and the run goes on): 1" in summary.render()


HANGS = """
import sys, time
from fuzz import runner
runner.PROGRAM_GIVE_UP = 1.0
runner.check_program = lambda *args, **kwargs: time.sleep(60)  # a check that does not return
runner.run_many(1, seed=1, inflight=sys.argv[1], failures=sys.argv[2])
"""


def test_a_worker_whose_check_never_returns_dumps_its_threads_and_exits_to_be_restarted(tmp_path):
    """A deadlock that holds the GIL keeps the threads arm's own wait from waking (seed 24, torch's
    traceback free list at thread exit): past runner.PROGRAM_GIVE_UP, faulthandler writes every
    thread's stack and exits, leaving the in-flight program; the parent names the hang."""
    import subprocess
    import sys

    from fuzz.__main__ import _died

    inflight, log = tmp_path / "chunk-0.inflight.py", tmp_path / "chunk-0.log"
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.path.join(os.path.dirname(tests), "src")]))
    with open(log, "w") as fh:
        fh.write("Timeout (0:00:09)! an earlier worker's\n")
        start = fh.tell()
        fh.flush()
        code = subprocess.run([sys.executable, "-c", HANGS, str(inflight), str(tmp_path)], stdout=fh, stderr=fh, env=env).returncode
    assert code == 1, code  # faulthandler's exit; the dump below shows it fired
    written = log.read_text()[start:]
    assert written.startswith("Timeout (0:00:01)!") and "in <lambda>" in written, written[:500]
    assert inflight.exists()  # the program it was checking, for the restarted worker to count as crashed
    assert _died(code, str(log), start) == f"hung: no check returned in 5400 s (its threads' stacks: {log})"
    assert _died(1, str(log), os.path.getsize(log)) == "exit status 1"  # nothing written since: another exit
    assert _died(-9, str(log), start) == "killed by SIGKILL"


def test_programs_are_valid_python():
    from hypothesis import HealthCheck, given, settings

    # Generation speed is not what this asserts: on a starved CI machine the
    # too_slow health check failed it (one program in 2.5 s under nice 19).
    @settings(max_examples=200, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(programs())
    def compiles(program):
        compile(program.source, "<fuzz>", "exec")
        assert "class Model(nn.Module)" in program.source

    compiles()


def test_summary_counts_declines_by_reason():
    from fuzz.runner import Result

    summary = Summary()
    summary.add(Result("a", "checked", outcomes=[("DC", "where", "declined", "`h` is assigned on one path only (line 12)")]))
    summary.add(Result("b", "checked", outcomes=[("DC", "where", "declined", "`y` is assigned on one path only (line 7)")]))
    assert summary.declined == {"declined [where] `...` is assigned on one path only (line N)": 2}


def test_summary_counts_sites_whose_break_another_mend_removed_apart():
    """A site no rule mended whose break is gone (inside a mended branch) is `gone`: not
    mended, but no break left; the decline rate counts only sites with their break left."""
    from fuzz.runner import GONE, Result

    summary = Summary()
    summary.add(Result("a", "checked", outcomes=[
        ("DC", "where", "applied", "early return predicated"),
        ("DC", "where", GONE, "an early return inside a loop or block"),
        ("DC", "where", "declined", "a while loop on a tensor value cannot be predicated"),
        ("DC", "where", "applied", "if predicated"),
    ]))
    text = summary.render()
    assert "sites mended: 2; sites not mended: 2, 1 of them with their break removed by another site's mend" in text
    assert "sites not mended with their break left: 1 of 4 (25.0%)" in text


def test_the_parts_of_a_run_check_what_the_whole_run_checks(tmp_path):
    """`--chunks A:B` runs a part of a run; the parts, resumed in one folder, merge into the
    summary the whole run gives (the same programs, drawn with the same seeds)."""
    from fuzz.__main__ import parse, run_parallel

    def run(folder, *extra):
        args = parse([
            "--programs", "4", "--chunk", "2", "--seed", "7", "--max-statements", "3", "--grad-every", "0",
            "--aot-every", "0", "--inductor-every", "0", "--threads-every", "0", "--resume",
            "--summary", str(tmp_path / folder / "summary.txt"), "--failures", str(tmp_path / folder / "failures"), *extra,
        ])
        return run_parallel(args)

    first = run("parts", "--chunks", "0:1")
    assert first is not None and first.programs == 2
    parts = run("parts", "--chunks", "1:2")
    whole = run("whole")
    assert parts is not None and whole is not None
    assert parts.render().splitlines()[1:] == whole.render().splitlines()[1:]  # all but the timing line
    assert parts.programs == 4 and parts.status == whole.status


def test_summary_counts_held_assert_choices_apart_from_verification_reverts():
    from fuzz.runner import Result

    held = "graph breaks before `assert ...` would leave 1 more graph(s), and without them an assert that may be on tensor values stays in the graph, and ..."
    summary = Summary()
    summary.add(Result("a", "checked", kept=["a graph break goes before `assert (h > 0).all()` (line 3) ..."]))
    summary.add(Result("b", "checked", outcomes=[("LC", "defer", "reverted", held)], kept=["the rewrites that record ([defer], [trap]) are reverted: " + held]))
    summary.add(Result("c", "checked", outcomes=[("LC", "defer", "reverted", "verification found a difference: stdout")]))
    assert (summary.held_breaks, summary.held_reverted, summary.reverted) == (1, 1, ["c"])
    assert "with a graph break kept before an assert compiled into the graph (barriers.py): 1; with the rewrites that record reverted instead (fewer graphs): 1" in summary.render()


def test_worker_summaries_merge_into_one():
    from fuzz.runner import Result

    def one(digest, mismatch, rule):
        result = Result(digest, "checked", mismatches=[mismatch] if mismatch else [], graphs=(3, 1))
        result.outcomes = [("GB", rule, "applied", "ok"), ("GB", "where", "declined", "elif chains")]
        return result

    a, b = Summary(), Summary()
    a.add(one("p1", None, "defer"))
    b.add(one("p2", "eager, call 1: stdout differs", "trap"))
    b.add(Result("p3", "invalid"))
    a.merge(b)
    assert (a.programs, a.checked, a.invalid) == (3, 2, 1)
    assert (a.graphs_before, a.graphs_after) == (6, 2)
    assert a.status[("defer", "applied")] == a.status[("trap", "applied")] == 1
    assert a.status[("where", "declined")] == 2
    assert a.mismatches == [("p2", ["eager, call 1: stdout differs"])]


def test_inductor_text_numbers_compare_to_the_output_tolerance():
    from fuzz.runner import _close
    from graphmend.rewrite.verify import Observation

    eager = Observation(stdout="mean 0.6296598315\n", warnings=[("UserWarning", "h 30.8125", "f.py", 3)])
    fused = Observation(stdout="mean 0.6296597719\n", warnings=[("UserWarning", "h 30.8127", "f.py", 3)])
    assert _close(eager, fused) == []
    clamped = Observation(stdout="mean 0.6296598315\n", warnings=[("UserWarning", "h 64512.", "f.py", 3)])
    overflowed = Observation(stdout="mean 0.6296598315\n", warnings=[("UserWarning", "h 308199.2", "f.py", 3)])
    assert [d.split(":")[0] for d in _close(clamped, overflowed)] == ["warnings"]
    assert _close(Observation(stdout="a 1\n"), Observation(stdout="b 1\n")) != []


def test_the_threads_arm_waits_for_slow_threads_and_gives_up_on_blocked_ones(monkeypatch):
    """A threads arm on a machine whose cores another job holds is slow, not stuck: it is
    waited for while the process works; threads that use no CPU (a deadlock) are given up
    on after one span."""
    import threading
    import time

    from fuzz import runner

    monkeypatch.setattr(runner, "THREAD_TIMEOUT", 0.5)  # a span: long enough to get CPU on a loaded machine
    monkeypatch.setattr(runner, "WORKING_CPU_S", 0.05)

    def spin(cpu_seconds: float) -> None:
        start = time.thread_time()
        while time.thread_time() - start < cpu_seconds:
            pass

    busy = threading.Thread(target=spin, args=(1.2,), daemon=True)
    busy.start()
    waited, _ = runner._join_while_working([busy])
    assert not busy.is_alive() and waited > 1.0

    never = threading.Event()
    blocked = threading.Thread(target=never.wait, daemon=True)
    blocked.start()
    waited, cpu_used = runner._join_while_working([blocked])
    assert blocked.is_alive() and waited < 2.0 and cpu_used < 0.05
    never.set()
