"""graphmend: find and fix torch.compile graph breaks by rewriting source.

Python API::

    import graphmend
    report = graphmend.explain(model, x)        # every break, why, which rule
    compiled = graphmend.compile(model)         # torch.compile, breaks mended first
    compiled(x); compiled.report                # what was fixed, declined and why
    graphmend.unmend(model)                     # every original function restored
"""

from .api import compile, mend, mended, unmend
from .errors import GraphmendError, TargetError, UnsupportedEnvironment
from .explain import ExplainReport, explain
from .fallback import BackendFallbackWarning, with_fallback
from .mend import MendReport, SiteOutcome
from .sites import BreakSite
from .targets import Target, load_target

__version__ = "0.1.0"

__all__ = [
    "BackendFallbackWarning",
    "BreakSite",
    "ExplainReport",
    "GraphmendError",
    "Target",
    "TargetError",
    "UnsupportedEnvironment",
    "compile",
    "explain",
    "mend",
    "mended",
    "unmend",
    "with_fallback",
    "MendReport",
    "SiteOutcome",
    "load_target",
]
