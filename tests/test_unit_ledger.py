"""A budget that follows people: units, lineages, per-unit composition, the Rényi filter, migration."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from scipy.optimize import brentq

from dpml.ledger.units import load_or_create_key
from dpml.ledger.ledger import BudgetExceeded, Ledger, LedgerError, epsilons_from_rdp, filter_bound, filter_order
from dpml.accounting.tuning import ORDERS
from dpml.accounting.mechanism import MechanismDescription, PoissonGaussianSteps
from dpml.data.units import digests_of_ids, digests_of_rows, one_row_per_unit

DELTA = 1e-5


def run(q: float = 0.05, sigma: float = 2.0, steps: int = 100) -> MechanismDescription:
    return MechanismDescription("dpsgd", (PoissonGaussianSteps(q, sigma, steps),), "add-remove", 1.0, 1000)  # type: ignore[arg-type]


def people(ids: range | list[int]) -> np.ndarray:
    return digests_of_ids(list(ids))


def independent_pld(mechanisms: list[MechanismDescription]) -> float:
    """dp_accounting's PLD accountant composing the events directly (not through dpml)."""
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    for m in mechanisms:
        for e in m.events:
            accountant.compose(
                dp_event.PoissonSampledDpEvent(e.sample_rate, dp_event.GaussianDpEvent(e.noise_multiplier)), e.steps
            )
    return accountant.get_epsilon(DELTA)


def independent_rdp(mechanisms: list[MechanismDescription], orders: list[float] | None = None) -> float:
    accountant = rdp_privacy_accountant.RdpAccountant(orders) if orders else rdp_privacy_accountant.RdpAccountant()
    for m in mechanisms:
        for e in m.events:
            accountant.compose(
                dp_event.PoissonSampledDpEvent(e.sample_rate, dp_event.GaussianDpEvent(e.noise_multiplier)), e.steps
            )
    return accountant.get_epsilon(DELTA)


def test_a_grown_table_does_not_reset_anyones_budget(ledger_location: str, tmp_path: Path) -> None:
    """The issue's scenario: two runs on a table, five rows appended, a third run is refused for the
    people who were in both versions — and names how many and their ε."""
    ledger = Ledger(ledger_location, DELTA, unit_key=tmp_path / "unit.key")
    two = independent_pld([run(), run()])
    budget = (two + independent_pld([run()] * 3)) / 2
    for label in ("week 1", "week 1 again"):
        ledger.reserve("v1", run(), label, budget, lineage="census", units=people(range(1797)))
    with pytest.raises(BudgetExceeded) as refused:
        ledger.reserve("v2", run(), "week 2", budget, lineage="census", units=people(range(1802)))
    message = str(refused.value)
    assert "1,797 of the 1,802 privacy units" in message and "Nothing was recorded" in message
    assert f"{two:.4g}" in message  # their current ε, from the composition of the two runs
    assert len(ledger.spends("census")) == 2
    # The five new people alone may still be trained on: their budget is untouched.
    ledger.reserve("v2", run(), "new people", budget, lineage="census", units=people(range(1797, 1802)))
    assert ledger.total("census") == pytest.approx(two, rel=1e-3)
    assert sorted(n for _, n in ledger.unit_epsilons("census")) == [5, 1797]


