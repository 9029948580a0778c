"""graphmend fix: verified rewrites written back, every other byte kept."""

import ast
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
    imported = "from graphmend import runtime as gm" + newline
    assert new_lines[: len(head) + 1] == head[:4] + [imported] + head[4:]
    assert new_lines[len(new_lines) - len(tail) :] == tail
    new = change.new
    for kept in ("# -*- coding: utf-8 -*-", "ünïcödé", "# a comment ✓ that must survive", "# odd   spacing   kept",
                 "# a comment line above the print", "# LC: print", "# DC: branch on a tensor"):
        assert kept in new, kept
    lines = F.split_lines(new)
    assert all(line.endswith(newline) for line in lines)
    assert imported in lines
    body = [l for l in lines if "gm." in l or "torch.where" in l]
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


# -- what is written reads as a person's fix, and runs alone -------------------

SMALL = '''\
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        logger.warning("h norm %s", h.norm())
        if h.sum() > 0:
            h = h * 2
        else:
            h = h - 1
        return h.relu()


def build():
    torch.manual_seed(0)
    return Block().eval(), (torch.randn(4, 8),), {}
'''

# Loads FILE as the module NAME in a fresh process, calls build()'s model once
# under no_grad (compiled with a counting backend inside graphmend's region, or
# eagerly), and saves the output, the graphs and the model's log records.
ALONE = r'''
import importlib.util, json, logging, sys
import torch
path, name, mode, out = sys.argv[1:]
spec = importlib.util.spec_from_file_location(name, path)
module = importlib.util.module_from_spec(spec)
sys.modules[name] = module
spec.loader.exec_module(module)
records = []
class Keep(logging.Handler):
    def emit(self, r):
        records.append([r.name, r.levelname, r.pathname, r.lineno, r.funcName, r.getMessage()])
logging.getLogger(name).addHandler(Keep())
model, args, _ = module.build()
graphs = []
def counting(gm, example_inputs):
    graphs.append(gm)
    return gm.forward
with torch.no_grad():
    if mode == "compiled":
        from graphmend import runtime
        with runtime.region():
            output = torch.compile(model, backend=counting)(*args)
    else:
        output = model(*args)
torch.save({"output": output, "graphs": len(graphs), "records": records}, out)
'''


def _alone(tmp_path, text, mode):
    folder = tmp_path / f"alone-{mode}"
    folder.mkdir()
    (folder / "usermodel.py").write_text(text)
    out = folder / "out.pt"
    subprocess.run([sys.executable, "-c", ALONE, str(folder / "usermodel.py"), "usermodel", mode, str(out)],
                   check=True, timeout=600, capture_output=True)
    return torch.load(out)


