"""The privacy budget ledger: every use of a dataset version, composed, never forgotten.

One SQLite file holds an append-only table of *spends* per dataset version (the content hash of
the ingested records). A spend is written — in a transaction, before any training starts — with
the planned mechanism description; later rows only add events (``trained``, ``released``,
``failed``) and never change or remove a spend. So a crash or a SIGKILL at any point leaves the
spend counted: the ledger can over-count a run that died before touching the data, never
under-count one that did.

**When ε counts as spent.** From the reservation on — with one exception: a run that fails after its
reservation but *before* its trainer was handed the training records (the ``started`` event) cancels
the spend (:meth:`Ledger.cancel`, event ``cancelled``), which then no longer counts; ``dpml ledger``
still lists it. Nothing about the data can have been released by such a run. Once ``started`` is
recorded a spend can never be cancelled, whatever happens next (a crash, a kill, a failed gate).

The dataset's total privacy loss is the **composition** of all its spends' mechanisms (all
Poisson-subsampled Gaussian events composed in one PLD accountant, which is tighter than adding
ε's), at the ledger's δ. Once a random-count hyperparameter search is among them (it has an RDP
curve, no PLD), every spend is composed in RDP instead: still a composition, a little looser. :meth:`Ledger.reserve` checks "total with this run ≤ budget" and
inserts the spend inside one ``BEGIN IMMEDIATE`` transaction, so two concurrent runs racing for
the last of the budget are serialised: exactly one proceeds.

Spends of different neighbouring relations cannot be composed into one statement and are refused.
Non-private training runs (baselines) are recorded as such and excluded from the DP total: their
models carry no guarantee, and the report lists them.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpml.privacy.mechanism import MechanismDescription

SCHEMA_VERSION = 1


class LedgerError(RuntimeError):
    """A ledger that cannot be used: corrupt, from a newer dpml, or mixed relations."""


class BudgetExceeded(LedgerError):
    """The planned run would take the dataset's total ε over its budget."""


@dataclass(frozen=True)
class Spend:
    id: int
    dataset_version: str
    label: str
    created_at: float
    mechanism: MechanismDescription | None  # None: a non-private run
    epsilon_alone: float


def _compose(mechanisms: list[MechanismDescription], delta: float) -> float:
    """ε(δ) of all mechanisms together: one PLD accountant over every event (a valid upper bound).

    A KL-private spend (seed 000) has no finite ε at any δ < 1 that the paper proves, so any
    dataset with one has an unbounded (ε, δ) total.
    """
    if not mechanisms:
        return 0.0
    if any(m.guarantee == "kl" for m in mechanisms):
        return float("inf")
    relations = {m.neighbouring for m in mechanisms}
    if len(relations) > 1:
        raise LedgerError(f"cannot compose spends under different neighbouring relations {sorted(relations)}")
    from dpml.privacy.accountants import epsilon_pld, has_zcdp, mechanism_rdp_curve
    from dpml.privacy.tuning import ORDERS, rdp_to_epsilon

    if any((m.selection is not None and m.selection.random) or has_zcdp(m) for m in mechanisms):
        # A random-count search or a zCDP run has an RDP curve but no PLD: compose every spend in RDP.
        return rdp_to_epsilon(ORDERS, sum(mechanism_rdp_curve(m) for m in mechanisms), delta)
    events = tuple(e for m in mechanisms for e in m.composed_events())
    combined = MechanismDescription("ledger", events, mechanisms[0].neighbouring, 1.0, 0)
    return epsilon_pld(combined, delta)


def _compose_kl(mechanisms: list[MechanismDescription]) -> float:
    """Total KL of all spends: KL composes additively, adaptively too (the chain rule).

    An (ε, δ)-DP spend with δ > 0 bounds no KL divergence, and an uncertified noisy-GD run bounds
    nothing: either makes the KL total unbounded.
    """
    from dpml.privacy.kl_certificate import certified_kl

    total = 0.0
    for mechanism in mechanisms:
        if mechanism.guarantee != "kl":
            return float("inf")
        total += certified_kl(mechanism)
    return total


