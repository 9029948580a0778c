"""Plain torch in what ``graphmend fix`` writes: a [Where] select as a person writes it.

In memory, [Where] installs a guarded select::

    _gm_c0 = h.sum() > 0
    if __graphmend_rt__.predicable_with_grad(_gm_c0):
        _gm_t0 = h * 2
        _gm_f0 = h - 1
        if __graphmend_rt__.same_meta(_gm_t0, _gm_f0):
            h = __graphmend_rt__.select(_gm_c0, _gm_t0, _gm_f0)
        ...                                # the branch as written
    elif _gm_c0: ...                       # the original if, as written

The guards decide while Dynamo traces what the source alone may not prove.
``fix`` writes ``h = torch.where(h.sum() > 0, h * 2, h - 1)`` instead where
the source proves what they check:

* **the test is a 0-dim bool tensor**: a whole reduction (``x.sum()``,
  ``x.abs().amax()``, ``x.any()``...) of a proven tensor, compared with a
  number (``predicable``);
* **both values are one tensor through elementwise steps with Python
  numbers** (``h * 2``, ``h - 1``, ``h / 2.0``, ``-h``, ``h.relu()``,
  ``h.clamp(0, 1)``, ``h.sigmoid()``, or ``h`` itself): the same shape and
  device by construction, and the same dtype for every dtype ``h`` can have
  (``same_meta``);
* **neither value raises where the original would not**: ``h - 1`` raises
  on a bool tensor, ``h.relu()`` also on a complex one, so ``h`` must be
  known not to be one. What ``h`` can be is read from where it was assigned
  last before the ``if`` in the same function: a parameter annotated
  ``torch.Tensor`` (any dtype), a call of a layer whose output is floating
  or complex (``self.lin(x)`` with ``self.lin`` an ``nn.Linear``: its exact
  type, no hooks), ``x.float()``, or elementwise steps of one of those.
* **gradients**: every step's derivative is finite, so the value not taken
  adds zeros: eager's gradients, except that a gradient eager leaves as
  ``-0.0`` can come out ``+0.0`` (the runtime's ``select`` keeps the sign;
  plain ``torch.where`` cannot).

Any other site keeps the guarded form, and the site's note says which proof
is missing. What is written is then run in a fresh process against the
original (``tools/written.py``) before any file is touched.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass
from typing import Any

import torch

from graphmend.analysis.dtypes import ANY, BOOL, COMPLEX, FLOAT, INT, RAISES
from graphmend.analysis.source import RUNTIME_NAME, is_runtime_call

ANY_DTYPE = ANY
_REAL_OR_COMPLEX = frozenset({FLOAT, COMPLEX})

# Layers whose output is floating or complex whatever their input (an integer
# input raises in them), by exact type: a subclass may return anything.
_FLOATING_LAYERS = tuple(
    getattr(torch.nn, name)
    for name in """Linear Bilinear Conv1d Conv2d Conv3d ConvTranspose1d ConvTranspose2d ConvTranspose3d LayerNorm
    GroupNorm RMSNorm BatchNorm1d BatchNorm2d BatchNorm3d InstanceNorm1d InstanceNorm2d InstanceNorm3d""".split()
    if hasattr(torch.nn, name)
)
_CASTS = {"float": FLOAT, "double": FLOAT, "half": FLOAT, "bfloat16": FLOAT}

# Elementwise methods with no argument or number arguments: the dtypes they raise on.
_METHODS: dict[str, frozenset[str]] = {m: RAISES[m] for m in "relu abs neg clamp clip clamp_min clamp_max sigmoid tanh".split()}
_TO_FLOAT = {"sigmoid", "tanh"}  # an integer or bool tensor comes out floating
_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "norm", "prod"})
_TESTS = frozenset({"any", "all"})
_COMPARE = (ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq)


@dataclass(frozen=True)
class Steps:
    """An elementwise chain over one name: its base, what it promotes an
    integer or bool tensor to (``ints``: arithmetic with an int; ``floats``: with
    a float, a true division or a floating function), the dtypes it raises on."""

    base: str
    ints: bool = False
    floats: bool = False
    raises: frozenset[str] = frozenset()

    def then(self, *, ints: bool = False, floats: bool = False, raises: frozenset[str] = frozenset()) -> "Steps":
        return Steps(self.base, self.ints or ints, self.floats or floats, self.raises | raises)

    def dtypes_from(self, dtypes: frozenset[str]) -> frozenset[str]:
        """What the chain's result can be when its base can be any of ``dtypes``
        (a kind it may raise on is kept: ``raises`` is read against the base, and
        a step after a promotion may not raise on it)."""
        out = set()
        for kind in dtypes:
            if kind in (BOOL, INT) and self.floats:
                out.add(FLOAT)
            elif kind == BOOL and self.ints:
                out.add(INT)
            else:
                out.add(kind)
        return frozenset(out)


@dataclass
class Plain:
    """One [Where] select of a rewritten function: written plain or not, and why."""

    line: int
    plain: bool
    why: str


def plain_selects(fdef: ast.AST, namespace: dict[str, Any], model: Any) -> tuple[ast.AST, list[Plain]]:
    """A copy of the rewritten ``fdef`` with every select the source proves
    written as ``target = torch.where(test, a, b)``, and a note per select."""
    fdef = copy.deepcopy(fdef)
    notes: list[Plain] = []
    params = _tensor_params(fdef, namespace)
    _walk(fdef.body, [], fdef, namespace, model, params, notes)  # type: ignore[attr-defined]
    return fdef, notes


@dataclass
class _Select:
    """A guarded select found in a rewritten body: its test (as lowered), the
    branch's temporaries (the user's statements), target and values, the check."""

    test: ast.expr
    temps: list[ast.stmt]
    target: str
    when_true: ast.expr
    when_false: ast.expr
    check: str


def _walk(
    body: list[ast.stmt], scope: list[tuple[list[ast.stmt], ast.stmt, str]], fdef: ast.AST, namespace: dict,
    model: Any, params: frozenset[str], notes: list[Plain],
) -> None:
    """``scope``: for each enclosing compound statement, outermost first, the
    statements before it, it, and the field (``body``, ``orelse``...) we are in."""
    index = 0
    while index < len(body):
        found = _guarded(body, index)
        if found is not None:
            line = body[index].lineno
            where = _torch_where(namespace)
            why = _proof(found, where, body[:index], scope, model, params)
            cond = body[index].targets[0].id  # type: ignore[attr-defined]
            if why.startswith("plain") and _reads(fdef, cond) != _reads(ast.Module(body=body[index : index + 2], type_ignores=[]), cond):
                why = f"guarded: `{cond}` is read again after the select"
            if why.startswith("plain"):
                call = ast.Call(func=where, args=[found.test, found.when_true, found.when_false], keywords=[])  # type: ignore[arg-type]
                new = ast.Assign(targets=[ast.Name(id=found.target, ctx=ast.Store())], value=call, lineno=line)
                body[index : index + 2] = found.temps + [ast.fix_missing_locations(ast.copy_location(new, body[index]))]
                index += len(found.temps)
            notes.append(Plain(line, why.startswith("plain"), why))
        stmt = body[index]
        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            for name in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, name, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    _walk(inner, scope + [(body[:index], stmt, name)], fdef, namespace, model, params, notes)
            for handler in getattr(stmt, "handlers", []) or []:
                _walk(handler.body, scope + [(body[:index], stmt, "handlers")], fdef, namespace, model, params, notes)
        index += 1


def _guarded(body: list[ast.stmt], index: int) -> _Select | None:
    """``_gm_cN = TEST`` then ``if rt.predicable*(_gm_cN): ... elif <the test>: [temps...] T = a
    else: T = b`` (the else may be absent: ``b`` is ``T``), as [Where] writes a two-way select."""
    if index + 1 >= len(body):
        return None
    bind, branch = body[index], body[index + 1]
    if not (
        isinstance(bind, ast.Assign) and len(bind.targets) == 1 and isinstance(bind.targets[0], ast.Name)
        and bind.targets[0].id.startswith("_gm_c") and isinstance(branch, ast.If)
    ):
        return None
    cond = bind.targets[0].id
    checks = branch.test.values if isinstance(branch.test, ast.BoolOp) and isinstance(branch.test.op, ast.And) else [branch.test]
    check = checks[0]
    if not (
        isinstance(check, ast.Call) and isinstance(check.func, ast.Attribute)
        and isinstance(check.func.value, ast.Name) and check.func.value.id == RUNTIME_NAME
        and check.func.attr in ("predicable", "predicable_with_grad")
        and len(check.args) == 1 and isinstance(check.args[0], ast.Name) and check.args[0].id == cond
    ):
        return None
    # A dtype guard (runtime.is_kind) checks what _proof proves of every value from the source.
    checks = [c for c in checks if not is_runtime_call(c, "is_kind")]
    name = check.func.attr if len(checks) == 1 else ast.unparse(ast.BoolOp(op=ast.And(), values=checks[1:]))
    if not (len(branch.orelse) == 1 and isinstance(branch.orelse[0], ast.If)):
        return None
    original = branch.orelse[0]  # the if as written (its test the name, or the user's own when lowered)
    if not all(isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name) for s in original.body):
        return None
    *temps, last = original.body
    target = last.targets[0].id  # type: ignore[attr-defined]
    if original.orelse:
        other = _single(original.orelse)
        if other is None or other[0] != target:
            return None
        false_value = other[1]
    else:
        false_value = ast.Name(id=target, ctx=ast.Load())
    if any(t.targets[0].id == target for t in temps):  # type: ignore[attr-defined]
        return None
    return _Select(bind.value, temps, target, last.value, false_value, name.replace(RUNTIME_NAME + ".", ""))  # type: ignore[attr-defined]


def _reads(node: ast.AST, name: str) -> int:
    return sum(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in ast.walk(node))


def _single(block: list[ast.stmt]) -> tuple[str, ast.expr] | None:
    if len(block) == 1 and isinstance(block[0], ast.Assign) and len(block[0].targets) == 1:
        target = block[0].targets[0]
        if isinstance(target, ast.Name):
            return target.id, block[0].value
    return None


def _torch_where(namespace: dict) -> ast.expr | None:
    if namespace.get("torch") is torch:
        return ast.Attribute(value=ast.Name(id="torch", ctx=ast.Load()), attr="where", ctx=ast.Load())
    return None


def _proof(
    select: _Select, where: ast.expr | None, before: list[ast.stmt], scope: list, model: Any, params: frozenset[str]
) -> str:
    """"plain: <why>", or what keeps the guards."""
    if where is None:
        return "guarded: the module has no `import torch` to write `torch.where` with"
    if select.check == "predicable":
        return "guarded: under autograd the original branch must run (the runtime decides per call)"
    if select.check != "predicable_with_grad":
        return f"guarded: the runtime also checks `{select.check}` per call"

    def origin(name: str) -> frozenset[str] | None:
        return _origin(name, before, scope, model, params)

    numbers: dict[str, Number] = {}
    for temp in select.temps:
        number = _number_expr(temp.value, numbers, origin)  # type: ignore[attr-defined]
        if number is None:
            return f"guarded: `{ast.unparse(temp)}` is not proven a Python number that cannot raise (it would run on both paths)"
        numbers[temp.targets[0].id] = number  # type: ignore[attr-defined]
    tested = _test_steps(select.test, numbers)
    if tested is None:
        shown = ast.unparse(select.test).replace(RUNTIME_NAME + ".", "")
        return f"guarded: `{shown}` is not proven a 0-dim bool tensor (a whole reduction compared with a number)"
    sides = [_steps(select.when_true, numbers), _steps(select.when_false, numbers)]
    if None in sides or sides[0].base != sides[1].base:  # type: ignore[union-attr]
        return "guarded: the two values are not one tensor through elementwise steps with Python numbers"
    left, right = sides  # type: ignore[misc]
    known = {}
    for name in {s.base for s in tested} | {left.base}:
        dtypes = origin(name)
        if dtypes is None:
            return f"guarded: `{name}` is not proven a tensor where it was last assigned (a layer, a cast, a parameter annotated torch.Tensor)"
        known[name] = dtypes
    dtypes = known[left.base]
    raising = dtypes & (left.raises | right.raises)
    if raising:
        return f"guarded: a value raises on a {'/'.join(sorted(raising))} tensor, which `{left.base}` may be"
    if not _same_dtype(left, right, dtypes):
        return f"guarded: the values can differ in dtype when `{left.base}` is an integer or bool tensor"
    kinds = "/".join(sorted(dtypes))
    return (
        f"plain torch.where: the test is a 0-dim bool tensor; both values are `{left.base}` ({kinds}) "
        "through elementwise steps with numbers (same shape, dtype, device); under autograd eager's "
        "gradients except the sign of a zero"
    )


def _same_dtype(left: Steps, right: Steps, dtypes: frozenset[str]) -> bool:
    return all(left.dtypes_from(frozenset({k})) == right.dtypes_from(frozenset({k})) for k in dtypes)


@dataclass(frozen=True)
class Number:
    """A Python number the source proves: its type, and its value when a literal."""

    kind: type
    value: int | float | None = None


_FINFO = frozenset({"max", "min", "eps", "tiny", "resolution", "smallest_normal"})


def _number(node: ast.expr, numbers: dict[str, Number] | None = None) -> Number | None:
    """A literal (signed), or a name bound to a proven number."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _number(node.operand, numbers)
        if inner is None or inner.value is None:
            return inner
        return Number(inner.kind, -inner.value if isinstance(node.op, ast.USub) else inner.value)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Number(type(node.value), node.value)
    if isinstance(node, ast.Name) and numbers and node.id in numbers:
        return numbers[node.id]
    return None


