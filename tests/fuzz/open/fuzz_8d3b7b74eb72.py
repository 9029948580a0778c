# seed=95
# start=7
# grad=False
# inductor=False
# aot=True
# checked: counting, call 6: warnings: [('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 37), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 37), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 37), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 37)] vs [('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 37), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 37), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 37), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 36)]
# checked: aot_eager, call 6: warnings: [('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 37), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 37), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 37), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 37)] vs [('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 37), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 37), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 37), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 22), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-90dsnira/graphmend_fuzz_8d3b7b74eb72_15.py', 36)]
"""A generated graphmend fuzz program (tests/fuzz/generator.py)."""

import logging
import warnings

import torch
from torch import nn

logger = logging.getLogger("graphmend.fuzz")


class FuzzError(Exception):
    """A model-defined exception class."""


class Block3(nn.Module):
    def __init__(self, use_bias=True):
        super().__init__()
        pass
    def forward(self, h):
        s = h.mean()
        warnings.warn(f"mean {h.mean()}")
        return h


class Block2(nn.Module):
    def __init__(self, use_bias=True):
        super().__init__()
        self.block3 = nn.ModuleList([Block3() for _ in range(2)])
        self.last = None
        self.bias = nn.Parameter(torch.full((4,), 0.25)) if use_bias else None
    def forward(self, h):
        s = h.mean()
        for layer in self.block3:
            h = layer(h)
        if h.sum() > 0:
            warnings.warn(f"mean {h.mean()}")
            h.add_(1)
            self.last = h.detach().sum()
        elif h.sum() > 0:
            logger.info("norm %s", h.norm())
        else:
            s = h.amax()
        if self.bias is not None and h.sum() > 0:
            h = h + self.bias
        return h


class Block1(nn.Module):
    def __init__(self, use_bias=True):
        super().__init__()
        self.bias = nn.Parameter(torch.full((4,), 0.25)) if use_bias else None
        self.block2 = nn.ModuleList([Block2() for _ in range(2)])
    def forward(self, h):
        s = h.mean()
        if self.bias is not None and h.sum() > 0:
            h = h + self.bias
        for layer in self.block2:
            h = layer(h)
        return h


class Model(nn.Module):
    def __init__(self, use_bias=False):
        super().__init__()
        self.block1 = nn.ModuleList([Block1() for _ in range(2)])

    def forward(self, x):
        h = x * 1.0
        s = h.mean()
        logger.info("norm %s", h.norm())
        for layer in self.block1:
            h = layer(h)
        return h
