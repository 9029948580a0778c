"""graphmend.compile as servers and training loops use it (issue 21): several
threads, random state, a bad first call, pickling, torch.export, the grad mode
of the calls, logging turned off."""

import contextlib
import copy
import io
import logging
import os
import random
import sys
import threading
import time
import warnings

import pytest
import torch

import graphmend
from graphmend import api, runtime
from graphmend.discover.isolation import captured, random_state_kept

from effects_capture import CountingBackend
from real_use import LOGGER, Blocks, Chatty, Checked, CheckedAndPrinted, Dropped


@pytest.fixture(autouse=True)
def _restore():
    yield
    graphmend.unmend()
    torch._dynamo.reset()


class _ThreadLines:
    """sys.stdout for a test: what each thread wrote, by thread name."""

    def __init__(self):
        self.text: dict[str, str] = {}
        self._lock = threading.Lock()

    def write(self, text):
        with self._lock:
            name = threading.current_thread().name
            self.text[name] = self.text.get(name, "") + text
        return len(text)

    def flush(self):
        pass

    def lines(self, name):
        return self.text.get(name, "").splitlines()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str, str]] = []

    def emit(self, record):
        self.seen.append((record.threadName, record.getMessage()))


@contextlib.contextmanager
def _heard():
    """(stdout by thread, log records with their thread) for the block (pytest sets
    sys.stdout again when a test starts, so a fixture cannot)."""
    lines, records = _ThreadLines(), _Records()
    saved = sys.stdout
    sys.stdout = lines
    LOGGER.addHandler(records)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False
    try:
        yield lines, records
    finally:
        sys.stdout = saved
        LOGGER.removeHandler(records)
        LOGGER.propagate = True


# --------------------------------------------------------------------------
# threads


def test_a_capture_holds_back_only_its_own_threads_output():
    with _heard() as (lines, records):
        _capture_beside_another_thread(lines, records)


def test_a_warning_while_compiling_is_not_taken_for_the_models():
    """Found by the torchvision survey on torch 2.14: torchvision's fake kernel for nms
    warns ("`create_unbacked_symint` is deprecated") while Dynamo traces, so verifying
    a capture setting saw a warning eager never gives and dropped the setting. What is
    warned while this thread compiles is the compiler's; the model's own warning is
    still captured, once per call, as eager gives it."""

    def compiler(gm, example_inputs):
        warnings.warn("from the compiler", FutureWarning)
        return gm.forward

    def f(x):
        x = x + 1
        warnings.warn("from the model")
        return x * 2

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with captured() as effects:
            torch.compile(f, backend=compiler)(torch.ones(2))
            f(torch.ones(2))
    torch._dynamo.reset()
    assert [(w[0], w[1]) for w in effects.warnings] == [("UserWarning", "from the model")] * 2


def _capture_beside_another_thread(lines, records):
    inside, outside = threading.Event(), threading.Event()

    def other():
        inside.wait(10)
        print("other print")
        LOGGER.info("other log")
        outside.set()

    worker = threading.Thread(target=other, name="other")
    worker.start()
    with captured() as effects:
        inside.set()
        outside.wait(10)  # the other thread prints and logs while this one captures
        print("captured print")
        LOGGER.info("captured log")
    worker.join()
    assert lines.lines("other") == ["other print"]
    assert "captured print" not in "".join(lines.text.values())
    assert records.seen == [("other", "other log")]
    assert effects.stdout.getvalue() == "captured print\n"
    assert [r[5] for r in effects.records] == ["captured log"]
    print("after the capture")  # the routing stays, and passes through
    assert lines.lines("MainThread") == ["after the capture"]


def test_calls_from_other_threads_during_the_first_mend_lose_nothing(monkeypatch):
    """4 threads x 50 calls, started while the main thread's first call mends: every print and
    log record exactly once, in its own thread, in call order; outputs as eager."""
    with _heard() as (lines, records):
        _calls_during_the_first_mend(lines, records, monkeypatch)


