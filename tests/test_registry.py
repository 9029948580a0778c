"""The rule registry is the one source of a rule's facts: each rule module
declares them, and discovery, the defaults, `graphmend check`, reports and
the pipeline read them from there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import graphmend
from graphmend.check.find import CODES
from graphmend.check.safety import PROOFS
from graphmend.discover.sites import CATEGORIES, verdict_for
from graphmend.passes.barriers import RECORDS
from graphmend.pipeline import CAPTURE_RULE, DEFAULT_RULES
from graphmend.passes.speculation import RULE as SPECULATE
from graphmend.rules import default_rules, load_rules, rule_with_pass, rules_that

RULES = load_rules()
SECTIONS = ["What it rewrites", "Why the original breaks", "Example", "When it declines"]


def test_each_rule_documents_itself_in_the_same_sections():
    for name, rule in RULES.items():
        sections = re.findall(r"^## (.+)$", rule.doc, re.M)
        assert [h for h in sections if h in SECTIONS] == SECTIONS, name  # in this order; others may follow
        assert rule.summary, name


def test_a_category_is_claimed_by_one_rule_whose_verdict_explain_shows():
    claimed = [c for rule in RULES.values() for c in rule.categories]
    assert len(claimed) == len(set(claimed)) and set(claimed) <= set(CATEGORIES)
    for rule in RULES.values():
        for category in rule.categories:
            assert verdict_for(category) == (rule.name, rule.verdict) and rule.verdict
    assert verdict_for("DS")[0] is None


def test_the_defaults_come_from_the_rules_in_rank_order():
    assert DEFAULT_RULES == default_rules() == ("where", "defer", "trap", "scalar", "speculate", "reassign", "compiling")
    ranks = [RULES[n].rank for n in DEFAULT_RULES]
    assert ranks == sorted(set(ranks))


def test_check_codes_records_and_passes_are_the_rules():
    owned = {code: (rule.name, what) for rule in RULES.values() for code, what in rule.codes.items()}
    assert sum(len(rule.codes) for rule in RULES.values()) == len(owned)  # no code owned twice
    assert {c: v for c, v in CODES.items() if v[0] is not None} == owned
    assert set(CODES) - set(owned) == {"GM000"}
    assert RECORDS == ("print_", "log", "warn", "trap")
    assert CAPTURE_RULE == "scalar"


def test_what_the_passes_ask_of_a_rule_they_read_as_its_facts():
    assert rules_that("records") == ("defer", "trap")  # held asserts take these back together
    assert rules_that("defers_output") == ("defer",)  # rounds guard its output from failing asserts
    assert rules_that("defers_raise") == ("trap",)  # no capture measured with it; off through a DDP buffer hook
    assert rule_with_pass("speculation") == SPECULATE == "speculate"
    assert {name: rule.proof for name, rule in RULES.items() if rule.proof} == {
        "defer": "unchanged after", "trap": "no imported call after"
    }
    assert set(PROOFS) == {rule.proof for rule in RULES.values() if rule.proof}


def test_no_code_outside_the_rules_names_a_rule():
    """Passes, tools and reports ask the registry for a rule by its facts: a
    string constant equal to a rule's name appears only in the rules (and the
    runtime, whose call names they share)."""
    package = Path(graphmend.__file__).parent
    named = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] in ("rules", "runtime"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in RULES:
                named.append(f"{path.relative_to(package)} {node.value!r}")
    # torch.where: among torch's tensor-making functions, an op whose condition autograd cuts, an
    # op with dtype and shape facts, one whose one-argument form has a shape that depends on the
    # values, and the call graphmend fix writes for a select it proves
    assert sorted(set(named)) == [
        "analysis/dtypes.py 'where'", "analysis/gradients.py 'where'", "analysis/shapes.py 'where'",
        "analysis/traceable.py 'where'", "check/tensors.py 'where'", "tools/plain.py 'where'",
    ]
