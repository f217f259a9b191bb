"""The ledger's answers about one person and about a lineage's filter, pinned by the ledger's mutation round
(``bash scripts/mutation.sh ledger``; ``benchmarks/results/mutation.md`` lists each mutant these tests kill).

Each test names the bug it pins. The ledgers are real (SQLite, and PostgreSQL where a test takes
``ledger_location``); the mechanisms are ρ-zCDP releases, composed in closed form, so every expected ε is
recomputed here from a ledger holding one release of the summed ρ (zCDP composes by adding ρ: Bun & Steinke
2016, Lemma 2.3), not from the code under test's own sum.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from test_kl_certificate import dp_mechanism, kl_mechanism

from dpml.accounting.accountants import certify
from dpml.accounting.mechanism import ConcentratedDP, MechanismDescription, PoissonGaussianSteps
from dpml.accounting.tuning import ORDERS
from dpml.data.units import digests_of_ids
from dpml.ledger.ledger import BudgetExceeded, Ledger
from dpml.ledger.unit_accounts import LedgerError, UnitAccounts, epsilons_from_rdp, filter_bound, filter_order

DELTA = 1e-5


def release(rho: float) -> MechanismDescription:
    return MechanismDescription("onepass", (ConcentratedDP(rho),), "add-remove", 1.0, 100)


def people(ids: range | list[int]) -> np.ndarray:
    return digests_of_ids([f"p{i:05d}" for i in ids])


def epsilon_of_one_release(rho: float, tmp_path: Path) -> float:
    """ε at DELTA of a single ρ-zCDP release, from a ledger of its own."""
    alone = Ledger(str(tmp_path / f"alone-{rho!r}.db"), DELTA)
    alone.reserve("v", release(rho), "alone", 1e9, lineage="alone")
    return alone.total("alone")


def test_a_persons_view_lists_every_release_that_touched_them_with_its_numbers(
    ledger_location: str, tmp_path: Path
) -> None:
    """``dpml ledger person``: the releases charged to the person's units, a release charged to the whole lineage
    (no unit list) among them, a cancelled one listed as not counted, each with its lineage, label and ε alone;
    the person's ε composes the counted ones, at the ledger's δ. Pins: the lineage-wide releases left out of a
    person's history (``_base`` asked about no lineage), a cancelled release listed as counted or dropped from
    the list (the listing taken from the counted spends only), the record's keys."""
    ledger = Ledger(ledger_location, DELTA, unit_key=tmp_path / "unit.key")
    first = ledger.reserve("v1", release(0.05), "first", 100.0, lineage="L", units=people(range(100)))
    everyone = ledger.reserve("v1", release(0.02), "everyone", 100.0, lineage="L")
    dropped = ledger.reserve("v1", release(0.03), "dropped", 100.0, lineage="L", units=people(range(50, 60)))
    ledger.cancel(dropped.id, "the run failed before it started")
    view = ledger.person(people([55]))
    assert view is not None and view["lineages"] == ["L"] and view["delta"] == DELTA
    assert view["releases"] == [
        {
            "spend": first.id,
            "lineage": "L",
            "label": "first",
            "epsilon_alone": pytest.approx(first.epsilon_alone),
            "counted": True,
        },
        {
            "spend": everyone.id,
            "lineage": "L",
            "label": "everyone",
            "epsilon_alone": pytest.approx(everyone.epsilon_alone),
            "counted": True,
        },
        {
            "spend": dropped.id,
            "lineage": "L",
            "label": "dropped",
            "epsilon_alone": pytest.approx(dropped.epsilon_alone),
            "counted": False,
        },
    ]
    assert view["epsilon"] == pytest.approx(epsilon_of_one_release(0.07, tmp_path), rel=1e-9)
    assert first.epsilon_alone == pytest.approx(epsilon_of_one_release(0.05, tmp_path), rel=1e-9)
    assert ledger.person(people([5]))["epsilon"] == pytest.approx(view["epsilon"], rel=1e-12)  # not in `dropped`
    assert ledger.person(people([500])) is None


