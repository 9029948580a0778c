"""The supported torch releases, and each fact graphmend's table keeps of one,
checked against the torch this suite runs on (run it on each release: the
row of the installed torch must be true of it)."""

import ast
import inspect
import io
import logging
import sys
import warnings

import pytest
import torch
from effects_capture import CountingBackend

from graphmend.compat import (
    RELEASES,
    SUPPORTED_TORCH,
    check_environment,
    release,
    torch_version_tuple,
)
from graphmend.discover import sites
from graphmend.discover.trace import graph_break_registry
from graphmend.errors import UnsupportedEnvironment

ROW = release()


@pytest.fixture(autouse=True)
def _reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_range_is_the_table_and_outside_it_is_one_line():
    assert SUPPORTED_TORCH == (min(RELEASES), (max(RELEASES)[0], max(RELEASES)[1] + 1))
    for version in RELEASES:
        check_environment(f"{version[0]}.{version[1]}.1+cu130")  # a build suffix is not the version
    below = (min(RELEASES)[0], min(RELEASES)[1] - 1)
    above = (max(RELEASES)[0], max(RELEASES)[1] + 1)
    for version in (below, above):
        with pytest.raises(UnsupportedEnvironment) as raised:
            check_environment(f"{version[0]}.{version[1]}.0")
        assert "\n" not in str(raised.value) and f"found torch {version[0]}.{version[1]}.0" in str(raised.value)
    assert torch_version_tuple(torch.__version__) in RELEASES


def test_every_graph_break_id_graphmend_reads_names_the_same_type_in_this_torch():
    registry = graph_break_registry()
    assert len(registry) > 400
    assert {gb: registry.get(gb) for gb in sites.GRAPH_BREAK_IDS} == sites.GRAPH_BREAK_IDS
    source = ast.parse(inspect.getsource(sites))
    named = {n.value for n in ast.walk(source) if isinstance(n, ast.Constant) and str(n.value).startswith("GB0")}
    assert named == set(sites.GRAPH_BREAK_IDS)  # no id read that the table does not name


def test_logs_to_current_stderr_is_where_torchs_console_handler_writes():
    """torch 2.14 made its console handler follow ``sys.stderr``: torch's own
    warnings then pass through graphmend's stream watch."""
    logger = logging.getLogger("torch._dynamo")
    handlers = [h for h in logger.handlers + logging.getLogger("torch").handlers if isinstance(h, logging.Handler)]
    assert handlers, "torch's logging sets up a console handler"
    seen = io.StringIO()
    saved, sys.stderr = sys.stderr, seen
    try:
        logging.getLogger("torch._dynamo").warning("graphmend-compat-probe")
    finally:
        sys.stderr = saved
    assert ("graphmend-compat-probe" in seen.getvalue()) == ROW.logs_to_current_stderr


def test_assert_in_graph_is_how_dynamo_treats_torch_assert():
    def f(x):
        torch._assert((x > 0).all(), "positive")
        return x + 1

    backend = CountingBackend()
    torch.compile(f, backend=backend)(torch.ones(3))
    assert (len(backend.graphs) == 1) == ROW.assert_in_graph


def test_a_constant_warning_still_breaks_the_graph_on_every_release():
    """pytorch #186072 (deferring a constant ``warnings.warn``) does not act in
    the default configuration of any supported release: [Defer] is still needed."""

    def f(x):
        x = x + 1
        warnings.warn("graphmend-compat-probe")
        return x * 2

    backend = CountingBackend()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        torch.compile(f, backend=backend)(torch.ones(3))
    assert len(backend.graphs) == 2


def test_reorderable_logging_is_whether_dynamo_takes_a_logger_method():
    logger = logging.getLogger("graphmend-compat-probe")
    logger.addHandler(logging.NullHandler())
    logger.propagate = False

    def f(x):
        x = x + 1
        logger.info("probe")
        return x * 2

    backend = CountingBackend()
    functions = torch._dynamo.config.reorderable_logging_functions
    try:
        torch._dynamo.config.reorderable_logging_functions = set(functions) | {logger.info}
        torch.compile(f, backend=backend)(torch.ones(3))
    except Exception:  # a release that refuses a logger method there
        assert not ROW.reorderable_logging
        return
    finally:
        torch._dynamo.config.reorderable_logging_functions = functions
    assert (len(backend.graphs) == 1) == ROW.reorderable_logging


class _Select(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cond, a, b):
        ctx.save_for_backward(cond)
        return torch.where(cond, a, b)

    @staticmethod
    def backward(ctx, grad):
        (cond,) = ctx.saved_tensors
        return None, torch.where(cond, grad, 0.0), torch.where(cond, 0.0, grad)


def test_duplicate_input_loses_grad_is_whether_dynamo_drops_one_of_a_functions_gradients():
    """One tensor as two inputs of one autograd.Function: eager sums both gradients
    (3); torch 2.12's Dynamo keeps one (found by the 2.12.1 fuzz run)."""

    def f(x, c):
        h = x * 1.0
        return _Select.apply(c, h, h) * 3

    x = torch.ones(4, requires_grad=True)
    torch.compile(f, backend="eager")(x, torch.tensor(True)).sum().backward()
    assert (x.grad.tolist() != [3.0] * 4) == ROW.duplicate_input_loses_grad, x.grad


def test_symbolic_format_crashes_is_whether_dynamo_fails_a_format_spec_on_a_dynamic_float():
    """pytorch #197093: the second call recompiles the resumed frame with the
    `.item()` float dynamic, and `:.3f` on it raises inside Dynamo."""

    def f(h, s):
        if s > 0:
            s.add_(1)
        else:
            torch._assert(torch.isfinite(h).all(), f"max was {h.max().item():.3f}")
        return h, s

    compiled = torch.compile(f, backend="eager")
    compiled(torch.ones(2, 4), torch.tensor(-1.0))
    try:
        compiled(torch.ones(2, 4) * 2, torch.tensor(-1.0))
    except torch._dynamo.exc.InternalTorchDynamoError as exc:
        assert "Unknown format code 'f'" in str(exc) and ROW.symbolic_format_crashes, exc
    else:
        assert not ROW.symbolic_format_crashes


def test_emulated_casts_miss_overflow_is_whether_inductor_sees_an_fp16_overflow():
    """Found by the 2.12.1 fuzz run: with emulate_precision_casts, torch 2.12's Inductor
    still computes `isinf(t.to(float16))` in fp32 when fused (no inf where eager has one)."""

    def overflows(h):
        return torch.isinf((h * 3000.0).to(torch.float16)).any()

    x = torch.tensor([7488.8535, -15507.9365])
    assert overflows(x)
    compiled = torch.compile(overflows, backend="inductor", options={"emulate_precision_casts": True})
    assert (not compiled(x)) == ROW.emulated_casts_miss_overflow


class _StoreThenCond(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, h):
        self.last = h
        h = torch.cond(h.mean() > 0, lambda h: self.lin(h), lambda h: h.clone(), (h,))
        self.calls = self.calls + 1
        return h


def test_cond_drops_later_stores_is_whether_a_store_after_a_cond_is_lost():
    """Hand-written torch.cond, plain torch.compile: with an attribute store before
    the cond in the frame, torch 2.13 and 2.14 lose the one after it (calls stays 0)."""
    model = _StoreThenCond()
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        for sign in (1.0, -1.0):
            compiled(torch.ones(2, 4) * sign)
    assert torch.equal(model.last, -torch.ones(2, 4))
    assert (model.calls != 2) == ROW.cond_drops_later_stores, model.calls
