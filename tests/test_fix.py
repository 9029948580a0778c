"""graphmend fix: verified rewrites written back, every other byte kept."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import graphmend
from graphmend.tools import cli
from graphmend.tools import fix as F
from graphmend.models.targets import load_target
from graphmend.rewrite.verify import quiet

from effects_capture import CountingBackend, run

HERE = os.path.dirname(__file__)

MODEL = '''\
# -*- coding: utf-8 -*-
"""A user's model — ünïcödé in the docstring."""
import torch
from torch import nn


class Net(nn.Module):  # a comment ✓ that must survive
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)   # odd   spacing   kept
        # a comment line above the print
        print("hidden", h.sum())  # LC: print
        if h.abs().amax() > 2.0:  # DC: branch on a tensor
            h = h / 2.0
        return h


def build():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(2, 4) * 3,), {}


def build_small():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(2, 4) * 1e-3,), {}
'''


def _write(folder, text=MODEL, newline="\n", indent="    "):
    text = text.replace("    ", indent).replace("\n", newline)
    path = folder / "model.py"
    path.write_bytes(text.encode("utf-8"))
    return path


def _fix(path, root):
    with quiet():
        target = load_target(f"{path}:build")
        return F.fix_target(target, root=str(root))


@pytest.mark.parametrize("newline,indent", [("\n", "    "), ("\r\n", "    "), ("\n", "\t")],
                         ids=["lf-spaces", "crlf", "tabs"])
def test_only_rewritten_statements_change(tmp_path, newline, indent):
    path = _write(tmp_path, newline=newline, indent=indent)
    report = _fix(path, tmp_path)
    assert report.mend.verified is True and not report.skipped
    [change] = report.changes
    assert (change.kind, change.display, change.functions) == ("project", "model.py", ["Net.forward"])
    # Exactly the print and the if-block were replaced; every other line is byte for byte.
    old_lines, new_lines = F.split_lines(change.old), F.split_lines(change.new)
    first = next(i for i, l in enumerate(old_lines) if 'print("hidden"' in l)
    head, tail = old_lines[:first], old_lines[first + 3 :]
    imported = "import graphmend.runtime as graphmend_rt" + newline
    assert new_lines[: len(head) + 1] == head[:4] + [imported] + head[4:]
    assert new_lines[len(new_lines) - len(tail) :] == tail
    new = change.new
    for kept in ("# -*- coding: utf-8 -*-", "ünïcödé", "# a comment ✓ that must survive", "# odd   spacing   kept",
                 "# a comment line above the print", "# LC: print", "# DC: branch on a tensor"):
        assert kept in new, kept
    lines = F.split_lines(new)
    assert all(line.endswith(newline) for line in lines)
    assert "import graphmend.runtime as graphmend_rt" + newline in lines
    body = [l for l in lines if "graphmend_rt." in l or "torch.where" in l]
    assert body and all(l.startswith(indent * 2) for l in body)
    compile(new, "model.py", "exec")


def test_write_verifies_and_a_second_run_changes_nothing(tmp_path, capsys):
    path = _write(tmp_path)
    original = path.read_bytes()
    code = cli.main(["fix", f"{path}:build", "--write", "--root", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    written = path.read_bytes()
    assert written != original
    backups = list(tmp_path.glob("model.py.graphmend-backup*"))
    assert [b.read_bytes() for b in backups] == [original]  # outside git: a backup beside it

    # The written file: one graph under graphmend's region, same outputs and prints as the original.
    for factory in ("build", "build_small"):  # both sides of the branch
        with quiet():
            fixed = load_target(f"{path}:{factory}")
        ref_model, ref_args, _ = _load_original(tmp_path, original, factory)
        expected = run(ref_model, *ref_args)
        backend = CountingBackend()
        compiled = graphmend.compile(fixed.model, backend=backend)
        got = run(compiled, *fixed.args)
        assert len(backend.graphs) == 1
        assert torch.equal(got.output, expected.output)
        assert got.stdout == expected.stdout and "hidden" in got.stdout
    capsys.readouterr()

    assert cli.main(["fix", f"{path}:build", "--write", "--root", str(tmp_path)]) == 0
    assert path.read_bytes() == written  # idempotent
    assert "0 file(s) to change" in capsys.readouterr().err


def _load_original(tmp_path, source, factory):
    folder = tmp_path / "orig"
    folder.mkdir(exist_ok=True)
    (folder / "model_orig.py").write_bytes(source)
    with quiet():
        t = load_target(f"{folder / 'model_orig.py'}:{factory}")
    return t.model, t.args, t.kwargs


def test_diff_applies_with_patch_p1(tmp_path, capsys):
    project = tmp_path / "proj"
    project.mkdir()
    path = _write(project, newline="\r\n")
    pristine = path.read_bytes()
    copy = tmp_path / "copy"
    shutil.copytree(project, copy)
    code = cli.main(["fix", f"{path}:build", "--root", str(project)])
    diff = capsys.readouterr().out
    assert code == 1 and diff.startswith("--- a/model.py")
    subprocess.run(["patch", "-p1", "--binary", "-s"], input=diff.encode(), cwd=copy, check=True)
    expected = _fix(path, project).changes[0].new.encode("utf-8")
    assert (copy / "model.py").read_bytes() == expected
    assert path.read_bytes() == pristine  # --diff writes nothing


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_write_refuses_a_dirty_file_unless_forced(tmp_path, capsys):
    path = _write(tmp_path)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "model.py")
    _git(tmp_path, "commit", "-qm", "x")
    path.write_bytes(path.read_bytes() + b"# uncommitted\n")
    before = path.read_bytes()
    assert cli.main(["fix", f"{path}:build", "--write", "--root", str(tmp_path)]) == 2
    assert "uncommitted changes in git" in capsys.readouterr().err
    assert path.read_bytes() == before
    assert cli.main(["fix", f"{path}:build", "--write", "--force", "--root", str(tmp_path)]) == 0
    assert path.read_bytes() != before and b"# uncommitted\n" in path.read_bytes()


def test_clean_file_in_git_is_written_without_backup(tmp_path):
    path = _write(tmp_path)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "model.py")
    _git(tmp_path, "commit", "-qm", "x")
    report = _fix(path, tmp_path)
    F.write_changes(report)
    assert report.written == [str(path)] and report.backups == []


def test_write_is_atomic(tmp_path, monkeypatch):
    path = _write(tmp_path)
    before = path.read_bytes()
    report = _fix(path, tmp_path)

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(F.os, "replace", boom)
    with pytest.raises(OSError):
        F.write_changes(report)
    assert path.read_bytes() == before
    assert not list(tmp_path.glob(".graphmend-*.tmp"))


def test_statements_sharing_a_line_are_not_written(tmp_path):
    text = MODEL.replace('        print("hidden", h.sum())  # LC: print\n',
                         '        print("hidden", h.sum()); n = 1  # LC: print\n')
    path = _write(tmp_path, text=text)
    report = _fix(path, tmp_path)
    assert report.changes == []
    assert any("shares its line" in s for s in report.skipped), report.skipped


def test_installed_package_gets_a_patch_that_applies_and_works(tmp_path, capsys):
    pytest.importorskip("transformers")
    import transformers.models.t5.modeling_t5 as t5

    out = tmp_path / "patches"
    code = cli.main(["fix", "zoo:t5", "--patch-dir", str(out), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["verified"] is True
    [change] = data["changes"]
    assert (change["kind"], change["package"], change["display"]) == (
        "package", "transformers", "transformers/models/t5/modeling_t5.py")
    patch = out / "transformers.patch"
    assert data["patches"] == [str(patch)]
    tree = tmp_path / "tree" / "transformers" / "models" / "t5"
    tree.mkdir(parents=True)
    shutil.copy(t5.__file__, tree / "modeling_t5.py")
    subprocess.run(["patch", "-p1", "-s", "-i", str(patch)], cwd=tmp_path / "tree", check=True)
    with open(t5.__file__, "rb") as fh:
        assert fh.read() != (tree / "modeling_t5.py").read_bytes()  # site-packages untouched, the copy patched
    result = subprocess.run([sys.executable, os.path.join(HERE, "fixtures", "fix_t5_check.py"),
                             str(tree / "modeling_t5.py")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    checked = json.loads(result.stdout.strip().splitlines()[-1])
    assert checked["patched_file"] == str(tree / "modeling_t5.py")
    assert checked["graphs"] == 1
    assert checked["same_logits"] is True
    assert checked["logs_a"] == checked["logs_b"]


def test_classify(tmp_path):
    assert F.classify(str(tmp_path / "a" / "m.py"), str(tmp_path)) == ("project", None, "a/m.py")
    pkg = tmp_path / "site-packages" / "lib" / "sub"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    assert F.classify(str(pkg / "m.py"), str(tmp_path / "elsewhere")) == ("package", "lib", "lib/sub/m.py")