def test_the_refusal_names_the_spent_epsilon_once_when_the_units_agree_and_as_a_range_when_they_differ(
    tmp_path: Path,
) -> None:
    """The refusal's "spent ε = …" is one number when every unit over the budget has the same ε and
    ``low…high`` otherwise. Pins the comparison that picks the form (always a range, never a range, reversed)."""
    ledger = Ledger(str(tmp_path / "l.db"), DELTA, unit_key=tmp_path / "unit.key")
    ledger.reserve("v1", release(0.05), "all", 100.0, lineage="L", units=people(range(200)))
    ledger.reserve("v1", release(0.05), "some", 100.0, lineage="L", units=people(range(100, 200)))
    low, high = sorted(e for e, _ in ledger.unit_epsilons("L"))
    assert f"{low:.4g}" != f"{high:.4g}"

    def refusal(units: np.ndarray) -> str:
        with pytest.raises(BudgetExceeded) as refused:
            ledger.reserve("v2", release(0.05), "next", 0.99 * high, lineage="L", units=units)
        return str(refused.value)

    assert re.search(rf"spent ε = {re.escape(f'{high:.4g}')} already", refusal(people(range(100, 200))))
    assert f"spent ε = {low:.4g}…{high:.4g} already" in refusal(people(range(200)))


def test_a_run_that_reaches_the_filters_bound_exactly_may_take_part(tmp_path: Path) -> None:
    """The Rényi filter admits a run whose RDP at α* reaches B*(α*) exactly (Feldman & Zrnic 2021: the filter
    is Σ ρ_s(α*) ≤ B*, not <) and refuses one a hair above. Pins the tolerance's sign at the bound."""
    ledger = Ledger(str(tmp_path / "l.db"), DELTA, unit_key=tmp_path / "unit.key")
    order = filter_order(1.0, DELTA)
    rho = filter_bound(order, 1.0, DELTA) / order  # ρ-zCDP: RDP ρα, so ρ·α* = B*
    assert ledger.units_within_filter("F", people(range(5)), release(rho), 1.0).all()
    assert not ledger.units_within_filter("F", people(range(5)), release(rho * (1 + 1e-9)), 1.0).any()


def test_the_filters_order_is_the_one_fixed_at_the_lineages_first_filtered_run(tmp_path: Path) -> None:
    """α* is chosen once, at a lineage's first filtered run, from that run's budget; a later run with another
    budget is checked at the same α* (a filter whose order moves with each run's settings is no longer the
    filter of Feldman & Zrnic's theorem). Pins the stored order ignored (recomputed from each run's budget)."""
    ledger = Ledger(str(tmp_path / "l.db"), DELTA, unit_key=tmp_path / "unit.key")
    first, later = 1.0, 8.0
    fixed, moved = filter_order(first, DELTA), filter_order(later, DELTA)
    assert fixed != moved
    ledger.reserve("v1", release(0.001), "first", first, lineage="L", units=people(range(10)), mode="exclude")
    room_fixed = filter_bound(fixed, later, DELTA) / fixed - 0.001  # the largest ρ the fixed order admits
    room_moved = filter_bound(moved, later, DELTA) / moved - 0.001  # … and the order this budget would pick
    assert room_fixed < room_moved
    between = release((room_fixed + room_moved) / 2)
    assert not ledger.units_within_filter("L", people(range(10)), between, later).any()
    assert ledger.units_within_filter("L", people(range(10)), release(room_fixed * 0.99), later).all()


