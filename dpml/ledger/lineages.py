"""One person, one account: which lineages hold a unit, every release that touched it, renames and merges.

A lineage is an account of *people* (privacy units), not of a file: the ledger recognises a unit by its
keyed id (:mod:`dpml.ledger.units`), whatever the file it came from was called or how it was encoded.
This module keeps that true across lineages, on SQLite and PostgreSQL alike (plain SQL over the
tables of :mod:`dpml.ledger.cohorts`; no schema change):

- :func:`holders`: the lineages other than a run's own that already hold some of its units. The
  ledger refuses such a run (:class:`LineageConflict`, one line naming both lineages and the fix), so
  from then on every unit lives in one lineage and its composed ε is its lineage's.
- :func:`lineage_groups`: a lineage's units grouped by their history *across every lineage*. Ledgers
  written before that rule may hold the same people under several names (a renamed file opened a
  fresh account); each such unit's ε composes every release that touched it, whatever the lineage, in
  the lineage's largest unit ε, the budget check and ``dpml ledger``.
- :func:`rename`: ``dpml ledger rename OLD NEW`` moves a lineage's spends, units and filter order to a
  new name; with ``merge`` into an existing lineage, each shared unit's history becomes the union of
  both (the spends that touched it under either name), and the lineage's base (spends of unknown
  units) the union of both bases — an over-count for units of one side only, never an under-count.
  Every moved spend gets a ``lineage_renamed`` event naming the old and new names, so the history of
  names is kept; the spends' mechanisms, units and earlier events never change.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpml.ledger import cohorts
from dpml.ledger.unit_accounts import History, LedgerError

MAX_NAME = 200  # characters of a lineage name (ledger.dataset)


class LineageConflict(LedgerError):
    """A run's units are already accounted under another lineage: one person, one account."""


@dataclass(frozen=True)
class Group:
    """Units of one lineage with one history across every lineage: ``releases`` (spend ids, sorted),
    ``units`` how many, ``lineages`` the lineages holding them."""

    releases: History
    units: int
    lineages: tuple[str, ...]


def unit_lineages(db: Any, other_than: str | None = None) -> list[str]:
    """Lineages that hold units (other than ``other_than``), sorted."""
    rows = db.execute("SELECT DISTINCT lineage FROM unit_shards").fetchall()
    return sorted(str(r[0]) for r in rows if r[0] != other_than)


def holders(db: Any, ids: np.ndarray, other_than: str | None) -> dict[str, int]:
    """For each lineage other than ``other_than`` that holds any of ``ids`` (sorted unique keyed ids):
    how many of them it holds."""
    found: dict[str, int] = {}
    for name in unit_lineages(db, other_than):
        count = int(np.count_nonzero(cohorts.look_up(db, name, ids).cohort_of_unit))
        if count:
            found[name] = count
    return found


def conflict(lineage: str, run_units: int, found: dict[str, int], lineage_exists: bool) -> LineageConflict:
    """The one-line refusal of a run whose units ``found`` under other lineages (module docstring)."""
    names = sorted(found, key=lambda n: (-found[n], n))
    where = ", ".join(f"{n!r} ({found[n]:,} of them)" for n in names)
    if len(names) > 1:
        fix = (
            f"merge those lineages first (dpml ledger rename {names[1]} {names[0]} --merge), then set "
            f"ledger.dataset: {names[0]}"
        )
    elif lineage_exists:
        fix = (
            f"set ledger.dataset: {names[0]} (or leave ledger.dataset out: the lineage then follows the records), "
            f"or merge the two accounts: dpml ledger rename {lineage} {names[0]} --merge"
        )
    else:
        fix = (
            f"set ledger.dataset: {names[0]} (or leave ledger.dataset out: the lineage then follows the records), "
            f"or rename that lineage: dpml ledger rename {names[0]} {lineage}"
        )
    return LineageConflict(
        f"lineage {lineage!r}: privacy units of this run ({run_units:,} in all) are already accounted under lineage "
        f"{where}: the same people (their unit ids match), and one person has one account; {fix} (from Python: "
        "dpml.train_private(lineage=…)). Nothing was recorded."
    )


def _own_units(db: Any, lineage: str) -> tuple[dict[int, cohorts.Shard], np.ndarray]:
    shards = cohorts.load_shards(db, lineage)
    owned = [shards[s].cohorts for s in sorted(shards)]
    return shards, np.concatenate(owned) if owned else np.zeros(0, dtype=np.int64)


