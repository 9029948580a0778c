"""[Defer] deferred side effects (categories: LC).

## What it rewrites
A ``print(...)``, ``warnings.warn(...)`` or logger call (``debug``, ``info``,
``warning``, ``warn``, ``error``, ``critical``, ``fatal``, ``log``, and
transformers' ``warning_once`` / ``info_once``) used as a statement inside the
compiled region, in ``forward`` or any helper it calls.

## Why the original breaks
Dynamo cannot trace I/O: ``print`` is GB0059, logger methods GB0291,
``warnings.warn`` GB0007. Each call splits the graph. torch's own
``reorderable_logging_functions`` cannot take logger methods, drops calls in
helpers, prints values after later in-place changes and drops ``end=``.

## Example
```python
print("hidden", h.mean())                 # before
__graphmend_rt__.print_(site, ("hidden", h.mean()), {})    # after
logger.warning_once(f"mask {m.sum().item()}")              # before
__graphmend_rt__.log(site, logger, "warning_once",
    (__graphmend_rt__.fstr("mask ", (__graphmend_rt__.lazy("item", m.sum()), None, "")),), {})
```
Inside a region (``graphmend.compile`` opens one per call) the call records
its arguments, tensors snapshotted with ``detach().clone()`` at the call (a
tensor that requires grad is kept too, and prints as eager prints it, with its
``grad_fn``), and the effect is performed after the compiled call, in the
original order, with the original file and line on warnings and log records.
A message whose formatting needs host values (``.item()``, ``.tolist()``, ``int()``,
``float()`` in an f-string, ``%``, ``.format`` or ``"..." + str(x)``) is
formatted after the call too, so the conversion leaves the graph. Outside a region the call
happens at once, as before. A disabled logger level records nothing.

Every other print / warn / logger statement of the same function is deferred
with it (also those on paths the example inputs did not take): an effect left
in place would happen before this one, which waits for the end of the call.
The effects of the model's code are deferred ahead too, although the example
inputs did not reach them (``Rule.ahead``): those of a function that breaks
elsewhere (a declined ``if``, a captured ``.item()``), and those ``graphmend
check`` finds in the ``forward`` of the model's module classes and the
same-file helpers it calls. On inputs that reach them the call would split
the graph, and in a frame Dynamo compiled (a resume function) torch 2.13
reports a warning at another line (the ``if`` above it, the ``def``) than
eager Python does.

## When it declines
- another print / warn / log statement of the function cannot be deferred,
  or its receiver is not provably a logger (their order would change);
- the call's value is used (not a statement), or the callee is not provably
  ``print`` / ``warnings.warn`` (shadowed names) or a logger method;
- ``logger.exception`` (it reads the exception being handled at the call);
- ``stacklevel=`` other than 1, ``stack_info=`` or ``exc_info=`` (they read
  the call stack or the active exception, which only exist at the call);
- a receiver expression that calls something other than ``logging.getLogger``;
- the function keeps an ``assert`` whose test may be a tensor, not rewritten
  by [Trap]: Dynamo compiles it into the graph, and when it fails the graph
  raises before returning, so output recorded in that graph would be lost.
  A graph break goes before each such assert instead (``runtime.barrier``)
  when that leaves fewer breaks than keeping the effects in place (a tie goes
  to the break when a warning is among the effects); the function's effects
  stay in place only otherwise, or when no statement can go before the
  assert alone. Decided after the function's other rewrites: an assert [Trap]
  rewrote, or one on shapes, sizes, types, ``is None`` or plain attributes,
  does not count (``graphmend/analysis/asserts.py``). Such an assert in *another*
  function of the graph (a submodule's, a helper's) is handled once the
  whole model is mended (``graphmend/passes/barriers.py``): a graph break before
  it, or, where that costs more graphs than deferring saved, the deferral
  reverted.

## Fix safety
Arguments are evaluated where they were; only the I/O moves. Tensors are
copied at the call; lists, tuples and dicts are copied shallowly, other
objects are kept by reference (an object printed and then mutated in the same
forward prints its later state; verification catches this on the example
inputs). An effect that was not deferred (another function's, on a path the
example did not take) makes the runtime perform the pending records first, so
it never overtakes them; output written outside Python (a C extension's) is
not seen and can interleave differently. An error raised inside a compiled
graph (an index out of range in ``nn.Embedding``, an assert in another
function of the same graph) loses the output recorded earlier in that graph,
which eager Python would have printed before the error.
"""

