"""Run one generated program against its mended self, and many in a row.

For each program (``check_program``):

1. import it from a real file under a unique module name (graphmend reads
   source through ``inspect`` / ``ast``) and build ``Model()`` with seeded
   weights;
2. the reference: the original, eagerly, called on every input in turn on one
   private copy (state carries from call to call, as it would for a user);
3. mend through the public API, ``graphmend.compile(model, backend=counting,
   example_inputs=...)`` with autograd off (the mend is measured in the grad
   mode it happens in), with the first input (from a drawn start) on which
   the original runs without raising;
4. the arms, each on its own fresh copy, called on the same inputs in the
   same order: the mended program eagerly (inside a deferral region, as
   compiled calls run), the ``graphmend.compile`` result (counting backend),
   ``torch.compile(..., backend="aot_eager")`` of the mended program, and on a
   sample Inductor; on a subset the eager and ``aot_eager`` arms again with
   grad enabled, backward through the output;
4b. after ``graphmend.unmend()`` restored the original code, on the grad
   subset the arm ``compile+grad``: a fresh copy through
   ``graphmend.compile(copy, backend=counting)`` with no example inputs,
   called with grad on, so that its first call mends in grad mode (its
   report must say ``grad=True``); compared with the eager grad reference
   exactly as ``eager+grad`` is. On another subset the arm ``threads``: two
   fresh copies, each through its own ``graphmend.compile`` (no example
   inputs), called by two threads started together (a barrier) on the whole
   input series without grad, so that their first calls race to mend
   (graphmend serialises the mends); each thread's series is observed on its
   own (``effects_capture.ThreadCapture``) and must equal the
   single-threaded reference;
5. after every call: output (bit for bit), exception (type and message),
   module state, stdout, stderr, log records and warnings, compared with
   ``graphmend.rewrite.verify.compare``; gradients of the input and every parameter
   (bit for bit; under ``aot_eager`` a zero of either sign, see
   ``_zero_grads_unsigned``). Inductor outputs are compared to a tolerance.

A difference in a compiled arm is graphmend's only if the original program,
compiled with the same backend and not mended, does not show it too (that is
the backend's behaviour; counted as ``backend``); for ``threads`` the control
is the original under ``torch.compile`` (counting) in two threads the same
way. Under grad, AOTAutograd's "modified by an inplace operation" errors name
the node that saved the tensor, which depends on where the graphs were cut:
they compare by kind.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import faulthandler
import importlib.util
import linecache
import logging
import os
import re
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import graphmend
from graphmend import runtime
from graphmend.compat import release
from graphmend.discover.trace import _function_name
from graphmend.pipeline import GONE as _GONE_NOTE
from graphmend.rewrite.verify import Observation, _detach, compare, fresh_once_caches, module_state, tensors_in

try:  # pytest puts tests/ on sys.path; `python -m tests.fuzz` runs from the repository root
    from effects_capture import ThreadCapture, capture, unwrapped
except ImportError:
    from tests.effects_capture import ThreadCapture, capture, unwrapped

from .generator import Program

_SEQ = [0]
os.environ["GRAPHMEND_CACHE"] = "0"  # every program is mended, and nothing is kept of its temporary files


def load(program: Program, folder: str) -> Any:
    """Write the program to ``folder`` and import it under a unique name."""
    _SEQ[0] += 1
    name = f"graphmend_fuzz_{program.digest}_{_SEQ[0]}"
    path = os.path.join(folder, name + ".py")
    with open(path, "w") as fh:
        fh.write(program.source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def unload(module: Any) -> None:
    sys.modules.pop(module.__name__, None)
    linecache.checkcache(module.__file__)


def inputs_for(seed: int) -> list[torch.Tensor]:
    """Inputs that take both sides of every generated test: mixed signs, all
    negative, all positive, zeros, large (fp16 overflow), inf, nan, small."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(2, 4, generator=gen) * 2
    inf, nan = base.clone(), base.clone()
    inf[0, 1] = float("inf")
    nan[1, 2] = float("nan")
    return [base, -base.abs() - 0.1, base.abs() + 0.5, torch.zeros(2, 4), base * 1e4, inf, nan, base * 0.1]


class CountingBackend:
    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        self.graphs += 1
        return gm.forward


@contextlib.contextmanager
def _captured(obs: Observation, threads: ThreadCapture | None = None):
    """stdout, stderr, log records (not torch's own) and warnings of the block, into ``obs``;
    with ``threads``, this thread's only (the arm made the caches fresh for all threads)."""
    with (threads.capturing() if threads is not None else capture()) as cap, (
        fresh_once_caches() if threads is None else contextlib.nullcontext()
    ):
        yield
    obs.stdout, obs.stderr, obs.records, obs.warnings = cap.stdout, cap.stderr, cap.records, cap.warnings


# graphmend.compile's own notices to the user (api.py), made by a first call that mends:
# "could not mend ... compiling it unchanged", "N graphs but no graph break in Dynamo's log".
_NOTICE = re.compile(r"graphmend: (could not mend|\d+ graphs but no graph break)")


def call(
    fn: Callable,
    state_of: torch.nn.Module,
    x: torch.Tensor,
    *,
    region: bool,
    grad: bool,
    threads: ThreadCapture | None = None,
    notices: list[str] | None = None,
) -> Observation:
    """One observed call: output (plus gradients under grad), exception, state, effects.

    ``threads``: the call's effects are its thread's (the threads arm).
    ``notices``: a ``graphmend.compile`` arm; graphmend's own notices of a mend
    (``_NOTICE``) are taken out of the warnings into this list."""
    obs = Observation()
    arg = x.clone().requires_grad_(grad)
    with _captured(obs, threads), (torch.enable_grad() if grad else torch.no_grad()):
        try:
            with runtime.region() if region else contextlib.nullcontext():
                result = fn(arg)
            obs.output = _detach(result)
            if grad:
                obs.output = (obs.output, _gradients(result, arg, state_of))
        except Exception as exc:  # the exception is part of the behaviour
            obs.exception = (type(exc).__qualname__, str(exc))
    # Dynamo runs the code after a graph break as `torch_dynamo_resume_in_<fn>_at_<line>`:
    # a log record made there names that function. Its name, not the record, is the backend's.
    obs.records = [(*r[:4], _function_name(r[4]), *r[5:]) for r in obs.records]
    # graphmend's own notice that the backend failed on a graph (which then ran as captured)
    FALLBACKS["warnings"] += sum(w[0] == "BackendFallbackWarning" for w in obs.warnings)
    obs.warnings = [w for w in obs.warnings if w[0] != "BackendFallbackWarning"]
    if notices is not None:
        notices += [w[1] for w in obs.warnings if w[0] == "RuntimeWarning" and _NOTICE.match(w[1])]
        obs.warnings = [w for w in obs.warnings if not (w[0] == "RuntimeWarning" and _NOTICE.match(w[1]))]
    obs.state = _zero_dim(module_state(state_of))
    obs.output = _zero_dim(obs.output)
    return obs


