"""[Where]: each form on inputs that take each branch, each decline reason,
autograd, and `import torch as th`; the bugs the fuzzer found in it; its
golden table (a source -> the exact rewrite, or the exact reason it declines)."""

import copy
import logging
import warnings

import branches as B
import golden
import pytest
import torch
from conftest import fixture_program
from effects_capture import CountingBackend, bits_equal, run

import graphmend
from graphmend.compat import release

P, N = B.POSITIVE, B.NEGATIVE
LOGGER = logging.getLogger("graphmend.tests.where")


@pytest.fixture(autouse=True)
def _restore():
    yield
    graphmend.unmend()
    torch._dynamo.reset()


def check_form(cls, inputs, graphs=1, **example):
    """Mend on the first input, call compiled on every input; each output must
    equal the original eager output bit for bit, with no extra graph."""
    model = cls()
    reference = copy.deepcopy(model)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=inputs[0])
    report = compiled.report
    assert [o.status for o in report.outcomes if o.category == "DC"] == ["applied"], report.outcomes
    for args in inputs:
        with torch.no_grad():
            expected = reference(*args)
            got = compiled(*args)
        assert bits_equal(expected, got)
    assert len(backend.graphs) == graphs
    return model, report


@pytest.mark.parametrize(
    "cls",
    [B.TwoAssign, B.Returns, B.Update, B.UpdateWithTemp, B.NotGuard, B.AliasedTorch],
    ids=lambda c: c.__name__,
)
def test_form_on_both_branches(cls):
    check_form(cls, [(P,), (N,), (P * 0.1,)])


SMALL = P * 0.05  # sum 0.525: the first elif
VERY_NEGATIVE = N * 2  # mean -3.25: past every elif


@pytest.mark.parametrize("cls", [B.Elif, B.ElifFourWays, B.ElifReturns, B.ElifNoElse], ids=lambda c: c.__name__)
def test_elif_chains_are_nested_selects_on_every_path(cls):
    """Every test evaluated up front, every branch computed, nested torch.where: one
    graph, and the output of each path bit for bit (the inner elif's own site is
    reported as part of the chain's rewrite)."""
    model = cls()
    reference = copy.deepcopy(model)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(P,))
    head, *inner = [o for o in compiled.report.outcomes if o.category == "DC"]
    assert head.status == "applied" and "nested torch.where" in head.reason, compiled.report.outcomes
    assert all(o.status == "applied" and o.reason == f"rewritten with line {head.line} (where)" for o in inner), inner
    for x in (P, SMALL, N, VERY_NEGATIVE):
        with torch.no_grad():
            assert bits_equal(reference(x), compiled(x))
    assert len(backend.graphs) == 1


def test_an_elif_chain_under_grad_is_one_graph_with_eager_gradients():
    model = B.ElifFourWays()
    reference = copy.deepcopy(model)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend)
    for x in (P, SMALL, N, VERY_NEGATIVE):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, got = reference(a), compiled(b)
        expected.sum().backward()
        got.sum().backward()
        assert bits_equal(expected.detach(), got.detach()) and bits_equal(a.grad, b.grad)
    assert compiled.report.grad and len(backend.graphs) == 1


def test_a_name_an_elif_chain_leaves_unchanged_on_two_paths_is_not_selected_against_itself():
    """`y` is the same on the elif and the fall-through paths: the chain selects
    `where(c0, y_then, y)`, not `where(c0, y_then, where(c1, y, y))`. Passing one tensor
    twice to one autograd.Function lost a gradient under torch 2.12's Dynamo (found by
    the 2.12.1 fuzz run): eager's gradients to the bit on every path, on every release."""
    model = B.ElifLeavesOneUnchanged()
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend)
    for x in (P, SMALL, N):  # sums 10.5, 0.525, -10.5: each path
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, got = B.ElifLeavesOneUnchanged()(a), compiled(b)
        expected.sum().backward()
        got.sum().backward()
        assert bits_equal(expected.detach(), got.detach()) and bits_equal(a.grad, b.grad), (x, a.grad, b.grad)
    source = "\n".join(p.source for _, mending in graphmend.api._ACTIVE.values() for p in mending.patches)
    assert "y = __graphmend_rt__.select(_gm_c0, _gm_t0, y)\n" in source, source
    assert source.count("same_meta(_gm_t0, y)") == 1, source
    assert compiled.report.grad and len(backend.graphs) == 1


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_an_early_return_predicates_the_rest_of_the_function(grad):
    """`if x.max() > 2: return x * 0` then more code: both return values computed, one
    selected; one graph, outputs and input gradients as eager's on both paths."""
    model = B.EarlyReturn()
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend)
    for x in (P, N):  # P.max() is 3: the early return; N: the rest
        a, b = x.clone().requires_grad_(grad), x.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            expected, got = B.EarlyReturn()(a), compiled(b)
            if grad:
                expected.sum().backward()
                got.sum().backward()
        assert bits_equal(expected.detach(), got.detach())
        assert not grad or bits_equal(a.grad, b.grad)
    (dc,) = [o for o in compiled.report.outcomes if o.category == "DC"]
    assert dc.status == "applied" and dc.reason.startswith("early return predicated"), dc
    assert len(backend.graphs) == 1


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("cls", [B.ReturnInOneBranch, B.ReturnInElifChain], ids=lambda c: c.__name__)
def test_a_return_in_some_branches_predicates_the_rest_of_the_function_for_the_others(cls, grad):
    """The branches that do not return are followed by the rest of the function (a print
    in it happens only on their path): one graph, outputs, gradients and printed text as
    the original's on inputs taking every path."""
    # Under grad the print's text names autograd (grad_fn=...): deferred all the same, eager's text.
    report = _same_as_original(cls, [(P,), (N,), (P * 0.01,), (N * 0.01,)], grad=grad, graphs=1)
    (dc,) = [o for o in report.outcomes if o.category == "DC"]
    assert dc.status == "applied", dc


NAN = torch.full((2, 4), float("nan"))


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize(
    "cls, inputs",
    [
        (B.EarlyReturns, [(P,), (N,), (P * 0.01,), (NAN,)]),
        (B.ReturnInNestedIf, [(P,), (P * 0.05,), (P * 0.6,), (N,)]),
    ],
    ids=["EarlyReturns", "ReturnInNestedIf"],
)
def test_returns_before_the_end_of_a_path_become_one_return_and_every_path_is_selected(cls, inputs, grad):
    """Early returns in a row, and a return in a nested if: each path computed and one value
    selected; one graph without autograd, and outputs (and input gradients) as the original's
    on inputs taking every path. Under autograd a nested if runs the original branches: as
    many graphs as plain torch.compile of the original."""
    plain = CountingBackend()
    _compiled_results(torch.compile(cls(), backend=plain), inputs, grad)
    assert len(plain.graphs) > 1
    report = _same_as_original(cls, inputs, grad=grad, graphs=len(plain.graphs) if grad else 1)
    assert report.outcomes[0].status == "applied", report.outcomes
    for other in report.outcomes[1:] if not grad else []:  # a site inside the first: its break is gone with it
        assert other.status == "applied" or "another site's mend removed it" in " ".join(other.notes), other


def test_a_trapped_check_with_a_guarded_message_in_the_rest_fires_only_on_its_path():
    """Found by the fuzzer (seed 2401): a check [Trap] rewrote with guards of its message
    (`is_kind`, `nonempty`) in the rest after an early return was not recognised as a
    trapped check, and the early return declined. Now one graph; outputs, and the
    exception's type and message where the rest's check fails, as eager's."""
    bad = N.clone()
    bad[0, 0] = float("nan")
    model = B.CheckWithMessageAfterEarlyReturn()
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(N,))
    assert [o.status for o in compiled.report.outcomes] == ["applied", "applied"], compiled.report.outcomes
    for x in (P, N, bad, P):
        expected, got = run(B.CheckWithMessageAfterEarlyReturn(), x), run(compiled, x)
        assert expected.exception == got.exception and (x is bad) == (got.exception is not None), got.exception
        assert x is bad or bits_equal(expected.output, got.output)
    assert got.exception is None and len(backend.graphs) == 1


def test_an_early_return_inside_a_loop_is_declined():
    model = B.EarlyReturnInLoop()
    report = graphmend.mend(model, N)
    (dc,) = [o for o in report.outcomes if o.category == "DC"]
    assert dc.status == "declined" and dc.reason == (
        "an early return inside a loop or block: the rest of the function is not one straight path"
    ), dc


@pytest.mark.parametrize("cls", [B.BufferCopy, B.LocalUpdates, B.AddUpdates], ids=lambda c: c.__name__)
def test_in_place_updates_in_branches_write_the_selected_value(cls):
    """`self.running.copy_(m)`, `y.mul_(2)`, `y.masked_fill_(...)`, `y.clamp_(...)` as the last
    statement of a branch: `t.copy_(torch.where(c, new, t))`; outputs and buffers as eager's
    on every path, call after call, in one graph."""
    model = cls()
    reference = copy.deepcopy(model)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(P,))
    assert all(o.status == "applied" for o in compiled.report.outcomes), compiled.report.outcomes
    for x in (P, N * 0.5, N, SMALL * 0.1, P):  # LocalUpdates: each of its three paths; BufferCopy: both
        with torch.no_grad():
            assert bits_equal(reference(x), compiled(x))
        assert all(bits_equal(a, b) for a, b in zip(reference.buffers(), model.buffers()))
    assert len(backend.graphs) == 1


def test_a_name_updated_in_place_on_one_path_and_assigned_on_another_is_declined():
    """`s.add_(1)` on one path, `s = x * 2` on the other: copying the select back into `s`
    would change, on the second path, the tensor eager let go (`kept` shares it). Declined
    with the reason; `kept` as eager's on both paths."""
    for x in (P, N):
        expected = B.InPlaceOrRebound()(x)
        compiled = graphmend.compile(B.InPlaceOrRebound(), example_inputs=(x,))
        (dc,) = [o for o in compiled.report.outcomes if o.category == "DC"]
        assert dc.status == "declined" and dc.reason.startswith(
            "torch.where: `s = x * 2`: an assignment to a name a path updates in place"
        ), dc
        with torch.no_grad():
            assert all(bits_equal(a, b) for a, b in zip(expected, compiled(x)))
        graphmend.unmend()


