"""The ledger's SQLite schema (version 2), the migration from schema 1, and lineage names.

Schema 2: ``spends`` (append-only; ``lineage``, ``n_units`` and the RDP curve per spend), ``events``,
``lineages`` (``base``: spends charged to every unit of the lineage; the Rényi filter's order), a memo
of PLD compositions, and the unit cohorts of :mod:`dpml.ledger.cohorts`.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from dpml.ledger import cohorts
from dpml.accounting.mechanism import MechanismDescription
from dpml.ledger.unit_accounts import _curve_to_json, rdp_curve
from dpml.data.source_kinds import source_name

SCHEMA_VERSION = 2


def default_lineage(source: str) -> str:
    """The name a *new* lineage takes when ``ledger.dataset`` is not set and the ledger has never seen the
    run's people: the source's name (:func:`dpml.data.source_kinds.source_name`). People the ledger has seen
    stay in their lineage whatever the file is called (:func:`dpml.stages.train.lineage_of`)."""
    return source_name(source)


_LABEL_SOURCE = re.compile(r"\(((?:sklearn|idx|csv|parquet):[^()]*)\)\s*$")


def create_tables(db: sqlite3.Connection) -> None:
    """The schema-2 tables (idempotent)."""
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


def migrate_from_v1(path: Path, connect: Callable[[], AbstractContextManager[sqlite3.Connection]]) -> None:
    """Schema 1 (one account per dataset version, no units) → 2. A copy of the old file is kept
    beside it (``<name>.v1``). Every old private spend becomes a spend of unknown units charged to
    every unit of its lineage — the lineage named after the source in its label (``… (csv:x.csv)``
    → ``x``), else its dataset version — which can only over-count."""
    backup = path.with_name(path.name + ".v1")
    with connect() as db:
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
        create_tables(db)
        base: dict[str, list[int]] = {}
        for spend_id, version_hash, label, private, mechanism in db.execute(
            "SELECT id, dataset_version, label, private, mechanism FROM spends ORDER BY id"
        ).fetchall():
            match = _LABEL_SOURCE.search(label)
            lineage = default_lineage(match.group(1)) if match else version_hash
            curve = (
                _curve_to_json(rdp_curve(MechanismDescription.from_dict(json.loads(mechanism)))) if private else None
            )
            db.execute("UPDATE spends SET lineage = ?, rdp = ? WHERE id = ?", (lineage, curve, spend_id))
            base.setdefault(lineage, [])
            if private:
                base[lineage].append(int(spend_id))
        for lineage, spends in base.items():
            db.execute(
                "INSERT OR IGNORE INTO lineages (name, created_at, base) VALUES (?, ?, ?)",
                (lineage, time.time(), json.dumps(spends)),
            )
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
        db.execute("COMMIT")
