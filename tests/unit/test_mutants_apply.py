"""Every mutant's edit still finds its code exactly once: a refactor that moves the code a
mutant breaks must move the mutant with it (the CI gate would find it minutes later, in a
run that kills every mutant; this finds it in the fast tier)."""

from __future__ import annotations

from tests.mutants import MUTANTS, applies


def test_every_mutant_applies_to_the_code_it_names() -> None:
    assert [(m.name, applies(m)) for m in MUTANTS if applies(m) != "applies"] == []
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)   # one name, one rule