def _calls_during_the_first_mend(lines, records, monkeypatch):
    torch.manual_seed(0)
    model = Chatty().eval()
    reference = copy.deepcopy(model)
    compiled = graphmend.compile(model, backend=CountingBackend())
    mending, launched, waiting = threading.Event(), threading.Event(), []
    real_mend = api.mend_model

    def mend_while_threads_call(*args, **kwargs):
        mending.set()
        launched.wait(30)  # every worker is about to make its first call
        return real_mend(*args, **kwargs)

    monkeypatch.setattr(api, "mend_model", mend_while_threads_call)
    inputs = {f"w{t}": [torch.full((2, 4), 100.0 * t + j) for j in range(50)] for t in range(4)}
    inputs["MainThread"] = [torch.full((2, 4), -1.0)]
    outputs: dict[str, list] = {name: [] for name in inputs}

    def work(name):
        with torch.no_grad():
            waiting.append(name)
            if len(waiting) == 4:
                launched.set()
            for x in inputs[name]:
                outputs[name].append(compiled(x))

    def start_workers():
        mending.wait(30)
        for name in [n for n in inputs if n != "MainThread"]:
            threading.Thread(target=work, args=(name,), name=name).start()

    starter = threading.Thread(target=start_workers)
    starter.start()
    with torch.no_grad():
        outputs["MainThread"].append(compiled(inputs["MainThread"][0]))
    starter.join()
    for thread in threading.enumerate():
        if thread.name.startswith("w"):
            thread.join()
    assert compiled.report is not None and compiled.report.after.graphs == 1
    for name, xs in inputs.items():
        assert lines.lines(name) == ["x " + str(x.sum()) for x in xs], name
        assert [m for t, m in records.seen if t == name] == ["x " + str(x.sum()) for x in xs], name
    with captured(), torch.no_grad():  # the reference's own prints are not the calls'
        for name, xs in inputs.items():
            assert all(torch.equal(y, reference(x)) for x, y in zip(xs, outputs[name])), name
    assert len(records.seen) == 201


def test_a_call_that_waits_longer_than_the_timeout_runs_the_model_eagerly(monkeypatch):
    with _heard() as (lines, records):
        _call_past_the_timeout(lines, records, monkeypatch)


def _call_past_the_timeout(lines, records, monkeypatch):
    model = Chatty().eval()
    compiled = graphmend.compile(model, backend=CountingBackend(), mend_timeout=0.0)
    release, mending = threading.Event(), threading.Event()
    real_mend = api.mend_model

    def slow_mend(*args, **kwargs):
        mending.set()
        release.wait(30)
        return real_mend(*args, **kwargs)

    monkeypatch.setattr(api, "mend_model", slow_mend)
    first = threading.Thread(target=lambda: compiled(torch.ones(2, 4)), name="first")
    with torch.no_grad():
        first.start()
        mending.wait(30)
        y = compiled(torch.full((2, 4), 2.0))  # the lock is held: no wait, eager
        release.set()
        first.join()
        assert torch.equal(y, model(torch.full((2, 4), 2.0)))
    assert lines.lines("MainThread")[0] == "x tensor(16.)"
    assert records.seen[0] == ("MainThread", "x tensor(16.)")


# --------------------------------------------------------------------------
# random state


def _train(fn, model, x, steps=5):
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs = []
    for _ in range(steps):
        y = fn(x)
        y.sum().backward()
        opt.step()
        opt.zero_grad()
        outs.append(y.detach())
    return outs, torch.rand(3), [p.detach().clone() for p in model.parameters()]


def test_dropout_training_is_bit_identical_to_eager_from_the_same_seed():
    torch.manual_seed(0)
    base = Dropped().train()
    x = torch.randn(4, 8)
    eager = copy.deepcopy(base)
    expected = _train(eager, eager, x)
    model = copy.deepcopy(base)
    compiled = graphmend.compile(model, backend="eager")
    got = _train(compiled, model, x)
    assert compiled.report is not None and compiled.report.grad is True
    assert all(torch.equal(a, b) for a, b in zip(expected[0], got[0]))  # the dropout masks
    assert torch.equal(expected[1], got[1])  # the generator after the steps
    assert all(torch.equal(a, b) for a, b in zip(expected[2], got[2]))


