"""[Trap] predicated validation (category: VG).

## What it rewrites
A check that raises on tensor values:

* ``if <tensor test>: raise SomeError(message)`` (and ``if not ...``);
* ``if not torch.equal(a, b): raise ...``;
* ``assert <tensor test>, message`` and ``torch._assert(<tensor test>, message)``.

## Why the original breaks
Deciding whether to raise turns a tensor into a Python bool (GB0170; GB0033
for ``torch._assert``). A literal-message ``assert`` does compile, but then
raises ``RuntimeError`` instead of ``AssertionError``.

## Example
```python
if not torch.equal(mask, expected):                       # before
    raise ValueError(f"bad mask {mask.sum().item()}")

_gm_c0 = torch.logical_not(__graphmend_rt__.equal(mask, expected))   # after
if __graphmend_rt__.trappable(_gm_c0):
    __graphmend_rt__.trap(site, _gm_c0, ValueError,
        (__graphmend_rt__.fstr("bad mask ", (__graphmend_rt__.lazy("item", mask.sum()), None, None)),))
elif _gm_c0:
    raise ValueError(f"bad mask {mask.sum().item()}")    # the original check
```
The flag is computed in the graph. When the region closes, effects recorded
before the check are performed, and if the flag is set the same exception
class is raised with the same message (formatted then, from the values as
they were at the check); effects recorded after it are dropped, as the
original never reached them. ``torch.equal`` compares shapes first, so
broadcasting cannot make different shapes equal. ``assert`` stays under
``if __debug__`` (``python -O`` still removes it).

## When it declines
- the check is inside a ``try`` of the same function, or the call that leads
  to it inside a ``try`` of a caller (the handler could catch it);
- the exception class cannot be re-created from its arguments (it overrides
  ``__init__`` or ``__new__``), or ``raise ... from <cause>``;
- a message argument could raise or act when evaluated on every call;
- state changes follow the check in the forward (stores to attributes,
  in-place ops, cache updates, modules whose code does either): the original
  would have stopped before them, the compiled graph would not. A print to
  stdout / stderr, ``warnings.warn`` or a call on a known logger is not one:
  the runtime performs pending records, and so raises a set trap, before any
  such effect that was not deferred.

## Fix safety
On CPU the exception, its message and the effects before it are exact. The
exception is raised after the compiled call returns, so a traceback points
at the call, not at the check.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import copy
from typing import Any, Iterator

from graphmend.analysis.effects import LOG_METHODS, is_side_effect_call
from graphmend.analysis.facts import FunctionFacts, bound_before, speculation_blockers
from graphmend.analysis.source import (
    definition_of,
    first_line,
    module_namespace,
    parse_file,
    statement_in,
)
from graphmend.rules import Decline, RewriteContext, Rule, register
from graphmend.rules._predicate import check_lowerable, has_boolops, lower
from graphmend.rules.defer import Defer

# Builtins that change state outside the caller's locals (an iterator's position, attributes, files).
_STATEFUL_BUILTINS = frozenset({"setattr", "delattr", "next", "exec", "eval", "open", "input"})
MUTATING_METHODS = frozenset(
    {"register_buffer", "register_parameter", "update", "append", "extend", "insert", "pop", "clear",
     "setdefault", "add_module", "popitem", "remove"}
)
_STATELESS_MODULES = frozenset(
    {"Linear", "Bilinear", "Identity", "Conv1d", "Conv2d", "Conv3d", "LayerNorm", "RMSNorm", "GroupNorm",
     "Embedding", "ReLU", "GELU", "SiLU", "Tanh", "Sigmoid", "Softmax", "LogSoftmax", "LeakyReLU", "ELU",
     "Mish", "Hardtanh", "Dropout", "Flatten", "Sequential", "ModuleList", "ModuleDict"}
)


@register
class Trap(Rule):
    name = "trap"
    categories = frozenset({"VG"})
    summary = "compute validation checks as a flag in the graph, raise the same exception after the call"
    verdict = "[Trap] compute a flag in the graph, raise at the call boundary"
    rank = 3
    codes = {
        "GM301": "`raise` guarded by a tensor value",
        "GM302": "`assert` on a tensor value",
        "GM303": "`torch._assert` on a tensor value",
    }
    records = ("trap",)
    style = "magenta"

    def rewrite(self, stmt: ast.stmt, ctx: RewriteContext) -> list[ast.stmt]:
        facts = FunctionFacts.of(ctx.fdef, ctx.globals, ctx.local_names)
        bound = bound_before(ctx.fdef, stmt)
        if self._inside_try(ctx.fdef, stmt):
            raise Decline("the check is inside a try block of the same function (a handler could catch it)")
        test, negate, exc_node, args, is_assert = self._match(stmt)
        exc_type = self._exception_type(exc_node, ctx)
        test = _EqualToRuntime(ctx, facts).visit(copy.deepcopy(test))
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test, negate = test.operand, not negate  # `not` is applied to the flag below
        if has_boolops(test):  # lowering evaluates every operand, not just the first
            for reason in speculation_blockers(test, facts, bound | {"__graphmend_rt__"}):
                raise Decline(f"the test: {reason}")
        check_lowerable(test, facts)
        tested = lower(test, facts, ctx)
        deferred_args = [Defer()._defer_format(copy.deepcopy(a), ctx) for a in args]
        for arg in deferred_args:
            for reason in _deferred_blockers(arg, facts, bound):
                raise Decline(f"the message: {reason}")
        mutation = self._state_changes_after(stmt, ctx)
        if mutation:
            raise Decline(f"state changes after the check would now happen before it raises: {mutation}")
        name = ctx.fresh("c")
        site = ctx.site(stmt)
        flag: ast.expr = ast.Name(id=name, ctx=ast.Load())
        if negate:  # decided at run time: only a tensor reaches logical_not
            flag = ast.Call(func=ctx.torch("logical_not"), args=[flag], keywords=[])
        trap_call = ast.Call(
            func=ctx.runtime("trap"),
            args=[site, flag, exc_node, ast.Tuple(elts=deferred_args, ctx=ast.Load())],
            keywords=[],
        )
        out: list[ast.stmt] = [
            ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=tested),
            ast.If(
                test=ast.Call(func=ctx.runtime("trappable"), args=[ast.Name(id=name, ctx=ast.Load())], keywords=[]),
                body=[ast.Expr(value=trap_call)],
                orelse=[self._original_on(stmt, name, negate)],
            ),
        ]
        if is_assert:
            out = [ast.If(test=ast.Name(id="__debug__", ctx=ast.Load()), body=out, orelse=[])]
        ctx.notes.append(f"{exc_type.__name__} raised after the call when the flag is set")
        for node in out:
            ast.copy_location(node, stmt)
            for sub in ast.walk(node):
                if "lineno" in sub._attributes and not hasattr(sub, "lineno"):
                    ast.copy_location(sub, stmt)
        return [ast.fix_missing_locations(node) for node in out]

    @staticmethod
    def _original_on(stmt: ast.stmt, name: str, negate: bool) -> ast.stmt:
        """The original check, deciding on the test value already computed."""
        value: ast.expr = ast.Name(id=name, ctx=ast.Load())
        stmt = copy.deepcopy(stmt)
        if isinstance(stmt, ast.If):
            stmt.test = ast.UnaryOp(op=ast.Not(), operand=value) if negate else value
        elif isinstance(stmt, ast.Assert):
            stmt.test = value if negate else ast.UnaryOp(op=ast.Not(), operand=value)
        else:  # torch._assert(test, msg)
            stmt.value.args[0] = value if negate else ast.UnaryOp(op=ast.Not(), operand=value)  # type: ignore[attr-defined]
        return stmt

    # -- matching ----------------------------------------------------------------

    @staticmethod
    def _match(stmt: ast.stmt) -> tuple[ast.expr, bool, ast.expr, list[ast.expr], bool]:
        """(test, negate, exception class node, exception args, is an assert)."""
        if isinstance(stmt, ast.If):
            if stmt.orelse or len(stmt.body) != 1 or not isinstance(stmt.body[0], ast.Raise):
                raise Decline("the if does not hold exactly one raise (and no else)")
            raise_ = stmt.body[0]
            if raise_.cause is not None and not (isinstance(raise_.cause, ast.Constant) and raise_.cause.value is None):
                raise Decline("`raise ... from <cause>`: the cause is not re-created")
            exc = raise_.exc
            if isinstance(exc, ast.Call):
                if any(isinstance(a, ast.Starred) for a in exc.args) or exc.keywords:
                    raise Decline("the exception is built with keywords or *args")
                return stmt.test, False, exc.func, list(exc.args), False
            if isinstance(exc, (ast.Name, ast.Attribute)):
                return stmt.test, False, exc, [], False
            raise Decline("the raise does not build an exception from a class")
        if isinstance(stmt, ast.Assert):
            args = [stmt.msg] if stmt.msg is not None else []
            return stmt.test, True, ast.Name(id="AssertionError", ctx=ast.Load()), args, True
        if (
            isinstance(stmt, ast.Expr)
            and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Attribute)
            and stmt.value.func.attr == "_assert"
            and len(stmt.value.args) == 2
            and not stmt.value.keywords
        ):
            cond, msg = stmt.value.args
            return cond, True, ast.Name(id="AssertionError", ctx=ast.Load()), [msg], True
        raise Decline("not an if-raise, assert or torch._assert check")

    @staticmethod
    def _exception_type(node: ast.expr, ctx: RewriteContext) -> type:
        value = ctx.value_of(node)
        if isinstance(node, ast.Name) and node.id == "AssertionError" and value is None:
            value = AssertionError
        if not (isinstance(value, type) and issubclass(value, BaseException)):
            raise Decline(f"`{ast.unparse(node)}` is not provably an exception class")
        if getattr(builtins, value.__name__, None) is value:
            return value
        if value.__init__ is not BaseException.__init__ and "__init__" in _own_attrs(value):
            raise Decline(f"{value.__name__} defines __init__: it may not be re-created from its arguments")
        if "__new__" in _own_attrs(value):
            raise Decline(f"{value.__name__} defines __new__: it may not be re-created from its arguments")
        return value

    @staticmethod
    def _inside_try(fdef: ast.AST, stmt: ast.stmt) -> bool:
        for node in ast.walk(fdef):
            if isinstance(node, ast.Try) and any(stmt is n for b in node.body for n in ast.walk(b)):
                return True
        return False

    # -- what runs after the check -------------------------------------------

    max_depth = 6  # calls followed below the check's function
    assume_eval = False  # True: branches taken only in training mode are skipped

    def _state_changes_after(self, stmt: ast.stmt, ctx: RewriteContext) -> str | None:
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
    def state_changes_in_call(cls, fdef: Any, filename: str, namespace: dict, ctx: RewriteContext) -> str | None:
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
        if self._inside_try(fdef, block[index]):
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
            node = _without_training_branches(node)
        passed = dict(getattr(self, "_callables", ()))  # parameters the caller passed `self.<attr>` for
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Global, ast.Nonlocal)):
                return f"`{type(sub).__name__.lower()} {', '.join(sub.names)}` (line {sub.lineno})"
            if isinstance(sub, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                for target in targets:
                    for t in ast.walk(target):
                        if isinstance(t, (ast.Attribute, ast.Subscript)) and isinstance(t.ctx, ast.Store):
                            if root_of(t) not in local:
                                return f"`{ast.unparse(t)} = ...` (line {sub.lineno})"
            elif isinstance(sub, ast.Call):
                func = sub.func
                if isinstance(func, ast.Attribute) and root_of(func) == "__graphmend_rt__":
                    continue  # a deferred effect: dropped when the check fails, as intended
                if is_side_effect_call(sub):
                    if _watched_effect(sub, namespace):
                        continue  # the runtime performs the records (a set trap raises) before it
                    return f"`{ast.unparse(func)}(...)` is not deferred (line {sub.lineno})"
                if isinstance(func, ast.Attribute):
                    attr = func.attr
                    if (attr.endswith("_") and not attr.endswith("__")) or attr in MUTATING_METHODS:
                        if root_of(func.value) not in local:
                            return f"`{ast.unparse(func)}(...)` (line {sub.lineno})"
                self_attr = _self_attr_callee(func)
                if self_attr is not None:
                    reason = self._module_effects(self_attr, ast.unparse(func), ctx, depth, (sub, local))
                    if reason:
                        return reason
                elif isinstance(func, ast.Name):
                    if func.id in _STATEFUL_BUILTINS and namespace.get(func.id, getattr(builtins, func.id)) is getattr(builtins, func.id):
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
                elif _self_attribute(arg) is not None:
                    reason = self._module_effects(_self_attribute(arg), ast.unparse(arg), ctx, depth)
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
            attr = _loop_attribute(loop, name) if isinstance(loop, ast.For) else None
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
                if self.assume_eval and _pure_torch_builtin(value):
                    continue
                return f"calls `{label}`, which is not a module or a Python function"
            for module in value.modules():
                cls = type(module)
                if cls.__module__.startswith("torch.nn") and cls.__name__ in _STATELESS_MODULES:
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


_UNRESOLVED = object()  # a lookup that found nothing (None means: found, and clean)


class _EqualToRuntime(ast.NodeTransformer):
    """``torch.equal(a, b)`` -> ``__graphmend_rt__.equal(a, b)`` (a tensor, shapes first)."""

    def __init__(self, ctx: RewriteContext, facts: FunctionFacts) -> None:
        self.ctx, self.facts = ctx, facts

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "equal"
            and isinstance(func.value, ast.Name)
            and self.facts.resolves_to_torch(func.value.id)
            and len(node.args) == 2
            and not node.keywords
        ):
            return ast.copy_location(ast.Call(func=self.ctx.runtime("equal"), args=node.args, keywords=[]), node)
        return node


def _deferred_blockers(node: ast.expr, facts: FunctionFacts, bound: set[str]) -> list[str]:
    """Blockers of the parts of a deferred message still evaluated in the graph."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "__graphmend_rt__"
    ):
        out: list[str] = []
        for a in node.args:
            if isinstance(a, ast.Constant):
                continue
            out.extend(_deferred_blockers(a, facts, bound))
        return out
    if isinstance(node, ast.Tuple):
        return [r for e in node.elts for r in _deferred_blockers(e, facts, bound)]
    return speculation_blockers(node, facts, bound)


