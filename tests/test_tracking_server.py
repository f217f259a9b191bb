"""A team's tracking server: a real ``mlflow server`` with a server-side artifact store.

- Workers that create the experiment and the registered model at the same moment all get the same
  ones (no ``RESOURCE_ALREADY_EXISTS`` crash after the budget was spent).
- Two pipelines run at once from two working directories against the server: both register, the
  ``champion`` alias ends on the newest passing release, every artifact is in the server's store and
  none on the workers' disks, and the registered model is loaded and used from a third directory after
  both workers' directories are gone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from dpml.config import load
from dpml.tracking.runs import get_or_create_experiment
from tests.conftest import small_params, write_params

MODEL = "dpml-test-model"


def clean_environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return {**env, "PYTHONHASHSEED": "0", **extra}


def test_workers_creating_the_experiment_and_model_at_once_share_them(mlflow_server: dict[str, Any]) -> None:
    from dpml.tracking.runs import _ensure_registered_model

    workers = 8
    barrier = threading.Barrier(workers)
    ids: list[str] = []
    errors: list[BaseException] = []

    def first_run() -> None:
        client = MlflowClient(mlflow_server["url"])
        barrier.wait()
        try:
            ids.append(get_or_create_experiment(client, "raced", None))
            _ensure_registered_model(client, "raced-model")
        except BaseException as error:  # noqa: BLE001 - collected and reported below
            errors.append(error)

    threads = [threading.Thread(target=first_run) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    client = MlflowClient(mlflow_server["url"])
    assert len(ids) == workers and set(ids) == {client.get_experiment_by_name("raced").experiment_id}
    assert [m.name for m in client.search_registered_models("name = 'raced-model'")] == ["raced-model"]
    # Left to the server: its proxied artifact store, not a path on the worker that created it.
    assert client.get_experiment(ids[0]).artifact_location.startswith("mlflow-artifacts:")


def worker_params(workdir: Path, url: str) -> Path:
    params = small_params(workdir, gate={"epsilon_budget": 50.0})
    params["tracking"] = {"uri": url, "experiment": "team", "model_name": MODEL}
    return write_params(workdir / "params.yaml", params)


def run_id_of(summary: str) -> str:
    found = re.search(r"MLflow run\s+([0-9a-f]{32})", summary)
    assert found, summary
    return found.group(1)


LOAD_ELSEWHERE = """
import json, sys
import mlflow, numpy as np
model = mlflow.pyfunc.load_model(sys.argv[1])
records = np.load(sys.argv[2])
frame = model.predict(records)
print(json.dumps(frame[[c for c in frame.columns if c.startswith("probability(")]].to_numpy().tolist()))
"""


@pytest.mark.slow
def test_two_pipelines_at_once_register_on_the_server_and_load_anywhere(
    mlflow_server: dict[str, Any], tmp_path: Path
) -> None:
    url = mlflow_server["url"]
    workers = [tmp_path / name for name in ("worker-a", "worker-b")]
    for workdir in workers:
        workdir.mkdir()
    worker_params(workers[0], url)  # worker A names the server in its params.yaml
    # Worker B keeps the default tracking section (sqlite:///mlflow.db, experiment dpml) and is pointed at the
    # team's server by MLflow's own variables, as a scheduler's environment would: they win over the file.
    params = small_params(workers[1], store=False, gate={"epsilon_budget": 50.0})  # no store where params.yaml points
    params["tracking"] = {"model_name": MODEL}
    write_params(workers[1] / "params.yaml", params)
    environments = [clean_environment(), clean_environment(MLFLOW_TRACKING_URI=url, MLFLOW_EXPERIMENT_NAME="team")]
    running = [
        subprocess.Popen(
            [sys.executable, "-m", "dpml.cli", "run", "--engine", "local"],
            cwd=w,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for w, env in zip(workers, environments, strict=True)
    ]
    outcomes = [p.communicate(timeout=900) for p in running]
    assert [p.returncode for p in running] == [0, 0], [err[-3000:] for _, err in outcomes]
    for out, _ in outcomes:
        assert f"UI                   {url}" in out and "mlflow ui --backend-store-uri http" not in out
    assert re.search(r"tracking store\s+" + re.escape(url) + r"\s+\(environment MLFLOW_TRACKING_URI\)", outcomes[1][0])
    assert re.search(r"experiment\s+team\s+\(environment MLFLOW_EXPERIMENT_NAME\)", outcomes[1][0])
    assert not (workers[1] / "mlflow.db").exists()  # nothing went to the file params.yaml names
    team = MlflowClient(url).get_experiment_by_name("team").experiment_id
    assert {run_id_of(out) for out, _ in outcomes} <= {r.info.run_id for r in MlflowClient(url).search_runs([team])}

    client = MlflowClient(url)
    versions = sorted(client.search_model_versions(f"name = '{MODEL}'"), key=lambda v: int(v.version))
    assert [v.version for v in versions] == ["1", "2"]
    assert {v.run_id for v in versions} == {run_id_of(out) for out, _ in outcomes}
    passing = [v.version for v in versions if v.tags["gate.passed"] == "true"]
    assert passing, [v.tags for v in versions]
    assert client.get_registered_model(MODEL).aliases.get("champion") == max(passing, key=int)
    # Every artifact went through the server to its store; nothing landed on a worker's disk.
    for workdir in workers:
        assert not (workdir / "mlartifacts").exists() and not (workdir / "mlruns").exists()
    stored = {p.name for p in mlflow_server["artifacts"].rglob("*") if p.is_file()}
    assert {"MLmodel", "certificate.json", "privacy_report.md"} <= stored

    # The pipeline's own predictions for worker A's first test records, then both worker directories go.
    from dpml.stages import Layout, load_model

    layout = Layout(load(workers[0] / "params.yaml"))
    rows = np.load(layout.split)["test"][:16]
    raw = np.load(layout.raw)["x"][rows]
    with torch.no_grad():
        ours = torch.softmax(
            load_model(layout)(torch.from_numpy(np.load(layout.prepared["test"])["x"][:16])).double(), 1
        ).numpy()
    elsewhere = tmp_path / "reviewer"
    elsewhere.mkdir()
    np.save(elsewhere / "records.npy", raw)
    for workdir in workers:
        shutil.rmtree(workdir)
    version_of_a = next(v.version for v in versions if v.run_id == run_id_of(outcomes[0][0]))
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD_ELSEWHERE, f"models:/{MODEL}/{version_of_a}", str(elsewhere / "records.npy")],
        cwd=elsewhere,
        env=clean_environment(MLFLOW_TRACKING_URI=url),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    np.testing.assert_allclose(np.array(json.loads(loaded.stdout.strip().splitlines()[-1])), ours, atol=1e-5)
