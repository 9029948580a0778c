"""[Defer]: each behaviour the issue lists, compared with eager; the bugs the
fuzzer found in it; its golden table (a source -> the exact rewrite, or the
exact reason it declines)."""

import copy
import logging
import threading
import warnings

import effects as E
import golden
import library_effects
import pytest
import torch
from conftest import fixture_program
from effects_capture import CountingBackend, bits_equal, run
from torch import nn

import graphmend
from graphmend import runtime
from graphmend.compat import release

X = E.inputs()


@pytest.fixture(autouse=True)
def _restore():
    yield
    graphmend.unmend()
    torch._dynamo.reset()


def compiled(model, **kw):
    backend = CountingBackend()
    return graphmend.compile(model, backend=backend, **kw), backend


def eager_and_mended(cls):
    model = cls()
    eager = run(model, *X)
    c, backend = compiled(model)
    mended = run(c, *X)
    return eager, mended, backend, c


def assert_same(eager, mended):
    assert mended.effects() == eager.effects()
    if eager.output is not None:
        assert torch.equal(eager.output, mended.output)


def test_snapshot_prints_value_at_the_print_not_after_mutation():
    eager, mended, backend, c = eager_and_mended(E.Mutates)
    assert "tensor([[-2." in eager.stdout  # the value before add_(100)
    assert_same(eager, mended)
    assert len(backend.graphs) == 1


def test_one_fifo_order_across_print_log_warn_with_kwargs_and_locations():
    eager, mended, backend, c = eager_and_mended(E.Ordered)
    assert eager.stdout.index("first") < eager.stdout.index("fourth|")
    assert [r[5] for r in eager.records] == ["second tensor(1.)", "fifth 8 items"]
    assert eager.records[0][2] == E.__file__ and eager.records[0][4] == "forward"
    assert eager.warnings[0][2:] == (E.__file__, 30)
    assert_same(eager, mended)
    assert len(backend.graphs) == 1
    assert all(o.status == "applied" for o in c.report.outcomes)


def test_order_is_global_fifo_across_kinds():
    # One stream: interleave stdout and log text through a single handler.
    lines = []

    class ToList(logging.Handler):
        def emit(self, record):
            lines.append("log:" + record.getMessage())

    handler = ToList()
    E.logger.addHandler(handler)
    try:
        model = E.Ordered()
        import builtins

        real_print = builtins.print

        def spy(*a, **k):
            if k.get("file") is None:
                lines.append("print:" + " ".join(str(x) for x in a))
            real_print(*a, **k)

        c, _ = compiled(model, example_inputs=X)  # mend first: analysis runs print too
        builtins.print = spy
        try:
            run(model, *X)  # eager; the mended code outside a region acts at once
            eager_lines, lines[:] = list(lines), []
            run(c, *X)
        finally:
            builtins.print = real_print
    finally:
        E.logger.removeHandler(handler)
    assert lines == eager_lines
    assert [l.split(":")[0] for l in lines] == ["print", "log", "print", "log"]


def test_effects_in_helpers_and_submodules():
    eager, mended, backend, c = eager_and_mended(E.Helper)
    assert "helper sees" in eager.stdout and ("FutureWarning", "helper warns") == eager.warnings[-1][:2]
    assert_same(eager, mended)
    assert len(backend.graphs) == 1


def test_effects_before_an_exception_are_performed():
    model = E.Raises()
    c, backend = compiled(model, example_inputs=X)  # mended on inputs that work
    assert len(backend.graphs) == 0 and len(c.report.applied) == 3
    model.strict = True
    eager = run(model, *X)
    assert eager.exception == ("ValueError", "strict mode refuses this input")
    assert "before the error" in eager.stdout and "after the check" not in eager.stdout
    assert [r[5] for r in eager.records] == ["also before"]
    mended = run(c, *X)
    assert mended.effects() == eager.effects()


def test_formatting_that_needs_host_values_is_deferred():
    eager, mended, backend, c = eager_and_mended(E.Formats)
    assert "loss 0.000 n=8" in eager.stdout and "cat tensor(" in eager.stdout
    assert_same(eager, mended)
    assert len(backend.graphs) == 1  # the .item() / .tolist() / int() left the graph


def test_disabled_level_records_nothing_and_adds_no_graph_outputs():
    E.logger.setLevel(logging.WARNING)
    try:
        eager, mended, backend, c = eager_and_mended(E.Disabled)
        assert eager.records == [] and mended.records == []
        assert len(backend.graphs) == 1
        outputs = [n for n in backend.graphs[0].graph.nodes if n.op == "output"][0].args[0]
        assert len(outputs) == 1  # no snapshot of the hidden message's argument
        # Enabling the level later makes the record appear (Dynamo recompiles).
        E.logger.setLevel(logging.INFO)
        again = run(c, *X)
        assert [r[5][:7] for r in again.records] == ["hidden "]
    finally:
        E.logger.setLevel(logging.NOTSET)