class Ledger:
    """Append-only SQLite ledger; ``delta`` is the δ at which totals are stated."""

    def __init__(self, path: str | Path, delta: float) -> None:
        self.path = Path(path)
        self.delta = delta
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._check_or_create()

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        connection = sqlite3.connect(self.path, timeout=120.0, isolation_level=None)
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=FULL")
            yield connection
        finally:
            connection.close()

    def _check_or_create(self) -> None:
        try:
            with self._connect() as db:
                db.execute("BEGIN IMMEDIATE")
                db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
                db.execute("""CREATE TABLE IF NOT EXISTS spends (
                    id INTEGER PRIMARY KEY AUTOINCREMENT, dataset_version TEXT NOT NULL, label TEXT NOT NULL,
                    created_at REAL NOT NULL, private INTEGER NOT NULL, mechanism TEXT, epsilon_alone REAL NOT NULL)""")
                db.execute("""CREATE TABLE IF NOT EXISTS events (
                    id INTEGER PRIMARY KEY AUTOINCREMENT, spend_id INTEGER NOT NULL REFERENCES spends(id),
                    created_at REAL NOT NULL, kind TEXT NOT NULL, detail TEXT NOT NULL)""")
                row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                if row is None:
                    db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                elif int(row[0]) > SCHEMA_VERSION:
                    db.execute("ROLLBACK")
                    raise LedgerError(f"{self.path}: ledger schema {row[0]} is from a newer dpml "
                                      f"(this one reads ≤ {SCHEMA_VERSION}); refusing to touch it")
                db.execute("COMMIT")
        except sqlite3.DatabaseError as error:
            raise LedgerError(f"{self.path}: not a readable ledger ({error}); it was not modified") from None

    @staticmethod
    def _spend(row: tuple[Any, ...]) -> Spend:
        mechanism = MechanismDescription.from_dict(json.loads(row[5])) if row[4] else None
        return Spend(row[0], row[1], row[2], row[3], mechanism, row[6])

    _COUNTED = "id NOT IN (SELECT spend_id FROM events WHERE kind = 'cancelled')"

    def _spends(self, db: sqlite3.Connection, dataset_version: str, counted_only: bool = True) -> list[Spend]:
        """The dataset version's spends; by default only those that count (not cancelled)."""
        where = f"dataset_version = ?{' AND ' + self._COUNTED if counted_only else ''}"
        rows = db.execute("SELECT id, dataset_version, label, created_at, private, mechanism, epsilon_alone "
                          f"FROM spends WHERE {where} ORDER BY id", (dataset_version,)).fetchall()  # noqa: S608
        return [self._spend(r) for r in rows]

    def spends(self, dataset_version: str | None = None, counted_only: bool = True) -> list[Spend]:
        """Spends (of one dataset version, or all); by default only those that count (not cancelled)."""
        with self._connect() as db:
            if dataset_version is not None:
                return self._spends(db, dataset_version, counted_only)
            where = f" WHERE {self._COUNTED}" if counted_only else ""
            rows = db.execute("SELECT id, dataset_version, label, created_at, private, mechanism, epsilon_alone "
                              f"FROM spends{where} ORDER BY id").fetchall()  # noqa: S608
            return [self._spend(r) for r in rows]

    def cancel(self, spend_id: int, reason: str) -> bool:
        """Cancel a spend whose run failed before its trainer saw the data; False (and nothing changes)
        once the spend has a ``started`` event — from then on it counts for ever."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            kinds = {row[0] for row in db.execute("SELECT kind FROM events WHERE spend_id = ?", (spend_id,))}
            if "started" in kinds:
                db.execute("ROLLBACK")
                return False
            if "cancelled" not in kinds:
                db.execute("INSERT INTO events (spend_id, created_at, kind, detail) VALUES (?, ?, 'cancelled', ?)",
                           (spend_id, time.time(), json.dumps({"reason": reason})))
            db.execute("COMMIT")
        return True

    def total(self, dataset_version: str) -> float:
        """The composed ε of every private spend on the dataset version, at the ledger's δ."""
        return _compose([s.mechanism for s in self.spends(dataset_version) if s.mechanism], self.delta)

    def kl_total(self, dataset_version: str) -> float:
        """The summed KL of the dataset version's spends (∞ once any (ε, δ)-DP spend is among them)."""
        return _compose_kl([s.mechanism for s in self.spends(dataset_version) if s.mechanism])

    def reserve(self, dataset_version: str, mechanism: MechanismDescription | None, label: str,
                budget: float, kl_budget: float | None = None) -> Spend:
        """Record a planned run's spend, or raise :class:`BudgetExceeded` (the ledger is then unchanged).

        A KL-private run is checked against ``kl_budget`` (refused when it is ``None``), every
        other private run against ``budget`` in (ε, δ) at the ledger's δ.
        """
        from dpml.privacy.accountants import tight_epsilon

        kl_run = mechanism is not None and mechanism.guarantee == "kl"
        alone = float("inf") if mechanism is None or kl_run else tight_epsilon(mechanism, self.delta)
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")  # one writer at a time: check and insert are atomic
            try:
                previous = [s.mechanism for s in self._spends(db, dataset_version) if s.mechanism]
                if kl_run:
                    self._check_kl_budget(dataset_version, previous, mechanism, kl_budget)  # type: ignore[arg-type]
                elif mechanism is not None:
                    before = _compose(previous, self.delta)
                    after = _compose(previous + [mechanism], self.delta)
                    if after > budget and before == float("inf"):
                        raise BudgetExceeded(
                            f"dataset {dataset_version[:12]}…: a KL-private (seed 000) release already used it, so its "
                            "(ε, δ) total is unbounded; no (ε, δ)-DP run can be added. Nothing was recorded.")
                    if after > budget:
                        raise BudgetExceeded(
                            f"dataset {dataset_version[:12]}…: this run would cost ε = {alone:.4g} alone and bring the "
                            f"composed total from {before:.4g} to {after:.4g} (δ = {self.delta:g}), over the budget "
                            f"{budget:g}; {max(budget - before, 0):.4g} of it is left. Nothing was recorded."
                        )
                cursor = db.execute(
                    "INSERT INTO spends (dataset_version, label, created_at, private, mechanism, epsilon_alone) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (dataset_version, label, time.time(), int(mechanism is not None),
                     json.dumps(mechanism.to_dict()) if mechanism else None, alone),
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return Spend(int(cursor.lastrowid), dataset_version, label, time.time(), mechanism, alone)

    @staticmethod
    def _check_kl_budget(dataset_version: str, previous: list[MechanismDescription], mechanism: MechanismDescription,
                         kl_budget: float | None) -> None:
        if kl_budget is None:
            raise BudgetExceeded(f"dataset {dataset_version[:12]}…: this run's guarantee is KL privacy, and "
                                 "ledger.kl_budget is not set; set it to allow KL-private releases. Nothing was recorded.")
        if any(m.guarantee != "kl" for m in previous):
            raise BudgetExceeded(f"dataset {dataset_version[:12]}…: it already has (ε, δ)-DP spends, which bound no KL "
                                 "divergence; a KL-private run cannot be accounted on it. Nothing was recorded.")
        before, after = _compose_kl(previous), _compose_kl(previous + [mechanism])
        if after > kl_budget:
            raise BudgetExceeded(f"dataset {dataset_version[:12]}…: this run would bring the summed KL from {before:.4g} "
                                 f"to {after:.4g}, over ledger.kl_budget = {kl_budget:g}. Nothing was recorded.")

    def record_event(self, spend_id: int, kind: str, detail: dict[str, Any] | None = None) -> None:
        """Append an event (``trained``, ``released``, ``failed`` …) to a spend; spends never change."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            if db.execute("SELECT 1 FROM spends WHERE id = ?", (spend_id,)).fetchone() is None:
                db.execute("ROLLBACK")
                raise LedgerError(f"{self.path}: no spend with id {spend_id}")
            db.execute("INSERT INTO events (spend_id, created_at, kind, detail) VALUES (?, ?, ?, ?)",
                       (spend_id, time.time(), kind, json.dumps(detail or {})))
            db.execute("COMMIT")

    def events(self, spend_id: int) -> list[tuple[str, dict[str, Any]]]:
        with self._connect() as db:
            rows = db.execute("SELECT kind, detail FROM events WHERE spend_id = ? ORDER BY id", (spend_id,)).fetchall()
        return [(kind, json.loads(detail)) for kind, detail in rows]

    def summary(self, dataset_version: str | None = None) -> list[dict[str, Any]]:
        """Per dataset version: spends with their events, private and non-private counts, composed total."""
        out = []
        versions = sorted({s.dataset_version for s in self.spends(dataset_version, counted_only=False)})
        for version in versions:
            spends = self.spends(version)
            listed = self.spends(version, counted_only=False)
            counted = {s.id for s in spends}
            out.append({
                "dataset_version": version,
                "epsilon_total": _compose([s.mechanism for s in spends if s.mechanism], self.delta),
                "kl_total": _compose_kl([s.mechanism for s in spends if s.mechanism])
                if any(s.mechanism is not None and s.mechanism.guarantee == "kl" for s in spends) else None,
                "delta": self.delta,
                "private_spends": sum(s.mechanism is not None for s in spends),
                "nonprivate_runs": sum(s.mechanism is None for s in spends),
                "cancelled_spends": len(listed) - len(spends),
                "spends": [{"id": s.id, "label": s.label, "created_at": s.created_at,
                            "epsilon_alone": s.epsilon_alone, "private": s.mechanism is not None,
                            "counted": s.id in counted, "events": [k for k, _ in self.events(s.id)]} for s in listed],
            })
        return out
