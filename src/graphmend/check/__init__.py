"""``graphmend check PATH...``: candidate graph-break sites, from source alone.

## What it does
Reads Python files (a folder: every ``*.py`` under it, hidden folders and
``__pycache__`` skipped), parses each once, imports none of them, and lists
the statements that would split a ``torch.compile`` graph, each with the rule
that fixes it and whether that rewrite is safe to apply without a run.

| code  | rule  | site |
|-------|-------|------|
| GM000 | -     | the file could not be parsed (syntax error, null bytes); the file is skipped, the run goes on |
| GM101 | where | `if` whose test Python reads from a tensor (`if x.isinf().any():`, `if mask.sum() > 0:`, `if torch.equal(a, b):`) |
| GM102 | where | `while` on a tensor value ([Where] declines loops: never safe) |
| GM103 | where | `a if <tensor> else b` ([Where] rewrites statements only: never safe) |
| GM201 | defer | `print(...)` in `forward` of an `nn.Module` subclass or a helper of the same file it calls |
| GM202 | defer | `logger.<level>(...)`, `logging.<level>(...)`, `logger.warning_once(...)` there |
| GM203 | defer | `warnings.warn(...)` there |
| GM301 | trap  | `if <tensor test>: raise E(...)` |
| GM302 | trap  | `assert <tensor test>` |
| GM303 | trap  | `torch._assert(<tensor test>, msg)` |
| GM401 | scalar | `.item()` / `.tolist()` on a tensor (TI) |
| GM402 | scalar | `.nonzero()`, `torch.nonzero`, `x[bool_mask]` (DO) |

GM4xx are reported only when selected (``--select GM4`` or ``--select ALL``),
and never as safe: [Scalar] decides on the live model. GM000 always is.
Codes are stable: a new pattern gets a new code.

## Provably a tensor
Only an expression the shared analysis (``analysis.is_tensor_expr``) proves
to be a tensor counts: a pure torch function, a tensor method of a proven
tensor, arithmetic or a comparison with one, or a proven name. Names are
proven by ``check.tensors``: parameters annotated ``torch.Tensor`` /
``Optional[torch.Tensor]``, parameters used as tensors in the function
(a tensor-only method such as ``.unsqueeze`` / ``.masked_fill`` / ``.dim``,
or the first argument of ``torch.isinf`` and the like), and locals every
assignment of which is a tensor. ``if x.shape[0] > 1``, ``if self.training``,
``if x is None``, ``if n > 0`` and anything reached through attributes or
module calls are not sites. A missed site is preferred to a false one.

## Safe or "needs a run"
``safe`` means the rule that ``graphmend mend`` would apply accepts the
statement with what the source proves (``check.safety``): [Where] when both
branches are speculation-safe and every name read after the ``if`` is bound
on both paths; [Defer] when the call is a statement, its callee is provably
print / warn / a logger, and its arguments are not changed in place later in
the function; [Trap] when nothing after the check in the function changes
state (a call to ``self.<module>`` or an imported function counts as a
possible change). Otherwise the reason is given after ``needs a run:``. A
[Trap] check is judged within its function: code a caller runs after it
returns is only seen by ``graphmend mend``, on the live model.

## Output
``path:line:col: CODE message [rule, safe|needs a run: why]`` sorted by path
and line (columns are 1-based characters), then ``N sites in M files (K
safe), F files checked`` on stderr. ``--json`` prints ``{"schema": 1,
"files_checked", "files_with_sites", "sites", "safe", "unparsed", "counts",
"findings": [{"path", "line", "col", "code", "rule", "message", "function",
"safe", "why"}]}`` (``rule`` null for GM000, ``why`` null when safe). Exit 1
when anything is reported, 0 when nothing, 2 for a usage error (a path that
does not exist, an unknown code).
"""

from __future__ import annotations

import gc
import os
from collections import Counter
from dataclasses import dataclass, field

from graphmend.check.find import CODES, Finding, find_in_source
from graphmend.errors import GraphmendError

__all__ = ["CODES", "CheckReport", "Finding", "check_paths", "parse_select"]

