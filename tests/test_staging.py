"""The mend's last trace is the compile's (issue 58, rewrite/fallback.py's
staged graphs): ``graphmend.compile``'s first call finds the graphs of the
code as finally installed in Dynamo's cache, and the backend compiles each
on its first run, in the context it was traced in."""

import copy
import warnings

import pytest
import torch

import graphmend
from graphmend.rewrite.fallback import BackendFallbackWarning, FallbackBackend

from effects_capture import CountingBackend, bits_equal


@pytest.fixture(autouse=True)
def _restore():
    yield
    graphmend.unmend()
    torch._dynamo.reset()


class Printed(torch.nn.Module):
    """Two prints ([Defer]) and a tensor branch ([Where]): 4 graphs, 1 mended."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        print("h", h.sum())
        if h.sum() > 0:
            h = h * 2
        else:
            h = h - 1
        print("h again", h.mean())
        return self.b(h).tanh()


class Scalar(torch.nn.Module):
    """A count read with .item(): a capture setting removes the break, and its graph
    holds a symbol (an unbacked size), which is compiled in Dynamo's trace instead."""

    def forward(self, x):
        n = int((x > 0).sum().item())
        return x[:n].sum() * 2


def _frames():
    from torch._dynamo.utils import counters

    return counters["frames"].get("total", 0)


def _run(compiled, x, grad):
    with torch.enable_grad() if grad else torch.no_grad():
        return compiled(x.clone())


@pytest.mark.parametrize("grad", [False, True])
def test_the_first_call_compiles_the_mends_last_trace_and_traces_nothing(grad, capsys):
    model, eager_model = Printed(), Printed()
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend)
    x = torch.randn(2, 4)
    before = _frames()
    first = _run(compiled, x, grad)
    report = compiled.report
    assert report.before.graphs == 4 and report.after.graphs == 1 and report.verified
    assert report.staged and report.traces == 2  # discovery and one round: the round's trace is the compile's
    assert len(backend.graphs) == 1  # the backend compiled the staged graph, once
    frames_in_first_call = _frames() - before
    expected = _run(eager_model, x, grad)
    assert bits_equal(first, expected)
    later = _frames()
    second = _run(compiled, x, grad)
    assert bits_equal(second, expected) and _frames() == later and len(backend.graphs) == 1  # cached, no recompile
    # Mending's traces are all the frames Dynamo converted in the first call.
    assert frames_in_first_call == report.frames_traced


def test_a_staged_graph_under_aot_autograd_trains_as_eager():
    model, eager_model = Printed(), Printed()
    compiled = graphmend.compile(model, backend="aot_eager")
    x = torch.randn(2, 4)
    with torch.enable_grad():
        out = compiled(x)
        out.sum().backward()
        expected = eager_model(x)
        expected.sum().backward()
    assert compiled.report.staged
    assert bits_equal(out.detach(), expected.detach())
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert bits_equal(p.grad, q.grad)


def test_printed_text_of_a_staged_first_call_is_eagers(capsys):
    model, eager_model = Printed(), Printed()
    compiled = graphmend.compile(model, backend="aot_eager")
    x = torch.randn(2, 4)
    with torch.no_grad():
        compiled(x)
        got = capsys.readouterr().out
        eager_model(x)
        expected = capsys.readouterr().out
    assert got == expected and expected.count("\n") == 2


def test_a_graph_with_a_symbol_is_compiled_in_dynamos_trace_that_verifies_the_capture_setting():
    """Its compile cannot wait (the backend adds guards on the symbol while Dynamo
    compiles): the run that verifies the kept capture setting compiles it then, runs
    it as captured (verification compares with eager), and the first call uses it."""
    model = Scalar()
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend)
    x = torch.randn(8)
    before = _frames()
    with torch.no_grad():
        out = compiled(x)
    report = compiled.report
    assert report.capture.flags == ("capture_scalar_outputs",) and report.staged
    assert bits_equal(out, Scalar()(x))
    assert len(backend.graphs) == report.after.graphs == 1
    assert _frames() - before == report.frames_traced  # the first call traced nothing of its own


def test_a_backend_that_fails_on_a_staged_graph_runs_it_as_captured():
    def failing(gm, example_inputs):
        raise RuntimeError("no such kernel")

    model, eager_model = Printed(), Printed()
    compiled = graphmend.compile(model, backend=failing)
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = compiled(x)
    assert compiled.report.staged
    assert [w.category for w in caught if issubclass(w.category, BackendFallbackWarning)] == [BackendFallbackWarning]
    with torch.no_grad():
        assert bits_equal(out, eager_model(x))