def test_unit_epsilon_is_the_composition_of_the_spends_that_touched_it(ledger_location: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    ledger = Ledger(ledger_location, DELTA, unit_key=tmp_path / "unit.key")
    mechanisms = [run(0.05, 1.0, 100), run(0.1, 1.5, 150), run(0.02, 0.9, 300), run(0.08, 1.2, 80)]
    n = 300
    touched = [np.sort(rng.choice(n, size=int(rng.integers(50, n)), replace=False)) for _ in mechanisms]
    for i, (m, rows) in enumerate(zip(mechanisms, touched, strict=True)):
        ledger.reserve(f"v{i}", m, f"run {i}", 1e6, lineage="L", units=people(rows.tolist()))
    histories: dict[tuple[int, ...], int] = {}
    for unit in range(n):
        history = tuple(i for i, rows in enumerate(touched) if unit in set(rows.tolist()))
        if history:
            histories[history] = histories.get(history, 0) + 1
    from dpml.accounting.tuning import ORDERS

    expected = sorted(
        (
            (independent_rdp([mechanisms[i] for i in h], list(ORDERS)), independent_pld([mechanisms[i] for i in h]), c)
            for h, c in histories.items()
        ),
        reverse=True,
    )
    reported = ledger.unit_epsilons("L")
    assert sorted(c for *_, c in expected) == sorted(c for _, c in reported)
    assert sum(c for _, c in reported) == sum(histories.values())
    # Each reported level belongs to one history: a valid bound (≥ the tight PLD value), no looser than RDP.
    unused = list(expected)
    for eps, count in reported:
        match = next(e for e in unused if e[2] == count and e[1] - 2e-3 <= eps <= e[0] + 1e-6)
        unused.remove(match)
    assert ledger.total("L") == pytest.approx(max(pld for _, pld, _ in expected), abs=3e-3)


def test_refusal_names_count_and_epsilon_and_changes_nothing(ledger_location: str, tmp_path: Path) -> None:
    ledger = Ledger(ledger_location, DELTA, unit_key=tmp_path / "unit.key")
    ledger.reserve("v1", run(), "a", 100.0, lineage="L", units=people(range(10)))
    with pytest.raises(BudgetExceeded, match=r"10 of the 20 privacy units"):
        ledger.reserve("v2", run(), "b", independent_pld([run()]) * 1.2, lineage="L", units=people(range(20)))
    assert [s.label for s in ledger.spends("L")] == ["a"]
    assert sum(n for _, n in ledger.unit_epsilons("L")) == 10


def test_a_lineage_spans_versions_and_separate_lineages_do_not_mix(ledger_location: str, tmp_path: Path) -> None:
    ledger = Ledger(ledger_location, DELTA, unit_key=tmp_path / "unit.key")
    one = independent_pld([run()])
    ledger.reserve("v1", run(), "a", one * 1.01, lineage="A", units=people(range(100)))
    ledger.reserve("v1", run(), "b", one * 1.01, lineage="B", units=people(range(1000, 1100)))  # other people
    with pytest.raises(BudgetExceeded):
        ledger.reserve("v2", run(), "c", one * 1.01, lineage="A", units=people(range(50, 150)))
    summary = {s["lineage"]: s for s in ledger.summary()}
    assert summary["A"]["units"] == 100 and summary["A"]["dataset_versions"] == {"v1": 1}
    assert summary["B"]["units"] == 100 and summary["A"]["shared_with"] == {}


def test_cancelled_spends_count_for_nobody(ledger_location: str, tmp_path: Path) -> None:
    ledger = Ledger(ledger_location, DELTA, unit_key=tmp_path / "unit.key")
    one = independent_pld([run()])
    spend = ledger.reserve("v1", run(), "killed before training", one * 1.5, lineage="L", units=people(range(30)))
    assert ledger.cancel(spend.id, "pre-flight")
    ledger.reserve("v1", run(), "real", one * 1.5, lineage="L", units=people(range(30)))
    assert ledger.total("L") == pytest.approx(one, abs=2e-3)


def test_renyi_filter_excludes_exactly_the_exhausted_units_and_keeps_every_budget(
    ledger_location: str, tmp_path: Path
) -> None:
    """Feldman & Zrnic (2021): with exclude, every unit's composed loss stays within the budget, checked
    by dp_accounting's RDP accountant on the spends that actually touched it; the units excluded are
    exactly those whose RDP at α* would pass B*."""
    rng = np.random.default_rng(11)
    ledger = Ledger(ledger_location, DELTA, unit_key=tmp_path / "unit.key")
    budget, n = 2.0, 300
    mechanisms = [run(0.05, 2.0, int(s)) for s in rng.integers(100, 400, size=8)]
    touched_by: dict[int, list[int]] = {u: [] for u in range(n)}
    excluded_total = 0
    for i, m in enumerate(mechanisms):
        present = np.sort(rng.choice(n, size=int(rng.integers(100, n)), replace=False))
        allowed = ledger.units_within_filter("F", people(present.tolist()), m, budget)
        excluded_total += int((~allowed).sum())
        kept = present[allowed]
        if kept.size == 0:
            continue
        ledger.reserve(f"v{i}", m, f"run {i}", budget, lineage="F", units=people(kept.tolist()), mode="exclude")
        for u in kept.tolist():
            touched_by[u].append(i)
    assert excluded_total > 0  # the scenario does exhaust some units
    [entry] = ledger.summary("F")
    order = entry["filter_order"]
    bound = filter_bound(order, budget, DELTA)
    for spends in touched_by.values():
        if spends:
            assert independent_rdp([mechanisms[i] for i in spends], [order]) <= budget + 1e-9
            rdp = rdp_privacy_accountant.RdpAccountant([order])
            for i in spends:
                e = mechanisms[i].events[0]
                rdp.compose(
                    dp_event.PoissonSampledDpEvent(e.sample_rate, dp_event.GaussianDpEvent(e.noise_multiplier)), e.steps
                )
            assert rdp._rdp[0] <= bound + 1e-9  # noqa: SLF001 — the filter's invariant at α*
    # A reservation in exclude mode that includes an exhausted unit is refused (a race, or a caller bug).
    exhausted = [u for u, s in touched_by.items() if s][:1]
    worst = max(touched_by, key=lambda u: sum(mechanisms[i].events[0].steps for i in touched_by[u]))
    heavy = run(0.05, 1.0, 5000)
    with pytest.raises(BudgetExceeded, match="Rényi filter"):
        ledger.reserve("vx", heavy, "too much", budget, lineage="F", units=people([worst, *exhausted]), mode="exclude")


def test_contribution_bounding_keeps_one_row_per_unit() -> None:
    ids = [1, 2, 2, 3, 3, 3, 4]
    digests = people(ids)
    kept = one_row_per_unit(digests, seed=0)
    assert sorted(ids[i] for i in kept) == [1, 2, 3, 4]
    assert np.array_equal(kept, one_row_per_unit(digests, seed=0))
    # 7, 7.0 and "7" are one person; rows are units by content when there is no id column.
    assert (digests_of_ids([7, 7.0, "7"]) == digests_of_ids([7])[0]).all()
    x = np.array([[1.0, 2.0], [1.0, 2.0], [1.0, 3.0]])
    rows = digests_of_rows(x, np.array([0, 0, 0]))
    assert (rows[0] == rows[1]).all() and not (rows[0] == rows[2]).all()


def test_the_ledger_stores_no_identity_and_needs_its_key(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    ledger = Ledger(path, DELTA)
    digests = people(range(50))
    ledger.reserve("v1", run(), "a", 100.0, lineage="L", units=digests)
    blob = (
        path.read_bytes() + (tmp_path / "l.db-wal").read_bytes()
        if (tmp_path / "l.db-wal").exists()
        else path.read_bytes()
    )
    assert not any(d.tobytes()[:8] in blob for d in digests)  # only keyed ids are stored
    assert oct((tmp_path / "l.db.key").stat().st_mode & 0o777) == "0o600"
    key = (tmp_path / "l.db.key").read_bytes()
    (tmp_path / "l.db.key").unlink()
    with pytest.raises(LedgerError, match="key"):
        Ledger(path, DELTA).reserve("v1", run(), "b", 100.0, lineage="L", units=digests)
    (tmp_path / "l.db.key").write_bytes(os.urandom(len(key)))
    with pytest.raises(LedgerError, match="not the unit key"):
        Ledger(path, DELTA).reserve("v1", run(), "b", 100.0, lineage="L", units=digests)
    (tmp_path / "l.db.key").write_bytes(key)
    Ledger(path, DELTA).reserve("v1", run(), "b", 100.0, lineage="L", units=digests)
    assert [n for _, n in Ledger(path, DELTA).unit_epsilons("L")] == [50]


def test_threads_that_create_the_unit_key_at_once_all_get_the_one_key(tmp_path: Path) -> None:
    """Runs started from threads of one process (a notebook's, a service's) may create a new ledger's unit key at
    the same moment: every thread gets the key that landed, none fails on another's half-made file, and only
    that key's file remains. 8 threads create 30 new keys together."""
    threads, rounds = 8, 30
    barrier = threading.Barrier(threads)

    def create(round_: int) -> bytes:
        barrier.wait(timeout=60)
        return load_or_create_key(tmp_path / f"{round_}.key", create=True)

    with ThreadPoolExecutor(threads) as pool:
        for round_ in range(rounds):
            keys = list(pool.map(create, [round_] * threads))
            assert keys == [(tmp_path / f"{round_}.key").read_bytes()] * threads
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{r}.key" for r in range(rounds))


def test_schema_1_ledgers_migrate_and_charge_old_spends_to_everyone(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.executescript("""
            CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            INSERT INTO meta VALUES ('schema_version', '1');
            CREATE TABLE spends (id INTEGER PRIMARY KEY AUTOINCREMENT, dataset_version TEXT NOT NULL,
                label TEXT NOT NULL, created_at REAL NOT NULL, private INTEGER NOT NULL, mechanism TEXT,
                epsilon_alone REAL NOT NULL);
            CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, spend_id INTEGER NOT NULL,
                created_at REAL NOT NULL, kind TEXT NOT NULL, detail TEXT NOT NULL);""")
        for version in ("aaaa", "bbbb"):  # two versions of one table: two accounts under schema 1
            db.execute(
                "INSERT INTO spends (dataset_version, label, created_at, private, mechanism, epsilon_alone) "
                "VALUES (?, 'dpsgd model (csv:data/census.csv)', 0, 1, ?, 1.0)",
                (version, json.dumps(run().to_dict())),
            )
    ledger = Ledger(path, DELTA)
    assert (tmp_path / "old.db.v1").exists()
    [entry] = ledger.summary()
    assert entry["lineage"] == "census" and entry["unknown_unit_spends"] == [1, 2]
    assert ledger.total("census") == pytest.approx(independent_pld([run(), run()]), abs=3e-3)
    # A new run on that lineage: its people carry both old spends (their units were not recorded).
    with pytest.raises(BudgetExceeded, match="5 of the 5"):
        ledger.reserve(
            "cccc", run(), "new", independent_pld([run()] * 2) * 1.01, lineage="census", units=people(range(5))
        )


@pytest.mark.slow
def test_a_kill_inside_the_reservation_leaves_no_spend_and_no_units(ledger_location: str, tmp_path: Path) -> None:
    key = str(tmp_path / "unit.key")
    script = textwrap.dedent(f"""
        import numpy as np
        from dpml.ledger.ledger import Ledger
        from dpml.accounting.mechanism import MechanismDescription, PoissonGaussianSteps
        from dpml.data.units import digests_of_ids
        m = MechanismDescription("dpsgd", (PoissonGaussianSteps(0.05, 1.0, 200),), "add-remove", 1.0, 1000)
        Ledger({ledger_location!r}, 1e-5, unit_key={key!r}).reserve("v", m, "x", 100.0, lineage="L",
                                                                   units=digests_of_ids(range(20000)))
    """)
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "DPML_FAULT": "ledger:units_written"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    ledger = Ledger(ledger_location, DELTA, unit_key=key)
    assert ledger.spends(counted_only=False) == [] and ledger.unit_epsilons("L") == []
    ledger.reserve("v", run(), "after", 100.0, lineage="L", units=people(range(10)))
    assert sum(n for _, n in ledger.unit_epsilons("L")) == 10


def test_vectorised_conversion_matches_dp_accounting() -> None:
    from dpml.accounting.tuning import ORDERS, rdp_to_epsilon

    rng = np.random.default_rng(0)
    curves = np.cumsum(rng.uniform(0, 0.3, size=(20, len(ORDERS))), axis=1)
    ours = epsilons_from_rdp(curves, DELTA)
    theirs = [rdp_to_epsilon(ORDERS, c, DELTA) for c in curves]
    assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(("budget", "delta"), [(1.0, 1e-5), (3.0, 1e-5), (8.0, 1e-6), (40.0, 1e-5), (200.0, 1e-5)])
def test_the_filter_order_and_bound_agree_with_dp_accountings_conversion(budget: float, delta: float) -> None:
    """α* is the order dp_accounting's RDP → (ε, δ) conversion picks for the Gaussian-shaped curve cα reaching the
    budget, and the filter's bound B*(α*) converts back to exactly the budget (pins filter_order and filter_bound,
    whose mutants the filter tests let through: any fixed α keeps the filter valid, so only tightness showed it)."""
    orders = np.asarray(ORDERS, dtype=float)
    c = brentq(lambda c: rdp_privacy_accountant.compute_epsilon(orders, c * orders, delta)[0] - budget, 1e-9, budget)
    _, best = rdp_privacy_accountant.compute_epsilon(orders, c * orders, delta)
    order = filter_order(budget, delta)
    assert order == best
    eps, _ = rdp_privacy_accountant.compute_epsilon([order], [filter_bound(order, budget, delta)], delta)
    assert eps == pytest.approx(budget, rel=1e-9)


def test_the_views_of_a_ledger_name_nobody_at_zero_and_list_units_largest_epsilon_first(
    ledger_location: str, tmp_path: Path
) -> None:
    ledger = Ledger(ledger_location, DELTA, unit_key=tmp_path / "unit.key")
    assert ledger.total("nobody") == 0.0 and ledger.unit_epsilons("nobody") == []
    ledger.reserve("v1", run(), "first", 1e6, lineage="L", units=people(range(10)))
    ledger.reserve("v2", run(), "second", 1e6, lineage="L", units=people(range(5)))
    levels = ledger.unit_epsilons("L")
    assert [count for _, count in levels] == [5, 5] and levels[0][0] > levels[1][0]
    assert ledger.total("L") == pytest.approx(levels[0][0])


def test_a_reservation_under_another_neighbouring_relation_than_its_units_history_is_refused(
    ledger_location: str, tmp_path: Path
) -> None:
    ledger = Ledger(ledger_location, DELTA, unit_key=tmp_path / "unit.key")
    ledger.reserve("v1", run(), "add/remove", 1e6, lineage="L", units=people(range(10)))
    other = MechanismDescription("dpsgd", (PoissonGaussianSteps(0.05, 2.0, 100),), "replace-one", 1.0, 1000)
    with pytest.raises(LedgerError, match="neighbouring"):
        ledger.reserve("v2", other, "replace-one", 1e6, lineage="L", units=people(range(10)))
