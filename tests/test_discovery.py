"""Discovery and classification: every break found, categorised, and given a verdict."""

import json

import pytest
import torch

import patterns as P
import scalars as S
from conftest import counting_graphs
from graphmend.models import demo
from graphmend.discover.trace import parse_event, trace_breaks
from graphmend.discover.explain import explain

X = P._x()

CASES = [
    # model, category, rule, gb id
    (P.Branch, "DC", "where", "GB0170"),
    (P.Printer, "LC", "defer", "GB0059"),
    (P.Logs, "LC", "defer", "GB0291"),
    (P.Warns, "LC", "defer", "GB0007"),
    (P.Guard, "VG", "trap", "GB0170"),
    (P.AssertGuard, "VG", "trap", "GB0170"),
    (P.Item, "TI", "scalar", "GB0124"),
    (P.Nonzero, "DO", "scalar", "GB0036"),
]


@pytest.mark.parametrize("cls,category,rule,gb_id", CASES, ids=[c[0].__name__ for c in CASES])
def test_each_pattern_is_one_site_with_category_and_verdict(cls, category, rule, gb_id):
    report = explain(cls(), X)
    assert report.graphs == 2 and report.breaks == 1
    assert len(report.sites) == 1
    site = report.sites[0]
    assert (site.category, site.rule, site.gb_id) == (category, rule, gb_id)
    assert site.file == P.__file__ and site.function == "forward"
    assert site.code  # the source line is shown
    if rule is None:
        assert site.verdict.startswith("out of scope:")
    else:
        assert f"[{rule.capitalize()}]" in site.verdict


@pytest.mark.parametrize("cls", [c[0] for c in CASES] + [P.Clean, P.Looped])
def test_graph_count_matches_a_plain_counting_backend(cls):
    assert explain(cls(), X).graphs == counting_graphs(cls(), (X,))


def test_clean_model_has_no_sites():
    report = explain(P.Clean(), X)
    assert (report.graphs, report.breaks, report.sites, report.warnings) == (1, 0, [], [])


def test_plain_function_target():
    report = explain(P.plain_function, X)
    assert report.graphs == 2
    assert [s.category for s in report.sites] == ["DC"]
    assert report.sites[0].function == "plain_function"


def test_zero_graphs_is_flagged_not_called_fixed():
    report = explain(P.OnlyBreak(), X)
    assert report.graphs == 0 and report.gave_up
    assert report.to_dict()["gave_up"] is True
    assert any("gave up" in w for w in report.warnings)
    assert [s.category for s in report.sites] == ["LC"]


def test_ops_captured_and_eager_fallbacks_are_torchs_counts():
    """``calls_captured`` is Dynamo's count of the ops in its graphs; a frame
    it runs eagerly is a fallback to eager (torch's benchmarks' two measures)."""
    branch = explain(P.Branch(), X)
    assert branch.calls_captured == sum(branch.ops_per_graph) > 0 and branch.fallbacks_to_eager == 0
    looped = explain(P.Looped(), X)
    assert looped.fallbacks_to_eager == looped.frames_skipped >= 1


def test_break_in_loop_reports_skipped_entry_frame():
    report = explain(P.Looped(), X)
    assert report.frames_skipped >= 1
    assert any("entry frame" in w for w in report.warnings)
    (site,) = report.sites
    assert site.category == "DC" and site.line == P.Block.forward.__code__.co_firstlineno + 1


def test_logger_break_inside_logging_maps_to_user_line():
    # A logger call with a tensor argument makes Dynamo break inside logging
    # too; every event lands on the user's line.
    report = explain(P.Logs(), X)
    (site,) = report.sites
    assert "logger.info" in site.code
    assert site.events >= 1


def test_demo_shows_every_category_it_was_built_for():
    model, args, kwargs = demo.build()
    report = explain(model, *args, **kwargs)
    by_cat = {}
    for s in report.sites:
        by_cat.setdefault(s.category, []).append(s)
    assert sorted(by_cat) == ["DC", "LC", "TI", "VG"]
    codes = " ".join(s.code for s in by_cat["LC"])
    assert "print(" in codes and "logger.warning(" in codes and "warnings.warn(" in codes
    assert by_cat["DC"][0].function == "forward" and "amax" in by_cat["DC"][0].code
    assert by_cat["VG"][0].rule == "trap" and by_cat["VG"][0].code.startswith("if (x.abs() > 1e4).any()")
    assert by_cat["TI"][0].rule == "scalar"
    assert report.graphs == counting_graphs(model, args, kwargs)


def test_callee_site_carries_the_frame_chain():
    model, args, kwargs = demo.build()
    report = explain(model, *args, **kwargs)
    (dc,) = [s for s in report.sites if s.category == "DC"]
    functions = [f.function for f in dc.frames]
    assert functions[-1] == "forward" and len(functions) >= 2


