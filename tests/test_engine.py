"""The rewrite engine on every function shape the issue names."""

import types

import pytest
import torch

import engine_cases as C
import graphmend
import userpkg
from effects_capture import CountingBackend, run
from graphmend.rewrite import engine
from graphmend.rules import Decline

X = C.inputs()


@pytest.fixture(autouse=True)
def _restore():
    yield
    graphmend.unmend()
    torch._dynamo.reset()


def check(model, *args, **kwargs):
    """Mend, then compare eager effects and outputs, and count graphs."""
    eager = run(model, *args, **kwargs)
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend, example_inputs=(args, kwargs))
    mended = run(compiled, *args, **kwargs)
    assert compiled.report.applied, compiled.report.outcomes
    assert mended.effects() == eager.effects()
    assert torch.equal(mended.output, eager.output)
    return compiled, backend


def test_zero_argument_super_keeps_the_class_cell():
    compiled, backend = check(C.UsesSuper(), *X)
    assert len(backend.graphs) == 1
    assert "__class__" in C.UsesSuper.forward.__code__.co_freevars


def test_decorated_method_with_defaults_kwonly_and_varargs():
    model = C.Decorated()
    defaults = model.forward.__wrapped__.__defaults__
    compiled, backend = check(model, *X)
    inner = C.Decorated.forward.__wrapped__
    assert inner.__defaults__ == defaults and inner.__kwdefaults__ == {"shift": 1.0}
    out = run(compiled, X[0], 3.0, 7, 8, shift=0.5, flag=True)
    assert "decorated tensor(88.) 2 ['flag']" in out.stdout


def test_closure_free_variables():
    fn = C.make_closure(3.0)
    compiled, backend = check(fn, *X)
    assert fn.__code__.co_freevars == ("factor",)
    assert len(backend.graphs) == 1


def test_private_name_mangling():
    compiled, backend = check(C.Private(), *X)
    assert "_Private__secret" in C.Private.forward.__code__.co_names


def test_function_in_package_init():
    original = userpkg.announce.__code__
    compiled, backend = check(C.CallsPackage(), *X)
    assert userpkg.announce.__code__ is not original
    graphmend.unmend()
    assert userpkg.announce.__code__ is original


def test_staticmethod():
    compiled, backend = check(C.Static(), *X)
    assert len(backend.graphs) == 1


def test_every_reference_sees_the_new_code():
    alias = C.UsesSuper.forward  # e.g. a dispatch table holding the function
    graphmend.mend(C.UsesSuper(), *X)
    assert alias.__code__ is C.UsesSuper.forward.__code__
    assert "__graphmend_rt__" in alias.__code__.co_names


def test_source_not_available_declines_with_reason():
    namespace = {}
    exec(compile("def f(x):\n    print('dyn', x.sum())\n    return x\n", "<generated>", "exec"), namespace)
    report = graphmend.mend(namespace["f"], *X)
    (outcome,) = [o for o in report.outcomes if o.category == "LC"]
    assert outcome.status == "declined" and "source" in outcome.reason


def test_locate_outside_a_function_declines(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("x = 1\n")
    with pytest.raises(Decline, match="not inside a function"):
        engine.locate(str(path), 1)


def test_unmend_restores_exact_code_objects_for_all_shapes():
    targets = [C.UsesSuper.forward, C.Decorated.forward.__wrapped__, C.Private.forward, C.Static.helper, userpkg.announce]
    before = [f.__code__ for f in targets]
    for model in (C.UsesSuper(), C.Decorated(), C.Private(), C.Static(), C.CallsPackage()):
        graphmend.mend(model, *X)
    assert [f.__code__ for f in targets] != before
    graphmend.unmend()
    assert all(f.__code__ is c for f, c in zip(targets, before))
    assert all(isinstance(c, types.CodeType) for c in before)


def test_compile_falls_back_to_the_original_when_mending_fails(monkeypatch):
    from graphmend.rewrite.session import Session

    model = C.UsesSuper()
    original = C.UsesSuper.forward.__code__

    def broken_retrace(session, flags=()):
        raise RuntimeError("injected failure in discovery")

    monkeypatch.setattr(Session, "retrace", broken_retrace)  # the first retrace follows the first round
    backend = CountingBackend()
    compiled = graphmend.compile(model, backend=backend)
    got = run(compiled, *X)  # mends on this first call, which fails: a warning, then the original
    assert any("could not mend UsesSuper" in message for _, message, _, _ in got.warnings)
    assert compiled.report is None and got.exception is None
    assert C.UsesSuper.forward.__code__ is original  # nothing left half-installed
    assert torch.equal(got.output, run(C.UsesSuper(), *X).output)


def _method_loads_on_a_new_line(code: types.CodeType) -> list[tuple[str, int, int]]:
    """Method loads that start a new line: torch 2.13's line table writer
    counts the line change of an instruction longer than 8 code units twice
    (LOAD_METHOD on 3.11, LOAD_ATTR from 3.12), so Dynamo misplaces every
    later break of a resume function."""
    import dis

    out, previous = [], None
    for ins in dis.get_instructions(code):
        line = ins.positions.lineno if ins.positions else None
        if ins.opname in ("LOAD_METHOD", "LOAD_ATTR") and None not in (line, previous) and line != previous:
            out.append((ins.argval, previous, line))
        previous = line if line is not None else previous
    return out


def test_a_break_after_a_rewrite_is_reported_at_its_own_line():
    import inspect

    import resume_lines

    model = resume_lines.Model()
    source, first = inspect.getsourcelines(resume_lines.Model.forward)
    left = first + next(i for i, text in enumerate(source) if "# LEFT" in text)
    assert _method_loads_on_a_new_line(resume_lines.Model.forward.__code__) == []
    report = graphmend.mend(model, *resume_lines.inputs())
    by_status = {(o.rule, o.status) for o in report.outcomes}
    assert ("where", "applied") in by_status and ("defer", "applied") in by_status
    # The generated `__graphmend_rt__.log`, `torch.where`, ... end on the line they start.
    assert _method_loads_on_a_new_line(resume_lines.Model.forward.__code__) == []
    lines = {(s.line, s.category) for s in report.after.sites}
    assert (left, "DC") in lines, lines
    assert all(first <= line < first + len(source) for line, _ in lines), lines
