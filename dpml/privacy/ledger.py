"""The privacy budget ledger: a budget that follows people, across every version of a data set.

**Units and lineages.** A budget protects a *privacy unit* (a person; :mod:`dpml.privacy.units`).
A *lineage* (``ledger.dataset``; by default the name of ``data.source``: ``adult`` for
``csv:data/adult.csv``) is one account shared by every version of a data set: the weekly table with
five new rows is the same lineage, and the people in both versions carry their history with them.

**Spends.** One SQLite file holds an append-only table of spends. A spend is written — in one
transaction with the record of which units it touched, before any training starts — with the planned
mechanism; later rows only add events (``started``, ``trained``, ``released``, ``failed``) and never
change or remove a spend. A crash or a SIGKILL at any point leaves the spend counted: the ledger can
over-count a run that died before touching the data, never under-count one that did.

**When ε counts as spent.** From the reservation on — with one exception: a run that fails after its
reservation but *before* its trainer was handed the training records (the ``started`` event) cancels
the spend (:meth:`Ledger.cancel`, event ``cancelled``), which then no longer counts for anyone;
``dpml ledger`` still lists it. Once ``started`` is recorded a spend can never be cancelled.

**Per-unit accounting.** Each spend records exactly which units it touched (the training part of the
run's data), stored as cohorts of units with one history (:mod:`dpml.privacy.cohorts`). A unit's
privacy loss is the composition of the mechanisms of the counted private spends that touched it: the
smaller of two valid upper bounds, RDP (Mironov 2017, summed curves; converted by Canonne, Kamath &
Steinke 2020, Prop. 12) and, where it matters, one PLD accountant over every event (tighter). The
lineage's guarantee is the largest over its units. Spends whose units are unknown (written by
:meth:`Ledger.reserve` without units, or migrated from a ledger of schema 1) are charged to *every*
unit of the lineage (its ``base``): an over-count, never an under-count.

**The check before a run** (``ledger.on_exhausted``):

- ``refuse`` (default): the run is refused, untrained and unrecorded, when any unit of its training
  data would go over ``epsilon_budget``; the error names how many and their current ε. (The refusal is
  seen only by whoever runs dpml, who holds the data anyway; no model is released.)
- ``exclude``: :meth:`Ledger.units_within_filter` says which units may take part; the run trains
  without the others. This is an **individual Rényi filter** (Feldman & Zrnic 2021, "Individual
  privacy accounting via a Rényi filter", Thm. 3.1 with the individual losses of Alg. 1): with an
  order α* fixed for the lineage before its first filtered run (:func:`filter_order`), unit i takes
  part in run t only if Σ_{s touched i} ρ_s(α*) + ρ_t(α*) ≤ B*, where B* is the largest RDP at α*
  that converts to ``epsilon_budget`` at δ. Whatever the adaptive sequence of runs, every unit is
  then (α*, B*)-RDP, hence (``epsilon_budget``, δ)-DP. An excluded unit's individual loss in that
  run is 0 (its record is not in the run at all).

KL-private spends (seed 000) compose additively in KL (the chain rule) against ``kl_budget``; a unit
with one has no finite (ε, δ), and (ε, δ)-DP spends bound no KL, so the two kinds exclude each other
on one unit. Spends of different neighbouring relations cannot be composed and are refused.
Non-private runs (baselines) are recorded as such and touch no account: their models carry no
guarantee, and the report lists them.

Two concurrent runs racing for the last of a budget are serialised by ``BEGIN IMMEDIATE``: the check
and the insert are one transaction, and exactly one proceeds.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dpml.faults import fault_point
from dpml.privacy import cohorts
from dpml.privacy.mechanism import MechanismDescription
from dpml.privacy.units import UnitKeyError, key_fingerprint, keyed_unit_ids, load_or_create_key

SCHEMA_VERSION = 2
PLD_REFINEMENTS = 4  # the most PLD compositions one check or summary computes beyond its memo
PLD_MAX_EVENTS = 8  # histories of more distinct events keep their RDP bound (a PLD would take many seconds)
History = tuple[int, ...]


class LedgerError(RuntimeError):
    """A ledger that cannot be used: corrupt, from a newer dpml, or mixed relations."""


class BudgetExceeded(LedgerError):
    """The planned run would take some unit of the lineage over its budget."""


@dataclass(frozen=True)
class Spend:
    id: int
    dataset_version: str
    label: str
    created_at: float
    mechanism: MechanismDescription | None  # None: a non-private run
    epsilon_alone: float
    lineage: str = ""
    n_units: int | None = None  # units touched; None: unknown (charged to every unit of the lineage)


def default_lineage(source: str) -> str:
    """The lineage of a ``data.source`` when ``ledger.dataset`` is not set: the file or folder name
    without extension (``csv:data/adult.csv`` → ``adult``), or the bundled set's name."""
    scheme, _, rest = source.partition(":")
    if scheme == "sklearn":
        return rest
    path = Path(rest.rstrip("/\\") or rest)
    return path.name if scheme == "idx" else path.stem


