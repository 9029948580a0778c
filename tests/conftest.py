import os
import sys

import pytest
import torch

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
sys.path.insert(0, FIXTURES)

# Each test mends from scratch: no entry of the mend cache (graphmend/cache.py) stands in for a
# mend, and the suite writes nothing there; tests/test_cache.py turns it on in a folder of its own.
os.environ["GRAPHMEND_CACHE"] = "0"


def counting_graphs(model, args=(), kwargs=None, calls=1):
    """Graphs compiled by a plain counting backend, independent of graphmend."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        for _ in range(calls):
            compiled(*args, **(kwargs or {}))
    torch._dynamo.reset()
    return len(graphs)


@pytest.fixture
def fixture_path():
    return lambda name: os.path.join(FIXTURES, name)


def has_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def fixture_program(name):
    """A program of the fuzzer kept in tests/fixtures, as tests.fuzz.runner takes it."""
    from fuzz.generator import Program

    with open(os.path.join(FIXTURES, name)) as fh:
        return Program(fh.read())