def test_outside_a_region_effects_are_immediate():
    model = E.Ordered()
    eager = run(model, *X)
    graphmend.mend(model, *X)
    assert not runtime.active()
    mended_eager = run(model, *X)  # plain eager call of the mended model
    assert mended_eager.effects() == eager.effects()


def test_threads_never_mix_or_lose_effects():
    model = E.Counted()
    c, backend = compiled(model, example_inputs=X)
    import builtins

    seen = {}
    real_print = builtins.print

    # By thread name: a thread's ident is reused by one started after it ended.
    def spy(*a, **k):
        seen.setdefault(threading.current_thread().name, []).append(a[1])

    results = {}

    def worker(i):
        x = torch.full((2, 4), float(i))
        with torch.no_grad():
            for _ in range(20):
                c(x)
        results[threading.current_thread().name] = 2.0 * i

    builtins.print = spy
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        builtins.print = real_print
    assert sorted(len(v) for v in seen.values()) == [20, 20, 20, 20]
    for ident, values in seen.items():
        assert set(values) == {results[ident]}


def test_plain_torch_compile_of_a_mended_model_warns_once(monkeypatch):
    monkeypatch.setattr(runtime.regions, "_unguarded_warned", False)  # the warning is once per process
    model = E.Ordered()
    graphmend.mend(model, *X)
    backend = CountingBackend()
    plain = torch.compile(model, backend=backend)
    first, second = run(plain, *X), run(plain, *X)
    ours = [w for w in first.warnings + second.warnings if "outside a deferral region" in w[1]]
    assert len(ours) == 1  # once, not per call or per site
    assert ours[0][0] == "RuntimeWarning"
    assert "first tensor(8.)" in first.stdout  # the effects still happen (the break stays)


def test_unmend_restores_the_original_code_objects():
    model = E.Ordered()
    original = E.Ordered.forward.__code__
    report = graphmend.mend(model, *X)
    assert E.Ordered.forward.__code__ is not original
    assert report.applied
    graphmend.unmend(model)
    assert E.Ordered.forward.__code__ is original


def test_mended_context_manager():
    model = E.Helper()
    original = (E.Helper.report.__code__, E.Ordered.forward.__code__)
    with graphmend.mended(model, *X) as report:
        assert len(report.applied) == 7  # the warn at line 46 is deferred with the print at 45 (same function)
    assert (E.Helper.report.__code__, E.Ordered.forward.__code__) == original


def test_declines_are_reported_with_reasons():
    import effects_declines as D

    model = D.Declines()
    report = graphmend.mend(model, *D.inputs())
    assert [(o.line, o.status, o.rule, o.reason) for o in report.outcomes] == [
        (13, "declined", "defer", "stacklevel other than 1 attributes the effect to a caller known only at run time"),
        (14, "declined", "defer", "the side effect is not a call statement (its value is used)"),
    ]


class WarnsOnAnotherPath(torch.nn.Module):
    def forward(self, h):
        if h.sum() > 0:
            h = h * 2
        elif h.sum() < -100:
            warnings.warn(f"low {h.mean()}")
            h = h - 1
        return h + 1


class WarnsWithStacklevelOnAnotherPath(torch.nn.Module):
    def forward(self, h):
        if h.sum() > 0:
            h = h * 2
        elif h.sum() < -100:
            warnings.warn(f"low {h.mean()}", stacklevel=2)
            h = h - 1
        return h + 1


def _line_of(cls, text):
    import inspect

    lines, first = inspect.getsourcelines(cls)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_effects_of_a_function_that_breaks_are_deferred_ahead():
    """The example input takes the first branch, so the warning never broke the graph; on an input
    that reaches it, it would run in a frame Dynamo compiled, where torch 2.13 can report another
    line (tests/fixtures/fuzz_warning_line.py). It is deferred ahead, and says why."""
    model = WarnsOnAnotherPath()
    c, backend = compiled(model, example_inputs=(torch.ones(3),))
    warn_line = _line_of(WarnsOnAnotherPath, "warnings.warn")
    outcome = {o.line: o for o in c.report.outcomes}[warn_line]
    assert (outcome.rule, outcome.status) == ("defer", "applied")
    assert "no break seen here on the example inputs" in outcome.reason
    low = torch.full((3,), -50.0)
    eager, mended = run(model, low), run(c, low)
    assert eager.warnings == [("UserWarning", "low -50.0", __file__, warn_line)]
    assert_same(eager, mended)