def test_a_fix_is_what_a_person_writes_and_runs_alone_in_a_fresh_process(tmp_path, capsys):
    path = tmp_path / "usermodel.py"
    path.write_text(SMALL)
    assert cli.main(["fix", f"{path}:build", "--write", "--root", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "ran alone in a fresh process: 1 graph(s), as the original eagerly" in err
    assert "usermodel.py:17 [where] plain torch.where: the test is a 0-dim bool tensor" in err
    written = path.read_text()
    assert len(written.splitlines()) - len(SMALL.splitlines()) == -2  # +1 import, the if's 4 lines become 1
    assert written == SMALL.replace(
        "from torch import nn\n", "from torch import nn\nfrom graphmend import runtime as gm\n"
    ).replace(
        '        logger.warning("h norm %s", h.norm())\n',
        '        gm.log((__name__, 17, "forward"), logger, "warning", ("h norm %s", h.norm()), {})\n',
    ).replace(
        "        if h.sum() > 0:\n            h = h * 2\n        else:\n            h = h - 1\n",
        "        h = torch.where(h.sum() > 0, h * 2, h - 1)\n",
    )
    fixed, original = _alone(tmp_path, written, "compiled"), _alone(tmp_path, SMALL, "eager")
    assert (fixed["graphs"], original["graphs"]) == (1, 0)
    assert torch.equal(fixed["output"], original["output"])
    [[name, level, pathname, line, function, message]] = fixed["records"]
    [[o_name, o_level, _, o_line, o_function, o_message]] = original["records"]
    assert (name, level, function, message) == (o_name, o_level, o_function, o_message) == (
        "usermodel", "WARNING", "forward", o_message)
    assert message.startswith("h norm tensor(")
    assert (pathname.endswith("alone-compiled/usermodel.py"), line, o_line) == (True, 17, 16)  # the call's own line


def test_a_file_that_uses_the_name_gm_gets_the_long_alias(tmp_path):
    text = SMALL.replace("import logging\n", "import logging\n\ngm = None  # the user's own gm\n")
    path = tmp_path / "usermodel.py"
    path.write_text(text)
    with quiet():
        report = F.fix_target(load_target(f"{path}:build"), root=str(tmp_path))
    [change] = report.changes
    assert "from graphmend import runtime as graphmend_rt\n" in change.new
    assert 'graphmend_rt.log((__name__, 19, "forward"), logger, "warning", ("h norm %s", h.norm()), {})' in change.new
    assert "gm = None  # the user's own gm\n" in change.new


def test_plain_torch_that_does_not_run_alone_falls_back_to_the_guarded_form(tmp_path, monkeypatch):
    import graphmend.tools.plain as plain

    real = plain.plain_selects

    def swapped(fdef, namespace, model):  # a wrong proof: the branches' values swapped
        node, notes = real(fdef, namespace, model)
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and ast.unparse(call.func) == "torch.where":
                call.args[1], call.args[2] = call.args[2], call.args[1]
        return node, notes

    monkeypatch.setattr(F, "plain_selects", swapped)
    path = tmp_path / "usermodel.py"
    path.write_text(SMALL)
    with quiet():
        report = F.fix_target(load_target(f"{path}:build"), root=str(tmp_path))
    assert report.notes[0].startswith("plain torch did not run alone as the original: output: values differ")
    [change] = report.changes
    assert "torch.where(" not in change.new and "gm.predicable_with_grad(cond)" in change.new
    assert report.alone == "ran alone in a fresh process: 1 graph(s), as the original eagerly"


LAYOUT = '''\
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


class Net(nn.Module):
    def forward(self, h: torch.Tensor):
        logger.warning(
            "a message in "
            'two parts: %s',  h.amax())
        if h.abs().amax() > 1e4:
            h = h / (  2.0 )   # odd spacing kept
        return h


def build():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(4, 8) * 3e4,), {}
'''


def test_written_statements_keep_the_users_text_where_the_code_is_theirs(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(LAYOUT)
    with quiet():
        report = F.fix_target(load_target(f"{path}:build"), root=str(tmp_path))
    [change] = report.changes
    # The message's two parts and quotes, 1e4, and the fallback branch with its spacing and
    # comment stay as written; new code is unparsed in the file's quote.
    assert change.new == LAYOUT.replace("from torch import nn\n", "from torch import nn\nfrom graphmend import runtime as gm\n").replace(
        """\
        logger.warning(
            "a message in "
            'two parts: %s',  h.amax())
        if h.abs().amax() > 1e4:
""", """\
        gm.log(
            (__name__, 12, "forward"),
            logger,
            "warning",
            (
                "a message in "
                'two parts: %s',
                h.amax(),
            ),
            {},
        )
        cond = h.abs().amax() > 1e4
        if gm.predicable_with_grad(cond):
            h_then = h / 2.0
            if gm.same_meta(h_then, h):
                h = gm.select(cond, h_then, h)
            elif cond:
                h = h_then
        elif cond:
""")
    assert report.alone == "ran alone in a fresh process: 1 graph(s), as the original eagerly"
    [form] = change.forms
    assert (form.line, form.plain) == (14, False)


def test_temporaries_get_names_a_person_would_pick_and_free_in_the_file():
    from graphmend.tools.spelling import readable_temporaries

    node = ast.parse(
        "def f(h, cond):\n"
        "    _gm_c0 = h.sum() > 0\n"
        "    _gm_c1 = h.sum() < -1\n"
        "    _gm_t0 = h * 2\n"
        "    _gm_e0 = h - 1\n"
        "    _gm_f0 = h + 1\n"
        "    h = gm.select(_gm_c0, _gm_t0, gm.select(_gm_c1, _gm_e0, _gm_f0))\n"
        "    _gm_ok0 = gm.nonempty(h)\n"
        "    _gm_hit0 = h.nonzero()\n"
        "    _gm_t1 = h.amax()\n"
        "    return _gm_t1, _gm_ok0, _gm_hit0\n"
    )
    got = ast.unparse(readable_temporaries(node, {"h_then", "hit"}))
    assert got == (
        "def f(h, cond):\n"
        "    cond_2 = h.sum() > 0\n"  # `cond` is the function's parameter
        "    cond_3 = h.sum() < -1\n"
        "    h_then_2 = h * 2\n"  # `h_then` is taken elsewhere in the file
        "    h_elif = h - 1\n"
        "    h_else = h + 1\n"
        "    h = gm.select(cond_2, h_then_2, gm.select(cond_3, h_elif, h_else))\n"
        "    guards_hold = gm.nonempty(h)\n"
        "    hit_2 = h.nonzero()\n"
        "    value_then = h.amax()\n"  # assigned to no name of the user's
        "    return (value_then, guards_hold, hit_2)"
    )


def test_every_rules_rewrite_runs_alone_in_a_fresh_process():
    # One model with a block per rule ([Where] plain and guarded, [Defer], [Trap], [Scalar],
    # [Speculate]); fix loads the written file fresh, compiles it with plain torch.compile in
    # graphmend's region (a speculating call for [Speculate]) and compares with the original.
    with quiet():
        report = F.fix_target(load_target(os.path.join(HERE, "fixtures", "fix_rules.py:build")), root=HERE)
    assert (report.mend.before.breaks, report.mend.after.breaks, report.mend.verified) == (13, 0, True)
    assert report.alone == "ran alone in a fresh process: 1 graph(s), as the original eagerly"
    assert report.notes == [] and report.skipped == []
    [change] = report.changes
    new = change.new
    for written in ("h = torch.where(h.sum() > 0, h * 2, h - 1)", "gm.predicable_with_grad(cond)",
                    'gm.print_((__name__, 46, "forward"), ("mean", h.mean()), {})',
                    'gm.log((__name__, 47, "forward"), logger, "warning", ("max %s", h.amax()), {})',
                    'gm.warn((__name__, 48, "forward"), ("applied",), {})',
                    'gm.trap((__name__, 60, "forward"), cond, ValueError, ("inputs must stay within 1e4",))',
                    'gm.trap((__name__, 67, "forward"), cond_2, AssertionError, ("a NaN in h",))',
                    "cond = gm.item_of(h.sum(), 0) > 0", "h_then = h * 2",
                    'wide = gm.speculate((__name__, 98, "forward"), (x > 2).any())'):
        assert written in new, written
    assert "graphmend_target_" not in new and "__graphmend_rt__" not in new and "_gm_" not in new
    assert [(f.line, f.plain) for f in change.forms] == [(20, True), (29, False), (67, False)]
    assert change.forms[2].why == (
        "guarded: `item_of(h.sum(), 0) > 0` is not proven a 0-dim bool tensor (a whole reduction compared with a number)")


def _chain_source() -> str:
    """The fixture model `branches.ChainCallingModules` as a file of its own, with `build()`."""
    import inspect

    import branches

    return (
        "import torch\nfrom torch import nn\n\n\n" + inspect.getsource(branches.ChainCallingModules)
        + "\n\ndef build():\n    torch.manual_seed(0)\n    return ChainCallingModules().eval(), (torch.ones(2, 4),)\n"
    )


def test_a_torch_cond_form_is_written_with_its_branch_functions_and_runs_alone(tmp_path):
    """The torch.cond form's branch functions are named as their calls name them: the
    written `def` kept the temporary name (`_gm_true_branch0`) while its call read
    `true_branch`, so the written code failed alone (NameError) and nothing was written."""
    path = tmp_path / "chain.py"
    path.write_text(_chain_source())
    with quiet():
        report = F.fix_target(load_target(f"{path}:build"), root=str(tmp_path))
    assert report.alone == "ran alone in a fresh process: 1 graph(s), as the original eagerly"
    [change] = report.changes
    for written in ("def true_branch():", "def elif_branch():", "def false_branch():",
                    "return torch.cond(cond_2, elif_branch, false_branch, ())",
                    "h, = torch.cond(cond, true_branch, rest, ())"):
        assert written in change.new, written


def test_portable_keeps_only_what_needs_nothing_but_torch_and_lists_the_rest(tmp_path, capsys):
    path = tmp_path / "usermodel.py"
    path.write_text(SMALL)
    assert cli.main(["fix", f"{path}:build", "--write", "--portable", "--root", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert ("ran alone in a fresh process: 2 graph(s), as the original eagerly "
            "(torch only; the original compiles 3, the whole fix 1)") in err
    assert "usermodel.py:16: needs graphmend's runtime (gm.log): left out (--portable)" in err
    written = path.read_text()
    assert written == SMALL.replace(
        "        if h.sum() > 0:\n            h = h * 2\n        else:\n            h = h - 1\n",
        "        h = torch.where(h.sum() > 0, h * 2, h - 1)\n",
    )
    assert "graphmend" not in written
    fixed, original = _alone(tmp_path, written, "compiled"), _alone(tmp_path, SMALL, "eager")
    assert fixed["graphs"] == 2 and torch.equal(fixed["output"], original["output"])
    assert [r[5] for r in fixed["records"]] == [r[5] for r in original["records"]]


def test_portable_with_nothing_torch_alone_can_do_writes_nothing(tmp_path):
    text = SMALL.replace("        if h.sum() > 0:\n            h = h * 2\n        else:\n            h = h - 1\n", "")
    path = tmp_path / "usermodel.py"
    path.write_text(text)
    with quiet():
        report = F.fix_target(load_target(f"{path}:build"), root=str(tmp_path), portable=True)
    assert report.changes == [] and report.alone == ""
    assert report.skipped == [f"{path}: every rewrite here needs graphmend's runtime (line 16: gm.log)"]


def test_portable_bart_fp16_patch_is_the_one_in_the_readme(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "patches"
    assert cli.main(["fix", "zoo:bart-fp16", "--portable", "--patch-dir", str(out)]) == 0
    err = capsys.readouterr().err
    assert "ran alone in a fresh process: 4 graph(s), as the original eagerly (torch only; the original compiles 8, the whole fix 1)" in err
    patch = (out / "transformers.patch").read_text()
    assert "graphmend" not in patch
    with open(os.path.join(os.path.dirname(HERE), "docs", "cli.md"), encoding="utf-8") as fh:
        doc = fh.read()
    shown = doc.split("```diff\n", 1)[1].split("```", 1)[0]
    assert shown in patch  # docs/cli.md's diff, line for line (context included)
    assert patch.count("\n@@ ") + patch.startswith("@@") == 1  # the one select: one hunk
    import transformers.models.bart.modeling_bart as bart

    tree = tmp_path / "tree" / "transformers" / "models" / "bart"
    tree.mkdir(parents=True)
    shutil.copy(bart.__file__, tree / "modeling_bart.py")
    subprocess.run(["patch", "-p1", "-s", "-i", str(out / "transformers.patch")], cwd=tmp_path / "tree", check=True)
    patched = (tree / "modeling_bart.py").read_text()
    assert "torch.logical_or(torch.isinf(hidden_states).any(), torch.isnan(hidden_states).any())," in patched


CACHED = '''import torch
from torch import nn


class Parts:
    def __init__(self):
        self.items = []

    def update(self, h):
        self.items.append(h)
        return h


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h, cache=None):
        if cache is not None:
            h = cache.update(h)
        return self.lin(h)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x, cache=None):
        """Checks, then fills the cache."""
        if cache is None:
            cache = Parts()
        assert x.abs().max().item() < 100
        for block in self.blocks:
            x = block(x, cache=cache)
        return x


def build():
    torch.manual_seed(0)
    return Model(), (torch.randn(2, 4),)
'''


def test_a_check_trapped_where_a_parameter_was_none_is_written_with_its_entry_test(tmp_path):
    """[Trap]'s test of a parameter at entry (`cache_was_none = cache is None`) goes
    after the docstring, and the written file runs alone as the original does."""
    path = tmp_path / "cached.py"
    path.write_text(CACHED)
    with quiet():
        report = F.fix_target(load_target(f"{path}:build"), root=str(tmp_path))
    assert (report.mend.before.breaks, report.mend.after.breaks, report.mend.verified) == (1, 0, True)
    assert report.alone == "ran alone in a fresh process: 1 graph(s), as the original eagerly"
    [change] = report.changes
    assert '        """Checks, then fills the cache."""\n        cache_was_none = cache is None\n' in change.new
    assert "            if cache_was_none and gm.trappable(cond):\n" in change.new
    assert "                assert gm.held(x.abs().max().item() < 100)\n" in change.new  # as written (runtime.held)
