"""Capture everything a call makes visible: stdout, stderr, log records, warnings."""

import contextlib
import io
import logging
import sys
import threading
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


class _NotTorchs(io.StringIO):
    """A captured stream without what torch's own loggers write to it (from
    torch 2.14 their console handler writes to the current ``sys.stderr``)."""

    def __init__(self, torchs):
        super().__init__()
        self._torchs = torchs

    def write(self, text):
        return len(text) if getattr(self._torchs, "active", False) else super().write(text)


@contextlib.contextmanager
def capture():
    cap = Captured()
    torchs = threading.local()  # set while a torch logger's record is handled on this thread
    out, err = _NotTorchs(torchs), _NotTorchs(torchs)
    original = logging.Logger.handle

    def handle(self, record):
        if not record.name.startswith("torch"):
            cap.records.append(
                (record.name, record.levelname, record.pathname, record.lineno, record.funcName, record.getMessage())
            )
            return original(self, record)
        torchs.active = True
        try:
            return original(self, record)
        finally:
            torchs.active = False

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
    from graphmend.rewrite.verify import fresh_once_caches

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



class _ThreadStream:
    """``sys.stdout`` / ``sys.stderr`` under ``ThreadCapture``: a write goes to
    the innermost capture of the writing thread, else to the stream itself."""

    def __init__(self, owner, name, inner):
        self._owner, self._name, self._inner = owner, name, inner

    def _target(self):
        cap = self._owner.current()
        return self._inner if cap is None else cap[self._name]

    def write(self, text):
        return self._target().write(text)

    def writelines(self, lines):
        self._target().writelines(lines)

    def flush(self):
        self._target().flush()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class ThreadCapture:
    """``capture()`` for several threads at once: inside ``installed()`` (entered
    by one thread around the whole block), each ``capturing()`` collects what
    its own thread prints (stdout, stderr), logs (records, not torch's; the
    record then goes on to the handlers, as under ``capture()``: Python's
    last-resort handler writes it to that thread's stderr) and warns (every
    warning shown: the process's filters are ``always`` for the block).

    Python's warning filters are process-wide; the per-thread part is where a
    shown warning goes. ``left`` names what ``installed()`` found replaced by
    another owner on exit (it puts its own saved streams back regardless)."""

    def __init__(self):
        self._threading = threading
        self._stacks = {}  # thread ident -> open captures, innermost last
        self._torchs = threading.local()  # set while a torch logger's record is handled on a thread
        self.left = []

    def current(self):
        stack = self._stacks.get(self._threading.get_ident())
        return stack[-1] if stack else None

    @contextlib.contextmanager
    def installed(self):
        saved_out, saved_err = sys.stdout, sys.stderr
        out, err = _ThreadStream(self, "stdout", saved_out), _ThreadStream(self, "stderr", saved_err)
        sys.stdout, sys.stderr = out, err
        original_handle = logging.Logger.handle
        owner = self

        def handle(logger, record):
            cap = owner.current()
            if not record.name.startswith("torch"):
                if cap is not None:
                    cap["records"].append(
                        (record.name, record.levelname, record.pathname, record.lineno, record.funcName, record.getMessage())
                    )
                return original_handle(logger, record)
            owner._torchs.active = True  # torch's console handler may write to this thread's stream
            try:
                return original_handle(logger, record)
            finally:
                owner._torchs.active = False

        logging.Logger.handle = handle
        try:
            with warnings.catch_warnings(record=True):  # showwarning as the default, restored on exit
                warnings.simplefilter("always")
                shown = warnings._showwarnmsg_impl

                def show(message):
                    cap = owner.current()
                    if cap is None:
                        return shown(message)
                    cap["warnings"].append(
                        (message.category.__name__, str(message.message), message.filename, message.lineno)
                    )

                warnings._showwarnmsg_impl = show
                yield self
        finally:
            # graphmend's own channel wrappers stay once installed (they pass through outside
            # a region or capture): what matters is that they wrap this capture's hooks.
            if unwrapped(logging.Logger.handle) is not handle:
                self.left.append(f"logging.Logger.handle: {_named(logging.Logger.handle)}")
            logging.Logger.handle = original_handle
            for name, mine, saved in (("stdout", out, saved_out), ("stderr", err, saved_err)):
                if unwrapped(getattr(sys, name)) is not mine:
                    self.left.append(f"sys.{name}: {_named(type(getattr(sys, name)))} wrapping {_named(type(getattr(getattr(sys, name), '_inner', None)))}")
                setattr(sys, name, saved)

    @contextlib.contextmanager
    def capturing(self):
        """A ``Captured`` with this thread's stdout, stderr, records and warnings of the block."""
        cap = Captured()
        buffers = {"stdout": _NotTorchs(self._torchs), "stderr": _NotTorchs(self._torchs), "records": cap.records,
                   "warnings": cap.warnings}
        stack = self._stacks.setdefault(self._threading.get_ident(), [])
        stack.append(buffers)
        try:
            yield cap
        finally:
            stack.remove(buffers)
            cap.stdout, cap.stderr = buffers["stdout"].getvalue(), buffers["stderr"].getvalue()



def unwrapped(obj):
    """``obj`` without graphmend's channel wrappers on top (each tagged ``_graphmend``,
    keeping what it wraps as ``_inner``; installed once, they pass through)."""
    while isinstance(getattr(obj, "__dict__", None), dict) and "_graphmend" in vars(obj):
        obj = vars(obj)["_inner"]
    return obj


def _named(value):
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