def test_mending_leaves_every_generator_where_it_was():
    model, x = Dropped().train(), torch.randn(4, 8)
    torch.manual_seed(3)
    random.seed(3)
    before = (torch.random.get_rng_state(), random.getstate())
    graphmend.mend(model, x)
    assert torch.equal(torch.random.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    with random_state_kept():
        torch.rand(5)
        random.random()
    assert torch.equal(torch.random.get_rng_state(), before[0]) and random.getstate() == before[1]


# --------------------------------------------------------------------------
# a bad first call


def test_a_first_call_that_raises_raises_as_torch_compile_and_the_next_one_mends():
    bad, good = torch.randn(2, 5), torch.randn(2, 4)
    plain = torch.compile(copy.deepcopy(Checked().eval()), backend=CountingBackend())
    with torch.no_grad(), pytest.raises(Exception) as expected:
        plain(bad)
    compiled = graphmend.compile(Checked().eval(), backend=CountingBackend())
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(type(expected.value)) as got:
            compiled(bad)
        assert str(got.value) == str(expected.value)
        assert compiled.report is None
        compiled(good)
    assert [str(w.message) for w in caught if "graphmend" in str(w.message)] == []
    assert compiled.report.before.graphs > 1 and compiled.report.after.graphs == 1


def test_graphmend_gives_up_once_after_three_first_calls_that_raise():
    compiled = graphmend.compile(Checked().eval(), backend=CountingBackend())
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            with pytest.raises(Exception):
                compiled(torch.randn(2, 5))
        compiled(torch.randn(2, 4))
    said = [str(w.message) for w in caught if "graphmend" in str(w.message)]
    assert len(said) == 1 and "it raised eagerly on each of its first 3 calls" in said[0], said
    assert "mat1 and mat2 shapes cannot be multiplied" in said[0]
    assert compiled.report is None


# --------------------------------------------------------------------------
# pickling


def test_the_compiled_model_pickles_before_and_after_its_first_call():
    x = torch.randn(2, 4)
    model = Checked().eval()
    with torch.no_grad():
        expected = model(x)
        compiled = graphmend.compile(model, backend="eager")
        for call_first in (False, True):
            if call_first:
                compiled(x)
            buf = io.BytesIO()
            torch.save(compiled, buf)
            buf.seek(0)
            loaded = torch.load(buf, weights_only=False)
            assert loaded.report is None
            assert torch.equal(loaded(x), expected)
            assert loaded.report is not None and loaded.report.after.graphs == 1


def test_the_fallback_backend_pickles():
    import pickle

    for name in ("eager", "inductor"):
        backend = graphmend.with_fallback(name)
        assert pickle.loads(pickle.dumps(backend)).__name__ == name


# --------------------------------------------------------------------------
# torch.export


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("in_region", [True, False])
def test_export_keeps_a_trapped_check_as_an_assert(strict, in_region):
    model = Checked().eval()
    x = torch.randn(2, 4)
    report = graphmend.mend(model, x)
    assert ("trap", "applied") in [(o.rule, o.status) for o in report.outcomes]
    with runtime.region() if in_region else _nothing(), torch.no_grad():
        exported = torch.export.export(model, (x,), strict=strict)
    assert torch.equal(exported.module()(x), model(x))
    with pytest.raises(RuntimeError, match="^ValueError: nan input$"):
        exported.module()(torch.full((2, 4), float("nan")))


def test_strict_export_of_a_deferred_print_stops_with_one_error_naming_the_site():
    model = CheckedAndPrinted().eval()
    x = torch.randn(2, 4)
    report = graphmend.mend(model, x)
    assert {("defer", "applied"), ("trap", "applied")} <= {(o.rule, o.status) for o in report.outcomes}
    with torch.no_grad(), pytest.raises(runtime.ExportError) as err:
        torch.export.export(model, (x,), strict=True)
    assert str(err.value).startswith("graphmend: torch.export cannot keep the print at ")
    assert "real_use.py:" in str(err.value)


def test_non_strict_export_of_a_deferred_print_prints_at_trace_time_as_the_original(capsys):
    model = CheckedAndPrinted().eval()
    x = torch.randn(2, 4)
    graphmend.mend(model, x)
    with torch.no_grad():
        exported = torch.export.export(model, (x,), strict=False)
    assert capsys.readouterr().out == "h torch.Size([2, 4])\n"
    assert torch.equal(exported.module()(x), model(x))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --------------------------------------------------------------------------
# the report says what the calls get


def _graphs_of_call(compiled, backend, x, grad):
    before = len(backend.graphs)
    with torch.enable_grad() if grad else torch.no_grad():
        y = compiled(x)
        if grad:
            y.sum().backward()
    return len(backend.graphs) - before


def test_the_report_is_measured_in_the_grad_mode_of_the_calls():
    torch.manual_seed(0)
    model = Blocks().train()
    x = torch.randn(4, 8) + 1
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend)
    graphs = _graphs_of_call(compiled, backend, x, grad=True)
    training = compiled.report
    assert training.grad is True and training.after.graphs == graphs == training.before.graphs > 1
    graphs = _graphs_of_call(compiled, backend, x, grad=False)  # autograd off: [Where] applies
    assert compiled.report.grad is False
    assert compiled.report.after.graphs == graphs == 1 < compiled.report.before.graphs
    _graphs_of_call(compiled, backend, x, grad=True)
    assert compiled.report is training


