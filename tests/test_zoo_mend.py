"""Issue 3's done-when: zoo rows mended by [Defer] reach one graph with the
same outputs and log records as the unmended eager model."""

import pytest
import torch

import graphmend
from conftest import has_transformers
from effects_capture import CountingBackend, run
from graphmend.rewrite.verify import tensors_in

pytestmark = [
    pytest.mark.zoo,
    pytest.mark.skipif(not has_transformers(), reason="needs transformers==4.52.4"),
]

LC_ROWS = ["t5", "whisper", "bart", "marian", "biogpt", "blenderbot", "pegasus-causal", "layoutlmv3"]


@pytest.fixture(autouse=True)
def _restore():
    yield
    graphmend.unmend()
    torch._dynamo.reset()


def _bitwise(a, b):
    ta, tb = tensors_in(a), tensors_in(b)
    return len(ta) == len(tb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb))


@pytest.mark.parametrize("row", LC_ROWS)
def test_lc_row_reaches_one_graph_with_identical_outputs_and_logs(row):
    from graphmend.models.zoo import build

    model, args, kwargs = build(row)
    eager = run(model, *args, **kwargs)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(args, kwargs))
    mended = run(compiled, *args, **kwargs)
    report = compiled.report
    assert report.before.graphs > 1 and report.after.graphs == 1
    assert len(backend.graphs) == 1
    assert all(o.rule == "defer" and o.status == "applied" for o in report.outcomes)
    assert _bitwise(eager.output, mended.output)
    assert mended.effects() == eager.effects()
    assert eager.records or eager.warnings  # the row really logs


def test_longformer_loses_every_break():
    from graphmend.models.zoo import build

    model, args, kwargs = build("longformer")
    eager = run(model, *args, **kwargs)
    report = graphmend.mend(model, *args, **kwargs)
    assert {s.category for s in report.before.sites} == {"LC", "TI"}
    assert report.after.sites == [] and report.after.graphs == 1
    assert sorted((o.category, o.rule) for o in report.applied) == [("LC", "defer"), ("TI", "speculate")]
    mended = run(model, *args, **kwargs)
    assert _bitwise(eager.output, mended.output)


@pytest.mark.slow
def test_t5_with_inductor_matches_eager_within_tolerance():
    from graphmend.models.zoo import build

    model, args, kwargs = build("t5")
    with torch.no_grad():
        reference = model(*args, **kwargs)
    compiled = graphmend.compile(model, backend="inductor", example_inputs=(args, kwargs))
    mended = run(compiled, *args, **kwargs)
    assert compiled.report.after.graphs == 1
    assert torch.allclose(reference.logits, mended.output.logits, atol=1e-5, rtol=1e-5)


def test_analysis_runs_neither_swallow_nor_repeat_warning_once():
    from effects_capture import capture
    from graphmend.rewrite.verify import fresh_once_caches
    from graphmend.models.zoo import build

    model, args, kwargs = build("t5")
    with fresh_once_caches():  # a process where the message was never logged
        compiled = graphmend.compile(model, backend=CountingBackend(), example_inputs=(args, kwargs))
        with capture() as first, torch.no_grad():
            compiled(*args, **kwargs)
        with capture() as second, torch.no_grad():
            compiled(*args, **kwargs)
    assert [r[5][:20] for r in first.records] == ["Passing a tuple of `"]  # shown once, at the user's call
    assert second.records == []  # and not again


def _fp16_overflowing(row):
    from graphmend.models.zoo import build

    model, args, kwargs = build(row)
    with torch.no_grad():  # make the encoder's first layer overflow fp16 so the clamp runs
        model.model.encoder.layers[0].final_layer_norm.weight.fill_(60000.0)
    return model, args, kwargs


@pytest.mark.parametrize("row", ["bart-fp16", "marian-fp16"])
@pytest.mark.parametrize("overflow", [False, True], ids=["normal", "overflow"])
def test_fp16_rows_reach_one_graph_and_stay_exact(row, overflow):
    import copy

    from graphmend.models.zoo import build

    model, args, kwargs = _fp16_overflowing(row) if overflow else build(row)
    reference = copy.deepcopy(model)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(args, kwargs))
    report = compiled.report
    assert {o.category for o in report.outcomes if o.status == "applied"} == {"DC", "LC"}
    assert report.after.breaks == 0 and len(backend.graphs) <= 1
    seen = []
    hook = reference.model.encoder.layers[0].register_forward_hook(lambda m, i, o: seen.append(o[0].abs().max()))
    eager = run(reference, *args, **kwargs)
    hook.remove()
    mended = run(compiled, *args, **kwargs)
    limit = float(torch.tensor(torch.finfo(torch.float16).max - 1000, dtype=torch.float16))
    assert (float(seen[0]) == limit) == overflow  # the clamp really ran (or really did not)
    ta, tb = tensors_in(eager.output), tensors_in(mended.output)
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb):
        # Bit for bit, except NaN payloads: the counting backend's fp16 graph
        # and eager produce different NaN bits for the unmended model too.
        nan = torch.isnan(x)
        assert torch.equal(nan, torch.isnan(y)) and torch.equal(x[~nan], y[~nan])
    assert mended.effects() == eager.effects()


def test_phi3_longrope_both_sides_of_the_threshold_without_recompile():
    import copy

    from graphmend.models.zoo import build

    model, args, kwargs = build("phi3-longrope")
    ids = kwargs["input_ids"]
    short = torch.arange(ids.shape[1]).unsqueeze(0)  # max position 7 < 16
    long = short + 30  # max position 37 > 16: the long-factor branch
    calls = [dict(kwargs, position_ids=p) for p in (short, long, short)]
    reference = copy.deepcopy(model)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=((), calls[0]))
    assert compiled.report.before.breaks == 5 and compiled.report.after.breaks == 0
    for call in calls:
        eager = run(reference, **call)
        mended = run(compiled, **call)
        assert _bitwise(eager.output, mended.output)
        assert torch.equal(reference.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    assert len(backend.graphs) == 1  # one graph, no recompile over the three calls


@pytest.mark.parametrize("length", [8, 20])
def test_phi3_longrope_is_one_graph_over_three_calls_at_each_length(length):
    """Input length 8 stays under `original_max_position_embeddings` (16), 20 goes over it (the
    long factor, memoised on the first call): one graph over three calls, outputs bit for bit."""
    import copy

    from graphmend.models.zoo import build

    model, _, _ = build("phi3-longrope")
    ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(0))
    reference = copy.deepcopy(model)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend)
    for _ in range(3):
        assert _bitwise(run(reference, input_ids=ids).output, run(compiled, input_ids=ids).output)
    assert compiled.report.verified and len(backend.graphs) == 1


def test_grounding_dino_loses_its_validation_guard_breaks():
    import copy

    from graphmend.models.zoo import build

    model, args, kwargs = build("grounding-dino")
    reference = copy.deepcopy(model)
    report = graphmend.mend(model, *args, **kwargs)
    vg = [o for o in report.outcomes if o.category == "VG"]
    assert vg and all(o.status == "applied" for o in vg)
    assert report.before.breaks == 16 and report.after.breaks == 7  # the paper's artifact: 16 -> 7
    assert {s.category for s in report.after.sites} <= {"TI", "DO", "DS"}
    assert _bitwise(run(reference, *args, **kwargs).output, run(model, *args, **kwargs).output)
