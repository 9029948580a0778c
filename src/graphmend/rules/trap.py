"""[Trap] predicated validation (category: VG).

## What it rewrites
A check that raises on tensor values:

* ``if <tensor test>: raise SomeError(message)`` (and ``if not ...``);
* ``if not torch.equal(a, b): raise ...``;
* ``assert <tensor test>, message`` and ``torch._assert(<tensor test>, message)``;
* a test comparing ``t.item()`` with a number or a name (``assert
  lengths.max().item() <= slen``): ``runtime.item_of`` makes it a tensor test
  where comparing in ``t``'s dtype is exact, else reads ``.item()`` as written.

A check in a branch of an ``if`` that the example inputs did not take is
rewritten ahead (``Trap.ahead``), in a function that breaks elsewhere: its
branch can then be predicated by [Where], which fires the trap only when the
branch would have run.

## Why the original breaks
Deciding whether to raise turns a tensor into a Python bool (GB0170; GB0033
for ``torch._assert``, GB0055 where its message formats a tensor). A literal-message ``assert`` does compile, but then
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
- a message argument could raise or act when evaluated on every call (a
  reduction with no identity element, ``x.min()``, raises on an empty tensor:
  guarded instead by ``runtime.nonempty(x)``, which sends an empty ``x`` to the
  original check; ``x.shape[1]`` likewise by ``runtime.has_dims(x, 2)``). Not
  for ``torch._assert``, whose arguments the original evaluates on every call
  too;
- state changes follow the check in the forward (stores to attributes,
  in-place ops, cache updates, modules whose code does either): the original
  would have stopped before them, the compiled graph would not. Not a reason:
  a print to stdout / stderr, ``warnings.warn`` or a call on a known logger
  (the runtime performs pending records, and so raises a set trap, before any
  such effect that was not deferred); an in-place change of a tensor the
  forward made itself (``analysis.aliasing``: not one a module or helper may
  hand back as it was given, ``nn.Identity``'s); and stores to the check's own
  ``self`` (``self.count = ...``, ``self.buf.add_(...)``, in its function or a
  method it calls through ``self``): the trap records those attributes (and a
  copy of such a tensor's data) at the check, ``keep=(self, names, tensors)``,
  and puts them back before it raises. Where the changes are to an object
  the call makes when a parameter is None (transformers 5.x's ``if cache is
  None: cache = EncoderDecoderCache(...)``, written by every attention
  layer), the check is trapped only in calls where that parameter was None
  at entry (``cache_was_none = cache is None`` at the function's start); a call
  given a cache runs the check as written. A check that a caller made the
  same way on the same values right before calling (XLM's ``get_masks``)
  cannot fail first on that call, so that caller's later code is not a reason
  (``analysis.implied``).

## Fix safety
On CPU the exception, its message and the effects before it are exact. The
exception is raised after the compiled call returns, so a traceback points
at the call, not at the check.
"""

from __future__ import annotations

import ast
import builtins
import copy
from typing import Any

