"""Bugs the differential fuzzer (tests/fuzz) found that are not one rule's,
each as the smallest program that shows it: verification, the backends
(AOTAutograd, the fallback), the fuzz runner's allowances, and the graph
breaks kept before asserts, which [Defer] and [Trap] records need alike. A
bug in one rule is a test in the "fuzz regressions" section of its file in
tests/rules/. Each test asserts the behaviour the original has."""

import copy
import re

import pytest
import torch
from conftest import fixture_program
from effects_capture import run
from torch import nn

import graphmend
from graphmend.compat import release
from graphmend.rewrite.verify import Observation, compare


@pytest.fixture(autouse=True)
def _restore():
    yield
    graphmend.unmend()
    torch._dynamo.reset()


class PrintThenNanScalar(nn.Module):
    def forward(self, x):
        print("x", x)
        return x.sum()


def test_identical_zero_dim_nan_outputs_compare_equal():
    nan = torch.tensor(float("nan"))
    assert compare(Observation(output=nan), Observation(output=nan.clone())) == []


def test_defer_is_kept_when_the_output_is_a_zero_dim_nan():
    x = torch.tensor([1.0, float("nan")])
    report = graphmend.mend(PrintThenNanScalar(), x)
    assert [(o.rule, o.status) for o in report.outcomes] == [("defer", "applied")]


def test_a_graph_the_backend_failed_on_is_gone_and_outputs_and_gradients_match_eager():
    """Found by the fuzzer (seed 8): mending joined `s = h.amax(); <deferred log>; s.add_(1); return h, s`
    into one graph, and under grad AOTAutograd refused it (the backward of the returned `s` needs the
    amax result changed in place) where eager runs; graphmend's backend ran that graph as captured
    (test_failure_safety::test_a_graph_the_backend_fails_on_runs_as_captured_with_one_warning keeps
    that path). Since [Where] predicates under grad (issue 24) the mend makes other graphs (12 -> 8).
    Since a record keeps a tensor that requires grad as itself, the log of `h.norm()` no longer breaks
    the graph under grad, so `s.add_(1)` after it is in the graph again: the backend fails on that one
    graph, which runs as captured; every arm, gradients included, still matches eager. Since a
    `torch._assert` whose message formats a tensor (GB0055) is [Trap]'s, 12 -> 7."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_aot_grad.py"), seed=369, start=5, grad=True, aot=True)
    assert result.status == "checked" and result.graphs == (12, 7)
    assert result.mismatches == [], result.mismatches[:2]
    assert result.fallbacks == 1


def _aot_grad_errors(program, seed):
    """The original under ``torch.compile(backend="aot_eager")`` with grad, on the fuzzer's inputs:
    each call's error (None where forward and backward ran)."""
    import tempfile

    from fuzz.runner import inputs_for, load

    torch.manual_seed(0)
    compiled = torch.compile(load(program, tempfile.mkdtemp()).Model(), backend="aot_eager")
    errors = []
    for x in inputs_for(seed):
        try:
            out = compiled(x.clone().requires_grad_())
            sum(o.sum() for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad).backward()
            errors.append(None)
        except (RuntimeError, ValueError) as e:
            errors.append(str(e))
    return errors


def test_an_inplace_autograd_error_the_original_shows_under_aot_eager_is_gone_once_mended():
    """Found by the fuzzer (seed 9): under grad, AOTAutograd failed the backward of the mended program
    (an in-place change of a tensor a compiled graph saved) where eager runs, and the original under
    aot_eager fails the same way. A tensor that requires grad is now recorded as itself, so the log
    call of `h.norm()` leaves no graph break under grad, and the in-place change is in the same
    graph: the mended program runs like eager under aot_eager, gradients included."""
    from fuzz.runner import check_program

    program = fixture_program("fuzz_aot_inplace.py")
    errors = _aot_grad_errors(program, seed=1)
    assert sum("modified by an inplace operation" in (e or "") for e in errors) == 7, errors
    result = check_program(program, seed=1, start=6, grad=True, aot=True)
    assert result.status == "checked"
    assert result.mismatches == [], result.mismatches[:2]
    assert result.backend_differences == []


