"""Mending's own runs of the model, kept apart from the user's process.

Mending calls the model many times (eager observations, traces under
Dynamo). Those calls are graphmend's, not the user's, so two things they do
must not reach the user:

* **Output.** ``captured()`` collects what the calls print (``sys.stdout``,
  ``sys.stderr``), log (``logging.Logger.handle``) and warn
  (``warnings._showwarnmsg``) on the thread that runs them, and only there.
  From the first capture on, those three channels are routed per thread:
  every other thread's prints, log records and warnings, and all of them
  outside a capture, go where they always go, at once. (Swapping ``sys.stdout`` for the whole process, as
  ``contextlib.redirect_stdout`` does, would swallow what other threads of a
  server print while the first call mends.) torch's own log records pass
  through: discovery reads Dynamo's from its handler. Once-only logger
  methods (transformers' ``warning_once``) get a private cache per capture,
  so a capture neither sees the user's earlier messages as logged nor
  swallows the user's next one.
* **Randomness.** ``random_state_kept()`` puts every generator back where it
  was: torch's CPU generator and each initialised CUDA device's, Python's
  ``random`` and numpy's global one. A mended first call then draws exactly
  what the call alone would have (the same dropout masks, the same later
  ``torch.rand``).

Warnings follow the process's filters on the capturing thread too (Python
3.11 has no per-thread filters); each capture starts and ends with fresh
once-per-place registries (``warnings._filters_mutated``, what
``warnings.catch_warnings`` does on entry and exit), so mending never makes
a warning the user has not seen yet count as already shown.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import random
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from graphmend.runtime.regions import compiling_here, random_state, set_random_state

_ONCE_METHODS = ("warning_once", "info_once")


@dataclass
class Effects:
    """What the calls of one capture printed, logged and warned, in order."""

    stdout: io.StringIO = field(default_factory=io.StringIO)
    stderr: io.StringIO = field(default_factory=io.StringIO)
    records: list[tuple] = field(default_factory=list)  # (logger, level, path, line, function, message)
    warnings: list[tuple] = field(default_factory=list)  # (category, message, path, line)
    once: dict[str, Callable] = field(default_factory=dict)  # private caches of once-only logger methods


# thread ident -> its open captures, innermost last
_CAPTURES: dict[int, list[Effects]] = {}
_GUARD = threading.Lock()


def _current() -> Effects | None:
    stack = _CAPTURES.get(threading.get_ident())
    return stack[-1] if stack else None


class _Router:
    """``sys.stdout`` / ``sys.stderr`` from the first capture on: a capturing
    thread's writes go to its capture, every other write to the stream itself."""

    def __init__(self, name: str, inner: Any) -> None:
        self._name = name
        self._inner = inner
        self._graphmend = "isolation"

    def _target(self) -> Any:
        effects = _current()
        return self._inner if effects is None else getattr(effects, self._name)

    def write(self, text: str) -> int:
        return self._target().write(text)

    def writelines(self, lines: Any) -> None:
        self._target().writelines(lines)

    def flush(self) -> None:
        self._target().flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _tagged(fn: Any, inner: Any) -> Any:
    fn._inner, fn._graphmend = inner, "isolation"
    return fn


def _handle_router(inner: Callable) -> Callable:
    def handle(logger: logging.Logger, record: logging.LogRecord) -> None:
        effects = _current()
        if effects is None or record.name.startswith("torch."):
            inner(logger, record)
            return
        effects.records.append(
            (record.name, record.levelno, record.pathname, record.lineno, record.funcName, record.getMessage())
        )

    return _tagged(handle, inner)


def _showwarnmsg_router(inner: Callable) -> Callable:
    def showwarnmsg(message: Any) -> None:
        effects = _current()
        if effects is None:
            inner(message)
            return
        if compiling_here():
            # Warned while this thread compiles: the compiler's or a library's fake kernel
            # (torchvision's nms on torch 2.14: "`create_unbacked_symint` is deprecated"),
            # never the model's own warning (Dynamo runs that after a break, or defers it).
            return
        effects.warnings.append((message.category.__name__, str(message.message), message.filename, message.lineno))

    return _tagged(showwarnmsg, inner)


def _once_router(name: str, original: Callable) -> Callable:
    raw = original.__wrapped__

    @functools.wraps(raw)
    def route(self: logging.Logger, *args: Any, **kwargs: Any) -> Any:
        effects = _current()
        if effects is None:
            return original(self, *args, **kwargs)
        if name not in effects.once:
            effects.once[name] = functools.lru_cache(None)(raw)
        return effects.once[name](self, *args, **kwargs)

    route.cache_clear, route.cache_info = original.cache_clear, original.cache_info  # still an lru_cache to others
    return _tagged(route, original)


def _route() -> None:
    """Route the channels per thread (at every capture's start; see the module doc).

    Routers are installed once and left in place: with no capture they only
    pass through. (Putting them back when the last capture ended went wrong
    with threads: a deferral region of another thread that opened meanwhile
    had wrapped the router, and restored it later.) Installed again only
    where something replaced them since, and for once-only logger methods a
    library defined since (transformers, imported while capturing)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not _routed(stream):
            setattr(sys, name, _Router(name, stream))
    if not _routed(logging.Logger.handle):
        logging.Logger.handle = _handle_router(logging.Logger.handle)  # type: ignore[method-assign]
    show = getattr(warnings, "_showwarnmsg", None)
    if show is not None and not _routed(show):
        warnings._showwarnmsg = _showwarnmsg_router(show)  # type: ignore[attr-defined]
    for name in _ONCE_METHODS:
        method = vars(logging.Logger).get(name)
        if hasattr(method, "cache_clear") and getattr(method, "__wrapped__", None) is not None and not _routed(method):
            setattr(logging.Logger, name, _once_router(name, method))


def _routed(obj: Any) -> bool:
    """Whether a router is ``obj`` or lies below it under graphmend's wrappers
    only (each tagged ``_graphmend``, keeping what it wraps as ``_inner``; the
    runtime's watchers among them). One under someone else's wrapper would
    see their writes too late."""
    for _ in range(64):
        own = getattr(obj, "__dict__", None)
        if not isinstance(own, dict) or "_graphmend" not in own:
            return False
        if own["_graphmend"] == "isolation":
            return True
        obj = own.get("_inner")
    return False


@contextlib.contextmanager
def captured() -> Iterator[Effects]:
    """Capture what this thread prints, logs and warns in the block (see the module doc)."""
    effects = Effects()
    ident = threading.get_ident()
    with _GUARD:
        _route()
        _CAPTURES.setdefault(ident, []).append(effects)
        warnings._filters_mutated()  # type: ignore[attr-defined]
    try:
        yield effects
    finally:
        with _GUARD:
            stack = _CAPTURES[ident]
            stack.remove(effects)
            if not stack:
                del _CAPTURES[ident]
            warnings._filters_mutated()  # type: ignore[attr-defined]


# --------------------------------------------------------------------------
# randomness


def seed_everything(seed: int) -> None:
    """Seed torch's generators, Python's and numpy's (once imported): each
    observation of a model starts from the same random state."""
    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Every random generator as it was before the block, after it (see the module doc)."""
    states = random_state()
    try:
        yield
    finally:
        set_random_state(states)