def test_an_effect_that_cannot_be_deferred_is_not_touched_ahead():
    model = WarnsWithStacklevelOnAnotherPath()
    c, backend = compiled(model, example_inputs=(torch.ones(3),))
    warn_line = _line_of(WarnsWithStacklevelOnAnotherPath, "warnings.warn")
    assert warn_line not in {o.line for o in c.report.outcomes}  # not a break the example showed: no outcome
    low = torch.full((3,), -50.0)
    # stacklevel=2 names a caller frame, which differs under torch.compile with or without graphmend
    eager, mended = run(model, low), run(c, low)
    assert [w[:2] for w in mended.warnings] == [w[:2] for w in eager.warnings] == [("UserWarning", "low -50.0")]
    assert torch.equal(mended.output, eager.output)


# -- fuzz regressions ----------------------------------------------------------
# Bugs the differential fuzzer (tests/fuzz) found in [Defer], each as the smallest
# program that shows it; each asserts the behaviour the original has.


class EffectOnAnotherPath(nn.Module):
    """Found by the fuzzer: only the first warning is on the example path, so
    only it was deferred; on other inputs the second one was logged first."""

    def forward(self, x):
        if (x > 0).any():
            LOGGER.warning("first %s", x)
        if x.sum() > 0:
            LOGGER.warning("second %s", x)
        return x * 2


LOGGER = logging.getLogger("graphmend.tests.fuzz_regressions")


def test_an_effect_on_a_path_not_taken_keeps_its_order():
    model = EffectOnAnotherPath()
    mended = copy.deepcopy(model)
    report = graphmend.mend(mended, torch.tensor([1.0, -5.0]))  # takes the first branch only
    # Both ifs are predicated, each warning happening only when its branch would have run:
    # the second one too, rewritten ahead (its branch is not taken on the example input).
    assert [(o.rule, o.status) for o in report.outcomes] == [("where", "applied"), ("defer", "applied")] * 2
    assert (report.before.graphs, report.after.graphs) == (3, 1)
    x = torch.tensor([1.0, 2.0])  # takes both
    expected = run(copy.deepcopy(model), x)
    assert [r[-1].split()[0] for r in expected.records] == ["first", "second"]
    got = run(lambda t: _in_region(mended, t), x)
    assert got.records == expected.records
    assert got.stderr == expected.stderr
    compiled = torch.compile(copy.deepcopy(mended), backend="eager")
    got = run(lambda t: _in_region(compiled, t), x)
    assert got.records[0][-1] == expected.records[0][-1] and got.records[1][-1] == expected.records[1][-1]


def _in_region(fn, *args):
    with graphmend.runtime.region():
        return fn(*args)


class EmitsOnAnotherPath(nn.Module):
    def __init__(self, channel):
        super().__init__()
        self.channel = channel

    def forward(self, h):
        if h.sum() > 0:
            _emit(self.channel, f"block {h.mean()}")
        return h * 2


class EmitsThroughALibrary(EmitsOnAnotherPath):
    def forward(self, h):
        if h.sum() > 0:
            library_effects.emit(self.channel, f"block {h.mean()}")
        return h * 2


def _emit(channel, text):
    if channel == "print":
        print(text)
    elif channel == "log":
        LOGGER.warning(text)
    else:
        warnings.warn(text)


class CallerWarnsFirst(nn.Module):
    """Found by the fuzzer (seed 2): the callee's warning is on a path the
    example did not take, so it is not deferred; the caller's is, and the
    callee's was emitted first. A callee of the same file now has its effects
    deferred ahead; one in another file (a library's) is not, and the watch
    performs the pending records before it."""

    def __init__(self, channel="warn", emit="here"):
        super().__init__()
        self.block = (EmitsOnAnotherPath if emit == "here" else EmitsThroughALibrary)(channel)

    def forward(self, x):
        warnings.warn(f"first {x.mean()}")
        print(f"first {x.mean()}")
        LOGGER.warning(f"first {x.mean()}")
        return self.block(x)


@pytest.mark.parametrize("emit, deferred", [("here", 6), ("library", 3)])
@pytest.mark.parametrize("channel", ["warn", "print", "log"])
def test_a_callee_effect_on_a_path_not_taken_keeps_its_order(channel, emit, deferred):
    model = CallerWarnsFirst(channel, emit)
    x = torch.tensor([1.0, 2.0])
    expected = run(copy.deepcopy(model), x)
    compiled = graphmend.compile(model, backend="eager", example_inputs=(-x,))
    assert [o.rule for o in compiled.report.outcomes if o.status == "applied"] == ["defer"] * deferred
    got = run(compiled, x)
    emitted = {"warn": [w[1] for w in expected.warnings], "print": expected.stdout.splitlines(),
               "log": [r[-1] for r in expected.records]}[channel]
    assert emitted == ["first 1.5", "block 1.5"]
    assert (got.stdout, got.records, got.warnings) == (expected.stdout, expected.records, expected.warnings)
    again = run(compiled, x)  # no recompile: the watched streams are the same objects on every call
    assert (again.stdout, again.records) == (expected.stdout, expected.records)