def test_an_in_place_update_before_other_statements_of_its_branch_is_computed_out_of_place():
    """Found by the 5,000-program run (20% of its declines): `y.add_(1)` before other
    statements of its branch. The statements after it read the update through `y`, so it
    is computed out of place into a temporary and copied back at the end; a second
    update of `y` follows the first. One graph, `y` and `z` as eager's on both paths."""
    backend = CountingBackend()
    compiled = graphmend.compile(B.InPlaceNotLast(), backend=backend, example_inputs=(P,))
    (dc,) = [o for o in compiled.report.outcomes if o.category == "DC"]
    assert dc.status == "applied" and "torch.where (y, z; in place)" in dc.reason, dc
    for x in (P, N, P):
        with torch.no_grad():
            assert all(bits_equal(a, b) for a, b in zip(B.InPlaceNotLast()(x), compiled(x)))
    assert len(backend.graphs) == 1


def test_an_in_place_update_before_a_statement_reading_a_view_of_it_is_declined():
    """`v = y[0]` before the if: eagerly `z = v * 2` after `y.add_(1)` reads the updated
    values, which a temporary would not. Declined with the name; outputs as eager's."""
    report = graphmend.mend(B.InPlaceThenAlias(), P)
    (dc,) = [o for o in report.outcomes if o.category == "DC"]
    assert dc.status == "declined" and dc.reason.startswith(
        "torch.where: `y.add_(1)`: an in-place update before other statements of its branch, which read `v`: "
        "it may share `y`'s storage; torch.cond: "
    ), dc
    for x in (P, N):
        with torch.no_grad():
            got = graphmend.compile(B.InPlaceThenAlias(), example_inputs=(x,))(x)
        assert all(bits_equal(a, b) for a, b in zip(B.InPlaceThenAlias()(x), got))
        graphmend.unmend()


def test_a_select_of_a_view_of_a_tensor_updated_after_the_if_is_declined():
    """`v = s.detach()` on one path and `s.add_(5)` after the if: eagerly `v` shows the
    update; a select's or torch.cond's new tensor would not. Declined with the reason."""
    report = graphmend.mend(B.SelectedViewUpdatedAfter(), P)
    (dc,) = [o for o in report.outcomes if o.category == "DC"]
    line = dc.line + 4  # `s.add_(5)`
    assert dc.status == "declined" and dc.reason == (
        f"torch.where: `v` may be `s` or a view of it on a path, and `s` is updated in place after the if (line {line}): "
        "the select makes a new tensor; torch.cond: `v` may be `s` or a view of it on a path, and `s` is updated in "
        f"place after the if (line {line}): torch.cond's output is a new tensor"
    ), dc
    for x in (P, N):
        expected = B.SelectedViewUpdatedAfter()(x)
        with torch.no_grad():
            got = graphmend.compile(B.SelectedViewUpdatedAfter(), example_inputs=(x,))(x)
        assert bits_equal(expected, got)
        graphmend.unmend()


def test_a_static_operand_of_or_stays_a_python_if_around_the_predicated_part():
    """`if flag or x.sum() > 0:` -> `if flag: <the branch> else: <predicated on x.sum() > 0>`:
    one graph per value of the flag (Dynamo specialises on it), none for the tensor test."""
    model = B.PythonOr()
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(P, False))
    (dc,) = [o for o in compiled.report.outcomes if o.category == "DC"]
    assert dc.status == "applied" and "static test `flag` kept as a Python if, its branch as written" in dc.notes, dc
    for flag in (False, True):
        for x in (P, N):
            with torch.no_grad():
                assert bits_equal(B.PythonOr()(x, flag), compiled(x, flag))
    assert len(backend.graphs) == 2


# -- autograd ------------------------------------------------------------------


def _counting(inner: str):
    """A backend that counts the graphs it gets and compiles them with ``inner``."""
    from torch._dynamo.backends.registry import lookup_backend

    compile_with = lookup_backend(inner)

    def backend(gm, example_inputs):
        backend.graphs.append(gm)
        return compile_with(gm, example_inputs)

    backend.graphs = []
    return backend


def _train(model, call, steps=20):
    """SGD with momentum and weight decay: losses, gradients (None kept), final weights, printed text."""
    import contextlib
    import io

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    generator = torch.Generator().manual_seed(0)
    losses, grads, out = [], [], io.StringIO()
    with contextlib.redirect_stdout(out):
        for step in range(steps):
            x = torch.randn(4, 8, generator=generator) * (1 + step % 3)  # every path of every block
            optimizer.zero_grad()
            loss = call(x)
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            optimizer.step()
    return losses, grads, [p.detach().clone() for p in model.parameters()], out.getvalue()


def _same(a, b):
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is None and b is None
    return a == b if isinstance(a, str) else bits_equal(a, b)


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_training_through_graphmend_compile_is_eager_bit_for_bit_in_fewer_graphs(inner):
    """20 SGD steps of four blocks, each with a tensor if/elif/else, a tensor if and a
    print: losses, gradients, final weights and printed text as eager's, bit for bit,
    in as few graphs as inference and fewer than plain torch.compile."""
    torch.manual_seed(0)
    base = B.FourBlocks()
    eager_model = copy.deepcopy(base)
    expected = _train(eager_model, eager_model)

    plain_model, plain = copy.deepcopy(base), _counting(inner)
    assert _same(_train(plain_model, torch.compile(plain_model, backend=plain)), expected)
    torch._dynamo.reset()

    model, backend = copy.deepcopy(base), _counting(inner)
    compiled = graphmend.compile(model, backend=backend)
    got = _train(model, compiled)
    for name, a, b in zip(("losses", "gradients", "weights", "printed text"), got, expected):
        assert _same(a, b), name
    assert compiled.report.grad and compiled.report.verified
    graphmend.unmend()
    torch._dynamo.reset()

    inference = graphmend.compile(copy.deepcopy(base), backend=CountingBackend(), example_inputs=(torch.randn(4, 8),))
    assert len(backend.graphs) == inference.report.after.graphs == 1 < len(plain.graphs)


def test_a_branch_not_taken_with_an_infinite_derivative_leaves_eager_gradients():
    """`x.sqrt()` on a path not taken, at 0 and below: its backward, fed the select's zeros,
    would give 0 * inf = NaN; the branch reads `x` through `grad_gate`, cut from autograd."""
    x = torch.tensor([[0.0, -1.0, 4.0, 9.0], [1.0, 2.0, 0.0, 3.0]])
    model = B.SqrtNotTaken()
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend)
    for value in (x, x.abs() + 1):  # the else branch, then the sqrt branch
        a, b = value.clone().requires_grad_(), value.clone().requires_grad_()
        expected, got = B.SqrtNotTaken()(a), compiled(b)
        expected.backward()
        got.backward()
        assert bits_equal(expected.detach(), got.detach()) and bits_equal(a.grad, b.grad), (a.grad, b.grad)
    assert not torch.isnan(b.grad).any() and len(backend.graphs) == 1
    assert "grad_gate" in model.forward.__code__.co_names


@pytest.mark.parametrize("cls", [B.ModuleCall, B.TwoModules], ids=lambda c: c.__name__)
def test_branches_calling_modules_use_torch_cond(cls):
    torch.manual_seed(0)
    _, report = check_form(cls, [(P,), (N,), (P * 0.5,)])
    (dc,) = [o for o in report.outcomes if o.category == "DC"]
    assert "torch.cond" in dc.reason and "only the taken one runs" in dc.reason


def test_a_tuple_from_a_pure_helper_method_in_a_branch_is_run_by_torch_cond():
    """Found by the 5,000-program run's sample: `h, s = self._helper(h, s)` in a branch was
    declined ("assignment to `(h, s)`"; torch.cond: "not a module"). A method whose
    source is pure now runs under torch.cond, its tuple unpacked into the outputs."""
    _, report = check_form(B.HelperMethod, [(P,), (N,), (P * 0.5,)])
    (dc,) = [o for o in report.outcomes if o.category == "DC"]
    assert "torch.cond (h, s)" in dc.reason
    for x in (P, N):  # under autograd the original branch runs: eager's gradients
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        compiled = graphmend.compile(B.HelperMethod(), backend=CountingBackend())
        expected, got = B.HelperMethod()(a), compiled(b)
        expected.sum().backward()
        got.sum().backward()
        assert bits_equal(expected.detach(), got.detach()) and bits_equal(a.grad, b.grad)
    # The subclass shares the mended forward: `type(self)._helper is HelperMethod._helper`
    # sends it to the original statement (torch.cond would run its print inside a trace).
    shared = run(B.HelperMethodPrints(), P)
    assert shared.exception is None and shared.stdout == "in the helper\n"
    report = graphmend.mend(B.HelperMethodPrints(), P)
    (dc,) = [o for o in report.outcomes if o.category == "DC"]
    assert dc.status == "declined" and "HelperMethodPrints._helper calls `print`, not known to be pure" in dc.reason


@pytest.mark.parametrize("use_bias", [True, False])
def test_a_static_guard_in_an_elif_test_lets_what_follows_run_only_where_it_holds(use_bias):
    """`elif self.bias is not None and h.mean() < -0.5`: the guard was declined ("may guard
    the operands after it"); now `(h.mean() < -0.5) if self.bias is not None else False`,
    decided while tracing. With a bias: one graph, outputs as eager's on every path;
    without, the test is a Python False, so the original runs: as many graphs as plain
    torch.compile, outputs as eager's."""
    inputs = [(P,), (N,), (N * 0.1,)]
    plain = CountingBackend()
    _compiled_results(torch.compile(B.BiasGuardInElif(use_bias), backend=plain), inputs, grad=False)
    backend = CountingBackend()
    compiled = graphmend.compile(B.BiasGuardInElif(use_bias), backend=backend, example_inputs=inputs[0])
    (dc,) = [o for o in compiled.report.outcomes if o.category == "DC"]
    assert dc.status == "applied", dc
    for (x,) in inputs:
        with torch.no_grad():
            assert bits_equal(B.BiasGuardInElif(use_bias)(x), compiled(x))
    assert len(backend.graphs) == (1 if use_bias else len(plain.graphs)) and len(plain.graphs) > 1


