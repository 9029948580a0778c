"""[Compiling]: a compiler check on the way to an exception only the compiled model
raises answers what eager answers; its sites come only from such an exception;
a mend whose eager path breaks more is taken back; its golden table."""

import copy

import golden
import pytest
import torch
from effects_capture import CountingBackend
from fixtures.compile_paths import build, build_breaking

import graphmend
from graphmend.pipeline import GONE


@pytest.fixture(autouse=True)
def _restore():
    yield
    graphmend.unmend()
    torch._dynamo.reset()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_the_compiled_model_takes_eagers_path_in_one_graph(grad):
    model, (x,) = build()
    reference = copy.deepcopy(model)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend)
    for scale in (1.0, 0.5):
        a, b = (x * scale).requires_grad_(grad), (x * scale).requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            expected, got = reference(a), compiled(b)
        assert torch.equal(expected, got)
        if grad:
            expected.sum().backward(), got.sum().backward()
            assert torch.equal(a.grad, b.grad)
            assert torch.equal(reference.out.lin.weight.grad, model.out.lin.weight.grad)
    report = compiled.report
    assert [(o.function, o.category, o.rule, o.status) for o in report.outcomes] == [
        ("_blocks", "OTHER", None, "out of scope"),  # the exception: gone with eager's path
        ("forward", "CC", "compiling", "applied"),
    ]
    assert GONE in report.outcomes[0].notes
    assert report.outcomes[1].reason == "`torch.compiler.is_compiling()` answered False, as in every eager run"
    assert (report.before.graphs, report.after.graphs) == (2, 1)
    assert (report.before.frames_skipped, report.after.frames_skipped) == (2, 0)
    assert len(backend.graphs) == 1


def test_explain_finds_the_check_only_on_the_way_to_an_observed_exception():
    model, args = build()
    sites = graphmend.explain(model, *args).sites
    assert [(s.category, s.reason, s.function, s.code, s.rule) for s in sites] == [
        ("OTHER", "Observed exception", "_blocks", "if mask.shape[1] % block != 0:", None),
        ("CC", "Observed exception", "forward", "if mask is None and not torch.compiler.is_compiling():", "compiling"),
    ]
    assert [f.function for f in sites[1].frames] == ["forward", "forward"]  # Model.forward > Encoder.forward
    assert sites[1].detail.endswith("compile_paths.py:11: if mask.shape[1] % block != 0:")
    # A mask passed in: no exception, so the check is no site (it keeps the compiler's path).
    mask = torch.ones(2, 6)
    plain = graphmend.explain(lambda x: model.encoder(x, mask), *args)
    assert [s.category for s in plain.sites] == [] and plain.graphs == 1


def test_an_eager_path_that_breaks_more_is_taken_back():
    model, (x,) = build_breaking()
    reference = copy.deepcopy(model)
    report = graphmend.mend(model, x)
    [check] = [o for o in report.outcomes if o.rule == "compiling"]
    assert check.status == "reverted"
    assert check.reason.startswith(
        "the mended program was worse than the original (2 graph(s), 0 recompile(s), 2 frame(s) skipped -> 5 graph(s)"
    )
    assert (report.before.graphs, report.after.graphs) == (2, 2)
    assert [o.code for o in report.outcomes if GONE in o.notes] == []  # the breaks only the taken-back mend made
    assert torch.equal(model(x), reference(x))


GOLDEN = [
    golden.case(
        "torch.compiler.is_compiling",
        """
        def forward(x, mask=None):
            if mask is None and not torch.compiler.is_compiling():  # <-
                mask = torch.ones_like(x)
            return x * mask
        """,
        rewritten="""
        def forward(x, mask=None):
            if mask is None and (not False):
                mask = torch.ones_like(x)
            return x * mask
        """,
    ),
    golden.case(
        "torch._dynamo.is_compiling-in-an-assignment",
        """
        def forward(x):
            compiling = torch._dynamo.is_compiling() or x.dim() > 4  # <-
            return x if compiling else x + 1
        """,
        rewritten="""
        def forward(x):
            compiling = False or x.dim() > 4
            return x if compiling else x + 1
        """,
    ),
    golden.case(
        "only-the-header-of-a-compound-statement",
        """
        def forward(x):
            if not torch.compiler.is_compiling():  # <-
                x = x + torch.compiler.is_compiling()
            return x
        """,
        rewritten="""
        def forward(x):
            if not False:
                x = x + torch.compiler.is_compiling()
            return x
        """,
    ),
    golden.case(
        "a-function-of-the-same-name",
        """
        def is_compiling():
            return True

        def forward(x):
            if not is_compiling():  # <-
                x = x + 1
            return x
        """,
        declined="`is_compiling` is not one of torch's or transformers' compiler checks "
        "(torch.compiler.is_compiling and the like)",
    ),
    golden.case(
        "no-check",
        """
        def forward(x):
            x = x + 1  # <-
            return x
        """,
        declined="the statement asks no compiler check",
    ),
]


@pytest.mark.parametrize("source, expected", GOLDEN)
def test_golden(source, expected):
    assert golden.outcome("compiling", source) == expected
