"""What a region records, and how a record is performed when the region closes.

Plain Python, never traced: ``flush`` runs eagerly after the compiled call.
Deferred values (``fstr``, ``pct``, ``fmt``, ``lazy`` in the package) are
tuples headed by ``_DEFER`` and formatted here, at flush."""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from typing import Any, NamedTuple

import torch

Site = tuple  # (module __name__, line, function name)


class _Marker:
    """Heads a tuple that stands for a value formatted at flush: (_DEFER, kind, ...)."""

    def __repr__(self) -> str:
        return "<graphmend deferred value>"


_DEFER = _Marker()
_FSTR, _PCT, _FMT, _LAZY, _LIVE = "f-string", "percent", "format", "lazy", "live"


def _is_deferred(value: Any) -> bool:
    return type(value) is tuple and len(value) > 0 and value[0] is _DEFER


# --------------------------------------------------------------------------
# records: what a region keeps of a deferred call, one type per kind


class Print(NamedTuple):
    """``print(*args, **kwargs)``; only if ``when`` (a 0-dim bool tensor: the call sits
    in a branch [Where] computed on every call) is None or true."""

    site: Site
    args: tuple
    kwargs: dict
    when: Any = None


class Log(NamedTuple):
    """``logger.<method>(*args, **kwargs)``."""

    site: Site
    logger: logging.Logger
    method: str
    args: tuple
    kwargs: dict
    when: Any = None  # as Print's


class Warn(NamedTuple):
    """``warnings.warn(*args, **kwargs)``."""

    site: Site
    args: tuple
    kwargs: dict
    when: Any = None  # as Print's


class Trap(NamedTuple):
    """``if flag: raise exc_type(*args)``; ``flag`` a 0-dim bool tensor.
    ``kept``: (obj, name, had, value) per attribute the code after the check
    stores, as it was at the check: put back before it raises."""

    site: Site
    flag: Any
    exc_type: Any
    args: tuple
    kept: tuple = ()


def kept_attributes(keep: Any) -> tuple:
    """``keep``, (obj, names, tensor names[, stored]) or None: each attribute as
    it is now, and a copy of the data of each tensor named or held by a named
    attribute (Trap.kept). A store after the check that [Where] rewrites once
    the check's trap is written may become a copy into the buffer it rebound
    (``runtime.store``): putting the binding back alone would keep the new data.
    ``stored``: see ``stored_at_check``."""
    if keep is None:
        return ()
    obj, names, data = keep[:3]
    values = dict(stored_at_check(keep))
    now = [getattr(obj, name) for name in (*data, *values) if isinstance(getattr(obj, name, None), torch.Tensor)]
    kept = [(obj, name, hasattr(obj, name), getattr(obj, name, None)) for name in names if name not in values]
    kept += [(obj, name, True, value) for name, value in values.items()]
    tensors: list = []
    for t in now + [v for _, _, _, v in kept if isinstance(v, torch.Tensor)]:
        if not any(t is u for u in tensors):
            tensors.append(t)
    return tuple(kept + [(t, None, True, t.detach().clone()) for t in tensors])


def stored_at_check(keep: Any) -> tuple:
    """``keep``'s (name, value) pairs: an attribute a branch [Where] merged stores
    before the check, and the value it has there in the original. The merged
    branch stores it after the trap, so a trap that raises sets it first."""
    return keep[3] if keep is not None and len(keep) > 3 else ()


def raise_if_set(flag: Any, exc_type: Any, args: tuple, keep: Any) -> None:
    """A trap outside a deferral region: raises now, as the original check, once
    the attributes a merged branch stores only after it are set as the original
    left them (``stored_at_check``)."""
    if bool(flag):
        for name, value in stored_at_check(keep):
            setattr(keep[0], name, value)
        raise exc_type(*_resolve(args))


def _put_back(kept: tuple) -> None:
    for obj, name, had, value in reversed(kept):
        if name is None:  # obj is a tensor changed in place
            with torch.no_grad():
                obj.copy_(value)
        elif had:
            setattr(obj, name, value)
        elif hasattr(obj, name):
            delattr(obj, name)


class Guess(NamedTuple):
    """A [Speculate] site compiled for ``guess``; ``value`` (0-dim) is what it read."""

    site: Site
    guess: Any
    value: Any


class Observed(NamedTuple):
    """A [Speculate] site that read ``value`` (0-dim) without guessing: the next guess."""

    site: Site
    value: Any


