"""The CLI contract: exit codes, JSON on stdout, one-line errors for bad input."""

import json
import os
import subprocess
import sys

import pytest

from graphmend.tools import cli

HERE = os.path.dirname(__file__)
PATTERNS = os.path.join(HERE, "fixtures", "patterns.py")


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_json_exit_1_when_breaks(capsys):
    code, out, err = run(capsys, "explain", f"{PATTERNS}:build_branch", "--json")
    assert code == 1
    data = json.loads(out)
    assert data["graphs"] == 2 and data["breaks"] == 1
    assert [s["category"] for s in data["sites"]] == ["DC"]
    assert data["sites"][0]["rule"] == "where"


def test_explain_exit_0_when_clean(capsys):
    code, out, _ = run(capsys, "explain", f"{PATTERNS}:build_clean", "--json")
    assert code == 0
    assert json.loads(out)["sites"] == []


def test_explain_table_output_has_summary(capsys):
    code, out, _ = run(capsys, "explain", f"{PATTERNS}:build_function")
    assert code == 1
    assert "plain_function" in out and "2 graphs, 1 break at 1 site" in out


@pytest.mark.parametrize("command, exit_code", [("explain", 1), ("mend", 0)])
def test_tables_show_code_with_brackets_as_written(capsys, command, exit_code):
    code, out, _ = run(capsys, command, os.path.join(HERE, "fixtures", "brackets.py") + ":build_subscript_branch")
    assert code == exit_code, out
    assert "if y[mask].sum() > 1:" in out  # not read as a rich style tag: `if y.sum() > 1:`


def test_demo_json_is_clean_despite_model_prints(capsys):
    code, out, err = run(capsys, "explain", "demo", "--json")
    assert code == 1
    data = json.loads(out)  # the model's print went to stderr, not into the JSON
    assert "demo: hidden mean" in err
    assert set(data["categories"]) == {"DC", "LC", "VG", "TI"}


def test_module_factory_spelling(capsys, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(HERE, "fixtures"))
    code, out, _ = run(capsys, "explain", "patterns:build_branch", "--json")
    assert code == 1 and json.loads(out)["breaks"] == 1


BAD = [
    ("no_such_file.py:build", "no such file: no_such_file.py"),
    (f"{HERE}/fixtures/syntax_error.py:build", "syntax error"),
    (f"{PATTERNS}:missing_factory", "has no attribute 'missing_factory'"),
    (f"{PATTERNS}:build_raises", "the factory raised RuntimeError: no weights here"),
    (f"{PATTERNS}:build_broken", "the model fails in eager mode: RuntimeError"),
    (f"{PATTERNS}:build_not_a_model", "must be an nn.Module or a plain function, got int"),
    (f"{PATTERNS}:build_wrong_arity", "must return (model, args) or (model, args, kwargs)"),
    (f"{PATTERNS}:build_bad_shape", "the model fails in eager mode: TypeError"),
    ("no_such_pkg_xyz.mod:build", "no module named 'no_such_pkg_xyz.mod'"),
    ("zoo:nope", "unknown zoo row"),
    ("just-a-word", "is not 'file.py:factory'"),
]


@pytest.mark.parametrize("target,message", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_input_is_one_line_and_exit_2(capsys, target, message):
    code, out, err = run(capsys, "explain", target)
    assert code == 2
    lines = [l for l in err.splitlines() if l.startswith("graphmend: error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_zoo_without_transformers_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    code, _, err = run(capsys, "explain", "zoo:t5")
    assert code == 2
    assert "needs transformers==4.52.4" in err and "Traceback" not in err


def test_unsupported_torch_is_a_clear_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "2.11.0")
    code, _, err = run(capsys, "explain", "demo")
    assert code == 2 and "supports torch 2.12 to 2.15, found torch 2.11.0" in err


def test_debug_flag_shows_traceback(capsys):
    code, _, err = run(capsys, "--debug", "explain", "no_such_file.py:build")
    assert code == 2 and "Traceback" in err


def test_usage_error_exit_2():
    proc = subprocess.run([sys.executable, "-m", "graphmend", "explain"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_console_script_in_subprocess_has_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "graphmend", "explain", "missing.py:f"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "graphmend: error: no such file: missing.py"


def test_zoo_listing(capsys):
    code, out, _ = run(capsys, "zoo", "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    for name in ("t5", "whisper", "bart", "bart-fp16", "marian", "marian-fp16", "biogpt", "blenderbot",
                 "pegasus-causal", "layoutlmv3", "phi3-longrope", "longformer", "grounding-dino", "clap"):
        assert name in rows
    assert "t5-small" in rows["t5"]["paper_models"]


def test_mend_demo_json(capsys):
    import graphmend

    code, out, err = run(capsys, "mend", "demo", "--json")
    graphmend.unmend()
    data = json.loads(out)
    status = {s["category"]: s["status"] for s in data["sites"] if s["category"] in ("DC", "TI")}
    assert status == {"DC": "applied", "TI": "applied"}
    assert all(s["status"] == "applied" for s in data["sites"] if s["category"] == "LC")
    assert data["verified"] is True and data["graphs_after"] < data["graphs_before"]
    # The demo's loop frame, which Dynamo ran eagerly, compiles once mended; more of it is captured.
    assert (data["fallbacks_to_eager_before"], data["fallbacks_to_eager_after"]) == (1, 0)
    assert data["calls_captured_after"] > data["calls_captured_before"] > 0
    assert code == 0  # no break remains ([Scalar] turns the TI count into a test [Where] predicates)


def test_mend_unknown_rule_is_a_usage_error(capsys):
    code, _, err = run(capsys, "mend", "demo", "--rules", "where,bogus")
    assert code == 2 and "unknown rule(s) bogus" in err


def test_rules_listing(capsys):
    code, out, _ = run(capsys, "rules")
    assert code == 0 and "defer" in out and "where" in out
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert "(TI, after scalar)" in lines["speculate"] and " DC " in lines["where"]  # no empty category column
