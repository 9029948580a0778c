"""The zoo: the offline rows of the paper's Table 2 as seeded builders."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo

import graphmend
from graphmend.models import zoo
from graphmend.errors import TargetError

TABLE_2_ORDER = [
    "t5",
    "whisper",
    "bart",
    "bart-fp16",
    "marian",
    "marian-fp16",
    "biogpt",
    "blenderbot",
    "pegasus-causal",
    "layoutlmv3",
    "phi3-longrope",
    "grounding-dino",
    "longformer",
    "clap",
    "mixtral",
]
CHEAP_ROWS = ["t5", "biogpt", "phi3-longrope"]


def _transformers_skip_reason() -> str | None:
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install 'graphmend[zoo]')"
    try:
        installed = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "transformers has no package metadata"
    if installed != zoo.TRANSFORMERS_VERSION:
        return f"the zoo needs transformers=={zoo.TRANSFORMERS_VERSION}, found {installed}"
    return None


_SKIP = _transformers_skip_reason()
needs_transformers = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


# ---------------------------------------------------------------- the table


def test_rows_are_in_table_2_order():
    assert list(zoo.ROWS) == TABLE_2_ORDER


@pytest.mark.parametrize("name", TABLE_2_ORDER)
def test_row_fields_are_filled(name):
    row = zoo.ROWS[name]
    assert row.name == name
    for text in (row.categories, row.scope, row.rules, row.note):
        assert isinstance(text, str) and text.strip()
        assert "\n" not in text
    assert isinstance(row.paper_models, tuple)
    assert all(isinstance(m, str) and m for m in row.paper_models)
    assert callable(row.builder)
    numbers = (row.paper_before, row.paper_fix_rate, row.artifact_before, row.artifact_after)
    assert all(n is None or (isinstance(n, int) and n >= 0) for n in numbers)
    if row.paper_before is None:
        assert row.paper_models == () and "beyond the paper" in row.rules
    else:
        assert row.paper_models and row.paper_fix_rate is not None
        assert row.artifact_before is not None and row.artifact_after is not None
        assert row.artifact_after <= row.artifact_before
    assert zoo.MEASURED_GRAPHS[name] >= 1


def test_measured_graphs_cover_exactly_the_rows():
    assert set(zoo.MEASURED_GRAPHS) == set(zoo.ROWS)


def test_measured_breaks_match_the_artifact():
    # Every row with an artifact measurement rebuilds that build: the break counts agree.
    for name, row in zoo.ROWS.items():
        if row.artifact_before is not None:
            assert zoo.MEASURED_GRAPHS[name] - 1 == row.artifact_before, name


# ---------------------------------------------------------------- errors


def test_unknown_row_names_the_known_rows():
    with pytest.raises(TargetError) as info:
        zoo.build("nope")
    message = str(info.value)
    assert "nope" in message and "\n" not in message
    for name in zoo.ROWS:
        assert name in message


def test_missing_transformers_is_a_target_error(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "transformers" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(TargetError) as info:
        zoo.build("t5")
    assert str(info.value) == "zoo:t5 needs transformers==4.52.4: pip install 'graphmend[zoo]'"


def test_wrong_transformers_version_is_a_target_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: object())
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    with pytest.raises(TargetError) as info:
        zoo.build("biogpt")
    message = str(info.value)
    assert "9.9.9" in message and "4.52.4" in message and "paper" in message
    assert "\n" not in message


def test_importing_the_zoo_does_not_import_transformers():
    src = str(Path(graphmend.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    code = "import sys, graphmend.models.zoo; sys.exit(1 if 'transformers' in sys.modules else 0)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr or "graphmend.models.zoo imported transformers"


# ---------------------------------------------------------------- builds


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(_bytes(a[key]), _bytes(b[key])), key


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update({f"buffer:{k}": v for k, v in model.named_buffers()})
    return out


@pytest.mark.zoo
@needs_transformers
@pytest.mark.parametrize("name", CHEAP_ROWS)
def test_builds_are_bitwise_deterministic(name):
    rng_before = torch.get_rng_state()
    model_a, args_a, kwargs_a = zoo.build(name)
    model_b, args_b, kwargs_b = zoo.build(name)
    assert torch.equal(torch.get_rng_state(), rng_before), "build() must not move the global RNG"
    assert not model_a.training and not model_b.training
    assert args_a == () and args_b == ()
    _assert_bitwise(_tensors(model_a), _tensors(model_b))
    _assert_bitwise(kwargs_a, kwargs_b)


@pytest.mark.zoo
@needs_transformers
@pytest.mark.parametrize("name", CHEAP_ROWS)
def test_counting_backend_gives_the_measured_graphs(name):
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model, args, kwargs = zoo.build(name)
    with torch.no_grad():
        eager = model(*args, **kwargs)
    model, args, kwargs = zoo.build(name)
    compiled = torch.compile(model, backend=counting_backend, dynamic=False)
    try:
        with torch.no_grad():
            out = compiled(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == zoo.MEASURED_GRAPHS[name]
    torch.testing.assert_close(out.logits, eager.logits)


@pytest.mark.zoo
@needs_transformers
def test_phi3_row_takes_the_longrope_branch():
    model, _, _ = zoo.build("phi3-longrope")
    assert model.model.rotary_emb.rope_type == "longrope"
