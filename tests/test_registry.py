"""The rule registry is the one source of a rule's facts: each rule module
declares them, and discovery, the defaults, `graphmend check`, reports and
the pipeline read them from there."""

from __future__ import annotations

import re

from graphmend.check.find import CODES
from graphmend.discover.sites import CATEGORIES, verdict_for
from graphmend.passes.barriers import RECORDS
from graphmend.pipeline import CAPTURE_RULE, DEFAULT_RULES
from graphmend.rules import default_rules, load_rules

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
    assert DEFAULT_RULES == default_rules() == ("where", "defer", "trap", "scalar", "speculate")
    ranks = [RULES[n].rank for n in DEFAULT_RULES]
    assert ranks == sorted(set(ranks))


def test_check_codes_records_and_passes_are_the_rules():
    owned = {code: (rule.name, what) for rule in RULES.values() for code, what in rule.codes.items()}
    assert sum(len(rule.codes) for rule in RULES.values()) == len(owned)  # no code owned twice
    assert {c: v for c, v in CODES.items() if v[0] is not None} == owned
    assert set(CODES) - set(owned) == {"GM000"}
    assert RECORDS == ("print_", "log", "warn", "trap")
    assert CAPTURE_RULE == "scalar"
