"""`graphmend check`: the static linter's findings, output, exit codes and JSON."""

import importlib.util
import json
import os
import re
import shutil

import pytest

from graphmend.tools import cli
from graphmend.check import CODES, check_paths, parse_select

HERE = os.path.dirname(__file__)
CHECK = os.path.join(HERE, "fixtures", "check")


def fixture(name):
    return os.path.join(CHECK, name)


def run(capsys, *argv):
    code = cli.main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def table(path, select=None):
    report = check_paths([path], select=parse_select(select))
    return [(f.line, f.col, f.code, f.safe) for f in report.findings], report


# -- exact findings per fixture ------------------------------------------------


def test_branches():
    found, report = table(fixture("branches.py"))
    assert found == [
        (11, 9, "GM101", True),  # if x.isinf().any(): x = torch.zeros_like(x)
        (13, 9, "GM101", True),  # mask is not None and mask.sum() > 0 (static conjunct kept)
        (15, 9, "GM101", False),  # torch.equal
        (17, 9, "GM102", False),  # while
        (19, 13, "GM103", False),  # conditional expression
        (20, 9, "GM101", False),  # w assigned on one path only
        (39, 5, "GM101", True),  # h proven by h.masked_fill, h reassigned from itself
        (55, 21, "GM103", False),  # after "ü": columns count characters
    ]
    by_line = {f.line: f for f in report.findings}
    assert "`w`" in by_line[20].why and "one path" in by_line[20].why
    assert by_line[17].why and "while" in by_line[17].why
    assert by_line[19].why == "[Where] rewrites `if` statements; a conditional expression is left as it is"
    assert by_line[11].why is None and by_line[11].function == "Block.forward"
    assert by_line[39].function == "scale"


def test_effects_only_in_forward_and_its_helpers():
    found, report = table(fixture("effects.py"))
    assert found == [
        (13, 5, "GM202", True),  # logger.info in report(), called by Net.forward
        (28, 9, "GM201", True),  # print in Net.forward
        (34, 9, "GM203", True),  # warnings.warn in Net._check (self._check from forward)
        (35, 9, "GM202", True),  # logger.warning_once
        (40, 9, "GM201", False),  # x.mul_ after the print
        (47, 9, "GM203", False),  # stacklevel=2
        (48, 13, "GM202", False),  # the call's value is used
        (59, 5, "GM101", True),  # a tensor branch in a plain function: an early return
    ]
    by_line = {f.line: f for f in report.findings}
    assert by_line[40].why == "`x` is changed in place after the call (`.mul_(...)`, line 41)"
    assert "stacklevel" in by_line[47].why
    assert "value is used" in by_line[48].why
    assert {f.rule for f in report.findings if f.code.startswith("GM2")} == {"defer"}


def test_guards():
    found, report = table(fixture("guards.py"))
    assert found == [
        (14, 9, "GM301", False),  # self.proj runs after the check
        (17, 9, "GM302", False),  # self.calls += 1 after the assert
        (19, 9, "GM303", True),
        (24, 5, "GM301", True),
    ]
    by_line = {f.line: f for f in report.findings}
    assert "self.proj" in by_line[14].why
    assert "self.calls" in by_line[17].why
    assert {f.rule for f in report.findings} == {"trap"}


def test_scalar_codes_only_when_selected_and_never_safe():
    assert table(fixture("scalars.py"))[0] == []
    found, report = table(fixture("scalars.py"), "GM4")
    assert found == [
        (7, 13, "GM401", False),  # x.sum().item()
        (8, 14, "GM401", False),  # x.tolist()
        (9, 13, "GM402", False),  # x.nonzero()
        (10, 11, "GM402", False),  # torch.nonzero(x)
        (11, 14, "GM402", False),  # x[x > 0]
    ]
    assert {f.rule for f in report.findings} == {"scalar"}
    assert all(f.why.startswith("[Scalar] decides on the live model") for f in report.findings)
    assert "capture_dynamic_output_shape_ops" in report.findings[-1].why
    assert all(line.endswith("]") and " [scalar, needs a run: [Scalar] decides" in line for line in report.lines())


def test_fixture_comments_agree_with_findings():
    """Every `# GM###` comment marks a finding of that code on its line, and
    every `# not a site` line has none."""
    for name in ("branches.py", "effects.py", "guards.py", "scalars.py"):
        report = check_paths([fixture(name)], select=parse_select("ALL"))
        codes = {(f.line, f.code) for f in report.findings}
        lines = {f.line for f in report.findings}
        with open(fixture(name), encoding="utf-8") as fh:
            for number, text in enumerate(fh, 1):
                comment = text.partition("#")[2]
                marked = re.match(r"\s*(GM\d{3})", comment)
                if marked:
                    assert (number, marked.group(1)) in codes, f"{name}:{number}"
                elif "not a site" in comment or "not GM" in comment:
                    assert number not in lines, f"{name}:{number}"


# -- transformers -----------------------------------------------------------------


def _t5_path():
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        pytest.skip("transformers is not installed")
    path = os.path.join(os.path.dirname(spec.origin), "models", "t5", "modeling_t5.py")
    if not os.path.exists(path):
        pytest.skip("no modeling_t5.py")
    return path


def test_t5_warning_once_in_forward():
    """The break `graphmend explain zoo:t5` reports (T5Stack.forward, line 1019)
    and the other logger / warnings calls that forward runs; not the
    warning_once in T5Attention.__init__ (line 367)."""
    report = check_paths([_t5_path()])
    found = [(f.line, f.code, f.function, f.safe) for f in report.findings if f.code.startswith("GM2")]
    assert found == [
        (994, "GM202", "T5Stack.forward", True),
        (1019, "GM202", "T5Stack.forward", True),
        (1510, "GM203", "T5Model.forward", True),
        (1768, "GM203", "T5ForConditionalGeneration.forward", True),
        (2397, "GM203", "T5ForQuestionAnswering.forward", True),
    ]
    assert all(f.line != 367 for f in report.findings)


