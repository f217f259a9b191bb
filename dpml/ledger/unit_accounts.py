"""Per-unit privacy loss for the ledger: composing the spends that touched a unit.

A unit's loss is the smaller of two valid upper bounds on the composition of the counted private
spends that touched it: RDP (Mironov 2017; the spends' curves summed on :data:`tuning.ORDERS`,
converted by Canonne, Kamath & Steinke 2020, Prop. 12) and, where it can change an answer and is
quick, one PLD accountant over every event. KL-private spends compose additively in KL. The
individual Rényi filter's order α* and bound B* (Feldman & Zrnic 2021, Thm. 3.1) live here too.
:class:`UnitAccounts` evaluates histories (tuples of spend ids) inside one ledger transaction.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpml.accounting.accountants import epsilon_pld, mechanism_rdp_curve
from dpml.accounting.closed_forms import has_zcdp
from dpml.accounting.kl_certificate import certified_kl
from dpml.accounting.mechanism import MechanismDescription
from dpml.accounting.tuning import ORDERS, rdp_to_epsilon

PLD_REFINEMENTS = 4  # the most PLD compositions one check or summary computes beyond its memo
PLD_MAX_EVENTS = 8  # histories of more distinct events keep their RDP bound (a PLD would take many seconds)
COUNTED = "id NOT IN (SELECT spend_id FROM events WHERE kind = 'cancelled')"  # SQL: spends that count
History = tuple[int, ...]


class LedgerError(RuntimeError):
    """A ledger that cannot be used: corrupt, from a newer dpml, or mixed relations."""


class BudgetExceeded(LedgerError):
    """The planned run would take some unit of the lineage over its budget."""


def _compose(mechanisms: list[MechanismDescription], delta: float) -> float:
    """ε(δ) of all mechanisms together: one PLD accountant over every event (a valid upper bound).

    A KL-private spend (seed 000) has no finite ε at any δ < 1 that the paper proves, so any
    history with one has an unbounded (ε, δ) total.
    """
    if not mechanisms:
        return 0.0
    if any(m.guarantee == "kl" for m in mechanisms):
        return float("inf")
    relations = {m.neighbouring for m in mechanisms}
    if len(relations) > 1:
        raise LedgerError(f"cannot compose spends under different neighbouring relations {sorted(relations)}")
    if any((m.selection is not None and m.selection.random) or has_zcdp(m) for m in mechanisms):
        # A random-count search or a zCDP run has an RDP curve but no PLD: compose every spend in RDP.
        return rdp_to_epsilon(ORDERS, sum((mechanism_rdp_curve(m) for m in mechanisms), np.zeros(len(ORDERS))), delta)
    events = tuple(e for m in mechanisms for e in m.composed_events())
    combined = MechanismDescription("ledger", events, mechanisms[0].neighbouring, 1.0, 0)
    return epsilon_pld(combined, delta)


def _compose_kl(mechanisms: list[MechanismDescription]) -> float:
    """Total KL of the spends: KL composes additively, adaptively too (the chain rule).

    An (ε, δ)-DP spend with δ > 0 bounds no KL divergence: it makes the KL total unbounded.
    """
    total = 0.0
    for mechanism in mechanisms:
        if mechanism.guarantee != "kl":
            return float("inf")
        total += certified_kl(mechanism)
    return total


def rdp_curve(mechanism: MechanismDescription) -> np.ndarray:
    """The spend's RDP curve on :data:`tuning.ORDERS`; ∞ (a vacuous bound, which leaves the unit's ε
    to the PLD accountant) for a KL-private spend or one dp_accounting has no RDP for (Poisson
    sampling under replace-one)."""
    from dp_accounting import UnsupportedEventError  # lazy: when this accountant is asked

    if mechanism.guarantee == "kl":
        return np.full(len(ORDERS), np.inf)
    try:
        return np.asarray(mechanism_rdp_curve(mechanism), dtype=float)
    except (UnsupportedEventError, NotImplementedError):
        return np.full(len(ORDERS), np.inf)


def epsilons_from_rdp(rdp: np.ndarray, delta: float) -> np.ndarray:
    """ε(δ) of each row of RDP values on :data:`tuning.ORDERS`, minimised over the orders.

    ε = min_α ρ(α) + log(1 − 1/α) − log(δα)/(α − 1) (Canonne, Kamath & Steinke 2020, Prop. 12; the
    conversion dp_accounting's ``compute_epsilon`` uses, vectorised; orders ≤ 1.01 are skipped as
    there), floored at 0.
    """
    orders = np.asarray(ORDERS, dtype=float)
    usable = orders > 1.01
    with np.errstate(invalid="ignore"):
        shift = np.log1p(-1.0 / orders[usable]) - np.log(delta * orders[usable]) / (orders[usable] - 1.0)
        eps = np.atleast_2d(rdp)[:, usable] + shift
    eps = np.where(np.isnan(eps), np.inf, eps)
    return np.asarray(np.maximum(eps.min(axis=1), 0.0), dtype=float)


def filter_order(budget: float, delta: float) -> float:
    """α* of a lineage's Rényi filter: the order at which a Gaussian-shaped composition (ρ(α) = cα, the
    shape of composed subsampled Gaussians at small q) reaching exactly ``budget`` at δ converts best.
    It depends on the budget and δ only, never on the data, and is fixed at a lineage's first
    filtered run."""
    orders = np.asarray(ORDERS, dtype=float)
    low, high = 0.0, budget
    for _ in range(100):  # bisect c so that min_α ε(cα) = budget
        c = (low + high) / 2
        low, high = (c, high) if epsilons_from_rdp(c * orders[None, :], delta)[0] < budget else (low, c)
    curve = low * orders
    usable = orders > 1.01
    shift = np.log1p(-1.0 / orders) - np.log(delta * orders) / (orders - 1.0)
    return float(orders[usable][np.argmin((curve + shift)[usable])])


def filter_bound(order: float, budget: float, delta: float) -> float:
    """B*: the largest RDP at ``order`` whose conversion (Canonne et al. 2020, Prop. 12) is ≤ ``budget``."""
    return budget - math.log1p(-1.0 / order) + math.log(delta * order) / (order - 1.0)


def _curve_to_json(curve: np.ndarray) -> str:
    return json.dumps([float(v) if np.isfinite(v) else None for v in curve])


def _curve_from_json(text: str) -> np.ndarray:
    return np.array([np.inf if v is None else v for v in json.loads(text)], dtype=float)


class UnitAccounts:
    """Per-unit privacy loss of histories (tuples of spend ids), within one connection."""

    def __init__(self, delta: float, db: sqlite3.Connection) -> None:
        self.db, self.delta = db, delta
        self.orders = np.asarray(ORDERS, dtype=float)
        rows = db.execute(f"SELECT id, mechanism, rdp FROM spends WHERE private = 1 AND {COUNTED}").fetchall()  # noqa: S608
        self.mechanisms = {int(i): MechanismDescription.from_dict(json.loads(m)) for i, m, _ in rows}
        self.curves = {int(i): _curve_from_json(r) if r else rdp_curve(self.mechanisms[int(i)]) for i, _, r in rows}
        self.extra: dict[int, MechanismDescription] = {}

    def counted(self, history: Sequence[int]) -> History:
        """The history's spends that count: private and not cancelled (cancelled ones stay listed)."""
        return tuple(s for s in history if s in self.mechanisms or s in self.extra)

    def add_planned(self, spend_id: int, mechanism: MechanismDescription) -> None:
        """Account a spend not yet written (the run being checked) under a provisional id."""
        self.extra[spend_id] = mechanism
        self.curves[spend_id] = rdp_curve(mechanism)

    def mechanism(self, spend: int) -> MechanismDescription:
        return self.extra.get(spend) or self.mechanisms[spend]

    def rdp(self, histories: list[History]) -> np.ndarray:
        """(histories × orders) summed RDP curves."""
        out = np.zeros((len(histories), self.orders.size))
        for row, history in enumerate(histories):
            for spend in self.counted(history):
                out[row] += self.curves[spend]
        return out

    def epsilon_rdp(self, histories: list[History]) -> np.ndarray:
        return epsilons_from_rdp(self.rdp(histories), self.delta) if histories else np.zeros(0)

    def epsilon_pld(self, history: History) -> float:
        """One PLD composition of the history (memoised in the ledger for written spends)."""
        history = self.counted(history)
        if not history:
            return 0.0
        memo_key = hashlib.sha256(f"{self.delta!r}|{','.join(map(str, sorted(history)))}".encode()).hexdigest()
        written = not any(s in self.extra for s in history)
        if written:
            row = self.db.execute("SELECT epsilon FROM history_epsilon WHERE key = ?", (memo_key,)).fetchone()
            if row is not None:
                return float(row[0])
        epsilon = _compose([self.mechanism(s) for s in history], self.delta)
        if written and self.db.in_transaction:
            self.db.execute("INSERT OR REPLACE INTO history_epsilon (key, epsilon) VALUES (?, ?)", (memo_key, epsilon))
        return epsilon

    def epsilons(
        self, histories: list[History], above: float | None = None, limit: int = PLD_REFINEMENTS
    ) -> np.ndarray:
        """min(RDP, PLD) ε of each history. PLD is computed only where it can change the answer: for
        the histories whose RDP value exceeds ``above`` (a budget check; the closest to it first), or —
        ``above`` None — in descending RDP order until no remaining history can exceed the largest
        found (a maximum). At most :data:`PLD_REFINEMENTS` PLD compositions per call, of histories of
        at most :data:`PLD_MAX_EVENTS` distinct events; the rest keep their RDP bound (an over-count:
        a looser bound, never an unsafe one)."""
        eps = self.epsilon_rdp(histories)
        if above is not None:
            flagged = np.flatnonzero(eps > above)
            order, limit = flagged[np.argsort(eps[flagged])], min(limit, PLD_REFINEMENTS // 2)
        else:
            order = np.argsort(-eps)
        done, best = 0, -np.inf
        for index in order:
            if done >= limit or (above is None and eps[index] <= best):
                break
            if self._pld_affordable(histories[index]):
                eps[index] = min(eps[index], self.epsilon_pld(histories[index]))
                done += 1
            best = max(best, eps[index])
        return eps

    def _pld_affordable(self, history: History) -> bool:
        """A PLD composition of the history exists (no KL spend, no random-count search) and is quick."""
        distinct: set[Any] = set()
        for spend in self.counted(history):
            mechanism = self.mechanism(spend)
            if mechanism.guarantee == "kl" or (mechanism.selection is not None and mechanism.selection.random):
                return False
            distinct.update(mechanism.composed_events())
        return len(distinct) <= PLD_MAX_EVENTS

    def kl(self, history: History) -> float:
        return _compose_kl([self.mechanism(s) for s in self.counted(history)])

    def relations(self, history: History) -> set[str]:
        return {self.mechanism(s).neighbouring for s in self.counted(history)}
