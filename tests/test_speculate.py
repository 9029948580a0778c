"""[Speculate]: a guessed host value, checked when the call ends; a wrong
guess runs the call again, and nothing of the discarded run is seen."""

import copy

import pytest
import torch

import graphmend
from effects_capture import run
from fixtures.speculate_models import Widen, WidenAndCount, WidenThenWarnOnAPath, WidenWithNoise

NARROW = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
WIDE = torch.tensor([[1.0, 5.0, 0.5, -1.0]])


@pytest.fixture(autouse=True)
def _restore():
    graphmend.runtime._PREDICTED.clear()
    graphmend.runtime.RERUNS.clear()
    yield
    graphmend.unmend()
    graphmend.runtime._PREDICTED.clear()
    graphmend.runtime.RERUNS.clear()
    torch._dynamo.reset()


class Counting:
    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _compile(model, example):
    backend = Counting()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(example,))
    return compiled, backend


def test_a_flag_that_changes_shapes_compiles_to_one_graph_and_keeps_every_output():
    torch.manual_seed(0)
    model = Widen().eval()
    reference = copy.deepcopy(model)
    compiled, backend = _compile(model, NARROW)
    report = compiled.report
    assert [(o.rule, o.status) for o in report.outcomes if o.category == "TI"] == [("speculate", "applied")]
    assert report.after.graphs == 1 and report.before.graphs > 1, (report.before.graphs, report.after.graphs)
    graphmend.runtime.RERUNS.clear()  # count the calls' reruns only
    for x in (NARROW, NARROW, WIDE, WIDE, NARROW):
        expected, got = run(reference, x), run(compiled, x)
        assert torch.equal(got.output, expected.output)
        assert got.stdout == expected.stdout  # the discarded run printed nothing
    assert graphmend.runtime.RERUNS["wrong guess"] + graphmend.runtime.RERUNS["raised"] == 2  # WIDE, then NARROW
    graphs = backend.graphs
    for x in (NARROW, WIDE):  # both values seen: no more compiles
        run(compiled, x)
    assert backend.graphs == graphs


def test_a_call_that_changes_state_is_not_speculated():
    report = graphmend.mend(WidenAndCount().eval(), NARROW)
    [ti] = [o for o in report.outcomes if o.category == "TI"]
    assert ti.status == "declined" and "self.calls" in " ".join([ti.reason, *ti.notes]), ti


def test_an_effect_that_was_not_deferred_stops_the_guessing_run_before_it_happens():
    torch.manual_seed(0)
    model = WidenThenWarnOnAPath().eval()
    reference = copy.deepcopy(model)
    compiled, _ = _compile(model, NARROW)
    big = WIDE * 100
    expected, got = run(reference, big), run(compiled, big)
    assert [w[1] for w in expected.warnings] == ["large"]
    assert got.warnings == expected.warnings and got.stdout == expected.stdout
    assert torch.equal(got.output, expected.output)
    assert graphmend.runtime.RERUNS["effect"] == 1


def test_random_numbers_are_drawn_once_per_call_seen():
    torch.manual_seed(0)
    model = WidenWithNoise().eval()
    reference = copy.deepcopy(model)
    compiled, _ = _compile(model, NARROW)
    for x in (WIDE, NARROW):  # each a wrong guess at first
        torch.manual_seed(7)
        expected = run(reference, x)
        torch.manual_seed(7)
        got = run(compiled, x)
        assert torch.equal(got.output, expected.output)
        assert torch.equal(torch.rand(1), (torch.manual_seed(7), reference(x), torch.rand(1))[2])
    assert sum(graphmend.runtime.RERUNS.values()) == 2


def test_training_mode_does_not_guess():
    torch.manual_seed(0)
    model = Widen().eval()
    compiled, backend = _compile(model, NARROW)
    model.train()
    reference = copy.deepcopy(model)
    for x in (WIDE, NARROW):
        assert torch.equal(run(compiled, x).output, run(reference, x).output)
    assert sum(graphmend.runtime.RERUNS.values()) == 0


def test_a_forward_hook_is_never_run_twice():
    torch.manual_seed(0)
    model = Widen().eval()
    compiled, _ = _compile(model, NARROW)
    seen = []
    model.proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    for x in (WIDE, NARROW, WIDE):
        run(compiled, x)
    assert len(seen) == 3  # once per call: a hook's effects were not scanned, so the call does not guess
    assert sum(graphmend.runtime.RERUNS.values()) == 0


def test_mend_plus_your_own_torch_compile_guesses_only_through_runtime_call():
    """docs/rules.md (speculate): with graphmend.mend and your own torch.compile, guessing happens
    in graphmend.runtime.call(compiled, x); in a plain region it is .item()."""
    torch.manual_seed(0)
    model = Widen().eval()
    reference = copy.deepcopy(model)
    report = graphmend.mend(model, NARROW)
    assert ("speculate", "applied") in [(o.rule, o.status) for o in report.outcomes]
    plain, guessing = Counting(), Counting()
    in_region = torch.compile(copy.deepcopy(model), backend=plain)
    through_call = torch.compile(copy.deepcopy(model), backend=guessing)
    for x in (NARROW, WIDE, NARROW):
        expected = run(reference, x)
        with graphmend.runtime.region():
            got_plain = in_region(x)
        got_call = run(lambda t: graphmend.runtime.call(through_call, t), x)
        assert torch.equal(got_plain, expected.output) and torch.equal(got_call.output, expected.output)
        assert got_call.stdout == expected.stdout
    assert guessing.graphs == 2  # one graph per value of the flag, no break
    assert plain.graphs > guessing.graphs  # .item() breaks there, as written
