"""[Trap] across files (issue 21): a check in a child module class whose parent
class lives in another file is trapped as when both share one file, and the
parents' code after the call is still checked for state changes."""

import copy
import os

import pytest
import torch

import graphmend
import trap_one_file as one
from effects_capture import CountingBackend, run
from trap_files import blocks
from trap_files import model as two

LAYOUTS = {"one_file": one, "two_files": two}
GOOD = torch.rand(2, 4, generator=torch.Generator().manual_seed(0))
NEGATIVE = GOOD - 1.0
NAN = GOOD.clone().index_fill_(1, torch.tensor([2]), float("nan"))


@pytest.fixture(autouse=True)
def _restore():
    yield
    graphmend.unmend()
    torch._dynamo.reset()


def _compiled(model):
    """(eager results on GOOD, NEGATIVE, NAN, the eager model after them), the compiled model, its backend."""
    eager = copy.deepcopy(model)
    expected = [run(eager, x.clone()) for x in (GOOD, NEGATIVE, NAN)]  # before mending patches the classes
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(GOOD.clone(),))
    return expected, eager, compiled, backend


def _traps(report):
    return [(o.status, o.reason) for o in report.outcomes if o.rule == "trap"]


def _same(got, expected):
    assert got.effects() == expected.effects()
    if expected.exception is None:
        torch.testing.assert_close(got.output, expected.output, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", ["Parent", "AliasParent"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_parent_in_another_file_is_trapped_as_in_one_file(layout, name):
    torch.manual_seed(0)
    model = getattr(LAYOUTS[layout], name)()
    expected, _, compiled, backend = _compiled(model)
    report = compiled.report
    assert [status for status, _ in _traps(report)] == ["applied"], report.outcomes
    assert (report.before.graphs, report.after.graphs) == (4, 1)
    got = [run(compiled, x.clone()) for x in (GOOD, NEGATIVE, NAN)]
    for g, e in zip(got, expected):
        _same(g, e)
    assert expected[1].exception == ("ValueError", "negative") and expected[2].exception is None
    assert len(backend.graphs) == 1


@pytest.mark.parametrize(
    "name, change, buffer",
    [
        ("UpdatingParent", "self.seen.add_", "seen"),  # in the parent, after the call
        ("ViaCounting", "self.calls.add_", "wrap.inner.calls"),  # in a module between the parent and the check
        ("TwoPaths", "self.seen.add_", "seen"),  # after the shorter of two chains to the check
    ],
)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_state_change_after_the_call_still_declines(layout, name, change, buffer):
    torch.manual_seed(0)
    model = getattr(LAYOUTS[layout], name)()
    expected, eager, compiled, _ = _compiled(model)
    traps = _traps(compiled.report)
    assert [status for status, _ in traps] == ["declined"], traps
    assert change in traps[0][1] and "state changes after the check" in traps[0][1], traps
    for x, e in zip((GOOD, NEGATIVE, NAN), expected):
        _same(run(compiled, x.clone()), e)
    torch.testing.assert_close(model.get_buffer(buffer), eager.get_buffer(buffer), rtol=0, atol=0, equal_nan=True)


def test_break_chains_keep_every_caller_frame():
    """Dynamo's report folds adjacent frames of one name (every inlined
    ``forward``) and starts with the stack above the compiled call; discovery
    keeps each caller and drops that stack."""
    from graphmend.discovery import is_library_internal, trace_breaks

    trace = trace_breaks(two.ViaCounting(), (GOOD.clone(),))
    here = os.path.dirname(blocks.__file__)
    want = [("model.py", two.ViaCounting.forward), ("blocks.py", blocks.Wrap.forward),
            ("blocks.py", blocks.Counting.forward), ("blocks.py", blocks.Child.forward)]
    lines = [(file, fn.__code__.co_firstlineno) for file, fn in want]
    assert trace.events
    for event in trace.events:
        frames = [f for f in event.frames if not is_library_internal(f.file)]
        assert all(os.path.dirname(f.file) == here for f in frames), frames
        assert [(os.path.basename(f.file), f.function) for f in frames] == [(file, "forward") for file, _ in want]
        assert all(f.line > line for f, (_, line) in zip(frames, lines)), frames
