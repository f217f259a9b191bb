"""Everything MLflow, in one place.

One pipeline run is one parent MLflow run, named ``<data set> · <trainer> · ε=<certified ε>``: every
parameter, the headline metrics (accuracy, ε, δ, the largest empirical ε lower bound, the gate) and the
audit's numbers, the training data set (``mlflow.log_input``), the privacy report, the certificate, the
ROC plot and the model; under it one nested run per stage with the times, parameters and metrics that
stage recorded (:mod:`dpml.stages.records`). The experiment is tagged as a model-development
experiment. The model version is created with all its privacy tags and its description in one call, so
a version never exists without them; the
``champion`` alias moves only when the release gate passed. The store is made ready (created,
migrated or repaired) by :func:`dpml.store.prepare_store` before any budget is spent, and
registration runs under the store's lock (:func:`dpml.store.store_lock`), so concurrent runs on one
SQLite store all register and the alias ends on the newest passing release.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import torch
from mlflow import MlflowClient
from mlflow.data.dataset_source import DatasetSource
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import Metric, Param

from dpml.config import TrackingConfig
from dpml.faults import fault_point
from dpml.serving import load_network, log_classifier
from dpml.store import activate, is_server, store_lock, tracking_uri

__all__ = ["CHAMPION", "REVIEW_VIEW", "clean_up_killed_runs", "find_version", "finished_releases", "get_or_create_experiment", "load_run_json",
           "log_audit", "log_release", "resolve_model", "review_url", "tracking_uri", "training_dataset"]

CHAMPION = "champion"
EXPERIMENT_KIND = "mlflow.experimentKind"  # the UI opens an experiment in the view this tag names
MODEL_DEVELOPMENT = "custom_model_development"  # not the GenAI view
REVIEW_VIEW = "dpml-review"  # the runs list with the release's headline columns (:func:`review_url`)
REVIEW_COLUMNS = ["attributes.`Dataset`", "attributes.`Duration`", "attributes.`Models`", "metrics.`test_accuracy`",
                  "tags.`dp.epsilon`", "metrics.`delta`", "metrics.`audit.max_epsilon_lower_bound`", "tags.`gate.passed`"]


def _experiment_id(config: TrackingConfig) -> str:
    """The configured experiment, created if new. On a tracking server its artifact location is left to
    the server (artifacts go through its proxy to its store, readable from any machine); on the embedded
    store it is ``tracking.artifact_root``."""
    uri = tracking_uri(config)
    location = None if is_server(uri) else Path(config.artifact_root).resolve().as_uri()
    return get_or_create_experiment(MlflowClient(uri), config.experiment, location)


def _already_exists(error: mlflow.exceptions.MlflowException) -> bool:
    return error.error_code == "RESOURCE_ALREADY_EXISTS"


def get_or_create_experiment(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    """The experiment's id, creating it if it does not exist; race-free: when another worker creates it
    between the lookup and the creation, its experiment is used."""
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location,
                                            tags={EXPERIMENT_KIND: MODEL_DEVELOPMENT})
        except mlflow.exceptions.MlflowException as error:
            if not _already_exists(error):
                raise
            found = client.get_experiment_by_name(name)
    if found is None or found.lifecycle_stage != "active":
        raise RuntimeError(f"tracking.experiment = {name!r}: the experiment is deleted in the store; restore it "
                           f"(mlflow experiments restore --experiment-id ...) or choose another name")
    if EXPERIMENT_KIND not in found.tags:  # made by an older dpml, or by hand: opened in the GenAI view
        client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND, MODEL_DEVELOPMENT)
    return found.experiment_id


def _save_review_view(client: MlflowClient, experiment_id: str) -> None:
    """Store the review view as a shared view of the experiment (the UI's ``viewStateShareKey``): the runs
    list with the data set, duration, model, test accuracy, certified ε, δ, the largest empirical ε lower
    bound and the gate as columns. A reviewer opens :func:`review_url` and may keep it as their own view."""
    client.set_experiment_tag(experiment_id, f"mlflow.sharedViewState.{REVIEW_VIEW}",
                              json.dumps({"selectedColumns": REVIEW_COLUMNS}))


def review_url(experiment_id: str, ui: str = "") -> str:
    """The experiment's runs list in the review view, under the UI at ``ui`` (e.g. ``http://127.0.0.1:5000``)."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs?viewStateShareKey={REVIEW_VIEW}"


def _ensure_registered_model(client: MlflowClient, name: str) -> None:
    """Create the registered model if it does not exist; race-free like :func:`get_or_create_experiment`."""
    try:
        client.create_registered_model(name, description="dpml releases: DP-trained, audited")
    except mlflow.exceptions.MlflowException as error:
        if not _already_exists(error):
            raise


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and np.isfinite(v)}


