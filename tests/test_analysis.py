"""The source facts the rules prove legality with (analysis/facts.py)."""

import ast
import textwrap
from types import SimpleNamespace

import pytest
import torch

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
    from graphmend.analysis.gradients import (
        block_reach,
        checked_at_run_time,
        prior_reach,
    )

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


SHARED_UPDATES = [
    # `s` views `h`, then `h` may be what the block hands back (itself on some path): a frame resumed
    # after the block has both as inputs; the print's break keeps the read and the update apart
    ("s = h[0, 0]\nh = self.block(h)\nprint(h, s)  # <-\ns.add_(1)", "`h` may share storage with `s`"),
    ("s = h.view(-1)\nprint(s)  # <-\nh.mul_(2)", None),  # a view of one input: shared alike on every call
    ("s = h.reshape(-1)\nprint(s)  # <-\nh.mul_(2)", "`s` may share storage with `h`"),  # a view or a copy
    # the update before the site, the read at it: a frame starting before the update has them shared alike every call
    ("s = h[0]\ns += 1\nprint(h)  # <-", None),
    ("s = h[i]\ns += 1\nprint(h)  # <-", "`h` may share storage with `s`"),  # a view or a copy
    ("s = h[0]\ntorch.relu(s, inplace=True)\nprint(h)  # <-", None),  # a constant index: a view on every call
    ("s = h[i]\ntorch.relu(s, inplace=True)\nprint(h)  # <-", "`h` may share storage with `s`"),  # a view or a copy
    ("s = h[0]\ns[0] = 1.0\nprint(h)  # <-", None),
    ("if h.sum() > 0:\n    s = h[0]\nelse:\n    s = h * 2\ns[0] = 1.0\nprint(h)  # <-", "`h` may share storage with `s`"),
    ("print(h)  # <-\nx.add_(1)", None),  # two parameters: judged at the calls (callers.shared_entry_in_calls)
    ("z = x * 1.0\ny = [z] * 2\nprint(y)  # <-\nz.add_(1)", "`y` may share storage with `z`"),  # a list holding `z`
    ("z = h * 1.0\nz.set_(x)\nprint(x)  # <-", None),  # set_ shares its argument's, alike on every call
    ("z = self.f(h)\nz.set_(x)\nprint(x)  # <-", None),  # shared from the update on: no frame starts there with both
    ("z = self.f(h)\nz.set_(x)\nprint(x)  # <-\nz.add_(1)", "`x` may share storage with `z`"),
    # a binding in the other branch, or in one that returns, has not run when a frame starts at the site
    ("if x.sum() > 0:\n    s = h[i]\n    return s\nprint(h)  # <-\nh.add_(1)\ns = h", None),
    ("if x.sum() > 0:\n    s = h[i]\n    print(s)\nprint(h)  # <-\ns.add_(1)", "`h` may share storage with `s`"),
    ("if x.sum() > 0:\n    s = h[i]\nelse:\n    print(h)  # <-\n    h.add_(1)\n    s = h", None),
    ("s = h[0]\nprint(h, s)\ns.add_(1)\nz = torch.ones(2)  # <-", None),  # read and update both before the site
    ("s = h.mean()\ns.add_(1)\nprint(h)  # <-", None),  # a new tensor: shares nothing
    ("h = h * 1.0\nh.add_(1)\nprint(h)  # <-", None),  # one name, updated and read
    ("n, d = h.shape\nh.add_(1)\nprint(n, d)  # <-", None),  # a shape holds no storage
    ("n, d = h.shape\nh *= 2\nh = h.view(-1, d)  # <-\nprint(n)", None),  # a view shares its receiver only
    ("y = self.lin(h)\nh.add_(1)\nprint(self.weight)  # <-", None),  # the module is left out
    ("out = self.block(h)\nout.logits = h\nprint(h)  # <-", None),  # an attribute store: not a tensor update
    ("for layer in self.blocks:\n    h = layer(h)  # <-\nh.add_(1)", None),  # a callee is no tensor read
    ("y = x * 2\ny.add_(1)\nprint(x)  # <-", None),  # arithmetic makes a new tensor
    ("out = torch.zeros_like(h)\nout.index_add_(0, i, h[i])\nprint(h)  # <-", None),  # values, not storage
    ("v, i = h.topk(2)\nv.add_(1)\nprint(i)  # <-", None),  # each element of a new result its own
    ("outs = (h,)\nprint(h)  # <-\nouts += (x,)", None),  # a tuple grows: no tensor changes
    # a same-module function's returns, element by element: `h` gets `h`, `s` gets `s` (a new tensor)
    ("s = h.mean()\nh, s = _hands_back(h, s)\nprint(h)  # <-\ns.add_(1)", None),
    ("h, s = _hands_back(h, h[0])\nprint(h)  # <-\ns.add_(1)", None),  # handed back as passed: alike on every call
    ("s = h[0]\nh, t = _maybe_back(h, s)\nprint(h)  # <-\ns.add_(1)", "`h` may share storage with `s`"),
    # `h` and `s` may share only once the helper has run, after the site: not at a frame's start before it
    ("h = x * 1.0\ns = h.mean()\nif (h < 0).any():  # <-\n    raise ValueError()\nh, s = helper(h, s)\nh.add_(1)", None),
    ("s = h[0]\n__graphmend_rt__.print_(site, (h, s), {})  # <-", None),  # graphmend's runtime: no update
    # no frame starts after `n = t` (nothing there for Dynamo to break on); after `t.view(-1)` one may
    ("for i in range(2):\n    t = self.f(h)\n    n = t\n    n.add_(1)\n    print(h)  # <-", None),
    ("for i in range(2):\n    t = self.f(h)\n    n = t.view(-1)\n    n.add_(1)\n    print(h)  # <-", "`h` may share storage with `n`"),
    # an item store into a list updates no tensor; into a tensor that may hold `h`, it does
    ("items = [h, x]\nitems[0] = x\nprint(h)  # <-\nitems[1] = h", None),
    ("items = self.f(h, x)\nitems[0] = x\nprint(h)  # <-\nitems[1] = h", "`h` may share storage with `items`"),
    # a binding overwritten on the straight path is no name's at the frame's start; not where the new
    # value reads the name (`h, s = _hands_back(h, s)`) or the old one went on to another name first
    ("s = h[i]\ns = h.mean()\nprint(h)  # <-\ns.add_(1)", None),
    ("s = h[i]\nh, s = _hands_back(h, s)\nprint(h)  # <-\ns.add_(1)", "`h` may share storage with `s`"),
    ("s = h[i]\nt = s\ns = t.view(-1)\nprint(h)  # <-\ns.add_(1)", "`h` may share storage with `s`"),
    # the tensor `n` holds at the frame's start is not the one updated: `n` is bound again first
    ("n = self.f(h)\nprint(h)  # <-\nn = self.g(h)\nn.add_(1)", None),
    ("n = self.f(h)\nprint(h)  # <-\nif x.sum() > 0:\n    n = self.g(h)\nn.add_(1)", "`h` may share storage with `n`"),
]


