"""The graphmend runtime: what mended code calls while it runs.

This package is the whole dependency of mended code (in memory, and in patches
that ``graphmend fix`` writes), so it stays small, documented and stable. It
imports only the standard library and torch, and nothing else of graphmend:
``regions`` holds the regions, the watchers and speculation's checks,
``records`` the record types and how a record is performed; this module the
calls mended code makes.

**Regions.** ``region()`` opens a deferral region around one call of a
compiled model; ``graphmend.compile`` opens it for you. Inside a region the
[Defer] calls below *record* their effect, with tensor arguments snapshotted
at the call (a tensor that requires grad is kept with its snapshot, so that
it prints its ``grad_fn`` as eager does: ``records._snap``); when the
outermost region closes (normally or by an exception) the records are
performed in FIFO order. Outside a region they perform the
effect at once, exactly as the original code did, so an eager call of a
mended function behaves like the original.

Dynamo traces these functions: the record is a new cell of a linked list whose tensors
become graph outputs, so the compiled region has no break. It never compiles
one as a frame of its own (``skip_frames``). Regions are serialised by one
process-wide lock: records of two threads can never mix.

**Effects that were not deferred.** A print, warning or log call that no
rule rewrote (a callee's, on a path the example inputs did not take; a
library's) runs at once. Deferred output must never be overtaken by it, so
from the first region on graphmend watches the three channels such effects
go through (``sys.stdout`` / ``sys.stderr``, ``warnings._showwarnmsg`` and
the log record factory): on a region's thread, the first write, shown
warning or created log record performs the records made so far (a set trap
among them raises there, before the effect, as the eager code would have)
and then lets the effect through. Outside a region, and on other threads,
the watchers only pass it through; they stay installed (see ``_watch``).
Writes that bypass Python (a C extension's) are not seen, nor are torch's
own warnings and logs while it compiles.

**Speculation.** ``call(fn, ...)`` runs ``fn`` in a speculating region:
a [Speculate] site (``speculate``) returns the value it had last as a
constant Dynamo compiles for, and records the actual one; when the call ends
the guesses are checked before anything is performed, and a wrong one runs the
call again (``Mispredicted``), nothing of the first run performed and the
random state restored. A call that raises, or that reaches an effect that was
not deferred, runs once more without guessing.

**Export.** Under ``torch.export`` nothing is recorded. A trap becomes
``torch._assert_async`` in the exported program: it raises RuntimeError
with the original exception type and message in its text (a message that is
not a constant refuses the export with one error naming the site). A deferred
print, log or warning runs at trace time in non-strict export, as the
original's does; strict export, where the original's effect is a graph break
that fails the export too, stops with one ``ExportError`` naming the site.
``barrier`` breaks no graph there.

**Guards.** Code evaluated where the original did not (a branch not taken)
runs only where ``nonempty``, ``has_dims``, ``broadcastable``, ``is_kind``...
hold, decided while tracing; elsewhere the original statement runs.

**Sites.** Each call carries ``site = (module_name, line, function)`` of the
original statement, so that a replayed warning or log record reports the
original file, line and function.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

import torch

from graphmend.runtime.records import (
    _DEFER,
    _FMT,
    _FSTR,
    _LAZY,
    _PCT,
    Guess,
    Log,
    Observed,
    Print,
    Site,
    Trap,
    Warn,
    _log_now,
    _module_of,
    _perform_call,
    _print_now,
    _resolve,
    _snap,
    _warn_now,
    flush,
    kept_attributes,
    raise_if_set,
)
from graphmend.runtime.regions import (
    _ENABLED,
    _GUESSABLE,
    _PREDICTED,
    _STATE,
    RERUNS,
    Mispredicted,
    _push,
    _recording,
    _traced,
    active,
    call,
    exclusive,
    region,
    register_log_site,
    skip_frames,
)

API_VERSION = 1


class ExportError(RuntimeError):
    """torch.export met a mended call whose behaviour an exported program cannot keep."""


def _exported(site: Site, what: str) -> None:
    """A deferred effect under torch.export. Not under Dynamo (non-strict
    export): nothing, the effect runs now, at trace time, as the original's
    does. Under Dynamo (strict export, where the original's effect is a graph
    break and fails the export too): one error that names the site."""
    if torch.compiler.is_exporting() and torch.compiler.is_dynamo_compiling():
        _refuse_export(site, what, "an exported program keeps no output")


@torch._dynamo.assume_constant_result  # Dynamo calls it while tracing: the error reaches the user as is
def _refuse_export(site: Site, what: str, why: str) -> None:
    filename, _ = _module_of(site)
    raise ExportError(
        f"graphmend: torch.export cannot keep the {what} at {filename}:{site[1]} ({site[2]}), mended by graphmend: "
        f"{why}; export the original (graphmend.unmend(model)) or remove it"
    )


# --------------------------------------------------------------------------
# snapshots and deferred formatting (traced by Dynamo)


def fstr(*parts: Any) -> Any:
    """An f-string: parts are str or (value, conversion, spec) tuples."""
    return (_DEFER, _FSTR, parts)


def pct(template: Any, values: Any) -> Any:
    """``template % values`` evaluated at flush."""
    return (_DEFER, _PCT, template, values)


def fmt(template: Any, args: tuple, kwargs: dict) -> Any:
    """``template.format(*args, **kwargs)`` evaluated at flush."""
    return (_DEFER, _FMT, template, args, kwargs)


def lazy(kind: str, value: Any) -> Any:
    """A host conversion (``item``, ``tolist``, ``int``, ``float``, ``bool``) at flush."""
    return (_DEFER, _LAZY, kind, value)


# --------------------------------------------------------------------------
# the deferred calls


def print_(site: Site, args: tuple, kwargs: dict, when: Any = None) -> None:
    """``print(*args, **kwargs)``; in a branch [Where] computes on every call, only
    ``when`` its branch is taken (a 0-dim bool tensor, read at flush)."""
    if not _recording():
        _exported(site, "print")
        _print_now(args, kwargs, when)
    else:
        _push(Print(site, _snap(args), _snap(kwargs), _snap(when)))


LEVELS = {  # a logger method's level (the [Defer] rule reads it too)
    "debug": logging.DEBUG, "info": logging.INFO, "info_once": logging.INFO,
    "warning": logging.WARNING, "warn": logging.WARNING, "warning_once": logging.WARNING,
    "error": logging.ERROR, "critical": logging.CRITICAL, "fatal": logging.CRITICAL,
}


def log(site: Site, logger: Any, method: str, args: tuple, kwargs: dict, when: Any = None) -> None:
    """``logger.<method>(*args, **kwargs)``; a disabled level records nothing; ``when``
    as ``print_``'s."""
    if not isinstance(logger, logging.Logger):
        _exported(site, f"call of `{method}`")
        _perform_call(logger, method, args, kwargs, when)
        return
    if not _recording():
        _exported(site, f"`logger.{method}` call")
        _log_now(site, logger, method, args, kwargs, when)
        return
    if _ENABLED.get(site, True):
        _push(Log(site, logger, method, _snap(args), _snap(kwargs), _snap(when)))


