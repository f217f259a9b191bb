"""End to end: the Prefect flow over the real stages, a real SQLite MLflow store and registry."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from dpml.config import load
from dpml.formatting import format_epsilon
from tests.conftest import REPO, small_params, write_params

EXPECTED_TAGS = {
    "dp.epsilon",
    "dp.delta",
    "dp.accountant",
    "dp.mechanism",
    "data.version",
    "audit.auc",
    "audit.tpr_at_0.1pct_fpr",
    "gate.passed",
    "audit.epsilon_lower_bound",
    "audit.is_evidence",
    "audit.control_tpr_at_1pct_fpr",
}


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
    # The flow run that made the release, and the Prefect API it reported to, are on its MLflow run.
    assert run.data.tags["prefect.flow_run_id"] == first["prefect"]["flow_run_id"]
    assert run.data.tags["prefect.api_url"] == first["prefect"]["api_url"]
    # The parent's metrics are written as the summary writes them: ε rounded up, never below the certificate.
    assert (
        run.data.metrics["epsilon"] == float(format_epsilon(first["certify"]["epsilon"])) >= first["certify"]["epsilon"]
    )
    assert 0 <= run.data.metrics["test_accuracy"] <= 1 and "audit.max_epsilon_lower_bound" in run.data.metrics
    # The audit's detail is on the audit stage's nested run; the release's run keeps the headline numbers.
    [audit_run] = client.search_runs(
        [run.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}' and tags.`dpml.stage` = 'audit'",
    )
    assert (
        "audit.target.loss.auc" in audit_run.data.metrics and "audit.control.rmia-online.auc" in audit_run.data.metrics
    )
    assert not any(k.startswith(("audit.target.", "audit.control.", "audit.conformance.")) for k in run.data.metrics)
    assert run.data.params["dp.noise_multiplier"] == "1.0"
    logged = {a.path for a in client.list_artifacts(v1.run_id)}
    assert {
        "privacy_report.md",
        "roc.png",
        "roc_control.png",
        "histograms.png",
        "certificate.json",
        "audit.json",
        "scores.json",
    } <= logged
    # The audit's bounds never exceed the certified ε of a correct trainer.
    assert float(v1.tags["audit.epsilon_lower_bound"]) <= float(v1.tags["dp.epsilon"])
    report = Path(mlflow.artifacts.download_artifacts(run_id=v1.run_id, artifact_path="privacy_report.md")).read_text()
    assert "add-or-remove-one" in report and "Release gate: PASSED" in report
    assert "the guarantee covers the model, not this report's figures" in report  # (accuracies from the records)
    # The three-part verdict, the same words in gate.json, the version's tags, its run's metrics and the report.
    verdict = first["gate"]["verdict"]
    assert verdict["certificate"]["word"] == "within budget"
    assert verdict["attacks"]["word"] == ("evidence" if first["gate"]["audit_is_evidence"] else "no demonstrated power")
    for part in ("certificate", "implementation", "attacks"):
        assert v1.tags[f"verdict.{part}"] == verdict[part]["word"]
        assert run.data.tags[f"verdict.{part}"] == verdict[part]["word"]
    assert run.data.metrics["verdict.certificate"] == 1.0
    assert report.splitlines()[2] == f"**Release gate: {verdict['title']}.**"  # the verdict comes first
    assert v1.description.startswith(f"**{verdict['title']}**")
    if not first["gate"]["audit_is_evidence"]:
        assert (
            verdict["title"] == "PASSED without demonstrated attack power"
            or "without implementation" in verdict["title"]
        )

    # The registered model takes raw records and reproduces the pipeline's own predictions on them.
    model = mlflow.pyfunc.load_model("models:/dpml-test-model@champion")
    config = load(params)
    from dpml.stages import Layout, load_model

    layout = Layout(config)
    test_rows = np.load(layout.split)["test"][:32]
    raw_test = np.load(layout.raw)["x"][test_rows]
    x_test = np.load(layout.prepared["test"])["x"][:32]
    with torch.no_grad():
        ours = torch.softmax(load_model(layout)(torch.from_numpy(x_test)).double(), 1).numpy()
    theirs = model.predict(raw_test)
    np.testing.assert_allclose(theirs[[f"probability({c})" for c in range(10)]].to_numpy(), ours, atol=1e-5)
    assert theirs["label"].tolist() == [str(i) for i in ours.argmax(1)]

    # `dpml certificate --run` recomputes the certificate from the logged mechanism description.
    from dpml.cli import main

    assert main(["certificate", "--run", v1.run_id, "--params", str(params)]) == 0
    for release in ("models:/dpml-test-model@champion", f"models:/dpml-test-model/{v1.version}"):
        assert main(["certificate", release, "--params", str(params)]) == 0  # a release, as every command takes it
    assert main(["certificate", "models:/dpml-test-model/99", "--params", str(params)]) != 0

    # `dpml audit --model` re-audits the registered version with the data it saw: same numbers.
    from dpml.stages import audit_registered_model

    again = audit_registered_model("models:/dpml-test-model@champion", config.tracking, workdir / "reaudit")
    assert again["consistent"] and again["model"] == f"dpml-test-model/{v1.version}"
    assert again["audit"]["target"]["attacks"]["loss"]["auc"] == pytest.approx(
        first["audit"]["target"]["attacks"]["loss"]["auc"]
    )
    assert (
        client.get_model_version("dpml-test-model", v1.version).tags["audit.latest_reaudit_run"]
        == again["audit_run_id"]
    )

    # A second release over the budget: tagged as failed, champion stays on version 1.
    over = write_params(workdir / "over.yaml", small_params(workdir, gate={"epsilon_budget": 0.01}))
    second = privacy_audited_pipeline(params_path=str(over))
    assert second["gate"]["passed"] is False
    v1, v2 = versions(client, "dpml-test-model")
    assert v2.tags["gate.passed"] == "false" and "exceeds the budget" in v2.tags["gate.reason"]
    assert v2.tags["verdict.certificate"] == "over budget" and v2.tags["verdict"].startswith(
        "FAILED: certificate over budget"
    )
    assert client.get_model_version_by_alias("dpml-test-model", "champion").version == v1.version


THIRD_PARTY_NOISE = (
    "distributed.",
    "Worker process still alive",
    "absl",
    "Downloading artifacts",
    "INFO mlflow",
    "WARNING mlflow",
    "Add type hints",
    "Dask",
    "Finished in state",
    "Beginning flow run",
)
"""Signs of Prefect's, Dask's, absl's and MLflow's logs and progress bars (and MLflow's warnings) in dpml's output."""


@pytest.mark.exhaustive  # CI runs it after the default suite, which stays near 20 min on 2 cores
@pytest.mark.slow
def test_dpml_run_shows_progress_and_its_summary_and_no_third_party_noise(workdir: Path, prefect_harness: None) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import ArtifactSort
    from prefect.settings import PREFECT_API_URL

    audit = {"references": 1, "bootstrap": 0, "white_box_canaries": 0}  # quick; LiRA still needs Dask's references
    params = write_params(workdir / "run.yaml", small_params(workdir, audit=audit))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "PREFECT_LOGGING_LEVEL": "INFO",
    }  # this test session's Prefect API; Prefect's INFO lines shown
    for name in (
        "MLFLOW_TRACKING_URI",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR",
        "MLFLOW_LOGGING_LEVEL",
        "DASK_LOGGING__DISTRIBUTED",
        "PREFECT_LOGGING_SETTINGS_PATH",
    ):
        env.pop(name, None)  # the CLI itself must quieten them (conftest quietens the tests' own processes)

    def dpml_run(*flags: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "dpml", *flags, "run", "--params", str(params)],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        assert "dpml run summary" in done.stdout
        return done.stdout + done.stderr

    quiet = dpml_run()
    assert [line for line in quiet.splitlines() if any(sign in line for sign in THIRD_PARTY_NOISE)] == []
    assert re.search(r"DP-SGD: 100% \((\d+)/\1 steps", quiet)  # training's progress
    assert re.search(r"audit reference models: 100% \((2)/\1 models", quiet)  # 1 reference × (target, control)
    run_id = re.search(r"MLflow run\s+([0-9a-f]{32})", quiet).group(1)

    with get_client(sync_client=True) as client:
        [artifact] = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["dpml-release"])),
            sort=ArtifactSort.CREATED_DESC,
            limit=1,
        )
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[artifact.flow_run_id])))
    assert artifact.type == "markdown" and "dpml run summary" in artifact.data and run_id in artifact.data
    assert artifact.data.startswith("# dpml release: gate FAILED")  # small_params: ε above the default budget
    assert [log.message for log in logs if log.message.startswith("DP-SGD: 100% (")]  # in the run's Prefect log

    verbose = dpml_run("--verbose")  # the same run again: references stored, Dask still started
    # (absl's one warning of a run, an RDP order that did not converge, is dropped by dpml even here: it is
    # safe by construction, dpml.accounting.accountants.non_converging_orders_unlogged)
    assert "distributed.scheduler" in verbose and "Downloading artifacts" in verbose
    assert "Finished in state Completed()" in verbose  # Prefect's own lines, kept out of the quiet run


@pytest.mark.slow
def test_nonprivate_model_never_becomes_champion(workdir: Path) -> None:
    from dpml.stages import run_all

    config = load(
        write_params(
            workdir / "np.yaml", small_params(workdir, train={"algorithm": "nonprivate"}, gate={"epsilon_budget": 1e6})
        )
    )
    results = run_all(config, echo=lambda _: None)
    assert results["gate"]["passed"] is False and results["certify"]["epsilon"] == float("inf")
    client = client_for(workdir)
    [version] = versions(client, "dpml-test-model")
    assert version.tags["gate.passed"] == "false" and version.tags["dp.epsilon"] == "inf"
    assert version.tags["verdict.certificate"] == "none" and results["gate"]["verdict"]["title"] == "FAILED"
    assert not client.get_registered_model("dpml-test-model").aliases


def test_bad_data_fails_before_registering_anything(workdir: Path) -> None:
    table = workdir / "records.csv"
    table.write_text("a,b,label\n1,2,x\n3,,y\n5,6,x\n")
    params = small_params(
        workdir,
        data={"source": f"csv:{table}", "label_column": "label", "feature_columns": ["a", "b"], "classes": ["x", "y"]},
    )
    path = write_params(workdir / "bad.yaml", params)
    done = subprocess.run(
        [sys.executable, "-m", "dpml", "run", "--engine", "local", "--params", str(path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert "records.csv: row 1, column 'b': missing value (NaN)" in done.stderr
    assert not [p for p in (workdir / "artifacts").rglob("*") if p.is_file()]  # pre-flight made the folder only
    if (workdir / "mlflow.db").exists():  # pre-flight prepares the store before ingestion; it stays empty
        client = client_for(workdir)
        assert not client.search_registered_models() and not client.search_runs(
            [e.experiment_id for e in client.search_experiments()]
        )


def test_invalid_config_fails_before_any_work(workdir: Path) -> None:
    path = write_params(workdir / "p.yaml", small_params(workdir))
    done = subprocess.run(
        [sys.executable, "-m", "dpml", "run", "--engine", "local", "--params", str(path), "--set", "dp.delta=1.5"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "dp.delta = 1.5" in done.stderr
    assert not (workdir / "data").exists()


@pytest.mark.exhaustive  # CI runs it after the default suite, which stays near 20 min on 2 cores
@pytest.mark.slow
def test_private_search_releases_the_best_candidate_and_charges_the_search(
    workdir: Path, prefect_harness: None
) -> None:
    from dpml.ledger.ledger import Ledger
    from flows.pipeline import private_hyperparameter_search

    space = {"train.learning_rate": [0.5, 2.0], "model.hidden": [[], [16]]}
    params = write_params(
        workdir / "tune.yaml",
        small_params(
            workdir,
            dp={"noise_multiplier": None, "target_epsilon": 2.0},
            tune={"distribution": "truncated_negative_binomial", "mean": 2.0, "shape": 1.0, "space": space},
            audit={"references": 1, "white_box_canaries": 0, "black_box_canaries": 0},
            gate={"epsilon_budget": 3.0},
        ),
    )
    results = private_hyperparameter_search(params_path=str(params))
    config = load(params)
    certificate = results["certify"]["certificate"]
    # Calibrated so that the whole search, not one candidate, meets the target.
    assert certificate["accountant"].startswith("papernot_steinke") and certificate["epsilon"] <= 2.0
    assert certificate["mechanism"]["selection"] == {
        "distribution": "truncated_negative_binomial",
        "mean": 2.0,
        "shape": 1.0,
    }
    assert "hyperparameter search" in certificate["statement"]
    one_candidate = certificate["mechanism"] | {"selection": None}
    from dpml.accounting.accountants import certify
    from dpml.accounting.mechanism import MechanismDescription

    assert certify(MechanismDescription.from_dict(one_candidate), 1e-5)["epsilon"] < certificate["epsilon"]

    client = client_for(workdir)
    [version] = versions(client, "dpml-test-model")
    chosen = {k.removeprefix("chosen."): v for k, v in results["train"].items() if k.startswith("chosen.")}
    assert set(chosen) == set(space) and all(chosen[k] in space[k] for k in space)
    assert version.tags["tune.chosen"] and "truncated negative binomial" in version.tags["dp.mechanism"]
    run = client.get_run(version.run_id)
    # The run logs the released candidate's hyperparameters, and nothing about the others.
    assert run.data.params["train.learning_rate"] == str(float(chosen["train.learning_rate"]))
    assert "tuning.json" in {a.path for a in client.list_artifacts(version.run_id)}
    assert not any("candidate" in key for key in run.data.metrics)
    # The released model has the chosen architecture, and the registered one predicts like it.
    from dpml.stages import Layout, load_model

    layout = Layout(config)
    assert list(json.loads(layout.model_spec.read_text())["hidden"]) == chosen["model.hidden"]
    x = torch.from_numpy(np.load(layout.prepared["test"])["x"][:16])
    from dpml.tracking.registered import resolve_model

    registered = resolve_model(f"models:/dpml-test-model/{version.version}", config.tracking)["model"]
    with torch.no_grad():
        torch.testing.assert_close(registered(x), load_model(layout)(x))
    # The ledger holds the whole search as one spend, recorded before training; K is not recorded.
    [spend] = Ledger(config.ledger.path, 1e-5).spends()
    assert spend.mechanism is not None and spend.mechanism.selection is not None
    events = dict(Ledger(config.ledger.path, 1e-5).events(spend.id))
    assert set(events) == {"started", "trained", "registering", "released"}
    assert set(events["trained"]) == {"chosen", "trained_outputs"} and set(events["registering"]) == {"host", "pid"}
    # The audit's members are the records the released model trained on: validation rows excluded.
    n_train = np.load(layout.prepared["train"])["y"].size
    n_val = np.load(layout.validation)["rows"].size
    assert n_val == round(config.tune.validation_fraction * n_train)
    from dpml.stages import audit_context

    assert audit_context(config).train[0].shape[0] == n_train - n_val


def test_noisycgd_pipeline_certifies_the_final_model_only(workdir: Path) -> None:
    """seed 001's trainer end to end: λ calibrated to the target, GDP certificate, no white-box canaries,
    the audit's references trained with the released λ, the version tagged with its mechanism."""
    from dpml.stages import Layout, release_config, run_all

    config = load(
        write_params(
            workdir / "cgd.yaml",
            small_params(
                workdir,
                train={"algorithm": "noisycgd", "learning_rate": 0.005, "epochs": 20},
                model={"kind": "gated", "gates": 16},
                dp={
                    "noise_multiplier": 3.0,
                    "target_epsilon": 4.0,
                    "delta": 1e-5,
                    "clip_norm": 34.0,
                    "neighbouring": "replace-one",
                },
                noisycgd={"batch_size": 60},
                gate={"epsilon_budget": 5.0},
                audit={"black_box_canaries": 100},
            ),
        )
    )
    results = run_all(config, echo=lambda _: None)
    certificate = results["certify"]["certificate"]
    assert certificate["epsilon"] == pytest.approx(4.0, abs=1e-6) and certificate["epsilon"] <= 4.0 + 1e-9
    assert certificate["threat_model"] == "final-model" and "final model only" in certificate["statement"]
    answers = {a["name"]: a for a in certificate["answers"]}
    assert answers["gdp.exact"]["epsilon"] == pytest.approx(4.0, abs=1e-6)
    assert answers["dp_accounting.pld"]["epsilon"] >= 4.0 - 1e-6
    audit = json.loads((Layout(config).audit).read_text())
    assert [run["method"] for run in audit["one_run"]] == ["one_run_black_box"]
    released = release_config(config)
    l2 = json.loads(Layout(config).train_metrics.read_text())["train_l2"]
    assert released.noisycgd.l2 == l2 > 0 and released.dp.target_epsilon is None
    client = client_for(workdir)
    [version] = versions(client, "dpml-test-model")
    assert version.tags["dp.mechanism"].startswith("noisycgd: gdp mu=")
    assert "final-model" in version.tags["dp.mechanism"] and version.tags["gate.passed"] == "true"


def test_noisycgd_search_calibrates_every_candidate_and_certifies_the_search(workdir: Path) -> None:
    """seed 001 §5 through dpml tune: K ~ truncated negative binomial under replace-one, every candidate's λ
    calibrated to the same μ, the whole search ≤ the target, the released λ used by the audit."""
    from dpml.accounting.accountants import certify as certify_mechanism
    from dpml.accounting.mechanism import MechanismDescription
    from dpml.stages import Layout, release_config, run_all

    config = load(
        write_params(
            workdir / "cgd-tune.yaml",
            small_params(
                workdir,
                train={"algorithm": "noisycgd", "learning_rate": 0.005, "epochs": 20},
                model={"kind": "gated", "gates": 16},
                dp={
                    "noise_multiplier": 3.0,
                    "target_epsilon": 6.0,
                    "delta": 1e-5,
                    "clip_norm": 34.0,
                    "neighbouring": "replace-one",
                },
                noisycgd={"batch_size": 60},
                gate={"epsilon_budget": 7.0},
                audit={"black_box_canaries": 0, "white_box_canaries": 0, "control": False, "attacks": ["loss"]},
                tune={"space": {"train.learning_rate": [0.002, 0.005], "model.gates": [8, 16]}, "mean": 2.0},
            ),
        )
    )
    results = run_all(config, echo=lambda _: None, search=True)
    certificate = results["certify"]["certificate"]
    assert certificate["epsilon"] <= 6.0 + 1e-9 and certificate["epsilon"] == pytest.approx(6.0, abs=1e-3)
    answers = {a["name"]: a for a in certificate["answers"]}
    assert answers["papernot_steinke.rdp[dp_accounting]"]["epsilon"] is not None
    assert answers["dp_accounting.rdp"]["epsilon"] is not None  # dp_accounting's own RepeatAndSelect
    mechanism = MechanismDescription.from_dict(certificate["mechanism"])
    assert mechanism.trainer == "noisycgd-search" and mechanism.neighbouring == "replace-one"
    assert mechanism.selection is not None and mechanism.selection.random
    released = release_config(config)
    tuning = json.loads(Layout(config).tuning.read_text())
    assert released.train.learning_rate == tuning["chosen"]["train.learning_rate"]
    assert released.noisycgd.l2 is not None and released.dp.target_epsilon is None
    # The released candidate alone is within the per-candidate μ the search was priced with.
    from dpml.train.trainers.noisycgd import noisycgd_settings
    from dpml.train.noisycgd import noisycgd_mechanism

    from dpml import io
    from dpml.stages import load_part

    layout = Layout(config)
    n_fit = load_part(layout, "train")[1].size - io.read_npz(layout.validation)["rows"].size
    alone = noisycgd_mechanism(noisycgd_settings(released, n_fit), n_fit)
    assert alone.events[0].mu <= mechanism.events[0].mu * (1 + 1e-9)
    assert certify_mechanism(alone, 1e-5)["epsilon"] < certificate["epsilon"]
