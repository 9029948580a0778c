"""[Trap]: the same exception, message, effects before the check, and state;
checks in a child class whose parent lives in another file; the bugs the
fuzzer found in it; its golden table (a source -> the exact rewrite, or the
exact reason it declines)."""

import copy
import os
import warnings

import golden
import guards as G
import pytest
import torch
import trap_one_file as one
from conftest import FIXTURES
from effects_capture import CountingBackend, bits_equal, run
from torch import nn
from trap_files import blocks
from trap_files import model as two

import graphmend

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
    "cls",
    [G.IfRaise, G.IfNotRaise, G.UntypedOr, G.Asserts, G.TorchAssert, G.TorchAssertFormatted, G.FormattedMessage,
     G.ShapeMessage],
    ids=lambda c: c.__name__,
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


def test_a_shape_in_the_message_is_read_only_from_a_tensor_that_has_the_dimension():
    """`str(y.shape[0])` on every call would raise IndexError on a 0-dim `y` the check
    passes; runtime.has_dims sends such a call to the original check, which does not
    format the message."""
    reference, compiled, backend = mended(G.ShapeMessage)
    assert run(reference, BAD).exception == ("ValueError", "check failed at 2 of 2")
    scalar = torch.tensor(0.5)
    eager, got = run(reference, scalar), run(compiled, scalar)
    assert eager.exception is None and got.exception is None
    assert torch.equal(got.output, eager.output)
    assert len(backend.graphs) == 2  # the 2-D example, then the 0-dim call (the original check)


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
    (G.MutatesChildAfter, "state changes after the check would now happen before it raises: `self.counter.seen.add_(...)`"),
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


def _call(fn, x):
    """(exception type and message, or None; the output), grad mode as the caller's."""
    try:
        return None, fn(x)
    except Exception as exc:
        return (type(exc).__name__, str(exc)), None


def _same_state(model, reference):
    assert torch.equal(model.calls, reference.calls) and torch.equal(model.seen, reference.seen)
    assert hasattr(model, "last") == hasattr(reference, "last")
    if getattr(reference, "last", None) is not None:
        assert torch.equal(model.last, reference.last)
    else:
        assert getattr(model, "last", None) is None


def _restores(grad, set_last, calls):
    """RestoresAfter through graphmend.compile, each call's exception or output
    (and gradients) and state held to eager's; (graphs, plain torch.compile's)."""
    torch.manual_seed(0)
    reference = G.RestoresAfter(set_last)
    model = copy.deepcopy(reference)
    plain_backend = CountingBackend()  # the original code (mending replaces the class's forward)
    with torch.set_grad_enabled(grad):
        plain = torch.compile(G.RestoresAfter(set_last), backend=plain_backend)
        for x in calls:
            _call(plain, x)
    torch._dynamo.reset()
    backend = CountingBackend()
    with torch.set_grad_enabled(grad):
        compiled = graphmend.compile(model, backend=backend, example_inputs=(GOOD,))
        traps = [o for o in compiled.report.outcomes if o.category == "VG"]
        assert [o.status for o in traps] == ["applied"], traps
        assert "(self.calls, self.last, self.seen's data) is put back when it raises" in traps[0].reason
        assert compiled.report.before.graphs == 2 and compiled.report.after.graphs == 1
        for x in calls:
            eager, got = _call(reference, x), _call(compiled, x)
            assert got[0] == eager[0]  # the exception, or None
            if eager[0] is None:
                assert torch.equal(got[1], eager[1])
                if grad:
                    got[1].sum().backward()
                    eager[1].sum().backward()
                    assert torch.equal(model.scale.grad, reference.scale.grad)
            _same_state(model, reference)
    assert _call(reference, BAD)[0] == ("ValueError", "too negative")
    return len(backend.graphs), len(plain_backend.graphs)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_what_the_code_after_the_check_stores_is_put_back_when_it_raises(grad):
    """`self.calls = ...`, `self.seen.add_(...)` and a method's `self.last = ...`
    after the check: the trap records them as they were at the check and puts
    them back before it raises, so the state after each call is eager's."""
    assert _restores(grad, True, (GOOD, BAD, GOOD * 3, BAD, GOOD)) == (1, 2)


def test_an_attribute_first_set_after_the_check_is_removed_when_it_raises():
    """`last` is not set before the first call, which raises: it stays unset,
    as eager leaves it. Its getting set by the next call recompiles once (the
    trap's record tests whether it exists): as many graphs as plain torch.compile."""
    assert _restores(False, False, (BAD, GOOD, BAD, GOOD * 3)) == (2, 2)


def test_a_module_that_hands_back_its_input_does_not_make_it_fresh():
    """`h = self.ident(x); h.mul_(2)` after the check changes the caller's `x`:
    [Trap] declines, and a call that raises leaves the input as eager does."""
    reference, compiled, _ = mended(G.ChangesInputAfter)
    traps = [o for o in compiled.report.outcomes if o.category == "VG"]
    assert [o.status for o in traps] == ["declined"]
    assert "state changes after the check would now happen before it raises: `h.mul_(...)`" in traps[0].reason
    for x in (GOOD, BAD):
        eager_in, got_in = x.clone(), x.clone()
        assert _call(compiled, got_in)[0] == _call(reference, eager_in)[0]
        assert torch.equal(got_in, eager_in)
    assert torch.equal(eager_in, BAD)  # eager raised before changing it


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_check_in_a_branch_not_taken_is_trapped_ahead_and_the_branch_computed(grad):
    reference, compiled, backend = mended(G.CheckInBranch)
    outcomes = {o.rule: (o.status, o.reason) for o in compiled.report.outcomes}
    assert outcomes["where"][0] == "applied" and outcomes["trap"][0] == "applied", outcomes
    assert "rewritten ahead" in outcomes["trap"][1]
    assert (compiled.report.before.graphs, compiled.report.after.graphs) == (2, 1)
    big, huge = torch.full((2, 4), 20.0), torch.full((2, 4), 20.0)
    huge[1, 2] = 600.0
    with torch.set_grad_enabled(grad):
        for x in (GOOD, big, huge, GOOD):
            eager, got = _call(reference, x), _call(compiled, x)
            assert got[0] == eager[0] and (eager[0] is not None or torch.equal(got[1], eager[1]))
    assert _call(reference, huge)[0] == ("AssertionError", "too large") and _call(reference, big)[0] is None
    assert len(backend.graphs) == 1


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