def warn(site: Site, args: tuple, kwargs: dict, when: Any = None) -> None:
    """``warnings.warn(*args, **kwargs)`` (stacklevel 1); ``when`` as ``print_``'s."""
    if not _recording():
        _exported(site, "`warnings.warn` call")
        _warn_now(site, args, kwargs, when)
    else:
        _push(Warn(site, _snap(args), _snap(kwargs), _snap(when)))


# --------------------------------------------------------------------------
# [Where] guards: pure checks that Dynamo evaluates while tracing (on shapes,
# dtypes and grad mode it already guards on), so the compiled graph holds
# only the predicated form, and eager code takes the original branch whenever
# a check fails.


def predicable(cond: Any) -> bool:
    """A 0-dim bool tensor, with autograd off: torch.where can stand in for ``if``.

    With grad enabled the original branch runs: ``where`` would give zero
    instead of ``None`` gradients to the branch not taken, and NaN gradients
    when that branch has a non-finite derivative."""
    return predicable_with_grad(cond) and not torch.is_grad_enabled()


def predicable_with_grad(cond: Any) -> bool:
    """A 0-dim bool tensor, in either autograd mode: for a select [Where] proved
    keeps eager's gradients (the branch not taken cut from autograd where its
    backward could make NaN, ``grad_gate``; what one branch alone reaches
    checked by ``grad_free``)."""
    return isinstance(cond, torch.Tensor) and cond.dtype == torch.bool and cond.dim() == 0


