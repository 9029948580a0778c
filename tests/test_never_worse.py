"""Issue 21, item 7: a mend never leaves more graphs, recompiles or abandoned
frames than the original. The rewrites (or capture flags) responsible are
taken back, their sites end ``reverted`` with both measures, and
``report.after`` is what is installed."""

import ast
import importlib

import pytest
import torch
from conftest import counting_graphs, has_transformers
from effects_capture import CountingBackend, run

import graphmend
from graphmend.discover.capture import SCALAR, Capture
from graphmend.rewrite.verify import tensors_in
from graphmend.rules import load_rules

mend_module = importlib.import_module("graphmend.pipeline")  # graphmend.mend is also the API function
session_module = importlib.import_module("graphmend.rewrite.session")
from graphmend.passes import capturing  # noqa: E402
from graphmend.passes.never_worse import with_dependants  # noqa: E402


@pytest.fixture(autouse=True)
def _restore():
    yield
    graphmend.unmend()
    torch._dynamo.reset()


def _worse(before, after, what="this rewrite"):
    return f"the mended program was worse than the original ({before} -> {after}); without {what}: {before}"


def _bitwise(a, b):
    ta, tb = tensors_in(a), tensors_in(b)
    return len(ta) == len(tb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb))


def test_a_record_in_a_layer_body_both_layers_resume_compiles_once():
    """Both layers run the same frame, which records a print (in the branch [Where]
    predicates since issue 24; before, in a resume frame after the break). The runtime's
    records are linked cells Dynamo guards by type only: with a list, Dynamo guarded on
    its length, and the second layer, finding one record, compiled the frame again
    (2 graphs -> 3, 1 recompile), which the guard below then had to revert."""
    from never_worse import Layer, build

    model, args, _ = build()
    eager = run(model, *args)
    report = graphmend.mend(model, *args)
    assert (report.before.graphs, report.before.recompiles, report.before.frames_skipped) == (2, 0, 0)
    assert (report.after.graphs, report.after.recompiles, report.after.frames_skipped) == (1, 0, 0)
    assert report.verified is True
    line = Layer.forward.__code__.co_firstlineno
    assert [(o.rule, o.line, o.status) for o in report.outcomes] == [
        ("where", line + 1, "applied"), ("defer", line + 2, "applied"),
    ]
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend)
    for _ in range(3):
        mended = run(compiled, *args)
        assert _bitwise(eager.output, mended.output) and mended.stdout == eager.stdout == "layer: finite\n" * 2
    assert len(backend.graphs) == 1


def _defers_with_a_graph_break(real):
    """A faulty [Defer]: the effect deferred, then an op (``h * 1``, exact) and a graph
    break after it (at its line), so the break ends a graph of its own."""

    def rewrite(self, stmt, ctx):
        extra = ast.parse("h = h * 1\ntorch._dynamo.graph_break()").body
        for node in (n for e in extra for n in ast.walk(e)):
            ast.copy_location(node, stmt)
        return [*real(self, stmt, ctx), *extra]

    return rewrite


def test_a_deferred_warning_is_taken_back_only_with_everything(monkeypatch):
    """A rewrite that defers a warnings.warn and leaves more graphs: taken back alone,
    the warning would run in a frame Dynamo compiles, where a warning can report another
    line; here it is the only rewrite, so the program is the original."""
    from never_worse import Model, WarningLayer, build

    from graphmend.rules.defer import Defer

    monkeypatch.setattr(Defer, "rewrite", _defers_with_a_graph_break(Defer.rewrite))
    model, args, _ = build(Model, WarningLayer)
    eager = run(model, *args)
    report = graphmend.mend(model, *args)
    line = WarningLayer.forward.__code__.co_firstlineno
    assert [(o.rule, o.line, o.status) for o in report.outcomes] == [
        ("where", line + 2, "declined"), ("defer", line + 3, "reverted"),
    ]
    assert report.outcomes[1].reason.startswith("the mended program was worse than the original (2 graph(s)")
    assert report.outcomes[1].reason.endswith(
        "taking back one rewrite or the capture flags alone "
        "makes it no less worse (one that defers a warnings.warn is not taken back alone): every rewrite is reverted"
    )
    assert report.after is report.before and counting_graphs(model, args) == 2
    mended = run(graphmend.compile(model, backend=CountingBackend()), *args)
    assert mended.warnings == eager.warnings and len(eager.warnings) == 2


def _adds_a_graph_break(self, stmt, ctx):
    """A faulty rewrite: the statement kept, a graph break before it (at its line)."""
    brk = ast.parse("torch._dynamo.graph_break()").body[0]
    for node in ast.walk(brk):
        ast.copy_location(node, stmt)
    return [brk, stmt]