from __future__ import annotations

import ast
import warnings

from graphmend.analysis.effects import LOG_METHODS
from graphmend.analysis.source import EFFECTS, is_runtime_call
from graphmend.rules import Decline, RewriteContext, Rule, register

_CONVERSIONS_METHODS = {"item", "tolist"}
_CONVERSION_BUILTINS = {"int": int, "float": float, "bool": bool}


@register
class Defer(Rule):
    name = "defer"
    categories = frozenset({"LC"})
    summary = "record print / logging / warnings in the graph, perform them after the compiled call"
    verdict = "[Defer] record in the graph, emit after the compiled call"
    rank = 2
    codes = {
        "GM201": "`print` run by forward",
        "GM202": "logger / logging call run by forward",
        "GM203": "`warnings.warn` run by forward",
    }
    records = EFFECTS
    defers_output = True
    proof = "unchanged after"
    style = "green"

    def rewrite(self, stmt: ast.stmt, ctx: RewriteContext) -> list[ast.stmt]:
        if _is_deferred(stmt):  # deferred already, with another site of this function
            ctx.notes.append("deferred with the other effects of the function")
            return [stmt]
        new = self._defer(stmt, ctx)
        # An effect left in place would now happen before this one, which waits
        # for the end of the call: defer every effect of the function, or none.
        others = []
        for other in _effect_statements(ctx.fdef):
            if other is stmt:
                continue
            first = ast.unparse(other).splitlines()[0]
            if not self._is_known_effect(other.value, ctx):
                raise Decline(
                    f"`{first}` (line {other.lineno}) may be an effect that cannot be deferred; "
                    "deferring this call could reorder their output"
                )
            try:
                others.append((other, self._defer(other, ctx, note=False)))
            except Decline as exc:
                raise Decline(
                    f"`{first}` (line {other.lineno}) cannot be deferred ({exc.reason}); "
                    "deferring this call would reorder their output"
                ) from None
        for other, replacement in others:
            other.value = replacement.value
        if others:
            lines = ", ".join(str(o.lineno) for o, _ in others)
            ctx.notes.append(f"with the other effects of the function (line {lines}), to keep their order")
        return [new]

    def ahead(self, fdef: ast.FunctionDef | ast.AsyncFunctionDef) -> list[int]:
        return [stmt.lineno for stmt in _effect_statements(fdef)]

    def _is_known_effect(self, call: ast.Call, ctx: RewriteContext) -> bool:
        """A print, warnings.warn, or a method call on a logger known now."""
        import logging

        func = call.func
        if isinstance(func, ast.Name) and func.id == "print":
            return True
        if ctx.value_of(func) is warnings.warn:
            return True
        return isinstance(func, ast.Attribute) and isinstance(ctx.value_of(func.value), logging.Logger)

    def _defer(self, stmt: ast.stmt, ctx: RewriteContext, note: bool = True) -> ast.stmt:
        if not isinstance(stmt, ast.Expr) or not isinstance(stmt.value, ast.Call):
            raise Decline("the side effect is not a call statement (its value is used)")
        notes = ctx.notes if note else []
        call = stmt.value
        kind, receiver, method = self._classify(call, ctx)
        args = ast.Tuple(elts=[self._defer_format(a, ctx) for a in call.args], ctx=ast.Load())
        kwargs = ast.Dict(
            keys=[ast.Constant(k.arg) if k.arg else None for k in call.keywords],
            values=[self._defer_format(k.value, ctx) for k in call.keywords],
        )
        site = ctx.site(call)
        if kind == "print":
            new = ast.Call(func=ctx.runtime("print_"), args=[site, args, kwargs], keywords=[])
            notes.append("print deferred")
        elif kind == "warn":
            new = ast.Call(func=ctx.runtime("warn"), args=[site, args, kwargs], keywords=[])
            notes.append("warnings.warn deferred")
        else:
            self._register_level(call, receiver, method, ctx)
            new = ast.Call(
                func=ctx.runtime("log"),
                args=[site, receiver, ast.Constant(method), args, kwargs],
                keywords=[],
            )
            notes.append(f"logger.{method} deferred")
        return ast.copy_location(ast.Expr(value=ast.copy_location(new, call)), stmt)

    # -- matching -------------------------------------------------------------

    def _classify(self, call: ast.Call, ctx: RewriteContext) -> tuple[str, ast.expr | None, str | None]:
        func = call.func
        keywords = {k.arg for k in call.keywords if k.arg}
        if any(k.arg is None for k in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args):
            # *args / **kwargs could carry stacklevel, exc_info, ...: keep them
            # only for print, where no keyword reads the call stack.
            if not (isinstance(func, ast.Name) and func.id == "print"):
                raise Decline("*args / **kwargs unpacking in a log or warn call hides its keywords")
        if isinstance(func, ast.Name) and func.id == "print":
            if not ctx.resolves_to("print", print):
                raise Decline("`print` is rebound in this module or function")
            return "print", None, None
        if ctx.value_of(func) is warnings.warn:
            self._check_stacklevel(call, keywords, position=2)
            return "warn", None, None
        if isinstance(func, ast.Attribute) and func.attr in LOG_METHODS:
            method = func.attr
            if method == "exception":
                raise Decline("logger.exception reads the exception being handled at the call")
            if {"stack_info", "exc_info"} & keywords:
                raise Decline("stack_info= / exc_info= read the call stack at the call")
            self._check_stacklevel(call, keywords, position=None)
            receiver = func.value
            self._check_receiver(receiver, ctx)
            if method == "log" and not call.args:
                raise Decline("logger.log without a level argument")
            return "log", receiver, method
        raise Decline("not a print, warnings.warn or logger call")

    @staticmethod
    def _check_stacklevel(call: ast.Call, keywords: set[str | None], position: int | None) -> None:
        for k in call.keywords:
            if k.arg == "stacklevel" and not (isinstance(k.value, ast.Constant) and k.value.value == 1):
                raise Decline("stacklevel other than 1 attributes the effect to a caller known only at run time")
        if position is not None and len(call.args) > position:
            value = call.args[position]
            if not (isinstance(value, ast.Constant) and value.value == 1):
                raise Decline("stacklevel other than 1 attributes the effect to a caller known only at run time")

    @staticmethod
    def _check_receiver(receiver: ast.expr, ctx: RewriteContext) -> None:
        for node in ast.walk(receiver):
            if isinstance(node, ast.Call):
                target = ctx.value_of(node.func)
                import logging

                if target is not logging.getLogger:
                    raise Decline("the logger expression calls a function other than logging.getLogger")
                if node is not receiver:
                    raise Decline("the logger expression is not a plain name or getLogger call")

    @staticmethod
    def _register_level(call: ast.Call, receiver: ast.expr | None, method: str | None, ctx: RewriteContext) -> None:
        """A disabled level should record nothing: when the logger is a module
        global known now, its level test moves out of the graph."""
        import logging

        from graphmend import runtime

        logger = ctx.value_of(receiver) if receiver is not None else None
        if not isinstance(logger, logging.Logger) or method is None:
            return
        if method == "log":
            first = call.args[0]
            level = first.value if isinstance(first, ast.Constant) and isinstance(first.value, int) else None
        else:
            level = runtime.LEVELS.get(method)
        if level is not None:
            site = (ctx.globals.get("__name__", "__main__"), call.lineno, ctx.fdef.name)
            runtime.register_log_site(site, logger, level)

    # -- deferred formatting --------------------------------------------------

    def _defer_format(self, node: ast.expr, ctx: RewriteContext) -> ast.expr:
        """Move host conversions and string formatting of an argument to flush time."""
        if isinstance(node, ast.Starred):
            return ast.Starred(value=self._defer_format(node.value, ctx), ctx=node.ctx)
        if isinstance(node, ast.JoinedStr) and any(isinstance(v, ast.FormattedValue) for v in node.values):
            parts: list[ast.expr] = []
            for value in node.values:
                if isinstance(value, ast.Constant):
                    parts.append(value)
                    continue
                assert isinstance(value, ast.FormattedValue)
                spec: ast.expr = ast.Constant(None)
                if value.format_spec is not None:
                    spec = self._defer_format(value.format_spec, ctx)
                conversion = ast.Constant(chr(value.conversion) if value.conversion and value.conversion > 0 else None)
                parts.append(
                    ast.Tuple(elts=[self._lazy(value.value, ctx), conversion, spec], ctx=ast.Load())
                )
            return ast.copy_location(ast.Call(func=ctx.runtime("fstr"), args=parts, keywords=[]), node)
        concatenated = self._concat(node, ctx)
        if concatenated is not None and isinstance(node, ast.BinOp):  # "at " + str(h.shape[0])
            return ast.copy_location(ast.Call(func=ctx.runtime("fstr"), args=concatenated, keywords=[]), node)
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Mod)
            and isinstance(node.left, (ast.Constant, ast.JoinedStr))
            and isinstance(getattr(node.left, "value", ""), str)
        ):
            right = node.right
            if isinstance(right, ast.Tuple):
                right = ast.Tuple(elts=[self._lazy(e, ctx) for e in right.elts], ctx=ast.Load())
            else:
                right = self._lazy(right, ctx)
            return ast.copy_location(
                ast.Call(func=ctx.runtime("pct"), args=[node.left, right], keywords=[]), node
            )
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "format"
            and isinstance(node.func.value, ast.Constant)
            and isinstance(node.func.value.value, str)
            and not any(isinstance(a, ast.Starred) for a in node.args)
            and all(k.arg for k in node.keywords)
        ):
            args = ast.Tuple(elts=[self._lazy(a, ctx) for a in node.args], ctx=ast.Load())
            kwargs = ast.Dict(
                keys=[ast.Constant(k.arg) for k in node.keywords],
                values=[self._lazy(k.value, ctx) for k in node.keywords],
            )
            return ast.copy_location(
                ast.Call(func=ctx.runtime("fmt"), args=[node.func.value, args, kwargs], keywords=[]), node
            )
        return self._lazy(node, ctx)

    def _concat(self, node: ast.expr, ctx: RewriteContext) -> list[ast.expr] | None:
        """The parts ``fstr`` takes for a string built with ``+`` from literals,
        f-strings and ``str(x)`` (``(x, "s", None)``, formatted at flush); None for
        anything else (an operand not provably a str keeps ``+`` as written)."""
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self._concat(node.left, ctx), self._concat(node.right, ctx)
            return None if left is None or right is None else left + right
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node]
        if isinstance(node, ast.JoinedStr):
            if not any(isinstance(v, ast.FormattedValue) for v in node.values):
                return [node]
            return self._defer_format(node, ctx).args  # type: ignore[attr-defined]  # fstr(...)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "str"
            and len(node.args) == 1
            and not node.keywords
            and not isinstance(node.args[0], ast.Starred)
            and ctx.resolves_to("str", str)
        ):
            return [ast.Tuple(elts=[self._lazy(node.args[0], ctx), ast.Constant("s"), ast.Constant(None)], ctx=ast.Load())]
        return None

    def _lazy(self, node: ast.expr, ctx: RewriteContext) -> ast.expr:
        """``t.item()`` -> lazy("item", t); ``int(t)`` -> lazy("int", t); else unchanged."""
        if isinstance(node, ast.Call) and not node.keywords:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _CONVERSIONS_METHODS and not node.args:
                return self._lazy_call(func.attr, func.value, node, ctx)
            if (
                isinstance(func, ast.Name)
                and func.id in _CONVERSION_BUILTINS
                and len(node.args) == 1
                and not isinstance(node.args[0], ast.Starred)
                and ctx.resolves_to(func.id, _CONVERSION_BUILTINS[func.id])
            ):
                return self._lazy_call(func.id, node.args[0], node, ctx)
        return node

    def _lazy_call(self, kind: str, value: ast.expr, node: ast.expr, ctx: RewriteContext) -> ast.expr:
        return ast.copy_location(
            ast.Call(func=ctx.runtime("lazy"), args=[ast.Constant(kind), value], keywords=[]), node
        )


def _is_deferred(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and is_runtime_call(stmt.value, *EFFECTS)


def _effect_statements(fdef: ast.AST) -> list[ast.Expr]:
    """Call statements of the function (not of nested functions or classes)
    that look like a print, a warnings.warn or a logger call."""
    found: list[ast.Expr] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Expr) and isinstance(child.value, ast.Call) and not _is_deferred(child):
                func = child.value.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if name == "print" or name == "warn" or name in LOG_METHODS:
                    found.append(child)
            visit(child)

    visit(fdef)
    return found