def test_json_schema_fields():
    report = explain(P.Branch(), X)
    data = json.loads(json.dumps(report.to_dict()))
    for key in ("schema", "target", "torch", "graphs", "breaks", "graphs_per_call", "ops_per_graph",
                "recompiles", "break_events", "frames_skipped", "fallbacks_to_eager", "calls_captured", "gave_up",
                "seconds", "categories", "warnings", "sites"):
        assert key in data
    site = data["sites"][0]
    for key in ("file", "path", "line", "function", "code", "category", "reason", "gb_id", "rule",
                "verdict", "declined", "events", "frames"):
        assert key in site
    assert data["categories"] == {"DC": 1}
    assert isinstance(data["ops_per_graph"], list) and len(data["ops_per_graph"]) == data["graphs"]


def test_recompiles_counted_over_calls():
    # Different shapes on the second call force a recompile with dynamic=False.
    inputs = [((torch.ones(2, 4),), {}), ((torch.ones(3, 4),), {})]
    trace = trace_breaks(P.Clean(), inputs=inputs)
    assert trace.graphs_per_call == [1, 1]
    assert trace.recompiles == 1


class _PrintLayer(torch.nn.Module):
    def __init__(self, width_in, width_out):
        super().__init__()
        self.lin = torch.nn.Linear(width_in, width_out)

    def forward(self, h):
        h = self.lin(h)
        print("width", h.shape[-1])
        return h.relu()


class _Widening(torch.nn.Module):
    """Each layer's frame, resumed after its print, meets a new width."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_PrintLayer(a, b) for a, b in ((4, 8), (8, 16), (16, 32), (32, 64)))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_explain_says_when_its_static_count_may_differ_from_torch_compiles_default():
    """Counted with dynamic=False (as mend counts), each new width is a new graph and
    explain says torch.compile's default may compile fewer; `--dynamic auto` counts
    as torch.compile() does, here 2 graphs fewer."""
    from graphmend.discover.explain import explain_target
    from graphmend.models.targets import target_from_objects

    static, auto = (
        explain_target(target_from_objects(_Widening(), (torch.ones(2, 4),), {}), dynamic=d) for d in (False, None)
    )
    assert (static.graphs, auto.graphs) == (8, 6), (static.graphs, auto.graphs)
    assert (static.to_dict()["dynamic"], auto.to_dict()["dynamic"]) == ("static", "auto")
    assert any("counted with dynamic=False" in w and "--dynamic auto" in w for w in static.warnings), static.warnings
    assert not any("dynamic=False" in w for w in auto.warnings), auto.warnings


def test_duplicate_suppression_does_not_hide_frames_across_runs():
    # Dynamo suppresses the traceback of a break it already logged; discovery
    # turns that off, so a second run sees the same frame chain.
    first = explain(P.Branch(), X).sites[0]
    second = explain(P.Branch(), X).sites[0]
    assert first.frames == second.frames and first.frames


def test_parse_event_reads_duplicate_form():
    msg = (
        "Graph break (user stack suppressed due to duplicate graph break) in user code at /a/b.py:12\n"
        "Graph Break Reason: Data-dependent branching\n"
        " For more details about this graph break, please visit: "
        "https://meta-pytorch.github.io/compile-graph-break-site/gb/gb0170.html"
    )
    event = parse_event(msg, "1/0", None)
    assert (event.file, event.line, event.gb_id, event.gb_type) == (
        "/a/b.py", 12, "GB0170", "Data-dependent branching")
    assert event.frames == ()


def test_discovery_restores_dynamo_logging_state():
    from torch._dynamo import symbolic_convert, utils

    log = symbolic_convert.graph_break_log
    before = (log.level, log.propagate, list(log.handlers), "add" in vars(utils.graph_break_dup_warning_checker))
    explain(P.Branch(), X)
    after = (log.level, log.propagate, list(log.handlers), "add" in vars(utils.graph_break_dup_warning_checker))
    assert before == after


def test_explain_offers_each_site_to_its_rule_and_says_what_mend_says():
    """`graphmend.explain` counts a site fixable only where its rule accepts it
    (issue 25: explain said "fixable" for sites mend then declined); the rule's
    reason is mend's, word for word; nothing stays rewritten."""
    import graphmend

    model, x = S.MoELeaks(), S.moe_inputs()
    codes = {name: fn.__code__ for name, fn in vars(S.MoELeaks).items() if callable(fn) and hasattr(fn, "__code__")}
    explained = graphmend.explain(model, x)
    assert explained.fixable == [] and len(explained.declined) == 2
    assert {name: fn.__code__ for name, fn in vars(S.MoELeaks).items() if name in codes} == codes  # undone
    assert explained.to_dict()["sites"][0]["declined"] == explained.sites[0].declined
    report = graphmend.mend(model, x)
    try:
        mended = {(o.line, o.reason) for o in report.outcomes if o.status == "declined"}
        assert mended == {(s.line, s.declined) for s in explained.declined}
        assert any("the loop's names y are read outside it" in reason for _, reason in mended)
    finally:
        graphmend.unmend()
    demo_model, args, kwargs = demo.build()
    accepted = graphmend.explain(demo_model, *args, **kwargs)
    assert accepted.declined == [] and len(accepted.fixable) == len(accepted.sites) == 6