def _cohorts_elsewhere(db: Any, shards: dict[int, cohorts.Shard], name: str) -> np.ndarray:
    """For every unit of ``shards`` (in shard order): its cohort in lineage ``name`` (0: not there)."""
    theirs = cohorts.load_shards(db, name)
    parts = []
    for shard in sorted(shards):
        mine = shards[shard]
        column = np.zeros(mine.ids.size, dtype=np.int64)
        if shard in theirs:
            _, at_mine, at_theirs = np.intersect1d(mine.ids, theirs[shard].ids, assume_unique=True, return_indices=True)
            column[at_mine] = theirs[shard].cohorts[at_theirs]
        parts.append(column)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def lineage_groups(db: Any, lineage: str, base_of: Callable[[str], History]) -> list[Group]:
    """The lineage's units grouped by their history across every lineage (module docstring)."""
    others = unit_lineages(db, lineage)
    shards, own = _own_units(db, lineage) if others else ({}, np.zeros(0, dtype=np.int64))
    columns = {name: col for name in others if (col := _cohorts_elsewhere(db, shards, name)).any()}
    if not columns:
        return [
            Group(_union(base_of(lineage), history), size, (lineage,))
            for _, history, size in cohorts.lineage_cohorts(db, lineage)
        ]
    names = list(columns)
    matrix = np.column_stack([own, *(columns[n] for n in names)])
    shared = (matrix[:, 1:] != 0).any(axis=1)
    history_of = cohorts.histories(db, np.unique(matrix))
    groups = []
    alone, alone_counts = cohorts.sorted_unique(own[~shared])
    for cohort, count in zip(alone.tolist(), alone_counts.tolist(), strict=True):
        groups.append(Group(_union(base_of(lineage), history_of[cohort]), int(count), (lineage,)))
    keys, counts = np.unique(matrix[shared], axis=0, return_counts=True)
    for key, count in zip(keys.tolist(), counts.tolist(), strict=True):
        where = [(lineage, key[0])] + [(n, c) for n, c in zip(names, key[1:], strict=True) if c]
        releases = _union(*(base_of(n) + history_of[c] for n, c in where))
        groups.append(Group(releases, int(count), tuple(n for n, _ in where)))
    return groups


def _union(*histories: History) -> History:
    return tuple(sorted({spend for history in histories for spend in history}))


def person(db: Any, unit_id: np.ndarray, base_of: Callable[[str], History]) -> Group | None:
    """The history of one unit (its keyed id, shape (1,)) across every lineage; None: never charged."""
    where = [(name, int(cohorts.look_up(db, name, unit_id).cohort_of_unit[0])) for name in unit_lineages(db)]
    where = [(name, c) for name, c in where if c]
    if not where:
        return None
    history_of = cohorts.histories(db, np.array([c for _, c in where], dtype=np.int64))
    return Group(_union(*(base_of(n) + history_of[c] for n, c in where)), 1, tuple(n for n, _ in where))


# ------------------------------------------------------------------------------------------- rename


def check_name(name: str) -> str:
    """A lineage name as ``ledger.dataset`` allows it: 1-200 characters, not only spaces."""
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME:
        raise LedgerError(f"lineage name {name!r}: must be 1-{MAX_NAME} characters (as ledger.dataset)")
    return name


def lineage_names(db: Any) -> list[str]:
    rows = db.execute("SELECT name FROM lineages UNION SELECT lineage FROM spends WHERE lineage IS NOT NULL")
    return sorted({str(r[0]) for r in rows.fetchall()})


def rename(db: Any, old: str, new: str, merge: bool) -> dict[str, Any]:
    """Move lineage ``old`` to ``new`` inside the caller's transaction (module docstring); the summary of
    what moved. ``new`` existing needs ``merge``."""
    check_name(new)
    names = lineage_names(db)
    if old not in names:
        raise LedgerError(f"no lineage {old!r} in the ledger; it has: {', '.join(map(repr, names)) or 'none'}")
    if new == old:
        raise LedgerError(f"lineage {old!r}: the new name is the old one")
    exists = new in names
    if exists and not merge:
        raise LedgerError(
            f"lineage {new!r} exists; to merge {old!r} into it (the people of both become one account, "
            "each person's history the union of both) add --merge"
        )
    spends = [int(r[0]) for r in db.execute("SELECT id FROM spends WHERE lineage = ? ORDER BY id", (old,)).fetchall()]
    shared = _merge_units(db, old, new) if exists else _move_units(db, old, new)
    db.execute("UPDATE spends SET lineage = ? WHERE lineage = ?", (new, old))
    detail = json.dumps({"from": old, "to": new, "merged": exists})
    for spend in spends:
        db.execute(
            "INSERT INTO events (spend_id, created_at, kind, detail) VALUES (?, ?, 'lineage_renamed', ?)",
            (spend, time.time(), detail),
        )
    return {"old": old, "new": new, "merged": exists, "spends": len(spends), "shared_units": shared}


def _move_units(db: Any, old: str, new: str) -> int:
    for table, column in (("lineages", "name"), ("cohorts", "lineage"), ("unit_shards", "lineage")):
        db.execute(f"UPDATE {table} SET {column} = ? WHERE {column} = ?", (new, old))  # noqa: S608
    return 0