LOOPS = os.path.join(FIXTURES, "trap_loops.py")


def _trap_outcome(factory):
    from graphmend.models.targets import load_target
    from graphmend.pipeline import mend_target
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


# -- across files --------------------------------------------------------------
# [Trap] across files (issue 21): a check in a child module class whose parent
# class lives in another file is trapped as when both share one file, and the
# parents' code after the call is still checked for state changes.

LAYOUTS = {"one_file": one, "two_files": two}
FILES_GOOD = torch.rand(2, 4, generator=torch.Generator().manual_seed(0))
FILES_NEGATIVE = FILES_GOOD - 1.0
FILES_NAN = FILES_GOOD.clone().index_fill_(1, torch.tensor([2]), float("nan"))
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="nn.DataParallel takes every GPU there")


def _compiled(model):
    """(eager results on FILES_GOOD, _NEGATIVE and _NAN, the eager model after them), the compiled model, its backend."""
    eager = copy.deepcopy(model)
    expected = [run(eager, x.clone()) for x in (FILES_GOOD, FILES_NEGATIVE, FILES_NAN)]  # before mending patches the classes
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(FILES_GOOD.clone(),))
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
    got = [run(compiled, x.clone()) for x in (FILES_GOOD, FILES_NEGATIVE, FILES_NAN)]
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
    for x, e in zip((FILES_GOOD, FILES_NEGATIVE, FILES_NAN), expected):
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
    for x, e in zip((FILES_GOOD, FILES_NEGATIVE, FILES_NAN), expected):
        _same(run(compiled, x.clone()), e)


def test_break_chains_keep_every_caller_frame():
    """Dynamo's report folds adjacent frames of one name (every inlined
    ``forward``) and starts with the stack above the compiled call; discovery
    keeps each caller and drops that stack."""
    from graphmend.discover.trace import is_library_internal, trace_breaks

    trace = trace_breaks(two.ViaCounting(), (FILES_GOOD.clone(),))
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
    for x, e in zip((FILES_GOOD, FILES_NEGATIVE, FILES_NAN), expected):
        _same(run(compiled, x.clone()), e)


@CPU_ONLY
def test_dataparallel_still_checks_the_wrapped_parent():
    torch.manual_seed(0)
    model = torch.nn.DataParallel(two.UpdatingParent())
    expected, eager, compiled, _ = _compiled(model)
    traps = _traps(compiled.report)
    assert [status for status, _ in traps] == ["declined"] and "self.seen.add_" in traps[0][1], traps
    for x, e in zip((FILES_GOOD, FILES_NEGATIVE, FILES_NAN), expected):
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
        compiled = graphmend.compile(model, backend=CountingBackend(), example_inputs=(FILES_GOOD.clone(),))
        assert [status for status, _ in _traps(compiled.report)] == ["declined"]  # the buffer update
        graphmend.unmend()
        model = torch.nn.parallel.DistributedDataParallel(two.Parent())
        compiled = graphmend.compile(model, backend=CountingBackend(), example_inputs=(FILES_GOOD.clone(),))
        assert [status for status, _ in _traps(compiled.report)] == ["applied"]
        graphmend.unmend()
        model = torch.nn.parallel.DistributedDataParallel(two.UpdatingParent())

        def broadcast(state, buffers):
            return [_allreduce_fut(None, b) for b in buffers]

        model._register_buffer_comm_hook(None, broadcast, comm_hook_location=_BufferCommHookLocation.POST_FORWARD)
        with pytest.warns(RuntimeWarning, match=r"\[Trap\] is off for this DistributedDataParallel"):
            compiled = graphmend.compile(model, backend=CountingBackend(), example_inputs=(FILES_GOOD.clone(),))
        traps = _traps(compiled.report)
        assert [status for status, _ in traps] == ["declined"] and "rule 'trap' is not enabled" in traps[0][1]
    finally:
        dist.destroy_process_group()


def _seeded(cls):
    torch.manual_seed(0)
    return cls()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_an_item_compared_in_an_assert_is_trapped_as_a_tensor_test(grad):
    reference, model = _seeded(G.ItemAssert), _seeded(G.ItemAssert)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(GOOD,))
    for x in (GOOD, BAD, GOOD * 0.5, BAD):
        a, b = x.clone().requires_grad_(grad), x.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            expected, got = run(reference, a), run(compiled, b)
        assert got.exception == expected.exception and got.effects() == expected.effects()
        if expected.exception is None:
            assert torch.equal(expected.output, got.output)
    assert run(reference, BAD).exception == ("AssertionError", "activations blew up")
    assert [(o.rule, o.status) for o in compiled.report.outcomes] == [("trap", "applied")]
    assert len(backend.graphs) == 1


def test_an_item_compared_with_a_name_in_an_assert_is_trapped():
    model = G.LengthsAssert()
    x = torch.randn(2, 5)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(x, torch.tensor([3, 5])))
    for lengths in ([3, 5], [3, 6], [5, 1]):
        lengths = torch.tensor(lengths)
        expected, got = run(model, x, lengths), run(compiled, x, lengths)
        assert got.exception == expected.exception
        if expected.exception is None:
            assert torch.equal(expected.output, got.output)
    assert run(model, x, torch.tensor([3, 6])).exception == ("AssertionError", "")
    assert len(backend.graphs) == 1


def test_an_item_compared_with_a_constant_not_exact_in_its_dtype_keeps_the_break():
    """100.1 is not exact in float32: runtime.item_of reads `.item()`, as the original
    does, and the check runs where it stands (2 graphs, as before)."""
    reference, model = _seeded(G.ItemAssertInexact), _seeded(G.ItemAssertInexact)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(GOOD,))
    for x in (GOOD, BAD):
        expected, got = run(reference, x), run(compiled, x)
        assert got.exception == expected.exception
        if expected.exception is None:
            assert torch.equal(expected.output, got.output)
    assert run(reference, BAD).exception == ("AssertionError", "activations blew up")
    assert compiled.report.after.graphs == 2


