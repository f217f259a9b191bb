"""The ledger's check before a run: would any of its units go over budget?

Two rules (``ledger.on_exhausted``), both evaluated per history — the units of one cohort share a
history, so a check costs one composition per cohort, not per unit:

- ``refuse``: the run's units are checked by composition, min(RDP, PLD) of the spends that touched
  each plus the planned one (:class:`~dpml.ledger.unit_accounts.UnitAccounts`), against
  ``ledger.epsilon_budget``. Any unit over it refuses the run, naming how many units and their ε.
- ``exclude``: the individual Rényi filter (Feldman & Zrnic 2021, Thm. 3.1 with the individual
  losses of Alg. 1): at the lineage's fixed order α*, a unit takes part only while
  Σ_{s touched it} ρ_s(α*) + ρ_new(α*) ≤ B* (:func:`~dpml.ledger.unit_accounts.filter_bound`).

KL-private runs (seed 000) are checked in summed KL against ``ledger.kl_budget``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpml.ledger import cohorts
from dpml.accounting.mechanism import MechanismDescription
from dpml.ledger.unit_accounts import BudgetExceeded, History, LedgerError, UnitAccounts, filter_bound


@dataclass(frozen=True)
class Standing:
    """The units of one run (or of the whole lineage) grouped by history."""

    histories: list[History]  # each with the lineage's base in front
    units: np.ndarray  # how many of the run's units have each history
    lookup: cohorts.Lookup | None  # None: the run carries no unit list (charged to every unit)
    cohort_of_history: list[int]


def units_phrase(units: int, known: bool) -> str:
    """How a refusal names the units it is about (a run without a unit list is charged to all)."""
    if not known:
        return "every privacy unit of the lineage (this run's data carries no unit list)"
    return f"{units:,} privacy units of this run"


def _epsilon_range(values: np.ndarray) -> str:
    low, high = float(values.min()), float(values.max())
    return f"{low:.4g}" if f"{low:.4g}" == f"{high:.4g}" else f"{low:.4g}…{high:.4g}"


def within_filter(
    accounts: UnitAccounts, histories: list[History], planned: int, order: float, budget: float, delta: float
) -> np.ndarray:
    """Per history: may its units take part under the Rényi filter at ``order`` (Feldman & Zrnic 2021)?
    Σ ρ_s(α*) + ρ_planned(α*) ≤ B*(α*, budget, δ)."""
    column = int(np.flatnonzero(accounts.orders == order)[0])
    spent = accounts.rdp(histories)[:, column] if histories else np.zeros(0)
    return np.asarray(spent + accounts.curves[planned][column] <= filter_bound(order, budget, delta) + 1e-12)


def check_budget(
    accounts: UnitAccounts,
    standing: Standing,
    lineage: str,
    planned: int,
    mechanism: MechanismDescription,
    budget: float,
    kl_budget: float | None,
    filter_order: float | None,
    delta: float,
) -> None:
    """Raise :class:`BudgetExceeded` when any unit of the run would go over its budget: by the Rényi
    filter at ``filter_order`` (``exclude``) or by composition (``refuse``, ``filter_order`` None)."""
    candidates = [h + (planned,) for h in standing.histories]
    relations = set().union(*(accounts.relations(h) for h in candidates)) if candidates else set()
    if len(relations) > 1:
        raise LedgerError(
            f"lineage {lineage!r}: cannot compose spends under different neighbouring relations "
            f"{sorted(relations)}; nothing was recorded"
        )
    if mechanism.guarantee == "kl":
        return check_kl(accounts, standing, candidates, lineage, kl_budget)
    alone = accounts.epsilons([(planned,)])[0]
    if filter_order is not None:
        over = ~within_filter(accounts, standing.histories, planned, filter_order, budget, delta)
        rule = "the lineage's Rényi filter"
    else:
        over = accounts.epsilons(candidates, above=budget) > budget
        rule = "composition"
    if not over.any():
        return
    known = standing.lookup is not None
    now = accounts.epsilons([h for h, o in zip(standing.histories, over, strict=True) if o], limit=1)
    after = accounts.epsilon_rdp([c for c, o in zip(candidates, over, strict=True) if o])
    who = (
        f"{int(standing.units[over].sum()):,} of the {int(standing.units.sum()):,} privacy units in this run's "
        "training data have"
        if known
        else units_phrase(0, known=False) + " has"
    )
    kl_units = any(
        any(accounts.mechanism(s).guarantee == "kl" for s in accounts.counted(h))
        for h, o in zip(standing.histories, over, strict=True)
        if o
    )
    why = " (a KL-private release already used them, so their (ε, δ) loss is unbounded)" if kl_units else ""
    raise BudgetExceeded(
        f"lineage {lineage!r}: {who} spent ε = {_epsilon_range(now)} already{why}; this run (ε = {alone:.4g} "
        f"alone at δ = {delta:g}) would take them to ε ≈ {float(np.min(after)):.4g} or more ({rule}), over the "
        f"budget (ledger.epsilon_budget = {budget:g}); {max(budget - float(now.max()), 0.0):.4g} of it is left. "
        "Nothing was recorded." + (" To train without them, set ledger.on_exhausted: exclude." if known else "")
    )


def check_kl(
    accounts: UnitAccounts, standing: Standing, candidates: list[History], lineage: str, kl_budget: float | None
) -> None:
    """KL-private runs: summed KL (the chain rule) of every unit ≤ ``kl_budget``; a unit with an
    (ε, δ)-DP spend has no KL bound, so a KL-private run cannot be accounted on it."""
    if kl_budget is None:
        raise BudgetExceeded(
            f"lineage {lineage!r}: this run's guarantee is KL privacy, and ledger.kl_budget is "
            "not set; set it to allow KL-private releases. Nothing was recorded."
        )
    known = standing.lookup is not None
    for history, candidate, units in zip(standing.histories, candidates, standing.units, strict=True):
        if any(accounts.mechanism(s).guarantee != "kl" for s in accounts.counted(history)):
            raise BudgetExceeded(
                f"lineage {lineage!r}: {units_phrase(int(units), known)} already have (ε, δ)-DP spends, "
                "which bound no KL divergence; a KL-private run cannot be accounted on them. Nothing was recorded."
            )
        before, after = accounts.kl(history), accounts.kl(candidate)
        if after > kl_budget:
            raise BudgetExceeded(
                f"lineage {lineage!r}: {units_phrase(int(units), known)} would go from summed KL = {before:.4g} "
                f"to {after:.4g}, over ledger.kl_budget = {kl_budget:g}. Nothing was recorded."
            )