from graphmend.analysis.facts import FunctionFacts, bound_before
from graphmend.analysis.implied import implied_by_caller
from graphmend.analysis.purity import Emptiness, speculation_blockers
from graphmend.analysis.purity import tested as proven_by
from graphmend.analysis.source import inside_try
from graphmend.rules import Decline, RewriteContext, Rule, register
from graphmend.rules._live import own_attrs
from graphmend.rules._predicate import (
    add_guards,
    deferred_blockers,
    has_boolops,
    item_test,
    lower,
    needs_runtime,
    pre_guarded,
    when_ok,
)
from graphmend.rules._state import StateScan
from graphmend.rules.defer import Defer


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
    defers_raise = True
    proof = "no imported call after"
    style = "magenta"

    def rewrite(self, stmt: ast.stmt, ctx: RewriteContext) -> list[ast.stmt]:
        facts = FunctionFacts.of(ctx.fdef, ctx.globals, ctx.local_names)
        bound = bound_before(ctx.fdef, stmt)
        if inside_try(ctx.fdef, stmt):
            raise Decline("the check is inside a try block of the same function (a handler could catch it)")
        test, negate, exc_node, args, is_assert = self._match(stmt)
        if isinstance(stmt, ast.Expr):  # `X._assert(test, msg)`: only torch's, under any name it is imported as
            owner = stmt.value.func.value  # type: ignore[attr-defined]
            if not (isinstance(owner, ast.Name) and facts.resolves_to_torch(owner.id)):
                raise Decline(f"`{ast.unparse(stmt.value.func)}` is not torch._assert")  # type: ignore[attr-defined]
        exc_type = self._exception_type(exc_node, ctx)
        test = _EqualToRuntime(ctx, facts).visit(copy.deepcopy(test))
        test = _ItemTests(ctx).visit(test)
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test, negate = test.operand, not negate  # `not` is applied to the flag below
        pre: list[ast.expr] = []  # guards the lowered test needs, checked before it is evaluated
        if has_boolops(test):  # lowering evaluates every operand, not just the first
            proof = proven_by(test, facts)
            empty = Emptiness(proof.nonempty, frozenset(bound), proven=proof.kinds)
            for reason in speculation_blockers(test, facts, bound | {"__graphmend_rt__"}, empty):
                raise Decline(f"the test: {reason}")
            add_guards(empty, ctx, pre)
        tested = lower(test, facts, ctx)
        deferred_args = [Defer()._defer_format(copy.deepcopy(a), ctx) for a in args]
        # The message now runs on every call; `torch._assert(test, msg)` evaluated it on every call already.
        proof = proven_by(test, facts)
        empty = Emptiness(proof.nonempty, frozenset(bound), proven=proof.kinds)
        for arg in deferred_args if not isinstance(stmt, ast.Expr) else []:
            for reason in deferred_blockers(arg, facts, bound, empty):
                raise Decline(f"the message: {reason}")
        def settled(chain: list) -> bool:  # the caller made the same check just before calling
            return len(chain) >= 2 and implied_by_caller(stmt, ctx.fdef, ctx.globals, chain[-2])

        scan = StateScan()
        mutation = scan.after(stmt, ctx, settled=settled)
        made: list[str] = []  # parameters whose None at entry makes what the code after the check changes its own
        if mutation:
            scan, made = self._none_at_entry(stmt, ctx, mutation, settled)
        keep = []
        if scan.undo or scan.undo_data:  # `self.count = ...`, `self.buf.add_(v)` after the check
            names = [ast.Tuple(elts=[ast.Constant(a) for a in sorted(part)], ctx=ast.Load()) for part in (scan.undo, scan.undo_data)]
            keep = [ast.keyword(arg="keep", value=ast.Tuple(elts=[ast.Name(id="self", ctx=ast.Load()), *names], ctx=ast.Load()))]
            changed = [f"self.{a}" for a in sorted(scan.undo)] + [f"self.{a}'s data" for a in sorted(scan.undo_data)]
            ctx.notes.append(f"what the code after the check changes ({', '.join(changed)}) is put back when it raises")
        name = ctx.fresh("c")
        site = ctx.site(stmt)
        flag: ast.expr = ast.Name(id=name, ctx=ast.Load())
        if negate:  # decided at run time: only a tensor reaches logical_not
            flag = ast.Call(func=ctx.torch("logical_not"), args=[flag], keywords=[])
        trap_call = ast.Call(
            func=ctx.runtime("trap"),
            args=[site, flag, exc_node, ast.Tuple(elts=deferred_args, ctx=ast.Load())],
            keywords=keep,
        )
        guards: list[ast.expr] = []
        add_guards(empty, ctx, guards)  # an empty tensor the message reduces: the original check
        check: ast.expr = ast.Call(func=ctx.runtime("trappable"), args=[ast.Name(id=name, ctx=ast.Load())], keywords=[])
        if guards:
            check = ast.BoolOp(op=ast.And(), values=[check, *guards])
        if made:  # calls given one of these run the check as written
            nones = [ast.Compare(left=ast.Name(id=p, ctx=ast.Load()), ops=[ast.Is()], comparators=[ast.Constant(None)]) for p in made]
            entry = ctx.at_entry(nones[0] if len(nones) == 1 else ast.BoolOp(op=ast.And(), values=nones), "_".join(made) + "_was_none")
            check = ast.BoolOp(op=ast.And(), values=[ast.Name(id=entry, ctx=ast.Load()), check])
            ctx.notes.append(
                f"trapped only in calls where {', '.join(f'`{p}`' for p in made)} {'is' if len(made) == 1 else 'are'} None "
                "(what the code after the check changes is then made in the call)"
            )
        # The original check on the flag, or as written where it runs compiled (`made`: a tensor flag
        # would then be an assert in the graph, RuntimeError; the test again breaks the graph as before).
        on_flag = not needs_runtime(test, facts) and not pre and not made
        original = self._original_on(stmt, name, negate) if on_flag else copy.deepcopy(stmt)
        out: list[ast.stmt] = []
        if pre:  # where they fail, the test is not evaluated (None) and the check runs as written
            assign, ok = pre_guarded(ctx, pre)
            out.append(assign)
            tested = when_ok(ok, tested)
            check = ast.BoolOp(op=ast.And(), values=[ast.Name(id=ok, ctx=ast.Load()), check])
        out += [
            ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=tested),
            ast.If(test=check, body=[ast.Expr(value=trap_call)], orelse=[original]),
        ]
        if is_assert:  # under -O: nothing, or for torch._assert its arguments evaluated, as the original
            orelse = [copy.deepcopy(stmt)] if isinstance(stmt, ast.Expr) else []
            out = [ast.If(test=ast.Name(id="__debug__", ctx=ast.Load()), body=out, orelse=orelse)]
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

    def ahead(self, fdef: ast.FunctionDef | ast.AsyncFunctionDef) -> list[int]:
        """Checks in a branch of an ``if`` that the example inputs did not
        reach: trapped first, [Where] can compute the branch on every call."""
        lines = []
        for node in ast.walk(fdef):
            for stmt in node.body + node.orelse if isinstance(node, ast.If) else []:
                try:
                    self._match(stmt)
                except Decline:
                    continue
                lines.append(stmt.lineno)
        return lines

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
        if value.__init__ is not BaseException.__init__ and "__init__" in own_attrs(value):
            raise Decline(f"{value.__name__} defines __init__: it may not be re-created from its arguments")
        if "__new__" in own_attrs(value):
            raise Decline(f"{value.__name__} defines __new__: it may not be re-created from its arguments")
        return value

    # -- what runs after the check -------------------------------------------

    @staticmethod
    def _none_at_entry(stmt: ast.stmt, ctx: RewriteContext, mutation: str, settled: Any) -> tuple[StateScan, list[str]]:
        """The fewest parameters defaulting to None under which the code after
        the check changes only what the call made (XLM's ``cache=None``, made
        by ``if cache is None: cache = EncoderDecoderCache(...)`` and written
        by every attention layer): the trap then fires only in calls where
        they were None at entry. Declines with ``mutation`` when there are none."""
        candidates = _none_defaults(ctx.fdef)
        scan = StateScan()
        if not candidates or scan.after(stmt, ctx, frozenset(candidates), settled):
            raise Decline(f"state changes after the check would now happen before it raises: {mutation}")
        made = sorted(candidates)
        for name in list(made):  # drop those the proof does not need: a call passing them keeps the trap
            fewer = StateScan()
            if not fewer.after(stmt, ctx, frozenset(made) - {name}, settled):
                made.remove(name)
                scan = fewer  # the scan of `made` as it now is (its undo sets)
        return scan, made


class _ItemTests(ast.NodeTransformer):
    """``t.item() <= n`` -> ``runtime.item_of(t, n) <= n``: a tensor test where
    comparing in ``t``'s dtype is exact (``_predicate.item_test``)."""

    def __init__(self, ctx: RewriteContext) -> None:
        self.ctx = ctx

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        return item_test(node, self.ctx) or node


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


def _none_defaults(fdef: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The parameters of ``fdef`` whose default is None."""
    args = fdef.args
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    return {a.arg for a, d in pairs if isinstance(d, ast.Constant) and d.value is None}