def _merge_units(db: Any, old: str, new: str) -> int:
    """Merge ``old``'s units into ``new``: shared units get a cohort whose history is the union; bases and
    the Rényi filter order combine. Returns how many units the two shared."""
    row_old = db.execute("SELECT base, filter_order FROM lineages WHERE name = ?", (old,)).fetchone()
    row_new = db.execute("SELECT base, filter_order FROM lineages WHERE name = ?", (new,)).fetchone()
    orders = {r[1] for r in (row_old, row_new) if r is not None and r[1] is not None}
    if len(orders) > 1:
        raise LedgerError(
            f"lineages {old!r} and {new!r} run individual Rényi filters at different orders "
            f"{sorted(orders)}; a unit's filter needs one order, so they cannot be merged"
        )
    base = _union(*(tuple(json.loads(r[0])) for r in (row_old, row_new) if r is not None))
    theirs, mine = cohorts.load_shards(db, old), cohorts.load_shards(db, new)
    db.execute("UPDATE cohorts SET lineage = ? WHERE lineage = ?", (new, old))
    pairs, shared = _merged_pairs(theirs, mine)
    history_of = cohorts.histories(db, np.unique(np.concatenate([pairs[:, 0], pairs[:, 1], [0]])))
    keys, counts = np.unique(pairs, axis=0, return_counts=True) if pairs.size else (pairs, np.zeros(0, np.int64))
    combined: dict[tuple[int, int], int] = {}
    for (a, b), count in zip(keys.tolist(), counts.tolist(), strict=True):
        cursor = db.execute(
            "INSERT INTO cohorts (lineage, history, size) VALUES (?, ?, ?)",
            (new, json.dumps(list(_union(history_of[a], history_of[b]))), count),
        )
        combined[(a, b)] = int(cursor.lastrowid)
        for cohort in (a, b):
            db.execute("UPDATE cohorts SET size = size - ? WHERE id = ?", (count, cohort))
    _write_union(db, old, new, theirs, mine, combined)
    if row_new is None:
        db.execute("INSERT INTO lineages (name, created_at, base) VALUES (?, ?, '[]')", (new, time.time()))
    db.execute(
        "UPDATE lineages SET base = ?, filter_order = ? WHERE name = ?",
        (json.dumps(list(base)), next(iter(orders), None), new),
    )
    db.execute("DELETE FROM lineages WHERE name = ?", (old,))
    return shared


def _merged_pairs(theirs: dict[int, cohorts.Shard], mine: dict[int, cohorts.Shard]) -> tuple[np.ndarray, int]:
    """(cohort in ``theirs``, cohort in ``mine``) of every unit both hold, and how many."""
    pairs = []
    for shard in sorted(set(theirs) & set(mine)):
        _, a, b = np.intersect1d(theirs[shard].ids, mine[shard].ids, assume_unique=True, return_indices=True)
        pairs.append(np.column_stack([theirs[shard].cohorts[a], mine[shard].cohorts[b]]))
    stacked = np.concatenate(pairs) if pairs else np.zeros((0, 2), dtype=np.int64)
    return stacked, int(stacked.shape[0])


def _pair_key(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One int64 per (cohort, cohort) pair (cohort ids are row ids, far below 2³¹)."""
    return (a.astype(np.int64) << 32) | b.astype(np.int64)


def _write_union(
    db: Any,
    old: str,
    new: str,
    theirs: dict[int, cohorts.Shard],
    mine: dict[int, cohorts.Shard],
    combined: dict[tuple[int, int], int],
) -> None:
    """``new``'s shards: every unit of both, a shared one in its combined cohort; ``old``'s shards go."""
    pairs = np.array(list(combined), dtype=np.int64).reshape(-1, 2)
    order = np.argsort(_pair_key(pairs[:, 0], pairs[:, 1]))
    known = _pair_key(pairs[:, 0], pairs[:, 1])[order]
    targets = np.array(list(combined.values()), dtype=np.int64)[order]
    for shard in sorted(set(theirs) | set(mine)):
        empty = cohorts.Shard(np.zeros(0, np.uint64), np.zeros(0, np.int64))
        a, b = theirs.get(shard, empty), mine.get(shard, empty)
        ids = np.union1d(a.ids, b.ids)
        in_a, in_b = np.searchsorted(a.ids, ids), np.searchsorted(b.ids, ids)
        has_a = in_a < a.ids.size
        has_a[has_a] = a.ids[in_a[has_a]] == ids[has_a]
        has_b = in_b < b.ids.size
        has_b[has_b] = b.ids[in_b[has_b]] == ids[has_b]
        assigned = np.zeros(ids.size, dtype=np.int64)
        assigned[has_a] = a.cohorts[in_a[has_a]]
        assigned[has_b] = b.cohorts[in_b[has_b]]
        both = has_a & has_b
        if both.any():
            keys = _pair_key(a.cohorts[in_a[both]], b.cohorts[in_b[both]])
            assigned[both] = targets[np.searchsorted(known, keys)]
        db.execute(
            "INSERT OR REPLACE INTO unit_shards (lineage, shard, ids, cohorts) VALUES (?, ?, ?, ?)",
            (new, shard, ids.astype("<u8").tobytes(), assigned.astype("<i8").tobytes()),
        )
    db.execute("DELETE FROM unit_shards WHERE lineage = ?", (old,))
