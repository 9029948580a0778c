"""``graphmend fix``: the verified rewrites, written back as source.

``fix`` mends the target in memory exactly as ``graphmend.compile`` does
(discovery, rules, eager verification, bisect on a difference), then turns
each installed, verified rewrite into a source change:

* files of the user's project (under ``--root``, the current directory by
  default, and not inside site-packages) become a unified diff (``--diff``,
  the default) or are rewritten in place (``--write``);
* files of installed packages are never touched: their changes become one
  patch per package under ``--patch-dir``, with paths relative to the
  directory that holds the package (``a/transformers/models/t5/...``), so
  ``patch -p1 -d src`` applies it in that library's repository.

What is written, and what is not:

* Only the statements a rule replaced change. The new body of each mended
  function is aligned with the original statement by statement; a compound
  statement whose header is unchanged is descended into, so an ``if`` whose
  body holds one deferred ``print`` changes only that line. Every other byte
  of the file (comments, blank lines, formatting, tabs, line endings,
  encoding, a BOM) stays as it was. Comments inside a replaced statement are
  kept as comment lines above its replacement.
* [Where] emits plain torch (plus small guards); [Defer] and [Trap] call the
  runtime, imported once per file as ``import graphmend.runtime as
  graphmend_rt`` (after the file's leading imports). Deferred effects and
  trapped checks are break-free inside ``graphmend.compile`` or a
  ``graphmend.runtime.region()`` around the compiled call; outside one they
  run immediately, as the original did.
* The result is re-parsed, and every mended function in it must be, node
  for node, the code that was verified (log and warning sites are renumbered
  to their new lines), or the file is not written.
* ``--write`` replaces a file atomically (a temporary file in the same
  directory, then ``os.replace``). A file with uncommitted changes in git is
  refused unless ``--force``; a file outside git (or forced) keeps a backup
  beside it.

``fix`` on already-fixed code changes nothing: the rewritten sites no longer
break, so there is nothing to mend.
"""

from __future__ import annotations

import ast
import copy
import difflib
import io
import os
import subprocess
import tempfile
import time
import tokenize
from dataclasses import dataclass, field
from typing import Any

from graphmend.analysis.source import first_line
from graphmend.errors import GraphmendError
from graphmend.rules import Decline
from graphmend.tools.edits import (
    Coarse,
    Edit,
    blocks,
    check_disjoint,
    comments_of,
    diff_body,
    indent_unit,
)
from graphmend.tools.layout import Layout
from graphmend.tools.plain import Plain, plain_selects
from graphmend.tools.spelling import (
    add_import,
    alias_for,
    names_in,
    normalised,
    quote_of,
    readable_temporaries,
    renumber_sites,
    runtime_calls,
    spelled,
    split_lines,
    uses,
)


@dataclass
class FileChange:
    path: str  # absolute
    display: str  # the path in the diff (a/<display>)
    kind: str  # "project" | "package"
    package: str | None
    encoding: str
    old: str
    new: str
    functions: list[str] = field(default_factory=list)
    sites: list[int] = field(default_factory=list)  # original lines of the mended sites
    forms: list[Plain] = field(default_factory=list)  # each [Where] select: plain torch or guarded, and why
    needs_runtime: list[str] = field(default_factory=list)  # --portable: the edits left out, and what they call

    def diff(self) -> str:
        return unified_diff(self.old, self.new, self.display)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "display": self.display,
            "kind": self.kind,
            "package": self.package,
            "functions": list(self.functions),
            "sites": list(self.sites),
            "selects": [{"line": f.line, "plain": f.plain, "why": f.why} for f in self.forms],
            "needs_runtime": list(self.needs_runtime),
        }


@dataclass
class FixReport:
    target: str
    mend: Any  # MendReport
    changes: list[FileChange] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # files not changed, with why
    notes: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    backups: list[str] = field(default_factory=list)
    patches: list[str] = field(default_factory=list)
    alone: str = ""  # how the written code ran alone in a fresh process ("": not run)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": 1,
            "target": self.target,
            "verified": self.mend.verified,
            "breaks_before": self.mend.before.breaks,
            "breaks_after": self.mend.after.breaks,
            "changes": [c.to_dict() for c in self.changes],
            "skipped": list(self.skipped),
            "notes": list(self.notes),
            "written": list(self.written),
            "backups": list(self.backups),
            "patches": list(self.patches),
            "alone": self.alone,
        }


