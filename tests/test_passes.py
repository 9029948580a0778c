"""The pipeline's passes run alone on a Session: each reads the session and
changes it, so a pass can be checked without the rest of the pipeline."""

from graphmend import pipeline
from graphmend.models.targets import load_target
from graphmend.passes import never_worse
from graphmend.rewrite.session import Session, Status
from graphmend.rewrite.verify import quiet


def test_the_first_passes_alone_rewrite_the_demo_and_the_checkpoint_takes_it_back():
    target = load_target("demo")
    original = type(target.model).forward.__code__
    session = Session(target, pipeline.DEFAULT_RULES)
    with quiet():
        for step in (pipeline.observe_baseline, pipeline.discover):
            step(session)
        assert (session.before.graphs, session.mending.patches, session.outcomes) == (7, [], {})
        checkpoint = session.checkpoint()
        pipeline.rewrite_rounds(session)
        assert session.current.graphs == 1 and session.rounds == 2  # [Scalar]'s rewrite lets [Where] in, one round later
        assert type(target.model).forward.__code__ is not original
        assert [o.status for o in session.outcomes.values()] == [Status.APPLIED] * 7
        assert session.verified is None and session.capture.flags == ()  # later passes did not run
        checkpoint.restore()
    assert (session.mending.patches, session.outcomes) == ([], {})
    assert type(target.model).forward.__code__ is original


def test_never_worse_alone_keeps_a_program_that_is_no_worse():
    target = load_target("demo")
    session = Session(target, pipeline.DEFAULT_RULES)
    with quiet():
        pipeline.discover(session)
        session.current = session.before
        never_worse.never_worse(session)  # nothing installed, nothing worse: nothing to take back
    assert session.current is session.before and session.outcomes == {}


def test_verify_capture_tries_the_next_candidate_when_the_kept_one_changes_the_program(monkeypatch):
    """Found by the torchvision survey: on the R-CNNs both flags together failed a runtime
    assert eager never meets and were dropped, though one flag alone helped and verified.
    Verification now tries the candidates that helped, best first, and keeps the first
    that verifies; the report is traced again under it."""
    from graphmend.discover.capture import DYNAMIC, SCALAR, Capture
    from graphmend.passes import verification

    session = Session(load_target("demo"), pipeline.DEFAULT_RULES)
    tried = []

    def compared(baseline, compiled=None):
        tried.append(compiled)
        return ([] if compiled == (SCALAR,) else ["output: values differ"]), None

    with quiet():
        pipeline.observe_baseline(session)
        pipeline.discover(session)
        session.plain = session.current = session.before
        session.capture = Capture(flags=(SCALAR, DYNAMIC), notes=["measured"], fallbacks=((DYNAMIC,), (SCALAR,)))
        monkeypatch.setattr(session, "compared", compared)
        verification.verify_capture(session)
        expected_graphs = session.trial((SCALAR,)).graphs
    assert tried == [(SCALAR, DYNAMIC), (DYNAMIC,), (SCALAR,)]
    assert session.capture.flags == (SCALAR,) and session.verified is True
    dropped = "dropped, verification under torch.compile found a difference: output: values differ"
    assert session.capture.notes == [
        "measured",
        f"{SCALAR} + {DYNAMIC}: {dropped}",
        f"{DYNAMIC}: {dropped}",
        f"{SCALAR}: kept instead (it helps too)",
    ]
    assert session.current.graphs == expected_graphs  # traced again under the flag kept: captured ops join a graph
    assert session.current.ops_per_graph != session.before.ops_per_graph
    assert session.plain is session.before


def test_verify_capture_with_no_candidate_left_keeps_no_flag(monkeypatch):
    from graphmend.discover.capture import DYNAMIC, SCALAR, Capture
    from graphmend.passes import verification

    session = Session(load_target("demo"), pipeline.DEFAULT_RULES)
    with quiet():
        pipeline.observe_baseline(session)
        pipeline.discover(session)
        session.plain = session.current = session.before
        session.capture = Capture(flags=(SCALAR, DYNAMIC), notes=["measured"], fallbacks=((SCALAR,),))
        monkeypatch.setattr(session, "compared", lambda baseline, compiled=None: (["output: values differ"], None))
        verification.verify_capture(session)
    assert session.capture.flags == () and session.capture.fallbacks == ()
    assert [n.split(":")[0] for n in session.capture.notes] == ["measured", f"{SCALAR} + {DYNAMIC}", SCALAR]
    assert session.current.graphs == session.before.graphs and session.verified is None


def _warned(*where: tuple[str, int], message: str = "In CPU autocast, but the target dtype is not supported.", output=None):
    from graphmend.rewrite.verify import Observation

    return Observation(output=output, warnings=[("UserWarning", message, path, line) for path, line in where])


def test_a_warning_torch_issues_from_its_own_frame_under_compile_is_the_same_warning():
    """Found by the diffusers survey: Mochi enters autocast with float32 on CPU; eagerly
    torch's warning names the model's line, compiled with capture_dynamic_output_shape_ops
    (11 graphs -> 1) it names torch/amp/autocast_mode.py, and the flag was dropped for it.
    The same warnings in the same order, moved only into torch's own frames, are not a
    difference; anything else still is."""
    import os

    import torch

    from graphmend.rewrite.verify import relocated_by_compile

    model_line = ("/home/user/model.py", 286)
    in_torch = (os.path.join(os.path.dirname(torch.__file__), "amp", "autocast_mode.py"), 397)
    eager = _warned(model_line)
    assert relocated_by_compile(eager, _warned(in_torch))
    assert relocated_by_compile(_warned(model_line, model_line), _warned(model_line, in_torch))
    assert not relocated_by_compile(eager, _warned(("/home/user/other.py", 3)))  # moved to user code: a difference
    assert not relocated_by_compile(eager, _warned())  # lost
    assert not relocated_by_compile(eager, _warned(in_torch, in_torch))  # issued twice
    assert not relocated_by_compile(eager, _warned(in_torch, message="another text"))
    assert not relocated_by_compile(_warned(model_line, output=torch.zeros(2)), _warned(in_torch, output=torch.ones(2)))


def test_verify_capture_keeps_a_flag_whose_only_difference_is_where_torch_warns_from(monkeypatch):
    import os

    import torch

    from graphmend.discover.capture import DYNAMIC, Capture
    from graphmend.passes import verification

    session = Session(load_target("demo"), pipeline.DEFAULT_RULES)
    in_torch = (os.path.join(os.path.dirname(torch.__file__), "amp", "autocast_mode.py"), 397)
    elsewhere = ("/home/user/other.py", 3)
    with quiet():
        pipeline.observe_baseline(session)
        pipeline.discover(session)
        session.plain = session.current = session.before
        session.baseline = _warned(("/home/user/model.py", 286))
        for place, kept in ((elsewhere, ()), (in_torch, (DYNAMIC,))):
            monkeypatch.setattr(session, "compared", lambda baseline, compiled=None, place=place: (["warnings: differ"], _warned(place)))
            session.capture = Capture(flags=(DYNAMIC,), notes=["measured"])
            verification.verify_capture(session)
            assert session.capture.flags == kept
    assert session.capture.notes[-1] == (
        f"{DYNAMIC}: verified; torch's own warnings name a frame inside torch where eager names the model's line "
        "(same warnings, same order)"
    )
    assert session.verified is True
