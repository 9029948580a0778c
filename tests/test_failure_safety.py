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

import graphmend
from graphmend import demo, engine, verify
from graphmend.rules import load_rules

from effects_capture import CountingBackend, run

mend_module = importlib.import_module("graphmend.mend")  # graphmend.mend is also the API function


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


WHOLE_STAGES = {
    "discovery": (mend_module, "explain_target"),
    "baseline observation": (mend_module, "observe"),
    "locate": (engine, "locate"),
    "build": (engine, "build"),
    "install": (engine, "install"),
    "verification compare": (mend_module, "compare"),
}


@pytest.mark.parametrize("stage", sorted(WHOLE_STAGES))
def test_a_fault_in_any_stage_keeps_the_model_working(stage, reference, monkeypatch):
    expected, _ = reference
    module, name = WHOLE_STAGES[stage]
    monkeypatch.setattr(module, name, _fault)
    got, report, fallbacks = _mended_run()
    _same_behaviour(got, expected)
    if report is None:  # mending gave up as a whole: compiled unchanged, and said so
        assert fallbacks and "injected fault" in fallbacks[0]
    else:  # the fault declined sites, which keep their original code
        assert report.applied == []
        assert any("injected fault" in o.reason or "internal" in o.reason for o in report.declined)


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

    monkeypatch.setattr(mend_module, "observe", second_call_fails)
    got, report, fallbacks = _mended_run()
    _same_behaviour(got, expected)
    assert report is None or report.applied == []


def test_an_unsupported_torch_compiles_unchanged_with_a_warning(reference, monkeypatch):
    expected, _ = reference
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    model, (x,), _ = demo.build()
    with pytest.warns(RuntimeWarning, match="graphmend supports torch 2.13.x, found torch 2.11.0.*; compiling the model unchanged"):
        compiled = graphmend.compile(model, backend=CountingBackend())
    got = run(compiled, x)
    torch._dynamo.reset()
    _same_behaviour(got, expected)
