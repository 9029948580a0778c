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

    def differences_from(baseline, compiled=None):
        tried.append(compiled)
        return [] if compiled == (SCALAR,) else ["output: values differ"]

    with quiet():
        pipeline.observe_baseline(session)
        pipeline.discover(session)
        session.plain = session.current = session.before
        session.capture = Capture(flags=(SCALAR, DYNAMIC), notes=["measured"], fallbacks=((DYNAMIC,), (SCALAR,)))
        monkeypatch.setattr(session, "differences_from", differences_from)
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
        monkeypatch.setattr(session, "differences_from", lambda baseline, compiled=None: ["output: values differ"])
        verification.verify_capture(session)
    assert session.capture.flags == () and session.capture.fallbacks == ()
    assert [n.split(":")[0] for n in session.capture.notes] == ["measured", f"{SCALAR} + {DYNAMIC}", SCALAR]
    assert session.current.graphs == session.before.graphs and session.verified is None
