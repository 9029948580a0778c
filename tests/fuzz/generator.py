"""Hypothesis strategies that write small ``nn.Module`` programs as source text.

A program is one module file: imports (``torch`` possibly as ``th``), a
logger, maybe module-level helper functions and block classes, and a
``Model`` whose ``forward(self, x)`` takes one ``[2, 4]`` float tensor. Its
statements mix the patterns the rules handle with the traps around them:
data-dependent ``if`` / ``elif`` / ``else`` (nested, sequential, with early
returns and returns in some branches), prints / logger calls / ``warnings.warn`` of tensors followed by
in-place mutation of those tensors, validation checks (``if ...: raise``,
``assert``, ``torch._assert``, also inside branches), attribute and buffer
updates (also inside branches, in place), parameters that may be ``None``, an fp16
overflow guard, helpers, submodules, loops over an ``nn.ModuleList``, and
host reads and data-dependent shapes (``.item()``, boolean indexing,
``nonzero``).

Weights are seeded (the runner calls ``torch.manual_seed`` before building
``Model``), so a program is a pure function of its source.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from hypothesis import strategies as st

# Data-dependent tests; ``{T}`` is the torch alias. Every one is a 0-dim
# bool tensor (or an and/or/not of them).
CONDITIONS = [
    "h.sum() > 0",
    "h.mean() < 0.5",
    "(h > 1).any()",
    "(h < 0).all()",
    "h.abs().amax() > 2.0",
    "not (h > 0).all()",
    "{T}.isnan(h).any() or {T}.isinf(h).any()",
    "h.max() > 1 and h.min() < 0",
    "s > 0",
    "h.norm() > 3",
    "h.dim() > 2 or h.sum() > 0",  # a static operand of `or`: a Python if around the predicated part
]

# Checks that fail on some inputs (inf, nan, large or negative values).
CHECKS = [
    "(h.abs() > 1e3).any()",
    "{T}.isnan(h).any()",
    "not {T}.isfinite(h).all()",
    "(h < -2).any()",
    "not {T}.equal(h, h)",
]

ARITH = [
    "h = h * 1.5",
    "h = h + 1.0",
    "h = {T}.tanh(h)",
    "h = h - h.mean()",
    "h = {T}.relu(h)",
    "s = s + h.sum()",
    "s = h.amax()",
    "h = self.lin(h)",
    "s = h[0, 0]",  # a view: an in-place update of either changes the other
]

MESSAGES = [
    '"value out of range"',
    'f"bad values: {{h.min()}}"',
    'f"max was {{h.max().item():.3f}}"',
    '"check failed at " + str(h.shape[0])',
]

# Host reads and data-dependent shapes: [Scalar] / [Speculate] or nothing.
UNTOUCHABLE = [
    ["h = h + h.sum().item()"],
    ["if h.sum().item() > 0:", "    h = h * 2"],
    ["k = h[h > 0]", "h = h + k.sum()"],
    ["idx = {T}.nonzero(h > 0)", "h = h + idx.shape[0]"],
    ["h = h.clamp(min=-1e4, max=1e4)"],
    # [Speculate]: a host flag that changes shapes (Longformer's is_global_attn)
    ["wide = (h > 1).any().item()", "if wide:", "    h = {T}.cat([h, h.flip(-1)], dim=-1)",
     "    h = h[..., :4] + h[..., 4:]"],
]


@dataclass
class Program:
    source: str
    features: list[str] = field(default_factory=list)

    @property
    def digest(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()[:12]


class _Ctx:
    """What the statements drawn so far need: init lines, helpers, classes."""

    def __init__(self, alias: str, has_self: bool = True):
        self.T = alias
        self.has_self = has_self  # False in module-level helper functions
        self.init: list[str] = []
        self.defs: list[list[str]] = []  # helper functions and block classes, in order
        self.methods: list[list[str]] = []
        self.features: list[str] = []
        self.counter = [0]  # shared with nested contexts: names stay unique

    def fresh(self, stem: str) -> str:
        self.counter[0] += 1
        return f"{stem}{self.counter[0]}"

    def need(self, line: str) -> None:
        if line not in self.init:
            self.init.append(line)

    def fmt(self, text: str) -> str:
        """Fill in the torch alias; ``{{``/``}}`` become literal braces."""
        return text.replace("{T}", self.T).replace("{{", "{").replace("}}", "}")


def _indent(lines: list[str], n: int = 1) -> list[str]:
    return ["    " * n + line for line in lines]


@st.composite
def _condition(draw, ctx: _Ctx, pool=CONDITIONS) -> str:
    return ctx.fmt(draw(st.sampled_from(pool)))


@st.composite
def _arith(draw, ctx: _Ctx) -> list[str]:
    line = draw(st.sampled_from(ARITH if ctx.has_self else [a for a in ARITH if "self" not in a]))
    if "self.lin" in line:
        ctx.need("self.lin = nn.Linear(4, 4)")
    return [ctx.fmt(line)]


@st.composite
def _effect(draw, ctx: _Ctx) -> list[str]:
    kind = draw(st.sampled_from(["print", "print_f", "log", "log_info", "warn"]))
    ctx.features.append(kind)
    T = ctx.T
    lines = {
        "print": ['print("h is", h, s)'],
        "print_f": ['print(f"sum={h.sum()} max={h.max():.2f}")'],
        "log": ['logger.warning("h %s s %s", h, s)'],
        "log_info": ['logger.info("norm %s", h.norm())'],
        "warn": ['warnings.warn(f"mean {h.mean()}")'],
    }[kind]
    if draw(st.booleans()):  # mutate what was just printed
        lines.append(draw(st.sampled_from(["h.mul_(2)", "h.add_(1)", "s.add_(1)", f"h.copy_({T}.zeros_like(h))"])))
        ctx.features.append("mutate-after-effect")
    return lines


@st.composite
def _check(draw, ctx: _Ctx) -> list[str]:
    kind = draw(st.sampled_from(["raise", "raise_custom", "assert", "torch_assert"]))
    ctx.features.append(kind)
    test = ctx.fmt(draw(st.sampled_from(CHECKS)))
    message = ctx.fmt(draw(st.sampled_from(MESSAGES)))
    if kind == "raise":
        cls = draw(st.sampled_from(["ValueError", "RuntimeError"]))
        return [f"if {test}:", f"    raise {cls}({message})"]
    if kind == "raise_custom":
        return [f"if {test}:", f"    raise FuzzError({message})"]
    if kind == "assert":
        return [f"assert not ({test}), {message}"]
    holds = test[len("not "):] if test.startswith("not ") else f"~({test})"  # as people write it
    return [f"{ctx.T}._assert({holds}, {message})"]


@st.composite
def _state(draw, ctx: _Ctx) -> list[str]:
    kind = draw(st.sampled_from(["count", "calls", "buf_copy", "buf_store", "attr_tensor", "buf_update"]))
    ctx.features.append(kind)
    if kind == "count":
        ctx.need("self.count = 0")
        return ["self.count += 1"]
    if kind == "calls":
        ctx.need("self.calls = 0")
        return ["self.calls = self.calls + 1"]
    if kind == "buf_copy":
        ctx.need(f'self.register_buffer("buf", {ctx.T}.zeros(4))')
        return ["self.buf.copy_(h.mean(0).detach())"]
    if kind == "buf_update":  # an in-place update, as the last statement of a branch or anywhere
        ctx.need(f'self.register_buffer("buf", {ctx.T}.zeros(4))')
        return [draw(st.sampled_from(["self.buf.mul_(0.5)", "self.buf.add_(h.mean(0).detach())",
                                      "self.buf.clamp_(-1.0, 1.0)", "self.buf.masked_fill_(self.buf > 1.0, 0.0)"]))]
    if kind == "buf_store":
        ctx.need(f'self.register_buffer("running", {ctx.T}.zeros(4))')
        return ["self.running = h.mean(0).detach()"]
    ctx.need("self.last = None")
    return ["self.last = h.detach().sum()"]


@st.composite
def _if(draw, ctx: _Ctx, depth: int, allow_return: bool) -> list[str]:
    lines = [f"if {draw(_condition(ctx))}:"]
    lines += _indent(draw(_block(ctx, depth - 1, allow_return, 1, 2)))
    shape = draw(st.sampled_from(["if", "if-else", "if-elif", "if-elif-else"]))
    ctx.features.append(shape)
    if allow_return and draw(st.integers(0, 3)) == 0:  # the first branch returns, the others go on
        ctx.features.append("return-in-one-branch")
        lines.append(f"    return {draw(st.sampled_from(['h * 2', 'h + s', '-h']))}")
    if "elif" in shape:
        lines.append(f"elif {draw(_condition(ctx))}:")
        lines += _indent(draw(_block(ctx, depth - 1, allow_return, 1, 2)))
    if shape.endswith("else"):
        lines.append("else:")
        lines += _indent(draw(_block(ctx, depth - 1, allow_return, 1, 2)))
    if allow_return and shape == "if-else" and draw(st.booleans()):  # both branches return
        ctx.features.append("if-else-return")
        return [lines[0], f"    return {draw(st.sampled_from(['h * 2', 'h + s']))}", "else:", "    return -h"]
    return lines


@st.composite
def _early_return(draw, ctx: _Ctx) -> list[str]:
    ctx.features.append("early-return")
    value = draw(st.sampled_from(["h * 2", "h + s", "-h"]))
    return [f"if {draw(_condition(ctx))}:", f"    return {value}"]


@st.composite
def _helper(draw, ctx: _Ctx) -> list[str]:
    """A module-level function or a method holding its own statements."""
    kind = draw(st.sampled_from(["function", "method"]))
    ctx.features.append("helper-" + kind)
    name = ctx.fresh("_helper" if kind == "method" else "helper")
    sub = _Ctx(ctx.T, has_self=kind == "method")
    sub.counter = ctx.counter
    body = draw(_block(sub, 1, False, 1, 3, plain=True))
    ctx.features += sub.features
    ctx.defs += sub.defs
    if kind == "function":
        ctx.defs.append([f"def {name}(h, s):", *_indent(body), "    return h, s"])
        return [f"h, s = {name}(h, s)"]
    ctx.init += [line for line in sub.init if line not in ctx.init]
    ctx.methods.append([f"def {name}(self, h, s):", *_indent(body), "    return h, s"])
    return [f"h, s = self.{name}(h, s)"]


@st.composite
def _submodule(draw, ctx: _Ctx) -> list[str]:
    """A block class with its own forward; used once or in a ModuleList loop."""
    cls = ctx.fresh("Block")
    sub = _Ctx(ctx.T)
    sub.counter = ctx.counter
    body = draw(_block(sub, 1, False, 1, 3))
    ctx.features += sub.features
    ctx.defs += sub.defs
    ctx.defs.append(
        [
            f"class {cls}(nn.Module):",
            "    def __init__(self, use_bias=True):",
            "        super().__init__()",
            *_indent(sub.init or ["pass"], 2),
            *_indent(sub.methods and [line for m in sub.methods for line in m] or [], 1),
            "    def forward(self, h):",
            "        s = h.mean()",
            *_indent(body, 2),
            "        return h",
        ]
    )
    attr = cls.lower()
    if draw(st.booleans()):
        ctx.features.append("modulelist-loop")
        ctx.need(f"self.{attr} = nn.ModuleList([{cls}() for _ in range(2)])")
        return [f"for layer in self.{attr}:", "    h = layer(h)"]
    ctx.features.append("submodule")
    ctx.need(f"self.{attr} = {cls}()")
    return [f"h = self.{attr}(h)"]


@st.composite
def _optional_param(draw, ctx: _Ctx) -> list[str]:
    ctx.features.append("optional-param")
    ctx.need(f"self.bias = nn.Parameter({ctx.T}.full((4,), 0.25)) if use_bias else None")
    test = draw(st.sampled_from(["self.bias is not None", "self.bias is not None and h.sum() > 0"]))
    return [f"if {test}:", "    h = h + self.bias"]


@st.composite
def _fp16_guard(draw, ctx: _Ctx) -> list[str]:
    ctx.features.append("fp16-guard")
    T = ctx.T
    scale = draw(st.sampled_from(["3000.0", "10.0"]))
    return [
        f"t = (h * {scale}).to({T}.float16)",
        f"if t.dtype == {T}.float16 and {T}.isinf(t).any():",
        f"    lim = {T}.finfo(t.dtype).max - 1000",
        f"    t = {T}.clamp(t, min=-lim, max=lim)",
        "h = t.float()",
    ]


@st.composite
def _untouchable(draw, ctx: _Ctx) -> list[str]:
    ctx.features.append("untouchable")
    return [ctx.fmt(line) for line in draw(st.sampled_from(UNTOUCHABLE))]


@st.composite
def _statement(draw, ctx: _Ctx, depth: int, allow_return: bool, plain: bool = False) -> list[str]:
    kinds = ["arith", "arith", "effect", "check"] + (["state"] if ctx.has_self else [])
    if depth > 0:
        kinds += ["if", "if"]
        if allow_return:
            kinds.append("return")
        if not plain:
            kinds += ["helper", "submodule", "optional", "fp16", "untouchable"]
    kind = draw(st.sampled_from(kinds))
    if kind == "arith":
        return draw(_arith(ctx))
    if kind == "effect":
        return draw(_effect(ctx))
    if kind == "check":
        return draw(_check(ctx))
    if kind == "state":
        return draw(_state(ctx))
    if kind == "if":
        return draw(_if(ctx, depth, allow_return))
    if kind == "return":
        return draw(_early_return(ctx))
    if kind == "helper":
        return draw(_helper(ctx))
    if kind == "submodule":
        return draw(_submodule(ctx))
    if kind == "optional":
        return draw(_optional_param(ctx))
    if kind == "fp16":
        return draw(_fp16_guard(ctx))
    return draw(_untouchable(ctx))


@st.composite
def _block(draw, ctx: _Ctx, depth: int, allow_return: bool, low: int, high: int, plain: bool = False) -> list[str]:
    count = draw(st.integers(low, high))
    lines: list[str] = []
    for _ in range(count):
        lines += draw(_statement(ctx, depth, allow_return, plain))
    return lines


@st.composite
def programs(draw, max_statements: int = 6) -> Program:
    """One program: a ``Model`` (built as ``Model()``) with ``forward(self, x)``."""
    alias = draw(st.sampled_from(["torch", "th"]))
    ctx = _Ctx(alias)
    if alias == "th":
        ctx.features.append("torch-as-th")
    body = draw(_block(ctx, 2, True, 2, max_statements))
    ret = draw(st.sampled_from(["h", "h + s", "(h, s)"]))
    use_bias = draw(st.booleans())
    imports = ["import logging", "import warnings", ""]
    imports += ["import torch", "from torch import nn"] if alias == "torch" else ["import torch as th", "", "nn = th.nn"]
    lines = [
        '"""A generated graphmend fuzz program (tests/fuzz/generator.py)."""',
        "",
        *imports,
        "",
        'logger = logging.getLogger("graphmend.fuzz")',
        "",
        "",
        "class FuzzError(Exception):",
        '    """A model-defined exception class."""',
        "",
        "",
    ]
    for definition in ctx.defs:
        lines += definition + ["", ""]
    lines += [
        "class Model(nn.Module):",
        f"    def __init__(self, use_bias={use_bias}):",
        "        super().__init__()",
        *_indent(ctx.init, 2),
    ]
    for method in ctx.methods:
        lines += [""] + _indent(method)
    lines += [
        "",
        "    def forward(self, x):",
        "        h = x * 1.0",
        "        s = h.mean()",
        *_indent(body, 2),
        f"        return {ret}",
        "",
    ]
    return Program(source="\n".join(lines), features=sorted(set(ctx.features)))
