"""The torch and Python versions graphmend supports, checked before any work.

graphmend reads Dynamo's graph-break log and relies on how Dynamo treats each
pattern; both change between torch releases. The supported range is the one
the behaviour was measured on (``dynamo-behaviour.md``): torch 2.13.x.
"""

from __future__ import annotations

import sys

from graphmend.errors import UnsupportedEnvironment

SUPPORTED_TORCH = ((2, 13), (2, 14))  # [min, max) as (major, minor)
SUPPORTED_PYTHON = (3, 10)


def torch_version_tuple(version: str) -> tuple[int, int]:
    parts = version.split("+", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def check_environment(torch_version: str | None = None) -> None:
    """Raise UnsupportedEnvironment (one line) outside the supported range."""
    if sys.version_info[:2] < SUPPORTED_PYTHON:
        raise UnsupportedEnvironment(
            f"graphmend needs Python >= {SUPPORTED_PYTHON[0]}.{SUPPORTED_PYTHON[1]}, "
            f"this is {sys.version_info[0]}.{sys.version_info[1]}"
        )
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    low, high = SUPPORTED_TORCH
    if not (low <= torch_version_tuple(torch_version) < high):
        raise UnsupportedEnvironment(
            f"graphmend supports torch {low[0]}.{low[1]}.x, found torch {torch_version}; "
            f"install torch=={low[0]}.{low[1]}.0"
        )