def _hands_back(h, s):
    return h, s


def _maybe_back(h, s):
    if h.sum() > 0:
        return h, s
    return h * 2, s


@pytest.mark.parametrize("body, reason", SHARED_UPDATES)
def test_a_break_between_a_read_and_an_update_of_tensors_that_may_share_storage_is_found(body, reason):
    """`shared.SharedUpdates.at(site)`: a frame may start before the site (`# <-`) with a name
    updated in place and another read, that may share its storage, both bound; one of the two is
    at the site or after it. A graph joining them may read stale values where AOTAutograd reused
    a graph built for inputs that shared storage (pytorch #139789)."""
    from graphmend.analysis.facts import FunctionFacts
    from graphmend.analysis.shared import SharedUpdates

    source = "def forward(self, h, x):\n" + textwrap.indent(body, "    ") + "\n    return None\n"
    fdef = ast.parse(source).body[0]
    line = next(i for i, text in enumerate(source.splitlines(), 1) if "# <-" in text)
    site = next(n for n in ast.walk(fdef) if isinstance(n, ast.stmt) and n.lineno == line)
    found = SharedUpdates(fdef, FunctionFacts.of(fdef, {"torch": torch, "_hands_back": _hands_back, "_maybe_back": _maybe_back}, set())).at(site)
    if reason is None:
        assert found is None
    else:
        assert found is not None and found.startswith(reason), found


def test_a_caller_that_updates_a_tensor_another_name_may_share_is_found_on_the_chain(tmp_path):
    """The callers on a site's chains are inlined into the frame its break splits: their reads
    and updates join too (`callers.shared_update_in_callers`), named with the caller's line."""
    from graphmend.analysis.callers import shared_update_in_callers

    path = tmp_path / "callers_mod.py"
    path.write_text("def forward(self, h):\n    s = h[0, 0]\n    h = self.pre(h)\n    h = self.block(h)\n    s.add_(1)\n    return h\n")
    # `h = self.block(h)`: a frame resumed after `self.pre` (which may hand `h` back) reads `h` and updates `s`
    caller = SimpleNamespace(file=str(path), line=4, function="forward")
    callee = SimpleNamespace(file=str(path), line=9, function="block")
    reason = shared_update_in_callers([[caller, callee]])
    assert reason is not None and reason.startswith("in the caller forward (callers_mod.py:4), `h` may share storage with `s`"), reason
    assert shared_update_in_callers([[callee]]) is None  # no caller
    assert shared_update_in_callers(None) is None  # no run: not judged here


