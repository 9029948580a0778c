"""graphmend: find and fix torch.compile graph breaks by rewriting source.

Python API::

    import graphmend
    report = graphmend.explain(model, x)        # every break, why, which rule
    print(report.to_dict())
"""

from .errors import GraphmendError, TargetError, UnsupportedEnvironment
from .explain import ExplainReport, explain
from .sites import BreakSite
from .targets import Target, load_target

__version__ = "0.1.0"

__all__ = [
    "BreakSite",
    "ExplainReport",
    "GraphmendError",
    "Target",
    "TargetError",
    "UnsupportedEnvironment",
    "explain",
    "load_target",
]
