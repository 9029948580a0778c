"""Print the README's rules table from the rule registry.

    python docs/gen_rules_table.py           # print the Markdown table
    python docs/gen_rules_table.py --write   # replace the table in README.md
    python docs/gen_rules_table.py --check   # exit 1 when README.md's table is stale

The table sits in README.md between ``<!-- rules:begin -->`` and
``<!-- rules:end -->``. Run from the repository root with graphmend importable
(``.venv/bin/python``, or ``PYTHONPATH=src``).

Every fact comes from the code: the rules are those ``graphmend.rules``
registers (``graphmend rules`` lists the same), a rule's categories and summary
are its class attributes, "on by default" is the rule's own ``default`` flag
when it has one, else whether it is in ``DEFAULT_RULES`` (what
``graphmend.compile`` and ``graphmend mend`` use without ``rules=`` /
``--rules``), and the ``check`` codes are ``graphmend check``'s code table.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- rules:begin -->", "<!-- rules:end -->"


def rows() -> list[tuple[str, str, str, str, str]]:
    from graphmend.discover.sites import CATEGORIES as names
    from graphmend.rules import default_rules, load_rules

    rules, defaults = load_rules(), default_rules()
    order = [n for n in defaults if n in rules] + sorted(n for n in rules if n not in defaults)
    out = []
    for name in order:
        rule = rules[name]
        if rule.categories:
            fixes = "; ".join(f"`{c}` {names[c]}" if c in names else f"`{c}`" for c in sorted(rule.categories))
        else:
            fixes = f"{rule.offered} (the sites the other rules left)"
        codes = ", ".join(sorted(rule.codes)) or "-"
        out.append((f"`{name}`", fixes, rule.summary, "yes" if rule.default else "no", codes))
    return out


def table() -> str:
    lines = [
        "| rule | breaks it fixes | what it does | on by default | `check` codes |",
        "|---|---|---|---|---|",
    ]
    for row in rows():
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines) + "\n"


def _spliced(text: str, new: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{new}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="replace the table in README.md")
    group.add_argument("--check", action="store_true", help="exit 1 when README.md's table differs")
    ns = parser.parse_args(argv)
    new = table()
    if not (ns.write or ns.check):
        sys.stdout.write(new)
        return 0
    with open(README, encoding="utf-8") as fh:
        text = fh.read()
    if BEGIN not in text or END not in text:
        print(f"README.md has no {BEGIN} ... {END} block", file=sys.stderr)
        return 2
    updated = _spliced(text, new)
    if ns.check:
        if updated != text:
            print("README.md's rules table is stale: run python docs/gen_rules_table.py --write", file=sys.stderr)
            return 1
        return 0
    if updated != text:
        with open(README, "w", encoding="utf-8") as fh:
            fh.write(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
