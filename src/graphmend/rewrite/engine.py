"""The rewrite engine: from a break site to new code installed in the running process.

Small passes, each usable alone:

``locate``   (file, line) -> the live function object(s) whose code holds the line
``rewrite``  apply each site's rule to its statement in a fresh copy of the function's AST
``build``    compile the new AST so the code object fits the original function
             (same closure variables, the ``__class__`` cell for ``super()``,
             class-private name mangling, the original file and line numbers)
``install``  swap ``function.__code__`` in place, so every reference to the
             function (class attributes, dispatch tables, ``from x import f``
             copies) sees the new code; ``uninstall`` swaps it back.

Nothing is written to disk: library code (transformers, ...) is mended in
memory, its files untouched.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import gc
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Iterable

from graphmend import runtime
from graphmend.analysis import source
from graphmend.analysis.callers import shared_entry_in_calls, shared_update_in_callers
from graphmend.analysis.facts import FunctionFacts
from graphmend.analysis.memo import recall
from graphmend.analysis.shared import SharedUpdates, callees_from, new_from_layers
from graphmend.analysis.source import (
    RUNTIME_NAME,
    defs_containing,
    first_line,
    parse_file,
    statement_in,
)
from graphmend.rules import Decline, RewriteContext, Rule

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass
class Located:
    """A function found live in the process, with its source."""

    functions: list[types.FunctionType]  # every function object sharing the code
    code: types.CodeType  # the code it runs now
    node: FunctionNode  # a fresh copy of its definition, original line numbers
    filename: str
    namespace: dict[str, Any]
    previous: "Patch | None" = None  # set when an earlier round already rewrote it

    @property
    def qualname(self) -> str:
        return getattr(self.code, "co_qualname", self.code.co_name)


# Installed code -> (that code, the user's code it replaced). A second model of a
# class another mending rewrote finds that mending's code installed: its patch
# records the user's code, so undoing the two in either order restores it.
_ORIGINALS: dict[int, tuple[types.CodeType, types.CodeType]] = {}


@dataclass
class Patch:
    """One installed rewrite; enough to undo it exactly."""

    located: Located
    new_code: types.CodeType
    original_code: types.CodeType
    injected_runtime: bool
    node: FunctionNode | None = None  # the rewritten definition
    source: str = ""  # the rewritten function, for reports and debugging

    def uninstall(self) -> None:
        source.MENDED.pop(id(self.new_code), None)
        _ORIGINALS.pop(id(self.new_code), None)
        for fn in self.located.functions:
            if fn.__code__ is self.new_code:
                fn.__code__ = self.original_code
        if self.injected_runtime and self.located.namespace.get(RUNTIME_NAME) is runtime:
            still_used = any(
                RUNTIME_NAME in (f.__code__.co_names)
                for f in _module_functions(self.located.namespace)
            )
            if not still_used:
                del self.located.namespace[RUNTIME_NAME]


# --------------------------------------------------------------------------
# locate


# Resolved once per path: locating a site compares every module's file and every function's
# with the site's, and resolving them anew each time was most of a small model's mend.
_realpath = functools.lru_cache(maxsize=16384)(os.path.realpath)


def _same_file(a: str, b: str) -> bool:
    try:
        return _realpath(a) == _realpath(b)
    except (OSError, ValueError):
        return a == b


def _unwrap_all(obj: Any) -> Iterable[types.FunctionType]:
    seen = 0
    while obj is not None and seen < 16:
        if isinstance(obj, types.FunctionType):
            yield obj
        obj = getattr(obj, "__wrapped__", None)
        seen += 1


def _class_functions(cls: type, seen: set[int]) -> Iterable[types.FunctionType]:
    if id(cls) in seen:
        return
    seen.add(id(cls))
    for value in list(vars(cls).values()):
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            for accessor in (value.fget, value.fset, value.fdel):
                yield from _unwrap_all(accessor)
            continue
        if isinstance(value, type) and value.__module__ == cls.__module__:
            yield from _class_functions(value, seen)
            continue
        yield from _unwrap_all(value)


def _module_functions(namespace: dict[str, Any]) -> Iterable[types.FunctionType]:
    module_name = namespace.get("__name__")
    seen: set[int] = set()
    for value in list(namespace.values()):
        if isinstance(value, type) and getattr(value, "__module__", None) == module_name:
            yield from _class_functions(value, seen)
        else:
            yield from _unwrap_all(value)


def _candidates(filename: str) -> list[types.FunctionType]:
    found: list[types.FunctionType] = []
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and _same_file(path, filename):
            found.extend(f for f in _module_functions(vars(module)) if _same_file(f.__code__.co_filename, filename))
    if not found:  # classes built at run time, functions kept only in containers
        found = [
            o
            for o in gc.get_objects()
            if type(o) is types.FunctionType and _same_file(o.__code__.co_filename, filename)
        ]
    return found


def locate(filename: str, line: int, patched: dict[int, "Patch"] | None = None) -> Located:
    """The live function holding ``filename:line``; raises Decline when there is none.

    ``patched`` maps ``id(new_code)`` of patches already installed: a function
    rewritten in an earlier round is rewritten again from that round's AST."""
    parsed = parse_file(filename)
    if parsed is None:
        raise Decline(f"source of {os.path.basename(filename)} is not available or does not parse")
    defs = defs_containing(parsed.tree, line)
    if not defs:
        raise Decline("the line is not inside a function (module or class body code)")
    functions = _candidates(filename)
    for node in defs:
        first = first_line(node)
        matches = [f for f in functions if f.__code__.co_name == node.name and f.__code__.co_firstlineno == first]
        if not matches and node is not defs[-1]:
            # A nested function (a closure) lives only as objects its parent
            # made; find the live ones.
            matches = [
                o
                for o in gc.get_objects()
                if type(o) is types.FunctionType
                and o.__code__.co_name == node.name
                and o.__code__.co_firstlineno == first
                and _same_file(o.__code__.co_filename, filename)
            ]
        if matches:
            code = matches[0].__code__
            sharing = [o for o in gc.get_referrers(code) if type(o) is types.FunctionType and o.__code__ is code]
            previous = (patched or {}).get(id(code))
            return Located(
                functions=sharing or matches,
                code=code,
                node=copy.deepcopy(previous.node if previous is not None else node),
                filename=filename,
                namespace=matches[0].__globals__,
                previous=previous,
            )
    raise Decline(f"no live function object holds line {line} (code generated or created at run time)")


