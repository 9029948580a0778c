"""One pass over one parsed file: every candidate site, with its code.

Each function is scanned once, statement by statement (nested functions are
scanned on their own). What a site needs:

* GM101-103 (``if`` / ``while`` / ``a if t else b``), GM301-303 (raise /
  ``assert`` / ``torch._assert``): Python reads the truth of a provably-tensor
  expression (``tensors.tensor_truth``), in any function;
* GM201-203 (print / logger / warnings.warn): the call is in ``forward`` of an
  ``nn.Module`` subclass of the file or in a function it reaches
  (``scope.reachable_from_forward``);
* GM401-402 (opt-in, [Scalar]): ``.item()`` / ``.tolist()`` / ``.nonzero()`` on
  a proven tensor, ``torch.nonzero``, indexing with a boolean tensor; not
  inside a deferred call's arguments or a ``raise``, which only run when they
  act. Never ``safe``: [Scalar] decides on the live model.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from graphmend.analysis.effects import is_guard_if, is_side_effect_call
from graphmend.analysis.facts import FunctionFacts, is_tensor_expr, is_torch_attr
from graphmend.analysis.source import dotted_name
from graphmend.check import safety
from graphmend.check.scope import ModuleScope, reachable_from_forward
from graphmend.check.tensors import (
    is_bool_tensor,
    optimistic_facts,
    tensor_facts,
    tensor_truth,
)
from graphmend.rules import check_codes, rules_that

#: code -> (rule or None, what it flags): GM000, and each rule's own codes (the registry).
CODES: dict[str, tuple[str | None, str]] = {"GM000": (None, "the file could not be parsed"), **check_codes()}

_EFFECT_CODES = {"print": "GM201", "warn": "GM203", "warnings.warn": "GM203", "warnings.warn_explicit": "GM203"}

#: Codes reported only when selected (``--select GM4``), and why [Scalar]
#: needs a run for them: its source rewrites depend on how the value is used
#: and on dtypes and devices, and the capture setting it falls back to is kept
#: only when a measured run shows fewer graphs.
OPT_IN = {
    "GM401": "[Scalar] decides on the live model: a source rewrite where the value's use allows it, "
    "else `capture_scalar_outputs` when a measured run shows fewer graphs "
    "([Speculate] may guess a value that steers shapes, under `graphmend.compile`)",
    "GM402": "[Scalar] decides on the live model: `capture_dynamic_output_shape_ops` "
    "when a measured run shows fewer graphs",
}

#: Codes whose rewrite always needs a run, and why (no statement is judged for them).
_NEVER_SAFE = {"GM103": "[Where] rewrites `if` statements; a conditional expression is left as it is", **OPT_IN}


@dataclass
class Finding:
    path: str
    line: int
    col: int  # 1-based, in characters
    code: str
    message: str
    function: str  # qualified name of the enclosing function ("" for GM000)
    safe: bool = False
    why: str | None = None  # why the rewrite needs a run (None when safe or out of scope)

    @property
    def rule(self) -> str | None:
        return CODES[self.code][0]

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "line": self.line,
            "col": self.col,
            "code": self.code,
            "rule": self.rule,
            "message": self.message,
            "function": self.function,
            "safe": self.safe,
            "why": self.why,
        }


def find_in_source(
    path: str, source: bytes, opt_in: bool = True, namespace: dict | None = None, classes: set[str] | None = None
) -> list[Finding]:
    """The sites of one file (a single GM000 finding when it does not parse);
    ``opt_in``: look for GM4xx too. ``graphmend mend`` passes what it knows
    from the live model: ``namespace``, the file's globals, for the names the
    source alone leaves unknown (``nn = torch.nn``); ``classes``, the names of
    the module classes the model uses, whose ``forward`` alone runs."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        return [Finding(path, exc.lineno or 1, exc.offset or 1, "GM000", f"syntax error: {exc.msg} (file skipped)", "")]
    except ValueError as exc:  # null bytes
        return [Finding(path, 1, 1, "GM000", f"cannot parse: {exc} (file skipped)", "")]
    scope = ModuleScope.of(path, tree)
    if namespace is not None:
        scope.learn(namespace)
    lines = source.splitlines()
    scans = {id(fdef): _FunctionScan(scope, fdef, name, lines, opt_in) for fdef, name in _functions(tree.body, "")}
    for scan in scans.values():
        scan.run()
    reached = reachable_from_forward(scope, lambda f: scans[id(f)].calls, lambda f: scans[id(f)].nested, classes)
    out: list[Finding] = []
    for key, scan in scans.items():
        out.extend(scan.findings(reached=key in reached))
    return out