def test_an_elif_chain_whose_branches_call_modules_runs_as_nested_torch_cond():
    """Found by the 5,000-program run's sample (26 of its 95 declines): an elif chain whose
    branches call modules (`h = self.lin(h)`) was declined, as torch.where would run every
    module and torch.cond was not tried in a chain. Now nested torch.cond, one per test: one
    graph where plain torch.compile makes more, outputs as eager's on every path; under
    autograd the original branches run, with eager's gradients."""
    inputs = [(P,), (N,), (N * 0.1,)]  # the if, the elif, the else
    plain = CountingBackend()
    _compiled_results(torch.compile(B.ChainCallingModules(), backend=plain), inputs, grad=False)
    assert len(plain.graphs) > 1
    _, report = check_form(B.ChainCallingModules, inputs)
    (dc,) = [o for o in report.outcomes if o.category == "DC"]
    assert dc.reason.startswith("torch.cond (nested, one per test) (h): the branches call modules"), dc
    for (x,) in inputs:
        model = B.ChainCallingModules()
        reference = copy.deepcopy(model)
        compiled = graphmend.compile(model, backend=CountingBackend())
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, got = reference(a), compiled(b)
        expected.sum().backward()
        got.sum().backward()
        assert bits_equal(expected.detach(), got.detach()) and bits_equal(a.grad, b.grad)
        assert all(bits_equal(p.grad, q.grad) if p.grad is not None else q.grad is None
                   for p, q in zip(reference.parameters(), model.parameters()))
        graphmend.unmend()


class _Counts:
    """A plain object the model reaches only through a global."""

    scale = 2.0
    count = 0


COUNTS = _Counts()


class ObjectCountAfterCond(torch.nn.Module):
    """`self.counts`, a plain object, is first met inside the branch (`self.counts.scale`); stored after."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.counts = _Counts()

    def forward(self, x):
        h = x * 1.0
        if h.mean() > 0:
            h = self.lin(h) * self.counts.scale
        self.counts.count += 1
        return h


class CountAfterCond(torch.nn.Module):
    """`self` is first met inside the torch.cond branch (`self.lin`), then an attribute of it is stored."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.count = 0

    def forward(self, x):
        h = x * 1.0
        if h.mean() > 0:
            h = self.lin(h)
        self.count += 1
        return h


class HelperCountAfterCond(CountAfterCond):
    """The store happens in a method called after the cond."""

    def bump(self):
        self.count += 1

    def forward(self, x):
        h = x * 1.0
        if h.mean() > 0:
            h = self.lin(h)
        self.bump()
        return h


class SetterCountAfterCond(CountAfterCond):
    """A method forward never calls stores an attribute: it cannot run before the cond."""

    def set_lin(self, lin):
        self.lin = lin


class GlobalCountAfterCond(torch.nn.Module):
    """A global object first met inside the branch (`COUNTS.scale`), stored after."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = x * 1.0
        if h.mean() > 0:
            h = self.lin(h) * COUNTS.scale
        COUNTS.count += 1
        return h


def _counts(model):
    return (getattr(model, "count", None), getattr(getattr(model, "counts", None), "count", None), COUNTS.count)


@pytest.mark.parametrize(
    "cls", [CountAfterCond, ObjectCountAfterCond, HelperCountAfterCond, SetterCountAfterCond, GlobalCountAfterCond], ids=lambda c: c.__name__
)
def test_attribute_stores_after_torch_cond_are_kept(cls):
    """Found by the fuzzer (seed 10, d95b4b2cf4b0): Dynamo drops a later attribute store to an object
    it first met inside a torch.cond branch; the rewrite shows it the branches' objects first."""
    torch.manual_seed(0)
    model = cls()
    reference = copy.deepcopy(model)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(P,))
    (dc,) = [o for o in compiled.report.outcomes if o.category == "DC"]
    if cls is HelperCountAfterCond and release().cond_drops_later_stores:  # a store in another method may run before the cond
        assert dc.status == "declined" and "`self.count` in HelperCountAfterCond.bump" in dc.reason, dc.reason
    else:
        assert dc.status == "applied" and "torch.cond" in dc.reason
    for x in (P, N, P * 0.5):
        COUNTS.count = 0
        with torch.no_grad():
            expected = reference(x)
            want = _counts(reference)
            COUNTS.count = 0
            got = compiled(x)
        assert bits_equal(expected, got)
        assert _counts(model) == want
    # Dynamo may recompile on the stored int, but every graph is the whole forward, cond included
    if dc.status == "applied":
        assert compiled.report.after.graphs == 1 and all(hasattr(g, "cond_true_0") for g in backend.graphs)


class EffectsAroundCond(torch.nn.Module):
    """Deferred effects before and after a torch.cond form, in one compiled frame."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = x * 1.0
        if h.sum() > 0:
            warnings.warn(f"before {h.mean()}")
        print("ungated", h.sum())
        if h.sum() > 0:
            h = self.lin(h)
        warnings.warn(f"after {h.mean()}")
        LOGGER.warning("logged %s", h.sum())
        print("last", h.max())
        return torch.relu(h)


def test_deferred_effects_before_and_after_a_torch_cond_are_all_performed():
    """Found by the fuzzer (seed 24): a deferred warning after a torch.cond form was never shown
    when the frame deferred an effect before it. torch 2.13 and 2.14 keep the object's attribute
    stores of a frame in a table the cond's tracing replaces, so the runtime's record of the later
    effect (an attribute store on its state) was dropped; torch 2.12 and 2.15 kept it."""
    model = EffectsAroundCond()
    twin = copy.deepcopy(model)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(P,))
    dc = [o for o in compiled.report.outcomes if o.category == "DC"]
    assert [o.status for o in dc] == ["applied", "applied"] and "torch.cond" in dc[1].reason, dc
    for x in (P, N, P * 0.5, N):
        expected, got = run(twin, x), run(compiled, x)
        assert bits_equal(expected.output, got.output)
        assert got.effects() == expected.effects()
        assert expected.warnings[-1][1].startswith("after") and "last" in expected.stdout
    assert compiled.report.after.graphs == 1 and len(backend.graphs) == 1


def test_deferred_effects_around_a_torch_cond_are_each_threads_own():
    """The same model called from three threads at once: each thread sees the prints, log
    records and warnings of its own inputs, all of them, in eager's order."""
    import threading

    from effects_capture import ThreadCapture

    model = EffectsAroundCond()
    inputs = [P, N, P * 0.5]
    expected = [run(copy.deepcopy(model), x) for x in inputs]
    compiled = graphmend.compile(model, backend=CountingBackend(), example_inputs=(P,))
    threads_capture, got, outputs = ThreadCapture(), {}, {}

    def work(k):
        with threads_capture.capturing() as cap, torch.no_grad():
            outputs[k] = [compiled(inputs[k]) for _ in range(5)]
        got[k] = cap

    with threads_capture.installed():
        threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for k, eager in enumerate(expected):
        assert got[k].stdout == eager.stdout * 5 and got[k].stderr == eager.stderr * 5
        assert got[k].records == eager.records * 5
        assert got[k].warnings == eager.warnings * 5
        assert all(bits_equal(out, eager.output) for out in outputs[k])


def test_or_guard_on_finite_inf_and_nan_inputs():
    weird = P.clone()
    weird[0, 0] = float("inf")
    nan = P.clone()
    nan[1, 2] = float("nan")
    _, report = check_form(B.OrGuard, [(P,), (weird,), (nan,)])
    assert any("predicated" in n for o in report.outcomes for n in o.notes)


def _original(cls, inputs, grad=False):
    """What the original code gives on each input (before any mend: a mend rewrites
    the class's functions): (output, input gradient or None, printed text)."""
    out = []
    for args in inputs:
        xs = [a.clone().requires_grad_(grad) if isinstance(a, torch.Tensor) else a for a in args]
        with torch.set_grad_enabled(grad):
            cap = run(cls(), *xs) if not grad else None
            output = cls()(*xs) if grad else cap.output
        gx = torch.autograd.grad(output.sum(), xs[0])[0] if grad else None
        out.append((output, gx, "" if grad else cap.stdout))
    return out


def _same_as_original(cls, inputs, grad=False, graphs=1, example=P):
    """Mend ``cls`` through graphmend.compile; every input as the original, in ``graphs`` graphs."""
    expected = _original(cls, inputs, grad)
    backend = CountingBackend()
    compiled = graphmend.compile(cls(), backend=backend, example_inputs=(example,))
    got = _compiled_results(compiled, inputs, grad)
    for (eo, eg, et), (go, gg, gt) in zip(expected, got):
        assert et == gt
        pairs = zip(eo, go) if isinstance(eo, tuple) else [(eo, go)]
        assert all(bits_equal(e, g) for e, g in pairs)
        assert eg is None or bits_equal(eg, gg)
    assert len(backend.graphs) == graphs
    return compiled.report


def _compiled_results(compiled, inputs, grad):
    out = []
    for args in inputs:
        xs = [a.clone().requires_grad_(grad) if isinstance(a, torch.Tensor) else a for a in args]
        if grad:
            output = compiled(*xs)
            out.append((output, torch.autograd.grad(output.sum(), xs[0])[0], ""))
        else:
            cap = run(compiled, *xs)
            out.append((cap.output, None, cap.stdout))
    return out


MIXED = torch.tensor([[2.0, -1.0, 0.5, 0.2], [0.1, 0.3, -0.2, 0.4]])


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_and_not_over_operands_not_provably_tensors_are_decided_while_tracing(grad):
    """`h` is assigned twice, so nothing proves `h.max() > 1` a tensor: the test
    is lowered to the runtime's tensor_and / tensor_not, which Dynamo resolves to
    torch.logical_and / logical_not. One graph, every path bit for bit, with
    eager's gradients."""
    report = _same_as_original(B.UntypedAndNot, [(P,), (N,), (MIXED,), (P * 0.1,)], grad=grad)
    assert [o.status for o in report.outcomes] == ["applied", "applied"]