# --------------------------------------------------------------------------
# rewrite


@dataclass
class SiteRewrite:
    line: int
    rule: Rule
    ok: bool = False
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    memo_attrs: set[str] = field(default_factory=set)
    frames: list[Any] = field(default_factory=list)  # the break's frame chain, entry first
    chains: list[Any] | None = None  # from the model's entry to the break; None: no run (graphmend check)
    unalias: set[str] = field(default_factory=set)


def rewrite(located: Located, sites: list[SiteRewrite], model: Any = None) -> FunctionNode:
    """Apply each site's rule to its statement in ``located.node`` (in place)."""
    ctx = RewriteContext.for_function(located.node, located.namespace, located.filename, model)
    # A break between a read and an in-place update of tensors that may share storage stays (shared.SharedUpdates).
    model_key = ("layers of", id(model))  # one pair per round: callers' judgements are recalled by them
    new_result = recall(model_key + ("new",), lambda: new_from_layers(ctx.attribute_values), model)
    callees = recall(model_key + ("callees",), lambda: callees_from(ctx.attribute_values), model)
    facts = FunctionFacts.of(located.node, located.namespace, ctx.local_names)
    shared = SharedUpdates(located.node, facts, new_result, callees)
    placed: list[tuple[SiteRewrite, list[ast.stmt]]] = []
    # Bottom-up so that replacing one statement never moves another's index.
    for site in sorted(sites, key=lambda s: s.line, reverse=True):
        found = statement_in(located.node.body, site.line, into_classes=False)
        if found is None:
            site.reason = "no statement of this function holds the line"
            continue
        body, index = found
        ctx.notes = []
        ctx.memo_attrs = set()
        ctx.frames = list(site.frames)
        ctx.chains = None if site.chains is None else list(site.chains)
        ctx.unalias = set()
        ctx.entry = []
        try:
            joined = (
                shared.at(body[index])
                or shared_entry_in_calls(
                    shared, shared.entry_pairs(body[index]), located.node, located.filename, site.chains, new_result, callees
                )
                or shared_update_in_callers(site.chains, new_result, callees)
            )
            if joined:
                raise Decline(_own_reason(site, located.node, ctx) or joined)
            replacement = site.rule.rewrite(body[index], ctx)
        except Decline as exc:
            site.reason = exc.reason
            continue
        except Exception as exc:  # a rule bug must not cost the user their model
            site.reason = f"internal error in rule {site.rule.name}: {type(exc).__name__}: {exc}"
            continue
        inside = {id(node) for node in ast.walk(body[index])}
        for earlier, nodes in placed:  # applied inside this statement: now part of this rewrite
            if any(id(node) in inside for node in nodes):
                earlier.notes = [f"rewritten with line {site.line} ({site.rule.name})"]
        placed.append((site, replacement))
        ctx.replaced.update({id(node): (node, body[index]) for node in replacement})
        ctx.replaced_by.update({id(node): site.rule.name for node in replacement})
        body[index : index + 1] = replacement
        site.ok = True
        site.notes = list(ctx.notes)
        site.memo_attrs = set(ctx.memo_attrs)
        site.unalias = set(ctx.unalias)
        ctx.entry_kept += ctx.entry
    _place_entry(located.node, ctx.entry_kept)
    return located.node


