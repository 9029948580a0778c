"""graphmend suite --quick: rows side by side with the paper, totals, JSON and chart."""

import json

from graphmend.tools import cli


def test_quick_suite_rows_totals_json_and_chart(tmp_path, capsys):
    out = tmp_path / "build" / "suite.json"  # a folder not made yet: suite makes it (it crashed after the run)
    code = cli.main(["suite", "--quick", "--rows", "demo,biogpt", "--jobs", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    data = json.loads(out.read_text())
    rows = {r["row"]: r for r in data["rows"]}
    assert rows["biogpt"]["breaks_before"] == 2 and rows["biogpt"]["breaks_after"] == 0
    assert rows["biogpt"]["paper_before"] == 2 and rows["biogpt"]["rules"] == ["defer"]
    assert rows["demo"]["breaks_after"] == 0 and rows["demo"]["remaining"] == []
    assert rows["demo"]["kept"] == rows["biogpt"]["kept"] == []  # no assert Dynamo compiles into a graph
    totals = data["totals"]
    assert totals["breaks_eliminated"] == totals["breaks_before"] - totals["breaks_after"] == 8
    assert totals["rows_fully_fixed"] == 2 and totals["rows_failed"] == 0
    assert "totals: breaks 8 -> 0" in text
    png = tmp_path / "build" / "suite.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


def test_unknown_row_is_a_usage_error(capsys):
    assert cli.main(["suite", "--quick", "--rows", "nope"]) == 2
    assert "unknown row(s) nope" in capsys.readouterr().err