def test_a_python_operand_of_and_is_decided_while_tracing():
    """`abs(scale) > 1` is a Python bool: a false one makes the test false, a true
    one drops out, and Dynamo guards on it (a scale of 0.5 after 2.0 recompiles,
    it is not read as true)."""
    inputs = [(P,), (N,), (P, 0.5), (N, 0.5), (P, 2.0), (P, torch.tensor(2.0))]
    report = _same_as_original(B.PythonOperand, inputs, graphs=3)  # recompiles: scale 0.5, a tensor scale
    assert report.before.graphs == 2 and report.after.graphs == 1


NESTED_INPUTS = [
    (P,), (P * 3,), (N,), (P * 0.1,),
    (torch.tensor([[4.0, -2.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]),),
    (torch.tensor([[2.0, -1.5, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5]]),),
]


@pytest.mark.parametrize(
    "cls", [B.NestedIf, B.NestedIfWithPrint, B.PrintOnlyBranch, B.NestedElif, B.NestedOnePathTemp,
            B.NestedPriorValue, B.StaticNestedIf, B.StaticNestedIfNoBias], ids=lambda c: c.__name__
)
def test_nested_ifs_and_effect_only_branches_are_one_graph_on_every_path(cls):
    """A nested if is computed and selected with torch.where inside its branch, a
    print in a branch happens only when the branch would have run: outputs and
    printed text as the original's, on inputs taking every path."""
    report = _same_as_original(cls, NESTED_INPUTS)
    dc = [o for o in report.outcomes if o.category == "DC"]
    assert dc and all(o.status == "applied" for o in dc), report.outcomes


def _check_in_branch_mended(cls, inputs, expected):
    """The [Where] site and the [Trap] check in its branch both applied; each input
    as ``expected``; the graphs compiled so far after each call."""
    backend = CountingBackend()
    compiled = graphmend.compile(cls(), backend=backend, example_inputs=(P,))
    assert [(o.category, o.status) for o in compiled.report.outcomes] == [("DC", "applied"), ("VG", "applied")]
    counts = []
    for x, eager in zip(inputs, expected):
        got = run(compiled, x)
        assert got.exception == eager.exception and got.effects() == eager.effects()
        assert eager.exception is not None or bits_equal(got.output, eager.output)
        counts.append(len(backend.graphs))
    return counts


def test_a_check_in_a_branch_whose_message_reduces_a_branch_value_is_guarded_and_exact():
    """`h.min()` of the branch's `h * 2` is evaluated on every call: an empty `h` (the
    branch not taken) is sent to the original by runtime.nonempty(h), which covers the
    branch's value of as many elements."""
    raising = torch.tensor([[3.0, -1.5, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    inputs = [P, N, raising, torch.empty(0, 4), P]
    expected = [run(B.CheckOfBranchValue(), x) for x in inputs]
    assert expected[2].exception == ("ValueError", "bad values: -3.0")
    counts = _check_in_branch_mended(B.CheckOfBranchValue, inputs, expected)
    assert counts == [1, 1, 1, 3, 3]  # the empty input: the original statements, cut at the `if`


def test_a_check_in_a_branch_whose_message_reads_a_branch_values_shape_is_guarded_and_exact():
    """`str(h.shape[0])` of the branch's `h + 1.0` is evaluated on every call: a 0-dim
    `h` (whose branch may be the other one) goes to the original by runtime.has_dims(h, 1)."""
    nan = N.clone()
    nan[0, 1] = float("nan")
    inputs = [P, N, nan, torch.tensor(2.0), torch.tensor(-2.0), P]
    expected = [run(B.CheckOfBranchShape(), x) for x in inputs]
    assert expected[2].exception == ("AssertionError", "check failed at 2")
    assert expected[3].exception is None  # the other branch: no message formatted
    assert expected[4].exception == ("IndexError", "tuple index out of range")  # its own branch: eager's error
    plain = run(torch.compile(B.CheckOfBranchShape(), backend=CountingBackend()), inputs[4]).exception
    assert plain is not None  # Dynamo's own wording of it, which differs by release (2.12: InternalTorchDynamoError)
    expected[4].exception = plain  # the mended model raises what torch.compile of the original raises
    counts = _check_in_branch_mended(B.CheckOfBranchShape, inputs, expected)
    assert counts[:3] == [1, 1, 1]  # both branches and the failing check: the one graph


def test_a_name_one_branch_assigns_and_no_path_reads_later_is_a_temporary():
    """`lim` of the first guard is assigned again before the second reads it."""
    big = torch.full((2, 4), 30.0)
    report = _same_as_original(B.TwoOverflowGuards, [(big,), (P * 0.001,), (big * 0.1,)], example=big)
    assert [o.status for o in report.outcomes] == ["applied", "applied"], report.outcomes


def test_an_effect_in_a_branch_happens_once_when_the_original_statements_run():
    """Found by the fuzzer (seed 22): a deferred print was recorded before the check
    that sends the call to the original statements, which printed it again. Effects
    now come after every such check."""
    inputs = (P, N, P.double(), N.double())  # float64: the metadata check fails
    reference = B.PrintThenUpdate()
    expected = [(run(reference, x), reference.running.clone()) for x in inputs]  # the original code
    assert expected[2][0].stdout.count("updating") == 1
    model = B.PrintThenUpdate()
    compiled = graphmend.compile(model, backend=CountingBackend(), example_inputs=(P,))
    assert [o.status for o in compiled.report.outcomes if o.category == "DC"] == ["applied"]
    for x, (eager, running) in zip(inputs, expected):
        got = run(compiled, x)
        assert got.stdout == eager.stdout and bits_equal(got.output, eager.output)
        assert bits_equal(model.running, running)


def test_a_value_updated_in_place_after_the_if_is_declined_and_the_callers_tensor_still_changes():
    model = B.UpdatedAfter()
    report = graphmend.mend(model, P.clone())
    (dc,) = report.outcomes
    assert dc.status == "declined"
    assert dc.reason.startswith(f"`h` is updated in place after the if (line {dc.line + 2})"), dc.reason
    x = P.clone()
    with torch.no_grad():
        model(x)
    assert torch.equal(x, P + 1)  # as eager: the input itself was updated


def test_fp16_guard_keeps_static_conjunct_and_is_exact_on_overflow():
    normal = torch.full((2, 4), 3.0, dtype=torch.float16)
    overflow = normal.clone()
    overflow[0, 0] = 20000.0  # x4 overflows to inf
    near = normal.clone()
    near[1, 1] = 16300.0  # x4 = 65200: finite, above max - 1000, must NOT be clamped
    _, report = check_form(B.Fp16Guard, [(overflow,), (normal,), (near,)])
    (dc,) = [o for o in report.outcomes if o.category == "DC"]
    assert any("static test `h.dtype == torch.float16`" in n for n in dc.notes)


def test_fp32_input_of_fp16_guard_has_no_break_to_fix():
    report = graphmend.explain(B.Fp16Guard(), P)
    assert report.graphs == 1 and report.sites == []


def test_condition_traced_through_local_assignment():
    ids_short = torch.arange(4).reshape(1, 4)
    ids_long = torch.arange(4).reshape(1, 4) + 10
    check_form(B.TracedCondition, [(ids_long, P), (ids_short, P), (ids_long, N)])


def test_buffer_updated_in_place_without_recompile():
    model, report = check_form(B.BufferUpdate, [(P,), (N,), (P * 2,)])
    buffer = model.running
    reference = B.BufferUpdate()
    with torch.no_grad():
        for x in (P, N, P * 2):
            reference(x)
    assert bits_equal(model.running, reference.running)
    assert model.running is buffer  # updated in place: same tensor object
    assert "running" in dict(model.named_buffers())


DECLINES = [
    (B.ElifTestCanRaise, "the elif test `x[:, 3].sum() > 0`: indexing can go out of range"),
    (B.Loop, "while loop"),
    (B.PrintInBranch, "`x.mul_(1.0)`: an in-place update of a name a path assigns"),
    (B.CustomModuleCall, "Counter, not a known stateless layer"),
    (B.Indexing, "indexing"),
    (B.OnePathOnly, "assigned on one path only and read after"),
    (B.InPlace, "mutates its receiver"),
    (B.TensorOrFlag, "a static operand after a tensor operand would change evaluation order"),
    (B.NestedOnePathLive, "`lim` is assigned on some paths of a nested if only and read after the if"),
    (B.StaticNestedIfWithAssert, "the static nested if on `self.bias is not None` holds a statement other than an assignment"),
]


@pytest.mark.parametrize("cls,reason", DECLINES, ids=[d[0].__name__ for d in DECLINES])
def test_declines_with_reason_and_keeps_behaviour(cls, reason):
    model = cls()
    with torch.no_grad():
        expected = [model(P), model(N)]
    report = graphmend.mend(model, P)
    dc = [o for o in report.outcomes if o.category == "DC"]
    assert dc and all(o.status == "declined" for o in dc), report.outcomes
    assert any(reason in o.reason for o in dc), [o.reason for o in dc]
    with torch.no_grad():
        assert all(bits_equal(e, model(x)) for e, x in zip(expected, (P, N)))


@pytest.mark.parametrize("x", [P, N], ids=["taken", "not-taken"])
def test_grad_mode_keeps_original_gradients(x):
    torch.manual_seed(0)
    model = B.Grads()
    reference = copy.deepcopy(model)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(x,))
    assert compiled.report.after.graphs == 1  # no_grad: predicated
    loss = compiled(x)
    loss.backward()
    ref_loss = reference(x)
    ref_loss.backward()
    assert bits_equal(loss.detach(), ref_loss.detach())
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name  # None stays None: no zero gradients
        if p.grad is not None:
            assert bits_equal(p.grad, q.grad), name


def test_emitted_code_uses_the_real_torch_under_an_alias():
    import branches_alias

    weird = P.clone()
    weird[0, 1] = float("-inf")
    check_form(branches_alias.AliasedTorch, [(weird,), (P,)])
    names = branches_alias.AliasedTorch.forward.__code__.co_names
    assert branches_alias.torch == "not the torch module"
    assert "__graphmend_rt__" in names and "select" in names  # __graphmend_rt__.select: the runtime's torch


# -- fuzz regressions ----------------------------------------------------------
# Bugs the differential fuzzer (tests/fuzz) found in [Where], as the programs it
# made (tests/fixtures); test_attribute_stores_after_torch_cond_are_kept above
# holds the small models.


def test_attribute_stores_after_a_torch_cond_whose_branch_first_reaches_self_are_kept():
    """Found by the fuzzer (seed 10): a tensor `if` calling `self.lin` became torch.cond; Dynamo met
    `self` first inside the branch and dropped the later `self.count += 1` (count stayed 0 in the
    counting and aot_eager arms). The rewrite now shows Dynamo the branches' objects first."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_cond_attribute_store.py"), seed=4998, start=0, aot=True)
    assert result.status == "checked"
    assert any(rule == "where" and status == "applied" and "torch.cond" in r for _, rule, status, r in result.outcomes)
    assert result.mismatches == [], result.mismatches[:2]


def test_a_torch_cond_after_an_attribute_store_is_declined_where_torch_drops_later_stores():
    """Found by the fuzzer (seed 11): with `self.last = ...` before a torch.cond in the same compiled
    frame, Dynamo (torch 2.13 and 2.14) dropped the `self.calls += 1` after it, however the branches
    reach `self`. [Where] declines torch.cond there when an attribute store may run before it; on
    torch 2.12 and 2.15, which keep the stores, it makes the cond, and every arm matches eager."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_cond_store_before.py"), seed=5, start=1, aot=True)
    assert result.status == "checked"
    sites = [(status, r) for _, rule, status, r in result.outcomes if rule == "where"]
    if release().cond_drops_later_stores:
        assert len(sites) == 2 and all(s == "declined" and "`self.last` may run before it" in r for s, r in sites), sites
    else:
        assert len(sites) == 2 and all(s == "applied" and "torch.cond" in r for s, r in sites), sites
    assert result.mismatches == [], result.mismatches[:2]


def test_an_early_return_whose_rest_stores_an_attribute_in_a_nested_if_stores_it():
    """Found by the fuzzer (seed 22): `if h.max() > 1 and h.min() < 0: return h + s` with
    `self.last = ...` in an `if/elif` after it. The rest was predicated with the nested if
    as a select, and the selected `self.last` was never stored: on an input taking the
    rest, `last` kept its earlier value in every arm. The return form now selects the
    attributes each path stores and stores them: one graph, outputs and the buffer as
    eager's after every call, on every path (early return, store, neither)."""
    model, twin = B.EarlyReturnRestStores(), B.EarlyReturnRestStores()
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(N,))
    (dc, *_) = [o for o in compiled.report.outcomes if o.category == "DC"]
    assert dc.status == "applied" and "the attributes a path stores are selected too" in dc.reason, dc
    for x in (P, N, P * 0.8, P * 0.1, P * 0.9, P * 0.8):
        with torch.no_grad():
            expected, got = twin(x), compiled(x)
        assert bits_equal(expected, got) and bits_equal(twin.last, model.last), (x, twin.last, model.last)
    assert len(backend.graphs) == 1


