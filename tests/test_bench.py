"""graphmend bench: isolated arms, pinned weights, honest failure reporting."""

import json
import os

import pytest

from graphmend import bench as B
from graphmend import cli

PATTERNS = os.path.join(os.path.dirname(__file__), "fixtures", "patterns.py")


@pytest.fixture(scope="module")
def unseeded_report():
    return B.bench(f"{PATTERNS}:build_unseeded", backend="eager", batches=(1, 3), iters=5, timeout=300)


def test_arms_have_private_empty_caches(unseeded_report):
    arms = unseeded_report.arms
    assert arms["original"]["ok"] and arms["mended"]["ok"], arms
    assert arms["original"]["cache_dir"] != arms["mended"]["cache_dir"]
    assert arms["original"]["cache_was_empty"] and arms["mended"]["cache_was_empty"]
    assert unseeded_report.problems == []


def test_weights_are_pinned_to_the_original_arm(unseeded_report):
    # Unseeded weights differ between processes; identical outputs prove the
    # mended arm ran the original arm's state_dict on the same inputs.
    assert unseeded_report.arms["mended"]["weights_pinned"] is True
    assert unseeded_report.arms["original"]["inputs_sha"] == unseeded_report.arms["mended"]["inputs_sha"]
    assert unseeded_report.outputs_identical is True and unseeded_report.max_abs_diff == 0.0


def test_mended_arm_really_mended(unseeded_report):
    original, mended = unseeded_report.arms["original"], unseeded_report.arms["mended"]
    assert (original["graphs"], mended["graphs"]) == (2, 1)
    assert mended["applied_sites"] == mended["fixable_sites"] == 1


def test_json_schema(unseeded_report):
    data = json.loads(json.dumps(unseeded_report.to_dict()))
    assert {"schema", "target", "backend", "batches", "arms", "ratios", "outputs_identical", "max_abs_diff",
            "problems"} <= set(data)
    arm = data["arms"]["mended"]
    for key in ("graphs", "breaks", "recompiles", "cold_start_s", "cold_start_excl_compile_s", "compile_s",
                "steady_ms", "throughput", "peak_rss_mb", "cache_dir", "inputs_sha"):
        assert key in arm, key
    assert set(arm["throughput"]) == {"1", "3"}
    assert set(arm["steady_ms"]) == {"median", "p10", "p90"}
    assert data["ratios"]["cold_start"] is not None


def test_inert_arm_and_unfair_setups_are_reported():
    report = B.BenchReport(target="t", backend="eager", batches=[1])
    base = {"ok": True, "cache_was_empty": True, "inputs_sha": "a", "batches": [1], "graphs": 3}
    report.arms["original"] = dict(base, cache_dir="/c1")
    report.arms["mended"] = dict(base, cache_dir="/c1", inputs_sha="b", batches=[2], weights_pinned=False,
                                 fixable_sites=2, applied_sites=0, cache_was_empty=False)
    B._check(report)
    text = " | ".join(report.problems)
    for fragment in ("not private and empty", "shared a compile cache", "different inputs", "different batch sizes",
                     "did not load the original arm's weights", "mended nothing although 2 site(s)"):
        assert fragment in text, fragment


def test_a_failed_arm_is_reported_not_dropped(capsys):
    code = cli.main(["bench", f"{PATTERNS}:build_clean", "--backend", "eager", "--timeout", "0.01", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 2
    assert not data["arms"]["original"]["ok"] and "timed out" in data["arms"]["original"]["error"]
    assert any("original arm failed" in p for p in data["problems"])


def test_bad_batch_is_a_usage_error(capsys):
    assert cli.main(["bench", "demo", "--batch", "x"]) == 2
    assert "--batch takes comma-separated integers" in capsys.readouterr().err
