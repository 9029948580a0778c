"""Mending's runs of the model on copies that share its parameters.

Mending runs the model many times (eager observations, traces under Dynamo),
each on a private copy, so that nothing a run changes (buffers, attributes,
the inputs) reaches the user's model. A whole copy would need the model's
memory again, which a real model on a GPU does not have: ``private`` copies
everything but the parameters, which the copy shares with the model.

Sharing is safe only while no run writes a parameter. What a run may write
is not read from source; it is watched:

* The first run of a model (``private`` before anything is known) runs under
  a dispatch mode that sees every operator and, before the first write to
  the storage of a parameter, keeps a copy of it; after the run the copies
  are put back. A model whose forward writes its own parameters (rare: an
  in-place update under ``no_grad``) is copied whole from then on
  (``writes_parameters``).
* Every later run is checked when it ends: each shared parameter still has
  its storage, version counter, dtype and ``requires_grad``. A storage or a
  flag swapped (``param.data = ...``, ``.requires_grad_()``) is put back; a
  write in place, which the first run did not show and cannot be undone,
  raises :class:`ParameterWritten` (mending stops and is undone).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphmend.errors import GraphmendError
from graphmend.models.targets import Target

# The user's model -> whether its first run wrote a parameter (unknown: not in it).
_WRITES: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


class ParameterWritten(GraphmendError):
    """A run of the model wrote a parameter in place that its first run did not."""


def writes_parameters(model: Any) -> bool | None:
    """Whether the first run of ``model`` wrote one of its parameters (None: not run yet)."""
    try:
        return _WRITES.get(model)
    except TypeError:  # not weakly referenceable
        return None


def _parameters(model: Any) -> list[torch.nn.Parameter]:
    if not isinstance(model, torch.nn.Module):
        return []
    return list(model.parameters())


@dataclass(frozen=True)
class _Held:
    """A shared parameter as it was before a run."""

    param: torch.nn.Parameter
    data: torch.Tensor  # an alias of its storage (no copy): what ``param.data = ...`` would replace
    version: int
    requires_grad: bool

    @classmethod
    def of(cls, param: torch.nn.Parameter) -> "_Held":
        return cls(param, param.detach(), param._version, param.requires_grad)

    def swapped(self) -> bool:
        p = self.param
        return p.data_ptr() != self.data.data_ptr() or p.dtype != self.data.dtype or p.shape != self.data.shape

    def put_back(self) -> None:
        if self.swapped():
            self.param.data = self.data
        if self.param.requires_grad != self.requires_grad:
            self.param.requires_grad_(self.requires_grad)


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse and other layouts without one storage
        return None


class _Watch(TorchDispatchMode):
    """Before the first write to the storage of a watched tensor, a copy of it
    (put back by ``restore``). Transparent to torch.compile (its frames compile
    as without it) and to higher-order operators, whose branches cannot write
    their inputs."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.watched = {_storage(p): p for p in params if p.numel()}
        self.watched.pop(None, None)
        self.saved: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for value in _written(func, args, kwargs):
            for t in value if isinstance(value, (list, tuple)) else (value,):
                ptr = _storage(t) if isinstance(t, torch.Tensor) and not t.is_meta else None
                if ptr in self.watched and ptr not in self.saved:
                    p = self.watched[ptr]
                    self.saved[ptr] = (p, p.detach().clone())
        return func(*args, **kwargs)

    def restore(self) -> None:
        with torch.no_grad():
            for p, value in self.saved.values():
                p.detach().copy_(value)


def _written(func: Any, args: tuple, kwargs: dict) -> Iterator[Any]:
    """The value of each argument an operator's schema says it writes."""
    for i, name in _writes(func):
        if i < len(args):
            yield args[i]
        elif name in kwargs:
            yield kwargs[name]


_WRITTEN_ARGS: dict[Any, tuple[tuple[int, str], ...]] = {}


def _writes(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments ``func`` writes, from its schema (none for a
    higher-order operator); a keyword-only one has no position."""
    found = _WRITTEN_ARGS.get(func)
    if found is None:
        schema = getattr(func, "_schema", None)
        arguments = schema.arguments if schema is not None else ()
        found = tuple(
            (1 << 30 if arg.kwarg_only else i, arg.name)
            for i, arg in enumerate(arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        _WRITTEN_ARGS[func] = found
    return found


@dataclass
class Private(Target):
    """A copy of a target for one run: ``versions`` has the version counter of
    each parameter it shares, as the run began."""

    versions: dict[int, int] = field(default_factory=dict)

    def untouched(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a shared parameter no operator has written since the run began."""
        return self.versions.get(id(tensor)) == tensor._version


def copy_of(model: Any, share: bool) -> Any:
    """``model`` copied, its parameters shared with it when ``share``."""
    if not isinstance(model, torch.nn.Module):
        return model
    memo = {id(p): p for p in _parameters(model)} if share else {}
    return copy.deepcopy(model, memo)


@contextlib.contextmanager
def private(target: Target) -> Iterator[Target]:
    """A copy of ``target`` (model and inputs) for one run in the block (see
    the module doc), a :class:`Private`; the target itself when it cannot be
    copied."""
    model = target.model
    known = writes_parameters(model)
    share = known is not True
    try:
        subject = copy_of(model, share)
        args, kwargs = copy.deepcopy((target.args, target.kwargs))
    except Exception:  # cannot be copied: used as is (the caller restores what it must)
        yield target
        return
    copied = Private(target.name, subject, args, kwargs, target.speculating)
    if not share or not isinstance(model, torch.nn.Module):
        yield copied
        return
    held = [_Held.of(p) for p in _parameters(model)]
    copied.versions = {id(h.param): h.version for h in held}
    if known is None:
        watch = _Watch([h.param for h in held])
        try:
            with watch:
                yield copied
        finally:
            watch.restore()
            for h in held:
                h.put_back()
            with contextlib.suppress(TypeError):
                _WRITES[model] = bool(watch.saved)
        return
    try:
        yield copied
    finally:
        for h in held:
            h.put_back()
        changed = {id(h.param) for h in held if h.param._version != h.version}
        written = [name for name, p in model.named_parameters() if id(p) in changed]
        if written:  # raised in place of whatever the run raised: this is what matters
            raise ParameterWritten(
                f"{target.name}: a run of the model wrote parameter {written[0]!r} in place, which its first run "
                "did not; mending runs the model on copies that share its parameters, so it stops here"
            )