def test_a_logged_tensor_that_requires_grad_breaks_no_graph_that_a_later_inplace_change_needs():
    """Found by the fuzzer (seed 22): a log call of `h.norm()` under grad ran at once, a graph break,
    after [Trap] had joined the code before it into one graph with the returned `s`; `h.copy_(...)`
    after the break changed the `h` that graph saved for the norm, and aot_eager failed the backward
    on calls 3 and 4 ("modified by an inplace operation") where eager and the original run. The record
    keeps the tensor itself now (it prints eager's `grad_fn`), so no break is left between them."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_log_grad_inplace.py"), seed=65535, start=0, grad=True, aot=True)
    assert result.status == "checked"
    assert result.mismatches == [], result.mismatches[:2]
    assert result.backend_differences == []


def _input_mutated_in_a_graph(h):
    h.mul_(2)
    return torch.tanh(h) * 3000.0


def test_aot_autograd_gives_plus_zero_for_a_minus_zero_gradient_of_a_mutated_input():
    """The torch behaviour the next test depends on, without graphmend: AOTAutograd applies an
    in-place change of a graph input after the graph, and the input's gradient of -0.0 (tanh
    saturated, then negated) comes back +0.0. If torch changes this, the runner's allowance goes."""
    grads = {}
    for backend in ("eager", "aot_eager"):
        x = torch.tensor([-3000.0, 3000.0, 1.0], requires_grad=True)
        fn = _input_mutated_in_a_graph if backend == "eager" else torch.compile(_input_mutated_in_a_graph, backend=backend, fullgraph=True)
        (-fn(x * 1.0)).sum().backward()
        grads[backend] = x.grad
    assert torch.signbit(grads["eager"]).tolist() == [True, True, True]
    assert torch.signbit(grads["aot_eager"]).tolist() == [False, False, True]
    assert torch.equal(grads["eager"], grads["aot_eager"])  # equal as values: 0 == -0


def test_a_difference_the_original_shows_once_dynamo_stops_giving_up_is_the_backends():
    """Found by CI's fuzz run on torch 2.15 (seed 2150): the original hit Dynamo's recompile
    limit and ran a frame eagerly from call 7 on, so its failing ``torch._assert`` raised eager's
    AssertionError; the mended program (a capture flag: fewer frames, fewer recompiles) still
    compiled it, and a compiled ``torch._assert`` raises RuntimeError from 2.15. The unmended
    original does the same once Dynamo may recompile as often (the runner's patient control):
    the backend's difference, not a rewrite's."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_torch_assert_past_recompile_limit.py"), seed=5, start=6, grad=True)
    assert result.status == "checked" and result.mismatches == [], result.mismatches[:2]
    compiled_type = "('RuntimeError', 'check failed at 2')"
    hits = [d for d in result.backend_differences if compiled_type in d and "('AssertionError'" in d]
    assert bool(hits) == release().assert_in_graph, result.backend_differences[:3]


def test_a_signed_zero_gradient_from_aot_autograd_is_the_backends():
    """Found by the fuzzer (seed 11): under aot_eager with grad, the mended program's input gradient
    at one call was all +0.0 where eager autograd gives -0.0 (the `h.mul_(2)` of a graph input, as
    above); the original under aot_eager fails every backward there, so it gave no control."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_aot_signed_zero_grad.py"), seed=6896, start=4, grad=True, aot=True)
    assert result.status == "checked"
    assert result.mismatches == [], result.mismatches[:2]
    assert "aot_eager+grad, call 2: output[1].x: values differ (max abs diff 0)" in result.backend_differences


