"""Failure safety: a fault inside graphmend never costs the user their model.

Each test injects an exception into one stage of mending. ``graphmend.compile``
must still return a model that computes, prints, logs and warns exactly
what ``torch.compile`` of the untouched model does; a fault confined to one
site declines that site (with the internal error as the reason) and keeps
the others mended.
"""

import importlib

import pytest
import torch
from effects_capture import CountingBackend, run

import graphmend
from graphmend.compat import torch_version_tuple
from graphmend.models import demo
from graphmend.rewrite import engine, verify
from graphmend.rules import load_rules

mend_module = importlib.import_module("graphmend.pipeline")  # graphmend.mend is also the API function
session_module = importlib.import_module("graphmend.rewrite.session")  # where every pass observes and compares


def _fault(*args, **kwargs):
    raise RuntimeError("injected fault")


def _reference():
    model, (x,), _ = demo.build()
    backend = CountingBackend()
    return run(torch.compile(model, backend=backend), x), len(backend.graphs)


@pytest.fixture(scope="module")
def reference():
    torch._dynamo.reset()
    return _reference()


def _mended_run():
    model, (x,), _ = demo.build()
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend)
    got = run(compiled, x)  # mends on this first call
    graphmend.unmend()
    torch._dynamo.reset()
    fallbacks = [w[1] for w in got.warnings if w[0] == "RuntimeWarning" and w[1].startswith("graphmend:")]
    return got, compiled.report, fallbacks


def _user_warnings(captured):
    return [w[:2] for w in captured.warnings if w[1].startswith("demo:")]


def _same_behaviour(got, expected):
    # The reference is torch.compile of the untouched model: same output, the
    # same prints, log messages and the model's own warnings, in order. (Record
    # funcName differs by design: Dynamo names a record logged in a resumed
    # frame after its resume function, mending keeps eager's name.)
    assert got.exception == expected.exception
    assert torch.equal(got.output, expected.output)
    assert got.stdout == expected.stdout
    assert [(r[0], r[1], r[5]) for r in got.records] == [(r[0], r[1], r[5]) for r in expected.records]
    assert _user_warnings(got) == _user_warnings(expected)
    assert expected.records and _user_warnings(expected) and expected.stdout  # the comparison sees the effects


GAVE_UP = "graphmend: could not mend DemoModel (RuntimeError: injected fault); compiling it unchanged"
BUILDING = "internal error building the rewrite: RuntimeError: injected fault"

# stage -> where the fault goes in, and what the user gets: the whole mend
# given up (None: compiled unchanged, one warning), or each site declined
# with the internal error as its reason (it keeps its original code).
WHOLE_STAGES = {
    "discovery": ((mend_module, "explain_target"), None),
    "baseline observation": ((session_module, "observe"), None),
    "locate": ((engine, "locate"), "internal error locating the function: injected fault"),
    "build": ((engine, "build"), BUILDING),
    "install": ((engine, "install"), BUILDING),
    "verification compare": ((session_module, "compare"), None),
}


@pytest.mark.parametrize("stage", sorted(WHOLE_STAGES))
def test_a_fault_in_any_stage_keeps_the_model_working(stage, reference, monkeypatch):
    expected, _ = reference
    (module, name), declined = WHOLE_STAGES[stage]
    monkeypatch.setattr(module, name, _fault)
    got, report, fallbacks = _mended_run()
    _same_behaviour(got, expected)
    if declined is None:
        assert report is None and fallbacks == [GAVE_UP]
    else:
        assert report is not None and report.applied == [] and report.declined
        assert {o.reason for o in report.declined if o.rule is not None} == {declined}


def test_a_fault_in_the_assert_guard_reverts_only_the_rewrites_that_record(reference, monkeypatch):
    """barriers.guard_model keeps records safe from asserts that fail inside the graph: when it
    fails, the records cannot be shown safe, so [Defer] and [Trap] are reverted, the rest kept."""
    from graphmend.passes import barriers

    expected, _ = reference
    monkeypatch.setattr(barriers, "guard_model", _fault)
    got, report, warned = _mended_run()
    _same_behaviour(got, expected)
    assert report is not None and len(warned) == 1 and "an internal error declined" in warned[0]
    recording = [o for o in report.outcomes if o.rule in ("defer", "trap")]
    assert recording and all(o.status == "reverted" and "internal error: RuntimeError: injected fault" in o.reason for o in recording)
    assert any(o.status == "applied" and o.rule == "where" for o in report.outcomes)
    assert any("are reverted: no graph break could be put before the asserts (internal error" in k for k in report.kept)


@pytest.mark.parametrize("rule_name", ["where", "defer", "trap"])
def test_a_rule_fault_declines_only_that_rules_sites(rule_name, reference, monkeypatch):
    expected, _ = reference
    rule = load_rules()[rule_name]
    monkeypatch.setattr(type(rule), "rewrite", _fault)
    got, report, warned = _mended_run()
    _same_behaviour(got, expected)
    # Not a fallback of the whole model: one warning that names the internal error.
    assert len(warned) == 1 and "internal error declined" in warned[0] and "injected fault" in warned[0]
    faulted = [o for o in report.outcomes if o.rule == rule_name]
    assert faulted and all(o.status == "declined" and "internal error" in o.reason for o in faulted)
    others = [o for o in report.outcomes if o.rule not in (rule_name, None)]
    assert any(o.status == "applied" for o in others)
    assert not any("internal error" in o.reason for o in others)