FALLBACKS: Counter = Counter()


def _zero_dim(value: Any) -> Any:
    """Wrap 0-dim tensors so ``compare`` checks their bits: ``verify._bits_equal``
    cannot view a 0-dim tensor as bytes and falls back to ``torch.equal``,
    which calls two NaNs different (tests/test_fuzz_regressions.py: the zero-dim NaN pair)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return ("0-dim", value.reshape(1))
    if isinstance(value, dict):
        return {k: _zero_dim(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_zero_dim(v) for v in value)
    return value


def _gradients(result: Any, arg: torch.Tensor, module: torch.nn.Module) -> dict[str, Any]:
    outs = [t for t in tensors_in(result) if t.requires_grad]
    if not outs:
        return {"backward": "no output requires grad"}
    sum(t.float().sum() for t in outs).backward()
    grads = {"x": arg.grad}
    for name, param in module.named_parameters():
        grads[name] = param.grad
        param.grad = None
    return _detach(grads)


def _close(a: Observation, b: Observation) -> list[str]:
    """Inductor: values to a tolerance (also the numbers in printed, logged and
    warned text: a fused graph reduces in another order), everything else exactly."""
    diffs = [d for d in compare(a, _texts_within_tolerance(a, b)) if "values differ" not in d]
    for x, y in zip(tensors_in(a.output), tensors_in(b.output)):
        if x.shape == y.shape and not torch.allclose(x.double(), y.double(), rtol=1e-3, atol=1e-3, equal_nan=True):
            diffs.append("output: values differ beyond tolerance")
    return diffs


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:inf|nan)")


def _numbers_close(x: str, y: str) -> bool:
    """The same text with every number equal to the Inductor output tolerance."""
    if x == y:
        return True
    if _NUMBER.sub("#", x) != _NUMBER.sub("#", y):
        return False
    a = torch.tensor([float(n) for n in _NUMBER.findall(x)], dtype=torch.float64)
    b = torch.tensor([float(n) for n in _NUMBER.findall(y)], dtype=torch.float64)
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-3, atol=1e-3, equal_nan=True))


def _texts_within_tolerance(a: Observation, b: Observation) -> Observation:
    """``b`` with each text that matches ``a``'s to the tolerance replaced by ``a``'s."""

    def pick(x: str, y: str) -> str:
        return x if _numbers_close(x, y) else y

    def message_at(xs: list, ys: list, index: int) -> list:  # records: the message is last; warnings: second
        out = list(ys)
        for k, (x, y) in enumerate(zip(xs, ys)):
            i = index % len(y)
            if len(x) == len(y) and x[:i] + x[i + 1:] == y[:i] + y[i + 1:]:
                out[k] = (*y[:i], pick(x[i], y[i]), *y[i + 1:])
        return out

    return dataclasses.replace(
        b,
        stdout=pick(a.stdout, b.stdout),
        stderr=pick(a.stderr, b.stderr),
        records=message_at(a.records, b.records, -1),
        warnings=message_at(a.warnings, b.warnings, 1),
    )


@dataclass
class Result:
    digest: str
    status: str  # checked | invalid (no input runs eagerly) | mend-error | harness-error | crashed (the process died)
    mismatches: list[str] = field(default_factory=list)
    backend_differences: list[str] = field(default_factory=list)
    known: list[str] = field(default_factory=list)  # mismatches of a known bug with an xfail regression test
    torch_bug: list[str] = field(default_factory=list)  # differences from a call torch's format bug failed (_FORMAT_CRASH)
    documented: list[str] = field(default_factory=list)  # grad_fn text, in-place error's node (docs/limits.md)
    outcomes: list[tuple[str, str, str, str]] = field(default_factory=list)  # category, rule, status, reason
    detail: str = ""
    graphs: tuple[int, int] = (0, 0)  # graphs on the example input, before and after mending (the report's)
    kept: list[str] = field(default_factory=list)  # the report's graph breaks kept before held asserts (barriers.py)
    fallbacks: int = 0  # graphs the backend failed on, run as captured (graphmend.with_fallback)
    arms: list[str] = field(default_factory=list)  # the arms that ran
    grad_report: bool | None = None  # compile+grad: the report's grad mode (None: no report)
    notices: list[str] = field(default_factory=list)  # graphmend.compile's notices in the compile+grad / threads arms
    mend_errors: list[str] = field(default_factory=list)  # a mend that failed in those arms (not "raised eagerly")
    left: list[str] = field(default_factory=list)  # threads: what graphmend left in place of sys.stdout / stderr / Logger.handle


def _series(
    make: Callable[[], tuple[Callable, torch.nn.Module]],
    xs: list[torch.Tensor],
    *,
    region: bool,
    grad: bool,
    notices: list[str] | None = None,
) -> list[Observation]:
    # Dynamo warns some things once per process (utils.warn_once: "does not know how to trace
    # the builtin `time.time`"): each series starts as a fresh process would, so the control
    # series of the original shows what the mended one showed when Dynamo does it to both.
    torch._dynamo.utils.warn_once_cache.clear()
    fn, state_of = make()
    return [call(fn, state_of, x, region=region, grad=grad, notices=notices) for x in xs]


THREADS = 2
THREAD_TIMEOUT = 600.0  # seconds for the whole threaded series (both threads' mends included)...
# ...unless the process kept working through it: a machine whose cores another job holds makes
# the threads slow, not stuck. A deadlock uses no CPU; a loop that never ends is stopped here:
THREAD_GIVE_UP = 3600.0
WORKING_CPU_S = 30.0  # CPU seconds per THREAD_TIMEOUT that count as still working
# A check that never returns even so: a deadlock in which a blocked thread holds the GIL (torch's
# traceback free list at thread exit, docs/torch-issues.md) keeps the wait above from waking.
# faulthandler's timer needs no GIL: it writes every thread's stack to stderr and exits the
# process, and run_parallel starts the worker again after the program, counted as crashed.
PROGRAM_GIVE_UP = THREAD_GIVE_UP + 1800.0
# What a threads arm that never finished left running: the program, the threads' stacks.
# graphmend's locks may be held by them, so nothing more is checked in this process.
STUCK: list[str] = []


def _named(value: Any) -> str:
    if value is None:
        return "nothing"
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"


_CONFIG = ("capture_scalar_outputs", "capture_dynamic_output_shape_ops")  # what graphmend turns on around calls


def _process_state() -> dict[str, Any]:
    """What graphmend changes process-wide while it runs, and must put back: the hooks it
    wraps (``warnings._showwarnmsg``, the log record factory), a ``findCaller`` it sets on
    a logger while it performs a deferred record, the Dynamo flags of a mending's capture."""
    state: dict[str, Any] = {
        "warnings._showwarnmsg": unwrapped(warnings._showwarnmsg),  # graphmend's wrappers stay, passing through
        "logging record factory": unwrapped(logging.getLogRecordFactory()),
    }
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and "findCaller" in vars(logger):
            state[f"logger {name!r} findCaller"] = vars(logger)["findCaller"]
    for key in _CONFIG:
        state[f"torch._dynamo.config.{key}"] = getattr(torch._dynamo.config, key)
    return state


