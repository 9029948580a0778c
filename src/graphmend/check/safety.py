"""Whether a site's rewrite is safe to apply without a run.

The answer comes from the rules themselves: the sites of one function are
handed to the engine's ``rewrite`` (the same call ``graphmend mend`` makes,
bottom-up, one shared context) on a copy of the function, with the module's
static namespace (``scope.ModuleScope``) and no live model. A rule that
declines gives the reason shown after ``needs a run:``; whatever a rule
could only prove with the live model (which modules ``self.layer`` holds, a
function imported from another package) is a decline here. On top of the
rule's own proof:

* [Defer] (its ``proof`` "unchanged after"): the arguments must not be changed in place later in the function
  (``h.add_(...)``, ``h[i] = ...``, ``h += ...``): the deferred call would
  otherwise have to rely on its snapshot;
* [Trap] ("no imported call after"): a call after the check of a function imported from another module
  is a possible state change the linter cannot read.

What the static view cannot see: the code that runs in a *caller* after the
function returns (``mend`` scans those frames on the live model). A [Trap]
site marked safe is safe within its own function.
"""

from __future__ import annotations

import ast
import copy

from graphmend.analysis.effects import root_of
from graphmend.analysis.facts import path_to
from graphmend.analysis.purity import mutating_method, stores
from graphmend.analysis.source import bound_names
from graphmend.check.scope import ModuleScope
from graphmend.rewrite.engine import Located, SiteRewrite, rewrite
from graphmend.rules import load_rules


def judge(
    fdef: ast.FunctionDef | ast.AsyncFunctionDef, sites: list[tuple[ast.stmt, str]], scope: ModuleScope
) -> list[str | None]:
    """For each (statement, rule) of one function: None when the rule rewrites
    it with a static proof, else why not."""
    rules = load_rules()
    located = Located(functions=[], code=None, node=copy.deepcopy(fdef), filename=scope.path, namespace=scope.namespace)  # type: ignore[arg-type]
    rewrites = [SiteRewrite(line=stmt.lineno, rule=rules[rule]) for stmt, rule in sites]
    rewrite(located, rewrites)
    out: list[str | None] = []
    for (stmt, rule), site in zip(sites, rewrites):
        why = None if site.ok else site.reason
        if why is None and rules[rule].proof:
            why = PROOFS[rules[rule].proof](stmt, fdef, scope)
        out.append(why)
    return out


def continuation(fdef: ast.FunctionDef | ast.AsyncFunctionDef, stmt: ast.stmt) -> list[ast.stmt]:
    """The statements of ``fdef`` that can run after ``stmt``: those after it in
    its block and every enclosing block, and the whole body of an enclosing
    loop (its next iterations)."""
    path = path_to(fdef.body, stmt) or []
    after: list[ast.stmt] = []
    for block, index in path:
        after.extend(block[index + 1 :])
        if isinstance(block[index], (ast.For, ast.AsyncFor, ast.While)):
            after.extend(block[index].body)
    return after


def _changed_after(stmt: ast.stmt, fdef: ast.FunctionDef | ast.AsyncFunctionDef, scope: ModuleScope) -> str | None:
    """Whether a name the call shows is changed in place after it."""
    call = stmt.value  # type: ignore[attr-defined]
    shown = {
        n.id
        for arg in [*call.args, *(k.value for k in call.keywords)]
        for n in ast.walk(arg)
        if isinstance(n, ast.Name)
    }
    for later in continuation(fdef, stmt):
        for node in ast.walk(later):
            changed = _in_place_change(node)
            if changed is not None and changed[0] in shown:
                return f"`{changed[0]}` is changed in place after the call ({changed[1]}, line {node.lineno})"
    return None


def _in_place_change(node: ast.AST) -> tuple[str, str] | None:
    """(name, how) when ``node`` changes the object a name holds."""
    if isinstance(node, ast.AugAssign):
        root = root_of(node.target)
        return (root, f"`{ast.unparse(node.target)} {_OPS.get(type(node.op), '?')}= ...`") if root else None
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        for sub in stores(node.targets if isinstance(node, ast.Assign) else [node.target]):
            root = root_of(sub)
            if root:
                return root, f"`{ast.unparse(sub)} = ...`"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        attr = node.func.attr
        if mutating_method(attr):
            root = root_of(node.func.value)
            return (root, f"`.{attr}(...)`") if root else None
    return None


_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
        ast.MatMult: "@", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>"}


def _imported_call_after(stmt: ast.stmt, fdef: ast.FunctionDef | ast.AsyncFunctionDef, scope: ModuleScope) -> str | None:
    """Whether a function imported from another module is called after the check."""
    local = bound_names(fdef)
    for later in continuation(fdef, stmt):
        for node in ast.walk(later):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                name = node.func.id
                if name not in local and scope.is_imported(name):
                    return (
                        f"`{name}(...)` runs after the check (line {node.lineno}), imported from "
                        f"{scope.imported_from[name]}: its effects are not read from source"
                    )
    return None


# A rule's ``proof`` (the registry) -> the static check it needs on top of its rewrite.
PROOFS = {"unchanged after": _changed_after, "no imported call after": _imported_call_after}
