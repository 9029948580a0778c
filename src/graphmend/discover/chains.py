"""Complete a break's frame chain up to the model's entry.

Dynamo reports a break with the user frames *of the frame it was compiling*.
After an earlier break in a caller, the callee runs (and is compiled) as a
frame of its own, or resumes as ``torch_dynamo_resume_in_<fn>_at_<line>``:
its breaks then name only the callee, not the callers whose code runs after
it returns. A rule that must reason about everything that runs after a site
([Trap]: no state change may run before a deferred raise) needs those
callers. They are taken from the other chains observed in the same run (the
first break in a function is usually reported from the entry down); when no
observed chain leads from the entry to the function, the callers are unknown
and the rule declines. A site reached along several chains (a check in a
module called from two places) is completed along each (``complete_all``):
each caller has its own code after the call.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from graphmend.analysis.source import definition_of, parse_file

Key = tuple[str, int]  # (file, line of the innermost enclosing def)


def def_key(frame: Any) -> Key | None:
    """The function a frame is in: its file and the line of its ``def``."""
    parsed = parse_file(frame.file)
    if parsed is None:
        return None
    from graphmend.analysis.source import defs_containing

    defs = defs_containing(parsed.tree, frame.line)
    return (frame.file, defs[0].lineno) if defs else None


def entry_keys(model: Any) -> set[Key]:
    """The functions a compiled call of ``model`` starts in: its ``forward``
    (a module) or itself (a function), and whatever they wrap; through a
    transparent wrapper (``_transparent_inner``), the wrapped module's too."""
    import torch

    fn = type(model).forward if isinstance(model, torch.nn.Module) else model
    inner = _transparent_inner(model)
    keys: set[Key] = entry_keys(inner) if inner is not None else set()
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        code = getattr(fn, "__code__", None)
        if code is not None:
            node = definition_of(code)
            if node is not None:
                keys.add((code.co_filename, node.lineno))
        fn = getattr(fn, "__wrapped__", None)
    return keys


def _transparent_inner(model: Any) -> Any:
    """The module a torch wrapper calls as the whole of its work, or None.

    ``nn.DataParallel`` with no device (CPU) or one: its ``forward`` ends in
    ``return self.module(...)``, in the calling thread, inside a profiler
    ``record_function`` whose exit runs on an exception too. Nothing of the
    wrapper's runs after the call, so the module's ``forward`` is where the
    chains a rule must check start (its frames are torch's, left out of
    chains). Not with several devices (replicas in threads, then ``gather``),
    nor ``DistributedDataParallel``: its ``_post_forward`` changes state after
    the call (``require_forward_param_sync``, the reducer's
    ``prepare_for_backward``, buffer syncs), which a deferred raise would let
    run, so its callers stay unknown and [Trap] declines."""
    import torch

    if type(model) is torch.nn.DataParallel and len(model.device_ids) <= 1:
        return model.module
    return None


def complete(frames: Sequence[Any], observed: Iterable[Sequence[Any]], entries: set[Key]) -> list[tuple[Any, ...]]:
    """Chains from the entry to the site: ``frames`` when it starts at an entry,
    otherwise ``frames`` behind every observed entry chain that reaches its
    first function (one per distinct caller path); ``[]`` when none is known.

    Without known entries (``entries`` empty), ``frames`` is taken as it is."""
    if not frames:
        return []
    frames = tuple(frames)
    if not entries:
        return [frames]
    head = def_key(frames[0])
    if head in entries:
        return [frames]
    out: dict[tuple[tuple[str, int], ...], tuple[Any, ...]] = {}
    for chain in observed:
        if not chain or def_key(chain[0]) not in entries:
            continue
        for i, frame in enumerate(chain):
            if def_key(frame) == head:
                prefix = tuple(chain[:i])
                out.setdefault(tuple((f.file, f.line) for f in prefix), prefix + frames)
                break
    return list(out.values())


def complete_all(paths: Iterable[Sequence[Any]], observed: Iterable[Sequence[Any]], entries: set[Key]) -> list[tuple[Any, ...]]:
    """``complete`` for every chain a site was reached by, together: ``[]``
    (unknown) as soon as one of them cannot be completed, as the code after
    that caller's call could not be checked."""
    observed = list(observed)
    out: list[tuple[Any, ...]] = []
    for path in paths:
        chains = complete(path, observed, entries)
        if not chains:
            return []
        out += [c for c in chains if c not in out]
    return out


__all__ = ["complete", "complete_all", "def_key", "entry_keys"]
