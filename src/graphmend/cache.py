"""The mend cache: what ``graphmend.compile`` mended and verified, kept on disk
so that a restarted process installs it without mending again.

A mend depends on the code it read, the model, the example inputs and the
versions involved. An entry is found by a key over what is known before
mending: graphmend's own source (a hash of it), torch's and Python's versions, the rules and options,
the grad mode, the example inputs' shapes, dtypes and devices, and the
model's structure (each module's class, training flag, hooks and plain
attributes, its parameters' and buffers' shapes and dtypes). The entry holds
the text hash of every file the mend read (the functions it rewrote, the
callees its rules followed, the model's classes), the rewritten functions
(their ASTs, exact line numbers kept), the buffers and memo attributes the
rewrites need, and the report (capture flags and [Speculate] sites are in it).

A later process with the same key checks those hashes (reading the files,
no tracing) and installs the rewrites: no discovery, no rewrite rounds, no
verification. An entry that does not load is ignored with one warning and
replaced: unreadable (corrupt, or written by another graphmend), or stale (a
file it read changed since). A function already mended in the process
(another instance of the model's class) is a miss: the mend runs as without
a cache.

Where: ``$GRAPHMEND_CACHE_DIR``, else ``$XDG_CACHE_HOME/graphmend``, else
``~/.cache/graphmend``; entries are ``mends/<key>.pkl`` under it, and nothing
else is written. ``GRAPHMEND_CACHE=0`` (or ``graphmend.compile(...,
cache=False)``) turns it off. Writes go to a temporary file renamed over the
entry, so a reader never sees half an entry and two processes writing the
same one both leave a whole one. Entries are pickles: the cache folder must
be as trusted as the code it caches.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import pickle
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from graphmend.analysis import source
from graphmend.models.targets import Target
from graphmend.passes import memos
from graphmend.pipeline import MendReport
from graphmend.rewrite import engine
from graphmend.rewrite.session import Mending
from graphmend.rules import Decline

FORMAT = 1  # the entry layout; another is unreadable (and replaced)


def enabled(asked: bool = True) -> bool:
    return asked and os.environ.get("GRAPHMEND_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def root() -> str:
    """The cache folder (entries live in its ``mends/``)."""
    explicit = os.environ.get("GRAPHMEND_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "graphmend")


def _entries_folder() -> str:
    return os.path.join(root(), "mends")


# --------------------------------------------------------------------------
# the key


class _Uncacheable(Exception):
    """An input or attribute the key cannot describe: no caching for this mend."""


def key_of(target: Target, rules: tuple[str, ...], verify: bool, grad: bool) -> str | None:
    """The entry's key, or None when the inputs hold a value the key cannot describe."""
    try:
        parts = (
            FORMAT, _own_code(), torch.__version__, sys.version_info[:3], tuple(rules), verify, grad,
            _described((target.args, target.kwargs)), _structure(target.model),
        )
    except _Uncacheable:
        return None
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=1)
def _own_code() -> str:
    """A hash of graphmend's own source: a new graphmend (a release, or a rule
    edited in a checkout) does not install what an older one mended."""
    package = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(package)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, package).encode())
            with open(path, "rb") as fh:
                digest.update(fh.read())
    return digest.hexdigest()


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _described(value: Any, depth: int = 0) -> Any:
    """An input for the key: a tensor by its metadata, plain values by value, containers by their items."""
    if depth > 8:
        raise _Uncacheable
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), str(value.device), value.requires_grad, str(value.layout))
    if isinstance(value, _PLAIN):
        return (type(value).__name__, repr(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_described(v, depth + 1) for v in value))
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return ("dict", tuple((k, _described(v, depth + 1)) for k, v in sorted(value.items())))
    raise _Uncacheable


