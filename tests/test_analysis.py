"""The source facts the rules prove legality with (analysis/facts.py)."""

import ast
import textwrap

import pytest

from graphmend.analysis.facts import live_after, updated_after

LIVENESS = [
("""
def f(x):
    if c:
        lim = 1
        x = x + lim
    return x
""", "lim", False),
("""
def f(x):
    if c:
        lim = 1
    return lim
""", "lim", True),
("""
def f(x):
    if c:
        lim = 1
    lim = 2
    return lim
""", "lim", False),
("""
def f(x):
    for i in range(3):
        y = lim if i else 0
        if c:
            lim = 1
    return x
""", "lim", True),
("""
def f(x):
    if c:
        lim = 1
    if d:
        lim = 3
    else:
        x = lim
    return x
""", "lim", True),
("""
def f(x):
    if c:
        lim = 1
    if d:
        lim = 3
    else:
        return x
    return lim
""", "lim", False),
("""
def f(x):
    if c:
        lim = 1
    del lim
""", "lim", True),
("""
def f(x):
    if c:
        lim = 1
    lim += 1
""", "lim", True),
("""
def f(x):
    g = lambda: lim
    if c:
        lim = 1
    return g
""", "lim", True),
("""
def f(x):
    if a:
        if c:
            lim = 1
        x = 2
    else:
        x = lim
    return x
""", "lim", False),
("""
def f(x):
    if a:
        if c:
            lim = 1
        x = 2
    return lim
""", "lim", True),
]


@pytest.mark.parametrize("source,name,live", LIVENESS, ids=['a-temporary-of-the-branch', 'returned-after', 'assigned-again-first', 'read-in-the-enclosing-loop', 'read-on-one-path-of-a-later-if', 'assigned-or-left-on-every-later-path', 'deleted-after', 'updated-with-plus-equals', 'read-by-a-closure', 'the-enclosing-else-is-skipped', 'read-after-the-enclosing-if'])
def test_live_after_an_if(source, name, live):
    """Whether the value a branch of ``if c:`` gave ``name`` may be read later: a
    name [Where] may leave unassigned on the predicated path only when it is not."""
    fdef, site = _at_if_c(source)
    assert live_after(fdef, site, name) is live


def _at_if_c(source):
    """The function of ``source`` and its ``if c:`` statement."""
    fdef = ast.parse(textwrap.dedent(source)).body[0]
    return fdef, next(n for n in ast.walk(fdef) if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "c")


UPDATES = [
    ("h.add_(1)", True),
    ("h[0] = 0.0", True),
    ("h += 1", True),
    ("h = h + 1", False),
    ("y = h.add(1)", False),
    ("g.add_(1)", False),
]


@pytest.mark.parametrize("later,updated", UPDATES, ids=[u[0] for u in UPDATES])
def test_updated_in_place_after_an_if(later, updated):
    """What [Where] declines for: after a select, `h` is a new tensor, so an in-place
    update no longer reaches the tensor the original path kept (an input, say)."""
    source = f"def f(x, g):\n    h = x\n    if c:\n        h = h * 2\n    {later}\n    return h\n"
    fdef, site = _at_if_c(source)
    assert (updated_after(fdef, site, "h") is not None) is updated


def test_an_update_earlier_in_an_enclosing_loop_runs_after_the_if_too():
    source = "def f(x):\n    h = x\n    for i in range(2):\n        h.mul_(2)\n        if c:\n            h = h * 2\n    return h\n"
    fdef, site = _at_if_c(source)
    assert updated_after(fdef, site, "h") is not None


def test_an_update_after_a_reassignment_from_arithmetic_reaches_a_new_tensor():
    source = "def f(x):\n    h = x\n    if c:\n        h = h * 2\n    h = h + 1.0\n    h.mul_(2)\n    return h\n"
    assert updated_after(*_at_if_c(source), "h") is None
    aliased = source.replace("h = h + 1.0", "h = h.float()")  # may be the same tensor
    assert updated_after(*_at_if_c(aliased), "h") is not None


