"""What can change state after a point of the model's call: the scan [Trap]
makes before it moves a check's exception to the end of the call, and
[Speculate] before it lets a call run twice.

The scan follows the code that runs after the point: the rest of its function
(every later iteration of an enclosing loop included), the callers' code after
their call on every chain Dynamo showed, and every function, method and
module it calls, resolved on the live model. A store outside the function's
locals, an in-place or mutating method on something not local, a global
statement, a stateful builtin, or an effect the runtime does not watch is a
reason; deferred effects (the runtime's calls) are not.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
from typing import Any, Iterator

from graphmend.analysis.effects import (
    is_side_effect_call,
    loop_attribute,
    root_of,
    self_attribute,
    watched_effect,
    without_training_branches,
)
from graphmend.analysis.purity import (
    STATEFUL_BUILTINS,
    STATELESS_CONTAINERS,
    STATELESS_LAYERS,
    is_layer,
    mutating_method,
    pure_torch_builtin,
    stores,
)
from graphmend.analysis.source import (
    definition_of,
    first_line,
    module_namespace,
    parse_file,
    statement_in,
)
from graphmend.rules import Decline, RewriteContext


class StateScan:
    """One scan: which functions and classes were judged already, and how deep it may follow calls."""

    max_depth = 6  # calls followed below the check's function
    assume_eval = False  # True: branches taken only in training mode are skipped

    def after(self, stmt: ast.stmt, ctx: RewriteContext) -> str | None:
        """Why state could change between the check ``stmt`` and the end of the
        model's call (its function's continuation, and its callers'), or None."""
        from graphmend.analysis.facts import path_to

        self._scanned: dict[int, str | None] = {}  # function or class -> verdict, per check
        self._scope: tuple[Any, str] | None = (ctx.fdef, ctx.filename)  # the function being scanned

        path = path_to(ctx.fdef.body, stmt)
        reason = self._scan_continuation(ctx.fdef, path, ctx.globals, ctx, 0)
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
        for chain in ctx.chains:
            for frame in chain[:-1]:
                reason = self._caller_continuation(frame, ctx)
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
        scanner._scanned = {}
        with scanner._scanning(fdef, filename):
            return scanner._mutation_in(fdef, _fresh_locals(fdef), namespace, ctx, 0)

    def _caller_continuation(self, frame: Any, ctx: RewriteContext) -> str | None:
        from graphmend.analysis.facts import path_to
        from graphmend.analysis.source import defs_containing

        parsed = parse_file(frame.file)
        if parsed is None:
            return f"the source of a caller ({frame.file}) is not available to check"
        defs = defs_containing(parsed.tree, frame.line)
        if not defs:
            return None
        fdef = defs[0]
        found = statement_in(fdef.body, frame.line, into_classes=False)
        if found is None:
            return None
        block, index = found
        if inside_try(fdef, block[index]):
            raise Decline(
                f"a caller's call is inside a try block (`{fdef.name}`, line {frame.line}): a handler could catch "
                "the exception, which would now be raised after the call"
            )
        path = path_to(fdef.body, block[index])
        namespace = module_namespace(frame.file)
        with self._scanning(fdef, frame.file):
            return self._scan_continuation(fdef, path, namespace, ctx, 0)

    def _scan_continuation(self, fdef: Any, path: Any, namespace: dict, ctx: RewriteContext, depth: int) -> str | None:
        if path is None:
            return None
        local = _fresh_locals(fdef)
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
                    if root_of(t) not in local:
                        return f"`{ast.unparse(t)} = ...` (line {sub.lineno})"
            elif isinstance(sub, ast.Call):
                func = sub.func
                if isinstance(func, ast.Attribute) and root_of(func) == "__graphmend_rt__":
                    continue  # a deferred effect: dropped when the check fails, as intended
                if is_side_effect_call(sub):
                    if watched_effect(sub, namespace):
                        continue  # the runtime performs the records (a set trap raises) before it
                    return f"`{ast.unparse(func)}(...)` is not deferred (line {sub.lineno})"
                if isinstance(func, ast.Attribute):
                    attr = func.attr
                    if mutating_method(attr):
                        if root_of(func.value) not in local:
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
                        reason = self._local_callable(func.id, node, ctx, depth, namespace)
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
                        reason = self._local_callable(func.id, node, ctx, depth, namespace)
                        if reason:
                            return reason
                        continue
                    if hasattr(target, "__code__"):
                        reason = self._function_effects(
                            target, func.id, ctx, depth, *_arguments(sub, target, local, bound=False)
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
            if _none_everywhere(ctx, attr):
                return None  # calling None raises before any effect
            return f"calls `{label}`, which could not be resolved on the live model"
        return self._modules_effects(values, label, ctx, depth, site, attr)

    def _function_effects(
        self, fn: Any, label: str, ctx: RewriteContext, depth: int, fresh: frozenset[str] = frozenset(),
        callables: frozenset[tuple[str, str]] = frozenset(),
    ) -> str | None:
        """A method or function called after the check: scan its body the same way."""
        if depth >= self.max_depth:
            return f"calls `{label}`, too deep to check"
        code = fn.__code__
        key: Any = (id(code), fresh, callables) if fresh or callables else id(code)
        if key in self._scanned:
            return self._scanned[key]
        self._scanned[key] = None  # recursion: assume clean while scanning
        fdef = definition_of(code)
        if fdef is None:
            return f"calls `{label}`, whose source is not available"
        saved, self._callables = getattr(self, "_callables", frozenset()), callables
        try:
            with self._scanning(fdef, code.co_filename):
                reason = self._mutation_in(fdef, _fresh_locals(fdef, fresh), fn.__globals__, ctx, depth + 1)
        finally:
            self._callables = saved
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
                    reason = self._local_callable(arg.id, outer, ctx, depth, namespace)
                elif self_attribute(arg) is not None:
                    reason = self._module_effects(self_attribute(arg), ast.unparse(arg), ctx, depth)
                else:
                    return f"calls `{name}(...)`, passed to `{nested.name}` as `{ast.unparse(arg)}`, which could not be resolved"
                if reason:
                    return reason
            return None
        return _UNRESOLVED

    @contextlib.contextmanager
    def _scanning(self, fdef: Any, filename: str) -> Iterator[None]:
        previous, self._scope = getattr(self, "_scope", None), (fdef, filename)
        try:
            yield
        finally:
            self._scope = previous

    def _self_values(self, attr: str, ctx: RewriteContext) -> list:
        """What ``self.<attr>`` can be in the function being scanned: the
        attribute on the live modules whose class runs that function (all
        modules of the model when none is found)."""
        import torch

        scope = getattr(self, "_scope", None)
        if scope is None or not isinstance(ctx.model, torch.nn.Module):
            return ctx.attribute_values(attr)
        fdef, filename = scope
        line = first_line(fdef)
        owners = [m for m in ctx.model.modules() if _runs(type(m), fdef.name, line, filename)]
        return ctx.attribute_values(attr, owners or None)

    def _local_callable(
        self, name: str, scope: ast.AST, ctx: RewriteContext, depth: int, namespace: dict | None = None
    ) -> str | None:
        """``for layer in self.layers: ... layer(h)``: the modules the loop yields;
        a function defined inside the function being scanned: its body."""
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
                    reason = self._mutation_in(nested[0], _fresh_locals(nested[0]), namespace or {}, ctx, depth + 1)
                    self._scanned[key] = f"{name}: {reason}" if reason else None
                return self._scanned[key]
            reason = self._nested_parameter(name, current[0], ctx, depth, namespace)
            if reason is not _UNRESOLVED:
                return reason
        outer = [current[0]] if current is not None else []
        for loop in (n for root in [scope, *outer] for n in ast.walk(root)):
            attr = loop_attribute(loop, name) if isinstance(loop, ast.For) else None
            if attr is not None:
                values = self._self_values(attr, ctx)
                if values:
                    return self._modules_effects(values, f"{name}(...)", ctx, depth)
        return f"calls the local `{name}(...)`, which could not be resolved"

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
                    if site is not None and attr is not None:
                        bound = _bound_through_self(ctx, attr)
                        if bound is not None:
                            fresh, _ = _arguments(site[0], value, site[1], bound=bound)
                    reason = self._function_effects(value, label, ctx, depth, fresh)
                    if reason:
                        return reason
                    continue
                if self.assume_eval and pure_torch_builtin(value):
                    continue
                return f"calls `{label}`, which is not a module or a Python function"
            for module in value.modules():
                cls = type(module)
                if is_layer(module, STATELESS_LAYERS | STATELESS_CONTAINERS):
                    continue
                if depth >= self.max_depth:
                    return f"calls `{label}` ({cls.__name__}), too deep to check"
                if id(cls) in self._scanned:
                    if self._scanned[id(cls)]:
                        return self._scanned[id(cls)]
                    continue
                self._scanned[id(cls)] = None
                forward = getattr(cls, "forward", None)
                code = getattr(forward, "__code__", None)
                fdef = definition_of(code) if code is not None else None
                if fdef is None:
                    return f"calls `{label}` ({cls.__name__}), whose forward source was not found"
                with self._scanning(fdef, code.co_filename):
                    reason = self._mutation_in(fdef, _fresh_locals(fdef), forward.__globals__, ctx, depth + 1)
                if reason:
                    self._scanned[id(cls)] = f"{cls.__name__}.forward: {reason}"
                    return self._scanned[id(cls)]
        return None


def inside_try(fdef: ast.AST, stmt: ast.stmt) -> bool:
    """Whether ``stmt`` sits in the body of a ``try`` of ``fdef`` (a handler could catch what it raises)."""
    for node in ast.walk(fdef):
        if isinstance(node, ast.Try) and any(stmt is n for b in node.body for n in ast.walk(b)):
            return True
    return False


_UNRESOLVED = object()  # a lookup that found nothing (None means: found, and clean)


def _none_everywhere(ctx: RewriteContext, attr: str) -> bool:
    import torch

    model = ctx.model
    if not isinstance(model, torch.nn.Module):
        return False
    holders = [m for m in model.modules() if attr in vars(m)]
    return bool(holders) and all(vars(m)[attr] is None for m in holders)


_VIEW_METHODS = frozenset(
    {"view", "view_as", "reshape", "transpose", "permute", "flatten", "squeeze", "unsqueeze", "expand", "expand_as",
     "narrow", "select", "detach", "t", "contiguous", "to", "as_strided", "unflatten", "split", "chunk", "unbind",
     "movedim", "swapaxes", "diagonal", "real", "imag", "type", "float", "half", "double", "long", "int", "bool"}
)


def _bound_through_self(ctx: RewriteContext, attr: str) -> bool | None:
    """Whether ``self.<attr>(...)`` passes ``self`` as the first parameter
    (a method) or not (a staticmethod); None when the model's classes disagree."""
    import inspect

    import torch

    if not isinstance(ctx.model, torch.nn.Module):
        return None
    kinds = set()
    for module in ctx.model.modules():
        raw = inspect.getattr_static(type(module), attr, None)
        if raw is None:
            continue
        kinds.add("static" if isinstance(raw, staticmethod) else "method" if inspect.isfunction(raw) else "other")
    if kinds == {"static"}:
        return False
    if kinds == {"method"}:
        return True
    return None


def _arguments(
    call: ast.Call, fn: Any, local: set[str], *, bound: bool
) -> tuple[frozenset[str], frozenset[tuple[str, str]]]:
    """What the call passes the callee: the parameters that receive one of the
    caller's fresh locals (in-place changes to them change nothing the
    caller's caller can see), and (parameter, attr) for each argument passed as
    ``self.<attr>`` (a method or module the callee may call through it).
    Positional arguments up to a ``*args``, and keywords naming a parameter."""
    fdef = definition_of(fn.__code__) if hasattr(fn, "__code__") else None
    if fdef is None:
        return frozenset(), frozenset()
    params = [a.arg for a in fdef.args.posonlyargs + fdef.args.args]
    if bound:
        params = params[1:]
    pairs = []
    for index, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred) or index >= len(params):
            break
        pairs.append((params[index], arg))
    named = {a.arg for a in fdef.args.args + fdef.args.kwonlyargs}
    pairs += [(k.arg, k.value) for k in call.keywords if k.arg in named]
    fresh = frozenset(p for p, arg in pairs if isinstance(arg, ast.Name) and arg.id in local)
    callables = frozenset((p, self_attribute(arg)) for p, arg in pairs if self_attribute(arg) is not None)
    return fresh, callables