def grad_free(*values: Any) -> bool:
    """Autograd off, or none of ``values`` (what one branch may reach and another
    not surely) requires grad: a select would give such a tensor a zero
    ``.grad`` where eager may leave ``None``. A value that may hold tensors
    (a module, an object) is not proven free."""
    return not torch.is_grad_enabled() or not any(_may_need_grad(v) for v in values)


def _may_need_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if value is None or isinstance(value, (bool, int, float, complex, str, torch.dtype, torch.device)):
        return False
    if type(value) in (tuple, list):
        return any(_may_need_grad(v) for v in value)
    return True


def grad_gate(taken: Any, value: Any) -> Any:
    """``value``, whose gradient is kept where its branch runs (``taken``) and is
    ``-0.0`` where it does not: whatever the branch's operations make of the
    select's ``-0.0`` there (a mask's ``+0.0``, ``0 * inf``), the tensors it read
    get ``-0.0`` added, which leaves their gradients bit for bit as eager's."""
    if type(value) in (tuple, list):
        return type(value)(grad_gate(taken, v) for v in value)
    if isinstance(value, torch.Tensor) and value.requires_grad and torch.is_grad_enabled():
        return _Gate.apply(taken, value)
    return value


def select(cond: Any, a: Any, b: Any) -> Any:
    """``torch.where(cond, a, b)``; under autograd its backward gives the side not
    chosen ``-0.0`` (``torch.where`` gives ``+0.0``, and ``x + 0.0`` is not ``x``
    when ``x`` is ``-0.0``)."""
    if torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad for v in (a, b)):
        return _Select.apply(cond, a, b)
    return torch.where(cond, a, b)


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, taken: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(taken)
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (taken,) = ctx.saved_tensors
        return None, torch.where(taken, grad, -0.0)