def test_the_fuzz_program_whose_early_return_lost_a_store_matches_eager():
    """The fuzzer's program for the bug above: no mismatch on any arm."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_early_return_rest_stores.py"), seed=44899, start=7, aot=True)
    assert result.status == "checked"
    assert result.mismatches == [], result.mismatches[:2]



def test_a_torch_cond_branch_with_a_value_shaped_operation_is_declined_before_it_fails():
    """Found by the 5,000-program run (seed 24, program 6327086f9d5a): `k = h[h > 0]` in a
    branch became torch.cond, which Dynamo captures there only with fullgraph=True
    (UncapturedHigherOrderOpError); verification reverted it and, with it, the program's
    legal [Defer] and [Where] rewrites. [Where] now declines the cond form with the reason,
    and the other rewrites stay: fewer graphs, no revert, every arm (grad on, aot_eager) as eager."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_cond_value_shaped.py"), seed=2916, start=1, grad=True, aot=True)
    assert result.status == "checked" and result.mismatches == [], result.mismatches[:2]
    statuses = [(rule, status) for _, rule, status, _ in result.outcomes]
    assert "reverted" not in [s for _, s in statuses] and ("defer", "applied") in statuses, statuses
    assert ("where", "applied") in statuses, statuses
    (cond,) = [r for _, rule, _, r in result.outcomes if "torch.cond: `h[h > 0]`" in r]
    assert "(`h > 0` may be a boolean mask): its shape or value depends on tensor data" in cond
    before, after = result.graphs
    assert after < before, result.graphs


# -- golden table --------------------------------------------------------------
# What [Where] makes of small sources (tests/rules/golden.py): the site is
# marked `# <-`; each case expects exactly the function after the rewrite, or
# exactly the reason it declines. Source level only: milliseconds a case.