def _own_reason(site: SiteRewrite, fdef: FunctionNode, ctx: RewriteContext) -> str | None:
    """The site's rule's own reason to decline, asked of a copy of the function (a
    rewrite may change other statements too): where a break must stay for another
    reason as well, the report names the rule's, the more specific one."""
    twin = copy.deepcopy(fdef)
    found = statement_in(twin.body, site.line, into_classes=False)
    if found is None:
        return None
    try:
        site.rule.rewrite(found[0][found[1]], dataclasses.replace(ctx, fdef=twin, notes=[], entry=[], entry_kept=[]))
    except Decline as exc:
        return exc.reason
    except Exception:  # a rule bug: reported where the rule applies
        return None
    return None


def _place_entry(fdef: FunctionNode, entry: list[ast.stmt]) -> None:
    """Put what rewrites need at the function's start after its docstring, at
    the def line (no break site is there, so no later site finds them)."""
    body = fdef.body
    start = 1 if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str) else 0
    for stmt in entry:
        for node in ast.walk(stmt):
            if "lineno" in node._attributes:
                node.lineno = node.end_lineno = fdef.lineno  # type: ignore[attr-defined]
                node.col_offset, node.end_col_offset = 0, 0  # type: ignore[attr-defined]
    body[start:start] = entry


# --------------------------------------------------------------------------
# build


def _strip_for_compile(node: FunctionNode) -> FunctionNode:
    """Drop what the def statement evaluates (decorators, defaults,
    annotations): those live on the function object, not in its code."""
    node = copy.deepcopy(node)
    node.decorator_list = []
    node.returns = None
    args = node.args
    args.defaults = []
    args.kw_defaults = [None] * len(args.kwonlyargs)
    for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
        if a is not None:
            a.annotation = None
    for sub in ast.walk(node):
        if isinstance(sub, ast.AnnAssign) and sub.value is None and isinstance(sub.target, ast.Name):
            pass  # a bare annotation in the body is a no-op at run time; keep it
    return node


def _enclosing_class(code: types.CodeType) -> str | None:
    qualname = getattr(code, "co_qualname", "")
    parts = qualname.split(".")
    if len(parts) >= 2 and parts[-2] != "<locals>":
        return parts[-2]
    return None


def _attributes_on_one_line(node: FunctionNode) -> None:
    """End each generated ``a.b`` on the line it starts.

    Rules place the nodes they generate (``__graphmend_rt__.log``,
    ``torch.where``) at the span of the statement they replace, so a generated
    attribute and its value share a span of several lines. CPython then puts
    the method load (``LOAD_METHOD``; ``LOAD_ATTR`` from 3.12) on the span's
    last line, and Dynamo's line table writer (torch 2.13,
    ``linetable_311_writer``) adds a line change twice for an instruction
    longer than 8 code units: every break after it, in a resume function, was
    reported lines too far down (outside the function, or at another
    statement). Parsed code never has an attribute with its value's exact
    span, so only generated nodes change."""
    for sub in ast.walk(node):
        if not isinstance(sub, ast.Attribute) or sub.end_lineno in (None, sub.lineno):
            continue
        value = sub.value
        span = (sub.lineno, sub.col_offset, sub.end_lineno, sub.end_col_offset)
        if (value.lineno, value.col_offset, value.end_lineno, value.end_col_offset) == span:
            sub.end_lineno, sub.end_col_offset = sub.lineno, sub.col_offset