def test_a_kl_run_may_reach_the_kl_budget_exactly_and_a_refusal_names_the_units_it_is_about(tmp_path: Path) -> None:
    """KL composes by addition (the chain rule; Ye et al., Def. 2.3), and ``ledger.kl_budget`` bounds the sum:
    a run that takes a unit's summed KL to the budget exactly is admitted, one a step further is refused,
    naming how many of the run's units would go over and from which sum to which. A KL run on units that an
    (ε, δ)-DP release already touched is refused naming those units. Pins: ``>`` → ``>=`` at the budget,
    the before and after sums swapped or misformatted, the count of units taken from the wrong history."""
    ledger = Ledger(str(tmp_path / "l.db"), DELTA, unit_key=tmp_path / "unit.key")
    kl = certify(kl_mechanism(), DELTA)["kl"]
    ledger.reserve("v1", kl_mechanism(), "first", 10.0, 100.0, lineage="L", units=people(range(100)))
    ledger.reserve("v1", kl_mechanism(), "second", 10.0, 100.0, lineage="L", units=people(range(50, 150)))
    three = 0.0
    for _ in range(3):
        three += kl  # the chain rule's sum, term by term
    ledger.reserve("v1", kl_mechanism(), "to the budget", 10.0, three, lineage="L", units=people(range(50, 60)))
    assert ledger.kl_total("L") == three
    with pytest.raises(BudgetExceeded) as refused:
        ledger.reserve("v1", kl_mechanism(), "over", 10.0, three, lineage="L", units=people([55, 56, 57, 58, 120]))
    assert (
        f"4 privacy units of this run would go from summed KL = {three:.4g} to {three + kl:.4g}, over "
        f"ledger.kl_budget = {three:g}"
    ) in str(refused.value)
    assert [s.label for s in ledger.spends("L")] == ["first", "second", "to the budget"]

    dp = dp_mechanism()
    ledger.reserve("v1", dp, "dp", 10.0, lineage="L", units=people(range(200, 206)))
    with pytest.raises(BudgetExceeded) as refused:
        ledger.reserve("v1", kl_mechanism(), "after dp", 10.0, 100.0, lineage="L", units=people(range(203, 220)))
    assert str(refused.value) == (
        "lineage 'L': 3 privacy units of this run already have (ε, δ)-DP spends, which bound no KL divergence; a "
        "KL-private run cannot be accounted on them. Nothing was recorded."
    )


def test_the_kl_refusals_say_what_to_set_and_name_a_run_without_a_unit_list_as_every_unit(tmp_path: Path) -> None:
    """A KL-private run with no ``ledger.kl_budget`` is refused saying so; one without a unit list on a lineage that an
    (ε, δ)-DP release touched is refused naming every unit of the lineage. The whole sentences are pinned: they are
    what an operator reads (pins their wording, case and the unit phrase of a run without units)."""
    ledger = Ledger(str(tmp_path / "l.db"), DELTA, unit_key=tmp_path / "unit.key")
    with pytest.raises(BudgetExceeded) as refused:
        ledger.reserve("v1", kl_mechanism(), "no budget", 10.0, lineage="K")
    assert str(refused.value) == (
        "lineage 'K': this run's guarantee is KL privacy, and ledger.kl_budget is not set; "
        "set it to allow KL-private releases. Nothing was recorded."
    )
    dp = dp_mechanism()
    ledger.reserve("v1", dp, "dp", 10.0, lineage="K")
    with pytest.raises(BudgetExceeded) as refused:
        ledger.reserve("v1", kl_mechanism(), "after dp", 10.0, 100.0, lineage="K")
    assert str(refused.value) == (
        "lineage 'K': every privacy unit of the lineage (this run's data carries no unit list) already have (ε, δ)-DP "
        "spends, which bound no KL divergence; a KL-private run cannot be accounted on them. Nothing was recorded."
    )
    assert [s.label for s in ledger.spends("K")] == ["dp"]

    ledger.reserve("v1", kl_mechanism(), "kl", 10.0, 100.0, lineage="J", units=people(range(300, 310)))
    with pytest.raises(BudgetExceeded) as refused:
        ledger.reserve("v1", dp, "dp after kl", 10.0, lineage="J", units=people(range(300, 310)))
    assert (
        "lineage 'J': 10 of the 10 privacy units in this run's training data have spent ε = inf already (a "
        "KL-private release already used them, so their (ε, δ) loss is unbounded); this run (ε = "
    ) in str(refused.value)


