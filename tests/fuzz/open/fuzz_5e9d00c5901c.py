# seed=6896
# start=4
# grad=True
# inductor=False
# aot=True
"""A generated graphmend fuzz program (tests/fuzz/generator.py)."""

import logging
import warnings

import torch
from torch import nn

logger = logging.getLogger("graphmend.fuzz")


class FuzzError(Exception):
    """A model-defined exception class."""


class Block1(nn.Module):
    def __init__(self, use_bias=True):
        super().__init__()
        self.lin = nn.Linear(4, 4)
    def forward(self, h):
        s = h.mean()
        if h.sum() > 0:
            h = self.lin(h)
            h = h * 1.5
        elif h.norm() > 3:
            print("h is", h, s)
            h.mul_(2)
            h = torch.tanh(h)
        t = (h * 3000.0).to(torch.float16)
        if t.dtype == torch.float16 and torch.isinf(t).any():
            lim = torch.finfo(t.dtype).max - 1000
            t = torch.clamp(t, min=-lim, max=lim)
        h = t.float()
        return h


class Model(nn.Module):
    def __init__(self, use_bias=False):
        super().__init__()
        self.bias = nn.Parameter(torch.full((4,), 0.25)) if use_bias else None
        self.block1 = nn.ModuleList([Block1() for _ in range(2)])

    def forward(self, x):
        h = x * 1.0
        s = h.mean()
        logger.info("norm %s", h.norm())
        h.add_(1)
        if self.bias is not None and h.sum() > 0:
            h = h + self.bias
        for layer in self.block1:
            h = layer(h)
        if h.max() > 1 and h.min() < 0:
            return -h
        assert not ((h < -2).any()), f"bad values: {h.min()}"
        return (h, s)