def _number_expr(node: ast.expr, numbers: dict[str, Number], origin: Any) -> Number | None:
    """A Python number that evaluating ``node`` gives without raising: a literal,
    ``torch.finfo(x.dtype).max`` (and ``min``, ``eps``...) of a tensor proven
    floating, and ``+``, ``-``, ``*`` of those."""
    found = _number(node, numbers)
    if found is not None:
        return found
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = _number_expr(node.left, numbers, origin), _number_expr(node.right, numbers, origin)
        if left is None or right is None:
            return None
        return Number(float if float in (left.kind, right.kind) else int)
    if isinstance(node, ast.Attribute) and node.attr in _FINFO and isinstance(node.value, ast.Call):
        call = node.value
        if _is_torch(call.func, "finfo") and len(call.args) == 1 and not call.keywords:
            arg = call.args[0]
            if isinstance(arg, ast.Attribute) and arg.attr == "dtype" and isinstance(arg.value, ast.Name):
                if origin(arg.value.id) == frozenset({FLOAT}):
                    return Number(float)
    return None


def _is_torch(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.value, ast.Name) and node.value.id == "torch"


def _steps(node: ast.expr, numbers: dict[str, Number] | None = None) -> Steps | None:
    """``node`` as an elementwise chain over one name, or None."""
    if isinstance(node, ast.Name):
        return None if numbers and node.id in numbers else Steps(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _steps(node.operand, numbers)
        return inner and inner.then(raises=frozenset({BOOL}))
    if isinstance(node, ast.BinOp):
        number, tensor, reflected = _number(node.right, numbers), node.left, False
        if number is None:
            number, tensor, reflected = _number(node.left, numbers), node.right, True
        inner = _steps(tensor, numbers) if number is not None else None
        if inner is None or number is None:
            return None
        ints, floats = number.kind is int, number.kind is float
        if isinstance(node.op, (ast.Add, ast.Mult)):
            return inner.then(ints=ints, floats=floats)
        if isinstance(node.op, ast.Sub):
            return inner.then(ints=ints, floats=floats, raises=frozenset({BOOL}))
        if isinstance(node.op, ast.Div) and not reflected and number.value not in (0, None):  # 2 / h: infinite at 0
            return inner.then(floats=True)
        return None
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Attribute) and node.func.attr in _METHODS and not _is_torch(node.func, node.func.attr):
            receiver, args, method = node.func.value, node.args, node.func.attr
        elif isinstance(node.func, ast.Attribute) and node.func.attr in _METHODS and node.args:
            receiver, args, method = node.args[0], node.args[1:], node.func.attr  # torch.clamp(h, ...)
        else:
            return None
        if any(k.arg not in ("min", "max") for k in node.keywords) or (node.keywords and method not in ("clamp", "clip")):
            return None
        values = list(args) + [k.value for k in node.keywords]
        if not all(_number(v, numbers) is not None or _is_none(v) for v in values):
            return None
        inner = _steps(receiver, numbers)
        if inner is None:
            return None
        kinds = [n.kind for n in (_number(v, numbers) for v in values) if n is not None]
        return inner.then(
            ints=int in kinds, floats=method in _TO_FLOAT or float in kinds, raises=_METHODS[method]
        )
    return None


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _test_steps(node: ast.expr, numbers: dict[str, Number] | None = None) -> list[Steps] | None:
    """The chains a test reduces when it is a 0-dim bool tensor by construction:
    a whole reduction compared with a number, ``.any()``/``.all()``, and
    ``torch.logical_and``/``logical_or``/``logical_not`` of those."""
    if isinstance(node, ast.Call) and any(_is_torch(node.func, f) for f in ("logical_and", "logical_or", "logical_not")):
        parts = [_test_steps(arg, numbers) for arg in node.args]
        if node.keywords or not parts or len(parts) > 2 or any(p is None for p in parts):
            return None
        return [s for p in parts for s in p]  # type: ignore[union-attr]
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], _COMPARE):
        sides = [node.left, node.comparators[0]]
        found = [_number(side, numbers) for side in sides]
        if found.count(None) != 1:
            return None
        reduced = _reduced(sides[found.index(None)], _REDUCTIONS | _TESTS, numbers)
        return None if reduced is None else [reduced]
    reduced = _reduced(node, _TESTS, numbers)
    return None if reduced is None else [reduced]


