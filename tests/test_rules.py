"""Every rule of docs/structures.md "Who decides what" has exactly one decision site, marked in
the code by ``# rule: <name>``; every marker names a listed rule; every mutation entry that
breaks a rule is located by its marker (tests/mutations.py)."""

from __future__ import annotations

import ast

from tests.mutations import MUTATIONS, ROOT, locate, rule_names, rule_sites


def test_every_rule_has_exactly_one_decision_site():
    names = rule_names()
    sites = rule_sites()
    assert len(names) >= 70, "the rule table went missing from docs/structures.md"
    missing = sorted(n for n in names if n not in sites)
    twice = {n: s for n, s in sites.items() if len(s) > 1}
    unlisted = sorted(n for n in sites if n not in names)
    assert not missing, f"rules with no `# rule:` marker in ninfer/: {missing}"
    assert not twice, f"rules marked at more than one site: {twice}"
    assert not unlisted, f"markers naming no rule of docs/structures.md: {unlisted}"


def test_every_rule_mutation_is_located_by_its_marker():
    """Each entry's original text occurs exactly once in its marker's window (a rule entry) or in
    its file (a mechanism entry); a stale entry is found here, not after a long mutation run."""
    bad = []
    for m in MUTATIONS:
        try:
            locate(m)
        except LookupError as e:
            bad.append(f"{m.title}: {e}")
    assert not bad, "\n".join(bad)


def test_the_site_table_names_the_marked_function():
    """The table's site column names the function (or its closure's owner) that holds the
    marker, so a newcomer finds each rule where the table says."""
    text = (ROOT / "docs/structures.md").read_text()
    wrong = []
    for name, [(path, line)] in rule_sites().items():
        row = next(r for r in text.splitlines() if r.startswith(f"| `{name}` |"))
        func = row.rsplit("|", 2)[-2].strip().split("`")[1].split(".")[-1]
        tree = ast.parse((ROOT / path).read_text())
        holding = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and n.lineno <= line + 1 <= n.end_lineno]
        if func not in holding:
            wrong.append(f"{name}: the table says {func}, the marker ({path}:{line}) is in {holding}")
    assert not wrong, "\n".join(wrong)