def _put_back(name: str, value: Any) -> None:
    if name == "warnings._showwarnmsg":
        warnings._showwarnmsg = value
    elif name == "logging record factory":
        logging.setLogRecordFactory(value)
    elif name.startswith("logger "):
        logger = logging.getLogger(name.split("'")[1])
        if value is None:
            vars(logger).pop("findCaller", None)
        else:
            logger.findCaller = value
    else:
        setattr(torch._dynamo.config, name.rsplit(".", 1)[1], value)


@contextlib.contextmanager
def _hooks_kept(left: list[str]):
    """``_process_state()`` as it was before the block, after it; what differed goes to
    ``left``. (``ThreadCapture`` does the same for the streams and ``Logger.handle``.)
    A wrapper or a flag left behind would reach every later program."""
    saved = _process_state()
    try:
        yield
    finally:
        now = _process_state()
        for name in sorted(set(saved) | set(now)):
            was, found = saved.get(name), now.get(name)
            if was is found or (isinstance(was, bool) and was == found):
                continue
            left.append(f"{name}: {found if isinstance(found, bool) else _named(found)} (was {was if isinstance(was, bool) else _named(was)})")
            _put_back(name, was)


def _threaded(
    make: Callable[[], tuple[Callable, torch.nn.Module]],
    xs: list[torch.Tensor],
    *,
    notices: list[str] | None = None,
    left: list[str] | None = None,
) -> list[list[Observation]]:
    """``THREADS`` threads, each with its own ``make()``, started together (a barrier), each
    calling its own on every input in turn without grad; the series of each, observed on
    its own thread. Raises ``TimeoutError`` (with the threads' stacks) when one never ends.
    ``left``: what was left in place of ``sys.stdout`` / ``sys.stderr`` / ``Logger.handle``
    once both threads had ended."""
    torch._dynamo.utils.warn_once_cache.clear()
    made = [make() for _ in range(THREADS)]
    series: list[list[Observation]] = [[] for _ in range(THREADS)]
    errors: list[str] = []
    capture_threads = ThreadCapture()
    barrier = threading.Barrier(THREADS)

    def work(k: int) -> None:
        fn, state_of = made[k]
        try:
            barrier.wait(timeout=THREAD_TIMEOUT)
            for x in xs:
                series[k].append(call(fn, state_of, x, region=False, grad=False, threads=capture_threads, notices=notices))
        except Exception as exc:  # a harness error: reported by the arm
            errors.append(f"thread {k + 1}: {type(exc).__name__}: {exc}")

    workers = [threading.Thread(target=work, args=(k,), name=f"graphmend-fuzz-{k + 1}", daemon=True) for k in range(THREADS)]
    with _hooks_kept(capture_threads.left), fresh_once_caches(), capture_threads.installed():
        for worker in workers:
            worker.start()
        waited, cpu_used = _join_while_working(workers)
    alive = [w for w in workers if w.is_alive()]
    if alive:
        frames = sys._current_frames()
        stacks = [f"{w.name}:\n" + "".join(traceback.format_stack(frames[w.ident])) for w in alive if w.ident in frames]
        STUCK.append("\n".join(stacks))
        raise TimeoutError(
            f"{len(alive)} thread(s) did not finish in {waited:.0f} s "
            f"(the process used {cpu_used:.1f} s of CPU in the last {THREAD_TIMEOUT:.0f} s)\n" + "\n".join(stacks)
        )
    if errors:
        raise RuntimeError("; ".join(errors))
    if left is not None:
        # What replaced the capture's streams or logging hook and was still there when both
        # threads had ended (put back by the capture): a wrapper graphmend left behind.
        left += capture_threads.left
    return series


def _join_while_working(workers: list[threading.Thread]) -> tuple[float, float]:
    """Wait for ``workers`` in spans of ``THREAD_TIMEOUT``, going on while the process used
    ``WORKING_CPU_S`` of CPU in the last span, up to ``THREAD_GIVE_UP``. Returns the seconds
    waited and the CPU seconds of the last span."""
    start = time.monotonic()
    while True:
        span_cpu, span_end = time.process_time(), time.monotonic() + THREAD_TIMEOUT
        for worker in workers:
            worker.join(max(0.0, span_end - time.monotonic()))
        waited, cpu_used = time.monotonic() - start, time.process_time() - span_cpu
        if not any(w.is_alive() for w in workers) or cpu_used < WORKING_CPU_S or waited >= THREAD_GIVE_UP:
            return waited, cpu_used


def _first_valid(pristine: torch.nn.Module, xs: list[torch.Tensor], start: int) -> int | None:
    for k in range(len(xs)):
        i = (start + k) % len(xs)
        obs = call(copy.deepcopy(pristine), pristine, xs[i], region=False, grad=False)
        if obs.exception is None:
            return i
    return None


def check_program(
    program: Program,
    *,
    seed: int = 0,
    start: int = 0,
    grad: bool = False,
    inductor: bool = False,
    aot: bool = True,
    threads: bool = False,
    folder: str | None = None,
) -> Result:
    own = folder is None
    folder = folder or tempfile.mkdtemp(prefix="graphmend-fuzz-")
    module = load(program, folder)
    try:
        return _check(module, program, seed=seed, start=start, grad=grad, inductor=inductor, aot=aot, threads=threads)
    finally:
        if not STUCK:  # else a stuck thread may hold graphmend's locks: unmend would wait for ever
            graphmend.unmend()
            torch._dynamo.reset()
        unload(module)
        if own:
            for name in os.listdir(folder):
                os.remove(os.path.join(folder, name))
            os.rmdir(folder)


