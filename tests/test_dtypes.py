"""The dtype facts speculation relies on (analysis/dtypes.py), measured on the
torch this runs on, and what they do to a mended model given a dtype the
example never had."""

import ast
import textwrap

import pytest
import torch
import torch as th
from effects_capture import CountingBackend, bits_equal
from torch import nn

import graphmend
from graphmend.analysis.dtypes import BOOL, COMPLEX, FLOAT, INT, RAISES
from graphmend.analysis.dtypes import tested_kinds as proven_by
from graphmend.analysis.facts import PURE_TENSOR_METHODS, PURE_TORCH_FUNCTIONS, FunctionFacts
from graphmend.runtime import is_kind

DTYPES = {
    BOOL: [torch.bool],
    INT: [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64],
    FLOAT: [torch.float16, torch.bfloat16, torch.float32, torch.float64],
    COMPLEX: [torch.complex64, torch.complex128],
}

# One call per operation, as speculated code writes it (constant arguments).
CALLS = {
    "sub": lambda t: t.sub(1), "subtract": lambda t: torch.subtract(t, 1), "addcmul": lambda t: torch.addcmul(t, t, t),
    "clamp": lambda t: t.clamp(0, 1), "clamp_min": lambda t: t.clamp_min(0), "clamp_max": lambda t: t.clamp_max(1),
    "clip": lambda t: t.clip(0, 1), "lerp": lambda t: torch.lerp(t, t, 0.5),
    "finfo": lambda t: torch.finfo(t.dtype), "iinfo": lambda t: torch.iinfo(t.dtype),
    "softmax": lambda t: t.softmax(-1), "log_softmax": lambda t: t.log_softmax(-1),
    "cumsum": lambda t: t.cumsum(0), "cumprod": lambda t: t.cumprod(0), "transpose": lambda t: t.transpose(0, 1),
    "permute": lambda t: t.permute(1, 0), "view": lambda t: t.view(-1), "reshape": lambda t: t.reshape(-1),
    "expand": lambda t: t.expand(2, 3), "broadcast_to": lambda t: torch.broadcast_to(t, (2, 3)),
    "chunk": lambda t: t.chunk(2), "flip": lambda t: torch.flip(t, (0,)), "cat": lambda t: torch.cat([t, t]),
    "stack": lambda t: torch.stack([t, t]), "where": lambda t: torch.where(t != 0, t, t),
    "to": lambda t: t.to(torch.float32), "pow": lambda t: t.pow(2), "fmod": lambda t: torch.fmod(t, 2),
    "remainder": lambda t: torch.remainder(t, 2), "masked_fill": lambda t: t.masked_fill(t != 0, 0),
    "full_like": lambda t: torch.full_like(t, 1), "squeeze": lambda t: t.squeeze(0), "unsqueeze": lambda t: t.unsqueeze(0),
    "bmm": lambda t: torch.bmm(t[None], t.T[None]), "matmul": lambda t: torch.matmul(t, t.T),
    "einsum": lambda t: torch.einsum("ij,kj->ik", t, t), "div": lambda t: t.div(2), "mul": lambda t: t.mul(2),
    "add": lambda t: t.add(1), "eq": lambda t: t.eq(1), "ne": lambda t: t.ne(1),
}
TWO_TENSORS = {"maximum", "minimum", "atan2", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
               "bitwise_and", "bitwise_or", "bitwise_xor", "isclose", "allclose", "view_as", "expand_as", "type_as"}
CONSTRUCTORS = {"zeros", "ones", "arange", "tensor", "full"}  # no tensor to raise on


def _call(name):
    if name in CALLS:
        return CALLS[name]
    if name in TWO_TENSORS:
        return lambda t: getattr(torch, name)(t, t) if not hasattr(t, name) else getattr(t, name)(t)
    return lambda t: getattr(t, name)() if hasattr(t, name) else getattr(torch, name)(t)


def _raising_kinds(fn):
    out = set()
    for kind, dtypes in DTYPES.items():
        for dtype in dtypes:
            t = torch.tensor([[1, 0, 2], [3, 1, 0]]).to(dtype)
            try:
                fn(t)
            except (RuntimeError, TypeError, NotImplementedError):
                out.add(kind)
    return frozenset(out)


def test_every_pure_operation_has_dtype_facts():
    """A pure operation missing from the table would be declined, never assumed
    total; the table covers every one the purity lists allow."""
    assert sorted((PURE_TORCH_FUNCTIONS | PURE_TENSOR_METHODS) - RAISES.keys()) == []


