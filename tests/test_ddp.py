"""graphmend.compile through data-parallel wrappers: it mends the wrapped module
(the wrapper's forward only passes the inputs on) and compiles the wrapper."""

import copy
import json
import socket
import warnings

import pytest
import torch
import torch.multiprocessing as mp

import graphmend
from ddp_worker import Net, run


@pytest.fixture(autouse=True)
def _restore():
    yield
    graphmend.unmend()
    torch._dynamo.reset()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["ddp", "fsdp"], ids=["ddp", "fsdp2-mended-before-sharding"])
def test_two_cpu_processes_trap_and_train_bit_identically(tmp_path, which):
    mp.spawn(run, args=(2, str(tmp_path), _free_port(), which), nprocs=2, join=True)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert ["trap", "applied"] in result["outcomes"], result
        assert result["graphs"] == [2, 1], result
        assert result["identical"] is True, result
        assert result["errors"] == [["ValueError", "nan input"]] * 2, result


def test_data_parallel_mends_the_module_it_wraps():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 8)
    compiled = graphmend.compile(torch.nn.DataParallel(copy.deepcopy(model)), backend="eager")
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
        with pytest.raises(ValueError, match="^nan input$"):
            compiled(torch.full((2, 8), float("nan")))
    assert [(o.rule, o.status) for o in compiled.report.outcomes] == [("trap", "applied")]
    assert (compiled.report.before.graphs, compiled.report.after.graphs) == (2, 1)
    graphmend.unmend(compiled)
    assert graphmend.api._ACTIVE == {}


def test_a_sharded_model_is_compiled_unchanged_with_one_warning_saying_why(monkeypatch):
    from graphmend import api

    monkeypatch.setattr(api, "_sharded", lambda model: True)  # FSDP needs a process group: its test is the check
    compiled = graphmend.compile(Net(), backend="eager")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        compiled(torch.randn(2, 8))
        compiled(torch.randn(2, 8))
    said = [str(w.message) for w in caught if "graphmend" in str(w.message)]
    assert len(said) == 1 and "sharded by FSDP" in said[0] and "mend it before sharding" in said[0]
    assert compiled.report is None