def test_a_log_call_that_was_not_deferred_does_not_make_dynamo_trace_the_watch():
    """Found by the fuzzer (seed 9): the runtime's log record factory (and warning hook) ran under
    Dynamo's frame callback when an un-deferred `logger.warning` ran eagerly; Dynamo traced it into
    `time.time` and warned "does not know how to trace the builtin `time.time`" (counting and
    aot_eager arms, inf input). The watch's hooks are now never compiled."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_record_factory.py"), seed=8, start=0, aot=True)
    assert result.status == "checked"
    assert any(status == "declined" for _, _, status, _ in result.outcomes)  # the logger call stays as written
    assert result.mismatches == [], result.mismatches[:2]


@pytest.mark.parametrize(
    "name, seed, start, graphs, status",
    [("fuzz_warning_line.py", 95, 7, (3, 2), ["applied"] * 4), ("fuzz_warning_line_capture.py", 177, 6, (8, 4), ["applied"] * 3)],
)
def test_a_warning_on_a_path_not_taken_keeps_its_line_in_a_compiled_frame(name, seed, start, graphs, status):
    """Found by the fuzzer (seed 9): a `warnings.warn` the example input did not reach, in a function
    that breaks elsewhere, ran in a Dynamo resume function on later inputs and was reported at the line
    above its own (counting and aot_eager arms). It was then deferred ahead, with the file and line it
    has (test_effects_of_a_function_that_breaks_are_deferred_ahead keeps that on a small model).

    With the capture setting the mend keeps them (8 graphs -> 4). The other program, mended, compiled
    a frame Dynamo skipped before (3 graphs with 3 frames skipped -> 4 with 2) until issue 24: with
    its branch holding a deferred effect now a select too, it stays at 3 graphs, and every rewrite
    stays; 2 since the runtime's functions are never compiled as frames of their own (a deferred
    call run by eager code after a break made a graph of its own). (Before, never worse
    took back every rewrite together: one that defers a warning is not taken back alone, as with the
    other rewrites in place the warning would run in a compiled frame the original does not have,
    at another line; test_never_worse keeps that.)"""
    from fuzz.runner import check_program

    result = check_program(fixture_program(name), seed=seed, start=start, aot=True)
    assert result.status == "checked" and result.graphs == graphs
    deferred = [(s, r) for _, rule, s, r in result.outcomes if rule == "defer"]
    assert [s for s, _ in deferred] == status, deferred
    if status[0] == "reverted":
        assert all(r.endswith("(one that defers a warnings.warn is not taken back alone): every rewrite is reverted")
                   for _, r in deferred), deferred
    else:
        assert any("no break seen here on the example inputs" in r for _, r in deferred), deferred
    assert result.mismatches == [], result.mismatches[:2]


def test_a_warning_in_a_module_the_example_never_ran_keeps_its_line():
    """Found by the fuzzer (seed 10): the effects of the model's code that no break showed (a module
    the example input never ran) are deferred ahead too; found as `graphmend check` finds them,
    with the live globals (`nn = th.nn`)."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_warning_line_callee.py"), seed=101, start=3, aot=True)
    assert result.status == "checked"
    ahead = [r for _, rule, status, r in result.outcomes if rule == "defer" and "rewritten ahead" in r]
    assert any("the model's code" in r for r in ahead), result.outcomes
    assert result.mismatches == [], result.mismatches[:2]