def _check(module: Any, program: Program, *, seed: int, start: int, grad: bool, inductor: bool, aot: bool, threads: bool) -> Result:
    result = Result(program.digest, "checked")
    torch.manual_seed(0)
    pristine = module.Model()
    pristine.eval()
    xs = inputs_for(seed)
    example = _first_valid(pristine, xs, start)
    if example is None:
        result.status = "invalid"
        return result

    def fresh(compiler: Callable | None = None) -> Callable[[], tuple[Callable, torch.nn.Module]]:
        def make() -> tuple[Callable, torch.nn.Module]:
            model = copy.deepcopy(pristine)
            return (compiler(model) if compiler else model), model

        return make

    grad_xs = [xs[i] for i in (0, 1, 2, 7)]
    reference = _series(fresh(), xs, region=False, grad=False)
    grad_reference = _series(fresh(), grad_xs, region=False, grad=True) if grad else []

    # Mend through the public API: graphmend.compile with the example input.
    mended_model = copy.deepcopy(pristine)
    counting = CountingBackend()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():  # graphmend.compile mends in the grad mode it is called in: inference
            compiled = graphmend.compile(mended_model, backend=counting, example_inputs=(xs[example].clone(),))
    if compiled.report is None:
        result.status = "mend-error"
        result.detail = "; ".join(str(w.message) for w in caught if "graphmend" in str(w.message))
        return result
    result.outcomes = [
        (o.category, o.rule or "-", GONE if o.status != "applied" and _GONE_NOTE in o.notes else o.status, o.reason)
        for o in compiled.report.outcomes
    ]
    result.graphs = (compiled.report.before.graphs, compiled.report.after.graphs)
    result.kept = list(compiled.report.kept)

    arms: dict[str, tuple[list[Observation], list[Observation]]] = {}
    fallbacks_before = FALLBACKS["warnings"]
    arms["eager"] = (reference, _series(fresh(), xs, region=True, grad=False))
    arms["counting"] = (reference, _series(lambda: (compiled, mended_model), xs, region=False, grad=False))
    if aot:
        arms["aot_eager"] = (reference, _series(fresh(_aot), xs, region=True, grad=False))
    if grad:
        arms["eager+grad"] = (grad_reference, _series(fresh(), grad_xs, region=True, grad=True))
        if aot:
            arms["aot_eager+grad"] = (grad_reference, _series(fresh(_aot), grad_xs, region=True, grad=True))
    if inductor:
        arms["inductor"] = (reference, _series(fresh(_inductor), xs, region=True, grad=False))

    result.fallbacks = FALLBACKS["warnings"] - fallbacks_before
    graphmend.unmend()
    torch._dynamo.reset()

    # graphmend.compile as a user calls it, on the original code again: no example
    # inputs, so the first call mends, in that call's grad mode and on that call's thread.
    def compiled_fresh(notices: list[str], made: list[Any]) -> Callable[[], tuple[Callable, torch.nn.Module]]:
        def make() -> tuple[Callable, torch.nn.Module]:
            model = copy.deepcopy(pristine)
            made.append(graphmend.compile(model, backend=CountingBackend()))
            return made[-1], model

        return make

    if grad:
        made: list[Any] = []
        got = _series(compiled_fresh(result.notices, made), grad_xs, region=False, grad=True, notices=result.notices)
        arms["compile+grad"] = (grad_reference, got)
        result.arms.append("compile+grad")
        report = made[0].report
        result.grad_report = None if report is None else report.grad
        if report is not None and report.grad is not True:
            result.mismatches.append(f"compile+grad: the report of a mend under grad says grad={report.grad!r}")
        graphmend.unmend()
        torch._dynamo.reset()
    if threads:
        made = []
        notices: list[str] = []
        try:
            arms["threads"] = (reference, _threaded(compiled_fresh(notices, made), xs, notices=notices, left=result.left))
        except TimeoutError as exc:
            result.mismatches.append(f"threads: {exc}")
            return result
        result.arms.append("threads")
        result.notices += notices
        for compiled_copy in made:
            if compiled_copy.report is not None and compiled_copy.report.grad is not False:
                result.mismatches.append(f"threads: the report of a mend without grad says grad={compiled_copy.report.grad!r}")
        graphmend.unmend()
        torch._dynamo.reset()
    # A mend that failed in those arms (not a first call that raised eagerly: the documented retry).
    result.mend_errors = [n for n in result.notices if n.startswith("graphmend: could not mend") and _RAISED_EAGERLY not in n]

    suspects: dict[str, list[str]] = {}
    for arm, (expected, got) in arms.items():
        diff = _arm_differences(arm, expected, got)
        if diff:
            suspects[arm] = diff
    for arm, diff in suspects.items():
        if arm != "eager" and any(_HOOK_SILENCED in d for d in diff):
            result.known += diff
            continue
        if arm == "inductor" and release().emulated_casts_miss_overflow and "float16" in program.source:
            result.torch_bug += diff  # torch 2.12: an fp16 overflow test fused sees fp32 (compat, docs/torch-issues.md)
            continue
        if arm != "eager":
            diff = _apart_from_format_crash(arm, arms[arm][1], diff, result)
            if not diff:
                continue
        expected, got = arms[arm]
        if "grad" in arm:
            # A tensor printed at a graph break is a compiled graph's output: under AOTAutograd its
            # text names `CompiledFunctionBackward` where eager names the op, for the original under
            # torch.compile too. In the eager and counting-backend arms only the name may differ,
            # for a tensor a [Where] select made (docs/limits.md); the text must still show it.
            # And an autograd in-place error may name another saved tensor: a select's output is a new
            # tensor, so a later in-place update no longer changes what the branch's op saved (docs/limits.md).
            names_only = arm != "aot_eager+grad"
            stripped = _differences(
                arm,
                [_inplace_error_unnamed(_without_grad_fn(o, names_only)) for o in expected],
                [_inplace_error_unnamed(_without_grad_fn(o, names_only)) for o in got],
            )
            result.documented += [d for d in diff if d not in stripped]
            diff = stripped
        if arm.startswith("eager") or not diff:
            result.mismatches += diff
            continue
        if arm == "aot_eager+grad" and any(_INPLACE_AUTOGRAD in (o.exception or ("", ""))[1] for o in expected):
            # Eager autograd refuses an in-place change of a saved tensor; a compiled graph
            # functionalizes it and succeeds. That is torch.compile's behaviour, not a rewrite's.
            result.backend_differences += diff
            continue
        # The same backend on the unmended original: a difference it shows too is the backend's.
        g = "grad" in arm
        backend = _BACKENDS[_CONTROL.get(arm, arm.split("+")[0])]
        if arm == "threads":
            def seen_in(controls: list) -> set[str]:
                return {d for k in range(THREADS) for c in controls for d in _differences(f"threads, thread {k + 1}", expected, c)}

            torch._dynamo.reset()  # as the mended arm started
            controls = _threaded(fresh(backend), xs)
            seen = seen_in(controls)
            if any(d not in seen for d in diff):
                controls += _patient(lambda: _threaded(fresh(backend), xs))
                seen = seen_in(controls)
            diff, moved = _warning_lines_as_controls(arm, expected, got, diff, controls)
            result.backend_differences += moved + [d for d in diff if d in seen]
            result.mismatches += [d for d in diff if d not in seen]
            continue
        def original() -> list:
            return _series(fresh(backend), grad_xs if g else xs, region=False, grad=g)

        def compared(outcomes: list) -> list:  # under grad: the in-place error's node name and grad_fn text left out
            return [_inplace_error_unnamed(_without_grad_fn(o)) for o in outcomes] if g else outcomes

        control = original()
        diff = _apart_from_format_crash(arm, control, diff, result)  # where the original failed so, no control
        if arm == "compile+grad":
            # The counting backend runs the captured graphs eagerly (no AOTAutograd): compared
            # as the eager+grad arm is, to the bit; printed grad_fn names left out.
            control = [_without_grad_fn(o, names_only=True) for o in control]
            expected = [_without_grad_fn(o, names_only=True) for o in expected]
            seen = set(_differences(arm, expected, control))
            result.backend_differences += [d for d in diff if d in seen]
            result.mismatches += [d for d in diff if d not in seen]
            continue
        if g:
            # Under AOTAutograd an in-place change of a tensor a compiled graph saved fails
            # the backward where eager autograd, which saves less, succeeds. The error names
            # the node that saved it, which depends on where the graphs were cut: when the
            # original under this backend fails the same way, so does the mended program.
            control = compared(control)
            expected = [_without_grad_fn(o) for o in expected]
            got = compared(got)
            diff = _differences(arm, expected, got)
            for series in (got, control):
                diff = _apart_from_format_crash(arm, series, diff, result)
            # AOTAutograd applies an in-place change of a graph input that requires grad after
            # the graph, and its backward adds a +0.0: an input gradient of -0.0 comes back +0.0
            # (torch 2.13, no graphmend needed: test_fuzz_regressions.py). The eager+grad arm
            # still holds the mended program's own gradients to every bit.
            unsigned = _differences(arm, [_zero_grads_unsigned(o) for o in expected], [_zero_grads_unsigned(o) for o in got])
            result.backend_differences += [d for d in diff if d not in unsigned]
            diff = unsigned
            if "eager+grad" not in suspects:
                # One compiled graph that uses a parameter several times sums its gradient in
                # AOTAutograd's joint graph, in another order than eager autograd: the bits can
                # differ where the original, cut into more graphs, matched (torch 2.13, no
                # graphmend needed: test_fuzz_regressions.py). With the eager+grad arm exact to
                # the bit, a gradient within float rounding of eager's is the backend's.
                rounded = _differences(arm, expected, [_grads_rounded_to(e, o) for e, o in zip(expected, got)])
                result.backend_differences += [d for d in diff if d not in rounded]
                diff = rounded
        seen = set(_differences(arm, expected, control))
        controls = [control]
        if any(d not in seen for d in diff):
            controls.append(compared(_patient(original)))
            seen |= set(_differences(arm, expected, controls[-1]))
        diff, moved = _warning_lines_as_controls(arm, expected, got, diff, controls)
        result.backend_differences += moved
        result.backend_differences += [d for d in diff if d in seen]
        result.mismatches += [d for d in diff if d not in seen]
    result.torch_bug = list(dict.fromkeys(result.torch_bug))
    return result