PRIOR = [
    # s holds what h held: both branches reach x
    ("h = x * 1.0\n    s = h.mean()", "s", "h", []),
    # h holds another tensor at the if than when s was computed: s reaches w, h reaches v
    ("h = self.w * 1.0\n    s = h.mean()\n    h = self.v * 1.0", "s", "h", ["h", "s"]),
    # assigned twice: a root of its own
    ("s = x.mean()\n    s = s * 2", "s", "x", ["s", "x"]),
    # read through a parameter never reassigned
    ("s = x.sum() + self.w", "s", "x", ["self.w"]),
    # h changed in place after s was computed: h may reach what s does not
    ("h = x * 1.0\n    s = h.mean()\n    h.mul_(self.w)", "s", "h", ["h", "s"]),
]


@pytest.mark.parametrize("before,left,right,checked", PRIOR, ids=["same", "reassigned", "twice", "param", "in-place"])
def test_what_a_name_bound_before_the_if_reaches(before, left, right, checked):
    """[Where] under autograd checks at run time (grad_free) the roots one branch may
    reach and another does not surely reach: a name assigned once, whose reads hold
    the same values at the if, reaches what its value reaches."""
    from graphmend.analysis.gradients import block_reach, checked_at_run_time, prior_reach

    source = f"def f(self, x):\n    {before}\n    if c:\n        y = {left}\n    else:\n        y = {right}\n    return y\n"
    fdef, site = _at_if_c(source)
    is_function = lambda name: False  # noqa: E731
    prior = prior_reach(fdef.body, site, _assignments(fdef), is_function)
    arms = [block_reach([("y", block[0].value)], is_function, prior)[0]["y"] for block in (site.body, site.orelse)]
    assert checked_at_run_time(arms) == checked


def _assignments(fdef):
    from graphmend.analysis.facts import FunctionFacts

    return FunctionFacts.of(fdef, {}, {n.id for n in ast.walk(fdef) if isinstance(n, ast.Name)}).assignments


CALLEE = """
import torch

def lengths_mask(slen, lengths):
    alen = torch.arange(slen)
    assert lengths.max().item() <= slen
    return alen[None, :] < lengths[:, None]

def rebinding(slen, lengths):
    lengths = lengths.clone()
    assert lengths.max().item() <= slen
    return lengths
"""

IMPLIED = [
    ("assert lengths.max().item() <= n\n    m = lengths_mask(n, lengths)", "lengths_mask", True),
    ("assert lengths.max().item() <= n\n    n = n\n    m = lengths_mask(n, lengths)", "lengths_mask", False),
    ("assert lengths.max().item() < n\n    m = lengths_mask(n, lengths)", "lengths_mask", False),
    ("assert lengths.max().item() <= n\n    m = lengths_mask(n, lengths + 0)", "lengths_mask", False),
    ("assert lengths.max().item() <= n\n    m = lengths_mask(n, lengths, f(lengths))", "lengths_mask", False),
    ("assert lengths.max().item() <= n\n    m = rebinding(n, lengths)", "rebinding", False),
]


@pytest.mark.parametrize("caller, callee, implied", IMPLIED)
def test_a_check_the_caller_made_just_before_the_call_cannot_fail_first(tmp_path, caller, callee, implied):
    """analysis.implied: only the same assert, on the names the call passes, right
    before a call that evaluates nothing else, with a callee that rebinds nothing."""
    from types import SimpleNamespace

    import torch

    from graphmend.analysis.implied import implied_by_caller

    path = tmp_path / "caller.py"
    path.write_text(f"def forward(lengths, n):\n    {caller}\n    return m\n")
    tree = ast.parse(CALLEE)
    fdef = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == callee)
    check = next(s for s in fdef.body if isinstance(s, ast.Assert))
    frame = SimpleNamespace(file=str(path), line=len(caller.splitlines()) + 1, function="forward")
    assert implied_by_caller(check, fdef, {"torch": torch}, frame) is implied


def test_what_a_fresh_local_holds_is_passed_fresh():
    """`layer(h, cache=cache[i])`, `cache.store`: what a value made in the call holds
    is passed as fresh as the value itself (analysis.aliasing.fresh_arguments)."""
    from graphmend.analysis.aliasing import fresh_arguments

    def layer(h, cache=None, other=None):
        return h

    call = ast.parse("layer(h, cache=cache[i], other=shared.store)").body[0].value
    fresh, _ = fresh_arguments(call, layer, {"cache"}, bound=False)
    assert fresh == frozenset({"cache"})
    call = ast.parse("layer(h, cache=cache.store, other=shared[0])").body[0].value
    fresh, _ = fresh_arguments(call, layer, {"cache", "h"}, bound=False)
    assert fresh == frozenset({"h", "cache"})
