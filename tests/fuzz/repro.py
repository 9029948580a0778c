"""Reproduce one saved program: ``python -m tests.fuzz.repro FILE [--seed N] [--start K]``.

Prints the rewritten functions and every difference the runner finds."""

from __future__ import annotations

import argparse
import re
import sys

import torch

import graphmend
from graphmend import api
from graphmend.rewrite.verify import quiet

from .generator import Program
from .runner import _first_valid, check_program, inputs_for, load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.repro")
    parser.add_argument("file")
    parser.add_argument("--grad", action="store_true")
    args = parser.parse_args(argv)
    text = open(args.file).read()
    params = dict(re.findall(r"^# (seed|start|grad|inductor|aot|threads)=(\S+)$", text, re.M))
    source = "\n".join(line for line in text.splitlines() if not line.startswith("# ")) + "\n"
    program = Program(source)
    seed, start = int(params.get("seed", 0)), int(params.get("start", 0))
    grad = args.grad or params.get("grad") == "True"
    # the rewrite, for reading
    import tempfile

    module = load(program, tempfile.mkdtemp())
    torch.manual_seed(0)
    model = module.Model().eval()
    xs = inputs_for(seed)
    example = _first_valid(model, xs, start)
    print("example input", example)
    with quiet():
        report = graphmend.mend(model, xs[example])
    for outcome in report.outcomes:
        print(f"{outcome.line:4d} {outcome.status:9s} [{outcome.rule}] {outcome.reason}")
    for _, mending in api._ACTIVE.values():
        for patch in mending.patches:
            print(patch.source)
    graphmend.unmend()
    result = check_program(
        program, seed=seed, start=start, grad=grad, aot=params.get("aot") != "False",
        inductor=params.get("inductor") == "True", threads=params.get("threads") == "True",
    )
    print(result.status, result.detail)
    for line in result.mismatches:
        print("MISMATCH", line)
    for line in result.backend_differences:
        print("backend", line)
    for line in result.torch_bug:
        print("TORCH BUG", line)
    for line in result.left:
        print("LEFT BEHIND", line)
    return 1 if result.mismatches or result.left else 0


if __name__ == "__main__":
    sys.exit(main())
