"""Shared fixtures: a small, fast configuration in a temporary working directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SHARED_FASHION = REPO.parent / "shared" / "datasets" / "fashion-mnist"

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def small_params(tmp: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """The repository's params.yaml made quick (few epochs) and pointed at ``tmp``."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"]["epochs"] = 3
    params["dp"] = {"noise_multiplier": 1.0, "delta": 1e-5, "clip_norm": 1.0, "neighbouring": "add-remove"}
    params["tracking"] = {"uri": f"sqlite:///{tmp / 'mlflow.db'}", "artifact_root": str(tmp / "mlartifacts"),
                          "experiment": "dpml-test", "model_name": "dpml-test-model"}
    params["paths"] = {"data": str(tmp / "data"), "artifacts": str(tmp / "artifacts"), "cache": str(tmp / "cache")}
    params["audit"] |= {"references": 2, "bootstrap": 50}
    params["ledger"] = {"path": str(tmp / "ledger.db"), "epsilon_budget": 1000.0, "delta": 1e-5}
    for name, values in sections.items():
        params.setdefault(name, {}).update(values)
    return params


@pytest.fixture(autouse=True)
def _tracking_uri_does_not_leak() -> Iterator[None]:
    """MLflow's ``set_tracking_uri`` writes MLFLOW_TRACKING_URI into the environment, where the next
    test's subprocesses would inherit a store that is not theirs: restore it after every test."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield tmp_path


def write_params(path: Path, params: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """One ephemeral Prefect API for the whole test run (≈10 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness():
        yield