_LABEL_SOURCE = re.compile(r"\(((?:sklearn|idx|csv|parquet):[^()]*)\)\s*$")


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
    from dpml.privacy.accountants import epsilon_pld, has_zcdp, mechanism_rdp_curve
    from dpml.privacy.tuning import ORDERS, rdp_to_epsilon

    if any((m.selection is not None and m.selection.random) or has_zcdp(m) for m in mechanisms):
        # A random-count search or a zCDP run has an RDP curve but no PLD: compose every spend in RDP.
        return rdp_to_epsilon(ORDERS, sum(mechanism_rdp_curve(m) for m in mechanisms), delta)
    events = tuple(e for m in mechanisms for e in m.composed_events())
    combined = MechanismDescription("ledger", events, mechanisms[0].neighbouring, 1.0, 0)
    return epsilon_pld(combined, delta)


def _compose_kl(mechanisms: list[MechanismDescription]) -> float:
    """Total KL of the spends: KL composes additively, adaptively too (the chain rule).

    An (ε, δ)-DP spend with δ > 0 bounds no KL divergence: it makes the KL total unbounded.
    """
    from dpml.privacy.kl_certificate import certified_kl

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
    from dp_accounting import UnsupportedEventError

    from dpml.privacy.accountants import mechanism_rdp_curve
    from dpml.privacy.tuning import ORDERS

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
    from dpml.privacy.tuning import ORDERS

    orders = np.asarray(ORDERS, dtype=float)
    usable = orders > 1.01
    with np.errstate(invalid="ignore"):
        shift = np.log1p(-1.0 / orders[usable]) - np.log(delta * orders[usable]) / (orders[usable] - 1.0)
        eps = np.atleast_2d(rdp)[:, usable] + shift
    eps = np.where(np.isnan(eps), np.inf, eps)
    return np.maximum(eps.min(axis=1), 0.0)


def filter_order(budget: float, delta: float) -> float:
    """α* of a lineage's Rényi filter: the order at which a Gaussian-shaped composition (ρ(α) = cα, the
    shape of composed subsampled Gaussians at small q) reaching exactly ``budget`` at δ converts best.
    It depends on the budget and δ only, never on the data, and is fixed at a lineage's first
    filtered run."""
    from dpml.privacy.tuning import ORDERS

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


def _units_phrase(units: int) -> str:
    """How a budget refusal names the units it is about (a run without a unit list is charged to all)."""
    if units == 0:
        return "every privacy unit of the lineage (this run's data carries no unit list)"
    return f"{units:,} privacy units of this run"


def _curve_to_json(curve: np.ndarray) -> str:
    return json.dumps([float(v) if np.isfinite(v) else None for v in curve])


def _curve_from_json(text: str) -> np.ndarray:
    return np.array([np.inf if v is None else v for v in json.loads(text)], dtype=float)


class _Accounts:
    """Per-unit privacy loss of histories (tuples of spend ids), within one connection."""

    def __init__(self, ledger: Ledger, db: sqlite3.Connection) -> None:
        from dpml.privacy.tuning import ORDERS

        self.ledger, self.db, self.delta = ledger, db, ledger.delta
        self.orders = np.asarray(ORDERS, dtype=float)
        rows = db.execute(f"SELECT id, mechanism, rdp FROM spends WHERE private = 1 AND {Ledger.COUNTED}").fetchall()  # noqa: S608
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

    def epsilons(self, histories: list[History], above: float | None = None,
                 limit: int = PLD_REFINEMENTS) -> np.ndarray:
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


