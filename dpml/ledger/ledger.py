"""The privacy budget ledger: a budget that follows people, across every version of a data set.

**Units and lineages.** A budget protects a *privacy unit* (a person; :mod:`dpml.ledger.units`).
A *lineage* is one account for the people of a data set, shared by every version of it: the weekly
table with five new rows is the same lineage, and the people in both versions carry their history
with them. The records decide which lineage a run belongs to, never the file's name
(:func:`dpml.stages.train.lineage_of`): the lineage that already holds the run's units, else
``ledger.dataset``'s or the source's name for people never seen. **One person, one account**
(:mod:`dpml.ledger.lineages`): a reservation whose units another lineage already holds is refused
(:class:`LineageConflict`, one line naming both lineages and how to proceed); ``dpml ledger rename``
renames a lineage or merges two, keeping every spend; and for ledgers written before that rule, a
unit's ε composes every release that touched it under any lineage.

**Spends.** A SQLite file, or a PostgreSQL database many workers share (``ledger.url``;
:mod:`dpml.ledger.db`; the same statements and guarantees), holds an append-only table of
spends. A spend is written — in one transaction with the record of which units it touched, before
any training starts — with the planned mechanism; later rows only add events (``started``,
``trained``, ``released``, ``failed``) and never change or remove a spend. A crash or a SIGKILL at
any point leaves the spend counted: the ledger can over-count a run that died before touching the
data, never under-count one that did.

**When ε counts as spent.** From the reservation on — with one exception: a run that fails after its
reservation but *before* its trainer was handed the training records (the ``started`` event) cancels
the spend (:meth:`Ledger.cancel`, event ``cancelled``), which then no longer counts for anyone;
``dpml ledger`` still lists it. Once ``started`` is recorded a spend can never be cancelled.

**Per-unit accounting.** Each spend records exactly which units it touched (the training part of the
run's data), stored as cohorts of units with one history (:mod:`dpml.ledger.cohorts`). A unit's
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

Two concurrent runs racing for the last of a budget are serialised by ``BEGIN IMMEDIATE`` (on
PostgreSQL: a transaction-scoped advisory lock): the check and the insert are one transaction, and
exactly one proceeds, whichever machines they run on.

The parts: :mod:`dpml.ledger.unit_accounts` (a unit's ε from its history),
:mod:`dpml.ledger.budget_checks` (the check before a run), :mod:`dpml.ledger.schema` (tables,
migration, lineage names), :mod:`dpml.ledger.cohorts` (which units have which history).
"""

from __future__ import annotations

import json
import time

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from dpml.faults import fault_point
from dpml.ledger import cohorts, lineages
from dpml.accounting.accountants import tight_epsilon
from dpml.ledger.budget_checks import Standing, check_budget, within_filter
from dpml.ledger.lineages import Group, LineageConflict
from dpml.ledger.db import SqliteDatabase, open_database
from dpml.ledger.schema import SCHEMA_VERSION, create_tables, default_lineage, migrate_from_v1
from dpml.ledger.views import LedgerViews
from dpml.accounting.mechanism import MechanismDescription
from dpml.ledger.unit_accounts import (
    COUNTED,
    BudgetExceeded,
    History,
    LedgerError,
    UnitAccounts,
    _compose,
    _curve_to_json,
    epsilons_from_rdp,
    filter_bound,
    filter_order,
    rdp_curve,
)
from dpml.ledger.units import UnitKeyError, key_fingerprint, keyed_unit_ids, load_or_create_key

if TYPE_CHECKING:
    from dpml.sections_stores import LedgerConfig

# The ledger's public face: its own classes plus what callers use from the modules it is built from.
__all__ = [
    "BudgetExceeded",
    "Ledger",
    "LedgerError",
    "LineageConflict",
    "Spend",
    "_compose",
    "default_lineage",
    "epsilons_from_rdp",
    "ledger_of",
    "filter_bound",
    "filter_order",
    "rdp_curve",
]


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