# torch 2.14+ (compat: symbolic_format_crashes, pytorch #197093): Dynamo fails a format
# spec on a float it made symbolic with InternalTorchDynamoError. The original fails the
# same way under torch.compile (tests/test_compat.py), on lines graphmend leaves as written;
# which calls reach it depends on where the graphs were cut and on the recompiles before,
# and what the failed call had done stays done. So from the call it fails on, a series is
# counted apart (the summary says how many programs), not compared.
_FORMAT_CRASH = ("InternalTorchDynamoError", "Unknown format code")
_DIFF_CALL = re.compile(r"^(.*), call (\d+): ")


def _apart_from_format_crash(arm: str, series: Any, diff: list[str], result: Result) -> list[str]:
    """``diff`` less the differences from the call on which ``series`` (the mended
    program's, or the original's: then there is no control) met torch's format bug;
    those go to ``result.torch_bug``."""
    if not release().symbolic_format_crashes:
        return diff
    failed_from = _format_crash_calls(arm, series)
    apart = [d for d in diff for series, call in [_call_of(d)] if call >= failed_from.get(series, sys.maxsize)]
    result.torch_bug += apart
    return [d for d in diff if d not in apart]


def _format_crash_calls(arm: str, got: Any) -> dict[str, int]:
    """Each series of ``arm`` (one per thread for ``threads``) -> the first call torch's
    format bug failed, as ``_differences`` names the series and numbers the calls."""
    named = {f"threads, thread {k + 1}": series for k, series in enumerate(got)} if arm == "threads" else {arm: got}
    first = {}
    for name, series in named.items():
        for k, o in enumerate(series):
            if o.exception and o.exception[0] == _FORMAT_CRASH[0] and _FORMAT_CRASH[1] in o.exception[1]:
                first[name] = k + 1
                break
    return first


def _call_of(difference: str) -> tuple[str, int]:
    """(the series, the call number) a ``_differences`` line names; ("", 0) for none."""
    found = _DIFF_CALL.match(difference)
    return (found.group(1), int(found.group(2))) if found else ("", 0)


# Dynamo gives up on a frame after config.recompile_limit (8) recompiles and runs it
# eagerly from then on. The mended program, with fewer frames and recompiles, may still
# compile at a call where the original already ran eagerly; a difference the original
# shows once Dynamo does not give up on it (torch 2.15's compiled torch._assert raises
# RuntimeError, eager AssertionError) is the backend's, not a rewrite's.
PATIENT_RECOMPILE_LIMIT = 64


def _patient(run: Callable[[], Any]) -> Any:
    """``run()`` with Dynamo compiling up to PATIENT_RECOMPILE_LIMIT times a frame."""
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=PATIENT_RECOMPILE_LIMIT):
            return run()
    finally:
        torch._dynamo.reset()


_INPLACE_AUTOGRAD = "modified by an inplace operation"
_RAISED_EAGERLY = "it raised eagerly on each of its first"
# The backend of an arm's control when the arm's name is not one (both compile with counting).
_CONTROL = {"compile+grad": "counting", "threads": "counting"}
_GRAD_FN = re.compile(r",\s*grad_fn=<\w+>|,\s*requires_grad=True")
_GRAD_FN_NAME = re.compile(r",\s*grad_fn=<\w+>")  # with the break before it: torch wraps by the name's length


