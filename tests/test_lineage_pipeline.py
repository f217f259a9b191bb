"""A budget that follows people through the whole pipeline: a table with a person-id column grows, a
run on it is refused for the people already at their budget, and `exclude` trains without them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from dpml.ledger.ledger import Ledger, filter_bound, filter_order, rdp_curve
from dpml.accounting.tuning import ORDERS
from tests.conftest import small_params, write_params


def people_table(n_people: int, start: int = 0, seed: int = 0) -> pd.DataFrame:
    """Two well-separated classes; every third person has a second row (a second visit)."""
    rng = np.random.default_rng(seed + start)
    rows = []
    for person in range(start, start + n_people):
        label = person % 2
        for _ in range(2 if person % 3 == 0 else 1):
            a, b = rng.normal(loc=1.5 if label else -1.5, size=2)
            rows.append({"person": f"p{person:05d}", "a": a, "b": b, "label": "yes" if label else "no"})
    return pd.DataFrame(rows)


def dpml(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dpml", *args], capture_output=True, text=True, timeout=900)


@pytest.mark.exhaustive  # three whole-pipeline runs (≈ 65 s): CI runs it; the default suite stays near 20 min
def test_a_growing_table_spends_each_persons_budget_once(workdir: Path) -> None:
    table = workdir / "visits.csv"
    people_table(600).to_csv(table, index=False)
    params = small_params(
        workdir,
        data={
            "source": f"csv:{table}",
            "label_column": "label",
            "id_column": "person",
            "feature_columns": ["a", "b"],
            "classes": ["no", "yes"],
        },
        preprocess={"lower": -5.0, "upper": 5.0},
        audit={"references": 1, "white_box_canaries": 0, "black_box_canaries": 0, "control": False},
        gate={"epsilon_budget": 1e6},
    )
    path = write_params(workdir / "p.yaml", params)
    first = dpml("run", "--engine", "local", "--params", str(path))
    assert first.returncode == 0, first.stderr
    ledger = Ledger(workdir / "ledger.db", 1e-5)
    [spend] = ledger.spends("visits")
    assert spend.n_units is not None and 0 < spend.n_units < 600  # people, one row each, training part only
    assert spend.mechanism is not None
    one = spend.epsilon_alone
    assert ledger.total("visits") == pytest.approx(one, rel=2e-3)
    from dpml.ledger.ledger import _compose  # noqa: PLC2701 — the ledger's own PLD composition

    both = _compose([spend.mechanism, spend.mechanism], 1e-5)
    budget = 0.999 * both  # room for one more release of a new person, not of an old one
    order = filter_order(budget, 1e-5)
    assert rdp_curve(spend.mechanism)[list(ORDERS).index(order)] <= filter_bound(order, budget, 1e-5)  # new people fit

    # The table grows by 90 people: a new data version of the same lineage.
    pd.concat([people_table(600), people_table(90, start=600)]).to_csv(table, index=False)
    refused = dpml("run", "--engine", "local", "--params", str(path), "--set", f"ledger.epsilon_budget={budget}")
    assert refused.returncode != 0
    [line] = [said for said in refused.stderr.splitlines() if said.startswith("dpml: error:")]
    assert "lineage 'visits'" in line and "privacy units in this run's training data have spent" in line
    assert f"{spend.n_units:,} of the" in line  # exactly the people trained on before
    assert len(ledger.spends("visits", counted_only=False)) == 1  # nothing recorded

    excluded = dpml(
        "run",
        "--engine",
        "local",
        "--params",
        str(path),
        "--set",
        f"ledger.epsilon_budget={budget}",
        "--set",
        "ledger.on_exhausted=exclude",
    )
    assert excluded.returncode == 0, excluded.stderr
    spends = ledger.spends("visits")
    assert len(spends) == 2 and 0 < (spends[1].n_units or 0) <= 90
    levels = ledger.unit_epsilons("visits")
    assert max(e for e, _ in levels) <= budget and sum(n for _, n in levels) == spend.n_units + spends[1].n_units
    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlflow.db'}")
    client = MlflowClient()
    newest = max(client.search_model_versions("name='dpml-test-model'"), key=lambda v: int(v.version))
    assert newest.tags["dp.lineage"] == "visits"
    assert float(newest.tags["dp.lineage_max_unit_epsilon"]) == pytest.approx(ledger.total("visits"), rel=1e-4)
    # Each person keeps their part as the table grows: the people excluded are exactly those trained on before.
    assert int(newest.tags["dp.units_excluded"]) == spend.n_units
    report = (workdir / "artifacts" / "gate" / "privacy_report.md").read_text()
    assert "Lineage 'visits'" in report and "were left out of this model's training data" in report

    shown = dpml("ledger", "--params", str(path))
    assert shown.returncode == 0 and "lineage visits: 2 data version(s), 2 DP runs" in shown.stdout
    assert "units by ε" in shown.stdout