@pytest.mark.parametrize("kwargs", [{}, {"guarded": False}, {"n_langs": 2}], ids=["absent", "absent-unguarded", "present"])
def test_a_call_of_an_attribute_the_module_lacks_after_the_check_is_no_state_change(kwargs):
    """XLM's `self.lang_embeddings(langs)` with one language: the lookup raises
    AttributeError before the call does anything, so it cannot change state; where it is
    reached, the trapped check's exception still wins when the check fails."""
    reference, model = _seeded(lambda: G.LangEmbeddingsAbsent(**kwargs)), _seeded(lambda: G.LangEmbeddingsAbsent(**kwargs))
    compiled = graphmend.compile(model, backend=CountingBackend(), example_inputs=(GOOD,))
    langs = torch.zeros(2, dtype=torch.long)
    for x, lang in ((GOOD, None), (BAD, None), (GOOD, langs), (BAD, langs)):
        expected, got = run(reference, x, lang), run(compiled, x, lang)
        assert got.exception == expected.exception
        if expected.exception is None:
            assert torch.equal(expected.output, got.output)
    assert run(reference, BAD, langs).exception == ("AssertionError", "activations blew up")
    missing = ("AttributeError", "'LangEmbeddingsAbsent' object has no attribute 'lang_embeddings'")
    assert run(reference, GOOD, langs).exception == (missing if kwargs == {"guarded": False} else None)
    assert [(o.rule, o.status) for o in compiled.report.outcomes] == [("trap", "applied")]
    assert compiled.report.after.graphs == 1


# -- fuzz regressions ----------------------------------------------------------
# Bugs the differential fuzzer (tests/fuzz) found in [Trap], each as the smallest
# program that shows it; each asserts the behaviour the original has.


class TrapThenError(nn.Module):
    def forward(self, x):
        if (x < 0).any():
            raise ValueError("negative input")
        return x + int(x.sum().item())


def test_trapped_check_wins_over_a_later_error_under_graphmend_compile():
    model = TrapThenError()
    x = torch.tensor([-1.0, float("nan")])
    expected = run(copy.deepcopy(model), x)
    assert expected.exception == ("ValueError", "negative input")
    compiled = graphmend.compile(model, backend="eager", example_inputs=(torch.ones(2),))
    assert ("trap", "applied") in [(o.rule, o.status) for o in compiled.report.outcomes]
    got = run(compiled, x)
    assert got.exception == expected.exception
    assert got.warnings == expected.warnings


class CountingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.count = 0

    def forward(self, h):
        self.count += 1
        return h


class CheckThenLoop(nn.Module):
    """Found by the fuzzer: the [Trap] continuation scan skipped calls of a loop
    variable (`layer(x)`), so blocks updated their state before the trapped
    check raised."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([CountingBlock() for _ in range(2)])

    def forward(self, x):
        if (x < 0).any():
            raise ValueError("negative")
        for layer in self.blocks:
            x = layer(x)
        return x


class CheckInHelperThenLoop(CheckThenLoop):
    def check(self, x):
        if (x < 0).any():
            raise ValueError("negative")
        return x

    def forward(self, x):
        x = self.check(x)
        for layer in self.blocks:
            x = layer(x)
        return x


@pytest.mark.parametrize("cls", [CheckThenLoop, CheckInHelperThenLoop], ids=lambda c: c.__name__)
def test_a_check_followed_by_stateful_blocks_in_a_loop_keeps_state(cls):
    model = cls()
    expected_model = copy.deepcopy(model)
    x = torch.tensor([1.0, -1.0])
    expected = run(expected_model, x)
    assert expected.exception == ("ValueError", "negative")
    compiled = graphmend.compile(model, backend="eager", example_inputs=(torch.ones(2),))
    (trap,) = [o for o in compiled.report.outcomes if o.rule == "trap"] or [compiled.report.outcomes]
    assert trap.status == "declined" and "self.count" in trap.reason
    got = run(compiled, x)
    assert got.exception == expected.exception
    assert [b.count for b in model.blocks] == [b.count for b in expected_model.blocks] == [0, 0]


class CheckThenTwoLoopsOfOneName(nn.Module):
    """Found by the fuzzer (seed 24): two loops bind the same name, `layer`; the
    scan resolved a `layer(x)` outside the statement it was scanning by the
    first loop, pure blocks, and missed the counting blocks of the second."""

    def __init__(self):
        super().__init__()
        self.pre = nn.ModuleList([nn.Identity(), nn.Identity()])
        self.blocks = nn.ModuleList([CountingBlock() for _ in range(2)])

    def forward(self, x):
        for layer in self.pre:
            x = layer(x) * 2
        for layer in self.blocks:
            if (x < 0).any():
                raise ValueError("negative")
            x = layer(x) + 1
        return x


class CheckingCountingBlock(CountingBlock):
    def forward(self, h):
        if (h < 0).any():
            raise ValueError("negative")
        self.count += 1
        return h.abs()


class CallerOfTwoLoopsOfOneName(CheckThenTwoLoopsOfOneName):
    """The fuzzer's own shape: the check is in the second list's blocks; the
    caller's loop runs the next block, a different `self`, after it."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([CheckingCountingBlock() for _ in range(2)])

    def forward(self, x):
        for layer in self.pre:
            x = layer(x) - 2
        for layer in self.blocks:
            x = layer(x)
        return x


@pytest.mark.parametrize("cls", [CheckThenTwoLoopsOfOneName, CallerOfTwoLoopsOfOneName], ids=lambda c: c.__name__)
def test_a_loop_variable_bound_by_two_loops_is_resolved_by_both(cls):
    model = cls()
    expected_model = copy.deepcopy(model)
    x = torch.tensor([0.5, -1.0])
    expected = run(expected_model, x)
    assert expected.exception == ("ValueError", "negative")
    compiled = graphmend.compile(model, backend="eager", example_inputs=(torch.full((2,), 5.0),))
    (trap,) = [o for o in compiled.report.outcomes if o.rule == "trap"] or [compiled.report.outcomes]
    assert trap.status == "declined" and f"{type(model.blocks[0]).__name__}.forward: `self.count" in trap.reason, trap
    got = run(compiled, x)
    assert got.exception == expected.exception
    assert [b.count for b in model.blocks] == [b.count for b in expected_model.blocks] == [0, 0]


def _scaled(x):
    def double(t):
        return t * 2

    return double(x)


class CheckThenNestedHelper(nn.Module):
    """The loop-variable fix must still accept a nested helper function (as in
    grounding-dino's get_sine_pos_embed): its body is scanned with its parent."""

    def forward(self, x):
        if (x < 0).any():
            raise ValueError("negative")
        return _scaled(x)


def test_a_check_followed_by_a_nested_pure_helper_is_trapped():
    report = graphmend.mend(CheckThenNestedHelper(), torch.ones(2))
    assert [(o.rule, o.status) for o in report.outcomes] == [("trap", "applied")], report.outcomes


