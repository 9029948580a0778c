"""[Speculate]: a guessed host value, checked when the call ends; a wrong
guess runs the call again, and nothing of the discarded run is seen; its
golden table (a source -> the exact rewrite, or the exact reason it declines)."""

import contextlib
import copy

import golden
import pytest
import torch
from effects_capture import run
from fixtures.speculate_models import (
    Widen,
    WidenAndCount,
    WidenThenWarnOnAPath,
    WidenWithNoise,
    WidenWithPythonNoise,
)

import graphmend

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


def test_a_call_that_changes_state_is_not_speculated_and_the_report_says_why():
    from rich.console import Console

    from graphmend.tools.render import render_mend

    report = graphmend.mend(WidenAndCount().eval(), NARROW)
    [ti] = [o for o in report.outcomes if o.category == "TI"]
    why = "[speculate] running the call again could be seen: `self.calls = ...` (line 41)"
    assert (ti.rule, ti.status, ti.notes) == ("scalar", "declined", [why])
    console = Console(record=True, width=1000)  # one line per row
    render_mend(report, console)
    assert f"{ti.reason}; {why}" in console.export_text()  # the text report shows both rules' words


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


@pytest.mark.parametrize("origin, stops", [("torch", False), ("model", True)])
def test_a_log_line_written_to_stderr_stops_a_guessing_run_only_when_it_is_the_models(origin, stops):
    """From torch 2.14 torch's console handler writes to the current ``sys.stderr``
    (compat: logs_to_current_stderr), so torch's own warnings ("hit
    recompile_limit") pass through the stream watch. Written from a log record
    made in torch's files, a line is torch's and the guess goes on; made in
    the model's, it is an effect not deferred, and the run stops before it.
    (The handler here follows sys.stderr on every release.)"""
    import logging
    import sys

    from graphmend.runtime import Mispredicted, region

    class FollowsStderr(logging.Handler):
        def emit(self, record):
            sys.stderr.write(self.format(record) + "\n")

    logger = logging.getLogger("graphmend-speculate-probe")
    logger.propagate, handler = False, FollowsStderr()
    logger.addHandler(handler)
    pathname = torch._dynamo.convert_frame.__file__ if origin == "torch" else __file__
    record = logging.makeLogRecord({"name": logger.name, "levelno": logging.WARNING, "levelname": "WARNING",
                                    "pathname": pathname, "msg": "hit config.recompile_limit"})
    try:
        with pytest.raises(Mispredicted) if stops else contextlib.nullcontext():
            with region(speculating=True):
                logger.handle(record)
    finally:
        logger.removeHandler(handler)
    assert graphmend.runtime.RERUNS["effect"] == (1 if stops else 0)


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


def test_pythons_random_numbers_are_drawn_once_per_call_seen_too():
    """Found reading [Speculate]'s scan (it accepts ``random.random()``): a run
    discarded after a wrong guess drew from Python's generator too, and only
    torch's was put back before the run again."""
    import random

    model = WidenWithPythonNoise().eval()
    reference = copy.deepcopy(model)
    compiled, _ = _compile(model, NARROW)
    report = compiled.report
    assert [(o.rule, o.status) for o in report.outcomes if o.category == "TI"] == [("speculate", "applied")]
    for x in (WIDE, NARROW):  # each a wrong guess at first
        random.seed(7)
        expected = run(reference, x)
        after_eager = random.random()
        random.seed(7)
        got = run(compiled, x)
        assert torch.equal(got.output, expected.output)
        assert random.random() == after_eager  # as many draws as eager's
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


# -- golden table --------------------------------------------------------------
# What [Speculate] makes of small sources (tests/rules/golden.py): the site is
# marked `# <-`; each case expects exactly the function after the rewrite, or
# exactly the reason it declines. Source level only: milliseconds a case.
# The scan reads what the `forward` of the source's `Model` runs (no `Model`: no live model).