def build(located: Located, node: FunctionNode) -> types.CodeType:
    """Compile ``node`` into a code object that can replace ``located.code``."""
    original = located.code
    func_node = _strip_for_compile(node)
    body: list[ast.stmt] = [func_node]
    holder: ast.stmt
    class_name = _enclosing_class(original)
    if class_name is not None:
        # A class body gives the same private-name mangling and the __class__ cell.
        holder = ast.ClassDef(name=class_name, bases=[], keywords=[], body=body, decorator_list=[])
        inner: list[ast.stmt] = [holder]
    else:
        inner = body
    free = [v for v in original.co_freevars if v != "__class__" or class_name is None]
    if free:
        # Closure variables become locals of a factory around the definition.
        factory = ast.FunctionDef(
            name="__graphmend_factory__",
            args=ast.arguments(
                posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]
            ),
            body=[
                *(ast.Assign(targets=[ast.Name(id=v, ctx=ast.Store())], value=ast.Constant(None)) for v in free),
                *inner,
                ast.Return(value=ast.Constant(None)),
            ],
            decorator_list=[],
            returns=None,
        )
        module = ast.Module(body=[factory], type_ignores=[])
    else:
        # At module level the holder class binds no name the body could capture.
        module = ast.Module(body=inner, type_ignores=[])
    ast.fix_missing_locations(module)
    _attributes_on_one_line(func_node)
    compiled = compile(module, located.filename, "exec", dont_inherit=True)
    new = _find_code(compiled, original.co_name, func_node.lineno)
    if new is None:
        raise Decline("internal: the rewritten function did not compile to a code object")
    if new.co_freevars != original.co_freevars:
        raise Decline(
            f"the rewrite changes the closure ({original.co_freevars} -> {new.co_freevars}); kept the original"
        )
    if (new.co_argcount, new.co_kwonlyargcount, new.co_posonlyargcount) != (
        original.co_argcount,
        original.co_kwonlyargcount,
        original.co_posonlyargcount,
    ) or new.co_varnames[: new.co_argcount] != original.co_varnames[: original.co_argcount]:
        raise Decline("internal: the rewritten signature differs from the original")
    if hasattr(new, "co_qualname"):
        new = new.replace(co_qualname=original.co_qualname)
    return new


def _find_code(code: types.CodeType, name: str, line: int) -> types.CodeType | None:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_name == name and const.co_firstlineno == line:
                return const
            found = _find_code(const, name, line)
            if found is not None:
                return found
    return None


# --------------------------------------------------------------------------
# install


def install(located: Located, new_code: types.CodeType, node: FunctionNode) -> Patch:
    """Swap the code in; a function rewritten before keeps its first original."""
    namespace = located.namespace
    existing = namespace.get(RUNTIME_NAME)
    if existing is not None and existing is not runtime:
        raise Decline(f"the module already defines {RUNTIME_NAME}")
    injected = existing is None
    namespace[RUNTIME_NAME] = runtime
    for fn in located.functions:
        fn.__code__ = new_code
    source.MENDED[id(new_code)] = node
    previous = located.previous
    if previous is not None:
        source.MENDED.pop(id(previous.new_code), None)
        _ORIGINALS.pop(id(previous.new_code), None)
    original = previous.original_code if previous is not None else _ORIGINALS.get(id(located.code), (None, located.code))[1]
    _ORIGINALS[id(new_code)] = (new_code, original)
    return Patch(
        located=located,
        new_code=new_code,
        original_code=original,
        injected_runtime=previous.injected_runtime if previous is not None else injected,
        node=node,
        source=ast.unparse(node),
    )


def unalias_buffers(model: Any, names: set[str]) -> list[str]:
    """Give each named buffer its own storage where another attribute of its
    module holds the same tensor, so a rewrite that updates the buffer in place
    cannot write through to that attribute. Values do not change."""
    import torch

    done: list[str] = []
    if not isinstance(model, torch.nn.Module) or not names:
        return done
    for path, module in model.named_modules():
        for name in names:
            buf = module._buffers.get(name)
            if buf is None:
                continue
            shared = any(v is buf for k, v in vars(module).items() if k not in ("_buffers",)) or any(
                v is buf for k, v in module._buffers.items() if k != name
            )
            if shared:
                module._buffers[name] = buf.clone()
                done.append(f"{path}.{name}" if path else name)
    return done