def _without_grad_fn(obs: Observation, names_only: bool = False) -> Observation:
    """``obs`` with printed ``grad_fn=<...>`` / ``requires_grad=True`` left out, or with
    ``names_only`` the grad_fn's name only (docs/limits.md: a tensor a [Where] select
    made prints the select's backward)."""
    def strip(text: str) -> str:
        return _GRAD_FN_NAME.sub(", grad_fn=<>", text) if names_only else _GRAD_FN.sub("", text)

    return Observation(
        output=obs.output,
        exception=obs.exception,
        state=obs.state,
        stdout=strip(obs.stdout),
        stderr=strip(obs.stderr),
        records=[(*r[:-1], strip(r[-1])) for r in obs.records],
        warnings=[(w[0], strip(w[1]), *w[2:]) for w in obs.warnings],
    )


def _zero_grads_unsigned(obs: Observation) -> Observation:
    """``obs`` with every zero in its gradients made +0.0 (``g + 0.0``; other values keep their bits)."""
    if not (isinstance(obs.output, tuple) and len(obs.output) == 2 and isinstance(obs.output[1], dict)):
        return obs

    def unsigned(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value + 0.0
        if isinstance(value, tuple):
            return tuple(unsigned(v) for v in value)
        return value

    grads = {k: unsigned(v) for k, v in obs.output[1].items()}
    return dataclasses.replace(obs, output=(obs.output[0], grads))


def _grads_rounded_to(expected: Observation, got: Observation) -> Observation:
    """``got`` with each gradient that is within float rounding of ``expected``'s
    (``torch.testing.assert_close`` defaults for the dtype) replaced by it."""
    if not all(isinstance(o.output, tuple) and len(o.output) == 2 and isinstance(o.output[1], dict) for o in (expected, got)):
        return got

    def close(a: Any, b: Any) -> bool:
        a, b = (v[1] if isinstance(v, tuple) and v[:1] == ("0-dim",) else v for v in (a, b))
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        try:
            torch.testing.assert_close(b, a, equal_nan=True)
        except AssertionError:
            return False
        return True

    want = expected.output[1]
    grads = {k: (want[k] if k in want and close(want[k], v) else v) for k, v in got.output[1].items()}
    return dataclasses.replace(got, output=(got.output[0], grads))


def _line_moves(expected: Observation, got: Observation) -> set[tuple]:
    """The warnings of ``got`` that differ from ``expected``'s only by their line:
    ``(filename, expected line, got line)`` each."""
    if len(expected.warnings) != len(got.warnings):
        return set()
    return {(e[2], e[3], w[3]) for e, w in zip(expected.warnings, got.warnings) if e[:3] == w[:3] and e[3] != w[3]}


def _warning_lines_as_controls(
    arm: str, expected: list[Observation], got: Any, diff: list[str], controls: list[list[Observation]]
) -> tuple[list[str], list[str]]:
    """``diff`` (of ``got``, shaped as for ``_arm_differences``) split into what stays and
    the warnings the backend moved to another line.

    Dynamo runs a graph break's call (``warnings.warn``) from the transformed code of
    the resume function, whose line table puts it on the line the function resumes at
    (the break before it) once that code is compiled (plain ``torch.compile`` on 2.12.1
    to 2.15.0, measured; docs/torch-issues.md). From which call on depends on the
    compile history, which a mend, or a first call that raised eagerly, changes. A
    warning that differs from eager's only by a line the unmended controls moved it to
    as well (same file, same lines, at any call) is the backend's."""
    moves = {m for control in controls for e, c in zip(expected, control) for m in _line_moves(e, c)}
    if not moves:
        return diff, []

    def relined(series: list[Observation]) -> list[Observation]:
        out = []
        for e, o in zip(expected, series):
            if len(e.warnings) == len(o.warnings) and _line_moves(e, o) <= moves:
                o = dataclasses.replace(o, warnings=[(*w[:3], x[3]) if w[:3] == x[:3] else w for x, w in zip(e.warnings, o.warnings)])
            out.append(o)
        return out

    kept = set(_arm_differences(arm, expected, [relined(s) for s in got] if arm == "threads" else relined(got)))
    return [d for d in diff if d in kept], [d for d in diff if d not in kept]


def _inplace_error_unnamed(obs: Observation) -> Observation:
    if obs.exception is None or _INPLACE_AUTOGRAD not in obs.exception[1]:
        return obs
    return dataclasses.replace(obs, exception=(obs.exception[0], f"{_INPLACE_AUTOGRAD} (a tensor a graph saved)"))


# api.compile closed the region in an always_call forward hook, whose exception torch
# silences when the forward raised (tests/rules/test_trap.py::test_trapped_check_wins...).
_HOOK_SILENCED = "raised an exception that was silenced as another error was raised in forward"


# The backends compile as graphmend.compile does: a graph the backend fails on runs as
# captured (src/graphmend/rewrite/fallback.py). Counted in the summary, never hidden.
def _aot(model: torch.nn.Module) -> Callable:
    return torch.compile(model, backend=graphmend.with_fallback("aot_eager"))


def _inductor(model: torch.nn.Module) -> Callable:
    # Inductor skips the rounding of an intermediate low-precision cast unless
    # told to emulate it: a value that a graph break used to materialise in
    # fp16 (and that a print shows) is then fp32 inside the fused graph. Both
    # arms, the mended program and the control, compile this way.
    return torch.compile(model, backend=graphmend.with_fallback("inductor", options={"emulate_precision_casts": True}))


_BACKENDS = {
    "counting": lambda model: torch.compile(model, backend=CountingBackend()),
    "aot_eager": _aot,
    "inductor": _inductor,
}


def _arm_differences(arm: str, expected: list[Observation], got: Any) -> list[str]:
    """``_differences``; for ``threads``, of each thread's series (``got``: one per thread)."""
    if arm == "threads":
        return [d for k, series in enumerate(got) for d in _differences(f"threads, thread {k + 1}", expected, series)]
    return _differences(arm, expected, got)


def _differences(arm: str, expected: list[Observation], got: list[Observation]) -> list[str]:
    out = []
    for i, (a, b) in enumerate(zip(expected, got)):
        diff = _close(a, b) if arm == "inductor" else compare(a, b)
        out += [f"{arm}, call {i + 1}: {d}" for d in diff]
    return out


# --------------------------------------------------------------------------
# many programs


_MASKS = [
    (re.compile(r"`[^`]*`"), "`...`"),
    (re.compile(r"'[^']*'"), "'...'"),
    (re.compile(r"\([^()]*;\s*names\)"), "(...)"),
    (re.compile(r"\d+"), "N"),
]


GONE = "gone"  # a site no rule mended whose break another site's mend removed (a site inside a mended branch)


def reason_class(reason: str) -> str:
    """A decline reason with names and numbers masked, for counting."""
    for pattern, repl in _MASKS:
        reason = pattern.sub(repl, reason)
    return reason.split(": verification found")[0][:110]


_HELD_REASON = "an assert that may be on tensor values stays in the graph"  # passes/held.py


@dataclass
class Summary:
    programs: int = 0
    checked: int = 0
    invalid: int = 0
    mend_errors: list[str] = field(default_factory=list)
    harness_errors: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)  # programs a worker process died checking (a signal)
    mismatches: list[tuple[str, list[str]]] = field(default_factory=list)
    backend_differences: int = 0
    backend_examples: list[str] = field(default_factory=list)
    known: list[tuple[str, list[str]]] = field(default_factory=list)
    torch_bug: list[tuple[str, list[str]]] = field(default_factory=list)
    reverted: list[str] = field(default_factory=list)
    held_breaks: int = 0  # programs with a graph break kept before an assert compiled into the graph
    held_reverted: int = 0  # programs whose record-making rewrites were reverted instead
    documented: int = 0
    fallbacks: int = 0
    arm_programs: Counter = field(default_factory=Counter)  # programs that ran each of the arms below
    grad_reports: Counter = field(default_factory=Counter)  # compile+grad: the report's grad mode (None: no report)
    gave_up: int = 0  # programs where a graphmend.compile arm gave up: the first calls raised eagerly
    left: list[str] = field(default_factory=list)  # threads: a wrapper of sys.stdout / stderr / logging graphmend left behind
    status: Counter = field(default_factory=Counter)
    declined: Counter = field(default_factory=Counter)
    graphs_before: int = 0
    graphs_after: int = 0
    seconds: float = 0.0

    def add(self, result: Result) -> None:
        self.programs += 1
        if result.status == "invalid":
            self.invalid += 1
            return
        if result.status == "mend-error":
            self.mend_errors.append(f"{result.digest}: {result.detail}")
            return
        if result.status == "harness-error":
            self.harness_errors.append(f"{result.digest}: {result.detail}")
            return
        if result.status == "crashed":
            self.crashes.append(f"{result.digest}: {result.detail}")
            return
        self.checked += 1
        self.arm_programs.update(result.arms)
        if "compile+grad" in result.arms:
            self.grad_reports[result.grad_report] += 1
        self.mend_errors += [f"{result.digest}: {e}" for e in result.mend_errors]
        self.gave_up += any(_RAISED_EAGERLY in n for n in result.notices)
        if result.left:
            self.left.append(f"{result.digest}: {'; '.join(result.left)}")
        self.graphs_before += result.graphs[0]
        self.graphs_after += result.graphs[1]
        for category, rule, status, reason in result.outcomes:
            self.status[(rule, status)] += 1
            if status != "applied":
                self.declined[f"{status} [{rule}] {reason_class(reason)}"] += 1
        if result.mismatches:
            self.mismatches.append((result.digest, result.mismatches))
        self.backend_differences += len(result.backend_differences)
        self.backend_examples += [f"{result.digest}: {d[:300]}" for d in result.backend_differences[:1]]
        self.documented += bool(result.documented)
        self.fallbacks += bool(result.fallbacks)
        if result.known:
            self.known.append((result.digest, result.known))
        if result.torch_bug:
            self.torch_bug.append((result.digest, result.torch_bug))
        self.held_breaks += any(k.startswith("a graph break goes before") for k in result.kept)
        held_reverted = any(k.startswith("the rewrites that record") for k in result.kept)
        self.held_reverted += held_reverted
        if any(status == "reverted" and not (held_reverted and _HELD_REASON in reason) for _, _, status, reason in result.outcomes):
            self.reverted.append(result.digest)

    def merge(self, other: "Summary") -> None:
        """Add another worker's summary (``seconds`` is left to the caller: wall time)."""
        for name, value in vars(other).items():
            mine = getattr(self, name)
            if name == "seconds":
                continue
            if isinstance(mine, Counter):
                mine.update(value)
            elif isinstance(mine, list):
                mine.extend(value)
            else:
                setattr(self, name, mine + value)

    def render(self) -> str:
        applied = sum(n for (_, s), n in self.status.items() if s == "applied")
        not_applied = sum(n for (_, s), n in self.status.items() if s != "applied")
        rate = self.seconds / max(self.programs, 1)
        gone = sum(n for (_, s), n in self.status.items() if s == GONE)
        left = not_applied - gone
        lines = [
            f"programs tried: {self.programs} ({self.checked} checked, {self.invalid} with no input valid eagerly)"
            f" in {self.seconds:.0f} s ({rate:.2f} s/program)",
            f"sites mended: {applied}; sites not mended: {not_applied}, {gone} of them with their break removed by"
            f" another site's mend | graphs on the example input: {self.graphs_before} -> {self.graphs_after}",
            f"sites not mended with their break left: {left} of {applied + not_applied}"
            f" ({100 * left / max(applied + not_applied, 1):.1f}%)",
            "by rule and status: " + ", ".join(f"{r} {s} {n}" for (r, s), n in sorted(self.status.items())),
            "sites not mended, by reason:",
            *[f"  {n:6d}  {reason}" for reason, n in self.declined.most_common()],
            f"mend errors: {len(self.mend_errors)}",
            *[f"  {e}" for e in self.mend_errors[:10]],
            f"harness errors: {len(self.harness_errors)}",
            *[f"  {e}" for e in self.harness_errors[:10]],
            f"worker process crashes (a program it died on counts here, is not checked again, and the run goes on): {len(self.crashes)}",
            *[f"  {e}" for e in self.crashes[:10]],
            f"backend differences (the unmended original differs the same way): {self.backend_differences}",
            *[f"  {e}" for e in self.backend_examples[:5]],
            f"programs where verification reverted a rewrite (caught before use): {len(self.reverted)}",
            f"programs with a graph break kept before an assert compiled into the graph (barriers.py): {self.held_breaks};"
            f" with the rewrites that record reverted instead (fewer graphs): {self.held_reverted}",
            f"trapped check lost to a later error under graphmend.compile (fixed in 315036a; regression test): {len(self.known)} programs",
            f"known torch bugs (compat.TorchRelease): calls torch failed formatting a float it made symbolic"
            f" (pytorch #197093; the original fails so too), those series compared no further; an fp16 overflow"
            f" test Inductor fused on 2.12: {len(self.torch_bug)} programs",
            *[f"  {digest}: {diffs[0][:200]}" for digest, diffs in self.torch_bug[:3]],
            f"printed grad_fn text (aot_eager: a compiled graph's output; else the name, of a tensor a select made), "
            f"or the node an autograd in-place error names (a select's output is a new tensor): {self.documented} programs",
            f"programs where the backend failed on a graph, which ran as captured (graphmend.with_fallback): {self.fallbacks}",
            f"graphmend.compile with no example inputs, after unmend: compile+grad (the first call mends under grad)"
            f" on {self.arm_programs['compile+grad']} programs (report.grad True: {self.grad_reports[True]},"
            f" False: {self.grad_reports[False]}, no report: {self.grad_reports[None]});"
            f" threads ({THREADS} copies, first calls racing to mend) on {self.arm_programs['threads']} programs;"
            f" gave up mending (the first calls raised eagerly) on {self.gave_up}",
            f"threads arm: programs after which graphmend's wrapper was left as sys.stdout / sys.stderr /"
            f" Logger.handle (a deferral region and a mend's capture of two threads that ended out of order): {len(self.left)}",
            *[f"  {e}" for e in self.left[:3]],
            f"mismatches: {len(self.mismatches)}",
        ]
        for digest, diffs in self.mismatches[:20]:
            lines.append(f"  {digest}: {diffs[0]}" + (f" (+{len(diffs) - 1} more)" if len(diffs) > 1 else ""))
        return "\n".join(lines)