# --------------------------------------------------------------------------
# logging turned off


def test_discovery_sees_every_break_with_logging_disabled():
    from graphmend.models import demo

    model, args, _ = demo.build()
    seen = graphmend.explain(model, *args)
    logging.disable(logging.CRITICAL)
    try:
        blind = graphmend.explain(model, *args)
        report = graphmend.mend(model, *args)
    finally:
        logging.disable(logging.NOTSET)
    assert blind.graphs == seen.graphs == 7
    assert [(s.line, s.category) for s in blind.sites] == [(s.line, s.category) for s in seen.sites]
    assert len(blind.sites) == 6 and blind.warnings == []
    assert report.after.graphs == 1


def test_another_threads_compile_does_not_take_this_threads_eager_effects():
    """torch.compiler.is_compiling() is process-wide in eager code (torch 2.13): while thread A
    compiled inside its region, an eager deferred print on another thread was recorded into
    A's region and printed when it closed. It prints at once, on its own thread."""
    compiling, go = threading.Event(), threading.Event()

    def slow_backend(gm, example_inputs):
        compiling.set()
        go.wait(30)
        return gm.forward

    def compile_in_a_region():
        with runtime.region():
            torch.compile(lambda x: x + 1, backend=slow_backend)(torch.ones(1))

    with _heard() as (lines, _):
        a = threading.Thread(target=compile_in_a_region, name="A")
        a.start()
        try:
            assert compiling.wait(30)
            runtime.print_(("__main__", 1, "<module>"), ("now",), {})
            assert lines.lines("MainThread") == ["now"] and lines.lines("A") == []
        finally:
            go.set()
            a.join()
        assert lines.lines("A") == []


