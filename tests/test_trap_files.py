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
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="nn.DataParallel takes every GPU there")


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


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_call_inside_a_callers_try_declines(layout):
    """Eager, the parent's handler catches the child's ValueError; a raise
    deferred to the end of the call would escape it."""
    torch.manual_seed(0)
    model = LAYOUTS[layout].CatchingParent()
    expected, _, compiled, _ = _compiled(model)
    traps = _traps(compiled.report)
    assert [status for status, _ in traps] == ["declined"] and "a caller's call is inside a try block" in traps[0][1]
    assert expected[1].exception is None and not expected[1].output.any()
    for x, e in zip((GOOD, NEGATIVE, NAN), expected):
        _same(run(compiled, x.clone()), e)


def test_break_chains_keep_every_caller_frame():
    """Dynamo's report folds adjacent frames of one name (every inlined
    ``forward``) and starts with the stack above the compiled call; discovery
    keeps each caller and drops that stack."""
    from graphmend.discover.trace import is_library_internal, trace_breaks

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


@CPU_ONLY
def test_dataparallel_is_a_transparent_caller():
    """``nn.DataParallel`` with no device (CPU) returns ``self.module(...)``:
    nothing of it runs after the call (chains._transparent_inner)."""
    torch.manual_seed(0)
    model = torch.nn.DataParallel(two.Parent())
    assert model.device_ids == []
    expected, _, compiled, backend = _compiled(model)
    report = compiled.report
    assert [status for status, _ in _traps(report)] == ["applied"], report.outcomes
    assert (report.before.graphs, report.after.graphs) == (4, 1)
    for x, e in zip((GOOD, NEGATIVE, NAN), expected):
        _same(run(compiled, x.clone()), e)


@CPU_ONLY
def test_dataparallel_still_checks_the_wrapped_parent():
    torch.manual_seed(0)
    model = torch.nn.DataParallel(two.UpdatingParent())
    expected, eager, compiled, _ = _compiled(model)
    traps = _traps(compiled.report)
    assert [status for status, _ in traps] == ["declined"] and "self.seen.add_" in traps[0][1], traps
    for x, e in zip((GOOD, NEGATIVE, NAN), expected):
        _same(run(compiled, x.clone()), e)
    torch.testing.assert_close(model.module.seen, eager.module.seen, rtol=0, atol=0, equal_nan=True)


@CPU_ONLY
def test_only_a_one_device_dataparallel_is_transparent():
    from graphmend.discover.chains import entry_keys

    inner = entry_keys(two.Parent())
    assert inner <= entry_keys(torch.nn.DataParallel(two.Parent()))
    several = torch.nn.DataParallel(two.Parent())
    several.device_ids = [0, 1]  # replicas in threads, then gather: not a plain call
    assert not inner & entry_keys(several)

    class Custom(torch.nn.DataParallel):  # its forward may do anything after the call
        pass

    assert not inner & entry_keys(Custom(two.Parent()))


def test_distributed_data_parallel_traps_unless_it_broadcasts_buffers_after_the_forward(tmp_path):
    """graphmend.compile mends the module DDP wraps: what DDP's ``_post_forward`` does after
    the call is bookkeeping for the next backward, which the next forward starts over
    (tests/test_ddp.py trains on after a failed call, bit-identically). A buffer hook placed
    after the forward broadcasts buffers there: [Trap] is off for that DDP, with a warning."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import _allreduce_fut
    from torch.nn.parallel.distributed import _BufferCommHookLocation

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("no gloo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(two.UpdatingParent())
        compiled = graphmend.compile(model, backend=CountingBackend(), example_inputs=(GOOD.clone(),))
        assert [status for status, _ in _traps(compiled.report)] == ["declined"]  # the buffer update
        graphmend.unmend()
        model = torch.nn.parallel.DistributedDataParallel(two.Parent())
        compiled = graphmend.compile(model, backend=CountingBackend(), example_inputs=(GOOD.clone(),))
        assert [status for status, _ in _traps(compiled.report)] == ["applied"]
        graphmend.unmend()
        model = torch.nn.parallel.DistributedDataParallel(two.UpdatingParent())

        def broadcast(state, buffers):
            return [_allreduce_fut(None, b) for b in buffers]

        model._register_buffer_comm_hook(None, broadcast, comm_hook_location=_BufferCommHookLocation.POST_FORWARD)
        with pytest.warns(RuntimeWarning, match=r"\[Trap\] is off for this DistributedDataParallel"):
            compiled = graphmend.compile(model, backend=CountingBackend(), example_inputs=(GOOD.clone(),))
        traps = _traps(compiled.report)
        assert [status for status, _ in traps] == ["declined"] and "rule 'trap' is not enabled" in traps[0][1]
    finally:
        dist.destroy_process_group()
