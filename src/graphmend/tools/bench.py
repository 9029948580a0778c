"""``graphmend bench``: what mending buys, measured side by side, honestly.

Two arms, *original* and *mended*, each in its own fresh subprocess with its
own empty Inductor and Triton cache directories. The original arm saves its
``state_dict``; the mended arm loads it (``strict=True``), so both run the
same weights on the same inputs (each arm reports a hash of its inputs and
the parent checks they match). For each arm:

* graphs and breaks on the first call, recompiles on later same-shape calls;
* cold start: everything the user waits for before the first output. For
  the original arm the first call, compilation included; for the mended arm
  the mend too (``mend_s``, split into discovery, rewrite and verify:
  ``mend_split``), which ``graphmend.compile`` runs inside the first call
  (``first_call_s`` is the call alone in both arms); and the same with
  Dynamo/Inductor compile time (``_compile.compile_inner``) subtracted;
* steady state: median, 10th and 90th percentile per-call latency after
  warm-up;
* throughput in samples/s at each ``--batch`` size (tensors whose first
  dimension is the example batch are repeated along it);
* time to steady: the first calls summed until one is within 1.5x of the
  steady median (compilation often spills past the first call);
* what one steady forward executed, from ``torch.profiler``: compiled
  regions entered and compiled graphs called (the proof that the mended
  program reached the compiled code), and on CUDA the CUDA-graph launches,
  kernel launches and host syncs;
* peak resident memory of the arm process, and on CUDA the peak allocated
  device memory;
* the first call's outputs, compared across arms by the parent (bit-exact,
  and the max abs difference).

Both arms run one eager forward before compiling, so lazy caches fill
outside the measured region. On CUDA both arms turn TF32 on (as the paper
did), synchronise around every timed call, and ``bench`` measures
``mode="reduce-overhead"`` (CUDA graphs) in addition to the default mode.

The parent refuses to measure nothing quietly: a mended arm that mended no
site while the target had fixable ones, arms whose caches were not private
and empty, and arms with different inputs or batches are reported as
problems in the result, and so is a profile that saw no compiled region (a
dropped profile) or a mended arm that entered as many compiled regions per
forward as the original. Each arm is bounded by ``--timeout``; a failed arm
is reported with its error.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

ARM_MODULE = "graphmend.tools.bench"


@dataclass
class BenchReport:
    target: str
    backend: str
    batches: list[int]
    device: str = "cpu"
    mode: str = "default"
    arms: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs_identical: bool | None = None
    max_abs_diff: float | None = None
    problems: list[str] = field(default_factory=list)
    modes: dict[str, "BenchReport"] = field(default_factory=dict)  # further modes measured (CUDA: reduce-overhead)
    mend_cache: str = "cold"  # "warm": the mended arm installed an earlier process's mend (cache.py)

    def ratio(self, key: str, sub: str | None = None) -> float | None:
        """original / mended for a metric (higher is better for the mended arm on times)."""
        a, b = self.arms.get("original", {}), self.arms.get("mended", {})
        x, y = a.get(key), b.get(key)
        if sub is not None:
            x = (x or {}).get(sub)
            y = (y or {}).get(sub)
        if not isinstance(x, (int, float)) or not isinstance(y, (int, float)) or y == 0:
            return None
        return x / y

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": 1,
            "target": self.target,
            "backend": self.backend,
            "device": self.device,
            "mode": self.mode,
            "mend_cache": self.mend_cache,
            "batches": list(self.batches),
            "arms": self.arms,
            "ratios": {
                "cold_start": self.ratio("cold_start_s"),
                "first_call": self.ratio("first_call_s"),
                "cold_start_excl_compile": self.ratio("cold_start_excl_compile_s"),
                "time_to_steady": self.ratio("time_to_steady_s"),
                "steady_state": self.ratio("steady_ms", "median"),
            },
            "outputs_identical": self.outputs_identical,
            "max_abs_diff": self.max_abs_diff,
            "problems": list(self.problems),
            "modes": {name: other.to_dict() for name, other in self.modes.items()},
        }


# --------------------------------------------------------------------------
# the parent


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def bench(
    target: str,
    *,
    backend: str = "inductor",
    batches: tuple[int, ...] = (1, 4),
    iters: int = 20,
    timeout: float = 600.0,
    device: str | None = None,
    modes: tuple[str, ...] | None = None,
    mend_cache: str = "cold",
) -> BenchReport:
    """Run both arms of ``target`` (a target string) and compare them.

    ``modes`` are ``torch.compile`` modes, measured one after the other, each
    with its own pair of cold arms; the default is ``("default",)`` on CPU and
    ``("default", "reduce-overhead")`` on CUDA with Inductor. ``mend_cache``:
    ``"cold"``, the mended arm mends; ``"warm"``, an unmeasured process mends
    first and the measured arm installs its entry from the mend cache (a
    restarted service's start).
    """
    device = device or default_device()
    if modes is None:
        modes = ("default", "reduce-overhead") if device == "cuda" and backend == "inductor" else ("default",)
    reports = [_bench_mode(target, backend, batches, iters, timeout, device, mode, mend_cache) for mode in modes]
    first = reports[0]
    first.modes = {r.mode: r for r in reports[1:]}
    return first


def _bench_mode(
    target: str, backend: str, batches: tuple[int, ...], iters: int, timeout: float, device: str, mode: str,
    mend_cache: str = "cold",
) -> BenchReport:
    report = BenchReport(target=target, backend=backend, batches=list(batches), device=device, mode=mode,
                         mend_cache=mend_cache)
    with tempfile.TemporaryDirectory(prefix="graphmend-bench-") as work:
        weights = os.path.join(work, "weights.pt")
        arms = ["original", "prepare", "mended"] if mend_cache == "warm" else ["original", "mended"]
        for arm in arms:
            spec = {
                "arm": arm,
                "target": target,
                "backend": backend,
                "device": device,
                "mode": mode,
                "batches": list(batches),
                "iters": iters,
                "weights": weights,
                "outputs": os.path.join(work, f"{arm}-outputs.pt"),
                "result": os.path.join(work, f"{arm}.json"),
                "mend_cache": os.path.join(work, "mend-cache") if mend_cache == "warm" else None,
            }
            result = _run_arm(spec, work, timeout)
            if arm != "prepare":
                report.arms[arm] = result
            elif not result.get("ok"):  # no entry to install: the measured arm would mend, not what was asked
                report.problems.append(f"the unmeasured mend for the warm cache failed: {result.get('error')}")
        _compare_outputs(report, work)
    _check(report)
    return report


def _run_arm(spec: dict[str, Any], work: str, timeout: float) -> dict[str, Any]:
    caches = tempfile.mkdtemp(prefix=f"{spec['arm']}-caches-", dir=work)
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(caches, "triton")
    env.pop("TORCH_LOGS", None)
    if spec.get("mend_cache"):
        env.update(GRAPHMEND_CACHE="1", GRAPHMEND_CACHE_DIR=spec["mend_cache"])
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", ARM_MODULE, json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "cache_dir": caches}
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not os.path.exists(spec["result"]):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        code = "likely out of memory (137)" if proc.returncode in (137, -9) else f"exit {proc.returncode}"
        return {"ok": False, "error": f"{code}: {tail[0]}", "cache_dir": caches, "wall_s": wall}
    with open(spec["result"], encoding="utf-8") as fh:
        result = json.load(fh)
    result["wall_s"] = round(wall, 3)
    return result


def _compare_outputs(report: BenchReport, work: str) -> None:
    import torch

    paths = [os.path.join(work, f"{arm}-outputs.pt") for arm in ("original", "mended")]
    if not all(os.path.exists(p) for p in paths):
        return
    a, b = (torch.load(p) for p in paths)
    if len(a) != len(b):
        report.outputs_identical = False
        return
    identical, worst = True, 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            identical, worst = False, math.inf
            continue
        same = torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)) if x.numel() else True
        identical &= bool(same)
        if x.numel() and x.is_floating_point():
            diff = (x.double() - y.double()).abs()
            agree = (x == y) | (torch.isnan(x) & torch.isnan(y))  # equal infinities and NaN pairs agree
            diff = torch.where(agree, torch.zeros_like(diff), diff)
            worst = max(worst, float(diff.nan_to_num(nan=math.inf).max()))
        elif x.numel() and not same:
            worst = math.inf
    report.outputs_identical = identical
    report.max_abs_diff = worst


def _check(report: BenchReport) -> None:
    original, mended = report.arms.get("original", {}), report.arms.get("mended", {})
    for name, arm in report.arms.items():
        if not arm.get("ok"):
            report.problems.append(f"{name} arm failed: {arm.get('error')}")
        elif not arm.get("cache_was_empty", False):
            report.problems.append(f"{name} arm's compile caches were not private and empty: it was not cold")
    if original.get("ok") and mended.get("ok"):
        if original.get("cache_dir") == mended.get("cache_dir"):
            report.problems.append("the arms shared a compile cache")
        if original.get("inputs_sha") != mended.get("inputs_sha"):
            report.problems.append("the arms ran different inputs")
        if original.get("batches") != mended.get("batches"):
            report.problems.append("the arms ran different batch sizes")
        if not mended.get("weights_pinned"):
            report.problems.append("the mended arm did not load the original arm's weights")
        fixable = mended.get("fixable_sites", 0)
        explained = mended.get("declined_with_reason", 0)  # sites the rules refused, each with its reason
        if fixable and not mended.get("applied_sites") and explained < fixable:
            report.problems.append(
                f"the mended arm mended nothing although {fixable} site(s) were fixable: it measured the original twice"
            )
        if report.mend_cache == "warm" and not mended.get("mend_from_cache"):
            report.problems.append("the mended arm mended instead of installing the warm cache's entry")
        for failure in mended.get("backend_failures", []):
            report.problems.append(f"the backend failed on a mended graph, which ran without it: {failure}")
        if mended.get("graphs", 0) > original.get("graphs", 0):
            report.problems.append("the mended arm compiled more graphs than the original")
        if original.get("device") != mended.get("device") or original.get("tf32") != mended.get("tf32"):
            report.problems.append("the arms ran on different devices or TF32 settings")
        a, b = original.get("per_forward") or {}, mended.get("per_forward") or {}
        for name, counts in (("original", a), ("mended", b)):
            if not counts.get("compiled_regions"):
                report.problems.append(f"the {name} arm's profile saw no compiled region: a dropped profile")
        if a.get("compiled_regions") and b.get("compiled_regions") and mended.get("applied_sites"):
            if b["compiled_regions"] >= a["compiled_regions"] and mended.get("graphs", 0) < original.get("graphs", 0):
                report.problems.append(
                    "the mended arm compiled fewer graphs but entered as many compiled regions per forward"
                )
        if report.mode == "reduce-overhead" and not (b.get("cuda_graph_launches") or a.get("cuda_graph_launches")):
            report.problems.append("reduce-overhead ran but no CUDA-graph launch was profiled")


# --------------------------------------------------------------------------
# one arm (runs in its own process)


def _batched(args: tuple, kwargs: dict, base: int, batch: int) -> tuple[tuple, dict]:
    import torch

    def grow(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == base and batch != base:
            reps = [-(-batch // base)] + [1] * (v.dim() - 1)
            return v.repeat(*reps)[:batch].contiguous()
        return v

    return tuple(grow(a) for a in args), {k: grow(v) for k, v in kwargs.items()}


def _sha(tensors: list[Any]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(str((tuple(t.shape), str(t.dtype))).encode())
        digest.update(t.detach().contiguous().cpu().reshape(-1).view(__import__("torch").uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))
    return ordered[index]


def _to_device(value: Any, device: str) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value


# Event names in torch.profiler's trace (torch 2.13); counted over one steady forward.
_REGION_EVENT = "Torch-Compiled Region"
_GRAPH_CALL_EVENT = "## Call CompiledFxGraph"
_CUDA_GRAPH_LAUNCH = ("cudaGraphLaunch",)
_KERNEL_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
_SYNC = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


def _profile_forward(call: Any, cuda: bool) -> dict[str, int]:
    """What one forward executed: compiled regions and graphs, and on CUDA launches and syncs."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, acc_events=True) as prof:
        call()
    names = [event.name for event in prof.events()]
    counts = {
        "compiled_regions": sum(1 for n in names if n.startswith(_REGION_EVENT)),
        "compiled_graph_calls": sum(1 for n in names if n.startswith(_GRAPH_CALL_EVENT)),
    }
    if cuda:
        counts.update(
            cuda_graph_launches=sum(1 for n in names if n in _CUDA_GRAPH_LAUNCH),
            kernel_launches=sum(1 for n in names if n in _KERNEL_LAUNCH),
            syncs=sum(1 for n in names if n in _SYNC),
        )
    return counts


def _time_to_steady(first_calls: list[float], median_ms: float) -> float:
    """Seconds from the first call until a call is within 1.5x of the steady median."""
    total = 0.0
    for seconds in first_calls:
        total += seconds
        if seconds * 1000 <= 1.5 * median_ms:
            break
    return total


def run_arm(spec: dict[str, Any]) -> dict[str, Any]:
    import resource
    import statistics

    import torch
    import torch._dynamo.utils as dynamo_utils

    from graphmend.models.targets import load_target
    from graphmend.rewrite.verify import quiet, tensors_in

    device, mode = spec.get("device", "cpu"), spec.get("mode", "default")
    cuda = device.startswith("cuda")
    cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    result: dict[str, Any] = {
        "ok": False,
        "arm": spec["arm"],
        "backend": spec["backend"],
        "device": device,
        "mode": mode,
        "cache_dir": os.path.dirname(cache_dir),
        "cache_was_empty": not os.path.exists(cache_dir) or not os.listdir(cache_dir),
        "batches": spec["batches"],
    }
    if cuda:  # as the paper set it, in both arms
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    result["tf32"] = bool(cuda and torch.backends.cuda.matmul.allow_tf32)
    with quiet():
        target = load_target(spec["target"])
    model, args, kwargs = target.model, target.args, target.kwargs
    if isinstance(model, torch.nn.Module):
        if spec["arm"] == "original":
            torch.save(model.state_dict(), spec["weights"])
        else:
            model.load_state_dict(torch.load(spec["weights"]), strict=True)
            result["weights_pinned"] = True
        model = model.to(device)
    args, kwargs = _to_device(args, device), _to_device(kwargs, device)
    result["inputs_sha"] = _sha(tensors_in((args, kwargs)))
    with torch.no_grad(), quiet():  # one eager forward: lazy caches fill outside the measurement
        model(*args, **kwargs)
    def invoke(fn: Any, a: tuple, k: dict) -> Any:
        return fn(*a, **k)

    graphs: list[int] = []

    if spec["backend"] == "inductor":
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        patches = list_mode_options(mode)  # {} for "default"

        def backend(gm: Any, example_inputs: Any) -> Any:
            graphs.append(1)
            return compile_fx(gm, example_inputs, config_patches=patches)

    else:

        def backend(gm: Any, example_inputs: Any) -> Any:
            graphs.append(1)
            return gm.forward

    if spec["arm"] in ("mended", "prepare"):  # as graphmend.compile does: a graph the backend fails on runs as captured
        from graphmend.rewrite.fallback import FallbackBackend

        backend = fallback = FallbackBackend(backend)

    mend_s = 0.0
    if spec["arm"] in ("mended", "prepare"):
        from graphmend.api import mend_model

        began = time.perf_counter()
        with quiet():  # what graphmend.compile does in the user's first call: its traces go through the backend
            report = mend_model(model, args, kwargs, cache=bool(spec.get("mend_cache")), stage=fallback)
        mend_s = time.perf_counter() - began
        result["mend_s"] = round(mend_s, 4)
        result["mend_split"] = report.mend_split
        result["mend_traces"] = report.traces
        result["mend_passes"] = report.mend_passes
        result["mend_staged"] = report.staged
        result["mend_from_cache"] = report.from_cache
        if spec["arm"] == "prepare":  # the entry is written: nothing to measure
            result["ok"] = True
            return result
        result["applied_sites"] = len(report.applied)
        result["fixable_sites"] = len(report.before.fixable)
        result["declined_with_reason"] = sum(1 for o in report.declined if o.rule and o.reason)
        def invoke(fn: Any, a: tuple, k: dict) -> Any:  # what graphmend.compile does around every call
            return report.call(fn, model, a, k)

    if not (spec["arm"] == "mended" and report.staged):
        torch._dynamo.reset()  # (a staged mend left the first call's trace in the cache: its last)
    compiled = torch.compile(model, backend=backend)
    step = torch.compiler.cudagraph_mark_step_begin if mode == "reduce-overhead" else (lambda: None)

    def call(a: tuple, k: dict) -> Any:
        step()
        out = invoke(compiled, a, k)
        if cuda:
            torch.cuda.synchronize()
        return out

    def timed(a: tuple, k: dict) -> float:
        start = time.perf_counter()
        call(a, k)
        return time.perf_counter() - start

    def compile_seconds() -> float:  # Dynamo's compiles, and the backend's of graphs a mend staged (fallback.py)
        staged = fallback.staged_seconds if spec["arm"] == "mended" else 0.0
        return sum(dynamo_utils.compilation_time_metrics.get("_compile.compile_inner", [])) + staged

    with torch.no_grad(), quiet():  # the model's own output is not the measurement
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        before_compile = compile_seconds()
        frames, captured = dict(dynamo_utils.counters["frames"]), dynamo_utils.counters["stats"]["calls_captured"]
        start = time.perf_counter()
        out = call(args, kwargs)
        cold = time.perf_counter() - start
        compile_s = compile_seconds() - before_compile
        result["graphs"] = len(graphs)
        result["breaks"] = max(0, len(graphs) - 1)
        result["calls_captured"] = dynamo_utils.counters["stats"]["calls_captured"] - captured
        result["fallbacks_to_eager"] = max(0, (dynamo_utils.counters["frames"]["total"] - frames.get("total", 0))
                                           - (dynamo_utils.counters["frames"]["ok"] - frames.get("ok", 0)))
        torch.save([t.detach().cpu() for t in tensors_in(out)], spec["outputs"])
        first_calls = [cold] + [timed(args, kwargs) for _ in range(3)]
        times = [timed(args, kwargs) * 1000 for _ in range(spec["iters"])]
        result["recompiles"] = len(graphs) - result["graphs"]
        result["per_forward"] = _profile_forward(lambda: call(args, kwargs), cuda)
        throughput = {}
        base = next((t.shape[0] for t in tensors_in((args, kwargs)) if t.dim() > 0), 1)
        for batch in spec["batches"]:
            a, k = _batched(args, kwargs, base, batch)
            call(a, k)  # compiles this shape
            n = max(3, spec["iters"] // 2)
            start = time.perf_counter()
            for _ in range(n):
                call(a, k)
            throughput[str(batch)] = round(batch * n / (time.perf_counter() - start), 2)
    median = statistics.median(times)
    if spec["arm"] == "mended":
        result["backend_failures"] = [f"{where}: {error}" for where, error in fallback.failures]
    result.update(
        ok=True,
        first_call_s=round(cold, 4),
        cold_start_s=round(mend_s + cold, 4),  # everything the user waits for: mending included
        compile_s=round(compile_s, 4),
        cold_start_excl_compile_s=round(max(0.0, mend_s + cold - compile_s), 4),
        time_to_steady_s=round(mend_s + _time_to_steady(first_calls, median), 4),
        steady_ms={
            "median": round(median, 4),
            "mean": round(statistics.fmean(times), 4),
            "p10": round(_percentile(times, 0.1), 4),
            "p90": round(_percentile(times, 0.9), 4),
        },
        throughput=throughput,
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    )
    if cuda:
        result["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    try:
        result = run_arm(spec)
    except Exception as exc:
        result = {"ok": False, "arm": spec.get("arm"), "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    with open(spec["result"], "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":  # pragma: no cover - the arm subprocess
    sys.exit(main(sys.argv[1:]))
