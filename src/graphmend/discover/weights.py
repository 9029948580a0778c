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

The copy also shares the plain data its modules hold (a configuration object,
a list of layer sizes: ``shared_data``), since Dynamo may guard their
identity: ``copy.deepcopy(self.config)`` in a forward (transformers'
``get_text_config``, which every ``DynamicCache(config=...)`` calls) guards
the config by id, and a trace made on a copy of it would be traced again by
the first call. Each run compares that data with a snapshot when it ends; a
run that changed it has the snapshot's contents put back (every part the same
object it was), and from then on the model's copies copy it.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphmend.errors import GraphmendError
from graphmend.models.targets import Target

# The user's model -> whether its first run wrote a parameter (unknown: not in it).
_WRITES: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
# The user's models one of whose runs changed the plain data its copies shared.
_CHANGES_DATA: "weakref.WeakSet[Any]" = weakref.WeakSet()


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


# Values deepcopy returns as they are (its atomic types, enum members), and containers.
_ATOMS = (
    type(None), bool, int, float, complex, str, bytes, range, type, enum.Enum,
    types.FunctionType, types.BuiltinFunctionType, torch.dtype, torch.device,
)
_CONTAINERS = (list, tuple, dict, set, frozenset)
_DATA_LIMIT = 20_000  # values walked per model: past it, the rest is copied, as before


def _plain_class(cls: type) -> bool:
    """Instances keep their state in ``__dict__`` and deepcopy copies them by it."""
    return (
        not hasattr(cls, "__slots__")
        and getattr(cls, "__deepcopy__", None) is None
        and all(getattr(cls, m) is getattr(object, m) for m in ("__reduce_ex__", "__reduce__", "__getstate__"))
    )


class _Walk:
    """Which values hold only plain data: atoms, containers of plain data and
    objects of plain classes (no tensor, module or custom copy), each judged once."""

    def __init__(self) -> None:
        self.judged: dict[int, bool | None] = {}
        self.budget = _DATA_LIMIT

    def plain(self, value: Any) -> bool:
        self.budget -= 1  # atoms too: the snapshot and the comparison after each run walk them
        if self.budget < 0:
            return False
        if isinstance(value, _ATOMS):
            return True
        if id(value) in self.judged:
            return bool(self.judged[id(value)])  # None: being judged, a cycle (copied, as before)
        self.judged[id(value)] = None
        self.judged[id(value)] = verdict = self._parts_plain(value)
        return verdict

    def _parts_plain(self, value: Any) -> bool:
        if type(value) in _CONTAINERS:
            parts = [*value.keys(), *value.values()] if isinstance(value, dict) else list(value)
        elif isinstance(value, (torch.Tensor, torch.nn.Module)) or not hasattr(value, "__dict__"):
            return False
        elif not _plain_class(type(value)):
            return False
        else:
            parts = list(vars(value).values())
        return all(self.plain(part) for part in parts)


def shared_data(model: Any) -> list[Any]:
    """The mutable plain data the modules of ``model`` hold as attributes (a
    config, a list of sizes), each once: what ``copy_of`` shares beside the
    parameters. Empty once a run changed it (``_Data.put_back``)."""
    if not isinstance(model, torch.nn.Module) or model in _CHANGES_DATA:
        return []
    found: dict[int, Any] = {}
    walk = _Walk()
    for module in model.modules():
        for name, value in vars(module).items():
            if name.startswith("_") or isinstance(value, (*_ATOMS, tuple, frozenset)) or id(value) in found:
                continue
            if walk.plain(value):
                found[id(value)] = value
    return list(found.values())


def _same(a: Any, b: Any, depth: int = 0) -> bool:
    """Plain data ``a`` equal to its snapshot ``b``, value by value (too deep: not known to be)."""
    if type(a) is not type(b) or depth > 50:
        return False
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    if isinstance(a, _ATOMS):
        return a is b or a == b
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], depth + 1) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, (set, frozenset)):
        return a == b
    return _same(vars(a), vars(b), depth + 1)