def _params(params: dict[str, Any]) -> dict[str, str]:
    """Parameters as MLflow stores them; an unset one (None) is left out, never logged as ``"None"``."""
    return {k: str(v)[:500] for k, v in params.items() if v is not None}


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


class DataSource(DatasetSource):
    """Where the training data came from: ``data.source`` (``sklearn:digits``, ``csv:PATH``, ``idx:DIR``…)
    and its full content version. Recorded for people and lineage; MLflow cannot load it."""

    def __init__(self, uri: str, version: str) -> None:
        self.uri, self.version = uri, version

    @staticmethod
    def _get_source_type() -> str:
        return "dpml"

    def load(self, **kwargs: Any) -> Any:
        raise NotImplementedError("load the data with dpml (data.source), not through MLflow")

    @staticmethod
    def _can_resolve(raw_source: Any) -> bool:
        return False

    @classmethod
    def _resolve(cls, raw_source: Any) -> DataSource:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return {"uri": self.uri, "version": self.version}

    @classmethod
    def from_dict(cls, source_dict: dict[Any, Any]) -> DataSource:
        return cls(source_dict["uri"], source_dict["version"])


def training_dataset(name: str, source: str, version: str) -> MetaDataset:
    """The training data set as MLflow shows it (the runs list's Dataset column): its name, its content
    version as the digest (MLflow keeps 36 characters of it; the source holds it whole) and its source."""
    return MetaDataset(DataSource(source, version), name=name, digest=version[:36])


def _log_stage_runs(client: MlflowClient, experiment_id: str, parent_id: str, records: list[dict[str, Any]],
                    tags: dict[str, str]) -> None:
    """One finished child run of ``parent_id`` per stage record (:mod:`dpml.stages.records`), with the
    stage's own start and end times, parameters and metrics. A record without ``ended`` ends now."""
    for record in records:
        child = client.create_run(experiment_id, start_time=_ms(record["started"]), run_name=record["stage"],
                                  tags={"mlflow.parentRunId": parent_id, "dpml.stage": record["stage"], **tags})
        ended = _ms(record["ended"]) if record.get("ended") is not None else None
        client.log_batch(child.info.run_id,
                         metrics=[Metric(k, v, ended or _ms(record["started"]), 0)
                                  for k, v in _numeric(record["metrics"]).items()],
                         params=[Param(k, v) for k, v in _params(record["params"]).items()])
        client.set_terminated(child.info.run_id, "FINISHED", end_time=ended)