class _Select(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, cond: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cond)
        return torch.where(cond, a, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (cond,) = ctx.saved_tensors
        return None, torch.where(cond, grad, -0.0), torch.where(cond, -0.0, grad)


def same_meta(a: Any, b: Any) -> bool:
    """Both tensors with the same shape, dtype, device and layout, so that
    ``torch.where(c, a, b)`` neither broadcasts nor promotes."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
        and a.layout == b.layout
    )


def bind(*objects: Any) -> None:
    """Nothing when it runs; while Dynamo traces, it meets each object here,
    in the frame's own graph, before ``torch.cond`` traces its branches.

    An object Dynamo first meets inside a ``torch.cond`` branch is tracked
    only in that branch's side effects, which are dropped after the branch
    is traced: a later ``obj.attr = ...`` in the same frame is then lost
    (torch 2.13, measured: ``self.count += 1`` after a cond whose branch
    calls ``self.lin``). ``type`` makes Dynamo build its view of each object."""
    for obj in objects:
        type(obj)


def store(module: Any, name: str, value: Any) -> None:
    """``module.<name> = value`` for a predicated attribute update: a registered
    buffer of the same shape and dtype that no other attribute of the module
    shares is updated in place (its identity, which Dynamo guards on, stays);
    anything else is rebound, as the original assignment did."""
    buffers = module.__dict__.get("_buffers", {})
    current = buffers.get(name)
    if current is not None and same_meta(current, value) and not _shared(module, name, current):
        current.copy_(value)
    else:
        setattr(module, name, value)


def register_buffer(module: Any, name: str, value: Any, persistent: bool = True) -> None:
    """``module.register_buffer(name, value, persistent=...)`` for a merged
    branch: an existing buffer with the same persistence is updated in place
    when nothing else shares it; otherwise the original call runs."""
    buffers = module.__dict__.get("_buffers", {})
    current = buffers.get(name)
    same_flag = (name not in module.__dict__.get("_non_persistent_buffers_set", set())) == bool(persistent)
    if current is not None and same_flag and same_meta(current, value) and not _shared(module, name, current):
        current.copy_(value)
    else:
        module.register_buffer(name, value, persistent=persistent)


def on_device(tensor: Any, device: Any) -> bool:
    """``tensor.to(device)`` would return ``tensor`` itself."""
    return isinstance(tensor, torch.Tensor) and tensor.device == torch.device(device)


def _shared(module: Any, name: str, tensor: Any) -> bool:
    for key, other in module.__dict__.get("_buffers", {}).items():
        if key != name and other is tensor:
            return True
    for other in module.__dict__.get("_parameters", {}).values():
        if other is tensor:
            return True
    for key, other in module.__dict__.items():
        if other is tensor:
            return True
    return False


def barrier() -> None:
    """A graph break, placed before an assert that may be on tensor values when
    the mended code records (passes/held.py, passes/barriers.py). Dynamo compiles such an
    assert into the graph, and a graph that raises loses the records made in
    it: the break ends the graph before the assert, so the records made so far
    reach the region, which performs them (and raises a set trap) even when
    the assert then fails. Under torch.export nothing is recorded: no break."""
    if not torch.compiler.is_exporting():
        _break()


@torch.compiler.disable
def _break() -> None:
    """Dynamo cannot trace a call of this: the graph ends before it."""


# While mending runs the model eagerly (barriers.py), the (file, line) of each
# held test that was a tensor; None otherwise (Dynamo guards on it being None).
HELD_PROBE: set | None = None


def held(value: Any) -> Any:
    """The test of an assert Dynamo may compile into the graph (barriers.py):
    a graph break first when it is a tensor (decided while tracing), so what
    was recorded before it is performed even when the assert fails; the value
    unchanged."""
    if isinstance(value, torch.Tensor):
        if HELD_PROBE is not None:
            caller = sys._getframe(1)
            HELD_PROBE.add((caller.f_code.co_filename, caller.f_lineno))
        barrier()
    return value


# --------------------------------------------------------------------------
# Guards of code evaluated where the original did not (a branch not taken, a message,
# a later operand of and/or), decided while tracing: analysis/purity, dtypes, shapes.


def nonempty(t: Any) -> bool:
    """A tensor holding an element: a reduction with no identity element
    (``amax``, ``max``) cannot raise on it (a size of 0 is never dynamic)."""
    return isinstance(t, torch.Tensor) and t.numel() > 0


def has_dims(t: Any, count: int) -> bool:
    """A tensor of at least ``count`` dimensions: ``t.shape[count - 1]``, ``t.sum(count - 1)``."""
    return isinstance(t, torch.Tensor) and t.dim() >= count


def broadcastable(a: Any, b: Any) -> bool:
    """``a`` and ``b`` combine elementwise (``a + b``) without raising."""
    return _fits(a, b, mutual=True)


def broadcasts_to(mask: Any, t: Any) -> bool:
    """``mask`` broadcasts to ``t``'s own shape (``t.masked_fill(mask, v)``)."""
    return _fits(mask, t, mutual=False)


def _fits(a: Any, b: Any, mutual: bool) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return is_scalar(a) or (mutual and is_scalar(b))
    pairs = zip(reversed(a.shape), reversed(b.shape))
    return (mutual or a.dim() <= b.dim()) and all(x == y or x == 1 or (mutual and y == 1) for x, y in pairs)


def is_scalar(value: Any) -> bool:
    """A number or a 0-dim tensor: it broadcasts with a tensor of any shape."""
    return type(value) in (bool, int, float, complex) or (isinstance(value, torch.Tensor) and value.dim() == 0)


_KINDS = {torch.bool: "bool", **dict.fromkeys([torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64], "integer"),
          **dict.fromkeys([torch.float16, torch.bfloat16, torch.float32, torch.float64], "floating"),
          **dict.fromkeys([torch.complex64, torch.complex128], "complex"), bool: "bool", int: "integer",
          float: "floating", complex: "complex"}  # float8, uint16...: none (not measured)


def is_kind(t: Any, *kinds: str) -> bool:
    """A tensor or number of a dtype of one of ``kinds`` ("bool", "integer",
    "floating", "complex"): ``h - 1`` raises on bool (a dtype is never dynamic)."""
    return _KINDS.get(t.dtype if isinstance(t, torch.Tensor) else type(t), "") in kinds


# --------------------------------------------------------------------------
# [Trap]: a validation check becomes a flag; the exception is raised when the
# region closes, in the place its record holds in the effect order.


_DIGITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}  # significand bits