class LoudBlock(nn.Module):
    def forward(self, h):
        if h.sum() > 100:
            print("loud", h.sum())
        return h


class CheckThenLoudBlock(nn.Module):
    """A trapped check, then a callee whose print the example did not reach:
    eager raises before printing; so must the mended program."""

    def __init__(self):
        super().__init__()
        self.block = LoudBlock()

    def forward(self, x):
        if (x < 0).any():
            raise ValueError("negative input")
        return self.block(x)


def test_a_set_trap_raises_before_an_effect_that_was_not_deferred():
    model = CheckThenLoudBlock()
    bad = torch.tensor([-1.0, 500.0])
    expected = run(copy.deepcopy(model), bad)
    assert expected.exception == ("ValueError", "negative input") and expected.stdout == ""
    compiled = graphmend.compile(model, backend="eager", example_inputs=(torch.ones(2),))
    assert ("trap", "applied") in [(o.rule, o.status) for o in compiled.report.outcomes], compiled.report.outcomes
    got = run(compiled, bad)
    assert (got.exception, got.stdout) == (expected.exception, expected.stdout)
    fine = torch.tensor([1.0, 500.0])
    assert run(compiled, fine).stdout == run(copy.deepcopy(model), fine).stdout == "loud tensor(501.)\n"


def _in_region(fn, *args):
    with graphmend.runtime.region():
        return fn(*args)


def test_a_check_reported_without_its_callers_still_sees_their_state_changes():
    from fixtures.trap_callers import UpdatesAfterBlocks

    model = UpdatesAfterBlocks()
    example = torch.ones(2, 4)
    sites = graphmend.explain(copy.deepcopy(model), example).sites
    assert [len(s.frames) for s in sites] == [3, 1]  # Dynamo's report: the second without callers
    bad = example.clone()
    bad[0, 1] = float("inf")
    eager, mended = copy.deepcopy(model), copy.deepcopy(model)
    expected = run(eager, bad)  # before mending: mending patches the class's functions
    report = graphmend.mend(mended, example)
    traps = [(o.status, o.reason) for o in report.outcomes if o.rule == "trap"]
    assert [status for status, _ in traps] == ["declined", "declined"], traps
    assert all("self.buf.copy_" in reason for _, reason in traps), traps
    got = run(lambda t: _in_region(mended, t), bad)
    assert expected.exception == ("AssertionError", "value out of range")
    assert got.exception == expected.exception
    assert torch.equal(mended.buf, eager.buf) and not eager.buf.any()


def test_callers_unknown_declines_the_check():
    import fixtures.trap_callers as fixture
    from fixtures.trap_callers import Block, UpdatesAfterBlocks

    from graphmend.discover.chains import complete
    from graphmend.discover.trace import Frame

    here = fixture.__file__
    line = Block._helper.__code__.co_firstlineno + 3  # the assert
    alone = (Frame(here, line, "_helper", ""),)
    forward = UpdatesAfterBlocks.forward.__code__.co_firstlineno
    entry = {(here, forward)}
    assert complete(alone, [], entry) == []  # nobody seen calling it: the rule must decline
    via = (Frame(here, forward + 3, "forward", ""), Frame(here, line - 2, "_helper", ""))
    assert complete(alone, [via], entry) == [via[:1] + alone]


def test_a_set_trap_raises_before_a_model_effect_but_not_inside_the_compiler():
    """Found by the fuzzer (seed 4): AOTAutograd warned while compiling a later
    frame, the watch performed the pending records, and the set trap raised
    inside the compiler (InternalTorchDynamoError instead of the check's error)."""
    rt = graphmend.runtime
    site = ("graphmend.tests", 1, "forward")
    with warnings.catch_warnings(record=True) as shown, pytest.raises(ValueError, match="bad values"):
        warnings.simplefilter("always")
        with rt.region():
            rt.trap(site, torch.tensor(True), ValueError, ("bad values",))
            # what Dynamo holds, on its own thread, while it compiles a frame (AOTAutograd and the backend too)
            with torch._guards.compile_context(torch._guards.CompileContext(None)):
                warnings.warn("torch's own, while compiling")
            assert [str(w.message) for w in shown] == ["torch's own, while compiling"]
            warnings.warn("the model's, after the check")  # eager would have raised before it
    assert [str(w.message) for w in shown] == ["torch's own, while compiling"]


def test_a_set_trap_does_not_raise_inside_a_real_compile():
    """The same on a real compile, on each release: torch 2.12 has no
    ``torch.compiler._compile_session_context``; the runtime asks the thread's
    ``CompileContext``, which Dynamo holds while the backend (and AOTAutograd
    inside it) compiles on every supported release."""
    rt = graphmend.runtime
    site = ("graphmend.tests", 1, "forward")
    torch._dynamo.reset()

    def backend(gm, example_inputs):
        warnings.warn("the backend's own, while compiling")
        return gm

    f = torch.compile(lambda x: x + 1, backend=backend)
    with warnings.catch_warnings(record=True) as shown, pytest.raises(ValueError, match="bad values"):
        warnings.simplefilter("always")
        with rt.region():
            rt.trap(site, torch.tensor(True), ValueError, ("bad values",))
            assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))
            assert [str(w.message) for w in shown] == ["the backend's own, while compiling"]
            warnings.warn("the model's, after the check")
    assert [str(w.message) for w in shown] == ["the backend's own, while compiling"]
    torch._dynamo.reset()


# -- golden table --------------------------------------------------------------
# What [Trap] makes of small sources (tests/rules/golden.py): the site is
# marked `# <-`; each case expects exactly the function after the rewrite, or
# exactly the reason it declines. Source level only: milliseconds a case.
# `# <- caller` marks the caller's line of the chain the scan follows.