def test_a_fault_in_the_mended_observation_reverts_everything(reference, monkeypatch):
    expected, _ = reference
    calls = {"n": 0}
    original = verify.observe

    def second_call_fails(*args, **kwargs):
        calls["n"] += 1
        if kwargs.get("in_region"):
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    monkeypatch.setattr(session_module, "observe", second_call_fails)
    got, report, fallbacks = _mended_run()
    _same_behaviour(got, expected)
    assert report is None and fallbacks == [GAVE_UP]  # a mend that cannot be verified is not used


def test_an_unsupported_torch_compiles_unchanged_with_a_warning(reference, monkeypatch):
    expected, _ = reference
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    model, (x,), _ = demo.build()
    with pytest.warns(RuntimeWarning, match="graphmend supports torch 2.12 to 2.15, found torch 2.11.0.*; compiling the model unchanged"):
        compiled = graphmend.compile(model, backend=CountingBackend())
    got = run(compiled, x)
    torch._dynamo.reset()
    _same_behaviour(got, expected)


# --------------------------------------------------------------------------
# the backend: mended graphs are new to it


class _Picky:
    """A backend that compiles graphs up to ``limit`` nodes and raises on bigger ones (as
    AOTAutograd raises on a joined graph whose backward it cannot trace)."""

    def __init__(self, limit):
        self.limit, self.compiled, self.refused = limit, 0, 0

    def __call__(self, gm, example_inputs):
        import warnings

        warnings.warn(f"picky: looking at {len(gm.graph.nodes)} nodes")
        if len(gm.graph.nodes) > self.limit:
            self.refused += 1
            raise RuntimeError("picky: graph too big")
        self.compiled += 1
        return gm.forward


def test_a_graph_the_backend_fails_on_runs_as_captured_with_one_warning(reference):
    expected, _ = reference
    model, (x,), _ = demo.build()
    counting = CountingBackend()
    run(torch.compile(model, backend=counting), x)
    torch._dynamo.reset()
    limit = max(len(gm.graph.nodes) for gm in counting.graphs)
    alone = _Picky(limit)
    assert run(torch.compile(model, backend=alone), x).exception is None  # torch.compile alone works
    torch._dynamo.reset()
    assert alone.refused == 0 and alone.compiled > 1

    picky = _Picky(limit)
    model, (x,), _ = demo.build()
    compiled = graphmend.compile(model, backend=picky, example_inputs=(x,))
    assert len(compiled.report.applied) > 0
    got = run(compiled, x)
    graphmend.unmend()
    torch._dynamo.reset()
    _same_behaviour(got, expected)  # the refused graph ran as captured: same output bits and effects
    assert picky.refused >= 1
    notices = [w[1] for w in got.warnings if w[0] == "BackendFallbackWarning"]
    assert len(notices) == picky.refused
    assert "graphmend: the _Picky backend failed on the graph of forward (demo.py:" in notices[0]
    assert "(RuntimeError: picky: graph too big); that graph runs as captured, without the backend" in notices[0]
    # what the backend warned is shown, as torch.compile shows it, failed attempts included
    looked = [w[1] for w in got.warnings if w[1].startswith("picky:")]
    assert len(looked) == picky.compiled + picky.refused


def test_dynamo_control_flow_from_the_backend_passes_through():
    def fn(x):
        return x.sum(0)

    def raises_index_error(gm, example_inputs):
        raise IndexError("dimension out of range (from the backend)")

    raised = []
    for backend in (raises_index_error, graphmend.with_fallback(raises_index_error)):
        with pytest.raises(Exception) as caught:
            torch.compile(fn, backend=backend)(torch.ones(2, 3))
        raised.append((type(caught.value), str(caught.value)))
        torch._dynamo.reset()
    assert raised[1] == raised[0]  # what torch.compile alone raises, not run as captured
    if torch_version_tuple(torch.__version__) == (2, 12):  # torch 2.12 wraps it
        assert raised[0][0] is torch._dynamo.exc.BackendCompilerFailed
        assert "IndexError: dimension out of range (from the backend)" in raised[0][1]
    else:  # from 2.13 Dynamo lets the backend's IndexError through
        assert raised[0][0] is IndexError and raised[0][1].startswith("dimension out of range (from the backend)")


def test_the_backend_gets_the_mode_and_options_torch_compile_would_give_it():
    from graphmend.rewrite.fallback import FallbackBackend

    seen = []

    def custom(gm, example_inputs, **kwargs):
        seen.append(kwargs)
        return gm.forward

    torch.compile(lambda x: x * 2, backend=graphmend.with_fallback(custom), options={"answer": 42})(torch.ones(2))
    torch._dynamo.reset()
    assert seen == [{"options": {"answer": 42}}]
    inductor = FallbackBackend("inductor")._compiler({"options": {"emulate_precision_casts": True}})
    assert type(inductor) is torch._TorchCompileInductorWrapper
    assert inductor.config["emulate_precision_casts"] is True
    # graphmend.compile: Inductor configured by mode / options exactly as torch.compile configures it
    for kwargs in ({}, {"mode": "max-autotune-no-cudagraphs"}, {"options": {"emulate_precision_casts": True}}):
        ours = graphmend.compile(torch.nn.Linear(2, 2), **kwargs).get_compiler_config()
        assert ours == torch.compile(torch.nn.Linear(2, 2), **kwargs).get_compiler_config()
        assert ours["max_autotune"] is ("mode" in kwargs)
        assert ours["emulate_precision_casts"] is ("options" in kwargs)
    with pytest.raises(RuntimeError, match="Either mode or options"):  # torch.compile's own refusal
        graphmend.compile(torch.nn.Linear(2, 2), mode="max-autotune", options={"emulate_precision_casts": True})