def _none_everywhere(ctx: RewriteContext, attr: str) -> bool:
    import torch

    model = ctx.model
    if not isinstance(model, torch.nn.Module):
        return False
    holders = [m for m in model.modules() if attr in vars(m)]
    return bool(holders) and all(vars(m)[attr] is None for m in holders)


def _self_attr_callee(func: ast.AST) -> str | None:
    """``self.x(...)`` or ``self.x[i](...)`` -> ``"x"``."""
    node = func.value if isinstance(func, ast.Subscript) else func
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def root_of(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


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
    callables = frozenset((p, _self_attribute(arg)) for p, arg in pairs if _self_attribute(arg) is not None)
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


def _self_attribute(node: ast.expr) -> str | None:
    """``self.<attr>`` or a slice of it (whose items are among its items)."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _loop_attribute(loop: ast.For, name: str) -> str | None:
    """The ``self`` attribute whose items the loop binds to ``name``:
    ``for name in self.X``, ``for i, name in enumerate(self.X)``,
    ``for a, name in zip(self.X, self.Y)``."""
    target, source = loop.target, loop.iter
    if isinstance(target, ast.Name):
        return _self_attribute(source) if target.id == name else None
    if not isinstance(target, ast.Tuple) or not isinstance(source, ast.Call) or not isinstance(source.func, ast.Name):
        return None
    names = [e.id if isinstance(e, ast.Name) else None for e in target.elts]
    if source.func.id == "enumerate" and len(names) == 2 and names[1] == name and len(source.args) == 1:
        return _self_attribute(source.args[0])
    if source.func.id == "zip" and len(names) == len(source.args) and name in names:
        return _self_attribute(source.args[names.index(name)])
    return None


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


def _watched_effect(call: ast.Call, namespace: dict) -> bool:
    """A print to stdout / stderr, a ``warnings.warn``, or a call on a logger
    known now: while a region is open, the runtime performs the records made
    before it first (a set trap raises there, before the effect), as the
    original would have stopped at the check (runtime module doc)."""
    import logging
    import sys
    import warnings

    func = call.func
    if isinstance(func, ast.Name) and func.id == "print":
        if namespace.get("print", builtins.print) is not builtins.print:
            return False
        file = next((k.value for k in call.keywords if k.arg == "file"), None)
        if any(k.arg is None for k in call.keywords):
            return False
        return file is None or (
            isinstance(file, ast.Attribute) and file.attr in ("stdout", "stderr")
            and isinstance(file.value, ast.Name) and namespace.get(file.value.id) is sys
        )
    if isinstance(func, ast.Name):
        return namespace.get(func.id) in (warnings.warn, warnings.warn_explicit)
    if not isinstance(func, ast.Attribute):
        return False
    if isinstance(func.value, ast.Name):
        receiver = namespace.get(func.value.id)
        if receiver is warnings and func.attr in ("warn", "warn_explicit"):
            return True
        if receiver is logging and func.attr == "getLogger":
            return True  # not an effect
        return isinstance(receiver, logging.Logger) and func.attr in LOG_METHODS
    return False


def _is_self_training(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute) and node.attr == "training"
        and isinstance(node.value, ast.Name) and node.value.id == "self"
    )


def _never_in_eval(test: ast.AST) -> bool | None:
    """True: ``test`` is false whenever ``self.training`` is; False: true then; None: unknown."""
    if _is_self_training(test):
        return True
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and _is_self_training(test.operand):
        return False
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and any(_never_in_eval(v) is True for v in test.values):
        return True
    return None


def _without_training_branches(node: ast.AST) -> ast.AST:
    """``node`` with the branches that only run in training mode removed (a
    speculating call runs only with every module in eval mode: runtime.call)."""
    if not any(isinstance(n, ast.If) and _never_in_eval(n.test) is not None for n in ast.walk(node)):
        return node

    class Prune(ast.NodeTransformer):
        def visit_If(self, branch: ast.If) -> Any:
            verdict = _never_in_eval(branch.test)
            self.generic_visit(branch)
            if verdict is True:
                return branch.orelse or ast.Pass()
            if verdict is False:
                return branch.body
            return branch

    return Prune().visit(copy.deepcopy(node))


def _pure_torch_builtin(value: Any) -> bool:
    """A torch function implemented in C that does not change its arguments in
    place or global settings (``torch.nn.functional.gelu``); random draws are
    undone by the caller that needs it (runtime.call restores the RNG)."""
    import types

    if not isinstance(value, types.BuiltinFunctionType):
        return False
    name = getattr(value, "__name__", "")
    module = getattr(value, "__module__", None) or ""
    owner = getattr(getattr(value, "__self__", None), "__name__", "")
    return (
        (module.startswith("torch") or str(owner).startswith("torch"))
        and not name.endswith("_")
        and not name.startswith(("set_", "_set", "manual_seed", "seed", "use_deterministic"))
    )
