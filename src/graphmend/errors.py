"""User-facing errors.

Every problem caused by the user's input (a missing file, a factory that
raises, an unsupported torch) is a :class:`GraphmendError`. The CLI prints its
message as one line and exits with status 2; ``--debug`` shows the traceback.
Anything else that escapes is a bug in graphmend.
"""

from __future__ import annotations


class GraphmendError(Exception):
    """A problem with what the user handed graphmend; the message is one line."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def describe(exc: BaseException, limit: int | None = None) -> str:
    """``Type: first line of the message`` (cut to ``limit`` characters), for a warning or a decline reason."""
    first = (str(exc).strip().splitlines() or [""])[0]
    if limit is not None and len(first) > limit:
        first = first[: limit - 3] + "..."
    return f"{type(exc).__name__}: {first}"


class TargetError(GraphmendError):
    """The target cannot be loaded, built, or run eagerly."""


class EagerFailure(TargetError):
    """The model raises when run eagerly on the given inputs (the exception is the cause)."""


class CompileFailure(TargetError):
    """The model runs eagerly but ``torch.compile`` raises on it before any rewrite."""


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception ``exc`` was raised from (torch wraps a user's
    TypeError in ``TorchRuntimeError: RuntimeError when making fake tensor call``)."""
    seen = {id(exc)}
    while True:
        inner = exc.__cause__ or exc.__context__  # also a context torch suppressed (`raise ... from None`)
        if inner is None or id(inner) in seen:
            return exc
        seen.add(id(inner))
        exc = inner


class UnsupportedEnvironment(GraphmendError):
    """The installed torch or Python is outside the supported range."""
