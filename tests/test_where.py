"""[Where]: each form on inputs that take each branch, each decline reason,
autograd, and `import torch as th`."""

import copy

import pytest
import torch

import branches as B
import graphmend
from effects_capture import CountingBackend, bits_equal

P, N = B.POSITIVE, B.NEGATIVE


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


@pytest.mark.parametrize("cls", [B.ModuleCall, B.TwoModules], ids=lambda c: c.__name__)
def test_branches_calling_modules_use_torch_cond(cls):
    torch.manual_seed(0)
    _, report = check_form(cls, [(P,), (N,), (P * 0.5,)])
    (dc,) = [o for o in report.outcomes if o.category == "DC"]
    assert "torch.cond" in dc.reason and "only the taken one runs" in dc.reason


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
    if cls is HelperCountAfterCond:  # a store in another method may run before the cond: declined
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


def test_or_guard_on_finite_inf_and_nan_inputs():
    weird = P.clone()
    weird[0, 0] = float("inf")
    nan = P.clone()
    nan[1, 2] = float("nan")
    _, report = check_form(B.OrGuard, [(P,), (weird,), (nan,)])
    assert any("predicated" in n for o in report.outcomes for n in o.notes)


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
    (B.Elif, "elif"),
    (B.Loop, "while loop"),
    (B.PrintInBranch, "statement other than a single-target assignment"),
    (B.CustomModuleCall, "Counter, not a known stateless layer"),
    (B.Indexing, "indexing"),
    (B.OnePathOnly, "assigned on one path only and read after"),
    (B.InPlace, "mutates its receiver"),
    (B.PythonOr, "not all provably tensors"),
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
    assert "__graphmend_rt__" in names and "torch" in names  # __graphmend_rt__.torch.where