# --------------------------------------------------------------------------
# from a target to file changes


def fix_target(
    target: Any, *, root: str = ".", started: float | None = None, run_alone: bool = True, portable: bool = False
) -> FixReport:
    """Mend ``target``, keep what verified, and compute the file changes (nothing
    is written). With ``run_alone``, the changes are those that ran alone in a
    fresh process as the original did (``tools/written.py``): plain torch where
    ``tools/plain.py`` proves it, else the guarded form, else none. ``portable``:
    only the changes that need nothing but torch (each other one is listed in
    its file's ``needs_runtime``), checked to be no worse than the original."""
    from graphmend.passes.speculation import may_run_twice
    from graphmend.pipeline import mend_target

    started = time.time() if started is None else started
    report, mending = mend_target(target, verify=True)
    result = FixReport(target=target.name, mend=report)
    attempts: list[tuple[list[FileChange], list[str]]] = []
    try:
        if not mending.patches or not report.verified:
            return result
        for plain in (True,) if portable else (True, False):
            attempts.append(_file_changes(mending, report, root, started, plain, target.model, portable))
            if not any(site.plain for change in attempts[-1][0] for site in change.forms):
                break  # nothing plain: the guarded form is all there is
        if mending.memo_attrs and not portable:
            result.notes.append(
                "hoisted memo attribute(s) " + ", ".join(sorted(mending.memo_attrs)) + " are created on the first "
                "call by the written code (graphmend.compile fills them at mend time): expect one recompile"
            )
        flags = getattr(getattr(report, "capture", None), "flags", None)
        if flags:
            result.notes.append(
                "the fix was measured with " + ", ".join(f"torch._dynamo.config.{f}=True" for f in flags)
                + "; graphmend.compile sets it around each call, plain torch.compile needs it set"
            )
    finally:
        mending.undo()
    original = None
    speculates = report.speculates and may_run_twice(target.model) and not portable
    # A portable patch claims no more graphs than the original; the whole fix, what the mend measured.
    claimed = report.before.graphs if portable else report.after.graphs
    for changes, skipped in attempts:
        if not changes or not run_alone:
            result.changes, result.skipped = changes, result.skipped + skipped
            return result
        from graphmend.tools.written import differences, run_fresh

        original = original or run_fresh(target.name, {}, compiled=False, grad=report.grad)
        texts = {c.path: c.new for c in changes}
        written = run_fresh(
            target.name, texts, compiled=True, grad=report.grad, flags=tuple(flags or ()), speculating=speculates
        )
        why = differences(original, written, claimed, set(texts), mending.memo_attrs)
        if not why:
            result.changes, result.skipped = changes, result.skipped + skipped
            result.alone = f"ran alone in a fresh process: {written.graphs} graph(s), as the original eagerly"
            if portable:
                result.alone += (
                    f" (torch only; the original compiles {report.before.graphs}, the whole fix {report.after.graphs})"
                )
            return result
        form = "plain torch" if any(site.plain for c in changes for site in c.forms) else "the guarded form"
        result.notes.append(f"{form} did not run alone as the original: {why[0]}")
    result.skipped += [f"{c.path}: the written code did not run alone as the original" for c in attempts[-1][0]]
    return result


def _file_changes(
    mending: Any, report: Any, root: str, started: float, plain: bool, model: Any, portable: bool = False
) -> tuple[list[FileChange], list[str]]:
    """Each changed file's new text (``plain``: selects in plain torch where proven), and the files skipped."""
    by_file: dict[str, list[Any]] = {}
    for patch in mending.patches:
        by_file.setdefault(patch.located.filename, []).append(patch)
    changes, skipped = [], []
    for path, patches in sorted(by_file.items()):
        try:
            if os.stat(path).st_mtime > started:
                raise Decline("the file changed on disk while graphmend ran")
            change = file_change(path, patches, root, model=model if plain else None, portable=portable)
        except Decline as exc:
            skipped.append(f"{path}: {exc.reason}")
            continue
        change.sites = sorted(o.line for o in report.applied if os.path.realpath(o.file) == os.path.realpath(path))
        changes.append(change)
    return changes, skipped


