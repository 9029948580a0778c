"""Rewrite rounds: the sites rules claim, rewritten function by function,
traced again, until no rewrite applies.

Each round locates the live function of every pending site, applies the
rules to its statements (a rule may rewrite ahead there and in the model's
other functions: ``Rule.ahead``, [defer] takes every print / log / warning),
builds and installs the new code, then traces the model again: that shows
the breaks that remain, and those the rewritten ones hid. A round whose code
does not compile is taken back whole.
"""

from __future__ import annotations

import ast
import copy
import inspect
import sys
from typing import Any

import torch

from graphmend.analysis import memo
from graphmend.analysis.asserts import held_asserts
from graphmend.analysis.source import EFFECTS, is_runtime_call, statement_in
from graphmend.check.find import find_in_source
from graphmend.discover.chains import complete_all, entry_keys
from graphmend.discover.sites import BreakSite
from graphmend.discover.trace import is_model_code
from graphmend.passes import barriers, memos
from graphmend.rewrite import engine
from graphmend.rewrite.session import Key, Session, SiteOutcome, Status, key, outcome
from graphmend.rules import Decline, Rule, load_rules


def rounds(session: Session, rules: tuple[str, ...], flags: tuple[str, ...] = ()) -> int:
    """Rewrite the sites of ``session.current`` not decided yet, retrace (with
    the capture ``flags``), repeat while rewrites apply; the rounds run."""
    ran = 0
    for _ in range(session.max_rounds):
        pending = [s for s in session.current.sites if key(s) not in session.outcomes]
        if not pending:
            break
        ran += 1
        checkpoint = session.checkpoint()
        session.observed += chains_seen(session.current.sites)
        if apply_round(session, pending, rules) == 0:
            break
        # Memos the round's rewrites hoisted, set now (passes/memos.py): the trace then sees the
        # model as the first call will, so its graphs can be that call's (rewrite/fallback.py).
        memos.fill(session.target, session.mending.memo_attrs, session.grad)
        try:
            session.current = session.retrace(flags)
        except Exception as exc:  # the mended code does not compile: undo this round
            checkpoint.restore(failed=exc)
            session.current = session.retrace(flags)
            break
    return ran


def chains_seen(sites: list[BreakSite]) -> list:
    """Every frame chain the sites were reached by (``session.observed`` grows by these)."""
    return [p for s in sites for p in (s.paths or [s.frames]) if p]


def apply_round(session: Session, sites: list[BreakSite], enabled: tuple[str, ...], only: str | None = None) -> int:
    """Rewrite the functions holding ``sites``; returns how many sites were applied.

    ``session.observed``: every frame chain seen so far, to complete the chains
    of breaks reported from a frame compiled on its own (chains.py). ``only``:
    offer every site to that rule instead of the one its category names. What
    the rules ask of the source and the model is worked out once (analysis/memo.py)."""
    with memo.once():
        return _apply_round(session, sites, enabled, only)


def _apply_round(session: Session, sites: list[BreakSite], enabled: tuple[str, ...], only: str | None) -> int:
    model, outcomes, mending = session.target.model, session.outcomes, session.mending
    rules = load_rules()
    entries = entry_keys(model)
    by_function: dict[int, tuple[engine.Located, list[tuple[BreakSite, engine.SiteRewrite]]]] = {}

    def rule_of(site: BreakSite) -> str | None:
        return only or site.rule

    for site in sites:
        rule = rules.get(rule_of(site) or "")
        if rule is None or rule.name not in enabled:
            reason = (
                site.verdict if site.rule is None else f"rule {site.rule!r} is not enabled or not built yet"
            )
            outcomes[key(site)] = outcome(site, Status.OUT_OF_SCOPE if site.rule is None else Status.DECLINED, reason, site.rule)
            continue
        try:
            located = engine.locate(site.file, site.line, mending.by_code())
        except Decline as exc:
            outcomes[key(site)] = outcome(site, Status.DECLINED, exc.reason, rule_of(site))
            continue
        except Exception as exc:  # never fail the user's model for an internal error
            outcomes[key(site)] = outcome(site, Status.DECLINED, f"internal error locating the function: {exc}", rule_of(site))
            continue
        entry = by_function.setdefault(id(located.code), (located, []))
        chains = complete_all(site.paths or [site.frames], session.observed, entries)
        entry[1].append((site, engine.SiteRewrite(line=site.line, rule=rule, frames=list(site.frames), chains=chains)))
    if only is None:  # the model's functions that showed no break: only what rules rewrite ahead
        for file, line in model_statements(model, rules, enabled):
            try:
                located = engine.locate(file, line, mending.by_code())
            except Exception:  # Decline or internal: nothing was seen there, nothing to report
                continue
            if located.previous is None:  # a function already rewritten had its turn
                by_function.setdefault(id(located.code), (located, []))
    applied = 0
    for located, pairs in by_function.values():
        node, pairs = rewrite_function(located, pairs, rules, enabled, outcomes, model, only)
        ok = [(s, r) for s, r in pairs if r.ok]
        for site, rw in pairs:
            if not rw.ok:
                outcomes[key(site)] = outcome(site, Status.DECLINED, rw.reason, rule_of(site))
        if not ok:
            continue
        try:
            code = engine.build(located, node)
            patch = engine.install(located, code, node)
        except Decline as exc:
            for site, _ in ok:
                outcomes[key(site)] = outcome(site, Status.DECLINED, exc.reason, rule_of(site))
            continue
        except Exception as exc:
            for site, _ in ok:
                outcomes[key(site)] = outcome(
                    site, Status.DECLINED, f"internal error building the rewrite: {type(exc).__name__}: {exc}",
                    rule_of(site),
                )
            continue
        mending.add(patch, [key(s) for s, _ in ok])
        unalias = set().union(*(rw.unalias for _, rw in ok))
        mending.unalias |= unalias
        unaliased = engine.unalias_buffers(model, unalias)
        for site, rw in ok:
            mending.memo_attrs |= rw.memo_attrs
            if unaliased:
                rw.notes.append(f"gave buffer(s) {', '.join(unaliased)} their own storage (values unchanged)")
            outcomes[key(site)] = outcome(
                site, Status.APPLIED, "; ".join(rw.notes) or f"rewritten by [{rule_of(site)}]", rule_of(site),
                rw.notes,
            )
            applied += 1
    if applied:  # new code: what Dynamo traced of the old is stale (with none, a staged trace stays)
        torch._dynamo.reset()
    return applied


