"""The torch and Python versions graphmend supports, and what differs between them.

graphmend reads Dynamo's graph-break log and relies on how Dynamo treats each
pattern; both change between torch releases. ``RELEASES`` is the one table of
what graphmend knows of each supported minor release, measured on each
(``docs/torch-versions.md``); outside it ``check_environment`` refuses with
one line. Code that must act differently asks ``release()`` for the fact,
never the version number. (The runtime, which imports nothing else of
graphmend, detects the two facts it needs directly; the table names them.)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from graphmend.errors import UnsupportedEnvironment

SUPPORTED_PYTHON = (3, 10)


@dataclass(frozen=True)
class TorchRelease:
    """What graphmend must know of one torch minor release."""

    version: tuple[int, int]
    # torch._logging's console handler writes to the *current* sys.stderr, so
    # torch's own warnings pass through graphmend's stream watch (the runtime
    # tells them apart by the log record's file: regions._log_record_written).
    logs_to_current_stderr: bool
    # torch._assert(tensor, msg) compiles into the graph instead of breaking.
    assert_in_graph: bool
    # config.reorderable_logging_functions accepts logger methods (pytorch #190840).
    reorderable_logging: bool
    # Torch bugs, measured (tests/test_compat.py); graphmend avoids what it can:
    # - an autograd.Function given one tensor as two inputs loses one of its
    #   gradients under Dynamo: [Where] never selects a value against itself;
    duplicate_input_loses_grad: bool
    # - a format spec on a float Dynamo made symbolic (`f"{t.max().item():.3f}"`
    #   in a frame resumed after a break, once a recompile makes the float
    #   dynamic) raises InternalTorchDynamoError (pytorch #197093). The original
    #   fails the same way under torch.compile; which calls reach it depends on
    #   where the graphs were cut, so the fuzz harness counts it apart.
    symbolic_format_crashes: bool
    # - Inductor's emulate_precision_casts leaves out an overflow test on a
    #   low-precision cast (`isinf(t.to(float16))` fused sees no inf): a guard
    #   the original ran after a break sees fp32 in the mended graph. Nothing to
    #   mend (docs/torch-issues.md); the fuzz harness counts it apart.
    emulated_casts_miss_overflow: bool
    # - after an attribute store in a compiled frame, the stores made after a
    #   torch.cond are lost (docs/torch-issues.md): [Where] declines torch.cond
    #   where a store may run before it.
    cond_drops_later_stores: bool


# A release joins the table once graphmend's suite, its zoo rows and a fuzz run
# pass on it (docs/torch-versions.md says what is measured and what is pending).
RELEASES: dict[tuple[int, int], TorchRelease] = {
    r.version: r
    for r in (
        TorchRelease(
            (2, 12), logs_to_current_stderr=False, assert_in_graph=False, reorderable_logging=False,
            duplicate_input_loses_grad=True, symbolic_format_crashes=False, emulated_casts_miss_overflow=True,
            cond_drops_later_stores=False,
        ),
        TorchRelease(
            (2, 13), logs_to_current_stderr=False, assert_in_graph=False, reorderable_logging=False,
            duplicate_input_loses_grad=False, symbolic_format_crashes=False, emulated_casts_miss_overflow=False,
            cond_drops_later_stores=True,
        ),
        TorchRelease(
            (2, 14), logs_to_current_stderr=True, assert_in_graph=False, reorderable_logging=True,
            duplicate_input_loses_grad=False, symbolic_format_crashes=True, emulated_casts_miss_overflow=False,
            cond_drops_later_stores=True,
        ),
        TorchRelease(
            (2, 15), logs_to_current_stderr=True, assert_in_graph=True, reorderable_logging=True,
            duplicate_input_loses_grad=False, symbolic_format_crashes=True, emulated_casts_miss_overflow=False,
            cond_drops_later_stores=False,
        ),
    )
}
SUPPORTED_TORCH = (min(RELEASES), (max(RELEASES)[0], max(RELEASES)[1] + 1))  # [min, max) as (major, minor)


def torch_version_tuple(version: str) -> tuple[int, int]:
    parts = version.split("+", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def release(torch_version: str | None = None) -> TorchRelease:
    """The table's row for ``torch_version`` (the installed torch by default)."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    found = RELEASES.get(torch_version_tuple(torch_version))
    if found is None:
        raise UnsupportedEnvironment(_unsupported(torch_version))
    return found


def _unsupported(torch_version: str) -> str:
    low, high = SUPPORTED_TORCH
    top = (high[0], high[1] - 1)
    return (
        f"graphmend supports torch {low[0]}.{low[1]} to {top[0]}.{top[1]}, found torch {torch_version}; "
        f"install one of them (pip install torch=={top[0]}.{top[1]}.*)"
    )


def check_environment(torch_version: str | None = None) -> None:
    """Raise UnsupportedEnvironment (one line) outside the supported range."""
    if sys.version_info[:2] < SUPPORTED_PYTHON:
        raise UnsupportedEnvironment(
            f"graphmend needs Python >= {SUPPORTED_PYTHON[0]}.{SUPPORTED_PYTHON[1]}, "
            f"this is {sys.version_info[0]}.{sys.version_info[1]}"
        )
    release(torch_version)