def _fresh_locals(fdef: Any, fresh_params: frozenset[str] = frozenset()) -> set[str]:
    """Locals that hold values the function made itself (results of calls and
    arithmetic), never a parameter, an attribute or a view of one: mutating
    them in place changes nothing outside the function. ``fresh_params``:
    parameters every caller passes such a value (they count as made here)."""
    params = {a.arg for a in fdef.args.posonlyargs + fdef.args.args + fdef.args.kwonlyargs}
    for extra in (fdef.args.vararg, fdef.args.kwarg):
        if extra is not None:
            params.add(extra.arg)
    values: dict[str, list[ast.AST | None]] = {}
    for node in ast.walk(fdef):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values.setdefault(target.id, []).append(node.value)
                else:
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                            values.setdefault(sub.id, []).append(None)  # unpacked: unknown origin
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name):
            values.setdefault(node.target.id, []).append(getattr(node, "value", None))
        elif isinstance(node, (ast.For, ast.With, ast.NamedExpr, ast.comprehension)):
            for sub in ast.walk(getattr(node, "target", None) or ast.Pass()):
                if isinstance(sub, ast.Name):
                    values.setdefault(sub.id, []).append(None)

    # The greatest fixpoint: assume every assigned name fresh, then drop names
    # with a definition that is not (a parameter, an attribute, a view of a
    # dropped name) until nothing changes. `x = x.view(...)` keeps x fresh when
    # its other definitions are.
    fresh: set[str] = {name for name in values if name not in params or name in fresh_params} | set(fresh_params)

    def fresh_expr(node: ast.AST) -> bool:
        if isinstance(
            node,
            (ast.BinOp, ast.UnaryOp, ast.Compare, ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.Set,
             ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.JoinedStr),
        ):
            return True  # a new value (a container's items are not mutated through it here)
        if isinstance(node, ast.IfExp):
            return fresh_expr(node.body) and fresh_expr(node.orelse)
        if isinstance(node, ast.Name):
            return node.id in fresh
        if isinstance(node, ast.Subscript):
            return fresh_expr(node.value)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _VIEW_METHODS:
                return fresh_expr(func.value)  # a view shares its receiver's storage
            return True  # a call's result is a new value (module outputs, torch ops, ...)
        return False

    changed = True
    while changed:
        changed = False
        for name in sorted(fresh):
            if name in values and not all(v is not None and fresh_expr(v) for v in values[name]):
                fresh.discard(name)
                changed = True
    return fresh


def _own_attrs(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass in (BaseException, Exception, object) or getattr(builtins, klass.__name__, None) is klass:
            break
        names |= set(vars(klass))
    return names


def _runs(cls: type, name: str, line: int, filename: str) -> bool:
    """Whether ``cls`` or a base (reached through ``super()``) defines method
    ``name`` from ``filename:line``."""
    import os

    for base in cls.__mro__:
        code = getattr(base.__dict__.get(name), "__code__", None)
        if code is None or code.co_firstlineno != line:
            continue
        try:
            if os.path.samefile(code.co_filename, filename):
                return True
        except OSError:
            if code.co_filename == filename:
                return True
    return False