GOLDEN = [
    golden.case(
        "a-nested-if-whose-only-name-is-dropped-one-check",
        """
        def f(x):
            if x.sum() > 0:  # <-
                y = x * 2
                if y.mean() > 1:
                    z = y
            else:
                y = x
            return y
        """,
        # The nested if's only check is its test: one condition, not a BoolOp of one
        # (which does not compile: the site was declined as an internal error). The
        # nested mean runs where eager might not: x must be floating (an integer
        # x * 2 would raise in it), which the test's x.sum() > 0 does not prove.
        rewritten="""
        def f(x):
            _gm_c0 = x.sum() > 0
            if __graphmend_rt__.predicable(_gm_c0) and __graphmend_rt__.is_kind(x, 'floating'):
                _gm_t0 = x * 2
                _gm_c1 = _gm_t0.mean() > 1
                _gm_t1 = _gm_t0
                if __graphmend_rt__.predicable(_gm_c1):
                    _gm_f0 = x
                    if __graphmend_rt__.same_meta(_gm_t0, _gm_f0):
                        y = torch.where(_gm_c0, _gm_t0, _gm_f0)
                    elif _gm_c0:
                        y = _gm_t0
                    else:
                        y = _gm_f0
                elif _gm_c0:
                    y = x * 2
                    if y.mean() > 1:
                        z = y
                else:
                    y = x
            elif _gm_c0:
                y = x * 2
                if y.mean() > 1:
                    z = y
            else:
                y = x
            return y
        """,
    ),
    golden.case(
        "if-else-assigns-a-name",
        """
        def f(x):
            if x.sum() > 0:  # <-
                y = x * 2
            else:
                y = x - 1
            return y
        """,
        rewritten="""
        def f(x):
            _gm_c0 = x.sum() > 0
            if __graphmend_rt__.predicable_with_grad(_gm_c0) and __graphmend_rt__.is_kind(x, 'integer', 'floating'):
                _gm_t0 = x * 2
                _gm_f0 = x - 1
                if __graphmend_rt__.same_meta(_gm_t0, _gm_f0):
                    y = __graphmend_rt__.select(_gm_c0, _gm_t0, _gm_f0)
                elif _gm_c0:
                    y = _gm_t0
                else:
                    y = _gm_f0
            elif _gm_c0:
                y = x * 2
            else:
                y = x - 1
            return y
        """,
    ),
    golden.case(
        "if-else-returns",
        """
        def f(x):
            if x.mean() > 0:  # <-
                return x + 1
            else:
                return x - 1
        """,
        rewritten="""
        def f(x):
            _gm_c0 = x.mean() > 0
            if __graphmend_rt__.predicable_with_grad(_gm_c0):
                _gm_t0 = x + 1
                _gm_f0 = x - 1
                if __graphmend_rt__.same_meta(_gm_t0, _gm_f0):
                    return __graphmend_rt__.select(_gm_c0, _gm_t0, _gm_f0)
                else:
                    return _gm_t0 if _gm_c0 else _gm_f0
            elif _gm_c0:
                return x + 1
            else:
                return x - 1
        """,
    ),
    golden.case(
        "update-without-else",
        """
        def f(h):
            if torch.isinf(h).any():  # <-
                h = torch.clamp(h, -100.0, 100.0)
            return h
        """,
        rewritten="""
        def f(h):
            _gm_c0 = torch.isinf(h).any()
            if __graphmend_rt__.predicable_with_grad(_gm_c0) and __graphmend_rt__.is_kind(h, 'bool', 'integer', 'floating'):
                _gm_g0 = __graphmend_rt__.grad_gate(_gm_c0, h)
                _gm_t0 = torch.clamp(_gm_g0, -100.0, 100.0)
                if __graphmend_rt__.same_meta(_gm_t0, h):
                    h = __graphmend_rt__.select(_gm_c0, _gm_t0, h)
                elif _gm_c0:
                    h = _gm_t0
            elif _gm_c0:
                h = torch.clamp(h, -100.0, 100.0)
            return h
        """,
    ),
    golden.case(
        "static-conjunct-stays-a-python-if",
        """
        def f(h):
            if h.dtype == torch.float16 and torch.isinf(h).any():  # <-
                h = torch.clamp(h, -100.0, 100.0)
            return h
        """,
        rewritten="""
        def f(h):
            if h.dtype == torch.float16:
                _gm_c0 = torch.isinf(h).any()
                if __graphmend_rt__.predicable_with_grad(_gm_c0) and __graphmend_rt__.is_kind(h, 'bool', 'integer', 'floating'):
                    _gm_g0 = __graphmend_rt__.grad_gate(_gm_c0, h)
                    _gm_t0 = torch.clamp(_gm_g0, -100.0, 100.0)
                    if __graphmend_rt__.same_meta(_gm_t0, h):
                        h = __graphmend_rt__.select(_gm_c0, _gm_t0, h)
                    elif _gm_c0:
                        h = _gm_t0
                elif _gm_c0:
                    h = torch.clamp(h, -100.0, 100.0)
            return h
        """,
    ),
    golden.case(
        "or-lowered-to-logical-or",
        """
        def f(x: torch.Tensor):
            if x.sum() > 0 or (x > 10).any():  # <-
                x = x * 0.5
            return x
        """,
        rewritten="""
        def f(x: torch.Tensor):
            _gm_c0 = torch.logical_or(x.sum() > 0, (x > 10).any())
            if __graphmend_rt__.predicable_with_grad(_gm_c0):
                _gm_t0 = x * 0.5
                if __graphmend_rt__.same_meta(_gm_t0, x):
                    x = __graphmend_rt__.select(_gm_c0, _gm_t0, x)
                elif _gm_c0:
                    x = _gm_t0
            elif x.sum() > 0 or (x > 10).any():
                x = x * 0.5
            return x
        """,
    ),
    golden.case(
        "not-lowered-to-logical-not",
        """
        def f(h: torch.Tensor):
            if not (h > 0).all():  # <-
                h = h.abs()
            return h * 2
        """,
        rewritten="""
        def f(h: torch.Tensor):
            _gm_c0 = torch.logical_not((h > 0).all())
            if __graphmend_rt__.predicable_with_grad(_gm_c0) and __graphmend_rt__.is_kind(h, 'integer', 'floating'):
                _gm_g0 = __graphmend_rt__.grad_gate(_gm_c0, h)
                _gm_t0 = _gm_g0.abs()
                if __graphmend_rt__.same_meta(_gm_t0, h):
                    h = __graphmend_rt__.select(_gm_c0, _gm_t0, h)
                elif _gm_c0:
                    h = _gm_t0
            elif not (h > 0).all():
                h = h.abs()
            return h * 2
        """,
    ),
    golden.case(
        "buffer-store",
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("running", torch.zeros(4))

            def forward(self, x):
                m = x.mean(0)
                if m.sum() > 0:  # <-
                    self.running = self.running * 0.9 + m * 0.1
                return x - self.running
        """,
        rewritten="""
        def forward(self, x):
            m = x.mean(0)
            _gm_c0 = m.sum() > 0
            if __graphmend_rt__.predicable(_gm_c0) and __graphmend_rt__.broadcastable(m, self.running):
                _gm_t0 = self.running * 0.9 + m * 0.1
                if __graphmend_rt__.same_meta(_gm_t0, self.running):
                    __graphmend_rt__.store(self, 'running', torch.where(_gm_c0, _gm_t0, self.running))
                elif _gm_c0:
                    self.running = _gm_t0
            elif _gm_c0:
                self.running = self.running * 0.9 + m * 0.1
            return x - self.running
        """,
    ),
    golden.case(
        "module-call-in-torch-cond",
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, h):
                if h.mean() > 0:  # <-
                    h = self.lin(h)
                return h
        """,
        rewritten="""
        def forward(self, h):
            _gm_c0 = h.mean() > 0
            if __graphmend_rt__.predicable(_gm_c0):

                def _gm_true_branch0():
                    _gm_t0 = self.lin(h)
                    return (_gm_t0,)

                def _gm_false_branch0():
                    return (h.clone(),)
                __graphmend_rt__.bind(h, self, getattr(self, 'lin', None))
                h, = torch.cond(_gm_c0, _gm_true_branch0, _gm_false_branch0, ())
            elif _gm_c0:
                h = self.lin(h)
            return h
        """,
    ),
    golden.case(
        "not-an-if",
        """
        def f(x):
            y = x.sum() > 0  # <-
            return y
        """,
        declined="the break is not at an if statement",
    ),
    golden.case(
        "elif-chain",
        """
        def f(x):
            if x.sum() > 0:  # <-
                y = x * 2
            elif x.sum() < -1:
                y = x
            else:
                y = x - 1
            return y
        """,
        rewritten="""
        def f(x):
            _gm_c0 = x.sum() > 0
            _gm_c1 = x.sum() < -1
            if __graphmend_rt__.predicable_with_grad(_gm_c0) and __graphmend_rt__.predicable_with_grad(_gm_c1) and __graphmend_rt__.is_kind(x, 'integer', 'floating'):
                _gm_t0 = x * 2
                _gm_e0 = x
                _gm_f0 = x - 1
                if __graphmend_rt__.same_meta(_gm_t0, _gm_e0) and __graphmend_rt__.same_meta(_gm_t0, _gm_f0):
                    y = __graphmend_rt__.select(_gm_c0, _gm_t0, __graphmend_rt__.select(_gm_c1, _gm_e0, _gm_f0))
                elif _gm_c0:
                    y = _gm_t0
                elif _gm_c1:
                    y = _gm_e0
                else:
                    y = _gm_f0
            elif _gm_c0:
                y = x * 2
            elif _gm_c1:
                y = x
            else:
                y = x - 1
            return y
        """,
    ),
    golden.case(
        "elif-test-reducing-a-possibly-empty-tensor",
        """
        def f(x, z):
            if x.sum() > 0:  # <-
                y = x * 2
            elif z.max() > 0:
                y = x
            else:
                y = x - 1
            return y
        """,
        rewritten="""
        def f(x, z):
            _gm_ok0 = __graphmend_rt__.nonempty(z) and __graphmend_rt__.is_kind(z, 'bool', 'integer', 'floating')
            _gm_c0 = x.sum() > 0
            _gm_c1 = z.max() > 0 if _gm_ok0 else None
            if _gm_ok0 and __graphmend_rt__.predicable_with_grad(_gm_c0) and __graphmend_rt__.predicable_with_grad(_gm_c1) and __graphmend_rt__.is_kind(x, 'integer', 'floating'):
                _gm_t0 = x * 2
                _gm_e0 = x
                _gm_f0 = x - 1
                if __graphmend_rt__.same_meta(_gm_t0, _gm_e0) and __graphmend_rt__.same_meta(_gm_t0, _gm_f0):
                    y = __graphmend_rt__.select(_gm_c0, _gm_t0, __graphmend_rt__.select(_gm_c1, _gm_e0, _gm_f0))
                elif _gm_c0:
                    y = _gm_t0
                elif _gm_c1:
                    y = _gm_e0
                else:
                    y = _gm_f0
            elif _gm_c0:
                y = x * 2
            elif z.max() > 0:
                y = x
            else:
                y = x - 1
            return y
        """,
    ),
    golden.case(
        "elif-test-with-a-static-operand-that-may-guard-evaluates-the-rest-only-where-it-lets-it",
        """
        def f(x, flag: bool):
            if x.sum() > 0:  # <-
                y = x * 2
            elif flag and x.mean() > 0:
                y = x
            else:
                y = x - 1
            return y
        """,
        rewritten="""
        def f(x, flag: bool):
            _gm_ok0 = __graphmend_rt__.is_kind(x, 'floating')
            _gm_c0 = x.sum() > 0
            _gm_c1 = (x.mean() > 0 if flag else False) if _gm_ok0 else None
            if _gm_ok0 and __graphmend_rt__.predicable_with_grad(_gm_c0) and __graphmend_rt__.predicable_with_grad(_gm_c1) and __graphmend_rt__.is_kind(x, 'integer', 'floating'):
                _gm_t0 = x * 2
                _gm_e0 = x
                _gm_f0 = x - 1
                if __graphmend_rt__.same_meta(_gm_t0, _gm_e0) and __graphmend_rt__.same_meta(_gm_t0, _gm_f0):
                    y = __graphmend_rt__.select(_gm_c0, _gm_t0, __graphmend_rt__.select(_gm_c1, _gm_e0, _gm_f0))
                elif _gm_c0:
                    y = _gm_t0
                elif _gm_c1:
                    y = _gm_e0
                else:
                    y = _gm_f0
            elif _gm_c0:
                y = x * 2
            elif flag and x.mean() > 0:
                y = x
            else:
                y = x - 1
            return y
        """,
    ),
    golden.case(
        "elif-test-with-a-metadata-operand",
        """
        def f(x):
            if x.sum() > 0:  # <-
                y = x * 2
            elif x.dim() > 2 or x.mean() > 0:
                y = x
            else:
                y = x - 1
            return y
        """,
        rewritten="""
        def f(x):
            _gm_ok0 = __graphmend_rt__.is_kind(x, 'floating')
            _gm_c0 = x.sum() > 0
            _gm_c1 = __graphmend_rt__.tensor_or(x.dim() > 2, x.mean() > 0) if _gm_ok0 else None
            if _gm_ok0 and __graphmend_rt__.predicable_with_grad(_gm_c0) and __graphmend_rt__.predicable_with_grad(_gm_c1) and __graphmend_rt__.is_kind(x, 'integer', 'floating'):
                _gm_t0 = x * 2
                _gm_e0 = x
                _gm_f0 = x - 1
                if __graphmend_rt__.same_meta(_gm_t0, _gm_e0) and __graphmend_rt__.same_meta(_gm_t0, _gm_f0):
                    y = __graphmend_rt__.select(_gm_c0, _gm_t0, __graphmend_rt__.select(_gm_c1, _gm_e0, _gm_f0))
                elif _gm_c0:
                    y = _gm_t0
                elif _gm_c1:
                    y = _gm_e0
                else:
                    y = _gm_f0
            elif _gm_c0:
                y = x * 2
            elif x.dim() > 2 or x.mean() > 0:
                y = x
            else:
                y = x - 1
            return y
        """,
    ),
    golden.case(
        "while-loop",
        """
        def f(x):
            while x.sum() > 0:  # <-
                x = x - 1
            return x
        """,
        declined="a while loop on a tensor value cannot be predicated",
    ),
    golden.case(
        "statement-other-than-assignment",
        """
        def f(x):
            if x.sum() > 0:  # <-
                print(x)
                x = x + 1
            return x
        """,
        declined=(
            "torch.where: a branch holds a statement other than a single-target assignment: a call statement "
            "(`print(x)`); torch.cond: a branch holds a statement other than an assignment to a name or a tuple of names"
        ),
    ),
    golden.case(
        "tuple-target",
        """
        def f(x):
            if x.sum() > 0:  # <-
                a, b = x, x
            return x
        """,
        declined="assignment to `(a, b)` (only names and self.<attr> are predicated)",
    ),
    golden.case(
        "indexing-may-raise-on-the-path-not-taken",
        """
        def f(x, i):
            if x.sum() > 0:  # <-
                x = x[i]
            return x
        """,
        declined="`x = x[i]`: indexing can go out of range on the path not taken",
    ),
    golden.case(
        "in-place-method",
        """
        def f(x):
            if x.sum() > 0:  # <-
                x = x.add_(1)
            return x
        """,
        declined=(
            "torch.where: `x = x.add_(1)`: `.add_` mutates its receiver; torch.cond: `.add_(...)` is "
            "not a known pure method"
        ),
    ),
    golden.case(
        "assigned-on-one-path-only",
        """
        def f(x):
            if x.sum() > 0:  # <-
                y = x * 2
            return y
        """,
        declined="`y` is assigned on one path only and read after the if",
    ),
    golden.case(
        "or-over-values-not-provably-tensors-decided-while-tracing",
        """
        def f(x):
            if x.sum() > 0 or (x > 10).any():  # <-
                x = x * 0.5
            return x
        """,
        rewritten="""
        def f(x):
            _gm_c0 = __graphmend_rt__.tensor_or(x.sum() > 0, (x > 10).any())
            if __graphmend_rt__.predicable_with_grad(_gm_c0):
                _gm_t0 = x * 0.5
                if __graphmend_rt__.same_meta(_gm_t0, x):
                    x = __graphmend_rt__.select(_gm_c0, _gm_t0, x)
                elif _gm_c0:
                    x = _gm_t0
            elif x.sum() > 0 or (x > 10).any():
                x = x * 0.5
            return x
        """,
    ),
    golden.case(
        "static-conjunct-after-a-tensor-one",
        """
        def f(x, flag):
            if x.sum() > 0 and flag:  # <-
                x = x * 2
            return x
        """,
        declined="a static operand after a tensor operand would change evaluation order",
    ),
    golden.case(
        "module-with-state",
        """
        class Counter(nn.Module):
            def __init__(self):
                super().__init__()
                self.calls = 0

            def forward(self, h):
                self.calls += 1
                return h


        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.counter = Counter()

            def forward(self, h):
                if h.mean() > 0:  # <-
                    h = self.counter(h)
                return h
        """,
        declined=(
            "torch.where: `h = self.counter(h)`: `.counter(...)` is not a known pure tensor method; "
            "torch.cond: `self.counter` contains Counter, not a known stateless layer"
        ),
    ),
    golden.case(
        "torch-cond-after-an-attribute-store",
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)
                self.last = None

            def forward(self, h):
                self.last = h
                if h.mean() > 0:  # <-
                    h = self.lin(h)
                return h
        """,
        declined=(
            "torch.where: `h = self.lin(h)`: `.lin(...)` is not a known pure tensor method; torch.cond:"
            " `self.last` may run before it in the compiled frame, and Dynamo then drops attribute "
            "stores made after a torch.cond (torch 2.13 and 2.14)"
        ),
        marks=pytest.mark.skipif(not release().cond_drops_later_stores, reason="torch 2.12 and 2.15 keep the stores"),
    ),
    # A reduction with no identity element (amax, max, min, item) raises on an empty
    # tensor: evaluated where the original did not, only of a name the test reduced whole
    # or one a guard (runtime.nonempty) tests first.
    golden.case(
        "reduction-on-the-path-not-taken",
        """
        def f(x):
            if (x > 0).any():  # <-
                m = x.amax()
            else:
                m = x.sum()
            return m
        """,
        rewritten="""
        def f(x):
            _gm_c0 = (x > 0).any()
            if __graphmend_rt__.predicable_with_grad(_gm_c0) and __graphmend_rt__.nonempty(x):
                _gm_g0 = __graphmend_rt__.grad_gate(_gm_c0, x)
                _gm_t0 = _gm_g0.amax()
                _gm_f0 = x.sum()
                if __graphmend_rt__.same_meta(_gm_t0, _gm_f0):
                    m = __graphmend_rt__.select(_gm_c0, _gm_t0, _gm_f0)
                elif _gm_c0:
                    m = _gm_t0
                else:
                    m = _gm_f0
            elif _gm_c0:
                m = x.amax()
            else:
                m = x.sum()
            return m
        """,
    ),
    golden.case(
        "reduction-of-a-name-the-test-reduced",
        """
        def f(h):
            if h.amax() > 1.5:  # <-
                scale = h.abs().amax()
            else:
                scale = h.sum()
            return h / scale
        """,
        rewritten="""
        def f(h):
            _gm_c0 = h.amax() > 1.5
            if __graphmend_rt__.predicable_with_grad(_gm_c0) and __graphmend_rt__.is_kind(h, 'integer', 'floating'):
                _gm_g0 = __graphmend_rt__.grad_gate(_gm_c0, h)
                _gm_t0 = _gm_g0.abs().amax()
                _gm_f0 = h.sum()
                if __graphmend_rt__.same_meta(_gm_t0, _gm_f0):
                    scale = __graphmend_rt__.select(_gm_c0, _gm_t0, _gm_f0)
                elif _gm_c0:
                    scale = _gm_t0
                else:
                    scale = _gm_f0
            elif _gm_c0:
                scale = h.abs().amax()
            else:
                scale = h.sum()
            return h / scale
        """,
    ),
    golden.case(
        "reduction-of-a-name-rebound-in-the-branch",
        """
        def f(h):
            if h.amax() > 1.5:  # <-
                h = h[1:]
                scale = h.amax()
            else:
                scale = h.sum()
            return scale
        """,
        declined='torch.where: `scale = h.amax()`: `.amax(...)` raises on an empty tensor, which the path not taken may hold; torch.cond: `h.amax()` raises on an empty tensor, and torch.cond traces the branch not taken on the shapes of the call',
    ),
    golden.case(
        "torch-cond-declines-a-boolean-mask-in-a-branch",
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, h):
                if (h < 0).all():  # <-
                    k = h[h > 0]
                    h = self.lin(h) + k.sum()
                return h
        """,
        declined="torch.where: `k = h[h > 0]`: indexing can go out of range on the path not taken; torch.cond: `h[h > 0]` (`h > 0` may be a boolean mask): its shape or value depends on tensor data, which Dynamo captures in a torch.cond branch only with fullgraph=True",
    ),
    golden.case(
        "torch-cond-declines-a-boolean-mask-in-a-helper-a-branch-calls",
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def _positive_sum(self, h):
                return h[h > 0].sum()

            def forward(self, h):
                if (h < 0).all():  # <-
                    h = self.lin(h) + self._positive_sum(h)
                return h
        """,
        declined="torch.where: `h = self.lin(h) + self._positive_sum(h)`: `.lin(...)` is not a known pure tensor method; torch.cond: Model._positive_sum: `h[h > 0]` (`h > 0` may be a boolean mask): its shape or value depends on tensor data, which Dynamo captures in a torch.cond branch only with fullgraph=True",
    ),
    golden.case(
        "torch-cond-declines-a-helper-with-a-tensor-test",
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def _squash(self, h):
                if h.max() > 1:
                    h = torch.relu(h)
                return h

            def forward(self, h):
                if (h < 0).all():  # <-
                    h = self._squash(self.lin(h))
                return h
        """,
        declined="torch.where: `h = self._squash(self.lin(h))`: `.lin(...)` is not a known pure tensor method; torch.cond: Model._squash: the test `h.max() > 1` may be on tensor values, which Dynamo captures in a torch.cond branch only with fullgraph=True",
    ),
    golden.case(
        "torch-cond-declines-a-slice-bounded-by-a-tensor",
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, h):
                k = h.sum().long()
                if (h < 0).all():  # <-
                    h = self.lin(h) + h[:k].sum()
                return h
        """,
        declined="torch.where: `h = self.lin(h) + h[:k].sum()`: `.lin(...)` is not a known pure tensor method; torch.cond: `h[:k]` (`:k` may be bounded by tensor values): its shape or value depends on tensor data, which Dynamo captures in a torch.cond branch only with fullgraph=True",
    ),
    golden.case(
        "torch-cond-keeps-an-index-proven-integer",
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, h):
                idx = torch.arange(2).long()
                if (h < 0).all():  # <-
                    h = self.lin(h[idx])
                return h
        """,
        rewritten="""
        def forward(self, h):
            idx = torch.arange(2).long()
            _gm_c0 = (h < 0).all()
            if __graphmend_rt__.predicable(_gm_c0):

                def _gm_true_branch0():
                    _gm_t0 = self.lin(h[idx])
                    return (_gm_t0,)

                def _gm_false_branch0():
                    return (h.clone(),)
                __graphmend_rt__.bind(self, h, idx, getattr(self, 'lin', None))
                h, = torch.cond(_gm_c0, _gm_true_branch0, _gm_false_branch0, ())
            elif _gm_c0:
                h = self.lin(h[idx])
            return h
        """,
    ),
    golden.case(
        "reduction-in-a-later-operand-of-and",
        """
        def f(x):
            if (x > 0).any() and x.max() > 2:  # <-
                x = x * 2
            return x
        """,
        rewritten="""
        def f(x):
            _gm_ok0 = __graphmend_rt__.nonempty(x)
            _gm_c0 = __graphmend_rt__.tensor_and((x > 0).any(), x.max() > 2) if _gm_ok0 else None
            if _gm_ok0 and __graphmend_rt__.predicable_with_grad(_gm_c0):
                _gm_t0 = x * 2
                if __graphmend_rt__.same_meta(_gm_t0, x):
                    x = __graphmend_rt__.select(_gm_c0, _gm_t0, x)
                elif _gm_c0:
                    x = _gm_t0
            elif (x > 0).any() and x.max() > 2:
                x = x * 2
            return x
        """,
    ),
    golden.case(
        "static-operand-of-or-stays-a-python-if-with-the-branch-as-written",
        """
        def f(h):
            if h.dim() > 2 or h.sum() > 0:  # <-
                h = h * 2
            return h
        """,
        rewritten="""
        def f(h):
            if h.dim() > 2:
                h = h * 2
            else:
                _gm_c0 = h.sum() > 0
                if __graphmend_rt__.predicable_with_grad(_gm_c0):
                    _gm_t0 = h * 2
                    if __graphmend_rt__.same_meta(_gm_t0, h):
                        h = __graphmend_rt__.select(_gm_c0, _gm_t0, h)
                    elif _gm_c0:
                        h = _gm_t0
                elif _gm_c0:
                    h = h * 2
            return h
        """,
    ),
    golden.case(
        "early-return-predicates-the-rest-of-the-function",
        """
        def f(x):
            if x.max() > 2:  # <-
                return x * 0
            y = x + 1
            return y * 2
        """,
        rewritten="""
        def f(x):
            _gm_c0 = x.max() > 2
            if __graphmend_rt__.predicable_with_grad(_gm_c0):
                _gm_t0 = x * 0
                _gm_f0 = x + 1
                _gm_f1 = _gm_f0 * 2
                if __graphmend_rt__.same_meta(_gm_t0, _gm_f1):
                    return __graphmend_rt__.select(_gm_c0, _gm_t0, _gm_f1)
                else:
                    return _gm_t0 if _gm_c0 else _gm_f1
            elif _gm_c0:
                return x * 0
            y = x + 1
            return y * 2
        """,
    ),
    golden.case(
        "early-returns-in-a-row-become-one-return-each-path-selected",
        """
        def f(x):
            if x.max() > 2:  # <-
                return x * 0
            if x.min() < -2:
                return x * 2
            y = x + 1
            return y
        """,
        rewritten="""
        def f(x):
            _gm_c0 = x.max() > 2
            if __graphmend_rt__.predicable(_gm_c0):
                _gm_t0 = x * 0
                _gm_c1 = x.min() < -2
                _gm_f0 = x * 2
                _gm_f1 = x + 1
                _gm_f2 = _gm_f1
                if __graphmend_rt__.predicable(_gm_c1) and __graphmend_rt__.same_meta(_gm_f0, _gm_f2):
                    _gm_f3 = torch.where(_gm_c1, _gm_f0, _gm_f2)
                    _gm_f4 = _gm_f3
                    if __graphmend_rt__.same_meta(_gm_t0, _gm_f4):
                        return __graphmend_rt__.select(_gm_c0, _gm_t0, _gm_f4)
                    else:
                        return _gm_t0 if _gm_c0 else _gm_f4
                elif _gm_c0:
                    return x * 0
            elif _gm_c0:
                return x * 0
            if x.min() < -2:
                return x * 2
            y = x + 1
            return y
        """,
    ),
    golden.case(
        "early-return-whose-rest-stores-an-attribute-in-a-nested-if-selects-the-store",
        """
        def f(self, x):
            if x.max() > 2:  # <-
                return x * 0
            if x.mean() < 0.5:
                self.last = x.sum()
            return x * 2
        """,
        rewritten="""
        def f(self, x):
            _gm_c0 = x.max() > 2
            if __graphmend_rt__.predicable(_gm_c0) and __graphmend_rt__.is_kind(x, 'floating'):
                _gm_t0 = x * 0
                _gm_c1 = x.mean() < 0.5
                _gm_f0 = x.sum()
                if __graphmend_rt__.predicable(_gm_c1) and __graphmend_rt__.same_meta(_gm_f0, self.last):
                    _gm_f1 = torch.where(_gm_c1, _gm_f0, self.last)
                    _gm_f2 = x * 2
                    if __graphmend_rt__.same_meta(_gm_t0, _gm_f2) and __graphmend_rt__.same_meta(self.last, _gm_f1):
                        __graphmend_rt__.store(self, 'last', torch.where(_gm_c0, self.last, _gm_f1))
                        return __graphmend_rt__.select(_gm_c0, _gm_t0, _gm_f2)
                    else:
                        if _gm_c0:
                            pass
                        else:
                            self.last = _gm_f1
                        return _gm_t0 if _gm_c0 else _gm_f2
                elif _gm_c0:
                    return x * 0
            elif _gm_c0:
                return x * 0
            if x.mean() < 0.5:
                self.last = x.sum()
            return x * 2
        """,
    ),
    golden.case(
        "a-store-to-an-attribute-the-model-does-not-have-yet-is-not-selected",
        """
        class Model(nn.Module):
            def forward(self, x):
                if x.mean() < 0.5:  # <-
                    self.last = x.sum()
                    x = x + 1
                return x * 2
        """,
        declined="torch.where: `self.last` is not set on the model before the if: the select would read it where the original does not; torch.cond: a branch holds a statement other than an assignment to a name or a tuple of names",
    ),
    golden.case(
        "early-return-when-the-function-falls-off-its-end",
        """
        def f(x, out: list):
            if x.max() > 2:  # <-
                return x * 0
            out.append(x)
        """,
        declined="an early return where the function does not end in `return <value>`",
    ),
    golden.case(
        "autograd-a-branch-with-an-infinite-derivative-reads-through-grad-gate",
        """
        def f(x):
            if x.min() > 0:  # <-
                y = x.sqrt()
            else:
                y = x * 0.5
            return y
        """,
        rewritten="""
        def f(x):
            _gm_c0 = x.min() > 0
            if __graphmend_rt__.predicable_with_grad(_gm_c0):
                _gm_g0 = __graphmend_rt__.grad_gate(_gm_c0, x)
                _gm_t0 = _gm_g0.sqrt()
                _gm_f0 = x * 0.5
                if __graphmend_rt__.same_meta(_gm_t0, _gm_f0):
                    y = __graphmend_rt__.select(_gm_c0, _gm_t0, _gm_f0)
                elif _gm_c0:
                    y = _gm_t0
                else:
                    y = _gm_f0
            elif _gm_c0:
                y = x.sqrt()
            else:
                y = x * 0.5
            return y
        """,
    ),
    golden.case(
        "autograd-a-parameter-one-branch-alone-reaches-is-checked-by-grad-free",
        """
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(4))

            def forward(self, h):
                if h.sum() > 0:  # <-
                    h = h + self.w
                return h
        """,
        rewritten="""
        def forward(self, h):
            _gm_c0 = h.sum() > 0
            if __graphmend_rt__.predicable_with_grad(_gm_c0) and __graphmend_rt__.grad_free(self.w) and __graphmend_rt__.broadcastable(h, self.w):
                _gm_t0 = h + self.w
                if __graphmend_rt__.same_meta(_gm_t0, h):
                    h = __graphmend_rt__.select(_gm_c0, _gm_t0, h)
                elif _gm_c0:
                    h = _gm_t0
            elif _gm_c0:
                h = h + self.w
            return h
        """,
    ),
]