def _snapshot(value: Any, pairs: dict[int, tuple[Any, Any]]) -> Any:
    """A deep copy of plain data ``value``; ``pairs`` gets (original, copy) of each
    mutable part, by the original's id."""
    if isinstance(value, _ATOMS):
        return value
    if id(value) in pairs:
        return pairs[id(value)][1]
    if isinstance(value, (tuple, frozenset)):  # immutable: no cycle can pass through it
        copied = type(value)(_snapshot(v, pairs) for v in value)
        pairs[id(value)] = (value, copied)
        return copied
    copied = type(value)() if isinstance(value, (list, dict, set)) else object.__new__(type(value))
    pairs[id(value)] = (value, copied)  # before the parts: a part that refers back finds it
    if isinstance(value, dict):
        copied.update((_snapshot(k, pairs), _snapshot(v, pairs)) for k, v in value.items())
    elif isinstance(value, list):
        copied.extend(_snapshot(v, pairs) for v in value)
    elif isinstance(value, set):
        copied.update(_snapshot(v, pairs) for v in value)
    else:
        vars(copied).update({k: _snapshot(v, pairs) for k, v in vars(value).items()})
    return copied


@dataclass(frozen=True)
class _Data:
    """The plain data a copy shares, and a snapshot to compare it with after a run."""

    values: list[Any]
    pairs: dict[int, tuple[Any, Any]]  # id(original) -> (original, snapshot), each mutable part

    @classmethod
    def of(cls, model: Any) -> "_Data":
        values = shared_data(model)
        pairs: dict[int, tuple[Any, Any]] = {}
        for value in values:
            _snapshot(value, pairs)
        return cls(values, pairs)

    def put_back(self, model: Any) -> None:
        """Changed data given its snapshot's contents, every part the same object it
        was; the model's copies copy it from then on."""
        if all(_same(value, self.pairs[id(value)][1]) for value in self.values):
            return
        back = {id(snap): original for original, snap in self.pairs.values()}

        def original(v: Any) -> Any:
            return back.get(id(v), v)

        for value, snap in self.pairs.values():
            if isinstance(value, list):
                value[:] = [original(v) for v in snap]
            elif isinstance(value, (dict, set)):
                value.clear()
                value.update({original(k): original(v) for k, v in snap.items()} if isinstance(snap, dict) else map(original, snap))
            elif not isinstance(value, (tuple, frozenset)):
                vars(value).clear()
                vars(value).update({k: original(v) for k, v in vars(snap).items()})
        with contextlib.suppress(TypeError):
            _CHANGES_DATA.add(model)


def copy_of(model: Any, share: bool, data: "_Data | None" = None) -> Any:
    """``model`` copied, its parameters shared with it when ``share``, and ``data``'s values."""
    if not isinstance(model, torch.nn.Module):
        return model
    memo = {id(p): p for p in _parameters(model)} if share else {}
    memo.update((id(v), v) for v in (data.values if data is not None else ()))
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
        data = _Data.of(model)
        subject = copy_of(model, share, data)
        args, kwargs = copy.deepcopy((target.args, target.kwargs))
    except Exception:  # cannot be copied: used as is (the caller restores what it must)
        yield target
        return
    copied = Private(target.name, subject, args, kwargs, target.speculating)
    try:
        with _sharing_parameters(model, copied, known if share else True):
            yield copied
    finally:
        data.put_back(model)


@contextlib.contextmanager
def _sharing_parameters(model: Any, copied: Private, known: bool | None) -> Iterator[None]:
    """The run in the block shares the parameters of ``model`` (unless ``known``
    is True: they were copied): watched when ``known`` is None, checked after."""
    if known is True or not isinstance(model, torch.nn.Module):
        yield
        return
    held = [_Held.of(p) for p in _parameters(model)]
    copied.versions = {id(h.param): h.version for h in held}
    if known is None:
        watch = _Watch([h.param for h in held])
        try:
            with watch:
                yield
        finally:
            watch.restore()
            for h in held:
                h.put_back()
            with contextlib.suppress(TypeError):
                _WRITES[model] = bool(watch.saved)
        return
    try:
        yield
    finally:
        for h in held:
            h.put_back()
        changed = {id(h.param) for h in held if h.param._version != h.version}
        written = [name for name, p in model.named_parameters() if id(p) in changed]
        if written:  # raised in place of whatever the run raised: this is what matters
            raise ParameterWritten(
                f"{copied.name}: a run of the model wrote parameter {written[0]!r} in place, which its first run "
                "did not; mending runs the model on copies that share its parameters, so it stops here"
            )