HELPER = "def helper(h, s):\n    print(h, s)\n    h.add_(1)\n    return h, s\n\n\n"
ENTRY_CALLS = [
    ("def run(x):\n    h = x * 1.0\n    s = h.mean()\n    return helper(h, s)\n", None),  # unrelated tensors
    ("def run(x):\n    h = x * 1.0\n    s = h[0]\n    return helper(h, s)\n", None),  # a view, alike on every call
    ("def run(x):\n    h = x * 1.0\n    s = h[0] if x.sum() > 0 else h.mean()\n    return helper(h, s)\n", "the call at"),
    ("def run(x):\n    h = x * 1.0\n    return helper(h, h[x.argmax()])\n", "the call at"),  # a view or a copy
    # two calls, each passing views alike every call, but not alike each other: one compiled frame for both
    ("def run(x):\n    h = x * 1.0\n    helper(h, h[0])\n    return helper(h, h.mean())\n", "the call at"),
    ("def run(x):\n    h = x * 1.0\n    return helper(h, h.mean()), helper(h, h.sum())\n", None),  # new tensors each
    ("", "`s` and `h` are parameters whose callers are not all known"),  # called from elsewhere
    ("fn = helper\n", "`s` and `h` are parameters whose callers are not all known"),  # used as a value
    # followed up through a caller passing its own two parameters
    ("def mid(a, b):\n    return helper(a, b)\n\n\ndef run(x):\n    h = x * 1.0\n    return mid(h, h.mean())\n", None),
    ("def mid(a, b):\n    return helper(a, b)\n\n\ndef run(x):\n    h = x * 1.0\n    return mid(h, h.reshape(-1))\n", "the call at"),
]


@pytest.mark.parametrize("callers, reason", ENTRY_CALLS)
def test_two_parameters_are_judged_at_the_calls_that_pass_them(tmp_path, callers, reason):
    """`SharedUpdates.entry_pairs` then `callers.shared_entry_in_calls`: `helper` reads `s` and updates
    `h`; a frame may start at its entry with both as inputs. They keep the print's break only where a
    call may pass tensors sharing storage on some calls only (AOTAutograd's stale read), or where the
    function's calls are not all known."""
    from graphmend.analysis.callers import shared_entry_in_calls
    from graphmend.analysis.facts import FunctionFacts
    from graphmend.analysis.shared import SharedUpdates

    path = tmp_path / "entry_mod.py"
    path.write_text(HELPER + callers)
    fdef = ast.parse(HELPER).body[0]
    shared = SharedUpdates(fdef, FunctionFacts.of(fdef, {"torch": torch}, set()))
    assert shared.at(fdef.body[0]) is None
    pairs = shared.entry_pairs(fdef.body[0])
    assert pairs == [("h", "s")]
    found = shared_entry_in_calls(shared, pairs, fdef, str(path), None)
    if reason is None:
        assert found is None
    else:
        assert found is not None and reason in found, found
        assert found.startswith("`s` may share storage with `h`, which the function updates in place (`h.add_(1)`, line 3)"), found


@pytest.mark.parametrize(
    "test, static",
    [
        ("x is None", True),
        ("not (x is not None and isinstance(x, tuple))", True),
        ("self.training or hasattr(x, 'bias')", True),
        ("self.use_bias", False),  # may be a tensor buffer
        ("x", False),
        ("x.max() > 1", False),
        ("x.dim() > 2", False),  # static in Dynamo, not shown so by the source alone
    ],
)
def test_tests_a_torch_cond_branch_may_not_hold(test, static):
    from graphmend.analysis.traceable import data_tests

    found = data_tests(ast.parse(f"if {test}:\n    y = 1"))
    assert found == ([] if static else [f"the test `{ast.unparse(ast.parse(test).body[0])}` may be on tensor values"])


@pytest.mark.parametrize(
    "index, shaped, alone",  # alone: read without the function's facts (a helper's source)
    [
        ("h[0, :half]", False, True),  # half = h.shape[-1] // 2: a size Dynamo knows
        ("h[:, 1:-1]", False, False),
        ("h[idx]", False, True),  # idx = torch.arange(2).long(): not bool
        ("h[h > 0]", True, True),
        ("h[mask]", True, True),  # a parameter: may be a boolean mask
        ("h[:k]", True, True),  # k = h.sum().long(): a tensor bound
        ("torch.where(h > 0)", True, True),
        ("torch.where(h > 0, h, 0.0)", False, False),
    ],
)
def test_value_shaped_operations_a_torch_cond_branch_may_not_hold(index, shaped, alone):
    from graphmend.analysis.facts import FunctionFacts
    from graphmend.analysis.traceable import value_shaped

    source = f"def f(h, mask):\n    half = h.shape[-1] // 2\n    idx = torch.arange(2).long()\n    k = h.sum().long()\n    y = {index}\n"
    fdef = ast.parse(source).body[0]
    facts = FunctionFacts.of(fdef, {"torch": torch}, {n.id for n in ast.walk(fdef) if isinstance(n, ast.Name)})
    assert bool(value_shaped(fdef.body[-1].value, facts)) is shaped
    assert bool(value_shaped(fdef.body[-1].value, None)) is alone