def _attribute(value: Any, depth: int) -> Any:
    """A model attribute for the key: plain values by value, objects (a config) by their own attributes."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), str(value.device))
    if isinstance(value, _PLAIN):
        return repr(value)
    if depth > 3:
        return type(value).__qualname__
    if isinstance(value, (tuple, list, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return (type(value).__name__, tuple(_attribute(v, depth + 1) for v in items))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _attribute(v, depth + 1)) for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))))
    if callable(value):
        return (getattr(value, "__module__", ""), getattr(value, "__qualname__", type(value).__qualname__))
    if hasattr(value, "__dict__"):  # a config: its fields (a hash-valued one differs per process: left out)
        fields = sorted((k, v) for k, v in vars(value).items() if "hash" not in k.lower())
        return (type(value).__qualname__, tuple((k, _attribute(v, depth + 1)) for k, v in fields))
    return type(value).__qualname__


def _structure(model: Any) -> Any:
    """The model for the key: each module's class, mode, hooks, plain attributes,
    parameters and buffers (shapes, dtypes, devices); a function by its name."""
    if not isinstance(model, torch.nn.Module):
        code = getattr(model, "__code__", None)
        return ("function", getattr(model, "__module__", ""), getattr(model, "__qualname__", repr(type(model))),
                getattr(code, "co_filename", ""))
    out = []
    for path, module in model.named_modules():
        hooks = tuple(len(v) for k, v in sorted(vars(module).items()) if k.endswith("hooks") and isinstance(v, dict))
        plain = tuple((k, _attribute(v, 1)) for k, v in sorted(vars(module).items()) if not k.startswith("_") and k != "training")
        tensors = tuple(
            (name, tuple(t.shape), str(t.dtype), str(t.device), t.requires_grad)
            for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            if t is not None
        )
        out.append((path, type(module).__module__, type(module).__qualname__, module.training, hooks, plain, tensors))
    return tuple(out)


def _class_files(model: Any) -> set[str]:
    """The files defining the model's classes (or the function): an edit there makes an entry stale."""
    objects = [type(m) for m in model.modules()] if isinstance(model, torch.nn.Module) else [model]
    files = set()
    for obj in objects:
        try:
            path = inspect.getsourcefile(obj)
        except (TypeError, OSError):
            path = None
        if path:
            files.add(os.path.abspath(path))
    return files


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _file_digest(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return _digest(fh.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError):
        return None


# --------------------------------------------------------------------------
# an entry


@dataclass
class _Rewrite:
    """One rewritten function: where it is, and the rewritten definition."""

    filename: str
    first_line: int  # the original code's co_firstlineno
    qualname: str
    body_line: int  # a line inside the original definition, for engine.locate
    node: Any  # the rewritten def (an ast node, its line numbers as installed)
    keys: list  # the sites it applies (Mending.groups)


@dataclass
class Entry:
    key: str
    target: str
    created: float
    torch: str
    files: dict[str, str]  # path -> sha256 of the text the mend read
    rewrites: list[_Rewrite]
    report: MendReport
    memo_attrs: set[str]
    unalias: set[str]
    format: int = FORMAT

    @property
    def path(self) -> str:
        return os.path.join(_entries_folder(), f"{self.key}.pkl")


def mend_cached(
    target: Target, rules: tuple[str, ...], verify: bool, grad: bool, mend: Callable[[], tuple[MendReport, Mending]]
) -> tuple[MendReport, Mending]:
    """``mend()``'s result, or what an entry for the same key installs; a new
    mend is stored (when verification did not fail)."""
    key = key_of(target, rules, verify, grad)
    if key is None:
        return mend()
    began = time.perf_counter()
    entry = _read(key)
    if entry is not None:
        installed = _install(entry, target, grad)
        if installed is not None:
            report, mending = installed
            report.seconds = time.perf_counter() - began
            return report, mending
    with source.reading() as read:
        report, mending = mend()
    if report.verified is not False:
        try:
            _write(_entry(key, target, report, mending, read))
        except _Unstorable:
            pass
    return report, mending


def _read(key: str) -> Entry | None:
    path = os.path.join(_entries_folder(), f"{key}.pkl")
    try:
        with open(path, "rb") as fh:
            entry = pickle.load(fh)
        if not isinstance(entry, Entry) or entry.format != FORMAT or entry.key != key:
            raise ValueError("not an entry of this graphmend")
    except FileNotFoundError:
        return None
    except Exception as exc:  # corrupt, truncated, or from another graphmend: mend again
        _warn(f"the mend cache entry {path} is unreadable ({type(exc).__name__}: {exc}); mending again and replacing it")
        return None
    changed = [p for p, digest in entry.files.items() if _file_digest(p) != digest]
    if changed:
        more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
        _warn(f"the cached mend of {entry.target} is stale ({changed[0]}{more} changed since); mending again")
        return None
    return entry


def _install(entry: Entry, target: Target, grad: bool) -> tuple[MendReport, Mending] | None:
    """Install the entry's rewrites; None (nothing left installed) when a
    function cannot be found as it was, or is mended already."""
    mending = Mending()
    try:
        for rewrite in entry.rewrites:
            located = engine.locate(rewrite.filename, rewrite.body_line)
            if (
                id(located.code) in source.MENDED
                or located.code.co_firstlineno != rewrite.first_line
                or located.qualname != rewrite.qualname
            ):
                raise Decline("not the function the entry rewrote")
            patch = engine.install(located, engine.build(located, rewrite.node), rewrite.node)
            mending.add(patch, list(rewrite.keys))
    except Decline:
        mending.undo()
        return None
    mending.memo_attrs, mending.unalias = set(entry.memo_attrs), set(entry.unalias)
    engine.unalias_buffers(target.model, mending.unalias)
    memos.fill(target, mending.memo_attrs, grad)
    torch._dynamo.reset()
    report = entry.report  # read for this call alone: no copy needed
    report.from_cache = True
    mending.report, mending.target = report, target
    return report, mending


def _entry(key: str, target: Target, report: MendReport, mending: Mending, read: dict[str, str]) -> Entry:
    files = {os.path.abspath(p): _digest(text) for p, text in read.items()}
    for path in _class_files(target.model) | {p.located.filename for p in mending.patches}:
        digest = _file_digest(path)
        if digest is None:
            raise _Unstorable  # no text to check a later process's against
        files.setdefault(os.path.abspath(path), digest)
    rewrites = []
    for index, patch in enumerate(mending.patches):
        original = source.definition_of(patch.original_code)
        if original is None or patch.node is None:
            raise _Unstorable
        rewrites.append(_Rewrite(
            patch.located.filename, patch.original_code.co_firstlineno,
            getattr(patch.original_code, "co_qualname", patch.original_code.co_name),
            original.body[0].lineno, patch.node, list(mending.groups.get(index, [])),
        ))
    stored = MendReport(**{k: v for k, v in vars(report).items() if k in MendReport.__dataclass_fields__})
    return Entry(key, report.target, time.time(), torch.__version__, files, rewrites, stored,
                 set(mending.memo_attrs), set(mending.unalias))


class _Unstorable(Exception):
    """A rewrite whose original definition cannot be found again: not cached."""


def _write(entry: Entry) -> None:
    folder = _entries_folder()
    try:
        data = pickle.dumps(entry)
        os.makedirs(folder, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=f".{entry.key}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(temp, entry.path)  # atomic: readers see the old entry or the new one
        except BaseException:
            os.unlink(temp)
            raise
    except Exception as exc:  # a cache that cannot be written costs the next process a mend, nothing more
        _warn(f"could not write the mend cache in {folder} ({type(exc).__name__}: {exc})")


def _warn(message: str) -> None:
    warnings.warn(f"graphmend: {message}", RuntimeWarning, stacklevel=2)


# --------------------------------------------------------------------------
# for users: graphmend cache list / clear


def entries() -> list[tuple[str, Entry | None, int]]:
    """(path, the entry or None when unreadable, size in bytes) for each entry, newest first."""
    folder = _entries_folder()
    found = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not name.endswith(".pkl") or name.startswith("."):
            continue
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as fh:
                entry = pickle.load(fh)
            entry = entry if isinstance(entry, Entry) else None
        except Exception:
            entry = None
        found.append((path, entry, os.path.getsize(path)))
    return sorted(found, key=lambda f: -(f[1].created if f[1] is not None else 0))


def clear() -> int:
    """Remove every entry (and any temporary file a killed writer left); how many entries went."""
    folder = _entries_folder()
    removed = 0
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if name.endswith(".pkl") or name.endswith(".tmp"):
            os.unlink(os.path.join(folder, name))
            removed += name.endswith(".pkl") and not name.startswith(".")
    return removed
