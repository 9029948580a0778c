"""Which asserts of a function graphmend takes as compiled into the graph
(src/graphmend/analysis/asserts.py): where [Defer] applies, a graph break goes before
each one, which may fail inside the graph."""

import ast
import textwrap
import types

import pytest
import torch
from torch import nn

from graphmend.analysis.asserts import held_asserts
from graphmend.compat import release

WINDOW = 4
SCALE = torch.ones(2)


class Owner(nn.Module):
    def __init__(self):
        super().__init__()
        self.window = 2
        self.config = types.SimpleNamespace(heads=2, sizes=(1, 2), table=torch.ones(2))
        self.register_buffer("limit", torch.ones(()))


def held(body: str, params: str = "self, x") -> str | None:
    source = f"def f({params}):\n" + textwrap.indent(textwrap.dedent(body), "    ")
    node = ast.parse(source).body[0]
    found = held_asserts(node, [Owner()], {"torch": torch, "WINDOW": WINDOW, "SCALE": SCALE})
    return ast.unparse(found[0]) if found else None


@pytest.mark.parametrize(
    "body",
    [
        "assert x.dim() == 2 and x.shape[0] > 0",
        "assert x is not None",
        "assert isinstance(x, torch.Tensor)",
        "b, n = x.shape\nassert n % self.window == 0",
        "n = x.size(-1)\nn = n * 2\nassert n > 0",
        "assert list(x.size()) == [2, self.config.heads]",
        "w = self.window if isinstance(self.window, int) else max(self.config.sizes)\nassert w % 2 == 0",
        "assert x.size(1) == WINDOW",
        "assert x.dtype == torch.float32",
        "for i in range(x.dim()):\n    assert i < 4",
        "torch._assert_async(x.numel() > 0, 'empty')",
        "if __graphmend_rt__.trappable(1):\n    pass\nelse:\n    assert (x > 0).all()",
    ],
)
def test_an_assert_decided_while_tracing_is_not_held(body):
    assert held(body) is None


@pytest.mark.skipif(release().assert_in_graph, reason="torch compiles torch._assert into the graph from 2.15")
def test_torch_assert_on_a_tensor_is_a_graph_break_up_to_2_14_and_not_held():
    assert held("torch._assert((x > 0).all(), 'a graph break, not in the graph')") is None


@pytest.mark.skipif(not release().assert_in_graph, reason="torch._assert is a graph break up to torch 2.14")
def test_torch_assert_on_a_tensor_compiles_from_2_15_and_is_held():
    assert held("torch._assert((x > 0).all(), 'in the graph')") == "torch._assert((x > 0).all(), 'in the graph')"
    assert held("torch._assert(x.dim() == 2, 'decided while tracing')") is None


@pytest.mark.parametrize(
    "body, params",
    [
        ("assert (x > 0).all(), 'not positive'", "self, x"),
        ("torch._assert_async(~x.isnan().any(), 'nan')", "self, x"),
        ("m = x.min()\nassert m > 0", "self, x"),
        ("n = 2\nn = x.sum()\nassert n > 0", "self, x"),  # one assignment is a tensor
        ("assert n > 0", "self, x, n"),  # a parameter may be a tensor
        ("assert self.limit > 0", "self, x"),  # a buffer
        ("assert self.config.table.sum() > 0", "self, x"),
        ("self.window = x.sum()\nassert self.window > 0", "self, x"),  # stored by the function
        ("self = x\nassert self.window > 0", "self, x"),  # rebound
        ("assert SCALE.sum() > 0", "self, x"),  # a global tensor
        ("with torch.no_grad() as n:\n    pass\nassert n > 0", "self, x"),
        ("n = 1\nwith x as n:\n    pass\nassert n > 0", "self, x"),  # also bound another way
        ("n = 1\nfor i, n in enumerate(x):\n    pass\nassert n > 0", "self, x"),
        ("for v in x:\n    assert v > 0", "self, x"),
        ("assert all(v > 0 for v in x)", "self, x"),
        ("assert bool(x.sum())", "self, x"),
    ],
)
def test_an_assert_that_may_be_on_a_tensor_is_held(body, params):
    assert held(body, params) is not None