def test_a_reservation_in_a_mode_the_ledger_does_not_know_is_refused_before_anything_is_recorded(
    tmp_path: Path,
) -> None:
    """``mode`` is ``refuse`` or ``exclude`` (``ledger.on_exhausted``); any other value (a typo through the Python
    API) is refused naming it, not silently read as ``refuse``, and the ledger is unchanged. Pins the mode
    check, and the default ``refuse`` passed on where a caller leaves it out."""
    ledger = Ledger(str(tmp_path / "l.db"), DELTA, unit_key=tmp_path / "unit.key")
    with pytest.raises(LedgerError) as refused:
        ledger.reserve("v1", release(0.01), "typo", 10.0, lineage="L", units=people(range(10)), mode="exlude")  # type: ignore[arg-type]
    assert str(refused.value) == (
        "mode = 'exlude': the ledger checks a run by 'refuse' (composition against the "
        "budget) or 'exclude' (the Rényi filter) only (ledger.on_exhausted); nothing was "
        "recorded"
    )
    assert ledger.spends("L") == [] and ledger.spends("L", counted_only=False) == []
    ledger.reserve("v1", release(0.01), "default", 10.0, lineage="L", units=people(range(10)))


def test_a_run_that_takes_its_units_to_the_budget_exactly_is_admitted_and_one_a_hair_over_is_refused(
    tmp_path: Path,
) -> None:
    """``refuse``: a unit may spend up to ``ledger.epsilon_budget`` inclusive (the budget is the largest ε allowed).
    The composed ε is taken from another ledger holding the same two releases, so the check sees the very same
    number. Pins ``>`` → ``>=`` at the budget."""
    twice = Ledger(str(tmp_path / "twice.db"), DELTA, unit_key=tmp_path / "unit.key")
    for label in ("first", "second"):
        twice.reserve("v1", release(0.05), label, 1e9, lineage="X", units=people(range(10)))
    reached = twice.total("X")
    assert reached == pytest.approx(epsilon_of_one_release(0.10, tmp_path), rel=1e-9)
    below = Ledger(str(tmp_path / "below.db"), DELTA, unit_key=tmp_path / "unit.key")
    below.reserve("v1", release(0.05), "first", 1e9, lineage="X", units=people(range(10)))
    with pytest.raises(BudgetExceeded):
        below.reserve(
            "v1", release(0.05), "second", float(np.nextafter(reached, 0.0)), lineage="X", units=people(range(10))
        )
    below.reserve("v1", release(0.05), "second", reached, lineage="X", units=people(range(10)))
    assert below.total("X") == reached


def test_a_refusal_says_who_how_much_by_which_rule_and_what_is_left(tmp_path: Path) -> None:
    """The whole refusal a person reads, recomputed from ledgers of one release each (ρ-zCDP composes by adding ρ):
    with a unit list, how many of the run's units would go over, their spent ε, the run's ε alone, where it takes
    them, the rule (composition, or the lineage's Rényi filter under ``exclude``), the budget, what is left and
    how to train without them; without a unit list, every unit of the lineage. Pins the rule's and the units'
    phrases, their case and decoration, and the phrase a run without units gets."""
    one, two = epsilon_of_one_release(0.05, tmp_path), epsilon_of_one_release(0.10, tmp_path)
    budget = (one + two) / 2
    ledger = Ledger(str(tmp_path / "l.db"), DELTA, unit_key=tmp_path / "unit.key")
    ledger.reserve("v1", release(0.05), "first", 100.0, lineage="L", units=people(range(10)))
    with pytest.raises(BudgetExceeded) as refused:
        ledger.reserve("v1", release(0.05), "second", budget, lineage="L", units=people(range(5, 15)))
    assert str(refused.value) == (
        f"lineage 'L': 5 of the 10 privacy units in this run's training data have spent ε = {one:.4g} already; this "
        f"run (ε = {one:.4g} alone at δ = 1e-05) would take them to ε ≈ {two:.4g} or more (composition), over the "
        f"budget (ledger.epsilon_budget = {budget:g}); {budget - one:.4g} of it is left. Nothing was recorded. To "
        "train without them, set ledger.on_exhausted: exclude."
    )

    ledger.reserve("v1", release(0.05), "first", 100.0, lineage="M")
    with pytest.raises(BudgetExceeded) as refused:
        ledger.reserve("v1", release(0.05), "second", budget, lineage="M")
    assert str(refused.value) == (
        f"lineage 'M': every privacy unit of the lineage (this run's data carries no unit list) has spent ε = "
        f"{one:.4g} already; this run (ε = {one:.4g} alone at δ = 1e-05) would take them to ε ≈ {two:.4g} or more "
        f"(composition), over the budget (ledger.epsilon_budget = {budget:g}); {budget - one:.4g} of it is left. "
        "Nothing was recorded."
    )

    ledger.reserve("v1", release(0.05), "first", budget, lineage="F", units=people(range(100, 110)), mode="exclude")
    with pytest.raises(BudgetExceeded) as refused:
        ledger.reserve(
            "v1", release(0.05), "second", budget, lineage="F", units=people(range(100, 110)), mode="exclude"
        )
    assert "would take them to ε ≈" in str(refused.value)
    assert f"or more (the lineage's Rényi filter), over the budget (ledger.epsilon_budget = {budget:g})" in str(
        refused.value
    )
    assert [s.label for s in ledger.spends()] == ["first", "first", "first"]


