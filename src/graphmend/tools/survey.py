"""``graphmend survey``: graphmend on real libraries, model by model.

An ecosystem check in the manner of ruff's and mypy_primer's: every model of a
library, built small with random weights (nothing is downloaded), runs in a
fresh process with a timeout and is measured the way a user meets it:

* ``graphs_plain``: graphs of one call of plain ``torch.compile(model)``
  (default settings: automatic dynamic shapes), counted by a backend that
  runs each graph as captured;
* ``graphs_mended``: the same for ``graphmend.compile(model)``, whose report
  gives breaks before and after, ``calls_captured``, recompiles, fallbacks,
  the rules that applied and whether the mend was verified;
* ``mismatch``: whether either compiled call's output differs, bit for bit,
  from eager;
* ``first_call_s``: the first call of each, plain and ``graphmend.compile``
  (mending included, by the same counting backend, so Dynamo's tracing and
  graphmend's mending), the plain one measured again after the mended one
  and the faster of its two kept (the first call of a process warms caches
  the second finds); ``traces``, the calls of the model the mend made under
  Dynamo, and ``mend_passes``, each pass's seconds, traces and frames traced.

Libraries (``LIBRARIES``) have a CI-sized subset and a long mode (every
model the installed release offers). ``--json PATH`` writes the rows and the
totals; the table goes to the terminal.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from graphmend.models import diffusion, vision
from graphmend.tools.suite import run_each, run_in_process

MODEL_MODULE = "graphmend.tools.survey"


def _transformers_all() -> list[str]:
    from graphmend.models import tiny

    return [tiny.PREFIX + name for name in tiny.architectures()]


@dataclass(frozen=True)
class Library:
    name: str
    subset: tuple[str, ...]  # the CI-sized subset: what breaks on a current release, and one that does not
    every: Callable[[], list[str]]  # long mode
    # what the installed release offers, when more than long mode runs (timm: every model, not one a family)
    offered: Callable[[], list[str]] | None = None


# The text architectures of transformers 5.23 that break under plain torch.compile
# (12 of the 164 that build and run tiny; `graphmend survey --long` on 5.23), and BERT,
# which does not. On another release the subset keeps the ones it has.
BREAKING_ON_5_23 = (
    "ctrl", "fastspeech2_conformer", "flaubert", "higgs_audio_v2", "jetmoe", "led", "longformer", "longt5",
    "openai_privacy_filter", "switch_transformers", "vits", "xlm",
)

LIBRARIES: dict[str, Library] = {
    "transformers": Library("transformers", tuple("hf:" + name for name in (*BREAKING_ON_5_23, "bert")), _transformers_all),
    # Every detection model (each breaks: box decoding, nonzero, nms) and one classifier, which does not.
    "torchvision": Library("torchvision", tuple(vision.PREFIX + n for n in (*vision.DETECTION, "resnet18")), vision.architectures),
    # Image classifiers of ten families; none broke under torch.compile when issue 25 was filed.
    "timm": Library("timm", tuple(vision.TIMM + n for n in vision.TIMM_SUBSET), vision.timm_architectures, vision.timm_offered),
    # Mochi, the one of diffusion.py's 18 denoisers and autoencoders that breaks on diffusers 0.42.1
    # (`nonzero` over the prompt mask), and the Stable Diffusion UNet, which does not; `--long`: all 18.
    "diffusers": Library("diffusers", tuple(diffusion.PREFIX + n for n in ("mochi", "unet2d_condition")), diffusion.architectures),
}


@dataclass
class SurveyReport:
    library: str
    long: bool
    rows: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def totals(self) -> dict[str, Any]:
        ok = [r for r in self.rows if r.get("ok")]
        before = sum(r["breaks_before"] for r in ok)
        after = sum(r["breaks_after"] for r in ok)
        return {
            "models": len(self.rows),
            "models_failed": len(self.rows) - len(ok),
            "models_breaking": sum(1 for r in ok if r["graphs_plain"] > 1),
            "graphs_plain": sum(r["graphs_plain"] for r in ok),
            "graphs_mended": sum(r["graphs_mended"] for r in ok),
            "first_call_ratio_max": max((_ratio(r) for r in ok if _ratio(r) is not None), default=None),
            "breaks_before": before,
            "breaks_after": after,
            "fix_rate": round(100 * (before - after) / before, 1) if before else None,
            "verified": sum(1 for r in ok if r["verified"]),
            "mended": sum(1 for r in ok if r["breaks_before"] > r["breaks_after"]),
            "mismatches": sum(1 for r in ok if r["mismatch"]),
            "worse": sum(1 for r in ok if r["graphs_mended"] > r["graphs_plain"]),
        }

    def to_dict(self) -> dict[str, Any]:
        return {"schema": 1, "library": self.library, "long": self.long, "seconds": round(self.seconds, 1),
                "rows": self.rows, "totals": self.totals()}


def _ratio(row: dict[str, Any]) -> float | None:
    """graphmend.compile's first call over plain torch.compile's (mending included)."""
    plain, mended = (row.get("first_call_s") or [None, None])[:2]
    return round(mended / plain, 2) if plain and mended is not None else None


def models_of(library: str, long: bool) -> list[str]:
    lib = LIBRARIES[library]
    if long:
        return lib.every()
    offered = set((lib.offered or lib.every)())
    return [name for name in lib.subset if name in offered]


def run_survey(
    library: str,
    models: list[str],
    *,
    long: bool = False,
    jobs: int = 1,
    timeout: float = 600.0,
    progress: Callable[[str], None] | None = None,
) -> SurveyReport:
    report = SurveyReport(library, long)
    start = time.perf_counter()
    report.rows = run_each(models, lambda name: run_in_process(MODEL_MODULE, [name], timeout, {"model": name}),
                           jobs, progress)
    report.seconds = time.perf_counter() - start
    return report


def _call(fn: Any, target: Any) -> Any:
    """One call on copies of the inputs, from the same random state every time
    (a model that draws noise, as VITS does, must draw the same noise in each arm)."""
    import torch

    args, kwargs = copy.deepcopy(target.args), copy.deepcopy(target.kwargs)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        return fn(*args, **kwargs)


def model_result(name: str) -> dict[str, Any]:
    """One model, in this process (the survey runs it in a fresh one)."""
    import torch

    from graphmend.api import compile as mend_and_compile
    from graphmend.models.targets import load_target, run_eager
    from graphmend.rewrite.verify import quiet, tensors_in
    from graphmend.tools.bench import _sha

    started = time.perf_counter()
    with quiet():
        target = load_target(name)
        private = copy.deepcopy(target.model)  # each arm starts from the model as built
        # Through run_eager: a model that fails eagerly is reported as such, in one line.
        eager = _call(lambda *a, **k: run_eager(dataclasses.replace(target, model=private, args=a, kwargs=k)), target)
        reference = _sha(tensors_in(eager))

    def counting() -> tuple[list, Callable]:
        graphs: list = []

        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            graphs.append(gm)
            return gm.forward

        return graphs, backend

    def plain_call() -> tuple[Any, int, float]:
        torch._dynamo.reset()
        graphs, backend = counting()
        began = time.perf_counter()
        out = _call(torch.compile(copy.deepcopy(target.model), backend=backend), target)
        return out, len(graphs), time.perf_counter() - began

    plain_out, plain, plain_s = plain_call()
    torch._dynamo.reset()
    graphs, backend = counting()
    compiled = mend_and_compile(target.model, backend=backend, cache=False)  # measured: mended here, not installed
    began = time.perf_counter()
    mended_out = _call(compiled, target)
    mended_s = time.perf_counter() - began
    mended = len(graphs)
    report = compiled.report
    plain_s = min(plain_s, plain_call()[2])
    torch._dynamo.reset()
    before, after = report.before, report.after
    return {
        "model": name,
        "ok": True,
        "graphs_plain": plain,
        "graphs_mended": mended,
        "breaks_before": before.breaks,
        "breaks_after": after.breaks,
        "categories": before.categories,
        "remaining": sorted({s.category for s in after.sites}),
        "calls_captured": [before.calls_captured, after.calls_captured],
        "recompiles": [before.recompiles, after.recompiles],
        "fallbacks_to_eager": [before.fallbacks_to_eager, after.fallbacks_to_eager],
        "rules": sorted({o.rule for o in report.applied if o.rule}),
        "capture": list(report.capture.flags),
        "verified": bool(report.verified),
        "mismatch": _sha(tensors_in(plain_out)) != reference or _sha(tensors_in(mended_out)) != reference,
        "first_call_s": [round(plain_s, 3), round(mended_s, 3)],
        "traces": report.traces,
        "frames_traced": report.frames_traced,
        "mend_passes": report.mend_passes,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str]) -> int:
    import json

    name = argv[0]
    try:
        result = model_result(name)
    except Exception as exc:  # reported as a failed model, never dropped
        result = {"model": name, "ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":  # pragma: no cover - the model subprocess
    sys.exit(main(sys.argv[1:]))
