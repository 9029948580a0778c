"""Golden tables: what a rule makes of a small source, pinned exactly.

A case is a few lines of module source with its break site marked ``# <-``
(a compound statement on its header line). ``outcome`` hands the marked
statement to the rule through the engine's own ``rewrite`` (the call
``graphmend mend`` makes for each function, and ``graphmend check`` for its
static proof) on a copy of the function's definition, and returns

* ``("rewritten", <the whole function after the rule, ast.unparse'd>)``, or
* ``("declined", <the reason the user reads>)``.

Nothing is traced, compiled or installed: a case takes milliseconds. What the
pipeline decides around a rule (rewrites ahead, graph breaks kept before
asserts, measured capture, never worse, verification) is left to the
model-level tests of each rule's file.

The source is written to a file of its own and imported as the module
``golden_case`` (the name in the site tuples rewrites emit), whose namespace
already holds ``torch``, ``nn``, ``F``, ``warnings``, ``logging`` and
``logger = logging.getLogger("golden_case")``: line 1 of a case is line 1 of
its file. When the source defines ``class Model``, an instance of it is the
live model rules may ask about (what ``self.lin`` holds, [Speculate]'s scan of
its ``forward``); otherwise there is none.

[Trap] also scans the callers' code after the call, on the frame chains from
the model's entry to the site: lines marked ``# <- caller`` make one chain,
entry first; with none there is no chain, as in ``graphmend check`` (the
function alone is judged).
"""

from __future__ import annotations

import ast
import atexit
import copy
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import textwrap
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graphmend.analysis.source import defs_containing
from graphmend.discover.trace import Frame
from graphmend.rewrite.engine import Located, SiteRewrite, rewrite
from graphmend.rules import load_rules

SITE = "# <-"
CALLER = "# <- caller"
MODULE = "golden_case"  # not "golden": that is this module

_DIR = tempfile.mkdtemp(prefix="graphmend-golden-")
atexit.register(shutil.rmtree, _DIR, True)


def _module(source: str) -> types.ModuleType:
    """The case imported as module ``golden_case`` (in ``sys.modules`` until the
    next case): rules read its classes' source through ``inspect``, as on a real model."""
    path = os.path.join(_DIR, f"golden_{hashlib.sha1(source.encode()).hexdigest()[:12]}.py")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(source)
    module = types.ModuleType(MODULE)
    module.__file__ = path
    module.__dict__.update(torch=torch, nn=nn, F=F, warnings=warnings, logging=logging, logger=logging.getLogger(MODULE))
    sys.modules[MODULE] = module
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def case(id: str, source: str, *, rewritten: str | None = None, declined: str | None = None, marks=()):
    """One row of a golden table: ``source`` and exactly one expected outcome,
    the function after the rewrite (indented as in the test file) or the reason
    (``marks``: pytest's, as a row that holds on some torch releases only)."""
    assert (rewritten is None) != (declined is None), "a case expects one outcome"
    expected = ("rewritten", textwrap.dedent(rewritten).strip("\n")) if rewritten is not None else ("declined", declined)
    return pytest.param(source, expected, id=id, marks=marks)


def outcome(rule: str, source: str) -> tuple[str, str]:
    """(``"rewritten"``, the function after ``rule``) or (``"declined"``, its reason)."""
    site, node, _, _ = rewritten(rule, source)
    return ("rewritten", ast.unparse(node)) if site.ok else ("declined", site.reason)


def rewritten(rule: str, source: str) -> tuple[SiteRewrite, ast.AST, types.ModuleType, object]:
    """The site, the function's definition after ``rule``, the case's module and its live model (or None)."""
    source = textwrap.dedent(source).lstrip("\n")
    tree = ast.parse(source)
    marked = [(i, text.rstrip()) for i, text in enumerate(source.splitlines(), 1)]
    (line,) = [i for i, text in marked if text.endswith(SITE)]
    callers = [i for i, text in marked if text.endswith(CALLER)]
    module = _module(source)
    chains = [[Frame(module.__file__, n, defs_containing(tree, n)[0].name, "") for n in [*callers, line]]] if callers else None
    with torch.random.fork_rng(devices=[]):  # building the model draws no number the other tests see
        model = module.Model() if isinstance(getattr(module, "Model", None), type) else None
    fdef = defs_containing(tree, line)[0]
    located = Located(functions=[], code=None, node=copy.deepcopy(fdef), filename=module.__file__, namespace=vars(module))  # type: ignore[arg-type]
    site = SiteRewrite(line=line, rule=load_rules()[rule], chains=chains)
    node = rewrite(located, [site], model)
    if site.ok:  # what the engine installs must compile (ast.unparse prints a one-value BoolOp that does not)
        compile(ast.fix_missing_locations(ast.Module(body=[copy.deepcopy(node)], type_ignores=[])), module.__file__, "exec")
    return site, node, module, model