JSON_SCHEMA = 1
_DEFAULT_PREFIXES = ("GM1", "GM2", "GM3")  # GM000 is always reported


def parse_select(text: str | None) -> tuple[str, ...]:
    """``"GM101,GM2"`` -> code prefixes; ``ALL`` selects every code; None the default set."""
    if not text:
        return _DEFAULT_PREFIXES
    prefixes = tuple(p.strip().upper() for p in text.split(",") if p.strip())
    if "ALL" in prefixes:
        return ("GM",)
    unknown = [p for p in prefixes if not any(code.startswith(p) for code in CODES)]
    if unknown or not prefixes:
        raise GraphmendError(f"--select: unknown code(s) {', '.join(unknown) or repr(text)}; codes are {', '.join(CODES)}")
    return prefixes


def python_files(paths: list[str]) -> list[str]:
    """The files to check, in order; a missing path is a usage error."""
    out: list[str] = []
    for path in paths:
        if os.path.isfile(path):
            out.append(path)
        elif os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                out.extend(os.path.join(root, f) for f in sorted(files) if f.endswith(".py"))
        else:
            raise GraphmendError(f"no such file or directory: {path}")
    return list(dict.fromkeys(out))  # a file named twice (a folder and a file in it) is checked once


@dataclass
class CheckReport:
    files_checked: int
    findings: list[Finding] = field(default_factory=list)

    @property
    def sites(self) -> list[Finding]:
        return [f for f in self.findings if f.code != "GM000"]

    def summary(self) -> str:
        sites = self.sites
        files = len({f.path for f in sites})
        safe = sum(f.safe for f in sites)
        line = (
            f"{len(sites)} site{'s' * (len(sites) != 1)} in {files} file{'s' * (files != 1)} ({safe} safe), "
            f"{self.files_checked} file{'s' * (self.files_checked != 1)} checked"
        )
        unparsed = len(self.findings) - len(sites)
        return line + (f", {unparsed} not parsed" if unparsed else "")

    def lines(self) -> list[str]:
        return [_line(f) for f in self.findings]

    def to_dict(self) -> dict:
        sites = self.sites
        return {
            "schema": JSON_SCHEMA,
            "files_checked": self.files_checked,
            "files_with_sites": len({f.path for f in sites}),
            "sites": len(sites),
            "safe": sum(f.safe for f in sites),
            "unparsed": len(self.findings) - len(sites),
            "counts": dict(sorted(Counter(f.code for f in self.findings).items())),
            "findings": [f.to_dict() for f in self.findings],
        }


def _line(f: Finding) -> str:
    rule = f.rule
    if f.code == "GM000":
        tail = ""
    else:
        tail = f" [{rule}, safe]" if f.safe else f" [{rule}, needs a run: {f.why}]"
    return f"{f.path}:{f.line}:{f.col}: {f.code} {f.message}{tail}"


def check_paths(paths: list[str], select: tuple[str, ...] = _DEFAULT_PREFIXES) -> CheckReport:
    files = python_files(paths)
    opt_in = any(p.startswith("GM4") or "GM4".startswith(p) for p in select)
    findings = _check_files(files, select, opt_in)
    findings.sort(key=lambda f: (f.path, f.line, f.col, f.code))
    return CheckReport(files_checked=len(files), findings=findings)


def _check_files(files: list[str], select: tuple[str, ...], opt_in: bool) -> list[Finding]:
    findings: list[Finding] = []
    # Syntax trees hold no reference cycles; with torch imported, the cyclic
    # collector's passes over them would double the run time.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for path in files:
            findings.extend(_check_file(path, select, opt_in))
    finally:
        if collecting:
            gc.enable()
    return findings


def _check_file(path: str, select: tuple[str, ...], opt_in: bool) -> list[Finding]:
    try:
        with open(path, "rb") as fh:
            source = fh.read()
    except OSError as exc:
        return [Finding(path, 1, 1, "GM000", f"cannot read: {exc.strerror} (file skipped)", "")]
    return [f for f in find_in_source(path, source, opt_in) if f.code == "GM000" or f.code.startswith(select)]
