"""graphmend: find and fix torch.compile graph breaks by rewriting source.

Python API::

    import graphmend
    report = graphmend.explain(model, x)        # every break, why, which rule
    compiled = graphmend.compile(model)         # torch.compile, breaks mended first
    compiled(x); compiled.report                # what was fixed, declined and why
    graphmend.unmend(model)                     # every original function restored

The names below load on first use: mended code imports ``graphmend.runtime``,
which must not load the whole tool with it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_API = {
    "compile": "api",
    "mend": "api",
    "mended": "api",
    "unmend": "api",
    "GraphmendError": "errors",
    "TargetError": "errors",
    "UnsupportedEnvironment": "errors",
    "ExplainReport": "discover.explain",
    "explain": "api",
    "BackendFallbackWarning": "rewrite.fallback",
    "with_fallback": "rewrite.fallback",
    "MendReport": "pipeline",
    "SiteOutcome": "pipeline",
    "BreakSite": "discover.sites",
    "Target": "models.targets",
    "load_target": "models.targets",
}

__all__ = sorted(_API)


# the layers, bottom first (docs/design.md); each loads on first use too
_PACKAGES = ("runtime", "errors", "compat", "analysis", "models", "discover", "rules", "rewrite", "check", "passes", "pipeline", "api", "tools")


def __getattr__(name: str) -> Any:
    if name in _PACKAGES:
        return importlib.import_module(f"{__name__}.{name}")  # binds it on the package
    if name not in _API:
        raise AttributeError(f"module 'graphmend' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_API[name]}"), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