class NoGradInside(torch.nn.Module):
    """Breaks inside a ``no_grad`` block: Dynamo compiles the graph before the break
    in the grad mode the frame began in, and calls it inside the block."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            s = h.sum() * 2
            print("s", s)
        return h + s


def test_a_staged_graph_is_compiled_in_the_global_state_dynamo_traced_it_in():
    from graphmend.api import mend_model

    def recording(seen):
        def backend(gm, example_inputs):
            seen.append(torch.is_grad_enabled())
            return gm.forward

        return FallbackBackend(backend)

    x = torch.randn(2, 4)
    staged_seen, unstaged_seen = [], []
    staged = recording(staged_seen)
    model = NoGradInside()
    report = mend_model(model, (x,), {}, grad=True, stage=staged)
    assert report.staged and report.verified and staged_seen == []
    with torch.enable_grad(), report.region():  # as graphmend.compile calls it
        out = torch.compile(model, backend=staged)(x)  # the staged graphs, compiled on their first run
    torch._dynamo.reset()
    with torch.enable_grad(), report.region():  # the same mended code, traced and compiled by Dynamo itself
        expected = torch.compile(NoGradInside(), backend=recording(unstaged_seen))(x)
    assert staged_seen == unstaged_seen and len(staged_seen) == report.after.graphs
    assert bits_equal(out.detach(), expected.detach())


def test_options_that_shape_the_trace_turn_staging_off():
    from graphmend.api import _stage_of
    from graphmend.rewrite.fallback import compile_kwargs

    assert _stage_of(compile_kwargs({"backend": "eager"})) is not None
    assert _stage_of(compile_kwargs({"backend": "eager", "dynamic": False})) is not None
    assert _stage_of(compile_kwargs({"backend": "eager", "dynamic": True})) is None
    assert _stage_of(compile_kwargs({"backend": "eager", "fullgraph": True})) is None
    assert _stage_of(compile_kwargs({"backend": "eager", "options": {"guard_filter_fn": lambda g: g}})) is None


class Unfixable(torch.nn.Module):
    """One break no rule addresses: nothing is rewritten."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return h.tanh()


def test_with_nothing_rewritten_discoverys_trace_is_the_compiles():
    model = Unfixable()
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend)
    x = torch.randn(2, 4)
    before = _frames()
    with torch.no_grad():
        out = compiled(x)
    report = compiled.report
    assert not report.applied and report.before.graphs == report.after.graphs == 2
    assert report.staged and report.traces == 1 and _frames() - before == report.frames_traced
    assert len(backend.graphs) == 2
    with torch.no_grad():
        assert bits_equal(out, Unfixable()(x))


class Tied(torch.nn.Module):
    """An embedding and an output layer sharing one weight (Dynamo passes the
    tensor twice; AOTAutograd compiles it once and guards that both stay one)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(10, 4)
        self.out = torch.nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        print("h", h.sum())
        return self.out(h.tanh())


def test_tied_weights_staged_under_aot_autograd_and_untied_later_match_eager():
    """Dynamo passes the tied weight once and guards it: untied, the frame is traced again."""
    model, eager_model = Tied(), Tied()
    compiled = graphmend.compile(model, backend="aot_eager")
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert bits_equal(compiled(ids), eager_model(ids)) and compiled.report.staged
        for m in (model, eager_model):  # untied: the guard AOTAutograd added would fail; the graph checks itself
            m.out.weight = torch.nn.Parameter(m.embed.weight.detach() * 2)
        assert bits_equal(compiled(ids), eager_model(ids))



class ViewAndBase(torch.nn.Module):
    """Takes a tensor and a view of it, and updates the tensor in place."""

    def forward(self, y, v):
        y.add_(1)
        print("y", y.sum())
        return v * 2


def test_inputs_sharing_storage_are_not_staged_and_run_as_eager():
    """AOTAutograd compiles them through a synthetic base of the inputs it saw, and guards
    their aliasing: a compile that waits would miss both (Inductor then read the view as
    the base: an IndexError in its code)."""
    from graphmend.rewrite.fallback import _stageable

    y = torch.ones(2, 4)
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode=None)):
        torch._guards.TracingContext.get().global_context.global_state = {}
        assert _stageable([y, y.clone()]) and not _stageable([y, y[0]]) and not _stageable([y, y])
    model, eager_model = ViewAndBase(), ViewAndBase()
    compiled = graphmend.compile(model, backend="aot_eager")
    a, b = torch.ones(2, 4), torch.ones(2, 4)
    with torch.no_grad():
        assert bits_equal(compiled(a, a[0]), eager_model(b, b[0])) and bits_equal(a, b)


def test_a_staged_discovery_trace_that_fails_leaves_the_mend_unstaged_as_before(monkeypatch, capsys):
    """torch 2.14 and 2.15 fail tracing some programs under automatic dynamic shapes
    (a symbolic float formatted, pytorch #197093) that a counting trace with
    ``dynamic=False`` traces: the mend goes on through counting traces, unstaged,
    and the first call compiles the mended code as without graphmend."""
    from graphmend.discover import explain
    from graphmend.rewrite import session

    real = explain.trace_breaks
    staged = []

    def failing_when_staged(*args, stage=None, **kwargs):
        staged.append(stage is not None)
        if stage is not None:
            raise torch._dynamo.exc.InternalTorchDynamoError("ValueError: Unknown format code 'f'")
        return real(*args, **kwargs)

    def recording(*args, stage=None, **kwargs):
        staged.append(stage is not None)
        return real(*args, stage=stage, **kwargs)

    monkeypatch.setattr(explain, "trace_breaks", failing_when_staged)
    monkeypatch.setattr(session, "trace_breaks", recording)
    model, eager_model = Printed(), Printed()
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend)
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = compiled(x)
        expected = eager_model(x)
    report = compiled.report
    assert staged == [True, False, False]  # discovery tried staged, then counted; the round's trace counted
    assert report.before.graphs == 4 and report.after.graphs == 1 and report.verified and not report.staged
    assert bits_equal(out, expected) and len(backend.graphs) == 1
    assert capsys.readouterr().out.count("\n") == 4  # the user's two prints in each run, none of mending's