class Ledger(LedgerViews):
    """Append-only ledger at ``location``: a SQLite file (a path or ``sqlite:///path``) or a PostgreSQL
    database (``postgresql://user@host:port/db``, shared by many workers; :mod:`dpml.ledger.db`).
    ``delta`` is the δ at which totals are stated; ``unit_key`` is the secret file that turns unit
    digests into the ids the ledger stores (default ``<file>.key`` beside a SQLite ledger; a
    PostgreSQL ledger needs it named, the one file every worker shares)."""

    def __init__(self, location: str | Path, delta: float, unit_key: str | Path | None = None) -> None:
        self._db = open_database(location)
        self.location = self._db.describe()
        self.delta = delta
        if unit_key:
            self.unit_key_path: Path | None = Path(unit_key)
        elif isinstance(self._db, SqliteDatabase):
            self.unit_key_path = self._db.path.with_name(self._db.path.name + ".key")
        else:
            self.unit_key_path = None
        self._key: bytes | None = None
        self._check_or_create()

    # ----------------------------------------------------------------------------------- storage
    def _connect(self) -> AbstractContextManager[Any]:
        return self._db.connect()

    def _check_or_create(self) -> None:
        try:
            with self._connect() as db:
                db.execute("BEGIN IMMEDIATE")
                db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
                row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                if row is not None and int(row[0]) > SCHEMA_VERSION:
                    db.execute("ROLLBACK")
                    raise LedgerError(
                        f"{self.location}: ledger schema {row[0]} is from a newer dpml "
                        f"(this one reads ≤ {SCHEMA_VERSION}); refusing to touch it"
                    )
                if row is not None and int(row[0]) < SCHEMA_VERSION:
                    db.execute("ROLLBACK")
                    if not isinstance(self._db, SqliteDatabase):
                        raise LedgerError(f"{self.location}: ledger schema {row[0]} has no migration here")
                    migrate_from_v1(self._db.path, self._connect)
                    return
                create_tables(db)
                if row is None:
                    db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                db.execute("COMMIT")
        except self._db.errors as error:
            raise LedgerError(
                f"{self.location}: not a readable or reachable ledger ({error}); it was not modified"
            ) from None

    def _unit_key(self, create: bool) -> bytes:
        """The unit key; its fingerprint is stored in the ledger on first use and checked after."""
        if self._key is None:
            if self.unit_key_path is None:
                raise LedgerError(
                    f"{self.location}: a shared (PostgreSQL) ledger needs the unit key file named "
                    "(ledger.unit_key), the same secret file on every worker"
                )
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
                raise LedgerError(
                    f"{self.unit_key_path}: this is not the unit key {self.location} was written with; "
                    "restore the right key file (or point ledger.unit_key at it)"
                )
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
            conditions.append(COUNTED)
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
                db.execute(
                    "INSERT INTO events (spend_id, created_at, kind, detail) VALUES (?, ?, 'cancelled', ?)",
                    (spend_id, time.time(), json.dumps({"reason": reason})),
                )
            db.execute("COMMIT")
        return True

    def record_event(self, spend_id: int, kind: str, detail: dict[str, Any] | None = None) -> None:
        """Append an event (``trained``, ``released``, ``failed`` …) to a spend; spends never change."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            if db.execute("SELECT 1 FROM spends WHERE id = ?", (spend_id,)).fetchone() is None:
                db.execute("ROLLBACK")
                raise LedgerError(f"{self.location}: no spend with id {spend_id}")
            db.execute(
                "INSERT INTO events (spend_id, created_at, kind, detail) VALUES (?, ?, ?, ?)",
                (spend_id, time.time(), kind, json.dumps(detail or {})),
            )
            db.execute("COMMIT")

    def events(self, spend_id: int) -> list[tuple[str, dict[str, Any]]]:
        with self._connect() as db:
            rows = db.execute("SELECT kind, detail FROM events WHERE spend_id = ? ORDER BY id", (spend_id,)).fetchall()
        return [(kind, json.loads(detail)) for kind, detail in rows]

    # ---------------------------------------------------------------------------------- standing
    @staticmethod
    def _base(db: Any, lineage: str) -> History:
        row = db.execute("SELECT base FROM lineages WHERE name = ?", (lineage,)).fetchone()
        return tuple(json.loads(row[0])) if row else ()

    def _groups(self, db: Any, lineage: str) -> list[Group]:
        """The lineage's units by their history across every lineage (:func:`lineages.lineage_groups`)."""
        return lineages.lineage_groups(db, lineage, lambda name: self._base(db, name))

    def _standing_of_run(self, db: Any, lineage: str, ids: np.ndarray | None) -> Standing:
        """The run's units by history. ``ids`` None (units unknown): every unit of the lineage, each with
        every release that touched it under any lineage."""
        base = self._base(db, lineage)
        if ids is None:
            groups = self._groups(db, lineage)
            histories = [base] + [g.releases for g in groups]
            return Standing(
                histories, np.array([0] + [g.units for g in groups], dtype=np.int64), None, [0] * (len(groups) + 1)
            )
        lookup = cohorts.look_up(db, lineage, ids)
        present, counts = cohorts.sorted_unique(lookup.cohort_of_unit)
        history_of = cohorts.histories(db, present)
        return Standing([base + history_of[int(c)] for c in present], counts, lookup, [int(c) for c in present])

    def _lineage_standing(self, db: Any, lineage: str) -> Standing:
        """Every unit of the lineage by history (the base alone stands for units not yet seen)."""
        return self._standing_of_run(db, lineage, None)

    def _filter_order(self, db: Any, lineage: str, budget: float) -> float:
        row = db.execute("SELECT filter_order FROM lineages WHERE name = ?", (lineage,)).fetchone()
        if row is not None and row[0] is not None:
            return float(row[0])
        return filter_order(budget, self.delta)

    def units_within_filter(
        self, lineage: str, digests: np.ndarray, mechanism: MechanismDescription, budget: float
    ) -> np.ndarray:
        """Mask over ``digests`` (one row per unit): the units that may take part in a run of ``mechanism``
        under the lineage's Rényi filter (``ledger.on_exhausted: exclude``). Nothing is written."""
        ids = self.unit_ids(digests)
        unique = cohorts.sorted_unique(ids)[0]
        inverse = cohorts.inverse_of(ids, unique)
        with self._connect() as db:
            self._refuse_other_lineages(db, lineage, unique)
            standing = self._standing_of_run(db, lineage, unique)
            accounts = UnitAccounts(self.delta, db)
            accounts.add_planned(-1, mechanism)
            order = self._filter_order(db, lineage, budget)
            allowed = within_filter(accounts, standing.histories, -1, order, budget, self.delta)
        allowed_cohorts = np.array(
            [c for c, a in zip(standing.cohort_of_history, allowed, strict=True) if a], dtype=np.int64
        )
        assert standing.lookup is not None
        return np.asarray(np.isin(standing.lookup.cohort_of_unit, allowed_cohorts)[inverse.ravel()])

    @staticmethod
    def _refuse_other_lineages(db: Any, lineage: str, ids: np.ndarray) -> None:
        """Raise :class:`LineageConflict` when any of the run's units (sorted unique keyed ids) is already
        accounted under another lineage: one person, one account (:mod:`dpml.ledger.lineages`)."""
        found = lineages.holders(db, ids, lineage)
        if found:
            exists = db.execute("SELECT 1 FROM lineages WHERE name = ?", (lineage,)).fetchone() is not None
            raise lineages.conflict(lineage, int(ids.size), found, exists)

    def generation(self) -> tuple[int, int]:
        """Changes whenever a spend or an event (a rename's too) is written: a key for answers to cache."""
        with self._connect() as db:
            spends = db.execute("SELECT MAX(id) FROM spends").fetchone()[0]
            events = db.execute("SELECT MAX(id) FROM events").fetchone()[0]
        return int(spends or 0), int(events or 0)

    def lineage_holding(self, digests: np.ndarray, fallback: str) -> str:
        """The lineage that already holds these units (digests), the one holding most of them if several;
        ``fallback`` when the ledger has seen none of them. Nothing is written (no key is created)."""
        if not self._has_unit_records():
            return fallback
        ids = cohorts.sorted_unique(self.unit_ids(digests))[0]
        with self._connect() as db:
            found = lineages.holders(db, ids, None)
        if not found:
            return fallback
        return min(found, key=lambda name: (-found[name], name != fallback, name))

    def rename_lineage(self, old: str, new: str, merge: bool = False) -> dict[str, Any]:
        """Rename lineage ``old`` to ``new`` keeping its history, or (``merge``) merge it into the existing
        lineage ``new``: one account for the people of both (:func:`lineages.rename`). One transaction."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                moved = lineages.rename(db, old, new, merge)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return moved | {"epsilon_total": self.total(new)}

    # ------------------------------------------------------------------------------------ reserve
    def reserve(
        self,
        dataset_version: str,
        mechanism: MechanismDescription | None,
        label: str,
        budget: float,
        kl_budget: float | None = None,
        *,
        lineage: str | None = None,
        units: np.ndarray | None = None,
        mode: Literal["refuse", "exclude"] = "refuse",
    ) -> Spend:
        """Record a planned run's spend and the units it touches, or raise :class:`BudgetExceeded`
        (the ledger is then unchanged).

        ``units``: the (n, 16) digests of the training data's units (:mod:`dpml.ledger.units`);
        ``None`` charges the spend to every unit of the lineage. ``lineage`` defaults to the dataset
        version (one account per version, the schema-1 behaviour). ``mode``: ``refuse`` checks the
        composition of every touched unit against ``budget``; ``exclude`` checks the lineage's Rényi
        filter (the caller passes only the units :meth:`units_within_filter` allowed); any other mode is
        refused before anything is read or written (:class:`LedgerError`), not taken as ``refuse``.
        """
        if mode not in ("refuse", "exclude"):
            raise LedgerError(
                f"mode = {mode!r}: the ledger checks a run by 'refuse' (composition against the "
                "budget) or 'exclude' (the Rényi filter) only (ledger.on_exhausted); nothing was "
                "recorded"
            )
        lineage = lineage or dataset_version
        kl_run = mechanism is not None and mechanism.guarantee == "kl"
        alone = float("inf") if mechanism is None or kl_run else tight_epsilon(mechanism, self.delta)
        ids = None if units is None or mechanism is None else cohorts.sorted_unique(self.unit_ids(units))[0]
        curve = None if mechanism is None else rdp_curve(mechanism)
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")  # one writer at a time: check and insert are atomic
            try:
                if ids is not None:
                    self._refuse_other_lineages(db, lineage, ids)
                db.execute(
                    "INSERT OR IGNORE INTO lineages (name, created_at, base) VALUES (?, ?, '[]')",
                    (lineage, time.time()),
                )
                standing = None
                if mechanism is not None:
                    accounts = UnitAccounts(self.delta, db)
                    accounts.add_planned(-1, mechanism)
                    standing = self._standing_of_run(db, lineage, ids)
                    order = self._filter_order(db, lineage, budget) if mode == "exclude" else None
                    check_budget(accounts, standing, lineage, -1, mechanism, budget, kl_budget, order, self.delta)
                    if mode == "exclude":
                        db.execute(
                            "UPDATE lineages SET filter_order = ? WHERE name = ? AND filter_order IS NULL",
                            (self._filter_order(db, lineage, budget), lineage),
                        )
                created = time.time()  # the reservation time, as stored and as returned (its identity: id@time)
                cursor = db.execute(
                    "INSERT INTO spends (dataset_version, label, created_at, private, mechanism, epsilon_alone, "
                    "lineage, n_units, rdp) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        dataset_version,
                        label,
                        created,
                        int(mechanism is not None),
                        json.dumps(mechanism.to_dict()) if mechanism else None,
                        alone,
                        lineage,
                        None if ids is None else int(ids.size),
                        None if curve is None else _curve_to_json(curve),
                    ),
                )
                spend_id = int(cursor.lastrowid)
                if mechanism is not None and ids is None:
                    base = list(self._base(db, lineage)) + [spend_id]
                    db.execute("UPDATE lineages SET base = ? WHERE name = ?", (json.dumps(base), lineage))
                elif mechanism is not None and ids is not None and standing is not None and standing.lookup is not None:
                    history_of = cohorts.histories(db, standing.lookup.cohort_of_unit)
                    cohorts.record_spend(
                        db, lineage, standing.lookup, np.ones(ids.size, dtype=bool), spend_id, history_of
                    )
                fault_point("ledger:units_written")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return Spend(
            spend_id, dataset_version, label, created, mechanism, alone, lineage, None if ids is None else int(ids.size)
        )


def ledger_of(settings: LedgerConfig) -> Ledger:
    """The ledger a configuration's ``ledger:`` section names: its location (a SQLite file or a PostgreSQL
    URL), the δ it composes at and its privacy-unit key."""
    return Ledger(settings.location(), settings.delta, unit_key=settings.unit_key)