# -- the command line ---------------------------------------------------------------


def test_text_output_and_summary(capsys):
    code, out, err = run(capsys, fixture("guards.py"))
    assert code == 1
    lines = out.splitlines()
    assert len(lines) == 4
    assert lines[2] == (
        f"{fixture('guards.py')}:19:9: GM303 `torch._assert` on a tensor value: `x.sum() != 0` [trap, safe]"
    )
    assert lines[0].startswith(f"{fixture('guards.py')}:14:9: GM301 `raise ValueError` guarded by a tensor value:")
    assert "[trap, needs a run: " in lines[0]
    assert err.strip() == "4 sites in 1 file (2 safe), 1 file checked"


def test_exit_0_when_clean(capsys):
    code, out, err = run(capsys, fixture("pkg/clean.py"))
    assert code == 0 and out == ""
    assert err.strip() == "0 sites in 0 files (0 safe), 1 file checked"


def test_json_schema(capsys):
    code, out, _ = run(capsys, CHECK, "--json", "--select", "ALL")
    assert code == 1
    data = json.loads(out)
    assert data["schema"] == 1
    assert data["files_checked"] == 6
    assert data["unparsed"] == 1
    assert data["sites"] == len(data["findings"]) - 1
    assert data["safe"] == sum(f["safe"] for f in data["findings"])
    assert data["counts"]["GM000"] == 1 and data["counts"]["GM402"] == 3
    keys = {"path", "line", "col", "code", "rule", "message", "function", "safe", "why"}
    for f in data["findings"]:
        assert set(f) == keys
        assert f["code"] in CODES and f["rule"] == CODES[f["code"]][0]
        assert (f["why"] is None) == (f["safe"] or f["code"] == "GM000")
    order = [(f["path"], f["line"], f["col"]) for f in data["findings"]]
    assert order == sorted(order)


def test_select(capsys):
    code, out, _ = run(capsys, CHECK, "--select", "GM101,GM3", "--json")
    codes = {f["code"] for f in json.loads(out)["findings"]}
    assert codes == {"GM000", "GM101", "GM301", "GM302", "GM303"}  # a syntax error is always reported
    assert code == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["no/such/dir"], "graphmend: error: no such file or directory: no/such/dir"),
        ([CHECK, "--select", "GM9"], "graphmend: error: --select: unknown code(s) GM9; codes are GM000, GM101"),
    ],
)
def test_usage_errors_are_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(message)


def test_syntax_error_is_one_finding_and_the_run_goes_on(capsys):
    code, out, err = run(capsys, os.path.join(CHECK, "pkg"))
    assert code == 1
    assert out.splitlines() == [f"{os.path.join(CHECK, 'pkg', 'broken.py')}:1:12: GM000 syntax error: invalid syntax (file skipped)"]
    assert err.strip() == "0 sites in 0 files (0 safe), 2 files checked, 1 not parsed"


def test_folder_walk_skips_hidden_and_pycache(tmp_path, capsys):
    for name in ("guards.py", "effects.py"):
        shutil.copy(fixture(name), tmp_path / name)
    for skipped in (".hidden", "__pycache__"):
        (tmp_path / skipped).mkdir()
        shutil.copy(fixture("guards.py"), tmp_path / skipped / "guards.py")
    (tmp_path / "sub").mkdir()
    shutil.copy(fixture("branches.py"), tmp_path / "sub" / "b.py")
    (tmp_path / "notes.txt").write_text("if x.any(): print(x)\n")
    report = check_paths([str(tmp_path)])
    assert report.files_checked == 3
    assert [os.path.relpath(p, tmp_path) for p in dict.fromkeys(f.path for f in report.findings)] == [
        "effects.py",
        "guards.py",
        os.path.join("sub", "b.py"),
    ]
    assert len(report.findings) == 8 + 4 + 8


def test_a_file_named_twice_is_checked_once():
    report = check_paths([CHECK, fixture("guards.py")])
    assert report.files_checked == 6
    assert [f.line for f in report.findings if f.path.endswith("guards.py")] == [14, 17, 19, 24]


def test_live_globals_and_classes_narrow_what_mend_asks_for():
    """``graphmend mend`` passes the file's live globals (``nn = th.nn`` is unknown to the
    source alone) and the model's classes (only their ``forward`` runs)."""
    import sys

    from graphmend.check.find import find_in_source

    path = os.path.join(os.path.dirname(__file__), "fixtures", "fuzz_warning_line_callee.py")
    source = open(path, "rb").read()
    assert not [f for f in find_in_source(path, source, opt_in=False) if f.rule == "defer"]
    spec = importlib.util.spec_from_file_location("fuzz_warning_line_callee_live", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        live = find_in_source(path, source, opt_in=False, namespace=vars(module))
        only = find_in_source(path, source, opt_in=False, namespace=vars(module), classes={"Block4"})
    finally:
        del sys.modules[spec.name]
    assert {(f.line, f.function) for f in live if f.code == "GM203"} == {(62, "Block4.forward")}
    assert {f.function for f in live if f.rule == "defer"} == {"Block1.forward", "Block4.forward", "Model.forward"}
    assert [(f.line, f.code) for f in only if f.rule == "defer"] == [(62, "GM203")]