def file_change(path: str, patches: list[Any], root: str, *, model: Any = None, portable: bool = False) -> FileChange:
    """The new text of ``path`` with every patch's function rewritten in place
    (``model``: the live target, for ``plain_selects``; None writes every select
    guarded). ``portable``: only the edits that do not call the runtime."""
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        encoding = tokenize.detect_encoding(io.BytesIO(raw).readline)[0]
        text = raw.decode(encoding)
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        raise Decline(f"the file does not decode or parse now: {exc}") from None
    lines = split_lines(text)
    comments = comments_of(text)
    quote = quote_of(text)
    alias = alias_for(tree)
    taken = names_in(tree)
    edits: list[Edit] = []
    functions: list[str] = []
    forms: list[Plain] = []
    expected: list[tuple[tuple[str, ...], ast.AST]] = []
    for patch in patches:
        original = _def_at(tree, patch.original_code)
        if original is None:
            raise Decline(f"no def of {patch.original_code.co_name} at line {patch.original_code.co_firstlineno}")
        node = patch.node
        if model is not None:
            node, found = plain_selects(node, patch.located.namespace, model)
            forms += found
        new = readable_temporaries(spelled(node, alias, patch.located.namespace.get("__name__")), taken)
        if _signature(original) != _signature(new):
            raise Decline(f"{original.name}: the rewrite changed the def line itself")
        unit = indent_unit(lines, original)
        try:
            diff_body(original.body, new.body, lines, edits, Layout(lines, unit, quote), comments)
        except Coarse as exc:
            raise Decline(f"{original.name}: {exc}") from None
        functions.append(getattr(patch.original_code, "co_qualname", original.name))
        expected.append((_path_of(tree, original), new))
    check_disjoint(edits)
    kind, package, display = classify(path, root)
    needs: list[str] = []
    if portable:
        left: list[str] = []
        for edit in sorted((e for e in edits if runtime_calls(e.text, alias)), key=lambda e: e.start):
            calls = ", ".join(f"{alias}.{c}" for c in runtime_calls(edit.text, alias))
            needs.append(f"{display}:{edit.start}: needs graphmend's runtime ({calls})")
            left.append(f"line {edit.start}: {calls}")
            edits.remove(edit)
        if not edits:
            raise Decline(f"every rewrite here needs graphmend's runtime ({'; '.join(left)})")
    for edit in sorted(edits, key=lambda e: e.start, reverse=True):
        lines[edit.start - 1 : edit.end] = edit.text
    new_text = "".join(lines)
    if portable:
        _check_parses(new_text)  # the functions are partly rewritten: running alone is the proof
    else:
        if any(uses(node, alias) for _, node in expected):
            new_text = add_import(new_text, tree, alias)
        new_text = renumber_sites(new_text, alias)
        _check_written(new_text, expected, alias)
    return FileChange(path, display, kind, package, encoding, text, new_text, functions, forms=forms, needs_runtime=needs)


def classify(path: str, root: str) -> tuple[str, str | None, str]:
    """("project" | "package", package name, path shown in the diff)."""
    real = os.path.realpath(path)
    norm = real.replace(os.sep, "/")
    base = os.path.realpath(root)
    inside = real.startswith(base + os.sep)
    if inside and "/site-packages/" not in norm and "/dist-packages/" not in norm:
        return "project", None, os.path.relpath(real, base).replace(os.sep, "/")
    top = os.path.dirname(real)
    if not os.path.exists(os.path.join(top, "__init__.py")):  # a top-level module
        return "package", os.path.splitext(os.path.basename(real))[0], os.path.basename(real)
    while os.path.exists(os.path.join(os.path.dirname(top), "__init__.py")):
        top = os.path.dirname(top)
    return "package", os.path.basename(top), os.path.relpath(real, os.path.dirname(top)).replace(os.sep, "/")


# --------------------------------------------------------------------------
# aligning the mended body with the original


def _def_at(tree: ast.Module, code: Any) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
            if first_line(node) == code.co_firstlineno:
                return node
    return None


def _path_of(tree: ast.Module, target: ast.AST) -> tuple[str, ...]:
    """Names of the defs and classes enclosing ``target``, and the index among same-named ones."""

    def walk(body: list[ast.stmt], prefix: tuple[str, ...]) -> tuple[str, ...] | None:
        for node in body:
            if node is target:
                return prefix + (node.name,)  # type: ignore[attr-defined]
            inner = prefix + (node.name,) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else prefix
            for block in blocks(node):
                found = walk(block, inner)
                if found is not None:
                    return found
        return None

    return walk(tree.body, ()) or ()


