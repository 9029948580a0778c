"""[Where] as ``graphmend fix`` writes it: plain ``torch.where`` where the source
proves what the runtime's guards check, else the guarded form with the
missing proof named (tools/plain.py). A golden table: the [Where] rewrite of
a small source (tests/rules/golden.py), then ``plain_selects``; each case
expects the function as written or the exact reason it stays guarded."""

import ast
import textwrap

import golden
import pytest

from graphmend.tools.plain import plain_selects

LINEAR = """\
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.other = nn.Linear(4, 4)

    def forward(self, x):
{body}
"""


def _linear(body: str) -> str:
    return LINEAR.format(body=textwrap.indent(textwrap.dedent(body).strip("\n"), " " * 8))


def _written(source: str):
    site, node, module, model = golden.rewritten("where", source)
    assert site.ok, site.reason
    node, [note] = plain_selects(node, vars(module), model)
    return node, note


def _case(id, source, *, plain=None, guarded=None):
    assert (plain is None) != (guarded is None)
    return pytest.param(source, plain, guarded, id=id)


CASES = [
    _case(
        "linear-output-sub-and-mul",
        _linear("""
            h = self.lin(x)
            if h.sum() > 0:  # <-
                h = h * 2
            else:
                h = h - 1
            return h
        """),
        plain="""
            def forward(self, x):
                h = self.lin(x)
                h = torch.where(h.sum() > 0, h * 2, h - 1)
                return h
        """,
    ),
    _case(
        "one-armed-true-division-of-a-floating-tensor",
        _linear("""
            h = self.lin(x)
            if h.abs().amax() > 2.0:  # <-
                h = h / 2.0
            return h
        """),
        plain="""
            def forward(self, x):
                h = self.lin(x)
                h = torch.where(h.abs().amax() > 2.0, h / 2.0, h)
                return h
        """,
    ),
    _case(
        "any-test-and-a-cast",
        """\
        def f(x: torch.Tensor):
            h = x.float()
            if (h > 3).any():  # <-
                h = -h
            else:
                h = h.clamp(0, 1)
            return h
        """,
        plain="""
            def f(x: torch.Tensor):
                h = x.float()
                h = torch.where((h > 3).any(), -h, h.clamp(0, 1))
                return h
        """,
    ),
    _case(
        "cast-then-negation",
        """\
        def f(x: torch.Tensor):
            h = x.float()
            if h.any():  # <-
                h = -h
            else:
                h = h.clamp(0, 1)
            return h
        """,
        plain="""
            def f(x: torch.Tensor):
                h = x.float()
                h = torch.where(h.any(), -h, h.clamp(0, 1))
                return h
        """,
    ),
    _case(
        "annotated-parameter-arithmetic-that-never-raises",
        """\
        def f(h: torch.Tensor):
            if h.mean() < 0:  # <-
                h = h * 3
            else:
                h = h + 1
            return h
        """,
        plain="""
            def f(h: torch.Tensor):
                h = torch.where(h.mean() < 0, h * 3, h + 1)
                return h
        """,
    ),
    _case(
        "annotated-parameter-may-be-bool-subtraction-raises",
        """\
        def f(h: torch.Tensor):
            if h.sum() > 0:  # <-
                h = h * 2
            else:
                h = h - 1
            return h
        """,
        guarded="guarded: a value raises on a bool tensor, which `h` may be",
    ),
    _case(
        "annotated-parameter-may-be-integer-dtypes-differ",
        """\
        def f(h: torch.Tensor):
            if h.abs().amax() > 2:  # <-
                h = h / 2
            return h
        """,
        guarded="guarded: the values can differ in dtype when `h` is an integer or bool tensor",
    ),
    _case(
        "unannotated-parameter-not-proven-a-tensor",
        """\
        def f(h):
            if h.sum() > 0:  # <-
                h = h * 2
            else:
                h = h + 1
            return h
        """,
        guarded="guarded: `h` is not proven a tensor where it was last assigned (a layer, a cast, a parameter annotated torch.Tensor)",
    ),
    _case(
        "relu-raises-on-complex-which-a-linear-may-give",
        _linear("""
            h = self.lin(x)
            if h.sum() > 0:  # <-
                h = h.relu()
            else:
                h = h * 2
            return h
        """),
        guarded="guarded: a value raises on a complex tensor, which `h` may be",
    ),
    _case(
        "two-tensors",
        _linear("""
            h = self.lin(x)
            g = self.other(x)
            if h.sum() > 0:  # <-
                h = g * 2
            else:
                h = h * 2
            return h
        """),
        guarded="guarded: the runtime also checks `grad_free(h, self, x)` per call",
    ),
    _case(
        "a-value-that-is-not-elementwise-with-numbers",
        _linear("""
            h = self.lin(x)
            if h.sum() > 0:  # <-
                h = h.softmax(-1)
            else:
                h = h * 2
            return h
        """),
        guarded="guarded: the two values are not one tensor through elementwise steps with Python numbers",
    ),
    _case(
        "a-loop-carries-the-value-from-a-later-statement",
        _linear("""
            h = self.lin(x)
            for _ in range(2):
                if h.sum() > 0:  # <-
                    h = h * 2
                else:
                    h = h + 1
                h = h @ h
            return h
        """),
        guarded="guarded: `h` is not proven a tensor where it was last assigned (a layer, a cast, a parameter annotated torch.Tensor)",
    ),
    _case(
        "assigned-in-the-loop-before-the-if",
        _linear("""
            h = x
            for _ in range(2):
                h = self.lin(h)
                if h.sum() > 0:  # <-
                    h = h * 2
                else:
                    h = h - 1
            return h
        """),
        plain="""
            def forward(self, x):
                h = x
                for _ in range(2):
                    h = self.lin(h)
                    h = torch.where(h.sum() > 0, h * 2, h - 1)
                return h
        """,
    ),
    _case(
        "a-subclass-of-linear-may-return-anything",
        """\
        class MyLinear(nn.Linear):
            pass

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = MyLinear(4, 4)

            def forward(self, x):
                h = self.lin(x)
                if h.sum() > 0:  # <-
                    h = h * 2
                else:
                    h = h - 1
                return h
        """,
        guarded="guarded: `h` is not proven a tensor where it was last assigned (a layer, a cast, a parameter annotated torch.Tensor)",
    ),
    _case(
        "a-test-that-is-not-a-whole-reduction",
        _linear("""
            h = self.lin(x)
            if h[0, 0] > 0:  # <-
                h = h * 2
            else:
                h = h - 1
            return h
        """),
        guarded="guarded: `h[0, 0] > 0` is not proven a 0-dim bool tensor (a whole reduction compared with a number)",
    ),
    _case(
        "a-number-temporary-under-a-dtype-test-bart-fp16",
        """\
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm = nn.LayerNorm(4)

            def forward(self, x):
                h = self.norm(x)
                if h.dtype == torch.float16 and (torch.isinf(h).any() or torch.isnan(h).any()):  # <-
                    c = torch.finfo(h.dtype).max - 1000
                    h = torch.clamp(h, min=-c, max=c)
                return h
        """,
        plain="""
            def forward(self, x):
                h = self.norm(x)
                if h.dtype == torch.float16:
                    c = torch.finfo(h.dtype).max - 1000
                    h = torch.where(torch.logical_or(torch.isinf(h).any(), torch.isnan(h).any()), torch.clamp(h, min=-c, max=c), h)
                return h
        """,
    ),
    _case(
        "a-number-temporary-that-may-raise-without-the-dtype-test",
        """\
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm = nn.LayerNorm(4)

            def forward(self, x):
                h = self.norm(x)
                if torch.isinf(h).any():  # <-
                    c = torch.finfo(h.dtype).max - 1000
                    h = torch.clamp(h, min=-c, max=c)
                return h
        """,
        guarded="guarded: `c = torch.finfo(h.dtype).max - 1000` is not proven a Python number that cannot raise (it would run on both paths)",
    ),
]


@pytest.mark.parametrize("source,plain,guarded", CASES)
def test_plain_selects(source, plain, guarded):
    node, note = _written(source)
    if plain is not None:
        assert note.plain and note.why.startswith("plain torch.where: "), note.why
        assert ast.unparse(node) == textwrap.dedent(plain).strip("\n")
    else:
        assert (note.plain, note.why) == (False, guarded)
        assert "torch.where(" not in ast.unparse(node).replace("__graphmend_rt__.torch.where", "")