def test_an_rdp_order_without_a_value_is_skipped_not_carried_into_epsilon() -> None:
    """ε = min over the orders α of ρ(α) + log(1 − 1/α) − log(δα)/(α − 1) (Canonne, Kamath & Steinke 2020,
    Prop. 12): an order whose RDP value is NaN (no value) must drop out of the minimum, as an ∞ one does. Carried
    into the minimum, NaN makes ε NaN, and ``NaN > budget`` is false: the budget check would admit anything. Pins
    the NaN → ∞ mapping (dropped, or mapped to None)."""
    curve = 0.05 * np.asarray(ORDERS, dtype=float)  # 0.05-zCDP
    holes = np.arange(len(ORDERS)) % 7 == 3
    without = np.where(holes, np.nan, curve)
    expected = epsilons_from_rdp(np.where(holes, np.inf, curve)[None, :], DELTA)[0]
    assert np.isfinite(expected) and expected >= epsilons_from_rdp(curve[None, :], DELTA)[0]
    assert epsilons_from_rdp(without[None, :], DELTA)[0] == expected


def test_a_planned_runs_epsilon_is_never_kept_for_the_next_reservation(tmp_path: Path) -> None:
    """The ledger keeps each written history's composed ε (``history_epsilon``), but a planned run is accounted
    under the provisional id -1, which every reservation reuses. Kept for a planned run, the small run's ε
    would stand for the next reservation's run at the same place: a larger run for people nobody has charged
    would be checked as the small one and admitted over budget. Pins ``written`` in ``epsilon_pld`` (the
    mutants that memoise a history holding the planned run)."""
    small, large = 0.02, 0.5
    large_alone = epsilon_of_one_release(large, tmp_path)
    budget = (epsilon_of_one_release(small, tmp_path) + large_alone) / 2
    ledger = Ledger(str(tmp_path / "l.db"), DELTA)
    ledger.reserve("v1", release(small), "small", budget, lineage="L", units=people(range(100)))
    with pytest.raises(BudgetExceeded):
        ledger.reserve("v1", release(large), "large", budget, lineage="L", units=people(range(100, 200)))
    refused = ledger_refusal(ledger, release(large), budget)
    assert float(re.search(r"this run \(ε = ([\d.]+)", refused).group(1)) == pytest.approx(  # type: ignore[union-attr]
        large_alone, rel=1e-3
    )
    assert [s.label for s in ledger.spends("L")] == ["small"]


def ledger_refusal(ledger: Ledger, mechanism: MechanismDescription, budget: float) -> str:
    """The refusal a person reads for ``mechanism`` on people the lineage has never charged."""
    with pytest.raises(BudgetExceeded) as refused:
        ledger.reserve("v1", mechanism, "again", budget, lineage="L", units=people(range(300, 400)))
    return str(refused.value)