@pytest.mark.parametrize("source, expected", GOLDEN)
def test_golden(source, expected):
    assert golden.outcome("where", source) == expected


def test_a_reduction_the_empty_input_never_reached_is_guarded():
    """Found reading the purity lists: `amax` is pure but raises on an empty
    tensor. Predicated, the positive inputs' branch reduced the empty input the
    original sent down the other branch, and the compiled call raised. A guard
    (`runtime.nonempty`, decided while tracing) now sends an empty tensor down
    the original branch: every input as eager, no more graphs than torch.compile."""
    empty = torch.empty(0, 4)
    model = B.ReducesOnOnePath()
    backend, plain = CountingBackend(), CountingBackend()
    with torch.no_grad():
        compiled = graphmend.compile(copy.deepcopy(model), backend=backend, example_inputs=(P,))
        assert [(o.status, o.reason) for o in compiled.report.outcomes] == [
            ("applied", "if/else predicated with torch.where (m; names)")
        ]
        for x in (P, N, empty):
            assert bits_equal(compiled(x), model(x))
        torch._dynamo.reset()
        original = torch.compile(copy.deepcopy(model), backend=plain)
        for x in (P, N, empty):
            original(x)
    assert len(backend.graphs) <= len(plain.graphs)


def test_a_selected_name_a_caller_updates_in_place_is_declined_in_the_fuzz_program():
    """Found by the fuzzer (5,000-program run, seed 24): `helper2` selected `h` and returned it
    as it is; the caller's `h.add_(1)` then changed the select's new tensor, not tanh's saved
    output, so the mended program's backward ran where eager's raises. Now declined with the
    caller named; no mismatch on any arm."""
    from fuzz.runner import check_program

    result = check_program(fixture_program("fuzz_select_returned_then_updated.py"), seed=37645, start=6, grad=True, aot=True)
    assert result.status == "checked"
    reasons = [r for _, rule, status, r in result.outcomes if rule == "where" and status == "declined"]
    assert any("`h` is returned as it is and the caller at" in r and "updates it in place" in r for r in reasons), reasons
    assert result.mismatches == [], result.mismatches[:2]


