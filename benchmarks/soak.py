"""Soak: call a mended, compiled model N times and watch memory.

Every call defers a print, a log record and a warning and computes a trap
flag; each is flushed at the end of its call. Resident memory (RSS) and the
runtime's buffers are sampled every N/10 calls: they must stay flat.

    .venv/bin/python benchmarks/soak.py [N]     (default 1,000,000)
"""

import contextlib
import gc
import logging
import os
import sys
import time
import warnings

import torch

import graphmend
from graphmend import runtime

logger = logging.getLogger("soak")


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        if torch.isnan(x).any():
            raise ValueError("soak: NaN input")
        h = self.lin(x)
        print("soak: mean", h.mean())
        logger.warning("soak: max %s", h.amax())
        warnings.warn("soak: step")
        return h


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    calls = {"graphs": 0}

    def backend(gm, example_inputs):
        calls["graphs"] += 1
        return gm.forward

    logging.basicConfig(stream=open(os.devnull, "w"), level=logging.WARNING)
    warnings.simplefilter("ignore")  # the registry keeps one entry per site either way
    model = graphmend.compile(Model().eval(), backend=backend)
    samples = []
    start = time.perf_counter()
    out = sys.stdout
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), torch.no_grad():
        for i in range(n + 1):
            if i % max(1, n // 10) == 0:
                gc.collect()
                samples.append((i, rss_mb(), time.perf_counter() - start))
                print(f"after {i:>9,} calls: RSS {samples[-1][1]:7.1f} MB  ({samples[-1][2]:6.1f} s)", file=out, flush=True)
            model(x)
    report = model.report
    print(f"applied sites: {len(report.applied)}, graphs compiled: {calls['graphs']}")
    first, last = samples[1][1], samples[-1][1]  # after warm-up (compile) to the end
    print(f"RSS growth from call {samples[1][0]:,} to {samples[-1][0]:,}: {last - first:+.1f} MB; "
          f"runtime buffers open: {runtime.active()}")


if __name__ == "__main__":
    main()