def test_a_run_the_pld_admits_is_not_refused_on_the_looser_rdp_bound_of_two_histories(tmp_path: Path) -> None:
    """A budget check refines by PLD up to two histories whose RDP bound is over the budget (the RDP bound of
    subsampled Gaussians is the looser one): two groups of people, each with one release, each taken by the run
    to a PLD ε under the budget and an RDP ε over it, must both be refined, and the run admitted. Pins the
    number of refinements a check makes (``epsilons``' limit, its count of refinements done)."""
    sampled = MechanismDescription("dpsgd", (PoissonGaussianSteps(0.01, 1.0, 400),), "add-remove", 1.0, 1000)
    pairs = Ledger(str(tmp_path / "pairs.db"), DELTA)
    pairs.reserve("v", sampled, "first", 1e9, lineage="pair")
    pairs.reserve("v", sampled, "second", 1e9, lineage="pair")
    with pairs._connect() as db:
        accounts = UnitAccounts(DELTA, db)
        spent = [s.id for s in pairs.spends("pair")]
        by_rdp, by_pld = float(accounts.epsilon_rdp([tuple(spent)])[0]), accounts.epsilon_pld(tuple(spent))
    assert by_pld < by_rdp * 0.97  # a gap to put the budget in
    budget = (by_pld + by_rdp) / 2
    ledger = Ledger(str(tmp_path / "l.db"), DELTA)
    ledger.reserve("v1", sampled, "A", budget, lineage="L", units=people(range(100)))
    ledger.reserve("v1", sampled, "B", budget, lineage="L", units=people(range(100, 200)))
    both = ledger.reserve("v1", sampled, "both", budget, lineage="L", units=people(range(200)))
    assert both.n_units == 200 and ledger.total("L") <= budget


def test_a_spend_written_without_its_rdp_curve_is_accounted_from_its_mechanism(tmp_path: Path) -> None:
    """A ledger written before spends stored their RDP curve (the ``rdp`` column empty) still accounts every
    spend: the curve is recomputed from the stored mechanism, and ε is what it was. Pins ``UnitAccounts``'
    fallback (an empty curve read as JSON, or the mechanism looked up wrongly, fails here)."""
    sampled = MechanismDescription("dpsgd", (PoissonGaussianSteps(0.01, 1.0, 400),), "add-remove", 1.0, 1000)
    ledger = Ledger(str(tmp_path / "l.db"), DELTA)
    ledger.reserve("v1", sampled, "A", 100.0, lineage="L", units=people(range(100)))
    ledger.reserve("v1", release(0.05), "B", 100.0, lineage="L", units=people(range(50, 150)))
    before = (ledger.total("L"), ledger.unit_epsilons("L"))
    with ledger._connect() as db:
        db.execute("BEGIN IMMEDIATE")
        db.execute("UPDATE spends SET rdp = NULL")
        db.execute("DELETE FROM history_epsilon")  # nothing remembered: every ε is composed again
        db.execute("COMMIT")
    assert (ledger.total("L"), ledger.unit_epsilons("L")) == before


def test_a_lineages_filter_keeps_the_order_fixed_at_its_first_filtered_run(tmp_path: Path) -> None:
    """The individual Rényi filter's order α* is fixed at a lineage's first filtered run (Feldman & Zrnic 2021
    need it chosen before the data: ``filter_order``). Here it is fixed at budget 1 (α* = 18); a later run at
    budget 8, whose own best order is 4, is still checked at 18, where these people's sum of RDP at that order
    is over the filter's bound, and refused. Pins the lineage passed to the stored order's lookup."""
    assert (filter_order(1.0, DELTA), filter_order(8.0, DELTA)) == (18.0, 4.0)
    ledger = Ledger(str(tmp_path / "l.db"), DELTA)
    ledger.reserve("v1", release(0.001), "first", 1.0, lineage="L", units=people(range(100)), mode="exclude")
    rho = 0.8  # with 0.001 spent: over the bound at order 18 (0.419 per order), within it at order 4 (1.228)
    assert filter_bound(18.0, 8.0, DELTA) / 18.0 < rho + 0.001 <= filter_bound(4.0, 8.0, DELTA) / 4.0
    with pytest.raises(BudgetExceeded, match="Rényi filter"):
        ledger.reserve("v1", release(rho), "second", 8.0, lineage="L", units=people(range(100)), mode="exclude")
    fresh = Ledger(str(tmp_path / "fresh.db"), DELTA)  # a lineage whose first filtered run is at budget 8
    fresh.reserve("v1", release(0.001), "first", 8.0, lineage="L", units=people(range(100)), mode="exclude")
    fresh.reserve("v1", release(rho), "second", 8.0, lineage="L", units=people(range(100)), mode="exclude")