@pytest.mark.parametrize(
    "name, kept",
    [
        ("TrapThenGuard", "reverted"),  # the break, in Guard's try, makes Dynamo skip its frame: never worse
        ("PrintThenGuard", "reverted"),
        ("PrintsThenGuard", "barrier"),
        ("PrintsThenHelper", "barrier"),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_records_before_an_assert_compiled_into_the_same_graph_in_another_function_are_not_lost(name, kept):
    """Found by the fuzzer (seed 15): a check trapped in one submodule (its flag recorded in the graph),
    then an assert on tensor values in another submodule, traced into the same graph. On an input
    failing both, the assert raised inside the graph and the trapped ValueError (and any output
    deferred before it) was lost. Now a graph break goes before such an assert anywhere in the
    model's code when the mended code records anything, or, where the break costs more graphs than
    the deferral saved (measured), the record-making rewrites are reverted. (The models live in a
    fixture file: pytest rewrites the asserts of test modules.)"""
    import held_asserts

    cls = getattr(held_asserts, name)
    bad = torch.full((3,), float("inf"))
    expected = run(cls(), bad)
    torch._dynamo.reset()
    original = torch.compile(cls(), backend="eager")
    original(torch.ones(3))
    control = run(original, bad)  # what torch.compile of the original does
    torch._dynamo.reset()
    compiled = graphmend.compile(cls(), backend="eager", example_inputs=(torch.ones(3),))
    report = compiled.report
    got = run(compiled, bad)
    assert got.stdout == expected.stdout
    assert got.records == expected.records
    if name == "TrapThenGuard":
        assert got.exception == expected.exception == ("ValueError", "not finite: inf")
    else:  # the assert fails in the graph, as under torch.compile of the original
        assert got.exception == control.exception == ("RuntimeError", "value out of range")
    recording = ("if", "print", "logging")  # the sites of Check, and the effects (not the guard's assert)
    statuses = {o.line: o.status for o in report.outcomes if o.rule in ("defer", "trap") and o.code.startswith(recording)}
    if kept == "barrier":
        assert any(line.startswith("a graph break goes before `assert (h.abs() <= 1000.0).all()") for line in report.kept), report.kept
        assert "applied" in statuses.values(), report.outcomes
        assert report.after.graphs < report.before.graphs
    else:
        assert any("rewrites that record ([defer], [trap]) are reverted" in line for line in report.kept), report.kept
        assert "reverted" in statuses.values() and "applied" not in statuses.values(), report.outcomes
        assert report.after.graphs <= report.before.graphs
    assert report.to_dict()["kept"] == report.kept
    from rich.console import Console

    from graphmend.tools.render import render_mend

    console = Console(record=True, width=100)
    render_mend(report, console)
    assert "note: " + report.kept[0] in console.export_text()


def test_a_trapped_check_before_an_assert_in_another_block_keeps_its_exception():
    """The fuzz program (seed 15): Block1's trapped FuzzError was lost to Block4's assert, which
    failed in the same graph (RuntimeError 'value out of range' on a NaN input)."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_trap_before_held_assert.py"), seed=0, start=0, aot=True)
    assert result.status == "checked"
    assert any(o[1:3] == ("trap", "applied") for o in result.outcomes), result.outcomes
    assert result.mismatches == [], result.mismatches[:2]


def test_held_wraps_every_assert_form_once_and_settles_statements_seen_as_tensors():
    import ast

    from graphmend.passes import barriers

    fdef = ast.parse(
        "def f(x):\n"
        "    assert (x > 0).all(), 'a'\n"
        "    y = [torch._assert_async((x > 0).all(), 'b')]\n"
        "    while torch._assert_async(x.all(), 'c'):\n"
        "        g = lambda: torch._assert_async(x.all(), 'd')\n"
    ).body[0]
    held = [n for n in ast.walk(fdef) if isinstance(n, ast.Assert) or (isinstance(n, ast.Call) and n.func.attr == "_assert_async")]
    assert barriers.wrap(held) == "`assert (x > 0).all(), 'a'` (line 2), `torch._assert_async(x.all(), 'c')` (line 4) and 2 more"
    barriers.wrap(held)  # once
    assert ast.unparse(fdef).splitlines()[1:5] == [
        "    assert __graphmend_rt__.held((x > 0).all()), 'a'",
        "    y = [torch._assert_async(__graphmend_rt__.held((x > 0).all()), 'b')]",
        "    while torch._assert_async(__graphmend_rt__.held(x.all()), 'c'):",
        "        g = lambda: torch._assert_async(__graphmend_rt__.held(x.all()), 'd')",
    ]
    assert all(barriers.guarded(h) for h in held)
    assert barriers.settle(fdef, {2, 3}) == [fdef.body[1]]  # statements only: line 3's assert is a call
    assert ast.unparse(fdef).splitlines()[1:4] == [
        "    __graphmend_rt__.barrier()",
        "    assert (x > 0).all(), 'a'",
        "    y = [torch._assert_async(__graphmend_rt__.held((x > 0).all()), 'b')]",
    ]


def test_held_breaks_the_graph_only_for_a_tensor_test():
    from held_asserts import tensor_then_int as f
    from torch._dynamo.testing import CompileCounter

    for w, graphs in ((0, 1), (2, 2)):
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(f, backend=counter)
        assert torch.equal(compiled(torch.ones(3), w), torch.full((3,), 3.0))
        assert counter.frame_count == graphs
    with pytest.raises(RuntimeError, match="tensor"):  # still compiled into the graph
        compiled(-torch.ones(3), 2)
    with pytest.raises(AssertionError, match="int"):
        compiled(torch.ones(3), 1)


def test_aot_autograd_sums_a_gradient_of_a_parameter_used_twice_in_one_graph_in_another_order():
    """torch 2.13, no graphmend: under aot_eager the weight gradient of a Linear applied twice in
    one graph is AOTAutograd's sum, which may differ from eager autograd's in its last bits (by how
    much depends on the machine's kernels: 1-5e-7 on the machines seen); torch promises only that
    it is within float rounding, and that is what the runner's allowance below relies on."""
    from fuzz.runner import inputs_for
    from held_asserts import LinearTwice

    torch.manual_seed(0)
    base = LinearTwice()
    x = inputs_for(5)[0]
    grads = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        fn = torch.compile(model, backend="aot_eager") if compiled else model
        fn(x.clone().requires_grad_(True)).sum().backward()
        grads.append(model.lin.weight.grad)
    torch.testing.assert_close(grads[1], grads[0])


def test_a_gradient_within_rounding_under_aot_eager_is_the_backends_when_eager_grad_is_exact():
    """The fuzz program (seed 16): deferring the print puts both uses of `self.lin` in one graph, and
    AOTAutograd's gradient of its weight may differ from eager's in its last bits (the test above),
    where the original, cut by the print into two graphs, matched to the bit. The eager+grad arm holds
    the mended program's gradients to every bit; the compiled arm's, within rounding, are the backend's.
    How many bits move is the machine's: only "within rounding" is asserted."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_aot_grad_rounding.py"), seed=5, start=6, grad=True, aot=True)
    assert result.status == "checked"
    assert result.mismatches == [], result.mismatches[:2]
    rounded = [re.fullmatch(r"aot_eager\+grad, call \d: output\[1\]\.lin\.weight: values differ \(max abs diff (.+)\)", d)
               for d in result.backend_differences]
    assert all(m is not None and 0 < float(m.group(1)) < 1e-5 for m in rounded), result.backend_differences


def test_the_runner_takes_a_gradient_within_rounding_as_the_backends_and_one_beyond_as_a_mismatch():
    """The allowance itself, on observations made up for it: what the test above meets on machines
    whose sums differ, whatever this machine's sums are."""
    from fuzz.runner import _differences, _grads_rounded_to

    from graphmend.rewrite.verify import Observation

    grad = torch.tensor([0.5, -0.25, 1.0])
    expected = Observation(output=(torch.ones(2), {"lin.weight": grad}))
    for delta, kept in ((2.4e-7, False), (1e-3, True)):
        got = Observation(output=(torch.ones(2), {"lin.weight": grad + torch.tensor([delta, 0.0, 0.0])}))
        left = _differences("aot_eager+grad", [expected], [_grads_rounded_to(expected, got)])
        assert bool(left) is kept, (delta, left)
        assert _differences("aot_eager+grad", [expected], [got]) != []


def test_a_select_a_caller_updates_in_place_is_declined_and_eagers_error_kept():
    """Found by the fuzzer (seed 22, 2026-12-02): a helper's elif chain is selected under
    grad, and the caller then updates the result in place. Eager's backward failed on
    tanh's saved output, the mended one on amax's saved input (the select made a new
    tensor), which docs/limits.md documented. Since the callers on Dynamo's chains are
    followed (analysis.callers, session 31) the site is declined: the same error, the
    same tensor named (the printed grad_fn text under compile+grad stays documented)."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_inplace_after_select.py"), seed=65536, start=4, grad=True, aot=False)
    assert result.status == "checked"
    assert result.mismatches == [], result.mismatches[:2]
    assert not any("inplace" in d for d in result.documented), result.documented  # grad_fn text in prints stays
    reasons = [r for _, rule, status, r in result.outcomes if rule == "where" and status == "declined"]
    assert any("`h` is returned as it is and the caller at" in r and "updates it in place" in r for r in reasons), reasons


def test_calls_torchs_format_bug_fails_are_counted_apart_from_mismatches():
    """Found by the 1,000-program run on torch 2.14.1: Dynamo fails formatting a float
    it made symbolic (compat: symbolic_format_crashes, pytorch #197093) on a line
    graphmend left as written; the original fails the same way, at other calls
    (graphmend cut the graphs elsewhere). From the call it fails on, a series is
    counted apart; before it, and on releases without the bug, it is compared."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_symbolic_format.py"), seed=3568, start=5, grad=True)
    assert result.status == "checked" and result.mismatches == [], result.mismatches[:2]
    assert bool(result.torch_bug) == release().symbolic_format_crashes, result.torch_bug[:2]
    assert all(d.startswith(("counting, ", "aot_eager", "compile+grad, ")) for d in result.torch_bug), result.torch_bug[:2]
    assert not result.torch_bug or any("('InternalTorchDynamoError', 'ValueError: Unknown format code" in d for d in result.torch_bug)


def test_a_warning_dynamo_moves_to_another_line_at_another_call_than_the_controls_is_the_backends():
    """Found by the 5,000-program run (seed 24): in the threads arm the first three inputs raise
    eagerly, so graphmend.compile gave up and compiled the model unchanged. Dynamo reports
    Block2's `warnings.warn`, run from a resume function's compiled code, at the line of the
    break before it (the `logger.info`), from a call that depends on the compile history: the
    arm from call 6, the unmended controls from call 1. The same move is the backend's."""
    from fuzz.runner import _RAISED_EAGERLY, check_program

    result = check_program(fixture_program("fuzz_threads_warning_line.py"), seed=3902, start=5, aot=False, threads=True)
    assert result.status == "checked" and result.mismatches == [], result.mismatches[:2]
    assert any(_RAISED_EAGERLY in n for n in result.notices), result.notices
    lines = fixture_program("fuzz_threads_warning_line.py").source.splitlines()
    warn, log = (1 + next(i for i, line in enumerate(lines) if text in line) for text in ('warnings.warn(f"mean', 'logger.info("norm'))
    moved = [d for d in result.backend_differences if d.startswith("threads, thread") and "'UserWarning', 'mean" in d]
    assert moved and all(re.search(rf"\.py', {warn}\)\].* vs .*\.py', {log}\)", d) for d in moved), moved[:2]


def test_the_runner_takes_a_warnings_line_as_the_backends_only_where_a_control_moved_it_so():
    """The allowance itself, on observations made up for it: a warning the control moved from
    line 24 to 22 (at another call) is the backend's; to line 21, or with another text, it stays."""
    from fuzz.runner import _differences, _warning_lines_as_controls

    def warned(*warnings):
        return Observation(output=torch.ones(1), warnings=[("UserWarning", text, "m.py", line) for text, line in warnings])

    expected = [warned(("mean 1", 24)), warned(("mean 2", 24))]
    controls = [[warned(("mean 1", 22)), warned(("mean 2", 24))]]
    for got, kept in (
        ([warned(("mean 1", 24)), warned(("mean 2", 22))], False),
        ([warned(("mean 1", 24)), warned(("mean 2", 21))], True),
        ([warned(("mean 1", 24)), warned(("mean 3", 22))], True),
    ):
        diff = _differences("counting", expected, got)
        assert len(diff) == 1
        left, moved = _warning_lines_as_controls("counting", expected, got, diff, controls)
        assert (left, moved) == ((diff, []) if kept else ([], diff))
