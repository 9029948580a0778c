"""The written code, run alone: ``graphmend fix`` proves its files work before writing them.

What ``fix`` writes is not the code it verified in memory: it is plainer
(``tools/plain.py``), it reaches the runtime through an import, and it runs
in the user's process without ``graphmend.compile``. So before any file is
written, any patch saved or any diff shown, two fresh Python processes load
the target (``python -m graphmend.tools.written JOB``):

* the original: the files as they are on disk, run eagerly;
* the written: the new texts served in place of the files (nothing on disk
  changes; ``SourceFileLoader`` reads them, no bytecode cache is used),
  compiled by ``torch.compile`` with a counting backend, with the capture
  flags the fix names set, and called inside ``graphmend.runtime.region()``
  as the written code's users call it (in ``graphmend.runtime.call`` when it
  speculates, after one call that learns the values to guess, as
  ``graphmend.compile``'s mend does).

Both build the target from seed 0 and run it once on its example inputs,
with autograd as the mend measured it, from the same seed. The written side must compile at most the
graphs the mend reported, with the original's outputs bit for bit, module
state, printed text, log records and warnings (their line numbers in a
changed file left out: the written file's lines moved), and the same
exception if any. Otherwise ``fix`` writes nothing for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

CHILD_TIMEOUT_S = 900.0


@dataclass
class Run:
    """What one fresh process saw: its observation, graphs compiled, or why it failed."""

    observation: Any = None
    graphs: int = 0
    error: str | None = None


def run_fresh(
    target: str, texts: dict[str, str], *, compiled: bool, grad: bool, flags: tuple[str, ...] = (), speculating: bool = False
) -> Run:
    """Load ``target`` in a new process with ``texts`` (path -> source) in place
    of those files, and call it once (compiled or eagerly; ``speculating``: in
    ``runtime.call``, as ``graphmend.compile`` calls a model with [Speculate] sites)."""
    import torch

    with tempfile.TemporaryDirectory(prefix="graphmend-written-") as folder:
        job = os.path.join(folder, "job.json")
        out = os.path.join(folder, "observation.pt")
        with open(job, "w", encoding="utf-8") as fh:
            json.dump({"target": target, "texts": texts, "compiled": compiled, "grad": grad, "flags": list(flags),
                       "speculating": speculating, "out": out}, fh)
        try:
            done = subprocess.run(
                [sys.executable, "-m", "graphmend.tools.written", job],
                capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=_child_env(),
            )
        except subprocess.TimeoutExpired:
            return Run(error=f"the fresh process did not finish in {CHILD_TIMEOUT_S:.0f} s")
        if done.returncode != 0 or not os.path.exists(out):
            tail = (done.stderr or done.stdout).strip().splitlines()
            return Run(error=f"the fresh process failed: {tail[-1] if tail else f'exit {done.returncode}'}")
        saved = torch.load(out, weights_only=False)
    return Run(observation=saved["observation"], graphs=saved["graphs"])


def _child_env() -> dict[str, str]:
    """The parent's environment, with graphmend importable as the parent imports it."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def differences(original: Run, written: Run, claimed: int, changed: set[str], memo_attrs: Any = frozenset()) -> list[str]:
    """Why the written run is not the original's, one line each (empty: it is)."""
    from graphmend.rewrite.verify import compare

    for side, run in (("original", original), ("written", written)):
        if run.error:
            return [f"{side}: {run.error}"]
    out = []
    if written.graphs > claimed:
        out.append(f"the written code compiles {written.graphs} graphs, the mend reported {claimed}")
    a, b = _unlined(original.observation, changed), _unlined(written.observation, changed)
    return out + compare(a, b, memo_attrs)


def _unlined(observation: Any, changed: set[str]) -> Any:
    """The observation with the line numbers of records and warnings from ``changed`` files blanked."""
    real = {os.path.realpath(p) for p in changed}

    def moved(path: Any) -> bool:
        return isinstance(path, str) and os.path.realpath(path) in real

    observation.records = [r[:3] + (None if moved(r[2]) else r[3],) + r[4:] for r in observation.records]
    observation.warnings = [w[:3] + (None if moved(w[2]) else w[3],) for w in observation.warnings]
    return observation


# --------------------------------------------------------------------------
# the fresh process


def _serve(texts: dict[str, str]) -> None:
    """Source files named in ``texts`` read as those texts, never from bytecode."""
    from importlib.machinery import SourceFileLoader

    served = {os.path.realpath(path): text for path, text in texts.items()}
    get_data, path_stats = SourceFileLoader.get_data, SourceFileLoader.path_stats

    def served_data(self: Any, path: str) -> bytes:
        text = served.get(os.path.realpath(path))
        return get_data(self, path) if text is None else text.encode("utf-8")

    def served_stats(self: Any, path: str) -> Any:
        if os.path.realpath(path) in served:
            raise OSError("served from memory: no bytecode")
        return path_stats(self, path)

    SourceFileLoader.get_data = served_data  # type: ignore[method-assign]
    SourceFileLoader.path_stats = served_stats  # type: ignore[method-assign]


def _main(job_path: str) -> int:
    with open(job_path, encoding="utf-8") as fh:
        job = json.load(fh)
    sys.dont_write_bytecode = True
    _serve(job["texts"])
    import torch

    from graphmend.discover.isolation import seed_everything
    from graphmend.models.targets import load_target
    from graphmend.rewrite.verify import observe, quiet

    seed_everything(0)  # a factory that draws without seeding builds the same model in both processes
    with quiet():
        target = load_target(job["target"])
    graphs = 0

    def counting(gm: Any, example_inputs: Any) -> Any:
        nonlocal graphs
        graphs += 1
        return gm.forward

    compiled = tuple(job["flags"]) if job["compiled"] else None
    if job["speculating"]:  # a first call learns the values to guess, as graphmend.compile's mend does
        _learn_guesses(target, job["grad"])
    observation = observe(
        target.model, target.args, target.kwargs, in_region=False, grad=job["grad"], compiled=compiled, backend=counting,
        speculating=job["speculating"],
    )
    torch.save({"observation": observation, "graphs": graphs}, job["out"])
    return 0


def _learn_guesses(target: Any, grad: bool) -> None:
    import copy

    import torch

    from graphmend import runtime
    from graphmend.discover.isolation import random_state_kept
    from graphmend.rewrite.verify import quiet

    with random_state_kept(), quiet(), (torch.enable_grad() if grad else torch.no_grad()):
        model = torch.compile(copy.deepcopy(target.model), backend="eager")
        runtime.call(model, *copy.deepcopy(target.args), **copy.deepcopy(target.kwargs))
    torch._dynamo.reset()


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
