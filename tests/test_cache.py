"""The mend cache (graphmend/cache.py): a restarted process installs what an
earlier one mended and verified, with the same graphs and outputs; corrupt,
stale and concurrently written entries are handled; nothing is written where
the cache is off."""

import json
import os
import subprocess
import sys

import pytest
import torch

from graphmend import cache
from graphmend.models.targets import target_from_objects

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")

MODEL = '''\
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        print("h max", h.amax())
        if h.sum() > 0:
            h = h * 2
        else:
            h = h - 1
        return torch.relu(h)


def build():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(4, 8),), {}
'''

# One process as a user's: graphmend.compile, one call under no_grad; what it saw, as JSON.
RUN = '''\
import contextlib, hashlib, io, json, sys, time, warnings
import torch, graphmend
from graphmend.models.targets import load_target

target = load_target(sys.argv[1])
graphs = []

if len(sys.argv) > 2:  # a barrier folder: write only once every process of the test has missed and mended
    import os
    from graphmend import cache
    write, folder, parties = cache._write, sys.argv[2], int(sys.argv[3])

    def _write_together(entry):
        open(os.path.join(folder, str(os.getpid())), "w").close()
        deadline = time.monotonic() + 300
        while len(os.listdir(folder)) < parties and time.monotonic() < deadline:
            time.sleep(0.01)
        write(entry)

    cache._write = _write_together

def backend(gm, example_inputs):
    graphs.append(gm)
    return gm.forward

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    compiled = graphmend.compile(target.model, backend=backend)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), torch.no_grad():
        y = compiled(*target.args, **target.kwargs)
print(json.dumps({
    "from_cache": compiled.report.from_cache,
    "graphs": len(graphs),
    "applied": len(compiled.report.applied),
    "output": hashlib.sha256(y.numpy().tobytes()).hexdigest(),
    "stdout": out.getvalue(),
    "warnings": [str(w.message) for w in caught if "graphmend" in str(w.message)],
}))
'''


def _env(folder, **extra):
    env = dict(os.environ, PYTHONPATH=SRC, GRAPHMEND_CACHE_DIR=str(folder), GRAPHMEND_CACHE="1")
    env.update(extra)
    return env


def _start(tmp_path, model_file, *barrier, **extra):
    script = tmp_path / "run.py"
    script.write_text(RUN)
    return subprocess.Popen([sys.executable, str(script), f"{model_file}:build", *map(str, barrier)],
                            env=_env(tmp_path / "cache", **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(tmp_path, model_file, **extra):
    process = _start(tmp_path, model_file, **extra)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _entries(tmp_path):
    folder = tmp_path / "cache" / "mends"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "usermodel.py"
    path.write_text(MODEL)
    return path


def test_a_restarted_process_installs_the_mend_with_the_same_graphs_outputs_and_prints(tmp_path, model_file):
    first = _run(tmp_path, model_file)
    [entry] = _entries(tmp_path)
    second = _run(tmp_path, model_file)
    assert (first["from_cache"], second["from_cache"]) == (False, True)
    assert first["graphs"] == second["graphs"] == 1  # the print deferred, the if a select: one graph each time
    assert first["applied"] == second["applied"] == 2
    assert first["output"] == second["output"]
    assert first["stdout"] == second["stdout"] and first["stdout"].startswith("h max tensor(")
    assert first["warnings"] == second["warnings"] == []
    assert _entries(tmp_path) == [entry]


def test_an_edited_source_makes_the_entry_stale_mended_again_and_replaced(tmp_path, model_file):
    first = _run(tmp_path, model_file)
    model_file.write_text(MODEL.replace("return torch.relu(h)", "return torch.relu(h) + 1"))
    second = _run(tmp_path, model_file)
    assert second["from_cache"] is False and second["output"] != first["output"]  # the edit runs, not the cached rewrite
    [stale] = second["warnings"]
    assert stale.startswith("graphmend: the cached mend of Net is stale (") and "usermodel.py changed since); mending again" in stale
    third = _run(tmp_path, model_file)
    assert third["from_cache"] is True and third["output"] == second["output"] and third["warnings"] == []


def test_a_corrupt_entry_is_ignored_with_one_warning_and_replaced(tmp_path, model_file):
    first = _run(tmp_path, model_file)
    [name] = _entries(tmp_path)
    (tmp_path / "cache" / "mends" / name).write_bytes(b"\x80\x04 not a pickle")
    second = _run(tmp_path, model_file)
    assert second["from_cache"] is False and second["output"] == first["output"]
    [unreadable] = second["warnings"]
    assert unreadable.startswith(f"graphmend: the mend cache entry {tmp_path / 'cache' / 'mends' / name} is unreadable (")
    assert _run(tmp_path, model_file)["from_cache"] is True


def test_two_processes_writing_the_same_entry_at_once_leave_one_whole_entry(tmp_path, model_file):
    # Each writes only once both have missed the cache and mended (a barrier around
    # cache._write), so the two writes meet however the machine schedules them.
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    processes = [_start(tmp_path, model_file, barrier, 2) for _ in range(2)]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["from_cache"] for r in results] == [False, False]
    assert len({r["output"] for r in results}) == 1
    assert len(_entries(tmp_path)) == 1  # no temporary file left behind
    assert _run(tmp_path, model_file)["from_cache"] is True


def test_nothing_is_written_when_the_cache_is_off(tmp_path, model_file):
    for _ in range(2):
        assert _run(tmp_path, model_file, GRAPHMEND_CACHE="0")["from_cache"] is False
    assert not (tmp_path / "cache").exists()


def test_the_cli_lists_and_clears_entries(tmp_path, model_file):
    _run(tmp_path, model_file)
    cli = [sys.executable, "-m", "graphmend", "cache"]
    listed = json.loads(subprocess.run([*cli, "list", "--json"], env=_env(tmp_path / "cache"), capture_output=True,
                                       text=True, check=True).stdout)
    [entry] = listed["entries"]
    assert (entry["target"], entry["graphs"], entry["functions"], entry["readable"]) == ("Net", [3, 1], 1, True)
    cleared = subprocess.run([*cli, "clear"], env=_env(tmp_path / "cache"), capture_output=True, text=True, check=True)
    assert cleared.stdout == f"removed 1 mend cache entry from {tmp_path / 'cache' / 'mends'}\n"
    assert _entries(tmp_path) == []


def test_the_key_follows_the_input_shapes_the_grad_mode_and_the_model_and_refuses_what_it_cannot_describe():
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def key(m=model, args=(x,), grad=False):
        return cache.key_of(target_from_objects(m, args, {}), ("where",), True, grad)

    assert key() == key(args=(torch.randn(2, 4),))  # values do not count, shapes do
    assert len({key(), key(args=(torch.randn(3, 4),)), key(args=(x.double(),)), key(grad=True),
                key(m=torch.nn.Linear(4, 4).train(False)), key(m=torch.nn.Linear(4, 4, bias=False))}) == 6
    assert key(args=(x, object())) is None  # an input the key cannot describe: not cached