def item_of(x: Any, *constants: Any) -> Any:
    """``x.item()`` for a test comparing it with ``constants``: ``x`` as a 0-dim
    tensor where comparing in its dtype gives the same answer (each constant
    exact in it), else ``x.item()`` itself (which raises as the original would).
    Decided while tracing."""
    if isinstance(x, torch.Tensor) and x.numel() == 1 and all(_exact(c, x.dtype) for c in constants):
        return x.reshape(())
    return x.item()


def _exact(c: Any, dtype: torch.dtype) -> bool:
    if type(c) is int and not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
        info = torch.iinfo(dtype)
        return info.min <= c <= info.max
    if type(c) not in (int, float) or dtype not in _DIGITS or c != c or abs(c) > torch.finfo(dtype).max or float(c) != c:
        return False
    numerator, denominator = float(c).as_integer_ratio()
    while numerator and numerator % 2 == 0:
        numerator //= 2
    return numerator.bit_length() <= _DIGITS[dtype] and (c == 0 or abs(c) >= torch.finfo(dtype).tiny)


def trappable(flag: Any) -> bool:
    """A 0-dim bool tensor: the check can be deferred (decided while tracing)."""
    return isinstance(flag, torch.Tensor) and flag.dtype == torch.bool and flag.dim() == 0