def rewrite_function(
    located: engine.Located,
    pairs: list[tuple[BreakSite, engine.SiteRewrite]],
    rules: dict[str, Rule],
    enabled: tuple[str, ...],
    outcomes: dict[Key, SiteOutcome],
    model: Any,
    only: Any,
) -> tuple[Any, list[tuple[BreakSite, engine.SiteRewrite]]]:
    """Apply the rules to one function: its sites, then what they rewrite ahead
    (ahead inside a site's statement first, so its rule meets them rewritten).

    Deferred effects are recorded by the graph and performed after it returns.
    An ``assert`` that may be on tensor values and stays in the function (no
    [Trap] rewrite) compiles into the graph (``torch._assert_async``); when it
    fails, the graph raises before returning, and the output recorded in it is
    lost. A graph break (``runtime.barrier()``) goes before each such assert,
    so the records made so far reach the region first, when that leaves fewer
    breaks than the effects would (a tie goes to the breaks when a warning is
    among them); otherwise, or where one cannot be placed (the assert call
    sits inside an expression), the function is rewritten again without
    [Defer]."""

    def rewrite(pairs: list[tuple[BreakSite, engine.SiteRewrite]], enabled: tuple[str, ...]) -> tuple[Any, list]:
        if only is not None:
            return engine.rewrite(located, [r for _, r in pairs], model), pairs
        # What the rules rewrite ahead inside a site's statement first (a print in a branch
        # [Where] predicates), then the sites, then the rest of what they rewrite ahead.
        spans = [_span(located.node, site.line) for site, _ in pairs]
        inside = [(s, r) for s, r in ahead_sites(located, pairs, rules, enabled, outcomes) if any(a <= s.line <= b for a, b in spans)]
        engine.rewrite(located, [r for _, r in inside], model)
        engine.rewrite(located, [r for _, r in pairs], model)
        lines = {s.line for s, _ in inside}
        rest = [(s, r) for s, r in ahead_sites(located, pairs, rules, enabled, outcomes) if s.line not in lines]
        node = engine.rewrite(located, [r for _, r in rest], model)
        more = inside + rest
        # One that declined stays as it was, unreported: no break was seen there.
        for site, rw in more:
            rw.notes.append(site.verdict)
        return node, pairs + [(s, r) for s, r in more if r.ok]

    pristine = copy.deepcopy(located.node)
    node, done = rewrite(pairs, enabled)
    deferred = [r for _, r in done if r.ok and r.rule.defers_output]
    held = held_asserts(node, barriers.owners(located, model), located.namespace) if deferred else []
    if not held:
        return node, done
    effects = [c.func.attr for c in ast.walk(node) if is_runtime_call(c, *EFFECTS)]
    # A break per assert, or one per effect left in place: the fewer. On a tie a warning tips it to
    # the breaks: one left in a frame Dynamo compiled can report another line (docs/torch-issues.md).
    needed = sum(1 for h in held if not barriers.guarded(h))
    barrier = needed < len(effects) or (needed == len(effects) and "warn" in effects)
    if barrier:
        placed = barriers.wrap(held)
        for rw in deferred:
            rw.notes.append(
                f"a graph break is kept before {placed}: an assert that may be on tensor values fails inside "
                "the graph, which would lose the output recorded before it"
            )
        return node, done
    first = held[0]
    reason = (
        f"`{ast.unparse(first).splitlines()[0]}` (line {first.lineno}) stays an assert that may be on tensor values, "
        "which Dynamo compiles into the graph: when it fails, the graph raises before the output recorded in it "
        "is performed; a graph break before it would save no graph"
    )
    located.node = pristine
    kept = []
    for site, rw in pairs:
        if rw.rule.defers_output:
            rw.ok, rw.reason, rw.notes = False, reason, []
        else:
            rw.ok, rw.reason, rw.notes, rw.memo_attrs, rw.unalias = False, "", [], set(), set()
            kept.append((site, rw))
    node, done = rewrite(kept, tuple(name for name in enabled if not rules[name].defers_output))
    return node, done + [(s, r) for s, r in pairs if r.rule.defers_output]


