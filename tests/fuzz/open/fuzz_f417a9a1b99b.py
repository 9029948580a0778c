# seed=177
# start=6
# grad=False
# inductor=False
# aot=True
# checked: counting, call 5: warnings: [('UserWarning', 'mean -90018.34375', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 38), ('UserWarning', 'mean -180036.6875', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 38), ('UserWarning', 'mean -360073.375', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54), ('UserWarning', 'mean -360073.375', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54)] vs [('UserWarning', 'mean -90018.34375', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 38), ('UserWarning', 'mean -180036.6875', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 36), ('UserWarning', 'mean -360073.375', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54), ('UserWarning', 'mean -360073.375', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54)]
# checked: counting, call 6: warnings: [('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 38), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 38), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54)] vs [('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 36), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 36), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54)]
# checked: aot_eager, call 5: warnings: [('UserWarning', 'mean -90018.34375', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 38), ('UserWarning', 'mean -180036.6875', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 38), ('UserWarning', 'mean -360073.375', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54), ('UserWarning', 'mean -360073.375', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54)] vs [('UserWarning', 'mean -90018.34375', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 38), ('UserWarning', 'mean -180036.6875', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 36), ('UserWarning', 'mean -360073.375', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54), ('UserWarning', 'mean -360073.375', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54)]
# checked: aot_eager, call 6: warnings: [('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 38), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 38), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54)] vs [('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 36), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 36), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54), ('UserWarning', 'mean inf', '/tmp/graphmend-fuzz-jlkxea5n/graphmend_fuzz_f417a9a1b99b_18.py', 54)]
"""A generated graphmend fuzz program (tests/fuzz/generator.py)."""

import logging
import warnings

import torch as th

nn = th.nn

logger = logging.getLogger("graphmend.fuzz")


class FuzzError(Exception):
    """A model-defined exception class."""


class Block1(nn.Module):
    def __init__(self, use_bias=True):
        super().__init__()
        pass
    def forward(self, h):
        s = h.mean()
        h = h + h.sum().item()
        return h


class Block2(nn.Module):
    def __init__(self, use_bias=True):
        super().__init__()
        self.last = None
        self.register_buffer("running", th.zeros(4))
    def forward(self, h):
        s = h.mean()
        idx = th.nonzero(h > 0)
        h = h + idx.shape[0]
        if h.norm() > 3:
            self.last = h.detach().sum()
            warnings.warn(f"mean {h.mean()}")
            h.mul_(2)
        else:
            self.running = h.mean(0).detach()
            if not th.isfinite(h).all():
                raise FuzzError("check failed at " + str(h.shape[0]))
        return h


class Block3(nn.Module):
    def __init__(self, use_bias=True):
        super().__init__()
        pass
    def forward(self, h):
        s = h.mean()
        logger.warning("h %s s %s", h, s)
        warnings.warn(f"mean {h.mean()}")
        return h


class Model(nn.Module):
    def __init__(self, use_bias=False):
        super().__init__()
        self.block1 = Block1()
        self.block2 = nn.ModuleList([Block2() for _ in range(2)])
        self.block3 = nn.ModuleList([Block3() for _ in range(2)])

    def forward(self, x):
        h = x * 1.0
        s = h.mean()
        h = self.block1(h)
        for layer in self.block2:
            h = layer(h)
        for layer in self.block3:
            h = layer(h)
        return h + s
