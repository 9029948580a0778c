"""The README as users read it: the error table row by row (the command, its exit
code, its one line), the rules table generated from the registry, its length."""

import os
import shlex
import subprocess
import sys

import pytest

from graphmend.tools import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    block = text.split("<!-- errors:begin -->", 1)[1].split("<!-- errors:end -->", 1)[0]
    rows = []
    for line in block.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        situation, command, code, says = cells
        rows.append((situation, command.strip("`"), int(code), says.strip("`")))
    return rows


ROWS = _rows()


def test_the_table_is_there():
    assert len(ROWS) >= 20


def _simulate(situation, monkeypatch, tmp_path, argv):
    if "transformers is not installed" in situation:
        monkeypatch.setitem(sys.modules, "transformers", None)
    elif "unsupported torch" in situation:
        import torch

        monkeypatch.setattr(torch, "__version__", "2.11.0")
    elif "uncommitted git changes" in situation:
        (tmp_path / "model.py").write_text(MODEL)
        git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
        subprocess.run(git + ["init", "-q"], cwd=tmp_path, check=True)
        subprocess.run(git + ["add", "model.py"], cwd=tmp_path, check=True)
        subprocess.run(git + ["commit", "-qm", "x"], cwd=tmp_path, check=True)
        with open(tmp_path / "model.py", "a") as fh:
            fh.write("# uncommitted\n")
        monkeypatch.chdir(tmp_path)
    return argv


MODEL = """\
import torch


class Net(torch.nn.Module):
    def forward(self, x):
        print("sum", x.sum())
        return x * 2


def build():
    return Net(), (torch.ones(2),), {}
"""


@pytest.mark.parametrize("situation,command,code,says", ROWS, ids=[r[0] for r in ROWS])
def test_error_row(situation, command, code, says, capsys, monkeypatch, tmp_path):
    if "without CUDA" in situation or "--device cuda" in command:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    monkeypatch.chdir(ROOT)
    argv = shlex.split(command)[1:]
    argv = _simulate(situation, monkeypatch, tmp_path, argv)
    try:
        got = cli.main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        got = exc.code
    err = capsys.readouterr().err
    assert got == code, err
    assert says in err, err
    if "--debug" not in argv:
        assert "Traceback" not in err
        if not says.startswith(("usage", "the following")):
            assert [l for l in err.splitlines() if l.startswith("graphmend: error:")] == [
                l for l in err.splitlines() if "error" in l.lower()
            ][:1], err


def _mend_fixture(factory):
    from graphmend.pipeline import mend_target
    from graphmend.models.targets import load_target
    from graphmend.rewrite.verify import quiet

    with quiet():
        target = load_target(os.path.join(ROOT, "tests", "fixtures", f"odd_targets.py:{factory}"))
        report, mending = mend_target(target)
    mending.undo()
    return report


def test_code_without_source_is_declined_with_the_reason():
    report = _mend_fixture("build_generated")
    [site] = report.outcomes
    assert site.status == "declined" and "source of <generated> is not available" in site.reason
    assert report.after.breaks == report.before.breaks == 1


def test_training_mode_with_dropout_is_mended_and_verified_exactly():
    report = _mend_fixture("build_training")
    assert report.verified is True
    assert sorted(o.rule for o in report.applied) == ["defer", "where"]
    assert (report.before.breaks, report.after.breaks) == (2, 0)


def test_the_readmes_rules_table_is_the_registrys():
    """README's rules table is generated from the registry (docs/gen_rules_table.py --write)."""
    sys.path.insert(0, os.path.join(ROOT, "docs"))
    try:
        import gen_rules_table
    finally:
        sys.path.pop(0)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    block = text.split("<!-- rules:begin -->\n", 1)[1].split("<!-- rules:end -->", 1)[0]
    assert block == gen_rules_table.table()
    assert block.count("\n| `") == 7  # where, defer, trap, scalar, speculate, reassign, compiling


def test_the_readme_stays_a_users_page():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        assert sum(1 for _ in fh) <= 300
