"""[Trap]: the same exception, message, effects before the check, and state."""

import copy
import os

import pytest
import torch

import graphmend
import guards as G
from effects_capture import CountingBackend, run

GOOD, BAD = G.inputs(), G.inputs(bad=True)


@pytest.fixture(autouse=True)
def _restore():
    yield
    graphmend.unmend()
    torch._dynamo.reset()


def mended(cls, *example):
    model = cls()
    reference = copy.deepcopy(model)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=example or (GOOD,))
    return reference, compiled, backend


@pytest.mark.parametrize(
    "cls", [G.IfRaise, G.IfNotRaise, G.Asserts, G.TorchAssert, G.FormattedMessage], ids=lambda c: c.__name__
)
def test_same_exception_message_and_effects(cls):
    reference, compiled, backend = mended(cls)
    report = compiled.report
    assert [o.status for o in report.outcomes if o.category == "VG"] == ["applied"], report.outcomes
    bad = BAD.clone()
    if cls in (G.Asserts,):
        bad[0, 0] = float("inf")
    for x in (GOOD, bad, GOOD):
        eager = run(reference, x)
        got = run(compiled, x)
        assert got.effects() == eager.effects(), (cls.__name__, x)
        if eager.exception is None:
            assert torch.equal(eager.output, got.output)
    assert eager.exception is None and run(reference, bad).exception is not None
    assert len(backend.graphs) == 1


def test_effects_before_the_check_happen_and_after_do_not():
    reference, compiled, _ = mended(G.IfRaise)
    eager = run(reference, BAD)
    got = run(compiled, BAD)
    assert eager.exception == ("ValueError", "too negative")
    assert "before the check" in eager.stdout and "after the check" not in eager.stdout
    assert eager.records == []
    assert got.effects() == eager.effects()


def test_assert_type_is_restored_where_dynamo_alone_changes_it():
    reference = G.Asserts()
    bad = GOOD.clone()
    bad[1, 1] = float("nan")
    plain = torch.compile(copy.deepcopy(reference), backend=CountingBackend())
    assert run(plain, bad).exception[0] == "RuntimeError"  # what torch.compile alone does
    _, compiled, _ = mended(G.Asserts)
    assert run(compiled, bad).exception == ("AssertionError", "must be finite")


def test_formatted_message_uses_values_at_the_check():
    reference, compiled, _ = mended(G.FormattedMessage)
    eager = run(reference, BAD)
    assert eager.exception == ("ModelError", "min was -2000.0 over 8 values")
    assert run(compiled, BAD).exception == eager.exception


def test_molformer_mask_guard_every_layer_to_one_graph():
    h = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    good_mask = torch.ones(2, 3)
    model = G.MaskModel()
    reference = copy.deepcopy(model)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(h, good_mask))
    report = compiled.report
    assert report.before.breaks >= 1 and report.before.sites[0].category == "VG"
    assert all(o.status == "applied" for o in report.outcomes if o.category == "VG")
    assert report.after.graphs == 1
    assert run(compiled, h, good_mask).output is not None and len(backend.graphs) == 1
    assert torch.equal(run(reference, h, good_mask).output, run(compiled, h, good_mask).output)
    bad_mask = good_mask.clone()
    bad_mask[1, 2] = 0
    wrong_shape = torch.ones(2, 1)  # broadcasts against ones_like: must still be unequal
    for mask in (bad_mask, wrong_shape):
        eager = run(reference, h, mask)
        assert eager.exception == ("ValueError", "MoLFormer-style layers need an all-ones attention mask")
        assert run(compiled, h, mask).effects() == eager.effects()


DECLINES = [
    (G.InTry, "inside a try block"),
    (G.RichException, "defines __init__"),
    (G.MutatesAfter, "state changes after the check"),
]


@pytest.mark.parametrize("cls,reason", DECLINES, ids=[d[0].__name__ for d in DECLINES])
def test_declines_keep_behaviour(cls, reason):
    model = cls()
    reference = copy.deepcopy(model)
    report = graphmend.mend(model, GOOD)
    vg = [o for o in report.outcomes if o.category == "VG"]
    assert vg and vg[0].status == "declined" and reason in vg[0].reason, report.outcomes
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    for x in (GOOD, BAD, GOOD):
        assert run(model, x).effects() == run(reference, x).effects()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


def test_analysis_does_not_touch_the_users_model():
    model = G.MutatesAfter()
    graphmend.mend(model, GOOD)  # eager, traced and verification runs: all on copies
    assert float(model.seen) == 0.0


def test_demo_validation_guard_raises_the_same_error_compiled():
    from graphmend.models import demo

    model, args, _ = demo.build()
    reference = copy.deepcopy(model)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=args)
    assert all(o.status == "applied" for o in compiled.report.outcomes if o.category in ("VG", "DC", "LC"))
    bad = args[0].clone()
    bad[0, 0] = 1e5
    eager = run(reference, bad)
    assert eager.exception == ("ValueError", "demo: input values must stay within +-1e4")
    assert run(compiled, bad).effects() == eager.effects()
    good = run(compiled, *args)
    assert good.exception is None and torch.equal(good.output, run(reference, *args).output)


def test_guard_inside_a_data_dependent_branch_fires_only_on_its_path():
    reference, compiled, backend = mended(G.GuardInBranch)
    statuses = {o.category: o.status for o in compiled.report.outcomes}
    assert statuses == {"VG": "applied", "DC": "applied"}, compiled.report.outcomes
    big_positive = GOOD.abs() + 1
    big_positive[0, 0] = 500.0  # branch taken, check fails
    big_negative = -(GOOD.abs() + 100)
    big_negative[0, 0] = 500.0  # sum < 0: branch (and check) not taken
    for x in (GOOD, big_positive, big_negative, GOOD):
        eager = run(reference, x)
        got = run(compiled, x)
        assert got.effects() == eager.effects()
        if eager.exception is None:
            assert torch.equal(eager.output, got.output)
    assert run(reference, big_positive).exception == ("ValueError", "too large on the positive path")
    assert run(reference, big_negative).exception is None
    assert len(backend.graphs) == 1


LOOPS = os.path.join(os.path.dirname(__file__), "fixtures", "trap_loops.py")


def _trap_outcome(factory):
    from graphmend.pipeline import mend_target
    from graphmend.models.targets import load_target
    from graphmend.rewrite.verify import quiet

    with quiet():
        report, mending = mend_target(load_target(f"{LOOPS}:{factory}"))
    mending.undo()
    [site] = [o for o in report.outcomes if o.rule == "trap"]
    return site


def test_continuation_through_enumerate_and_a_nested_wrapper_is_resolved():
    # layer(h) through `for i, layer in enumerate(self.layers)` and a nested
    # `wrap(module)` closure; another module's `layers` (state-changing) is
    # not what Stack.forward runs.
    site = _trap_outcome("build_plain")
    assert site.status == "applied", site.reason


def test_a_state_changing_layer_reached_that_way_declines():
    site = _trap_outcome("build_counting")
    assert site.status == "declined"
    assert "self.calls" in site.reason
