"""What the ledger says about its lineages and people: each lineage's largest unit ε (and KL), the units
by ε, the ``dpml ledger`` view, and one person's releases across lineages. A mixin of
:class:`dpml.ledger.ledger.Ledger`: it reads through the ledger's own connection and standing
(``_connect``, ``_lineage_standing``, ``_groups``, ``_base``, ``spends``, ``events``, ``unit_ids``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dpml.ledger import lineages
from dpml.ledger.budget_checks import Standing
from dpml.ledger.lineages import Group
from dpml.ledger.unit_accounts import UnitAccounts

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from dpml.ledger.ledger import Spend


class LedgerHost(Protocol):
    """What the views read of the :class:`dpml.ledger.ledger.Ledger` they are mixed into (for the type checker)."""

    delta: float

    def _connect(self) -> AbstractContextManager[Any]: ...
    def unit_ids(self, digests: np.ndarray) -> np.ndarray: ...
    def _has_unit_records(self) -> bool: ...
    def spends(self, lineage: str | None = None, counted_only: bool = True) -> list[Spend]: ...
    def events(self, spend_id: int) -> list[tuple[str, dict[str, Any]]]: ...
    def _base(self, db: Any, lineage: str) -> tuple[int, ...]: ...
    def _groups(self, db: Any, lineage: str) -> list[Group]: ...
    def _lineage_standing(self, db: Any, lineage: str) -> Standing: ...
    def _releases(self, history: tuple[int, ...]) -> list[dict[str, Any]]: ...
    def _people(
        self, lineage: str, groups: list[Group], eps: np.ndarray, lineage_of_spend: dict[int, str]
    ) -> dict[str, Any]: ...


class LedgerViews:
    """Read-only answers of the ledger (the per-person ε of Mironov 2017 / the tight accountants, composed by
    :class:`dpml.ledger.unit_accounts.UnitAccounts` over each unit's history)."""

    delta: float

    def person(self: LedgerHost, digest: np.ndarray) -> dict[str, Any] | None:
        """One unit (its (1, 16) digest): every release that touched it, across lineages, and its ε; None
        when the ledger has never charged it."""
        if not self._has_unit_records():
            return None
        unit = self.unit_ids(digest)
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            group = lineages.person(db, unit, lambda name: self._base(db, name))
            epsilon = 0.0 if group is None else float(UnitAccounts(self.delta, db).epsilons([group.releases])[0])
            db.execute("COMMIT")
        if group is None:
            return None
        return {
            "lineages": list(group.lineages),
            "epsilon": epsilon,
            "delta": self.delta,
            "releases": self._releases(group.releases),
        }

    def _releases(self: LedgerHost, history: tuple[int, ...]) -> list[dict[str, Any]]:
        """The spends of a history as the view lists them: id, lineage, label, ε alone, counted."""
        listed = {s.id: s for s in self.spends(counted_only=False)}
        counted = {s.id for s in self.spends()}
        return [
            {
                "spend": i,
                "lineage": listed[i].lineage,
                "label": listed[i].label,
                "epsilon_alone": listed[i].epsilon_alone,
                "counted": i in counted,
            }
            for i in history
            if i in listed
        ]

    # ------------------------------------------------------------------------------------ totals
    def total(self: LedgerHost, lineage: str) -> float:
        """The lineage's guarantee: the largest ε(δ) over its units (at the ledger's δ)."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            standing = self._lineage_standing(db, lineage)
            value = (
                float(UnitAccounts(self.delta, db).epsilons(standing.histories).max()) if standing.histories else 0.0
            )
            db.execute("COMMIT")
        return value

    def kl_total(self: LedgerHost, lineage: str) -> float:
        """The largest summed KL over the lineage's units (∞ once an (ε, δ)-DP spend touched one)."""
        with self._connect() as db:
            standing = self._lineage_standing(db, lineage)
            accounts = UnitAccounts(self.delta, db)
            return max((accounts.kl(h) for h in standing.histories), default=0.0)

    def unit_epsilons(self: LedgerHost, lineage: str) -> list[tuple[float, int]]:
        """(ε, number of units) for every history of the lineage's units, largest first."""
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            standing = self._lineage_standing(db, lineage)
            eps = UnitAccounts(self.delta, db).epsilons(standing.histories)
            db.execute("COMMIT")
        pairs = [(float(e), int(n)) for e, n in zip(eps, standing.units, strict=True) if n > 0]
        return sorted(pairs, reverse=True)

    @staticmethod
    def _people(lineage: str, groups: list[Group], eps: np.ndarray, lineage_of_spend: dict[int, str]) -> dict[str, Any]:
        """The view's per-person part: the lineage's units grouped by every release that touched them
        (across lineages), largest ε first, and how many of its units other lineages hold too."""
        ranked = sorted(
            ((g, float(e)) for g, e in zip(groups, eps, strict=True) if g.units > 0),
            key=lambda ge: (-ge[1], -ge[0].units),
        )
        people = [
            {
                "units": g.units,
                "epsilon": e,
                "lineages": list(g.lineages),
                "releases": [{"spend": i, "lineage": lineage_of_spend.get(i)} for i in g.releases],
            }
            for g, e in ranked
        ]
        shared: dict[str, int] = {}
        for group in groups:
            for other in group.lineages:
                if other != lineage:
                    shared[other] = shared.get(other, 0) + group.units
        return {"people": people, "shared_with": shared}

    def summary(self: LedgerHost, lineage: str | None = None) -> list[dict[str, Any]]:
        """Per lineage: versions, spends with their events, the distribution of unit ε, the largest (each unit's
        ε composing every release that touched it, whatever its lineage), and ``people``: the units grouped
        by those releases."""
        out = []
        every = self.spends(counted_only=False)
        listed_all = [s for s in every if lineage is None or s.lineage == lineage]
        for name in sorted({s.lineage for s in listed_all}):
            listed = [s for s in listed_all if s.lineage == name]
            counted = {s.id for s in self.spends(name)}
            with self._connect() as db:
                db.execute("BEGIN IMMEDIATE")
                groups = self._groups(db, name)
                standing = Standing(
                    [self._base(db, name)] + [g.releases for g in groups],
                    np.array([0] + [g.units for g in groups], dtype=np.int64),
                    None,
                    [],
                )
                accounts = UnitAccounts(self.delta, db)
                eps = accounts.epsilons(standing.histories)
                kl_any = any(
                    s.mechanism is not None and s.mechanism.guarantee == "kl" and s.id in counted for s in listed
                )
                kl = max((accounts.kl(h) for h in standing.histories), default=0.0) if kl_any else None
                base = self._base(db, name)
                order_row = db.execute("SELECT filter_order FROM lineages WHERE name = ?", (name,)).fetchone()
                db.execute("COMMIT")
            levels: dict[float, int] = {}
            for value, count in zip(eps, standing.units, strict=True):
                if count > 0:
                    level = float(f"{value:.4g}")
                    levels[level] = levels.get(level, 0) + int(count)
            versions: dict[str, int] = {}
            for s in listed:
                versions[s.dataset_version] = versions.get(s.dataset_version, 0) + 1
            out.append(
                {
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
                    "spends": [
                        {
                            "id": s.id,
                            "label": s.label,
                            "created_at": s.created_at,
                            "dataset_version": s.dataset_version,
                            "epsilon_alone": s.epsilon_alone,
                            "private": s.mechanism is not None,
                            "units": s.n_units,
                            "counted": s.id in counted,
                            "events": [k for k, _ in self.events(s.id)],
                        }
                        for s in listed
                    ],
                    **self._people(name, groups, eps[1:], {s.id: s.lineage for s in every}),
                }
            )
        return out