GOLDEN = [
    golden.case(
        "flag-that-changes-shapes",
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(4, 4)

            def forward(self, x):
                wide = (x > 2).any().item()  # <-
                h = self.proj(x)
                if wide:
                    h = torch.cat([h, h], dim=-1)
                return h
        """,
        rewritten="""
        def forward(self, x):
            wide = __graphmend_rt__.speculate(('golden_case', 7, 'forward'), (x > 2).any())
            h = self.proj(x)
            if wide:
                h = torch.cat([h, h], dim=-1)
            return h
        """,
    ),
    golden.case(
        "in-place-op-on-a-fresh-tensor",
        """
        class Model(nn.Module):
            def forward(self, x):
                y = x.clone()
                wide = (x > 2).any().item()  # <-
                y.add_(1)
                return y
        """,
        rewritten="""
        def forward(self, x):
            y = x.clone()
            wide = __graphmend_rt__.speculate(('golden_case', 4, 'forward'), (x > 2).any())
            y.add_(1)
            return y
        """,
    ),
    golden.case(
        "training-only-branch-skipped",
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("count", torch.zeros(()))

            def forward(self, x):
                wide = (x > 2).any().item()  # <-
                if self.training:
                    self.count.add_(1)
                return x
        """,
        rewritten="""
        def forward(self, x):
            wide = __graphmend_rt__.speculate(('golden_case', 7, 'forward'), (x > 2).any())
            if self.training:
                self.count.add_(1)
            return x
        """,
    ),
    golden.case(
        "effect-not-deferred-stops-the-run-before-it",
        """
        class Model(nn.Module):
            def forward(self, x):
                wide = (x > 2).any().item()  # <-
                print("wide", wide)
                return x
        """,
        rewritten="""
        def forward(self, x):
            wide = __graphmend_rt__.speculate(('golden_case', 3, 'forward'), (x > 2).any())
            print('wide', wide)
            return x
        """,
    ),
    golden.case(
        "not-an-assignment-of-item",
        """
        class Model(nn.Module):
            def forward(self, x):
                if (x > 2).any().item():  # <-
                    x = x * 2
                return x
        """,
        declined="not `name = <tensor>.item()`",
    ),
    golden.case(
        "tuple-target",
        """
        class Model(nn.Module):
            def forward(self, x):
                n, m = x.sum().item(), 1  # <-
                return x
        """,
        declined="not `name = <tensor>.item()`",
    ),
    golden.case(
        "not-a-module",
        """
        def f(x):
            wide = (x > 2).any().item()  # <-
            return x
        """,
        declined="running the call again could be seen: the target is not a module",
    ),
    golden.case(
        "attribute-store",
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.calls = 0

            def forward(self, x):
                wide = (x > 2).any().item()  # <-
                self.calls += 1
                return x
        """,
        declined="running the call again could be seen: `self.calls = ...` (line 8)",
    ),
    golden.case(
        "in-place-op-on-an-input",
        """
        class Model(nn.Module):
            def forward(self, x):
                wide = (x > 2).any().item()  # <-
                x.add_(1)
                return x
        """,
        declined="running the call again could be seen: `x.add_(...)` (line 4)",
    ),
    golden.case(
        "submodule-changes-state",
        """
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("seen", torch.zeros(()))

            def forward(self, x):
                self.seen.copy_(x.sum())
                return x


        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.block = Block()

            def forward(self, x):
                wide = (x > 2).any().item()  # <-
                return self.block(x)
        """,
        declined="running the call again could be seen: Block.forward: `self.seen.copy_(...)` (line 7)",
    ),
    golden.case(
        "global-statement",
        """
        class Model(nn.Module):
            def forward(self, x):
                global LAST
                wide = (x > 2).any().item()  # <-
                LAST = x
                return x
        """,
        declined="running the call again could be seen: `global LAST` (line 3)",
    ),
    golden.case(
        "call-not-resolved",
        """
        class Model(nn.Module):
            def __getattr__(self, name):
                return torch.relu if name == "hook" else super().__getattr__(name)

            def forward(self, x):
                wide = (x > 2).any().item()  # <-
                return self.hook(x)
        """,
        declined=(
            "running the call again could be seen: calls `self.hook`, which could not be resolved on the live model"
        ),
    ),
    golden.case(
        "a-function-looked-up-in-a-global-table",  # transformers' ALL_MASK_ATTENTION_FUNCTIONS[...]: each value judged
        """
        def plain(x):
            return x * 2

        def scaled(x):
            return x / 2

        TABLE = {"plain": plain, "scaled": scaled}

        class Model(nn.Module):
            kind = "plain"

            def forward(self, x):
                wide = (x > 2).any().item()  # <-
                fn = TABLE[self.kind]
                return fn(x)
        """,
        rewritten="""
        def forward(self, x):
            wide = __graphmend_rt__.speculate(('golden_case', 13, 'forward'), (x > 2).any())
            fn = TABLE[self.kind]
            return fn(x)
        """,
    ),
    golden.case(
        "a-table-value-that-changes-state",
        """
        SEEN = []

        def plain(x):
            return x * 2

        def remembered(x):
            SEEN.append(x)
            return x

        TABLE = {"plain": plain, "remembered": remembered}

        class Model(nn.Module):
            def forward(self, x):
                wide = (x > 2).any().item()  # <-
                fn = TABLE["plain"]
                return fn(x)
        """,
        declined="running the call again could be seen: remembered: `SEEN.append(...)` (line 7)",
    ),
    golden.case(
        "call-of-an-attribute-the-module-lacks",  # the lookup raises AttributeError before any effect
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.n_langs = 1

            def forward(self, x):
                wide = (x > 2).any().item()  # <-
                if self.n_langs > 1:
                    x = self.lang_embeddings(x)
                return x
        """,
        rewritten="""
        def forward(self, x):
            wide = __graphmend_rt__.speculate(('golden_case', 7, 'forward'), (x > 2).any())
            if self.n_langs > 1:
                x = self.lang_embeddings(x)
            return x
        """,
    ),
]


@pytest.mark.parametrize("source, expected", GOLDEN)
def test_golden(source, expected):
    assert golden.outcome("speculate", source) == expected