_ELEMENTWISE_TESTS = frozenset({"isinf", "isnan", "isfinite"})


def _reduced(node: ast.expr, names: frozenset[str], numbers: dict[str, Number] | None = None) -> Steps | None:
    """``x.sum()`` (a name in ``names``, no arguments) of a chain, of a chain
    compared with a number (``(h > 3).any()``), or of ``torch.isinf(h)``
    (``isnan``, ``isfinite``)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names:
        if not node.args and not node.keywords:
            receiver = node.func.value
            if isinstance(receiver, ast.Compare) and len(receiver.ops) == 1 and isinstance(receiver.ops[0], _COMPARE):
                sides = [receiver.left, receiver.comparators[0]]
                found = [_number(side, numbers) for side in sides]
                return _steps(sides[found.index(None)], numbers) if found.count(None) == 1 else None
            if (
                isinstance(receiver, ast.Call) and any(_is_torch(receiver.func, f) for f in _ELEMENTWISE_TESTS)
                and len(receiver.args) == 1 and not receiver.keywords
            ):
                return _steps(receiver.args[0], numbers)
            return _steps(receiver, numbers)
    return None


def _tensor_params(fdef: ast.AST, namespace: dict) -> frozenset[str]:
    args = fdef.args  # type: ignore[attr-defined]
    out = set()
    for arg in args.posonlyargs + args.args + args.kwonlyargs:
        note = arg.annotation
        if isinstance(note, ast.Attribute) and note.attr == "Tensor" and isinstance(note.value, ast.Name):
            if namespace.get(note.value.id) is torch:
                out.add(arg.arg)
        elif isinstance(note, ast.Name) and namespace.get(note.id) is torch.Tensor:
            out.add(arg.arg)
    return frozenset(out)


def _binds(node: ast.AST, name: str) -> bool:
    return any(
        isinstance(sub, ast.Name) and sub.id == name and isinstance(sub.ctx, (ast.Store, ast.Del))
        for sub in ast.walk(node)
    ) or any(isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and sub.name == name for sub in ast.walk(node))


# Statements before, innermost first; the compound statement holding them, and its field they are in.
Levels = list[tuple[list[ast.stmt], "ast.stmt | None", str]]


def _origin(name: str, before: list[ast.stmt], scope: list, model: Any, params: frozenset[str]) -> frozenset[str] | None:
    """The dtypes ``name``'s tensor can have after ``before`` (``scope``: see
    ``_walk``), or None when it is not proven a tensor."""
    levels: Levels = [(before, scope[-1][1], scope[-1][2]) if scope else (before, None, "")]
    for i in range(len(scope) - 1, -1, -1):
        levels.append((scope[i][0], scope[i - 1][1], scope[i - 1][2]) if i > 0 else (scope[i][0], None, ""))
    return _origin_in(name, levels, model, params, 0)


def _origin_in(name: str, levels: Levels, model: Any, params: frozenset[str], depth: int) -> frozenset[str] | None:
    """The last statement binding ``name`` before, looking outwards: a plain
    assignment is read (``_value_origin``); anything else is not proven. Leaving
    a loop that binds ``name`` stops (its value may come from a later
    iteration); leaving the body of an ``if name.dtype == torch.float16:``
    narrows what a binding further out can be."""
    if depth > 8:
        return None
    narrowed = ANY_DTYPE
    for position, (block, holder, field) in enumerate(levels):
        for index in range(len(block) - 1, -1, -1):
            stmt = block[index]
            if not _binds(stmt, name):
                continue
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                found = _value_origin(stmt.value, [(block[:index], holder, field)] + levels[position + 1 :], model, params, depth)
                return None if found is None else found & narrowed
            return None
        if isinstance(holder, (ast.For, ast.AsyncFor, ast.While)) and _binds(holder, name):
            return None
        if isinstance(holder, ast.If) and field == "body":
            narrowed = narrowed & _dtype_facts(holder.test, name)
    return ANY_DTYPE & narrowed if name in params else None


_FLOATING_DTYPES = frozenset({"float16", "float32", "float64", "bfloat16", "half", "float", "double"})
_COMPLEX_DTYPES = frozenset({"complex64", "complex128", "cfloat", "cdouble", "complex32", "chalf"})


def _dtype_facts(test: ast.expr, name: str) -> frozenset[str]:
    """What an ``if`` test that holds says of ``name``'s dtype: ``name.dtype ==
    torch.float16`` (a conjunct of it) -> floating; else anything."""
    conjuncts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    found = ANY_DTYPE
    for part in conjuncts:
        if isinstance(part, ast.Compare) and len(part.ops) == 1 and isinstance(part.ops[0], (ast.Eq, ast.Is)):
            for one, other in ((part.left, part.comparators[0]), (part.comparators[0], part.left)):
                if (
                    isinstance(one, ast.Attribute) and one.attr == "dtype" and isinstance(one.value, ast.Name)
                    and one.value.id == name and isinstance(other, ast.Attribute) and isinstance(other.value, ast.Name)
                    and other.value.id == "torch"
                ):
                    if other.attr in _FLOATING_DTYPES:
                        found = found & frozenset({FLOAT})
                    elif other.attr in _COMPLEX_DTYPES:
                        found = found & frozenset({COMPLEX})
    return found


def _value_origin(node: ast.expr, levels: Levels, model: Any, params: frozenset[str], depth: int) -> frozenset[str] | None:
    """The dtypes ``node`` can have (``levels``: what runs before it), or None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        owner, attr = node.func.value, node.func.attr
        if isinstance(owner, ast.Name) and owner.id == "self" and _floating_layer(model, attr):
            return _REAL_OR_COMPLEX
        if attr in _CASTS and not node.args and not node.keywords:
            inner = _steps(owner)
            if inner is not None and _origin_in(inner.base, levels, model, params, depth + 1) is not None:
                return frozenset({_CASTS[attr]})
            return None
    steps = _steps(node)
    if steps is None:
        return None
    base = _origin_in(steps.base, levels, model, params, depth + 1)
    return None if base is None else steps.dtypes_from(base)


def _floating_layer(model: Any, attr: str) -> bool:
    """Every module of the live model named ``attr`` is exactly one of the floating
    layers, with its own forward and no hooks (its own or global ones)."""
    if not isinstance(model, torch.nn.Module):
        return False
    hooks = torch.nn.modules.module
    if getattr(hooks, "_global_forward_hooks", None) or getattr(hooks, "_global_forward_pre_hooks", None):
        return False  # a hook on every module may return anything
    found = [m._modules[attr] for m in model.modules() if attr in m._modules]
    return bool(found) and all(
        type(m) in _FLOATING_LAYERS and "forward" not in vars(m) and not m._forward_hooks and not m._forward_pre_hooks
        for m in found
    ) and not any(attr in vars(m) or attr in m._parameters or attr in m._buffers for m in model.modules() if attr not in m._modules)
