# seed=4998
# start=0
# grad=False
# inductor=False
# aot=True
# checked: counting, call 1: attr:count: 2 vs 0
# checked: counting, call 2: attr:count: 4 vs 0
# checked: counting, call 3: attr:count: 6 vs 0
# checked: counting, call 4: attr:count: 8 vs 0
# checked: counting, call 5: attr:count: 10 vs 0
# checked: counting, call 6: attr:count: 12 vs 0
# checked: counting, call 7: attr:count: 14 vs 0
# checked: counting, call 8: attr:count: 16 vs 0
# checked: aot_eager, call 1: attr:count: 2 vs 0
# checked: aot_eager, call 2: attr:count: 4 vs 0
# checked: aot_eager, call 3: attr:count: 6 vs 0
# checked: aot_eager, call 4: attr:count: 8 vs 0
# checked: aot_eager, call 5: attr:count: 10 vs 0
# checked: aot_eager, call 6: attr:count: 12 vs 0
# checked: aot_eager, call 7: attr:count: 14 vs 0
# checked: aot_eager, call 8: attr:count: 16 vs 0
"""A generated graphmend fuzz program (tests/fuzz/generator.py)."""

import logging
import warnings

import torch
from torch import nn

logger = logging.getLogger("graphmend.fuzz")


class FuzzError(Exception):
    """A model-defined exception class."""


class Model(nn.Module):
    def __init__(self, use_bias=False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.count = 0

    def forward(self, x):
        h = x * 1.0
        s = h.mean()
        t = (h * 10.0).to(torch.float16)
        if t.dtype == torch.float16 and torch.isinf(t).any():
            lim = torch.finfo(t.dtype).max - 1000
            t = torch.clamp(t, min=-lim, max=lim)
        h = t.float()
        if s > 0:
            s = h.amax()
            h = self.lin(h)
        s = s + h.sum()
        h = h + 1.0
        self.count += 1
        self.count += 1
        print(f"sum={h.sum()} max={h.max():.2f}")
        h.mul_(2)
        return (h, s)
