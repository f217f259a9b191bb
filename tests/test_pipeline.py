"""End to end: the Prefect flow over the real stages, a real SQLite MLflow store and registry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from dpml.config import load
from tests.conftest import small_params, write_params

EXPECTED_TAGS = {"dp.epsilon", "dp.delta", "dp.accountant", "dp.mechanism", "data.version", "audit.auc",
                 "audit.tpr_at_0.1pct_fpr", "gate.passed", "audit.epsilon_lower_bound", "audit.is_evidence",
                 "audit.control_tpr_at_1pct_fpr"}


def client_for(tmp: Path) -> MlflowClient:
    mlflow.set_tracking_uri(f"sqlite:///{tmp / 'mlflow.db'}")
    return MlflowClient()


def versions(client: MlflowClient, name: str) -> list:
    return sorted(client.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version))


@pytest.mark.slow
def test_flow_registers_tagged_versions_and_gates_champion(workdir: Path, prefect_harness: None) -> None:
    from flows.pipeline import privacy_audited_pipeline

    params = write_params(workdir / "run.yaml", small_params(workdir, gate={"epsilon_budget": 50.0}))
    first = privacy_audited_pipeline(params_path=str(params))
    client = client_for(workdir)
    [v1] = versions(client, "dpml-test-model")
    assert EXPECTED_TAGS <= set(v1.tags)
    assert v1.tags["gate.passed"] == "true"
    assert float(v1.tags["dp.epsilon"]) == pytest.approx(first["certify"]["epsilon"], rel=1e-5)
    assert v1.tags["dp.accountant"].startswith("dp_accounting.pld")
    assert v1.tags["data.version"] == first["ingest"]["version"]
    assert client.get_model_version_by_alias("dpml-test-model", "champion").version == v1.version

    run = client.get_run(v1.run_id)
    assert run.data.metrics["epsilon"] == pytest.approx(first["certify"]["epsilon"])
    assert 0 <= run.data.metrics["test_accuracy"] <= 1 and "audit.target.loss.auc" in run.data.metrics and "audit.control.rmia-online.auc" in run.data.metrics
    assert run.data.params["dp.noise_multiplier"] == "1.0"
    logged = {a.path for a in client.list_artifacts(v1.run_id)}
    assert {"privacy_report.md", "roc.png", "roc_control.png", "histograms.png", "certificate.json", "audit.json",
            "scores.json"} <= logged
    # The audit's bounds never exceed the certified ε of a correct trainer.
    assert float(v1.tags["audit.epsilon_lower_bound"]) <= float(v1.tags["dp.epsilon"])
    report = Path(mlflow.artifacts.download_artifacts(run_id=v1.run_id, artifact_path="privacy_report.md")).read_text()
    assert "add-or-remove-one" in report and "Release gate: PASSED" in report

    # The registered model reproduces the pipeline's own predictions.
    model = mlflow.pytorch.load_model(f"models:/dpml-test-model@champion")
    config = load(params)
    x_test = np.load(Path(config.paths.data) / "prepared" / "test.npz")["x"][:32]
    from dpml.stages import Layout, load_model

    local = load_model(Layout(config))
    with torch.no_grad():
        ours = local(torch.from_numpy(x_test))
        theirs = model(torch.from_numpy(x_test))
    torch.testing.assert_close(theirs, ours)

    # `dpml certificate --run` recomputes the certificate from the logged mechanism description.
    from dpml.cli import main

    assert main(["certificate", "--run", v1.run_id, "--params", str(params)]) == 0

    # `dpml audit --model` re-audits the registered version with the data it saw: same numbers.
    from dpml.stages import audit_registered_model

    again = audit_registered_model("models:/dpml-test-model@champion", config.tracking, workdir / "reaudit")
    assert again["consistent"] and again["model"] == f"dpml-test-model/{v1.version}"
    assert again["audit"]["target"]["attacks"]["loss"]["auc"] == pytest.approx(
        first["audit"]["target"]["attacks"]["loss"]["auc"])
    assert client.get_model_version("dpml-test-model", v1.version).tags["audit.latest_reaudit_run"] == again["audit_run_id"]

    # A second release over the budget: tagged as failed, champion stays on version 1.
    over = write_params(workdir / "over.yaml", small_params(workdir, gate={"epsilon_budget": 0.01}))
    second = privacy_audited_pipeline(params_path=str(over))
    assert second["gate"]["passed"] is False
    v1, v2 = versions(client, "dpml-test-model")
    assert v2.tags["gate.passed"] == "false" and "exceeds the budget" in v2.tags["gate.reason"]
    assert client.get_model_version_by_alias("dpml-test-model", "champion").version == v1.version


@pytest.mark.slow
def test_nonprivate_model_never_becomes_champion(workdir: Path) -> None:
    from dpml.stages import run_all

    config = load(write_params(workdir / "np.yaml", small_params(workdir, train={"algorithm": "nonprivate"},
                                                                 gate={"epsilon_budget": 1e6})))
    results = run_all(config, echo=lambda _: None)
    assert results["gate"]["passed"] is False and results["certify"]["epsilon"] == float("inf")
    client = client_for(workdir)
    [version] = versions(client, "dpml-test-model")
    assert version.tags["gate.passed"] == "false" and version.tags["dp.epsilon"] == "inf"
    assert not client.get_registered_model("dpml-test-model").aliases


def test_bad_data_fails_before_registering_anything(workdir: Path) -> None:
    table = workdir / "records.csv"
    table.write_text("a,b,label\n1,2,x\n3,,y\n5,6,x\n")
    params = small_params(workdir, data={"source": f"csv:{table}", "label_column": "label",
                                         "feature_columns": ["a", "b"], "classes": ["x", "y"]})
    path = write_params(workdir / "bad.yaml", params)
    done = subprocess.run([sys.executable, "-m", "dpml", "run", "--engine", "local", "--params", str(path)],
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert "records.csv: row 1, column 'b': missing value (NaN)" in done.stderr
    assert not (workdir / "mlflow.db").exists()
    assert not (workdir / "artifacts").exists()


def test_invalid_config_fails_before_any_work(workdir: Path) -> None:
    path = write_params(workdir / "p.yaml", small_params(workdir))
    done = subprocess.run([sys.executable, "-m", "dpml", "run", "--engine", "local", "--params", str(path),
                           "--set", "dp.delta=1.5"], capture_output=True, text=True)
    assert done.returncode == 2 and "dp.delta = 1.5" in done.stderr
    assert not (workdir / "data").exists()