def log_release(*, config: TrackingConfig, run_name: str, params: dict[str, Any], metrics: dict[str, Any],
                artifacts: list[Path], model: torch.nn.Module, in_features: int, serving_spec: dict[str, Any],
                version_tags: dict[str, str], version_description: str, promote: bool, run_tags: dict[str, str],
                documents: dict[str, Any], dataset: MetaDataset, stage_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Log one pipeline run, register its model with ``version_tags`` and ``version_description``, alias
    it if ``promote``.

    The parent run starts when the first of ``stage_runs`` (the stages' records) started, so its duration
    is the pipeline's; each record becomes a nested run. ``dataset`` is logged as the training input. The
    model is the raw-record pyfunc of :mod:`dpml.serving`: ``model`` (taking ``in_features`` prepared
    inputs) behind the public preprocessing that ``serving_spec`` describes."""
    activate(config)
    experiment_id = _experiment_id(config)
    client = MlflowClient()
    model_name = config.model_name
    assert model_name is not None, "tracking.model_name is filled in when the configuration is validated"
    _save_review_view(client, experiment_id)
    started = min((_ms(r["started"]) for r in stage_runs), default=None)
    parent = client.create_run(experiment_id, start_time=started, tags=run_tags, run_name=run_name)
    with mlflow.start_run(run_id=parent.info.run_id) as run:
        mlflow.log_params(_params(params))
        mlflow.log_metrics(_numeric(metrics))
        mlflow.log_input(dataset, context="training")
        for path in artifacts:
            mlflow.log_artifact(str(path))
        for name, document in documents.items():
            mlflow.log_dict(document, name)
        with tempfile.TemporaryDirectory(prefix="dpml-model-") as workdir:
            info = log_classifier(model, in_features, serving_spec, Path(workdir))
        with store_lock(config):  # one registration at a time: the alias ends on the newest passing release
            _ensure_registered_model(client, model_name)
            version = client.create_model_version(
                name=model_name, source=info.model_uri, run_id=run.info.run_id,
                tags=version_tags, model_id=info.model_id, description=version_description,
            )
            fault_point("register:after_version")
            champion = _point_champion_at_newest_passing(client, model_name) if promote else None
            fault_point("register:after_alias")
        process = {k: run_tags[k] for k in ("dpml.host", "dpml.pid") if k in run_tags}  # a kill is cleaned up alike
        _log_stage_runs(client, experiment_id, run.info.run_id, stage_runs, process)
    return {
        "run_id": run.info.run_id,
        "experiment_id": experiment_id,
        "model_name": model_name,
        "model_version": str(version.version),
        "model_uri": f"models:/{model_name}/{version.version}",
        "champion": champion == str(version.version),
        "tracking_uri": tracking_uri(config),
    }


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_up_killed_runs(config: TrackingConfig) -> list[dict[str, str]]:
    """Runs a killed dpml process left RUNNING: mark them KILLED and delete any model version they had
    created (registration never finished: no alias moved, no ``released`` event). Only runs started on
    this host by a process that no longer exists are touched. Returns what was cleaned."""
    activate(config)
    experiment = mlflow.get_experiment_by_name(config.experiment)
    if experiment is None:
        return []
    client = MlflowClient()
    cleaned = []
    for run in client.search_runs([experiment.experiment_id], filter_string="attributes.status = 'RUNNING'"):
        tags = run.data.tags
        pid = tags.get("dpml.pid", "")
        if tags.get("dpml.host") != socket.gethostname() or not pid.isdigit() or _process_alive(int(pid)):
            continue
        with store_lock(config):
            for version in client.search_model_versions(f"run_id = '{run.info.run_id}'"):
                held_alias = client.get_registered_model(version.name).aliases.get(CHAMPION) == version.version
                client.delete_model_version(version.name, version.version)
                if held_alias:  # killed after the alias moved: back to the newest passing release
                    _point_champion_at_newest_passing(client, version.name)
            client.set_terminated(run.info.run_id, status="KILLED")
        cleaned.append({"run_id": run.info.run_id, "spend_id": tags.get("ledger.spend_id", "")})
    return cleaned


def _point_champion_at_newest_passing(client: MlflowClient, name: str) -> str | None:
    """The alias policy (newest release whose gate passed), applied to the model's versions; returns the
    version the alias ends on.

    On a tracking server no lock orders concurrent registrations, so the alias is set, read back and
    set again until the store agrees: the last worker to write re-reads after every other worker's
    version exists, so the alias always ends on the newest passing release."""
    for _ in range(50):
        passing = [v for v in client.search_model_versions(f"name = '{name}'") if v.tags.get("gate.passed") == "true"]
        if not passing:
            return None
        newest = str(max(int(v.version) for v in passing))
        if str(client.get_registered_model(name).aliases.get(CHAMPION)) == newest:  # an int from SQLite, a str from a server
            return newest
        client.set_registered_model_alias(name, CHAMPION, newest)
    raise RuntimeError(f"registered model {name!r}: the {CHAMPION} alias did not settle after 50 writes")


def finished_releases(config: TrackingConfig, spend_ids: dict[int, float]) -> dict[int, dict[str, str]]:
    """For ledger spends without a ``released`` event (id → creation time), the finished MLflow run
    that released each, if any: a kill between the end of registration and the ledger's event leaves
    exactly that. One search, bounded by the oldest spend's time: a run that released a spend ended after
    the spend was made (it may have started before: a parent run starts with the pipeline's first stage)."""
    if not spend_ids:
        return {}
    activate(config)
    experiment = mlflow.get_experiment_by_name(config.experiment)
    if experiment is None:
        return {}
    client = MlflowClient()
    since = int(min(spend_ids.values()) * 1000) - 60_000
    found: dict[int, dict[str, str]] = {}
    for run in client.search_runs([experiment.experiment_id], max_results=10_000,
                                  filter_string=f"attributes.status = 'FINISHED' AND attributes.end_time >= {since}"):
        spend = run.data.tags.get("ledger.spend_id", "")
        if spend.isdigit() and int(spend) in spend_ids:
            versions = client.search_model_versions(f"run_id = '{run.info.run_id}'")
            if versions:
                found[int(spend)] = {"run_id": run.info.run_id,
                                     "model_uri": f"models:/{versions[0].name}/{versions[0].version}"}
    return found


def load_run_json(config: TrackingConfig, run_id: str, name: str) -> Any:
    """A JSON artifact of a logged run; a clear ValueError when the run or the artifact is missing."""
    activate(config)
    try:
        return mlflow.artifacts.load_dict(f"runs:/{run_id}/{name}")
    except mlflow.exceptions.MlflowException as error:
        raise ValueError(f"run {run_id}: no {name} logged in {tracking_uri(config)} ({error.message})") from None


def find_version(uri: str, config: TrackingConfig) -> dict[str, Any]:
    """A registered version (``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``): its name, number, run id
    and tags; a ValueError naming ``uri`` when it is malformed or not in the store."""
    activate(config)
    client = MlflowClient()
    rest = uri.removeprefix("models:/")
    if not uri.startswith("models:/") or not ("@" in rest or "/" in rest) or rest.startswith(("@", "/")) \
            or rest.endswith(("@", "/")):
        raise ValueError(f"{uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION "
                         "(e.g. models:/dpml-digits@champion)")
    try:
        if "@" in rest:
            name, alias = rest.split("@", 1)
            version = client.get_model_version_by_alias(name, alias)
        else:
            name, number = rest.rsplit("/", 1)
            version = client.get_model_version(name, number)
    except mlflow.exceptions.MlflowException as error:
        raise ValueError(f"{uri!r}: not found in {tracking_uri(config)} ({error.message})") from None
    return {"name": version.name, "version": str(version.version), "run_id": version.run_id, "tags": dict(version.tags)}


def resolve_model(uri: str, config: TrackingConfig) -> dict[str, Any]:
    """A registered version (:func:`find_version`) with its run's configuration and its network."""
    try:
        found = find_version(uri, config)
    except ValueError as error:
        raise ValueError(f"--model {error}") from None
    try:
        run_config = load_run_json(config, found["run_id"], "config.json")
    except ValueError:
        raise ValueError(f"--model {uri!r}: its run {found['run_id']} has no config.json (not a dpml release, "
                         "or one from before dpml logged its configuration)") from None
    return found | {"config": run_config, "model": load_network(f"models:/{found['name']}/{found['version']}")}


def log_audit(config: TrackingConfig, model: dict[str, Any], metrics: dict[str, Any], artifacts: list[Path]) -> str:
    """Record a re-audit of a registered version as its own run, linked from the version's tags."""
    activate(config)
    with mlflow.start_run(experiment_id=_experiment_id(config), run_name=f"audit-{model['name']}-v{model['version']}") as run:
        mlflow.set_tags({"audited_model": f"{model['name']}/{model['version']}", "audited_run": model["run_id"]})
        mlflow.log_metrics(_numeric(metrics))
        for path in artifacts:
            mlflow.log_artifact(str(path))
    MlflowClient().set_model_version_tag(model["name"], model["version"], "audit.latest_reaudit_run", run.info.run_id)
    return run.info.run_id
