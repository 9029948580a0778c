"""graphmend bench: isolated arms, pinned weights, honest failure reporting."""

import json
import os

import pytest

from graphmend.tools import bench as B
from graphmend.tools import cli

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
    assert set(arm["steady_ms"]) == {"median", "mean", "p10", "p90"}
    assert data["ratios"]["cold_start"] is not None and data["ratios"]["time_to_steady"] is not None
    assert (data["device"], data["mode"], data["modes"]) == ("cpu", "default", {})
    assert arm["tf32"] is False  # TF32 is only turned on (in both arms) on CUDA


def test_profile_proves_the_mended_program_reached_compiled_code(unseeded_report):
    # One steady forward: the original enters two compiled regions (a break
    # between them), the mended program one.
    original, mended = unseeded_report.arms["original"], unseeded_report.arms["mended"]
    assert original["per_forward"]["compiled_regions"] == 2
    assert mended["per_forward"]["compiled_regions"] == 1


def test_time_to_steady_sums_calls_until_one_is_near_the_median():
    assert B._time_to_steady([10.0, 3.0, 0.001, 0.001], median_ms=1.0) == 13.001
    assert B._time_to_steady([0.001, 5.0], median_ms=1.0) == 0.001


def test_dropped_profiles_and_missing_cuda_graphs_are_reported():
    report = B.BenchReport(target="t", backend="inductor", batches=[], device="cuda", mode="reduce-overhead")
    base = {"ok": True, "cache_was_empty": True, "inputs_sha": "a", "batches": [], "device": "cuda", "tf32": True,
            "weights_pinned": True, "graphs": 2, "applied_sites": 1, "fixable_sites": 1}
    report.arms["original"] = dict(base, cache_dir="/a", per_forward={"compiled_regions": 0})
    report.arms["mended"] = dict(base, cache_dir="/b", graphs=1, tf32=False,
                                 per_forward={"compiled_regions": 1, "cuda_graph_launches": 0})
    B._check(report)
    text = " | ".join(report.problems)
    for fragment in ("original arm's profile saw no compiled region", "different devices or TF32",
                     "no CUDA-graph launch was profiled"):
        assert fragment in text, fragment
    assert "mended arm's profile" not in text


def test_as_many_regions_after_mending_is_reported():
    report = B.BenchReport(target="t", backend="inductor", batches=[])
    base = {"ok": True, "cache_was_empty": True, "inputs_sha": "a", "batches": [], "weights_pinned": True}
    report.arms["original"] = dict(base, cache_dir="/a", graphs=4, per_forward={"compiled_regions": 4})
    report.arms["mended"] = dict(base, cache_dir="/b", graphs=1, applied_sites=3, fixable_sites=3,
                                 per_forward={"compiled_regions": 4})
    B._check(report)
    assert report.problems == ["the mended arm compiled fewer graphs but entered as many compiled regions per forward"]


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


def test_reduce_overhead_without_cuda_is_a_usage_error(capsys):
    assert cli.main(["bench", "demo", "--device", "cpu", "--mode", "reduce-overhead"]) == 2
    assert "needs --device cuda" in capsys.readouterr().err


def test_bad_batch_is_a_usage_error(capsys):
    assert cli.main(["bench", "demo", "--batch", "x"]) == 2
    assert "--batch takes comma-separated integers" in capsys.readouterr().err


def test_sites_every_rule_declined_with_a_reason_are_not_an_inert_arm():
    # clap: its one DO site is claimed by [Scalar], which declines it with a reason;
    # the arms then run the same program by design, not by a failed mending.
    report = B.BenchReport(target="t", backend="eager", batches=[])
    base = {"ok": True, "cache_was_empty": True, "inputs_sha": "a", "batches": [], "weights_pinned": True, "graphs": 3}
    report.arms["original"] = dict(base, cache_dir="/a")
    report.arms["mended"] = dict(base, cache_dir="/b", fixable_sites=1, applied_sites=0, declined_with_reason=1)
    B._check(report)
    assert not any("mended nothing" in p for p in report.problems), report.problems


def test_the_mended_arms_cold_start_counts_the_mend(unseeded_report):
    # graphmend.compile mends inside the user's first call: the cold start is both.
    original, mended = unseeded_report.arms["original"], unseeded_report.arms["mended"]
    assert mended["cold_start_s"] == pytest.approx(mended["mend_s"] + mended["first_call_s"], abs=1e-3)
    assert mended["mend_s"] > 0 and set(mended["mend_split"]) == {"discovery", "rewrite", "verify"}
    assert mended["mend_from_cache"] is False and unseeded_report.mend_cache == "cold"
    assert "mend_s" not in original and original["cold_start_s"] == original["first_call_s"]


def test_a_warm_mend_cache_installs_what_an_unmeasured_process_mended():
    report = B.bench(f"{PATTERNS}:build_unseeded", backend="eager", batches=(1,), iters=3, timeout=300, mend_cache="warm")
    original, mended = report.arms["original"], report.arms["mended"]
    assert report.problems == [] and set(report.arms) == {"original", "mended"}
    assert mended["mend_from_cache"] is True and set(mended["mend_split"]) == {"install"}
    assert (original["graphs"], mended["graphs"]) == (2, 1) and report.outputs_identical is True
    assert report.to_dict()["mend_cache"] == "warm"