def _snap(value: Any) -> Any:
    """What a record keeps of an argument: tensors copied at the call. A tensor that
    requires grad prints ``grad_fn=<...>`` or ``requires_grad=True``, which a detached
    copy would not: it is kept with its copy (``_LIVE``) and prints as itself at flush,
    or, changed in place since the call, as its copy with the call's ``grad_fn`` (its
    name is read at the call where the code runs eagerly; a compiled graph's output
    names the graph's backward, ``CompiledFunctionBackward`` under AOTAutograd, before
    and after an in-place change alike)."""
    if isinstance(value, torch.nn.Parameter):
        return value  # a clone would print as a plain tensor
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            grad_fn = None if torch.compiler.is_compiling() else _grad_fn_name(value)
            return (_DEFER, _LIVE, value, value.detach().clone(), grad_fn)
        return value.detach().clone()
    if type(value) is tuple:
        return tuple([_snap(v) for v in value])
    if type(value) is list:
        return [_snap(v) for v in value]
    if type(value) is dict:
        return {k: _snap(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------
# flush (plain Python, never traced)


def _resolve(value: Any) -> Any:
    if _is_deferred(value):
        kind = value[1]
        if kind == _FSTR:
            out = []
            for part in value[2]:
                if isinstance(part, str):
                    out.append(part)
                    continue
                item, conversion, spec = part
                item = _resolve(item)
                if conversion == "r":
                    item = repr(item)
                elif conversion == "s":
                    item = str(item)
                elif conversion == "a":
                    item = ascii(item)
                out.append(format(item, _resolve(spec) if spec else ""))
            return "".join(out)
        if kind == _PCT:
            return _resolve(value[2]) % _resolve(value[3])
        if kind == _FMT:
            return _resolve(value[2]).format(*_resolve(value[3]), **_resolve(value[4]))
        if kind == _LAZY:
            conv, item = value[2], _resolve(value[3])
            item = item.copy if isinstance(item, _Printed) else item
            if conv in ("item", "tolist"):
                return getattr(item, conv)()
            return {"int": int, "float": float, "bool": bool}[conv](item)
        if kind == _LIVE:
            return _as_recorded(*value[2:])
    if type(value) is tuple:
        return tuple(_resolve(v) for v in value)
    if type(value) is list:
        return [_resolve(v) for v in value]
    if type(value) is dict:
        return {k: _resolve(v) for k, v in value.items()}
    return value


def _grad_fn_name(t: torch.Tensor) -> str | None:
    return None if t.grad_fn is None else type(t.grad_fn).__name__


def _as_recorded(live: torch.Tensor, copy: torch.Tensor, grad_fn: str | None) -> Any:
    """``live`` where it still holds what it held at the call (its text is the call's),
    else the copy, printed with the call's ``grad_fn`` (``_Printed``)."""
    now = live.detach()  # requires grad, so floating or complex: NaN compares as NaN
    if now.shape == copy.shape and torch.allclose(now, copy, rtol=0, atol=0, equal_nan=True):
        return live
    return _Printed(copy, grad_fn or _grad_fn_name(live))


_SUFFIXES = ("dtype=", "device=", "size=", "layout=", "quantization_scheme=")


def _with_suffix(text: str, suffix: str) -> str:
    """``text``, a tensor's repr, with ``suffix`` added last and wrapped as torch wraps it
    (``torch._tensor_str._add_suffixes``: the autograd suffix comes after dtype and device)."""
    body = text[:-1]  # the closing parenthesis
    tail = body[body.rfind("\n") + 1 :]
    indent = len("tensor(")
    wrapped = "\n" in body and tail.lstrip().startswith(_SUFFIXES)  # the last suffix has a line of its own
    last_line_len = len(tail) if wrapped else len(body) - body.rfind("\n") + 1
    if last_line_len + len(suffix) + 2 > torch._tensor_str.PRINT_OPTS.linewidth:
        return body + ",\n" + " " * indent + suffix + ")"
    return body + ", " + suffix + ")"


class _Printed:
    """A tensor's values as they were at the call, printed as a tensor that requires grad
    and has ``grad_fn`` (``requires_grad=True`` when None). A format spec or a 0-dim
    tensor prints the number alone, as ``Tensor.__format__`` does."""

    def __init__(self, copy: torch.Tensor, grad_fn: str | None) -> None:
        self.copy = copy
        self.text = _with_suffix(repr(copy), f"grad_fn=<{grad_fn}>" if grad_fn else "requires_grad=True")

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format(self.copy, spec) if spec or self.copy.dim() == 0 else self.text


def _module_of(site: Site) -> tuple[str, dict]:
    module = sys.modules.get(site[0])
    namespace = vars(module) if module is not None else {"__name__": site[0]}
    filename = namespace.get("__file__") or site[0]
    return filename, namespace


_RELOCATE = threading.local()
_RELOCATING = threading.RLock()


def _find_caller(logger: logging.Logger, original: Any) -> Any:
    def find_caller(stack_info: bool = False, stacklevel: int = 1) -> tuple:
        where = getattr(_RELOCATE, "where", None)
        if where is not None and getattr(_RELOCATE, "logger", None) is logger:
            return where
        return original(stack_info, stacklevel)

    return find_caller


def _skipped(when: Any) -> bool:
    """A call in a branch not taken (``when`` false): it does nothing."""
    return when is not None and not bool(when)


def _perform_print(args: tuple, kwargs: dict, when: Any = None) -> None:
    if not _skipped(when):
        print(*_resolve(args), **_resolve(kwargs))


@torch.compiler.disable
def _perform_call(target: Any, method: str, args: tuple, kwargs: dict, when: Any = None) -> None:
    if not _skipped(when):
        getattr(target, method)(*_resolve(args), **_resolve(kwargs))


def _call_logger(site: Site, logger: logging.Logger, method: str, args: tuple, kwargs: dict, when: Any = None) -> None:
    """Call the real logger method, with the record placed where eager put it.

    A method of ``logging.Logger`` itself reports its caller (the original
    site), so the call is relocated there. A method defined elsewhere
    (transformers' ``warning_once``) reports its own frame, as it does when
    called from here: it is called as is."""
    if _skipped(when):
        return
    args, kwargs = _resolve(args), _resolve(kwargs)
    function = getattr(getattr(type(logger), method, None), "__module__", None)
    if function != logging.__name__:
        getattr(logger, method)(*args, **kwargs)
        return
    filename, _ = _module_of(site)
    # The patch is on the logger, which other threads share: one relocated call at a time.
    with _RELOCATING:
        _RELOCATE.where = (filename, site[1], site[2], None)
        _RELOCATE.logger = logger
        had = "findCaller" in vars(logger)
        saved = vars(logger).get("findCaller")
        logger.findCaller = _find_caller(logger, type(logger).findCaller.__get__(logger))  # type: ignore[method-assign]
        try:
            getattr(logger, method)(*args, **kwargs)
        finally:
            _RELOCATE.where = None
            _RELOCATE.logger = None
            if had:
                logger.findCaller = saved  # type: ignore[method-assign]
            else:
                del logger.findCaller


def _warn_explicit(site: Site, args: tuple, kwargs: dict) -> None:
    message = args[0] if args else kwargs["message"]
    category = args[1] if len(args) > 1 else kwargs.get("category")
    if isinstance(message, Warning):
        category = message.__class__
    if category is None:
        category = UserWarning
    filename, namespace = _module_of(site)
    registry = namespace.setdefault("__warningregistry__", {}) if site[0] in sys.modules else {}
    warnings.warn_explicit(
        message,
        category,
        filename,
        site[1],
        module=site[0],
        registry=registry,
        # No module_globals: like warnings.warn itself, do not load the module's
        # source on every call (linecache reads it only if the warning is shown).
    )


def _warn_resolved(site: Site, args: tuple, kwargs: dict, when: Any = None) -> None:
    if not _skipped(when):
        _warn_explicit(site, _resolve(args), _resolve(kwargs))


# The immediate paths are reached from traced code (a mended function compiled
# outside a region): Dynamo must not trace into them. The flush below runs
# eagerly and calls the plain functions, without the disable wrappers' cost.
# The reason shows in Dynamo's break message, and in graphmend's report ("still breaks").
AT_ONCE = "graphmend: run at once, as the original: no deferral region is open"
_print_now = torch.compiler.disable(_perform_print, reason=AT_ONCE)
_log_now = torch.compiler.disable(_call_logger, reason=AT_ONCE)
_warn_now = torch.compiler.disable(_warn_resolved, reason=AT_ONCE)


def flush(records: list) -> None:
    """Perform recorded effects in order; a set trap raises and ends the flush."""
    for record in records:
        kind = type(record)
        if kind in (Print, Log, Warn) and _skipped(record.when):
            continue
        if kind is Print:
            _perform_print(record.args, record.kwargs)
        elif kind is Log:
            _call_logger(record.site, record.logger, record.method, record.args, record.kwargs)
        elif kind is Warn:
            _warn_explicit(record.site, _resolve(record.args), _resolve(record.kwargs))
        elif kind is Trap and bool(record.flag):
            _put_back(record.kept)  # what the code after the check stored: eager never reached it
            raise record.exc_type(*_resolve(record.args)) from None
        # Guess and Observed were checked before the flush (regions.region)
