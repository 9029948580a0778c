"""The bundled ``demo`` target: a tiny model with one graph break of each kind.

``graphmend explain demo`` runs it. Each commented line below breaks the graph
under ``torch.compile``; the comment names the break category and the rule
that addresses it:

* ``VG`` a validation ``raise`` on tensor values          -> [Trap]
* ``LC`` ``print``, a ``logging`` call, ``warnings.warn``   -> [Defer]
* ``DC`` a Python ``if`` on a tensor value                 -> [Where]
* ``TI`` ``.item()`` feeding Python control flow          -> [Scalar] (then [Where])

Everything is deterministic: weights come from ``torch.manual_seed(0)`` and
the input from a fixed generator.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

logger = logging.getLogger("graphmend.demo")


class Gate(nn.Module):
    """Scales large activations down; its branch is data-dependent."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.abs().amax() > 2.0:  # DC: branch on a tensor value
            h = h / 2.0
        return h


class DemoModel(nn.Module):
    def __init__(self, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.gate = Gate()
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.abs() > 1e4).any():  # VG: validation raise on tensor values
            raise ValueError("demo: input values must stay within +-1e4")
        h = torch.relu(self.proj(x))
        print("demo: hidden mean", h.mean())  # LC: print
        logger.warning("demo: hidden max %s", h.amax())  # LC: logging
        h = self.gate(h)
        warnings.warn("demo: gate applied")  # LC: warnings.warn
        active = int((h > 0).sum().item())  # TI: .item() feeds Python control flow
        if active > h.numel() // 2:
            h = h * 0.5
        return self.head(h)


def build() -> tuple[nn.Module, tuple, dict]:
    """Return ``(model, args, kwargs)`` for the demo target."""
    torch.manual_seed(0)
    model = DemoModel().eval()
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(2, 16, generator=gen) * 3
    return model, (x,), {}