def _defs_by_path(tree: ast.Module) -> dict[tuple[str, ...], list[ast.AST]]:
    found: dict[tuple[str, ...], list[ast.AST]] = {}

    def walk(body: list[ast.stmt], prefix: tuple[str, ...]) -> None:
        for node in body:
            inner = prefix
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = prefix + (node.name,)
                if not isinstance(node, ast.ClassDef):
                    found.setdefault(inner, []).append(node)
            for block in blocks(node):
                walk(block, inner)

    walk(tree.body, ())
    return found


def _signature(node: ast.AST) -> str:
    shell = copy.copy(node)
    shell.body = []  # type: ignore[attr-defined]
    return ast.dump(shell)


def _check_parses(text: str) -> ast.Module:
    try:
        return ast.parse(text)
    except SyntaxError as exc:
        raise Decline(f"internal: the written file does not parse ({exc.msg} at line {exc.lineno})") from None


def _check_written(text: str, expected: list[tuple[tuple[str, ...], ast.AST]], alias: str) -> None:
    defs = _defs_by_path(_check_parses(text))
    for path, node in expected:
        written = defs.get(path, [])
        if not any(normalised(w, alias) == normalised(node, alias) for w in written):
            raise Decline(f"internal: the written {'.'.join(path)} is not the rewrite")


# --------------------------------------------------------------------------
# output


def unified_diff(old: str, new: str, display: str) -> str:
    a, b = split_lines(old), split_lines(new)
    out: list[str] = []
    for line in difflib.unified_diff(a, b, f"a/{display}", f"b/{display}", n=3):
        if line.startswith(("---", "+++")) and not line.endswith("\n"):
            line += "\n"
        if not line.endswith(("\n", "\r")):
            line += "\n\\ No newline at end of file\n"
        out.append(line)
    return "".join(out)


def git_dirty(path: str) -> bool | None:
    """True when git has uncommitted changes to ``path``; None outside a git work tree."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        inside = subprocess.run(
            ["git", "-C", folder, "rev-parse", "--is-inside-work-tree"], capture_output=True, text=True, timeout=30
        )
        if inside.returncode != 0 or inside.stdout.strip() != "true":
            return None
        status = subprocess.run(
            ["git", "-C", folder, "status", "--porcelain", "--", os.path.abspath(path)],
            capture_output=True, text=True, timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(status.stdout.strip())


def write_atomically(path: str, data: bytes) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    mode = os.stat(path).st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(prefix=".graphmend-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _backup_path(path: str) -> str:
    candidate, n = path + ".graphmend-backup", 0
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}.graphmend-backup.{n}"
    return candidate


def write_changes(report: FixReport, *, force: bool = False) -> None:
    """``--write``: the project's files, each atomically; refuses dirty files in git unless forced."""
    project = [c for c in report.changes if c.kind == "project"]
    dirty = {c.path: git_dirty(c.path) for c in project}  # asked once per file
    refused = [c.display for c in project if dirty[c.path] and not force]
    if refused:
        raise GraphmendError(
            f"not writing {', '.join(refused)}: uncommitted changes in git (commit or stash them, or pass --force)"
        )
    for change in project:
        data = change.new.encode(change.encoding)
        with open(change.path, "rb") as fh:
            current = fh.read()
        if current.decode(change.encoding) != change.old:
            raise GraphmendError(f"not writing {change.display}: it changed on disk while graphmend ran")
        if dirty[change.path] is not False:  # outside git, or forced: keep the original beside it
            backup = _backup_path(change.path)
            with open(backup, "wb") as fh:
                fh.write(current)
            report.backups.append(backup)
        write_atomically(change.path, data)
        report.written.append(change.path)


def write_patches(report: FixReport, patch_dir: str) -> None:
    """One ``<package>.patch`` per installed package with changes."""
    by_package: dict[str, list[FileChange]] = {}
    for change in report.changes:
        if change.kind == "package":
            by_package.setdefault(change.package or "package", []).append(change)
    if not by_package:
        return
    os.makedirs(patch_dir, exist_ok=True)
    for package, changes in sorted(by_package.items()):
        path = os.path.join(patch_dir, f"{package}.patch")
        with open(path, "wb") as fh:
            for change in changes:
                fh.write(change.diff().encode(change.encoding))
        report.patches.append(path)
