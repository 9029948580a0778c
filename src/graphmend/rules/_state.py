"""What can change state after a point of the model's call: the scan [Trap]
makes before it moves a check's exception to the end of the call, and
[Speculate] before it lets a call run twice.

The scan follows the code that runs after the point: the rest of its function
(every later iteration of an enclosing loop included), the callers' code after
their call on every chain Dynamo showed, and every function, method and
module it calls, resolved on the live model (``layer(h)`` of ``for layer in
self.blocks``: the items of every loop binding ``layer``). A store outside
the function's locals, an in-place or mutating method on something not fresh
(see ``analysis.aliasing``; a called module's or helper's result is judged by
what it returns), a global statement, a stateful builtin, or an effect the
runtime does not watch is a reason; deferred effects (the runtime's calls)
are not.
Stores to the check's own ``self`` that the runtime can put back are
collected instead (``undo``, ``undo_data``).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
from typing import Any, Iterator

from graphmend.analysis.aliasing import (
    fresh_arguments,
    fresh_locals,
    has_self,
    is_super_call,
    may_return_input,
    result_fresh,
)
from graphmend.analysis.effects import (
    is_side_effect_call,
    loop_attributes,
    root_of,
    self_attribute,
    watched_effect,
    without_training_branches,
)
from graphmend.analysis.purity import (
    DRAWS_NOTHING,
    STATEFUL_BUILTINS,
    STATELESS_CONTAINERS,
    STATELESS_LAYERS,
    is_layer,
    mutating_method,
    pure_torch_builtin,
    stores,
)
from graphmend.analysis.source import (
    STORES,
    definition_of,
    in_place_argument,
    inside_try,
    module_namespace,
    parse_file,
    statement_in,
)
from graphmend.rules import Decline, RewriteContext
from graphmend.rules._live import bound_through_self, items, none_everywhere, owners


class StateScan:
    """One scan: which functions and classes were judged already, and how deep it may follow calls."""

    max_depth = 6  # calls followed below the check's function
    assume_eval = False  # True: branches taken only in training mode are skipped

    def after(
        self, stmt: ast.stmt, ctx: RewriteContext, assumed: frozenset[str] = frozenset(), settled: Any = None
    ) -> str | None:
        """Why state could change between the check ``stmt`` and the end of the
        model's call (its function's continuation, and its callers'), or None.
        ``assumed``: parameters of the check's function taken as made in the
        call (the rewrite keeps its result to calls where they are None at
        entry, as ``cache=None``); ``settled(chain)``: the check cannot fail
        first when called along that chain (whose callers are not scanned)."""
        from graphmend.analysis.facts import path_to

        self._scanned: dict[int, str | None] = {}  # function or class -> verdict, per check
        self._returns: dict[tuple, bool] = {}  # (callee, element, arguments' freshness) -> whether it returns new
        self._scope: tuple[Any, str] | None = (ctx.fdef, ctx.filename)  # the function being scanned
        self.undo: set[str] = set()  # attributes of the check's `self` stored after it (put back if it raises)
        self.undo_data: set[str] = set()  # its tensors changed in place after it (their data put back)
        self._same_self = has_self(ctx.fdef)  # `self` in the code being scanned is the check's

        path = path_to(ctx.fdef.body, stmt)
        reason = self._scan_continuation(ctx.fdef, path, ctx.globals, ctx, 0, assumed)
        self._same_self = False
        if reason:
            return reason
        # The callers' code after the call that led here runs too: on every
        # path from the model's entry that Dynamo showed reaching this function.
        # (No run at all, as in `graphmend check`: the function alone is judged.)
        if ctx.chains is None:
            return None
        if not ctx.chains:
            return (
                f"the callers of `{ctx.fdef.name}` are not known (Dynamo compiled it as a frame of its own "
                "after an earlier break, and no observed break shows who calls it), so their code after the call "
                "cannot be checked"
            )
        for chain in (c for c in ctx.chains if settled is None or not settled(c)):
            same = has_self(ctx.fdef)  # callers up to here called a method of the check's `self`
            for frame, callee in reversed(list(zip(chain[:-1], chain[1:]))):
                reason, same = self._caller_continuation(frame, ctx, same and callee.function)
                if reason:
                    return reason
        return None

    @classmethod
    def in_call(cls, fdef: Any, filename: str, namespace: dict, ctx: RewriteContext) -> str | None:
        """Why running all of ``fdef`` could change state, or None: the scan of
        a check's continuation applied to a whole call, as [Speculate] needs it
        (deeper, and in eval mode: branches taken only in training skipped)."""
        scanner = cls()
        scanner.assume_eval = True
        scanner.max_depth = 12
        scanner._scanned, scanner._returns = {}, {}
        with scanner._scanning(fdef, filename):
            return scanner._mutation_in(fdef, scanner._fresh(fdef, namespace, ctx, 0), namespace, ctx, 0)

    def _caller_continuation(self, frame: Any, ctx: RewriteContext, method: str | bool) -> tuple[str | None, bool]:
        """Why the caller's code after its call could change state, and
        whether its ``self`` is the check's (it called ``self.<method>(...)``,
        ``method`` the callee's name, False when an inner caller's is not)."""
        from graphmend.analysis.facts import path_to
        from graphmend.analysis.source import defs_containing

        parsed = parse_file(frame.file)
        if parsed is None:
            return f"the source of a caller ({frame.file}) is not available to check", False
        defs = defs_containing(parsed.tree, frame.line)
        if not defs:
            return None, False
        fdef = defs[0]
        found = statement_in(fdef.body, frame.line, into_classes=False)
        if found is None:
            return None, False
        block, index = found
        same = bool(method) and has_self(fdef) and bound_through_self(ctx, str(method)) is True and any(
            isinstance(c, ast.Call) and self_attribute(c.func) == method and isinstance(c.func, ast.Attribute)
            for c in ast.walk(block[index])
        )
        if inside_try(fdef, block[index]):
            raise Decline(
                f"a caller's call is inside a try block (`{fdef.name}`, line {frame.line}): a handler could catch "
                "the exception, which would now be raised after the call"
            )
        path = path_to(fdef.body, block[index])
        namespace = module_namespace(frame.file)
        with self._scanning(fdef, frame.file, same_self=same):
            return self._scan_continuation(fdef, path, namespace, ctx, 0), same

    def _scan_continuation(
        self, fdef: Any, path: Any, namespace: dict, ctx: RewriteContext, depth: int, assumed: frozenset[str] = frozenset()
    ) -> str | None:
        if path is None:
            return None
        local = self._fresh(fdef, namespace, ctx, depth, assumed)
        statements: list[ast.stmt] = []
        for block, index in path:
            owner = None
            statements.extend(block[index + 1 :])
            owner = block[index]
            if isinstance(owner, (ast.For, ast.While, ast.AsyncFor)):
                statements.extend(owner.body)  # later iterations run the whole body again
        for node in statements:
            reason = self._mutation_in(node, local, namespace, ctx, depth)
            if reason:
                return reason
        return None

    def _mutation_in(self, node: ast.AST, local: set[str], namespace: dict, ctx: RewriteContext, depth: int) -> str | None:
        if self.assume_eval:
            node = without_training_branches(node)
        passed = dict(getattr(self, "_callables", ()))  # parameters the caller passed `self.<attr>` for
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Global, ast.Nonlocal)):
                return f"`{type(sub).__name__.lower()} {', '.join(sub.names)}` (line {sub.lineno})"
            if isinstance(sub, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                for t in stores(targets):
                    reason = self._store(t, sub, local, ctx)
                    if reason:
                        return reason
            elif isinstance(sub, ast.Call):
                func = sub.func
                changed = in_place_argument(sub)  # `F.relu(h, inplace=True)`
                if changed is not None and root_of(changed) not in local:
                    return f"`{ast.unparse(sub)}` changes `{ast.unparse(changed)}` in place (line {sub.lineno})"
                if isinstance(func, ast.Attribute) and root_of(func) == "__graphmend_rt__":
                    if func.attr in STORES:  # `runtime.store(m, "x", v)`, [Where]'s `m.x = v`: not deferred
                        reason = self._store(_stored_attribute(sub), sub, local, ctx)
                        if reason:
                            return reason
                    continue  # a deferred effect: dropped when the check fails, as intended
                if is_side_effect_call(sub):
                    if watched_effect(sub, namespace):
                        continue  # the runtime performs the records (a set trap raises) before it
                    return f"`{ast.unparse(func)}(...)` is not deferred (line {sub.lineno})"
                if isinstance(func, ast.Attribute):
                    attr = func.attr
                    if mutating_method(attr):
                        if attr.endswith("_") and self._restorable(func.value, ctx):
                            self.undo_data.add(func.value.attr)  # type: ignore[attr-defined]  # `self.buf.add_(v)`
                        elif root_of(func.value) not in local:
                            return f"`{ast.unparse(func)}(...)` (line {sub.lineno})"
                self_attr = self_attribute(func)
                if self_attr is not None:
                    reason = self._module_effects(self_attr, ast.unparse(func), ctx, depth, (sub, local))
                    if reason:
                        return reason
                elif isinstance(func, ast.Name):
                    if func.id in STATEFUL_BUILTINS and namespace.get(func.id, getattr(builtins, func.id)) is getattr(builtins, func.id):
                        return f"`{func.id}(...)` (line {sub.lineno})"
                    if func.id in local:
                        reason = self._local_callable(func.id, ctx, depth, namespace, (sub, local))
                        if reason:
                            return reason
                        continue
                    if func.id in passed:
                        reason = self._module_effects(passed[func.id], f"{func.id}(...)", ctx, depth)
                        if reason:
                            return reason
                        continue
                    target = namespace.get(func.id, getattr(builtins, func.id, None))
                    if target is None:  # a parameter or loop variable: `for layer in self.layers: layer(h)`
                        reason = self._local_callable(func.id, ctx, depth, namespace, (sub, local))
                        if reason:
                            return reason
                        continue
                    if hasattr(target, "__code__"):
                        reason = self._function_effects(
                            target, func.id, ctx, depth, *fresh_arguments(sub, target, local, bound=False)
                        )
                        if reason:
                            return reason
        return None

    def _module_effects(
        self, attr: str, label: str, ctx: RewriteContext, depth: int, site: tuple[ast.Call, set[str]] | None = None
    ) -> str | None:
        """A call of ``self.<attr>`` (or ``self.<attr>[i]``): what it can be on the live model."""
        values = self._self_values(attr, ctx)
        if not values:
            if none_everywhere(ctx, attr) or self._missing(attr, ctx):
                return None  # calling None, or an attribute the module lacks, raises before any effect
            return f"calls `{label}`, which could not be resolved on the live model"
        return self._modules_effects(values, label, ctx, depth, site, attr)

    def _function_effects(
        self, fn: Any, label: str, ctx: RewriteContext, depth: int, fresh: frozenset[str] = frozenset(),
        callables: frozenset[tuple[str, str]] = frozenset(), same_self: bool = False,
    ) -> str | None:
        """A method or function called after the check: scan its body the same
        way. ``same_self``: a method called through the check's ``self``."""
        if depth >= self.max_depth:
            return f"calls `{label}`, too deep to check"
        code = fn.__code__
        same_self = same_self and getattr(self, "_same_self", False)
        key: Any = (id(code), fresh, callables, same_self) if fresh or callables or same_self else id(code)
        if key in self._scanned:
            return self._scanned[key]
        self._scanned[key] = None  # recursion: assume clean while scanning
        fdef = definition_of(code)
        if fdef is None:
            return f"calls `{label}`, whose source is not available"
        saved, self._callables = getattr(self, "_callables", frozenset()), callables
        saved_self, self._same_self = getattr(self, "_same_self", False), same_self and has_self(fdef)
        try:
            with self._scanning(fdef, code.co_filename):
                local = self._fresh(fdef, fn.__globals__, ctx, depth + 1, fresh)
                reason = self._mutation_in(fdef, local, fn.__globals__, ctx, depth + 1)
        finally:
            self._callables, self._same_self = saved, saved_self
        verdict = f"{code.co_name}: {reason}" if reason else None
        self._scanned[key] = verdict
        return verdict

    def _nested_parameter(
        self, name: str, outer: Any, ctx: RewriteContext, depth: int, namespace: dict | None
    ) -> Any:
        """``name`` is a parameter of a function nested in ``outer`` (as in
        ``def create_custom_forward(module): ... module(*inputs)``): what the
        calls of that function in ``outer`` pass for it."""
        for nested in ast.walk(outer):
            if not isinstance(nested, (ast.FunctionDef, ast.AsyncFunctionDef)) or nested is outer:
                continue
            params = [a.arg for a in nested.args.posonlyargs + nested.args.args]
            if name not in params:
                continue
            index = params.index(name)
            calls = [
                c for c in ast.walk(outer)
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == nested.name
            ]
            if not calls:
                return _UNRESOLVED
            for call in calls:
                if index >= len(call.args) or any(isinstance(a, ast.Starred) for a in call.args[: index + 1]):
                    return f"calls `{name}(...)`, passed to `{nested.name}` in a form that could not be resolved"
                arg = call.args[index]
                if isinstance(arg, ast.Name) and arg.id != name:
                    reason = self._local_callable(arg.id, ctx, depth, namespace)
                elif self_attribute(arg) is not None:
                    reason = self._module_effects(self_attribute(arg), ast.unparse(arg), ctx, depth)
                else:
                    return f"calls `{name}(...)`, passed to `{nested.name}` as `{ast.unparse(arg)}`, which could not be resolved"
                if reason:
                    return reason
            return None
        return _UNRESOLVED

    def _undoable(self, target: ast.AST, stmt: ast.stmt, ctx: RewriteContext) -> bool:
        """A store to an attribute of the check's ``self`` that the runtime can
        put back: a plain assignment, or ``+=`` on a number (on a tensor it
        changes the value in place)."""
        if not getattr(self, "_same_self", False) or not isinstance(target, ast.Attribute):
            return False
        if self_attribute(target) is None:
            return False
        if isinstance(stmt, ast.AugAssign):
            values = self._self_values(target.attr, ctx)
            return bool(values) and all(type(v) in (int, float, bool) for v in values)
        return True

    def _store(self, target: ast.AST, stmt: ast.AST, local: set[str], ctx: RewriteContext) -> str | None:
        """Why a store to ``target`` could change state, or None: a local's, or
        one the runtime puts back when the check raises (collected)."""
        if self._undoable(target, stmt, ctx):  # type: ignore[arg-type]
            self.undo.add(target.attr)  # type: ignore[attr-defined]  # its tensor's data is kept too (records)
        elif isinstance(target, ast.Subscript) and self._restorable(target.value, ctx):
            self.undo_data.add(target.value.attr)  # type: ignore[attr-defined]  # `self.buf[i] = v`
        elif root_of(target) not in local:
            return f"`{ast.unparse(target)} = ...` (line {stmt.lineno})"  # type: ignore[attr-defined]
        return None

    def _restorable(self, receiver: ast.AST, ctx: RewriteContext) -> bool:
        """``self.<attr>`` of the check's ``self``, a tensor on every module
        that runs the code: its data is copied at the check and put back."""
        import torch

        if not getattr(self, "_same_self", False) or not isinstance(receiver, ast.Attribute):
            return False
        values = self._self_values(receiver.attr, ctx) if self_attribute(receiver) is not None else []
        return bool(values) and all(isinstance(v, torch.Tensor) for v in values)

    @contextlib.contextmanager
    def _scanning(self, fdef: Any, filename: str, same_self: bool | None = None) -> Iterator[None]:
        previous, self._scope = getattr(self, "_scope", None), (fdef, filename)
        previous_self = getattr(self, "_same_self", False)
        if same_self is not None:
            self._same_self = same_self
        try:
            yield
        finally:
            self._scope, self._same_self = previous, previous_self

    def _self_values(self, attr: str, ctx: RewriteContext) -> list:
        """What ``self.<attr>`` can be in the function being scanned: the
        attribute on the live modules whose class runs that function (all
        modules of the model when none is found)."""
        return ctx.attribute_values(attr, self._owners(ctx) or None)

    def _owners(self, ctx: RewriteContext) -> list:
        """The live modules whose class runs the function being scanned."""
        scope = getattr(self, "_scope", None)
        return owners(ctx.model, *scope) if scope is not None else []

    def _missing(self, attr: str, ctx: RewriteContext) -> bool:
        """Whether every live module that runs the scanned function lacks
        ``self.<attr>`` (XLM's ``self.lang_embeddings`` with one language):
        the lookup raises AttributeError before the call does anything."""
        owners = self._owners(ctx)
        return bool(owners) and not any(hasattr(m, attr) for m in owners)

    def _fresh(
        self, fdef: Any, namespace: dict, ctx: RewriteContext, depth: int, params: frozenset[str] = frozenset()
    ) -> set[str]:
        """``fdef``'s fresh locals (analysis.aliasing), with a call to the
        model's own code judged by what that code returns."""

        def call_fresh(call: ast.Call, index: int | None, is_fresh: Any) -> bool:
            return self._call_fresh(call, index, is_fresh, namespace, ctx, depth)

        return fresh_locals(fdef, params, call_fresh)

    def _call_fresh(
        self, call: ast.Call, index: int | None, is_fresh: Any, namespace: dict, ctx: RewriteContext, depth: int
    ) -> bool:
        """Whether ``call``'s result (element ``index`` of it) is a new value:
        a torch op's is unless it may return its input (dropout, identity); a
        module's or helper's when each value it returns is made in it or is an
        argument the call passes fresh."""
        func = call.func
        attr = self_attribute(func)
        if attr is not None:
            values, bound = self._self_values(attr, ctx), bound_through_self(ctx, attr)
        elif isinstance(func, ast.Name):
            target = namespace.get(func.id, getattr(builtins, func.id, None))
            loop_items = [item for value in self._loop_values(func.id, ctx) for item in items(value)]
            values, bound = ([target] if target is not None else loop_items), False
        elif isinstance(func, ast.Attribute) and not is_super_call(func.value):  # a torch op, a tensor method
            return not may_return_input(func.attr) or all(map(is_fresh, call.args))  # F.dropout(h): as h
        else:
            return False  # `super().forward(h)`, a call of a call: what it returns is not known
        if not values:
            return attr is not None and none_everywhere(ctx, attr)  # calling None raises: nothing is returned
        if depth >= self.max_depth + 4:  # the scan may be at its limit: returns are followed further
            return False
        return all(self._returns_fresh(v, call, index, is_fresh, ctx, depth, bound) for v in values if callable(v))

    def _returns_fresh(
        self, value: Any, call: ast.Call, index: int | None, is_fresh: Any, ctx: RewriteContext, depth: int,
        bound: bool | None,
    ) -> bool:
        """What ``value``, one thing the call may call, returns: a torch layer's
        output is new unless the layer may hand back its input (Identity,
        dropout, ``inplace=True``; a Sequential holding only such layers); a
        Python function's or a module's forward is read (``result_fresh``)."""
        import inspect

        import torch

        if isinstance(value, torch.nn.Module) and type(value).__module__.startswith("torch.nn"):
            if isinstance(value, torch.nn.Sequential):
                return any(self._returns_fresh(m, call, None, lambda _: False, ctx, depth, True) for m in value) or all(
                    map(is_fresh, call.args)
                )
            aliasing = may_return_input(type(value).__name__) or getattr(value, "inplace", False)
            return not aliasing or all(map(is_fresh, call.args))
        if isinstance(value, torch.nn.Module):
            value, bound = type(value).forward, True
        elif inspect.ismethod(value):
            value, bound = value.__func__, True
        code = getattr(value, "__code__", None)
        if code is None or getattr(value, "__module__", "").startswith("torch"):
            if any(value is getattr(builtins, name) for name in ("max", "min", "getattr", "next")):
                return False  # one of its arguments, or an attribute
            if isinstance(value, type) or not may_return_input(getattr(value, "__name__", "")):
                return True
            return all(map(is_fresh, call.args))  # `dropout(h)` imported by name: as h
        fdef = definition_of(code)
        if fdef is None or bound is None:
            return False
        namespace = value.__globals__

        def inner(c: ast.Call, i: int | None, f: Any) -> bool:  # the callee's own calls
            return self._call_fresh(c, i, f, namespace, ctx, depth + 1)

        key = (id(code), index, tuple(map(is_fresh, call.args)), tuple(is_fresh(k.value) for k in call.keywords))
        if key not in self._returns:
            self._returns[key] = False  # recursion: not proven
            with self._scanning(fdef, code.co_filename):
                self._returns[key] = result_fresh(fdef, call, index, is_fresh, inner, bound=bound)
        return self._returns[key]

    def _loop_values(self, name: str, ctx: RewriteContext) -> list:
        """``for layer in self.layers``: what ``self.layers`` holds, for every
        loop of the function being scanned that binds ``layer`` (none when
        ``layer`` is bound otherwise too: ``analysis.effects.loop_attributes``)."""
        current = getattr(self, "_scope", None)
        attrs = loop_attributes(current[0], name) if current is not None else None
        return [value for attr in attrs or () for value in self._self_values(attr, ctx)]

    def _local_callable(
        self, name: str, ctx: RewriteContext, depth: int, namespace: dict | None = None,
        site: tuple[ast.Call, set[str]] | None = None,
    ) -> str | None:
        """``name(...)`` in the function being scanned: a function defined inside
        it (its body), a parameter a caller passes, a value looked up in a global
        table, or a loop variable (the modules of every loop binding ``name``)."""
        current = getattr(self, "_scope", None)
        if current is not None:
            nested = [
                n for n in ast.walk(current[0])
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name and n is not current[0]
            ]
            if len(nested) == 1:
                if depth >= self.max_depth:
                    return f"calls `{name}(...)`, too deep to check"
                key = id(nested[0])
                if key not in self._scanned:
                    self._scanned[key] = None
                    saved, self._same_self = getattr(self, "_same_self", False), False
                    local = self._fresh(nested[0], namespace or {}, ctx, depth + 1)
                    reason = self._mutation_in(nested[0], local, namespace or {}, ctx, depth + 1)
                    self._same_self = saved
                    self._scanned[key] = f"{name}: {reason}" if reason else None
                return self._scanned[key]
            reason = self._nested_parameter(name, current[0], ctx, depth, namespace)
            if reason is not _UNRESOLVED:
                return reason
            reason = self._looked_up(name, current[0], ctx, depth, namespace or {})
            if reason is not _UNRESOLVED:
                return reason
        values = self._loop_values(name, ctx)
        if values:
            return self._modules_effects(values, f"{name}(...)", ctx, depth, site)
        return f"calls the local `{name}(...)`, which could not be resolved"

    def _looked_up(self, name: str, scope: Any, ctx: RewriteContext, depth: int, namespace: dict) -> Any:
        """``fn = TABLE[key]; ... fn(...)`` with ``TABLE`` a global mapping (as
        transformers' ``ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]``):
        the call is one of its values, so every value is judged. _UNRESOLVED
        when ``name`` is not bound that way, once, in the function."""
        from collections.abc import Mapping

        stores = [n for n in ast.walk(scope) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)]
        binds = [n for n in ast.walk(scope) if isinstance(n, ast.Assign) and n.targets == stores]
        parameters = {a.arg for a in ast.walk(scope.args) if isinstance(a, ast.arg)}
        if len(stores) != 1 or len(binds) != 1 or name in parameters:
            return _UNRESOLVED
        value = binds[0].value
        if not (isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name)):
            return _UNRESOLVED
        table = namespace.get(value.value.id)
        if not isinstance(table, Mapping):
            return _UNRESOLVED
        for entry in list(table.values()):
            if not hasattr(entry, "__code__"):
                return f"calls `{name}(...)`, a value of `{value.value.id}` that is not a Python function"
            reason = self._function_effects(entry, f"{value.value.id}[...]", ctx, depth)
            if reason:
                return reason
        return None

    def _modules_effects(
        self, values: list, label: str, ctx: RewriteContext, depth: int,
        site: tuple[ast.Call, set[str]] | None = None, attr: str | None = None,
    ) -> str | None:
        import torch

        for value in values:
            if not callable(value):
                continue  # another module's attribute of that name; calling it would raise first
            if not isinstance(value, torch.nn.Module):
                if hasattr(value, "__code__"):
                    fresh: frozenset[str] = frozenset()
                    bound = bound_through_self(ctx, attr) if attr is not None else None
                    if site is not None and bound is not None:
                        fresh, _ = fresh_arguments(site[0], value, site[1], bound=bound)
                    reason = self._function_effects(value, label, ctx, depth, fresh, same_self=bound is True)
                    if reason:
                        return reason
                    continue
                if pure_torch_builtin(value) and (self.assume_eval or getattr(value, "__name__", "") in DRAWS_NOTHING):
                    continue  # [Speculate] restores the RNG; a trap cannot undo a random draw after its check
                return f"calls `{label}`, which is not a module or a Python function"
            called = list(value.children()) if is_layer(value, frozenset({"ModuleList", "ModuleDict"})) else [value]
            for module in value.modules():
                cls = type(module)
                if is_layer(module, STATELESS_LAYERS | STATELESS_CONTAINERS):
                    continue
                if depth >= self.max_depth:
                    return f"calls `{label}` ({cls.__name__}), too deep to check"
                forward = getattr(cls, "forward", None)
                code = getattr(forward, "__code__", None)
                fdef = definition_of(code) if code is not None else None
                if fdef is None:
                    return f"calls `{label}` ({cls.__name__}), whose forward source was not found"
                fresh = frozenset()
                if site is not None and any(module is c for c in called):
                    fresh, _ = fresh_arguments(site[0], forward, site[1], bound=True)
                key = (id(cls), fresh) if fresh else id(cls)
                if key in self._scanned:
                    if self._scanned[key]:
                        return self._scanned[key]
                    continue
                self._scanned[key] = None
                with self._scanning(fdef, code.co_filename, same_self=False):
                    local = self._fresh(fdef, forward.__globals__, ctx, depth + 1, fresh)
                    reason = self._mutation_in(fdef, local, forward.__globals__, ctx, depth + 1)
                if reason:
                    self._scanned[key] = f"{cls.__name__}.forward: {reason}"
                    return self._scanned[key]
        return None


def _stored_attribute(call: ast.Call) -> ast.expr:
    """``m.x`` for ``runtime.store(m, "x", v)`` / ``runtime.register_buffer(m, "x", v)``
    (which rebind it, or copy into the buffer it holds); the call itself when
    the name is not a constant (judged as a store to something unknown)."""
    if len(call.args) >= 2 and isinstance(call.args[1], ast.Constant) and isinstance(call.args[1].value, str):
        return ast.Attribute(value=call.args[0], attr=call.args[1].value, ctx=ast.Store())
    return call


_UNRESOLVED = object()  # a lookup that found nothing (None means: found, and clean)