GOLDEN = [
    golden.case(
        "if-raise",
        """
        def f(x):
            if (x < 0).any():  # <-
                raise ValueError("negative input")
            return x * 2
        """,
        rewritten="""
        def f(x):
            _gm_c0 = (x < 0).any()
            if __graphmend_rt__.trappable(_gm_c0):
                __graphmend_rt__.trap(('golden_case', 2, 'f'), _gm_c0, ValueError, ('negative input',))
            elif _gm_c0:
                raise ValueError('negative input')
            return x * 2
        """,
    ),
    golden.case(
        "if-not-raise-with-a-message-that-needs-item",
        """
        def f(x):
            if not torch.isfinite(x).all():  # <-
                raise ValueError(f"sum was {x.sum().item()}")
            return x * 2
        """,
        rewritten="""
        def f(x):
            _gm_c0 = torch.isfinite(x).all()
            if __graphmend_rt__.trappable(_gm_c0):
                __graphmend_rt__.trap(('golden_case', 2, 'f'), torch.logical_not(_gm_c0), ValueError, (__graphmend_rt__.fstr('sum was ', (__graphmend_rt__.lazy('item', x.sum()), None, None)),))
            elif not _gm_c0:
                raise ValueError(f'sum was {x.sum().item()}')
            return x * 2
        """,
    ),
    golden.case(
        "torch-equal",
        """
        def f(mask, expected):
            if not torch.equal(mask, expected):  # <-
                raise ValueError("bad mask")
            return mask
        """,
        rewritten="""
        def f(mask, expected):
            _gm_c0 = __graphmend_rt__.equal(mask, expected)
            if __graphmend_rt__.trappable(_gm_c0):
                __graphmend_rt__.trap(('golden_case', 2, 'f'), torch.logical_not(_gm_c0), ValueError, ('bad mask',))
            elif not _gm_c0:
                raise ValueError('bad mask')
            return mask
        """,
    ),
    golden.case(
        "assert",
        """
        def f(x):
            assert torch.isfinite(x).all(), "must be finite"  # <-
            return x * 2
        """,
        rewritten="""
        def f(x):
            if __debug__:
                _gm_c0 = torch.isfinite(x).all()
                if __graphmend_rt__.trappable(_gm_c0):
                    __graphmend_rt__.trap(('golden_case', 2, 'f'), torch.logical_not(_gm_c0), AssertionError, ('must be finite',))
                else:
                    assert _gm_c0, 'must be finite'
            return x * 2
        """,
    ),
    golden.case(
        "torch-assert",
        """
        def f(x):
            torch._assert((x > 0).all(), "positive")  # <-
            return x * 2
        """,
        rewritten="""
        def f(x):
            if __debug__:
                _gm_c0 = (x > 0).all()
                if __graphmend_rt__.trappable(_gm_c0):
                    __graphmend_rt__.trap(('golden_case', 2, 'f'), torch.logical_not(_gm_c0), AssertionError, ('positive',))
                else:
                    torch._assert(_gm_c0, 'positive')
            else:
                torch._assert((x > 0).all(), 'positive')
            return x * 2
        """,
    ),
    golden.case(
        "torch-assert-message-the-original-evaluates-on-every-call",
        """
        def f(x):
            torch._assert(torch.isfinite(x).all(), "check failed at " + str(x.shape[0]))  # <-
            return x
        """,
        rewritten="""
        def f(x):
            if __debug__:
                _gm_c0 = torch.isfinite(x).all()
                if __graphmend_rt__.trappable(_gm_c0):
                    __graphmend_rt__.trap(('golden_case', 2, 'f'), torch.logical_not(_gm_c0), AssertionError, (__graphmend_rt__.fstr('check failed at ', (x.shape[0], 's', None)),))
                else:
                    torch._assert(_gm_c0, 'check failed at ' + str(x.shape[0]))
            else:
                torch._assert(torch.isfinite(x).all(), 'check failed at ' + str(x.shape[0]))
            return x
        """,
    ),
    golden.case(
        "an-assert-method-that-is-not-torchs-is-not-trapped",
        """
        def f(self, x):
            self._assert((x > 0).all(), f"min {x.min()}")  # <-
            return x
        """,
        declined="`self._assert` is not torch._assert",
    ),
    golden.case(
        "state-change-of-a-fresh-local-and-a-print-after",
        """
        def f(x):
            y = x * 2
            if (y < 0).any():  # <-
                raise ValueError("negative")
            y.mul_(2)
            print("checked", y)
            return y
        """,
        rewritten="""
        def f(x):
            y = x * 2
            _gm_c0 = (y < 0).any()
            if __graphmend_rt__.trappable(_gm_c0):
                __graphmend_rt__.trap(('golden_case', 3, 'f'), _gm_c0, ValueError, ('negative',))
            elif _gm_c0:
                raise ValueError('negative')
            y.mul_(2)
            print('checked', y)
            return y
        """,
    ),
    golden.case(
        "stateless-module-after",
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                if (x < 0).any():  # <-
                    raise ValueError("negative")
                return self.lin(x)
        """,
        rewritten="""
        def forward(self, x):
            _gm_c0 = (x < 0).any()
            if __graphmend_rt__.trappable(_gm_c0):
                __graphmend_rt__.trap(('golden_case', 7, 'forward'), _gm_c0, ValueError, ('negative',))
            elif _gm_c0:
                raise ValueError('negative')
            return self.lin(x)
        """,
    ),
    golden.case(
        "not-a-check",
        """
        def f(x):
            if (x < 0).any():  # <-
                print("negative")
                raise ValueError("negative")
            return x
        """,
        declined="the if does not hold exactly one raise (and no else)",
    ),
    golden.case(
        "inside-a-try",
        """
        def f(x):
            try:
                if (x < 0).any():  # <-
                    raise ValueError("negative input")
            except ValueError:
                x = x.abs()
            return x
        """,
        declined="the check is inside a try block of the same function (a handler could catch it)",
    ),
    golden.case(
        "a-callers-call-inside-a-try",
        """
        class Model(nn.Module):
            def check(self, x):
                if (x < 0).any():  # <-
                    raise ValueError("negative")
                return x

            def forward(self, x):
                try:
                    x = self.check(x)  # <- caller
                except ValueError:
                    x = x.abs()
                return x
        """,
        declined=(
            "a caller's call is inside a try block (`forward`, line 9): a handler could catch the "
            "exception, which would now be raised after the call"
        ),
    ),
    golden.case(
        "exception-class-defines-init",
        """
        class RichError(Exception):
            def __init__(self, value):
                super().__init__(f"bad {value}")


        def f(x):
            if (x < 0).any():  # <-
                raise RichError(1)
            return x
        """,
        declined="RichError defines __init__: it may not be re-created from its arguments",
    ),
    golden.case(
        "not-provably-an-exception-class",
        """
        def f(x):
            if (x < 0).any():  # <-
                raise make_error()
            return x
        """,
        declined="`make_error` is not provably an exception class",
    ),
    golden.case(
        "raise-from-a-cause",
        """
        def f(x, err):
            if (x < 0).any():  # <-
                raise ValueError("negative") from err
            return x
        """,
        declined="`raise ... from <cause>`: the cause is not re-created",
    ),
    golden.case(
        "exception-built-with-keywords",
        """
        def f(x):
            if (x < 0).any():  # <-
                raise ValueError(code=3)
            return x
        """,
        declined="the exception is built with keywords or *args",
    ),
    golden.case(
        "message-may-raise",
        """
        def f(x, items):
            if (x < 0).any():  # <-
                raise ValueError(f"bad {items[3]}")
            return x
        """,
        declined="the message: indexing can go out of range on the path not taken",
    ),
    golden.case(
        "in-place-op-after",
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("seen", torch.zeros(()))

            def forward(self, x):
                if (x < 0).any():  # <-
                    raise ValueError("negative")
                self.seen.add_(1)
                return x
        """,
        rewritten="""
        def forward(self, x):
            _gm_c0 = (x < 0).any()
            if __graphmend_rt__.trappable(_gm_c0):
                __graphmend_rt__.trap(('golden_case', 7, 'forward'), _gm_c0, ValueError, ('negative',), keep=(self, (), ('seen',)))
            elif _gm_c0:
                raise ValueError('negative')
            self.seen.add_(1)
            return x
        """,
    ),
    golden.case(
        "attributes-stored-after",  # a number's += is put back too (a tensor's would change it in place)
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.calls = 0
                self.last = None

            def forward(self, x):
                if (x < 0).any():  # <-
                    raise ValueError("negative")
                self.calls += 1
                self.last = x.sum()
                return x
        """,
        rewritten="""
        def forward(self, x):
            _gm_c0 = (x < 0).any()
            if __graphmend_rt__.trappable(_gm_c0):
                __graphmend_rt__.trap(('golden_case', 8, 'forward'), _gm_c0, ValueError, ('negative',), keep=(self, ('calls', 'last'), ()))
            elif _gm_c0:
                raise ValueError('negative')
            self.calls += 1
            self.last = x.sum()
            return x
        """,
    ),
    golden.case(
        "in-place-on-what-a-helper-hands-back",  # helper returns h as given: as fresh as the h passed
        """
        def helper(h, s):
            return h, s


        class Model(nn.Module):
            def forward(self, x):
                h = x * 1.0
                s = h.mean()
                if (h < 0).any():  # <-
                    raise ValueError("negative")
                h, s = helper(h, s)
                h.add_(1)
                return h
        """,
        rewritten="""
        def forward(self, x):
            h = x * 1.0
            s = h.mean()
            _gm_c0 = (h < 0).any()
            if __graphmend_rt__.trappable(_gm_c0):
                __graphmend_rt__.trap(('golden_case', 9, 'forward'), _gm_c0, ValueError, ('negative',))
            elif _gm_c0:
                raise ValueError('negative')
            h, s = helper(h, s)
            h.add_(1)
            return h
        """,
    ),
    golden.case(
        "in-place-on-what-identity-hands-back",  # nn.Identity returns the input itself: the caller's tensor
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.ident = nn.Identity()

            def forward(self, x):
                if (x < 0).any():  # <-
                    raise ValueError("negative")
                h = self.ident(x)
                h.mul_(2)
                return h
        """,
        declined="state changes after the check would now happen before it raises: `h.mul_(...)` (line 10)",
    ),
    golden.case(
        "in-place-in-a-block-on-a-fresh-argument",
        """
        class Block(nn.Module):
            def forward(self, h):
                h.add_(1)
                return h


        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([Block(), Block()])

            def forward(self, x):
                h = x * 2.0
                if (h < 0).any():  # <-
                    raise ValueError("negative")
                for block in self.blocks:
                    h = block(h)
                return h
        """,
        rewritten="""
        def forward(self, x):
            h = x * 2.0
            _gm_c0 = (h < 0).any()
            if __graphmend_rt__.trappable(_gm_c0):
                __graphmend_rt__.trap(('golden_case', 14, 'forward'), _gm_c0, ValueError, ('negative',))
            elif _gm_c0:
                raise ValueError('negative')
            for block in self.blocks:
                h = block(h)
            return h
        """,
    ),
    golden.case(
        "in-place-in-a-block-on-the-input",
        """
        class Block(nn.Module):
            def forward(self, h):
                h.add_(1)
                return h


        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([Block(), Block()])

            def forward(self, x):
                if (x < 0).any():  # <-
                    raise ValueError("negative")
                for block in self.blocks:
                    x = block(x)
                return x
        """,
        declined="state changes after the check would now happen before it raises: Block.forward: `h.add_(...)` (line 3)",
    ),
    golden.case(
        "in-place-on-a-local-stored-on-self",  # self.cache holds h: changing h changes it
        """
        class Model(nn.Module):
            def forward(self, x):
                h = x * 2.0
                self.cache = h
                if (h < 0).any():  # <-
                    raise ValueError("negative")
                h.add_(1)
                return h
        """,
        declined="state changes after the check would now happen before it raises: `h.add_(...)` (line 7)",
    ),
    golden.case(
        "in-place-op-on-a-later-iteration",
        """
        def f(x):
            for i in range(3):
                x.mul_(2)
                if (x < 0).any():  # <-
                    raise ValueError("negative")
            return x
        """,
        declined="state changes after the check would now happen before it raises: `x.mul_(...)` (line 3)",
    ),
    golden.case(
        "module-with-state-after",
        """
        class Counting(nn.Module):
            def __init__(self):
                super().__init__()
                self.calls = 0

            def forward(self, x):
                self.calls += 1
                return x


        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([Counting(), Counting()])

            def forward(self, x):
                if (x < 0).any():  # <-
                    raise ValueError("negative")
                for block in self.blocks:
                    x = block(x)
                return x
        """,
        declined=(
            "state changes after the check would now happen before it raises: Counting.forward: "
            "`self.calls = ...` (line 7)"
        ),
    ),
    golden.case(
        "state-change-in-a-caller-after-the-call",  # through `self.check(x)`: the same `self`, put back
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.calls = 0

            def check(self, x):
                if (x < 0).any():  # <-
                    raise ValueError("negative")
                return x

            def forward(self, x):
                x = self.check(x)  # <- caller
                self.calls += 1
                return x
        """,
        rewritten="""
        def check(self, x):
            _gm_c0 = (x < 0).any()
            if __graphmend_rt__.trappable(_gm_c0):
                __graphmend_rt__.trap(('golden_case', 7, 'check'), _gm_c0, ValueError, ('negative',), keep=(self, ('calls',), ()))
            elif _gm_c0:
                raise ValueError('negative')
            return x
        """,
    ),
    golden.case(
        "state-change-in-a-caller-of-another-module",  # the caller's `self` is not the check's
        """
        class Check(nn.Module):
            def forward(self, x):
                if (x < 0).any():  # <-
                    raise ValueError("negative")
                return x


        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.check = Check()
                self.calls = 0

            def forward(self, x):
                x = self.check(x)  # <- caller
                self.calls += 1
                return x
        """,
        declined=(
            "state changes after the check would now happen before it raises: `self.calls = ...` (line 16)"
        ),
    ),
    # `layer(x)` is a call of whatever the loops binding `layer` yield: every such loop,
    # and nothing else binding the name (found by the fuzzer: the first loop alone was read).
    golden.case(
        "a-loop-variable-bound-by-two-loops",
        """
        class Pure(nn.Module):
            def forward(self, x):
                return x * 2


        class Counting(nn.Module):
            def __init__(self):
                super().__init__()
                self.calls = 0

            def forward(self, x):
                if (x < 0).any():  # <-
                    raise ValueError("negative")
                self.calls += 1
                return x


        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.pre = nn.ModuleList([Pure(), Pure()])
                self.blocks = nn.ModuleList([Counting(), Counting()])

            def forward(self, x):
                for layer in self.pre:
                    x = layer(x)
                for layer in self.blocks:
                    x = layer(x)  # <- caller
                return x
        """,
        declined=(
            "state changes after the check would now happen before it raises: Counting.forward: "
            "`self.calls = ...` (line 14)"
        ),
    ),
    golden.case(
        "a-loop-variable-also-bound-by-an-assignment",
        """
        class Counting(nn.Module):
            def __init__(self):
                super().__init__()
                self.calls = 0

            def forward(self, x):
                self.calls += 1
                return x


        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([nn.ReLU(), nn.ReLU()])
                self.head = Counting()

            def forward(self, x):
                for layer in self.blocks:
                    x = layer(x)
                if (x < 0).any():  # <-
                    raise ValueError("negative")
                layer = self.head
                return layer(x)
        """,
        declined=(
            "state changes after the check would now happen before it raises: calls the local `layer(...)`, "
            "which could not be resolved"
        ),
    ),
    # A reduction with no identity element (amax, max, min, item) raises on an empty
    # tensor: evaluated where the original did not, only of a name the test reduced whole
    # or one a guard (runtime.nonempty) tests first.
    golden.case(
        "message-reduces-what-the-test-does-not",
        """
        def f(x):
            if (x < 0).any():  # <-
                raise ValueError(f"min was {x.min().item()}")
            return x
        """,
        rewritten="""
        def f(x):
            _gm_c0 = (x < 0).any()
            if __graphmend_rt__.trappable(_gm_c0) and __graphmend_rt__.nonempty(x):
                __graphmend_rt__.trap(('golden_case', 2, 'f'), _gm_c0, ValueError, (__graphmend_rt__.fstr('min was ', (__graphmend_rt__.lazy('item', x.min()), None, None)),))
            elif _gm_c0:
                raise ValueError(f'min was {x.min().item()}')
            return x
        """,
    ),
    golden.case(
        "message-reduces-what-the-test-reduced",
        """
        def f(x):
            if x.max() > 10:  # <-
                raise ValueError(f"max was {x.max().item()}")
            return x
        """,
        rewritten="""
        def f(x):
            _gm_c0 = x.max() > 10
            if __graphmend_rt__.trappable(_gm_c0):
                __graphmend_rt__.trap(('golden_case', 2, 'f'), _gm_c0, ValueError, (__graphmend_rt__.fstr('max was ', (__graphmend_rt__.lazy('item', x.max()), None, None)),))
            elif _gm_c0:
                raise ValueError(f'max was {x.max().item()}')
            return x
        """,
    ),
]


@pytest.mark.parametrize("source, expected", GOLDEN)
def test_golden(source, expected):
    assert golden.outcome("trap", source) == expected


class GuardedByNone(nn.Module):
    """`mask is not None` guards the operand after it: lowered, `torch.isnan(mask)` is
    evaluated only where the guard holds."""

    def forward(self, x, mask=None):
        y = x * 2
        y = y + 0.0
        if mask is not None and torch.isnan(mask).any():
            raise ValueError("nan in the mask")
        return y


def test_a_static_operand_that_guards_the_next_one_lets_it_run_only_where_the_original_does():
    """Found by the 5,000-program run (a quarter of a sample's declines, as `self.bias is
    not None and h.sum() > 0`): lowering evaluated every operand, so a static guard before
    another was declined. Now `(torch.isnan(mask).any() if mask is not None else False)`:
    with no mask the original runs (nothing evaluated on None); with one, the check is
    trapped. Outputs and the exception as eager's."""
    report = graphmend.mend(GuardedByNone(), GOOD, GOOD)
    (vg,) = [o for o in report.outcomes if o.category == "VG"]
    assert vg.status == "applied", vg
    graphmend.unmend()
    bad = GOOD.clone()
    bad.view(-1)[0] = float("nan")
    compiled = graphmend.compile(GuardedByNone(), backend=CountingBackend(), example_inputs=(GOOD, GOOD))
    for args in [(GOOD,), (GOOD, GOOD), (GOOD, bad)]:
        expected, got = run(GuardedByNone(), *args), run(compiled, *args)
        assert expected.exception == got.exception and (args[-1] is bad) == (got.exception is not None)
        assert got.exception is not None or bits_equal(expected.output, got.output)


class CheckThenPredicatedBufferStore(nn.Module):
    """Found by the fuzzer (seed 22): the check inside the first `if` is trapped
    before [Where] rewrites the second, and its scan saw `self.running = ...`, a
    rebinding the trap puts back. [Where] then made the store a copy into the
    buffer (`runtime.store`, keeping the buffer Dynamo guards on): putting the
    binding back kept the new data, and the failed call left `running` changed."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running", torch.zeros(4))
        self.calls = 0

    def forward(self, x):
        h = x * 1.0
        if (h > 1).any():
            torch._assert(torch.isfinite(h).all(), "value out of range")
        else:
            self.calls = self.calls + 1
        if torch.isinf(h).any():
            self.running = h.mean(0).detach()
        return h * 2


def test_a_check_trapped_before_a_store_became_a_copy_into_the_buffer_puts_its_data_back():
    model = CheckThenPredicatedBufferStore()
    expected_model = copy.deepcopy(model)
    x = torch.tensor([[2.0, float("inf"), -1.0, 0.5], [1.0, 3.0, 0.0, -2.0]])
    expected = run(expected_model, x)
    assert expected.exception == ("AssertionError", "value out of range")
    compiled = graphmend.compile(model, backend="eager", example_inputs=(torch.ones(2, 4) * 2,))
    outcomes = {o.line - CheckThenPredicatedBufferStore.forward.__code__.co_firstlineno: (o.rule, o.status) for o in compiled.report.outcomes}
    assert outcomes[3] == ("trap", "applied") and outcomes[6] == ("where", "applied"), outcomes
    got = run(compiled, x)
    assert got.exception == expected.exception
    assert torch.equal(model.running, expected_model.running) and torch.equal(model.running, torch.zeros(4))
    for y in (torch.ones(2, 4) * 2, x.nan_to_num(posinf=5.0)):  # later calls as eager's
        assert torch.equal(compiled(y), expected_model(y))
        assert torch.equal(model.running, expected_model.running)


class StoreThenCheckInMergedBranch(nn.Module):
    """Found by the 2.15.0 fuzz run (seed 2150, on every release): the else branch
    stores `self.running`, then checks; the code after the check stores it again,
    so the trap puts `running` back when it raises. [Where] merges the branch and
    writes its store after the trap: the trap kept the value from before the
    branch, where eager's failed call leaves the branch's."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running", torch.zeros(4))

    def forward(self, x):
        h = x * 1.0
        if h.sum() > 0:
            h = h * 2
        else:
            self.running = h.mean(0)
            if torch.isnan(h).any():
                raise ValueError("value out of range")
        self.running = h.mean(0) + 1
        return h


def test_a_check_after_a_store_in_a_merged_branch_leaves_the_stored_value_when_it_raises():
    """Compiled (the trap raises after the call) and the mended code called eagerly
    (it raises at once): `running` as eager's failed call left it, and as eager's
    after every call."""
    nan = -torch.ones(2, 4)
    nan[1, 2] = float("nan")
    inputs = (-torch.ones(2, 4), torch.ones(2, 4), nan, -torch.ones(2, 4) * 3, nan)  # else, if, else raising, else, raising
    original = StoreThenCheckInMergedBranch()
    expected = [(run(original, x), original.running.clone()) for x in inputs]
    assert [e.exception for e, _ in expected] == [None, None, ("ValueError", "value out of range"), None] + [expected[2][0].exception]
    backend = CountingBackend()
    model = StoreThenCheckInMergedBranch()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(-torch.ones(2, 4),))
    assert {(o.rule, o.status) for o in compiled.report.outcomes} == {("trap", "applied"), ("where", "applied")}
    mended_eagerly = StoreThenCheckInMergedBranch()  # the class's forward is the mended one now
    for callee, module in ((compiled, model), (mended_eagerly, mended_eagerly)):
        for x, (want, running) in zip(inputs, expected):
            got = run(callee, x)
            assert got.exception == want.exception and (want.exception or bits_equal(got.output, want.output))
            assert bits_equal(module.running, running), (callee, x, module.running, running)
    assert len(backend.graphs) == 1


@pytest.mark.parametrize("order", ["all", "first_then_second", "second_then_first"])
def test_two_models_of_one_class_mended_in_turn_unmend_to_the_users_code_in_any_order(order):
    """The second model's mending finds the first's code installed on the class (a
    server's two copies; found by the fuzzer's threads arm on 2.15.0, whose control
    then ran mended code): it records the user's code, so no order of undoing
    leaves mended code behind."""
    original = StoreThenCheckInMergedBranch.forward.__code__
    first, second = StoreThenCheckInMergedBranch(), StoreThenCheckInMergedBranch()
    compiled = [graphmend.compile(m, backend=CountingBackend()) for m in (first, second)]
    compiled[0](-torch.ones(2, 4))  # each mends on its first call
    installed = StoreThenCheckInMergedBranch.forward.__code__
    compiled[1](-torch.ones(2, 4))
    now = StoreThenCheckInMergedBranch.forward.__code__
    assert now is not original and now is not installed  # the second's rewrite (equal code, not the same object)
    if order == "all":
        graphmend.unmend()
    else:
        for model in (first, second) if order == "first_then_second" else (second, first):
            graphmend.unmend(model)
    assert StoreThenCheckInMergedBranch.forward.__code__ is original


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_check_before_writes_to_a_cache_made_in_the_call_is_trapped_where_none_was_passed(grad):
    """XLM on transformers 5.x: the layers after the check write to `cache`, which
    the forward makes when the caller passes none. Trapped in those calls (one
    graph; the same check again in a helper it calls right after is settled by
    the first); a call given a cache runs the check as written, so a failing
    check leaves the caller's cache unwritten, as eager does."""
    reference, model = _seeded(G.CheckThenCache), _seeded(G.CheckThenCache)
    x, good, bad = torch.randn(2, 3, 4), torch.tensor([3, 2]), torch.tensor([4, 2])
    backend = CountingBackend()
    with torch.set_grad_enabled(grad):
        compiled = graphmend.compile(model, backend=backend, example_inputs=(x, good))
    assert [(o.rule, o.status) for o in compiled.report.outcomes] == [("trap", "applied"), ("trap", "applied")]
    assert compiled.report.before.graphs == 4 and compiled.report.after.graphs == 1
    for lengths in (good, bad, good):
        expected, got = run(reference, x, lengths), run(compiled, x, lengths)
        assert got.exception == expected.exception
        if expected.exception is None:
            assert bits_equal(expected.output, got.output)
        theirs, ours = G.PartsCache(), G.PartsCache()
        expected, got = run(reference, x, lengths, cache=theirs), run(compiled, x, lengths, cache=ours)
        assert got.exception == expected.exception
        assert len(ours.store.items) == len(theirs.store.items) == (0 if expected.exception else 2)
        assert all(bits_equal(a, b) for a, b in zip(theirs.store.items, ours.store.items))
    assert run(reference, x, bad).exception == ("AssertionError", "")