def test_a_relocated_log_record_leaves_the_logger_as_it_was():
    """Two threads performing records of one logger at once (a region's flush, a mended
    call outside a region): the findCaller graphmend sets on the logger for each was put
    back out of order and stayed, and every later record named graphmend's runtime."""
    a_in, b_in = threading.Event(), threading.Event()
    seen = []

    class Handler(logging.Handler):
        def emit(self, record):
            seen.append((record.getMessage(), os.path.basename(record.pathname), record.lineno, record.funcName))
            if record.getMessage() == "from A":
                a_in.set()
                b_in.wait(1)

    logger = logging.getLogger("graphmend.tests.real_use.relocated")
    logger.addHandler(Handler())
    logger.propagate = False
    site = (__name__, 10, "forward")

    def a():
        runtime.records._call_logger(site, logger, "warning", ("from A",), {})

    def b():
        a_in.wait(10)
        runtime.records._call_logger(site, logger, "warning", ("from B",), {})
        b_in.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "findCaller" not in vars(logger)
    logger.warning("later")
    here = os.path.basename(__file__)
    assert seen[:2] == [("from A", here, 10, "forward"), ("from B", here, 10, "forward")]
    assert seen[2][:2] == ("later", here) and seen[2][3] == "test_a_relocated_log_record_leaves_the_logger_as_it_was"


def test_a_mend_keeps_other_models_calls_out_until_it_ends(monkeypatch):
    """Mending resets Dynamo, which crashes a compiled call running in another thread
    (torch 2.13, no graphmend needed), and rewrites shared functions: graphmend.compile's
    calls of other models wait for a mend to end (they hold the same lock)."""
    torch.manual_seed(0)
    first = graphmend.compile(Chatty().eval(), backend=CountingBackend(), example_inputs=(torch.ones(2, 4),))
    starts, window = [], []
    first._orig_mod.register_forward_pre_hook(lambda module, args: starts.append(time.monotonic()))
    real = api.mend_target

    def slow_mend(*args, **kwargs):
        window.append(time.monotonic())
        time.sleep(1.0)
        try:
            return real(*args, **kwargs)
        finally:
            window.append(time.monotonic())

    monkeypatch.setattr(api, "mend_target", slow_mend)
    stop, serving = threading.Event(), threading.Event()

    def serve():
        with torch.no_grad(), captured():
            while not stop.is_set():
                first(torch.ones(2, 4))
                serving.set()

    server = threading.Thread(target=serve)
    server.start()
    try:
        assert serving.wait(30)
        with torch.no_grad(), captured():
            second = graphmend.compile(Checked().eval(), backend=CountingBackend())
            second(torch.ones(2, 4))
        deadline = time.monotonic() + 30
        while not (window and starts[-1] > window[-1]) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        server.join()
    assert second.report is not None and len(window) == 2
    assert [t for t in starts if window[0] < t < window[1]] == []
    assert any(t < window[0] for t in starts) and any(t > window[1] for t in starts)


def test_a_capture_routes_again_above_someone_elses_wrapper():
    """A wrapper of sys.stdout installed after graphmend's router (a harness's, say), which
    keeps the router as ``_inner``: the next capture puts a router above it, or the
    wrapper would see the capture's writes first."""

    class Proxy:
        def __init__(self, inner):
            self._inner, self.text = inner, ""

        def write(self, text):
            self.text += text
            return self._inner.write(text)

        def flush(self):
            pass

    with _heard() as (lines, _):
        with captured():
            print("first")
        proxy = sys.stdout = Proxy(sys.stdout)
        with captured() as effects:
            print("second")
        print("third")
        sys.stdout = lines
    assert effects.stdout.getvalue() == "second\n"
    assert proxy.text == "third\n" and lines.lines("MainThread") == ["third"]


def test_a_thread_that_called_a_compiled_model_ends_with_no_dynamo_traceback_to_free(capsys):
    """Dynamo keeps a traceback of each metric it set in the thread's metrics context
    (torch never clears them), freed when the thread ends; two threads freeing them
    at once can deadlock in torch (docs/torch-issues.md). The region's end frees them,
    under graphmend's lock. The same compile through plain torch.compile keeps them."""
    from torch._dynamo.utils import get_metrics_context

    def kept_after(call):
        left = []

        def work():
            with torch.no_grad():
                call(torch.randn(2, 4))
            left.append(len(get_metrics_context()._edits))

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        return left

    assert kept_after(torch.compile(Chatty(), backend="eager"))[0] > 0  # what torch does alone
    torch._dynamo.reset()
    assert kept_after(graphmend.compile(Chatty(), backend="eager")) == [0]
    capsys.readouterr()
