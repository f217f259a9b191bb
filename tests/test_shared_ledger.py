"""One budget for a team: workers in separate checkouts share one ledger on a real PostgreSQL server
and one real MLflow tracking server.

Two working directories (two "workers") run the whole pipeline on the same data at the same moment,
each a real ``dpml run`` process, against one PostgreSQL ledger with budget for one run: exactly one
trains and registers on the server; the other is refused before training with one ``dpml: error:``
line that names the lineage, its spent ε and the budget, and no traceback. ``dpml ledger`` run from a
third directory reads the same account. A configuration naming a PostgreSQL ledger without the shared
unit key file is refused when it is loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from dpml.config import load
from dpml.accounting.accountants import epsilon_pld
from dpml.ledger.ledger import Ledger
from dpml.accounting.mechanism import MechanismDescription, PoissonGaussianSteps
from dpml.train.dpsgd import number_of_steps
from tests.conftest import small_params, write_params

ENV = {**os.environ, "PYTHONHASHSEED": "0"}
ENV.pop("MLFLOW_TRACKING_URI", None)


def dpml(workdir: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "dpml.cli", *args],
        cwd=workdir,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finished(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=900)
    return process.returncode, out, err


def worker(root: Path, name: str, url: str, key: Path, budget: float, tracking: str) -> Path:
    workdir = root / name
    workdir.mkdir()
    params = small_params(
        workdir,
        ledger={"url": url, "unit_key": str(key), "epsilon_budget": budget, "delta": 1e-5},
        gate={"epsilon_budget": 50.0},
    )
    params["tracking"] = {"uri": tracking, "experiment": "team", "model_name": "team-model"}
    write_params(workdir / "params.yaml", params)
    return workdir


def one_run_epsilon(workdir: Path, runs: int) -> float:
    config = load(workdir / "params.yaml")
    q = config.train.sample_rate
    step = PoissonGaussianSteps(q, float(config.dp.noise_multiplier), number_of_steps(config.train.epochs, q))
    return epsilon_pld(MechanismDescription("dpsgd", (step,) * runs, "add-remove", 1.0, 1000), 1e-5)


@pytest.mark.exhaustive  # CI runs it after the default suite, which stays near 20 min on 2 cores
@pytest.mark.slow
def test_two_workers_one_postgresql_budget_exactly_one_trains(
    postgres_url: str, mlflow_server: dict[str, Any], tmp_path: Path
) -> None:
    key = tmp_path / "team-unit.key"
    probe = tmp_path / "probe"
    probe.mkdir()
    write_params(probe / "params.yaml", small_params(probe))
    one, two = one_run_epsilon(probe, 1), one_run_epsilon(probe, 2)
    budget = (one + two) / 2  # room for one run on these records, not two
    workers = [
        worker(tmp_path, name, postgres_url, key, budget, mlflow_server["url"]) for name in ("worker-a", "worker-b")
    ]
    running = [dpml(w, "run", "--engine", "local") for w in workers]
    outcomes = [finished(p) for p in running]
    codes = sorted(code for code, _, _ in outcomes)
    assert codes[0] == 0 and codes[1] != 0, [err[-2000:] for _, _, err in outcomes]
    refused = next(err for code, _, err in outcomes if code != 0)
    assert "Traceback" not in refused, refused
    errors = [line for line in refused.splitlines() if line.startswith("dpml: error:")]
    assert len(errors) == 1, refused
    assert "lineage 'digits'" in errors[0] and f"ledger.epsilon_budget = {budget:g}" in errors[0]
    assert f"ε = {one:.4g}" in errors[0] or "spent ε =" in errors[0]
    loser = workers[[code for code, _, _ in outcomes].index(codes[1])]
    assert not (loser / "artifacts" / "train" / "model.pt").exists()
    versions = MlflowClient(mlflow_server["url"]).search_model_versions("name = 'team-model'")
    assert [v.version for v in versions] == ["1"]
    ledger = Ledger(postgres_url, 1e-5, unit_key=key)
    (spend,) = ledger.spends()
    assert spend.lineage == "digits" and ledger.total("digits") == pytest.approx(one, rel=1e-3)
    # Any directory reads the same account.
    elsewhere = tmp_path / "reader"
    elsewhere.mkdir()
    params = small_params(elsewhere, ledger={"url": postgres_url, "unit_key": str(key), "epsilon_budget": budget})
    write_params(elsewhere / "params.yaml", params)
    code, out, err = finished(dpml(elsewhere, "ledger", "--json"))
    assert code == 0, err
    assert '"lineage": "digits"' in out and '"private_spends": 1' in out


def test_a_postgresql_ledger_without_its_shared_key_is_refused(tmp_path: Path) -> None:
    params = small_params(tmp_path, ledger={"url": "postgresql://dpml@127.0.0.1:5432/ledger"})
    with pytest.raises(Exception, match=r"ledger.unit_key: a PostgreSQL ledger \(ledger.url\) is shared by workers"):
        load(write_params(tmp_path / "params.yaml", params))


def test_an_unreachable_ledger_is_a_clear_error_without_the_password() -> None:
    from dpml.ledger.ledger import LedgerError

    with pytest.raises(LedgerError) as raised:
        Ledger("postgresql://dpml:s3cret@127.0.0.1:1/ledger", 1e-5, unit_key="unused.key")
    message = str(raised.value)
    assert "not a readable or reachable ledger" in message and "postgresql://dpml:***@127.0.0.1:1/ledger" in message
    assert "s3cret" not in message
