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
