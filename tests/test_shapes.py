"""Shapes on the path not taken (analysis/shapes.py): a mended model called
with shapes the example never had runs as eager, where the branch eager skips
would raise on them."""

import pytest
import torch
from torch import nn

import graphmend


class ViewBranch(nn.Module):
    def forward(self, h):
        if h.sum() > 0:
            h = h.view(2, 2) * 2
        else:
            h = h - 1
        return h


class AddsAnInput(nn.Module):
    def forward(self, h, b):
        if h.sum() > 0:
            h = h + b
        else:
            h = h * 2
        return h


class SoftmaxOverDimOne(nn.Module):
    def forward(self, h):
        if h.sum() > 0:
            h = h.softmax(1)
        else:
            h = h * 2
        return h


class MasksWithAnInput(nn.Module):
    def forward(self, h, m):
        if h.sum() > 0:
            h = h.masked_fill(m, 0.0)
        return h


CASES = [
    # model, example, calls where eager takes the other branch on shapes the taken one rejects, what the mend says
    (ViewBranch, (torch.ones(4),), [(torch.full((3,), -1.0),)], "`h.view(2, 2)` may raise on shapes the path not taken never had"),
    (AddsAnInput, (torch.ones(2, 4), torch.ones(4)), [(-torch.ones(2, 4), torch.ones(3))], "applied"),
    (SoftmaxOverDimOne, (torch.ones(2, 4),), [(-torch.ones(4),)], "applied"),
    (
        MasksWithAnInput,
        (torch.ones(2, 4), torch.ones(4, dtype=torch.bool)),
        [(-torch.ones(4), torch.ones(2, 4, dtype=torch.bool))],
        "applied",
    ),
]


@pytest.mark.parametrize("model, example, calls, said", CASES, ids=[c[0].__name__ for c in CASES])
def test_shapes_the_branch_not_taken_raises_on_run_as_eager(model, example, calls, said):
    """Applied: the guard (`broadcastable(b, h)`, `has_dims(h, 2)`, `broadcasts_to(m, h)`)
    holds for the example, one graph; a call it fails for runs the original if.
    Declined (a view to fixed sizes): the reason says so, the graphs stay."""
    compiled = graphmend.compile(model(), backend="eager", example_inputs=example)
    (outcome,) = compiled.report.outcomes
    graphs = (compiled.report.before.graphs, compiled.report.after.graphs)
    if said == "applied":
        assert outcome.status == "applied" and graphs == (2, 1)
    else:
        assert outcome.status == "declined" and said in outcome.reason and graphs == (2, 2)
    with torch.no_grad():
        for args in [example, *calls]:
            assert torch.equal(compiled(*args), model()(*args))
