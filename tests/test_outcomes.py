"""A site's outcome is a kind code matches on (``Status``), not prose; it
prints, compares and serialises as its plain value."""

import json

import graphmend
from graphmend.models import demo
from graphmend.pipeline import Status


def test_every_outcome_is_a_status_and_serialises_as_its_value():
    model, (x,), _ = demo.build()
    report = graphmend.mend(model, x)
    graphmend.unmend(model)
    assert [type(o.status) for o in report.outcomes] == [Status] * 7
    assert {o.status for o in report.outcomes} == {Status.APPLIED}
    sites = json.loads(json.dumps(report.to_dict()))["sites"]
    assert [s["status"] for s in sites] == ["applied"] * 7
    assert all(type(s) is str for s in (report.to_dict()["sites"][0]["status"], f"{Status.OUT_OF_SCOPE}"))
    assert (str(Status.OUT_OF_SCOPE), Status("out of scope"), Status.REVERTED == "reverted") == (
        "out of scope", Status.OUT_OF_SCOPE, True,
    )