def _forward_backward(model, x, grad):
    x = x.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        try:
            out = model(x)
            if grad:
                out.sum().backward()
        except RuntimeError as exc:
            return "RuntimeError", "modified by an inplace operation" in str(exc)
    return out.detach(), x.grad


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_helper_result_its_caller_updates_in_place_keeps_the_original_and_one_it_computes_with_is_selected(grad):
    """`h = helper(x); h.add_(1)`: the helper's select would hand back a new tensor where the
    original handed back tanh's output (under grad, saved: eager's backward raises); declined,
    outputs, gradients and the error as eager's. `h = helper(x); return h * 2`: selected.
    (Expected values are taken before mending: a mend patches the helper for every caller.)"""
    assert _forward_backward(B.ReturnedThenUpdated(), P, True) == ("RuntimeError", True)  # eager's backward refuses
    for cls, status in ((B.ReturnedThenUpdated, "declined"), (B.ReturnedThenComputed, "applied")):
        expected = [_forward_backward(cls(), x, grad) for x in (P, N, P)]
        backend = CountingBackend()
        with torch.set_grad_enabled(grad):
            compiled = graphmend.compile(cls(), backend=backend, example_inputs=(N,))
        (dc,) = [o for o in compiled.report.outcomes if o.category == "DC"]
        assert dc.status == status, dc
        if status == "declined":
            assert "`h` is returned as it is and the caller at branches.py:" in dc.reason, dc.reason
        for want, x in zip(expected, (P, N, P)):
            got = _forward_backward(compiled, x, grad)
            assert all(bits_equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(want, got)), (want, got)
        graphmend.unmend()
        torch._dynamo.reset()