@dataclass(frozen=True)
class _Standing:
    """The units of one run (or of the whole lineage) grouped by history."""

    histories: list[History]  # each with the lineage's base in front
    units: np.ndarray          # how many of the run's units have each history
    lookup: cohorts.Lookup | None
    cohort_of_history: list[int]


class Ledger:
    """Append-only SQLite ledger; ``delta`` is the δ at which totals are stated; ``unit_key`` is the
    secret file that turns unit digests into the ids the ledger stores (default ``<path>.key``)."""

    COUNTED = "id NOT IN (SELECT spend_id FROM events WHERE kind = 'cancelled')"

    def __init__(self, path: str | Path, delta: float, unit_key: str | Path | None = None) -> None:
        self.path = Path(path)
        self.delta = delta
        self.unit_key_path = Path(unit_key) if unit_key else self.path.with_name(self.path.name + ".key")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._key: bytes | None = None
        self._check_or_create()

    # ----------------------------------------------------------------------------------- storage
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
                row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                if row is not None and int(row[0]) > SCHEMA_VERSION:
                    db.execute("ROLLBACK")
                    raise LedgerError(f"{self.path}: ledger schema {row[0]} is from a newer dpml "
                                      f"(this one reads ≤ {SCHEMA_VERSION}); refusing to touch it")
                if row is not None and int(row[0]) < SCHEMA_VERSION:
                    db.execute("ROLLBACK")
                    self._migrate_from_v1()
                    return
                self._create_tables(db)
                if row is None:
                    db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                db.execute("COMMIT")
        except sqlite3.DatabaseError as error:
            raise LedgerError(f"{self.path}: not a readable ledger ({error}); it was not modified") from None

    @staticmethod
    def _create_tables(db: sqlite3.Connection) -> None:
        db.execute("""CREATE TABLE IF NOT EXISTS spends (
            id INTEGER PRIMARY KEY AUTOINCREMENT, dataset_version TEXT NOT NULL, label TEXT NOT NULL,
            created_at REAL NOT NULL, private INTEGER NOT NULL, mechanism TEXT, epsilon_alone REAL NOT NULL,
            lineage TEXT, n_units INTEGER, rdp TEXT)""")
        db.execute("""CREATE TABLE IF NOT EXISTS events (
            id INTEGER PRIMARY KEY AUTOINCREMENT, spend_id INTEGER NOT NULL REFERENCES spends(id),
            created_at REAL NOT NULL, kind TEXT NOT NULL, detail TEXT NOT NULL)""")
        db.execute("""CREATE TABLE IF NOT EXISTS lineages (
            name TEXT PRIMARY KEY, created_at REAL NOT NULL, base TEXT NOT NULL, filter_order REAL)""")
        db.execute("CREATE TABLE IF NOT EXISTS history_epsilon (key TEXT PRIMARY KEY, epsilon REAL NOT NULL)")
        for statement in cohorts.SCHEMA:
            db.execute(statement)

    def _migrate_from_v1(self) -> None:
        """Schema 1 (one account per dataset version, no units) → 2. A copy of the old file is kept
        beside it (``<name>.v1``). Every old private spend becomes a spend of unknown units charged to
        every unit of its lineage — the lineage named after the source in its label (``… (csv:x.csv)``
        → ``x``), else its dataset version — which can only over-count."""
        backup = self.path.with_name(self.path.name + ".v1")
        with self._connect() as db:
            if not backup.exists():
                with sqlite3.connect(backup) as copy:
                    db.backup(copy)
            db.execute("BEGIN IMMEDIATE")
            version = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if version is None or int(version[0]) != 1:  # another process migrated meanwhile
                db.execute("ROLLBACK")
                return
            for column in ("lineage TEXT", "n_units INTEGER", "rdp TEXT"):
                db.execute(f"ALTER TABLE spends ADD COLUMN {column}")
            self._create_tables(db)
            base: dict[str, list[int]] = {}
            for spend_id, version_hash, label, private, mechanism in db.execute(
                    "SELECT id, dataset_version, label, private, mechanism FROM spends ORDER BY id").fetchall():
                match = _LABEL_SOURCE.search(label)
                lineage = default_lineage(match.group(1)) if match else version_hash
                curve = _curve_to_json(rdp_curve(MechanismDescription.from_dict(json.loads(mechanism)))) if private else None
                db.execute("UPDATE spends SET lineage = ?, rdp = ? WHERE id = ?", (lineage, curve, spend_id))
                base.setdefault(lineage, [])
                if private:
                    base[lineage].append(int(spend_id))
            for lineage, spends in base.items():
                db.execute("INSERT OR IGNORE INTO lineages (name, created_at, base) VALUES (?, ?, ?)",
                           (lineage, time.time(), json.dumps(spends)))
            db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
            db.execute("COMMIT")

    def _unit_key(self, create: bool) -> bytes:
        """The unit key; its fingerprint is stored in the ledger on first use and checked after."""
        if self._key is None:
            try:
                key = load_or_create_key(self.unit_key_path, create=create)
            except UnitKeyError as error:
                raise LedgerError(str(error)) from None
            with self._connect() as db:
                db.execute("BEGIN IMMEDIATE")
                row = db.execute("SELECT value FROM meta WHERE key = 'unit_key_fingerprint'").fetchone()
                if row is None:
                    db.execute("INSERT INTO meta VALUES ('unit_key_fingerprint', ?)", (key_fingerprint(key),))
                db.execute("COMMIT")
            if row is not None and row[0] != key_fingerprint(key):
                raise LedgerError(f"{self.unit_key_path}: this is not the unit key {self.path} was written with; "
                                  "restore the right key file (or point ledger.unit_key at it)")
            self._key = key
        return self._key

    def check_unit_key(self) -> None:
        """Raise :class:`LedgerError` when the unit key is missing (for a ledger with units) or not this
        ledger's; create it for a ledger that has none yet."""
        self._unit_key(create=not self._has_unit_records())

    def unit_ids(self, digests: np.ndarray) -> np.ndarray:
        """The keyed ids the ledger stores for these unit digests (input order)."""
        has_units = self._has_unit_records()
        return keyed_unit_ids(digests, self._unit_key(create=not has_units))

    def _has_unit_records(self) -> bool:
        with self._connect() as db:
            return db.execute("SELECT 1 FROM unit_shards LIMIT 1").fetchone() is not None

    # ------------------------------------------------------------------------------------ spends
    @staticmethod
    def _spend(row: tuple[Any, ...]) -> Spend:
        mechanism = MechanismDescription.from_dict(json.loads(row[5])) if row[4] else None
        return Spend(row[0], row[1], row[2], row[3], mechanism, row[6], row[7] or row[1], row[8])

    _COLUMNS = "id, dataset_version, label, created_at, private, mechanism, epsilon_alone, lineage, n_units"

    def spends(self, lineage: str | None = None, counted_only: bool = True) -> list[Spend]:
        """Spends (of one lineage, or all); by default only those that count (not cancelled)."""
        conditions, values = [], []
        if lineage is not None:
            conditions.append("lineage = ?")
            values.append(lineage)
        if counted_only:
            conditions.append(self.COUNTED)
        where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        with self._connect() as db:
            rows = db.execute(f"SELECT {self._COLUMNS} FROM spends{where} ORDER BY id", values).fetchall()  # noqa: S608
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

    # ---------------------------------------------------------------------------------- standing
    @staticmethod
    def _base(db: sqlite3.Connection, lineage: str) -> History:
        row = db.execute("SELECT base FROM lineages WHERE name = ?", (lineage,)).fetchone()
        return tuple(json.loads(row[0])) if row else ()

    def _standing_of_run(self, db: sqlite3.Connection, lineage: str, ids: np.ndarray | None) -> _Standing:
        """The run's units by history. ``ids`` None (units unknown): every unit of the lineage."""
        base = self._base(db, lineage)
        if ids is None:
            rows = cohorts.lineage_cohorts(db, lineage)
            histories = [base] + [base + h for _, h, _ in rows]
            return _Standing(histories, np.array([0] + [s for *_, s in rows]), None, [0] + [c for c, *_ in rows])
        lookup = cohorts.look_up(db, lineage, ids)
        present, counts = cohorts.sorted_unique(lookup.cohort_of_unit)
        history_of = cohorts.histories(db, present)
        return _Standing([base + history_of[int(c)] for c in present], counts, lookup, [int(c) for c in present])

    def _lineage_standing(self, db: sqlite3.Connection, lineage: str) -> _Standing:
        """Every unit of the lineage by history (the base alone stands for units not yet seen)."""
        return self._standing_of_run(db, lineage, None)

    # -------------------------------------------------------------------------------------- check
    def _check(self, accounts: _Accounts, standing: _Standing, lineage: str, planned: int,
               mechanism: MechanismDescription, budget: float, kl_budget: float | None, mode: str,
               db: sqlite3.Connection) -> None:
        """Raise :class:`BudgetExceeded` when any unit of the run would go over its budget."""
        candidates = [h + (planned,) for h in standing.histories]
        relations = set().union(*(accounts.relations(h) for h in candidates)) if candidates else set()
        if len(relations) > 1:
            raise LedgerError(f"lineage {lineage!r}: cannot compose spends under different neighbouring relations "
                              f"{sorted(relations)}; nothing was recorded")
        alone = accounts.epsilons([(planned,)])[0] if mechanism.guarantee != "kl" else math.inf
        if mechanism.guarantee == "kl":
            return self._check_kl(accounts, standing, candidates, lineage, kl_budget)
        if mode == "exclude":
            over = ~self._within_filter(accounts, standing.histories, planned, budget, db, lineage)
            rule = "the lineage's Rényi filter"
        else:
            over = accounts.epsilons(candidates, above=budget) > budget
            rule = "composition"
        if not over.any():
            return
        units = int(standing.units[over].sum())
        now = accounts.epsilons([h for h, o in zip(standing.histories, over) if o], limit=1)
        after = accounts.epsilon_rdp([c for c, o in zip(candidates, over) if o])
        total = int(standing.units.sum())
        kl_units = any(any(accounts.mechanism(s).guarantee == "kl" for s in accounts.counted(h))
                       for h, o in zip(standing.histories, over) if o)
        why = (" (a KL-private release already used them, so their (ε, δ) loss is unbounded)" if kl_units else "")
        raise BudgetExceeded(
            f"lineage {lineage!r}: {units:,} of the {total:,} privacy units in this run's training data have spent "
            f"ε = {float(now.min()):.4g}…{float(now.max()):.4g} already{why}; this run (ε = {alone:.4g} alone at "
            f"δ = {self.delta:g}) would take them to ε ≈ {float(np.min(after)):.4g} or more ({rule}), over "
            f"ledger.epsilon_budget = {budget:g}; {max(budget - float(now.max()), 0.0):.4g} of their budget is left. "
            "Nothing was recorded. To train without them, set ledger.on_exhausted: exclude.")

    def _check_kl(self, accounts: _Accounts, standing: _Standing, candidates: list[History], lineage: str,
                  kl_budget: float | None) -> None:
        if kl_budget is None:
            raise BudgetExceeded(f"lineage {lineage!r}: this run's guarantee is KL privacy, and ledger.kl_budget is "
                                 "not set; set it to allow KL-private releases. Nothing was recorded.")
        for history, candidate, units in zip(standing.histories, candidates, standing.units):
            if any(accounts.mechanism(s).guarantee != "kl" for s in accounts.counted(history)):
                raise BudgetExceeded(
                    f"lineage {lineage!r}: {_units_phrase(int(units))} already have (ε, δ)-DP spends, "
                    "which bound no KL divergence; a KL-private run cannot be accounted on them. Nothing was recorded.")
            before, after = accounts.kl(history), accounts.kl(candidate)
            if after > kl_budget:
                raise BudgetExceeded(
                    f"lineage {lineage!r}: {_units_phrase(int(units))} would go from summed KL = {before:.4g} to "
                    f"{after:.4g}, over ledger.kl_budget = {kl_budget:g}. Nothing was recorded.")

    def _within_filter(self, accounts: _Accounts, histories: list[History], planned: int, budget: float,
                       db: sqlite3.Connection, lineage: str) -> np.ndarray:
        """Per history: may its units take part under the lineage's Rényi filter (Feldman & Zrnic 2021)?"""
        order = self._filter_order(db, lineage, budget)
        column = int(np.flatnonzero(accounts.orders == order)[0])
        spent = accounts.rdp(histories)[:, column] if histories else np.zeros(0)
        return spent + accounts.curves[planned][column] <= filter_bound(order, budget, self.delta) + 1e-12

    def _filter_order(self, db: sqlite3.Connection, lineage: str, budget: float) -> float:
        row = db.execute("SELECT filter_order FROM lineages WHERE name = ?", (lineage,)).fetchone()
        if row is not None and row[0] is not None:
            return float(row[0])
        return filter_order(budget, self.delta)

    def units_within_filter(self, lineage: str, digests: np.ndarray, mechanism: MechanismDescription,
                            budget: float) -> np.ndarray:
        """Mask over ``digests`` (one row per unit): the units that may take part in a run of ``mechanism``
        under the lineage's Rényi filter (``ledger.on_exhausted: exclude``). Nothing is written."""
        ids = self.unit_ids(digests)
        unique = cohorts.sorted_unique(ids)[0]
        inverse = cohorts.inverse_of(ids, unique)
        with self._connect() as db:
            standing = self._standing_of_run(db, lineage, unique)
            accounts = _Accounts(self, db)
            accounts.add_planned(-1, mechanism)
            allowed = self._within_filter(accounts, standing.histories, -1, budget, db, lineage)
        allowed_cohorts = np.array([c for c, a in zip(standing.cohort_of_history, allowed) if a], dtype=np.int64)
        assert standing.lookup is not None
        return np.isin(standing.lookup.cohort_of_unit, allowed_cohorts)[inverse.ravel()]

    # ------------------------------------------------------------------------------------ reserve
    def reserve(self, dataset_version: str, mechanism: MechanismDescription | None, label: str,
                budget: float, kl_budget: float | None = None, *, lineage: str | None = None,
                units: np.ndarray | None = None, mode: Literal["refuse", "exclude"] = "refuse") -> Spend:
        """Record a planned run's spend and the units it touches, or raise :class:`BudgetExceeded`
        (the ledger is then unchanged).

        ``units``: the (n, 16) digests of the training data's units (:mod:`dpml.privacy.units`);
        ``None`` charges the spend to every unit of the lineage. ``lineage`` defaults to the dataset
        version (one account per version, the schema-1 behaviour). ``mode``: ``refuse`` checks the
        composition of every touched unit against ``budget``; ``exclude`` checks the lineage's Rényi
        filter (the caller passes only the units :meth:`units_within_filter` allowed).
        """
        from dpml.privacy.accountants import tight_epsilon

        lineage = lineage or dataset_version
        kl_run = mechanism is not None and mechanism.guarantee == "kl"
        alone = float("inf") if mechanism is None or kl_run else tight_epsilon(mechanism, self.delta)
        ids = None if units is None or mechanism is None else cohorts.sorted_unique(self.unit_ids(units))[0]
        curve = None if mechanism is None else rdp_curve(mechanism)
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")  # one writer at a time: check and insert are atomic
            try:
                db.execute("INSERT OR IGNORE INTO lineages (name, created_at, base) VALUES (?, ?, '[]')",
                           (lineage, time.time()))
                standing = None
                if mechanism is not None:
                    accounts = _Accounts(self, db)
                    accounts.add_planned(-1, mechanism)
                    standing = self._standing_of_run(db, lineage, ids)
                    self._check(accounts, standing, lineage, -1, mechanism, budget, kl_budget, mode, db)
                    if mode == "exclude":
                        db.execute("UPDATE lineages SET filter_order = ? WHERE name = ? AND filter_order IS NULL",
                                   (self._filter_order(db, lineage, budget), lineage))
                cursor = db.execute(
                    "INSERT INTO spends (dataset_version, label, created_at, private, mechanism, epsilon_alone, "
                    "lineage, n_units, rdp) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (dataset_version, label, time.time(), int(mechanism is not None),
                     json.dumps(mechanism.to_dict()) if mechanism else None, alone, lineage,
                     None if ids is None else int(ids.size),
                     None if curve is None else _curve_to_json(curve)),
                )
                spend_id = int(cursor.lastrowid)
                if mechanism is not None and ids is None:
                    base = list(self._base(db, lineage)) + [spend_id]
                    db.execute("UPDATE lineages SET base = ? WHERE name = ?", (json.dumps(base), lineage))
                elif mechanism is not None and standing is not None and standing.lookup is not None:
                    history_of = cohorts.histories(db, standing.lookup.cohort_of_unit)
                    cohorts.record_spend(db, lineage, standing.lookup, np.ones(ids.size, dtype=bool), spend_id,
                                         history_of)
                fault_point("ledger:units_written")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return Spend(spend_id, dataset_version, label, time.time(), mechanism, alone, lineage,
                     None if ids is None else int(ids.size))

    # ------------------------------------------------------------------------------------ totals
    def total(self, lineage: str) -> float:
        """The lineage's guarantee: the largest ε(δ) over its units (at the ledger's δ)."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            standing = self._lineage_standing(db, lineage)
            value = float(_Accounts(self, db).epsilons(standing.histories).max()) if standing.histories else 0.0
            db.execute("COMMIT")
        return value

    def kl_total(self, lineage: str) -> float:
        """The largest summed KL over the lineage's units (∞ once an (ε, δ)-DP spend touched one)."""
        with self._connect() as db:
            standing = self._lineage_standing(db, lineage)
            accounts = _Accounts(self, db)
            return max((accounts.kl(h) for h in standing.histories), default=0.0)

    def unit_epsilons(self, lineage: str) -> list[tuple[float, int]]:
        """(ε, number of units) for every history of the lineage's units, largest first."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            standing = self._lineage_standing(db, lineage)
            eps = _Accounts(self, db).epsilons(standing.histories)
            db.execute("COMMIT")
        pairs = [(float(e), int(n)) for e, n in zip(eps, standing.units) if n > 0]
        return sorted(pairs, reverse=True)

    def summary(self, lineage: str | None = None) -> list[dict[str, Any]]:
        """Per lineage: versions, spends with their events, the distribution of unit ε, the largest."""
        out = []
        listed_all = self.spends(lineage, counted_only=False)
        for name in sorted({s.lineage for s in listed_all}):
            listed = [s for s in listed_all if s.lineage == name]
            counted = {s.id for s in self.spends(name)}
            with self._connect() as db:
                db.execute("BEGIN IMMEDIATE")
                standing = self._lineage_standing(db, name)
                accounts = _Accounts(self, db)
                eps = accounts.epsilons(standing.histories)
                kl_any = any(s.mechanism is not None and s.mechanism.guarantee == "kl" and s.id in counted
                             for s in listed)
                kl = max((accounts.kl(h) for h in standing.histories), default=0.0) if kl_any else None
                base = self._base(db, name)
                order_row = db.execute("SELECT filter_order FROM lineages WHERE name = ?", (name,)).fetchone()
                db.execute("COMMIT")
            levels: dict[float, int] = {}
            for value, count in zip(eps, standing.units):
                if count > 0:
                    level = float(f"{value:.4g}")
                    levels[level] = levels.get(level, 0) + int(count)
            versions: dict[str, int] = {}
            for s in listed:
                versions[s.dataset_version] = versions.get(s.dataset_version, 0) + 1
            out.append({
                "lineage": name,
                "dataset_versions": versions,
                "epsilon_total": float(eps.max()) if eps.size else 0.0,
                "kl_total": kl,
                "delta": self.delta,
                "units": int(standing.units[1:].sum()) if standing.units.size else 0,
                "unit_epsilon": sorted(levels.items(), reverse=True),
                "unknown_unit_spends": list(base),
                "filter_order": None if order_row is None else order_row[0],
                "private_spends": sum(s.mechanism is not None and s.id in counted for s in listed),
                "nonprivate_runs": sum(s.mechanism is None and s.id in counted for s in listed),
                "cancelled_spends": sum(s.id not in counted for s in listed),
                "spends": [{"id": s.id, "label": s.label, "created_at": s.created_at, "dataset_version": s.dataset_version,
                            "epsilon_alone": s.epsilon_alone, "private": s.mechanism is not None, "units": s.n_units,
                            "counted": s.id in counted, "events": [k for k, _ in self.events(s.id)]} for s in listed],
            })
        return out
