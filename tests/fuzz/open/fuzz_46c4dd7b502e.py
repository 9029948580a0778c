# seed=1
# start=6
# grad=True
# inductor=False
# aot=True
# checked: aot_eager+grad, call 1: exception: None vs ('RuntimeError', 'one of the variables needed for gradient computation has been modified by an inplace operation: [torch.FloatTensor [2, 4]], which is output 0 of torch::autograd::CopyBackwards, is at version 1; expected version 0 instead. Hint: enable anomaly detection to find the operation that failed to compute its gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False).')
# checked: aot_eager+grad, call 3: exception: None vs ('RuntimeError', 'one of the variables needed for gradient computation has been modified by an inplace operation: [torch.FloatTensor [2, 4]], which is output 0 of torch::autograd::CopyBackwards, is at version 1; expected version 0 instead. Hint: enable anomaly detection to find the operation that failed to compute its gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False).')
"""A generated graphmend fuzz program (tests/fuzz/generator.py)."""

import logging
import warnings

import torch as th

nn = th.nn

logger = logging.getLogger("graphmend.fuzz")


class FuzzError(Exception):
    """A model-defined exception class."""


def helper2(h, s):
    if th.isnan(h).any():
        raise ValueError(f"max was {h.max().item():.3f}")
    warnings.warn(f"mean {h.mean()}")
    return h, s


def helper3(h, s):
    if h.max() > 1 and h.min() < 0:
        h = th.tanh(h)
    h = th.tanh(h)
    s = h.amax()
    return h, s


def helper4(h, s):
    if h.sum() > 0:
        warnings.warn(f"mean {h.mean()}")
        s.add_(1)
    elif h.norm() > 3:
        assert not (not th.equal(h, h)), "value out of range"
    else:
        s = h.amax()
        h = h * 1.5
    logger.info("norm %s", h.norm())
    h.add_(1)
    return h, s


class Model(nn.Module):
    def __init__(self, use_bias=False):
        super().__init__()
        self.register_buffer("buf", th.zeros(4))
        self.count = 0
        self.lin = nn.Linear(4, 4)

    def _helper1(self, h, s):
        if (h > 1).any():
            self.buf.copy_(h.mean(0).detach())
            th._assert(~(not th.isfinite(h).all()), "value out of range")
        elif h.max() > 1 and h.min() < 0:
            self.buf.copy_(h.mean(0).detach())
            logger.warning("h %s s %s", h, s)
        else:
            self.count += 1
            self.count += 1
        h = self.lin(h)
        s = h.amax()
        return h, s

    def forward(self, x):
        h = x * 1.0
        s = h.mean()
        h, s = self._helper1(h, s)
        h, s = helper2(h, s)
        s = s + h.sum()
        print("h is", h, s)
        h.copy_(th.zeros_like(h))
        h, s = helper3(h, s)
        t = (h * 3000.0).to(th.float16)
        if t.dtype == th.float16 and th.isinf(t).any():
            lim = th.finfo(t.dtype).max - 1000
            t = th.clamp(t, min=-lim, max=lim)
        h = t.float()
        h, s = helper4(h, s)
        h = h.clamp(min=-1e4, max=1e4)
        return h