class Calls(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0


class PrintThenAssert(nn.Module):
    """The assert stays in the function ([Trap] declines: a state change follows
    it, on a child module, which [Trap] does not put back)."""

    def __init__(self):
        super().__init__()
        self.counter = Calls()

    def forward(self, x):
        print("x is", x)
        assert (x > 0).all(), "not positive"
        self.counter.calls += 1
        return x * 2


class PrintsThenAssert(PrintThenAssert):
    """Two effects before the assert: one graph break before it leaves fewer breaks than two."""

    def forward(self, x):
        print("x is", x)
        print("x sums to", x.sum())
        assert (x > 0).all(), "not positive"
        self.counter.calls += 1
        return x * 2


class WarnThenAssert(PrintThenAssert):
    """A tie (one effect, one assert): a warning tips it to the graph break."""

    def forward(self, x):
        print("x is", x)
        warnings.warn(f"x sums to {x.sum()}")
        assert (x > 0).all(), "not positive"
        self.counter.calls += 1
        return x * 2


class PrintThenTorchAssert(PrintThenAssert):
    """``torch._assert``: a graph break up to torch 2.14, compiled into the graph like the assert from 2.15."""

    def forward(self, x):
        print("x is", x)
        torch._assert((x > 0).all(), "not positive")
        self.counter.calls += 1
        return x * 2


class PrintThenNestedAssert(nn.Module):
    """The assert call sits inside an expression: no graph break can go before it alone."""

    def forward(self, x):
        print("x is", x)
        checks = [torch._assert_async((x > 0).all(), "not positive")]
        return x * 2 + len(checks)


class PrintThenTrappedAssert(nn.Module):
    def forward(self, x):
        print("x is", x)
        assert (x > 0).all(), "not positive"
        return x * 2


class PrintThenShapeAssert(nn.Module):
    def forward(self, x):
        print("x is", x)
        n = x.shape[0]
        assert x.dim() == 1 and n > 0, "a vector"
        return x * 2


@pytest.mark.parametrize(
    "cls, defer, barrier",
    [
        (PrintThenAssert, "declined", False),
        (PrintsThenAssert, "applied", True),
        (WarnThenAssert, "applied", True),
        (PrintThenNestedAssert, "declined", False),
        (PrintThenTorchAssert, "declined" if release().assert_in_graph else "applied", False),
        (PrintThenTrappedAssert, "applied", False),
        (PrintThenShapeAssert, "applied", False),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_output_recorded_before_an_assert_compiled_into_the_graph_is_not_lost(cls, defer, barrier):
    """Found by the fuzzer (seed 12): Dynamo compiles an assert on tensor values into the graph; when
    it failed, the graph raised before returning and the print / log recorded in it was lost. Now a
    graph break goes before such an assert (the records reach the region, which performs them when
    the assert fails); where it cannot, the function's effects stay in place. A trapped assert or one
    on shapes needs neither."""
    bad = -torch.ones(3)
    expected = run(cls(), bad)
    assert expected.stdout.startswith("x is tensor([-1., -1., -1.])")
    compiled = graphmend.compile(cls(), backend="eager", example_inputs=(torch.ones(3),))
    outcomes = {o.rule: (o.status, o.reason) for o in compiled.report.outcomes}
    assert outcomes["defer"][0] == defer, outcomes
    assert ("a graph break is kept before" in outcomes["defer"][1]) == barrier, outcomes
    if defer == "declined":
        assert "stays an assert that may be on tensor values" in outcomes["defer"][1]
    got = run(compiled, bad)
    assert got.stdout == expected.stdout
    assert got.warnings == expected.warnings
    if cls is PrintThenShapeAssert:
        assert got.exception is None and torch.equal(got.output, expected.output)
    elif cls is PrintThenTrappedAssert:  # AssertionError after the call, as eager raises it
        assert got.exception == ("AssertionError", "not positive")  # eager's, less pytest's assert rewriting
        assert expected.exception[0] == "AssertionError" and expected.exception[1].startswith("not positive")
    else:  # left in the graph: what torch.compile of the original raises
        torch._dynamo.reset()
        control = run(torch.compile(cls(), backend="eager"), bad)
        assert got.exception[0] == control.exception[0]  # RuntimeError on torch 2.13, AssertionError on 2.14


def test_a_deferred_log_before_an_assert_on_a_path_not_taken_is_kept():
    """The fuzz program (seed 12): a logger call on a path the example input did not take was deferred
    ahead, with the function's other effects; the assert after it failed in the graph on a NaN input.
    A graph break was kept before the assert; since [Trap] rewrites checks in branches ahead (and puts
    back the `self.calls` stored after it) the assert is trapped, and nothing is left in the graph to fail."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_assert_after_deferred_log.py"), seed=4935, start=7, aot=True)
    assert result.status == "checked"
    notes = [r for _, rule, status, r in result.outcomes if rule == "defer" and status == "applied"]
    assert not any("a graph break is kept before" in r for r in notes), notes
    traps = [(status, r) for _, rule, status, r in result.outcomes if rule == "trap"]
    assert [status for status, _ in traps] == ["applied"] and "rewritten ahead" in traps[0][1], traps
    assert "(self.calls) is put back when it raises" in traps[0][1]
    assert result.mismatches == [], result.mismatches[:2]


def test_a_warning_before_torch_assert_keeps_its_line():
    """The fuzz program (seed 13): the first fix for the assert above also counted `torch._assert(...)`,
    which on a tensor is a graph break, not an assert in the graph. It left that function's warning in
    place, and the warning, run in a frame Dynamo compiled, reported the `def` line (the torch issue in
    docs/torch-issues.md). `torch._assert` does not count now: the warning is deferred and keeps its line."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_warning_before_torch_assert.py"), seed=1, start=1, aot=True)
    assert result.status == "checked"
    assert any(o[1:3] == ("defer", "applied") for o in result.outcomes), result.outcomes
    assert result.mismatches == [], result.mismatches[:2]


# -- golden table --------------------------------------------------------------
# What [Defer] makes of small sources (tests/rules/golden.py): the site is
# marked `# <-`; each case expects exactly the function after the rewrite, or
# exactly the reason it declines. Source level only: milliseconds a case.
# The rule alone: the graph break kept before an assert, or the function's
# effects left in place, is decided after it (see the fuzz regressions above).

GOLDEN = [
    golden.case(
        "print",
        """
        def f(h):
            print("hidden", h.mean(), sep=": ", end="")  # <-
            return h * 2
        """,
        rewritten="""
        def f(h):
            __graphmend_rt__.print_(('golden_case', 2, 'f'), ('hidden', h.mean()), {'sep': ': ', 'end': ''})
            return h * 2
        """,
    ),
    golden.case(
        "logger-call-with-an-f-string-that-needs-item",
        """
        def f(h):
            logger.warning(f"mask {h.sum().item()}")  # <-
            return h
        """,
        rewritten="""
        def f(h):
            __graphmend_rt__.log(('golden_case', 2, 'f'), logger, 'warning', (__graphmend_rt__.fstr('mask ', (__graphmend_rt__.lazy('item', h.sum()), None, None)),), {})
            return h
        """,
    ),
    golden.case(
        "warn-with-percent-formatting",
        """
        def f(h):
            warnings.warn("low %s" % h.min())  # <-
            return h
        """,
        rewritten="""
        def f(h):
            __graphmend_rt__.warn(('golden_case', 2, 'f'), (__graphmend_rt__.pct('low %s', h.min()),), {})
            return h
        """,
    ),
    golden.case(
        "logger-log-with-a-level",
        """
        def f(h):
            logger.log(logging.INFO, "n=%d", h.numel())  # <-
            return h
        """,
        rewritten="""
        def f(h):
            __graphmend_rt__.log(('golden_case', 2, 'f'), logger, 'log', (logging.INFO, 'n=%d', h.numel()), {})
            return h
        """,
    ),
    golden.case(
        "getlogger-receiver",
        """
        def f(h):
            logging.getLogger(__name__).info("x %s", h)  # <-
            return h
        """,
        rewritten="""
        def f(h):
            __graphmend_rt__.log(('golden_case', 2, 'f'), logging.getLogger(__name__), 'info', ('x %s', h), {})
            return h
        """,
    ),
    golden.case(
        "every-effect-of-the-function-goes-together",
        """
        def f(h):
            print("first", h)  # <-
            h = h + 1
            logger.info("second %s", h)
            warnings.warn("third {}".format(int(h.sum())))
            return h
        """,
        rewritten="""
        def f(h):
            __graphmend_rt__.print_(('golden_case', 2, 'f'), ('first', h), {})
            h = h + 1
            __graphmend_rt__.log(('golden_case', 4, 'f'), logger, 'info', ('second %s', h), {})
            __graphmend_rt__.warn(('golden_case', 5, 'f'), (__graphmend_rt__.fmt('third {}', (__graphmend_rt__.lazy('int', h.sum()),), {}),), {})
            return h
        """,
    ),
    golden.case(
        "value-used",
        """
        def f(h):
            x = print(h)  # <-
            return h
        """,
        declined="the side effect is not a call statement (its value is used)",
    ),
    golden.case(
        "not-an-effect",
        """
        def f(h):
            h.add_(1)  # <-
            return h
        """,
        declined="not a print, warnings.warn or logger call",
    ),
    golden.case(
        "print-rebound",
        """
        print = None


        def f(h):
            print(h)  # <-
            return h
        """,
        declined="`print` is rebound in this module or function",
    ),
    golden.case(
        "stacklevel",
        """
        def f(h):
            warnings.warn("careful", stacklevel=2)  # <-
            return h
        """,
        declined="stacklevel other than 1 attributes the effect to a caller known only at run time",
    ),
    golden.case(
        "logger-exception",
        """
        def f(h):
            logger.exception("oops")  # <-
            return h
        """,
        declined="logger.exception reads the exception being handled at the call",
    ),
    golden.case(
        "exc-info",
        """
        def f(h):
            logger.info("x", exc_info=True)  # <-
            return h
        """,
        declined="stack_info= / exc_info= read the call stack at the call",
    ),
    golden.case(
        "kwargs-unpacking",
        """
        def f(h, kw):
            logger.info("x", **kw)  # <-
            return h
        """,
        declined="*args / **kwargs unpacking in a log or warn call hides its keywords",
    ),
    golden.case(
        "receiver-calls-something-else",
        """
        def get():
            return logger


        def f(h):
            get().info("x %s", h)  # <-
            return h
        """,
        declined="the logger expression calls a function other than logging.getLogger",
    ),
    golden.case(
        "receiver-not-a-plain-name-or-getlogger",
        """
        def f(h):
            logging.getLogger("a").parent.info("x %s", h)  # <-
            return h
        """,
        declined="the logger expression is not a plain name or getLogger call",
    ),
    golden.case(
        "another-effect-cannot-be-deferred",
        """
        def f(h):
            print(h)  # <-
            warnings.warn("careful", UserWarning, 2)
            return h
        """,
        declined=(
            "`warnings.warn('careful', UserWarning, 2)` (line 3) cannot be deferred (stacklevel other "
            "than 1 attributes the effect to a caller known only at run time); deferring this call "
            "would reorder their output"
        ),
    ),
    golden.case(
        "another-effect-of-an-unknown-receiver",
        """
        def f(h, log):
            print(h)  # <-
            log.info("x")
            return h
        """,
        declined=(
            "`log.info('x')` (line 3) may be an effect that cannot be deferred; deferring this call "
            "could reorder their output"
        ),
    ),
]


@pytest.mark.parametrize("source, expected", GOLDEN)
def test_golden(source, expected):
    assert golden.outcome("defer", source) == expected


# -- autograd ------------------------------------------------------------------


class PrintsUnderGrad(nn.Module):
    logger = logging.getLogger("graphmend.tests.grad_text")

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        print("max", h.amax())  # eager: tensor(..., grad_fn=<AmaxBackward0>)
        self.logger.warning("mean %s", h.mean())
        print(f"norm {h.norm():.4f}")  # a number only: deferred in both modes
        return h.relu()


def _effects_of(call, x, grad):
    from effects_capture import capture

    with capture() as cap, torch.set_grad_enabled(grad):
        cap.output = call(x)
    return cap


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_printed_tensors_that_require_grad_keep_eager_text(grad):
    """A snapshot is a detached copy: it would print without `grad_fn=<AmaxBackward0>` (or an
    input's `requires_grad=True`). A tensor that requires grad is recorded as itself beside its
    copy and prints as itself: eager's text, and no graph break in either grad mode."""
    torch.manual_seed(0)
    model = PrintsUnderGrad()
    x = torch.randn(2, 4)
    eager = _effects_of(model, x, grad)
    c, backend = compiled(model)
    mended = _effects_of(c, x, grad)
    assert mended.effects() == eager.effects()
    assert ("grad_fn=<AmaxBackward0>" in eager.stdout) == grad
    assert len(backend.graphs) == 1
    assert [n for o in c.report.outcomes for n in o.notes if n.startswith("still breaks")] == []


class PrintsThenChangesInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        print("h", h)
        h.mul_(2)
        return h.sum()


def test_a_printed_tensor_changed_in_place_later_prints_the_values_it_had_at_the_call():
    """Under grad the record keeps the tensor itself; `h.mul_(2)` after the print changes it (and
    its grad_fn), so the flush prints the copy made at the call with the call's grad_fn: read at the
    call where the mended code runs eagerly (eager's text), the compiled graph's where it is compiled
    (`CompiledFunctionBackward` under aot_eager, as the original compiled alone prints)."""
    torch.manual_seed(0)
    model = PrintsThenChangesInPlace()
    x = torch.randn(2, 4)
    eager = _effects_of(model, x, True)
    assert "grad_fn=<AddmmBackward0>" in eager.stdout
    alone = _effects_of(torch.compile(copy.deepcopy(model), backend="aot_eager"), x, True)
    assert "grad_fn=<CompiledFunctionBackward>" in alone.stdout and alone.stdout != eager.stdout
    torch._dynamo.reset()
    c = graphmend.compile(copy.deepcopy(model), backend="aot_eager")
    mended = _effects_of(c, x, True)
    assert [o.status.value for o in c.report.outcomes] == ["applied"] and c.report.verified
    assert mended.effects() == alone.effects() and torch.equal(mended.output, eager.output)
    graphmend.unmend()
    graphmend.mend(model, x)

    def in_region(v):  # the mended code, eagerly, deferring
        with runtime.region():
            return model(v)

    assert _effects_of(in_region, x, True).effects() == eager.effects()


def test_an_input_that_requires_grad_prints_as_eager_under_no_grad():
    class PrintsInput(nn.Module):
        def forward(self, x):
            print("input", x)
            return x * 2

    x = torch.ones(2, requires_grad=True)
    eager = _effects_of(PrintsInput(), x, False)
    c, _ = compiled(PrintsInput())
    mended = _effects_of(c, x, False)
    assert "requires_grad=True" in eager.stdout and mended.effects() == eager.effects()
    assert [o.status.value for o in c.report.outcomes] == ["applied"] and c.report.verified, c.report.outcomes


def test_a_print_is_kept_in_place_where_a_later_in_place_update_may_share_its_tensors_storage():
    """Found by the fuzzer (seed 24): `s = h[0, 0]; h = self.block1(h); print("h is", h, s); s.add_(1)`,
    where `block1` returns `h` itself on one path and a new tensor on another, and breaks inside. The
    frame Dynamo resumes after `block1` takes `h` and `s` as inputs: sharing storage on the first call,
    not on the next. AOTAutograd reuses the graph built for shared inputs and rebuilds `h` from `s`'s
    storage (pytorch #139789, docs/torch-issues.md); the original breaks at the print and computes
    nothing from `h` in that graph, but the deferred print's snapshot of `h` did, and printed stale
    values (aot_eager arms, call 2). [Defer] now keeps a print in place when a tensor it records may
    share storage with one the function updates in place, with the reason shown."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_defer_view_inputs_alias.py"), seed=48, start=5, aot=True, threads=True)
    assert result.status == "checked"
    deferred = [(s, r) for _, rule, s, r in result.outcomes if rule == "defer"]
    assert deferred == [("declined", "`h` may share storage with `s`, which the function updates in place "
                         "(`s.add_(1)`, line 55): a compiled graph that reads one and changes the other may read "
                         "stale values when the two share storage on some calls only (torch's AOTAutograd)")], deferred
    assert result.mismatches == [], result.mismatches[:2]


class _HandsBackSometimes(torch.nn.Module):
    """Breaks the graph, then hands back its input itself or a new tensor, as `same` says."""

    same = True

    def forward(self, h):
        torch._dynamo.graph_break()
        return h if self.same else h - h.mean()


class _Shout(torch.nn.Module):
    def forward(self, h, s):
        print("h is", h, s)
        return h


class _ViewThenShout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.shout = _HandsBackSometimes(), _Shout()

    def forward(self, x):
        h = x * 1.0
        s = h[0, 0]
        h = self.pre(h)
        h = self.shout(h, s)
        s.add_(1)
        return h, s


def test_a_print_in_a_callee_is_kept_in_place_where_its_caller_updates_a_tensor_that_may_share_storage():
    """The fuzz program's pattern one call down: the print is in `_Shout.forward`, the view and the
    update in its caller. Dynamo inlines the caller into the frame resumed after `pre`'s break, with
    `h` and `s` as inputs sharing storage only while `pre` hands `h` back; deferring the print would
    join its read of `h` and the caller's `s.add_(1)` in one graph (stale values under aot_eager on
    the call that makes `h` new). Declined, naming the caller; the printed text and the outputs are
    eager's on both calls."""
    model, twin = _ViewThenShout(), _ViewThenShout()
    x = torch.arange(8.0).reshape(2, 4) - 3
    compiled = graphmend.compile(model, backend="aot_eager", example_inputs=(x,))
    (deferred,) = [o for o in compiled.report.outcomes if o.rule == "defer"]
    assert deferred.status == "declined" and deferred.reason.startswith("in the caller forward (test_defer.py:"), deferred
    assert "`h` may share storage with `s`, which the function updates in place (`s.add_(1)`" in deferred.reason
    for same in (True, False):
        model.pre.same = twin.pre.same = same
        expected, got = run(twin, x.clone()), run(compiled, x.clone())
        assert got.stdout == expected.stdout and "h is" in got.stdout
        assert all(bits_equal(a, b) for a, b in zip(expected.output, got.output))