_DIED = re.compile(r"^# died: (.*)$", re.M)


def _died_checking(path: str, program: Program) -> str | None:
    """What ``path`` says killed the process that was checking ``program``; None when it
    holds another program or no ``# died:`` line (a process that was stopped, not killed)."""
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError:
        return None
    source = "\n".join(line for line in text.splitlines() if not line.startswith("# "))
    found = _DIED.search(text)
    return found.group(1) if found and source.strip() == program.source.strip() else None


def save_failure(folder: str, program: Program, result: Result, params: dict[str, Any], name: str | None = None) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name or f"fuzz_{program.digest}.py")
    notes = [f"# {key}={value!r}" for key, value in params.items()]
    notes += [f"# {result.status}: {line}" for line in (result.mismatches or [result.detail])[:30]]
    notes += [f"# left behind: {line}" for line in result.left] + [f"# mend error: {line}" for line in result.mend_errors]
    notes = [f"# {part}" if k else part for note in notes for k, part in enumerate(note.splitlines())]  # a stack: one note
    with open(path, "w") as fh:
        fh.write("\n".join(notes) + "\n" + program.source)
    return path


def run_many(
    count: int,
    *,
    seed: int | None = None,
    grad_every: int = 3,
    inductor_every: int = 0,
    aot_every: int = 1,
    threads_every: int = 0,
    max_statements: int = 6,
    failures: str | None = None,
    progress: Callable[[Summary], None] | None = None,
    progress_every: int = 50,
    resume: Summary | None = None,
    inflight: str | None = None,
) -> Summary:
    """Check ``count`` generated programs; ``seed=None`` derandomizes (CI).

    Hypothesis draws the programs (generate phase only: every program is
    checked and recorded, none is shrunk); mismatches are collected, not
    raised, and written to ``failures`` when given. ``resume``: the summary
    of an interrupted run with the same arguments; its programs are drawn
    again (the draw is deterministic for a seed and the same code: Hypothesis
    also draws from the constants of the loaded local modules) but not checked.

    ``inflight`` (default ``failures/inflight-<pid>.py``): the program being
    checked is written there first and removed when its check returns, so a
    process that dies checking it (a crash: the threads arm) leaves it
    behind. A resumed run that meets the file with a ``# died: ...`` line
    (``__main__.run_parallel`` adds it) and the same program counts that
    program as crashed and goes on with the next."""
    import time

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    from .generator import programs

    summary = resume or Summary()
    skip = [summary.programs]
    folder = tempfile.mkdtemp(prefix="graphmend-fuzz-")
    began = time.perf_counter() - summary.seconds

    @settings(
        max_examples=count,  # resumed programs are drawn again: they count
        database=None,
        deadline=None,
        derandomize=seed is None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(programs(max_statements=max_statements), st.integers(0, 2**16), st.integers(0, 7))
    def one(program: Program, input_seed: int, start: int) -> None:
        if STUCK:  # a threads arm never ended: its threads may hold graphmend's locks
            return
        if skip[0] > 0:  # checked before the run was interrupted
            skip[0] -= 1
            return
        index = summary.programs
        params = {
            "seed": input_seed,
            "start": start,
            "grad": grad_every > 0 and index % grad_every == 0,
            "inductor": inductor_every > 0 and index % inductor_every == 0,
            "aot": aot_every > 0 and index % aot_every == 0,
            # offset from the grad programs (both every 4th: not the same ones)
            "threads": threads_every > 0 and index % threads_every == threads_every // 2,
        }
        # The program being checked, until its check returns: what a worker process that died
        # (a crash: threads arm) was checking. The parent names these files (__main__.py).
        path = inflight or (os.path.join(failures, f"inflight-{os.getpid()}.py") if failures else None)
        died = _died_checking(path, program) if path else None
        if died is not None:  # the process before this one died checking it: not again
            result = Result(program.digest, "crashed", detail=died)
            os.remove(path)
        else:
            if path:
                note = Result(program.digest, "in flight", detail="the process died checking it")
                save_failure(os.path.dirname(path), program, note, params, name=os.path.basename(path))
                faulthandler.dump_traceback_later(PROGRAM_GIVE_UP, exit=True)
            try:
                result = check_program(program, folder=folder, **params)
            except Exception as exc:  # a harness bug must not end a long run
                result = Result(program.digest, "harness-error", detail=f"{type(exc).__name__}: {exc}"[:300])
                if not STUCK:
                    graphmend.unmend()
                    torch._dynamo.reset()
            finally:
                faulthandler.cancel_dump_traceback_later()
            if path:
                os.remove(path)
        summary.add(result)
        summary.seconds = time.perf_counter() - began
        if failures and (result.status in ("mend-error", "harness-error", "crashed") or result.mismatches or result.left or result.mend_errors):
            save_failure(failures, program, result, params)
        elif failures and any(status == "reverted" for _, _, status, _ in result.outcomes):
            save_failure(os.path.join(failures, "reverted"), program, result, params)
        if progress and summary.programs % progress_every == 0:
            progress(summary)

    if seed is not None:
        one = hypothesis_seed(seed)(one)
    one()
    summary.seconds = time.perf_counter() - began
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    os.rmdir(folder)
    return summary
