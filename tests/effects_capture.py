"""Capture everything a call makes visible: stdout, stderr, log records, warnings."""

import contextlib
import io
import logging
import warnings

import torch


class Captured:
    def __init__(self):
        self.stdout = ""
        self.stderr = ""
        self.records = []
        self.warnings = []
        self.exception = None
        self.output = None

    def effects(self):
        return (self.stdout, self.stderr, self.records, self.warnings, self.exception)


@contextlib.contextmanager
def capture():
    cap = Captured()
    out, err = io.StringIO(), io.StringIO()
    original = logging.Logger.handle

    def handle(self, record):
        if not record.name.startswith("torch"):
            cap.records.append(
                (record.name, record.levelname, record.pathname, record.lineno, record.funcName, record.getMessage())
            )
        return original(self, record)

    logging.Logger.handle = handle
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings(
            record=True
        ) as caught:
            warnings.simplefilter("always")
            yield cap
    finally:
        logging.Logger.handle = original
    cap.stdout, cap.stderr = out.getvalue(), err.getvalue()
    cap.warnings = [(w.category.__name__, str(w.message), w.filename, w.lineno) for w in caught]


def run(fn, *args, **kwargs):
    """Call fn under capture; returns Captured with .output or .exception.

    Once-only logger methods get a private cache, so every run is a "first"
    call whatever ran before it in the test process."""
    from graphmend.verify import fresh_once_caches

    with capture() as cap, torch.no_grad(), fresh_once_caches():
        try:
            cap.output = fn(*args, **kwargs)
        except Exception as exc:
            cap.exception = (type(exc).__name__, str(exc))
    return cap


class CountingBackend:
    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def bits_equal(a, b):
    """Same dtype, shape and bytes (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))