def equal(a: Any, b: Any) -> Any:
    """``torch.equal(a, b)`` as a 0-dim bool tensor (or a bool when it cannot be).

    Shapes are compared first, so broadcasting can never make tensors of
    different shapes compare equal, and shapes that do not broadcast do not
    raise; values are compared as torch.equal does (with type promotion; NaN
    is never equal)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.device != b.device:
        return torch.equal(a, b)  # the original call, with its own behaviour
    if a.shape != b.shape:
        return torch.zeros((), dtype=torch.bool, device=a.device)
    return torch.logical_not((a != b).any())


def tensor_and(*values: Any) -> Any:
    """``a and b ...`` in a test as ``torch.logical_and`` of its tensors, decided while
    tracing: a false Python bool or number among them makes it false, a true one drops
    out; any other operand (or two devices) gives None, which no guard accepts, so the
    test runs as written. The rules prove every operand safe to evaluate."""
    return _fold(torch.logical_and, values, decided_by=False)


def tensor_or(*values: Any) -> Any:
    """``a or b ...``: ``torch.logical_or``; a true Python operand decides (``tensor_and``)."""
    return _fold(torch.logical_or, values, decided_by=True)


def _fold(op: Any, values: tuple, decided_by: bool) -> Any:
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    plain = [v for v in values if not isinstance(v, torch.Tensor)]
    if not tensors or any(type(v) not in (bool, int, float) for v in plain) or len({t.device for t in tensors}) > 1:
        return None
    for v in plain:
        if (True if v else False) == decided_by:  # an `if`: Dynamo decides it, and guards on it
            return torch.full((), decided_by, dtype=torch.bool, device=tensors[0].device)
    out = tensors[0]
    for t in tensors[1:]:
        out = op(out, t)
    return out


def tensor_not(value: Any) -> Any:
    """``not a`` in a test: ``torch.logical_not`` of a tensor, else None (``tensor_and``)."""
    return torch.logical_not(value) if isinstance(value, torch.Tensor) else None


def gate(taken: Any, flag: Any) -> Any:
    """The flag of a check inside a branch: set only if the branch is taken.

    Two 0-dim bool tensors combine in the graph; anything else is decided as
    the original would (the flag is only looked at when the branch is taken)."""
    if trappable(taken) and trappable(flag):
        return torch.logical_and(taken, flag)
    return bool(taken) and bool(flag)


def trap(site: Site, flag: Any, exc_type: Any, args: tuple, keep: Any = None) -> None:
    """``if flag: raise exc_type(*args)``, deferred to the end of the region:
    effects recorded before it are performed, those after it are not, and
    ``keep``'s attributes, (obj, names), are put back as they are now."""
    if torch.compiler.is_exporting():
        _export_trap(site, flag, exc_type, args)
        return
    if not _recording():
        raise_if_set(flag, exc_type, args, keep)
        return
    _push(Trap(site, flag, exc_type, _snap(args), kept_attributes(keep)))


def _export_trap(site: Site, flag: Any, exc_type: Any, args: tuple) -> None:
    """A trap under torch.export: an assert the exported program keeps
    (``torch._assert_async``: it raises RuntimeError, with the original type
    and message in its text), or, when the message is not a constant, one
    error that names the site; a Python bool decides at once, as the original."""
    if not isinstance(flag, torch.Tensor):
        if flag:
            raise exc_type(*_resolve(args))
        return
    if not all(isinstance(a, str) for a in args):
        _refuse_export(site, f"check raising {exc_type.__name__}", "its message is computed from values")
    text = args[0] if len(args) == 1 else str(args) if args else ""
    torch._assert_async(torch.logical_not(flag), f"{exc_type.__name__}: {text}" if text else exc_type.__name__)


# --------------------------------------------------------------------------
# [Speculate]: a host value that steers Python control flow, guessed


def speculate(site: Site, value: Any) -> Any:
    """``value.item()``; compiled inside a speculating call, the value the site
    had last (a constant Dynamo guards on), recorded to be checked at the end."""
    if not _traced():
        result = value.item()
        if active() and _STATE.owner == threading.get_ident():
            _PREDICTED.setdefault(site, result)  # learn: eagerly, in a region
        return result
    guess = _PREDICTED.get(site)
    if not _recording() or value.dtype not in _GUESSABLE or value.numel() != 1:
        return value.item()
    if not _STATE.speculating or guess is None:
        # Not guessing (a rerun, a plain region): the value read is the next guess.
        _push(Observed(site, value.detach().clone()))
        return value.item()
    _push(Guess(site, guess, value.detach().clone()))
    return guess


__all__ = [
    "API_VERSION", "RERUNS", "ExportError", "LEVELS", "barrier", "bind", "held", "on_device", "predicable",
    "register_buffer", "same_meta", "store", "torch", "active", "flush", "fmt", "fstr", "lazy", "log", "pct",
    "print_", "region", "exclusive", "register_log_site", "Mispredicted", "call", "speculate", "equal",
    "tensor_and", "tensor_or", "tensor_not", "gate", "trap", "trappable", "nonempty", "is_kind", "broadcastable",
    "broadcasts_to", "is_scalar", "warn", "grad_free", "grad_gate", "has_dims", "predicable_with_grad", "select",
    "item_of",
]
skip_frames()