@pytest.mark.parametrize("name", sorted(RAISES.keys() - CONSTRUCTORS))
def test_the_table_is_what_torch_raises_on(name):
    """Measured on this torch, every dtype of each kind: the kinds a call raises
    on are exactly the table's."""
    assert _raising_kinds(_call(name)) == RAISES[name]


@pytest.mark.parametrize(
    "dtype, kind",
    [(torch.bool, BOOL), (torch.int64, INT), (torch.uint8, INT), (torch.bfloat16, FLOAT), (torch.complex64, COMPLEX),
     (torch.float8_e4m3fn, None)],
)
def test_is_kind_reads_the_dtype_and_knows_no_kind_it_was_not_measured_on(dtype, kind):
    t = torch.zeros(2, dtype=dtype)
    assert [k for k in (BOOL, INT, FLOAT, COMPLEX) if is_kind(t, k)] == ([kind] if kind else [])


def test_a_test_proves_only_what_surely_would_have_raised():
    fdef = ast.parse(textwrap.dedent("""
        def f(x, y):
            s = x.sum()
            if s > 1 and x.mean() > 0 and (x + y) - 1 > 0:
                pass
    """)).body[0]
    facts = FunctionFacts.of(fdef, {"torch": torch}, {"x", "y", "s"})
    # `s > 1`: s, and x through it, not complex; later operands of `and` prove nothing.
    assert proven_by(fdef.body[1].test, facts) == {"s": frozenset({BOOL, INT, FLOAT}), "x": frozenset({BOOL, INT, FLOAT})}


class BranchSubtracts(nn.Module):
    def forward(self, h):
        if h.sum() > 0:
            h = h * 2
        else:
            h = h - 1
        return h


class ElifMean(nn.Module):
    def forward(self, x):
        s = x.sum()
        if s > 1:
            y = x * 2
        elif x.mean() > -1.5:
            y = x - 1
        else:
            y = x
        return y


@pytest.mark.parametrize("model", [BranchSubtracts, ElifMean])
def test_a_dtype_the_branch_not_taken_raises_on_runs_as_eager(model):
    """Mended on a float input, called with a bool and an integer one: the branch
    eager skips would raise on them (`h - 1` on bool, `x.mean()` on integers); the
    guard sends them to the original statement, and the float input stays one graph."""
    compiled = graphmend.compile(model(), backend="eager", example_inputs=(torch.randn(4),))
    assert {o.status for o in compiled.report.outcomes} == {"applied"}
    with torch.no_grad():
        inputs = [torch.tensor([True, True]), torch.tensor([3, 0, 1]), torch.tensor([-1.0, 2.5]), torch.tensor([-3.0, 1.0])]
        for x in inputs:
            expected = model()(x)
            assert torch.equal(compiled(x), expected) and compiled(x).dtype == expected.dtype


class AliasedHalf(nn.Module):
    """torch imported as `th` (as the fuzzer writes it): `.to(th.float16)` is floating."""

    def forward(self, x):
        h = x * 1.0
        if h.mean() < 0.5:
            t = (h * 10.0).to(th.float16)
            lim = th.finfo(t.dtype).max - 1000
            t = th.clamp(t, min=-lim, max=lim)
            h = t.float()
        return h + 1


class ItemTestAfterReturn(nn.Module):
    """An early return, then an `.item()` test [Scalar] makes a tensor test
    (`runtime.item_of(h.sum(), 0) > 0`): its kind is `h.sum()`'s, so the early
    return's select proves it cannot raise (it was "may be complex")."""

    def forward(self, x):
        h = x * 1.0
        s = h.mean()
        if s > 0:
            return h + s
        s = s + h.sum()
        if h.sum().item() > 0:
            h = h * 2
        return h + s


@pytest.mark.parametrize("model", [AliasedHalf, ItemTestAfterReturn])
def test_the_kinds_of_an_aliased_dtype_and_of_an_item_test_are_known(model):
    inputs = [torch.tensor([[0.1, 0.2]]), torch.tensor([[0.9, 0.7]]), torch.tensor([[-0.5, 0.2]]), torch.tensor([[-0.5, -0.2]])]
    compiled = graphmend.compile(model(), backend=CountingBackend(), example_inputs=(inputs[0],))
    assert {o.status for o in compiled.report.outcomes} == {"applied"}, compiled.report.outcomes
    assert compiled.report.after.graphs == 1
    with torch.no_grad():
        for x in inputs:
            assert bits_equal(compiled(x), model()(x))