def _functions(body: list[ast.stmt], prefix: str):
    """(def, qualified name) of every function, nested ones included."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            yield node, name
            yield from _functions(node.body, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node.body, prefix + node.name + ".")
        else:
            for field in ("body", "orelse", "finalbody"):
                yield from _functions(getattr(node, field, []) or [], prefix)
            for handler in getattr(node, "handlers", []) or []:
                yield from _functions(handler.body, prefix)
            for case in getattr(node, "cases", []) or []:
                yield from _functions(case.body, prefix)


def _short(node: ast.AST, width: int = 60) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= width else text[: width - 3] + "..."


class _FunctionScan:
    """The sites of one function, found in one walk of its own body."""

    def __init__(self, scope: ModuleScope, fdef, qualname: str, lines: list[bytes], opt_in: bool) -> None:
        self.scope, self.fdef, self.qualname, self.lines = scope, fdef, qualname, lines
        self.opt_in = opt_in
        self.optimistic = optimistic_facts(fdef, scope.namespace)
        self._facts: FunctionFacts | None = None
        self.found: list[tuple[str, ast.AST, ast.stmt, str]] = []  # code, node, statement, message
        self.calls: list[ast.Call] = []  # every call of the body (for reachability)
        self.nested: list[ast.FunctionDef | ast.AsyncFunctionDef] = []

    @property
    def facts(self) -> FunctionFacts:
        if self._facts is None:  # one walk of the function, only when a question needs it
            self._facts = tensor_facts(self.fdef, self.scope.namespace)
        return self._facts

    def truth(self, test: ast.expr) -> ast.expr | None:
        if tensor_truth(test, self.optimistic) is None:
            return None
        return tensor_truth(test, self.facts)

    def is_tensor(self, node: ast.expr) -> bool:
        return is_tensor_expr(node, self.optimistic) and is_tensor_expr(node, self.facts)

    def run(self) -> None:
        self._block(self.fdef.body)

    def findings(self, reached: bool) -> list[Finding]:
        """The findings, judged; [Defer] sites only when forward reaches the function."""
        found = [item for item in self.found if reached or CODES[item[0]][0] not in rules_that("defers_output")]
        out = [Finding(self.scope.path, node.lineno, self._col(node), code, message, self.qualname)
               for code, node, _, message in found]
        judged = [(f, stmt) for f, (_, _, stmt, _) in zip(out, found) if f.rule is not None and f.code not in _NEVER_SAFE]
        for finding in out:
            finding.why = _NEVER_SAFE.get(finding.code)
        if judged:
            verdicts = safety.judge(self.fdef, [(stmt, f.rule) for f, stmt in judged], self.scope)
            for (finding, _), why in zip(judged, verdicts):
                finding.safe, finding.why = why is None, why
        return out

    def _col(self, node: ast.AST) -> int:
        line = self.lines[node.lineno - 1] if node.lineno <= len(self.lines) else b""
        return len(line[: node.col_offset].decode("utf-8", "replace")) + 1

    def _add(self, code: str, node: ast.AST, stmt: ast.stmt, message: str) -> None:
        self.found.append((code, node, stmt, message))

    # -- statements ------------------------------------------------------------

    def _block(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            self._stmt(stmt)

    def _stmt(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.nested.append(stmt)  # scanned as a function of its own
            return
        if isinstance(stmt, ast.ClassDef):
            return
        if isinstance(stmt, (ast.If, ast.While)):
            truth = self.truth(stmt.test)
            if truth is not None:
                if isinstance(stmt, ast.If) and is_guard_if(stmt):
                    raised = next(s for s in [*stmt.body, *stmt.orelse] if isinstance(s, ast.Raise))
                    label = _short(raised.exc.func if isinstance(raised.exc, ast.Call) else raised.exc or raised)
                    self._add("GM301", stmt, stmt, f"`raise {label}` guarded by a tensor value: `{_short(truth)}`")
                elif isinstance(stmt, ast.If):
                    self._add("GM101", stmt, stmt, f"`if` on a tensor value: `{_short(truth)}`")
                else:
                    self._add("GM102", stmt, stmt, f"`while` on a tensor value: `{_short(truth)}`")
            self._expr(stmt.test, stmt)
            self._block(stmt.body)
            self._block(stmt.orelse)
        elif isinstance(stmt, ast.Assert):
            truth = self.truth(stmt.test)
            if truth is not None:
                self._add("GM302", stmt, stmt, f"`assert` on a tensor value: `{_short(truth)}`")
            self._expr(stmt.test, stmt)
        elif isinstance(stmt, ast.Raise):
            return  # evaluated only when raising
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            self._expr(stmt.iter, stmt)
            self._block(stmt.body)
            self._block(stmt.orelse)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                self._expr(item.context_expr, stmt)
            self._block(stmt.body)
        elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            self._block(stmt.body)
            for handler in stmt.handlers:
                self._block(handler.body)
            self._block(stmt.orelse)
            self._block(stmt.finalbody)
        elif isinstance(stmt, ast.Match):
            self._expr(stmt.subject, stmt)
            for case in stmt.cases:
                self._block(case.body)
        else:
            self._expr(stmt, stmt)

    # -- expressions -----------------------------------------------------------

    def _expr(self, node: ast.AST, stmt: ast.stmt, deferred: bool = False) -> None:
        """Sites inside one expression tree; ``deferred``: inside the arguments of
        a call that [Defer] moves (their host conversions move with it)."""
        if isinstance(node, ast.IfExp):
            truth = self.truth(node.test)
            if truth is not None:
                self._add("GM103", node, stmt, f"conditional expression on a tensor value: `{_short(truth)}`")
        elif isinstance(node, ast.Call):
            deferred = self._call(node, stmt, deferred)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and self.opt_in and not deferred:
            if is_bool_tensor(node.slice, self.optimistic) and is_bool_tensor(node.slice, self.facts):
                self._add("GM402", node, stmt, f"boolean-mask indexing `{_short(node)}`: the shape depends on the mask")
        elif isinstance(node, ast.Lambda):
            return
        for child in ast.iter_child_nodes(node):
            self._expr(child, stmt, deferred)

    def _call(self, call: ast.Call, stmt: ast.stmt, deferred: bool) -> bool:
        """Record the sites of one call; whether its arguments are deferred."""
        self.calls.append(call)
        func = call.func
        torch_fn = is_torch_attr(func, self.optimistic)
        if torch_fn == "_assert" and call.args and self.truth(call.args[0]) is not None:
            self._add("GM303", call, stmt, f"`torch._assert` on a tensor value: `{_short(call.args[0])}`")
            return deferred
        if self._emits(call):
            code = _EFFECT_CODES.get(dotted_name(func) or "", "GM202")
            self._add(code, call, stmt, f"`{_short(func)}(...)` in `{self.qualname}`, run by forward")
            return True
        if deferred or not self.opt_in:
            return deferred
        if torch_fn == "nonzero" and is_torch_attr(func, self.facts) == "nonzero":
            self._add("GM402", call, stmt, "`torch.nonzero`: the output shape depends on tensor values")
        elif isinstance(func, ast.Attribute) and func.attr in ("item", "tolist") and not call.args:
            if self.is_tensor(func.value):
                self._add("GM401", call, stmt, f"`.{func.attr}()` turns a tensor into a Python value: `{_short(call)}`")
        elif isinstance(func, ast.Attribute) and func.attr == "nonzero" and self.is_tensor(func.value):
            self._add("GM402", call, stmt, f"`.nonzero()`: the output shape depends on tensor values: `{_short(call)}`")
        return deferred

    def _emits(self, call: ast.Call) -> bool:
        """print / warnings.warn / a logger method that emits (not ``getLogger``,
        not ``t.log()`` on a tensor)."""
        if not is_side_effect_call(call):
            return False
        func = call.func
        if not isinstance(func, ast.Attribute):
            return True
        if func.attr in ("getLogger", "get_logger"):
            return False
        if func.attr == "log" and (not call.args or self.is_tensor(func.value)):
            return False
        return True
