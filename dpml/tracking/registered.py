"""Reading a registered release back: a version by ``models:/NAME/VERSION`` or ``models:/NAME@ALIAS``, its
run's JSON artifacts and its network — through an explicit client of the configured stores (never MLflow's
process-wide URIs)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import mlflow

from dpml.config import TrackingConfig
from dpml.tracking.serving import load_network
from dpml.tracking.store import client as store_client


def load_run_json(config: TrackingConfig, run_id: str, name: str) -> Any:
    """A JSON artifact of a logged run; a clear ValueError when the run or the artifact is missing."""
    client = store_client(config)
    try:
        with tempfile.TemporaryDirectory(prefix="dpml-run-json-") as work:
            return json.loads(Path(client.download_artifacts(run_id, name, work)).read_text())
    except (mlflow.exceptions.MlflowException, OSError, ValueError) as error:
        reason = getattr(error, "message", None) or str(error)
        raise ValueError(f"run {run_id}: no {name} logged in {config.uri} ({reason})") from None


def download_run_file(config: TrackingConfig, run_id: str, name: str, directory: Path) -> Path:
    """A file artifact of a logged run, downloaded into ``directory``; a ValueError naming it when it is missing."""
    try:
        return Path(store_client(config).download_artifacts(run_id, name, str(directory)))
    except mlflow.exceptions.MlflowException as error:
        raise ValueError(f"run {run_id}: no {name} logged ({error.message})") from None


def run_metrics(config: TrackingConfig, run_id: str) -> dict[str, float]:
    """A logged run's metrics (the last value of each)."""
    return dict(store_client(config).get_run(run_id).data.metrics)


def stage_run_metrics(config: TrackingConfig, run_id: str, stage: str) -> dict[str, float] | None:
    """The exact metrics of ``stage``'s child run of the release run ``run_id`` (the parent run writes some of
    them rounded, :mod:`dpml.formatting`); None when the release has no such child run."""
    client = store_client(config)
    experiment_id = client.get_run(run_id).info.experiment_id
    children = client.search_runs(
        [experiment_id],
        max_results=2,
        filter_string=(f"tags.mlflow.parentRunId = '{run_id}' and tags.`dpml.stage` = '{stage}'"),
    )
    return dict(children[0].data.metrics) if children else None


def find_version(uri: str, config: TrackingConfig) -> dict[str, Any]:
    """A registered version (``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``): its name, number, run id
    and tags; a ValueError naming ``uri`` when it is malformed or not in the store."""
    client = store_client(config)
    rest = uri.removeprefix("models:/")
    if (
        not uri.startswith("models:/")
        or not ("@" in rest or "/" in rest)
        or rest.startswith(("@", "/"))
        or rest.endswith(("@", "/"))
    ):
        raise ValueError(
            f"{uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION (e.g. models:/dpml-digits@champion)"
        )
    try:
        if "@" in rest:
            name, alias = rest.split("@", 1)
            version = client.get_model_version_by_alias(name, alias)
        else:
            name, number = rest.rsplit("/", 1)
            version = client.get_model_version(name, number)
    except mlflow.exceptions.MlflowException as error:
        raise ValueError(f"{uri!r}: not found in {config.registry} ({error.message})") from None
    return {"name": version.name, "version": str(version.version), "run_id": version.run_id, "tags": dict(version.tags)}


def download_model(config: TrackingConfig, name: str, version: str, destination: Path) -> Path:
    """A registered version's model folder, downloaded from the run's own stores into ``destination``."""
    source = store_client(config).get_model_version_download_uri(name, version)
    return Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri=source, dst_path=str(destination), tracking_uri=config.uri, registry_uri=config.registry
        )
    )


def resolve_model(uri: str, config: TrackingConfig) -> dict[str, Any]:
    """A registered version (:func:`find_version`) with its run's configuration and its network."""
    try:
        found = find_version(uri, config)
    except ValueError as error:
        raise ValueError(f"--model {error}") from None
    try:
        run_config = load_run_json(config, found["run_id"], "config.json")
    except ValueError:
        raise ValueError(
            f"--model {uri!r}: its run {found['run_id']} has no config.json (not a dpml release, "
            "or one from before dpml logged its configuration)"
        ) from None
    with tempfile.TemporaryDirectory(prefix="dpml-model-") as work:
        local = download_model(config, found["name"], found["version"], Path(work))
        network = load_network(local, uri)
    return found | {"config": run_config, "model": network}