class _ShoutThenBump(torch.nn.Module):
    """Prints both its tensors, then updates the first in place: whether the print may
    join the update depends on what the caller passes."""

    def forward(self, h, s):
        print("h is", h, s)
        h.add_(1)
        return h


class _PassesUnrelated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.shout = _ShoutThenBump()

    def forward(self, x):
        h = x * 1.0
        return self.shout(h, h.mean())


class _PassesAViewSometimes(_PassesUnrelated):
    def forward(self, x):
        h = x * 1.0
        s = h[0, 0] if x.sum() > 0 else h.mean()
        return self.shout(h, s)


def test_two_parameters_are_judged_at_the_call_that_passes_them():
    """`_ShoutThenBump.forward(h, s)` prints both and updates `h` in place; a frame starting at its
    entry has both as inputs. Passed `h` and `h.mean()` (new storage on every call) the print is
    deferred; passed `h[0, 0]` on some calls and a new tensor on others, it stays, with the call's
    line in the reason (callers.shared_entry_in_calls). Printed text and outputs are eager's."""
    x = torch.arange(8.0).reshape(2, 4) - 3
    for cls, status in ((_PassesUnrelated, "applied"), (_PassesAViewSometimes, "declined")):
        model, twin = cls(), cls()
        compiled = graphmend.compile(model, backend="aot_eager", example_inputs=(x,))
        (deferred,) = [o for o in compiled.report.outcomes if o.rule == "defer"]
        assert deferred.status == status, (cls.__name__, deferred)
        if status == "declined":
            assert deferred.reason.startswith("`s` may share storage with `h`, which the function updates in place (`h.add_(1)`"), deferred.reason
            assert "; the call at test_defer.py:" in deferred.reason, deferred.reason
        for value in (x, -x):  # both paths of `s`
            expected, got = run(twin, value.clone()), run(compiled, value.clone())
            assert got.stdout == expected.stdout and "h is" in got.stdout
            assert bits_equal(expected.output, got.output)
        graphmend.unmend()  # `_ShoutThenBump.forward` is shared by both models