def test_a_rewrite_that_adds_a_graph_break_is_reverted(monkeypatch):
    from never_worse import Select, build

    model, args, _ = build(Select)
    monkeypatch.setattr(type(load_rules()["where"]), "rewrite", _adds_a_graph_break)
    report = graphmend.mend(model, *args)
    shown = "{} graph(s), 0 recompile(s), 0 frame(s) skipped"
    assert [(o.rule, o.status, o.reason) for o in report.outcomes] == [
        ("where", "reverted", _worse(shown.format(2), shown.format(3))),
    ]
    assert report.after.graphs == report.before.graphs == 2 and report.verified is True
    assert counting_graphs(model, args) == 2


def test_without_the_fault_the_same_site_is_applied():
    """The control for the fault above: [Where] takes the model to one graph."""
    from never_worse import Select, build

    model, args, _ = build(Select)
    report = graphmend.mend(model, *args)
    assert [(o.rule, o.status) for o in report.outcomes] == [("where", "applied")]
    assert (report.before.graphs, report.after.graphs) == (2, 1)


def test_capture_flags_that_cost_graphs_are_dropped(monkeypatch):
    """Flags kept whatever they cost, and made to cost two graphs: they go,
    and the report says so; nothing else was installed, so after is before."""
    from never_worse import Slice, build

    real = session_module.trial

    def costly(target, grad, flags, stage=None):
        trial = real(target, grad, flags, stage)
        if flags:
            trial.report.graphs += 2
        return trial

    monkeypatch.setattr(session_module, "trial", costly)
    monkeypatch.setattr(capturing, "decide", lambda base, measure: (Capture((SCALAR,), ["kept (injected)"]), measure((SCALAR,))))
    model, args, _ = build(Slice)
    report = graphmend.mend(model, *args)
    assert report.capture.flags == ()
    assert report.capture.notes == [
        "kept (injected)",
        f"{SCALAR}: dropped, " + _worse(
            "2 graph(s), 0 recompile(s), 0 frame(s) skipped", "3 graph(s), 0 recompile(s), 0 frame(s) skipped",
            "the capture flags",
        ),
    ]
    assert report.after is report.before
    assert [(o.rule, o.status) for o in report.outcomes] == [("scalar", "declined")]


def test_what_goes_with_a_patch_keeps_every_recorded_assert_guarded():
    """A patch that keeps graph breaks before its asserts (barriers.py) takes the
    rewrites that record with it, or its asserts would fail inside their graph;
    once nothing records, the patches that only keep such breaks go too."""
    from types import SimpleNamespace

    rt = "__graphmend_rt__"
    nodes = [
        f"{rt}.print_(s, (), {{}})\nassert {rt}.held(x.all())",  # records, guards its assert
        f"{rt}.log(s, lg, 'info', (), {{}})",  # records
        f"assert {rt}.held(x.all())",  # only guards (barriers.guard_model)
        "y = torch.where(c, a, b)",  # neither
    ]
    mending = mend_module.Mending()
    mending.patches = [SimpleNamespace(node=ast.parse(n)) for n in nodes]
    mending.groups = {0: [("f", 1)], 1: [("f", 2)], 2: [], 3: [("f", 4)]}
    outcomes = {("f", i): SimpleNamespace(status="applied") for i in (1, 2, 4)}
    dependants = [with_dependants(mending, outcomes, i) for i in (0, 1, 3)]
    assert dependants == [{0, 1, 2}, {1}, {3}]


@pytest.mark.zoo
@pytest.mark.slow
@pytest.mark.skipif(not has_transformers(), reason="needs transformers==4.52.4")
def test_musicgen_is_no_worse():
    """Held out (issue 21): MusicgenSdpaAttention.forward breaks on the empty-mask test
    (line 458, [Where] declines) in both layers, and its deferred warning_once (line 461)
    made the resumed frame compile twice (8 -> 9 graphs) while the runtime kept its
    records in a list (Dynamo guarded on its length); with linked cells it compiles once."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MusicgenDecoderConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
        max_position_embeddings=64, num_codebooks=2,
    )
    model = transformers.MusicgenForCausalLM(config).eval()
    input_ids = torch.randint(0, 64, (2 * config.num_codebooks, 8))
    eager = run(model, input_ids)
    report = graphmend.mend(model, input_ids)
    assert (report.before.graphs, report.before.recompiles, report.before.frames_skipped) == (8, 0, 2)
    assert (report.after.graphs, report.after.recompiles, report.after.frames_skipped) == (8, 0, 2)
    assert report.verified is True
    assert [o for o in report.outcomes if o.status == "reverted"] == []
    assert ("defer", "transformers/models/musicgen/modeling_musicgen.py", 461, "applied") in [
        (o.rule, o.path, o.line, o.status) for o in report.outcomes
    ]
    assert counting_graphs(model, (input_ids,)) == 8
    mended = run(model, input_ids)
    assert _bitwise(eager.output, mended.output) and mended.effects() == eager.effects()