def _span(fdef: ast.AST, line: int) -> tuple[int, int]:
    """The lines of the statement of ``fdef`` that starts at ``line`` (none: an empty span)."""
    found = statement_in(fdef.body, line, into_classes=False)  # type: ignore[attr-defined]
    if found is None:
        return (0, -1)
    stmt = found[0][found[1]]
    if found[0] is fdef.body and isinstance(stmt, ast.If) and any(isinstance(n, ast.Return) for n in ast.walk(stmt)):
        return stmt.lineno, fdef.end_lineno or stmt.lineno  # a return in it: the rest of the function is on its paths
    return stmt.lineno, stmt.end_lineno or stmt.lineno


def ahead_sites(
    located: engine.Located,
    pairs: list[tuple[BreakSite, engine.SiteRewrite]],
    rules: dict[str, Rule],
    enabled: tuple[str, ...],
    outcomes: dict[Key, SiteOutcome],
) -> list[tuple[BreakSite, engine.SiteRewrite]]:
    """Sites for the statements enabled rules rewrite ahead in a function of
    the model (``Rule.ahead``): no break was seen at them on the example inputs."""
    taken = {site.line for site, _ in pairs}
    if pairs:
        why = f"the function breaks (line {', '.join(str(line) for line in sorted(taken))})"
    else:
        why = "the model's code (a `forward` or a helper it calls) breaks the graph wherever an input reaches it"
    # The function's callers are those of its sites ([Trap] scans their code after the call); none seen: unknown.
    chains = [chain for _, rw in pairs for chain in rw.chains or []]
    made: list[tuple[BreakSite, engine.SiteRewrite]] = []
    for rule in rules.values():
        if rule.name not in enabled:
            continue
        for line in rule.ahead(located.node):
            if line in taken or (located.filename, line) in outcomes:
                continue
            taken.add(line)
            found = statement_in(located.node.body, line, into_classes=False)
            code = ast.unparse(found[0][found[1]]).splitlines()[0] if found else ""
            site = BreakSite(
                file=located.filename, line=line, function=located.node.name, code=code,
                category=min(rule.categories, default=""), reason="", gb_id=None, rule=rule.name,
                verdict=f"no break seen here on the example inputs; rewritten ahead because {why}",
            )
            made.append((site, engine.SiteRewrite(line=line, rule=rule, chains=list(chains))))
    return made


def model_statements(model: Any, rules: dict[str, Rule], enabled: tuple[str, ...]) -> list[tuple[str, int]]:
    """(file, line) of each statement ``graphmend check`` finds for a rule that
    rewrites ahead, in the source files of the model's own module classes
    (torch's and graphmend's excluded): ``forward`` and the helpers it calls."""
    ahead = {name for name, rule in rules.items() if name in enabled and type(rule).ahead is not Rule.ahead}
    if not ahead:
        return []
    found: list[tuple[str, int]] = []
    for path, (namespace, classes) in sorted(model_files(model).items()):
        try:
            with open(path, "rb") as fh:
                findings = find_in_source(path, fh.read(), opt_in=False, namespace=namespace, classes=classes)
        except Exception:  # unreadable, or a finder bug: that file gets no ahead rewrites
            continue
        found += [(path, f.line) for f in findings if f.rule in ahead]
    return found


def model_files(model: Any, bases: bool = False) -> dict[str, tuple[dict, set[str]]]:
    """The source files of the model's own module classes (torch's and
    graphmend's excluded): path -> the module's globals, the qualnames of the
    model's classes there (with ``bases``, also of their base classes)."""
    files: dict[str, tuple[dict, set[str]]] = {}
    if not isinstance(model, torch.nn.Module):
        return files
    for module in model.modules():
        for cls in type(module).__mro__ if bases else (type(module),):
            try:
                path = inspect.getsourcefile(cls)
            except (TypeError, OSError):
                continue
            owner = sys.modules.get(cls.__module__)
            if path and owner is not None and is_model_code(path):
                files.setdefault(path, (vars(owner), set()))[1].add(cls.__qualname__)
    return files
