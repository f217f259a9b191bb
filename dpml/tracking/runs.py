"""Everything MLflow, in one place.

One pipeline run is one parent MLflow run, named ``<data set> · <trainer> · ε=<certified ε>``: every
parameter, the headline metrics (accuracy, ε, δ, the largest empirical ε lower bound, the gate) and the
audit's numbers, the training data set, the privacy report, the certificate, the ROC plot and the model;
under it one nested run per stage with the times, parameters and metrics that stage recorded
(:mod:`dpml.stages.records`). The experiment is tagged as a model-development experiment.

Every call names its stores: the client of :func:`dpml.tracking.store.client` carries the run's tracking URI and
registry URI, resolved once at the edge (:mod:`dpml.routing`); nothing here reads or sets MLflow's
process-wide URIs, so two runs in one process with different settings each go where they say.

**A release is all or nothing, and one per spend** (:func:`log_release`). The model version is created
with all its privacy tags and its description in one call, after everything else of the run is logged;
the ``champion`` alias moves only when the release gate passed, under the registry's lock
(:func:`dpml.tracking.store.store_lock`), so concurrent runs all register and the alias ends on the newest
passing release. Any failure or interrupt inside registration deletes the version it made, puts the
alias back and ends the MLflow run FAILED (KILLED for an interrupt) before it propagates; a process
killed outright leaves a RUNNING run, which the next registration cleans up like every FAILED and
KILLED run still holding a version (:func:`clean_up_unreleased_runs`). A spend that already has its
version — a retried task, a repeated ``dpml stage register`` — gets that version back, not a second one
(:func:`release_of_spend`).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import torch
from mlflow import MlflowClient
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag, LoggedModelOutput, Metric, Param

from dpml.config import TrackingConfig
from dpml.faults import fault_point
from dpml.tracking.review_view import save_review_view
from dpml.tracking.serving import save_classifier
from dpml.tracking.store import client as store_client
from dpml.tracking.store import is_server, store_lock

__all__ = [
    "CHAMPION",
    "clean_up_unreleased_runs",
    "finished_releases",
    "get_or_create_experiment",
    "log_audit",
    "log_release",
    "record_verdict",
    "release_of_spend",
]

CHAMPION = "champion"
EXPERIMENT_KIND = "mlflow.experimentKind"  # the UI opens an experiment in the view this tag names
MODEL_DEVELOPMENT = "custom_model_development"  # not the GenAI view


def _experiment_id(config: TrackingConfig, client: MlflowClient) -> str:
    """The configured experiment, created if new. On a tracking server its artifact location is left to
    the server (artifacts go through its proxy to its store, readable from any machine); on the embedded
    store it is ``tracking.artifact_root``."""
    location = None if is_server(config.uri) else Path(config.artifact_root).resolve().as_uri()
    return get_or_create_experiment(client, config.experiment, location)


def _existing_experiment_id(config: TrackingConfig, client: MlflowClient) -> str | None:
    found = client.get_experiment_by_name(config.experiment)
    return None if found is None else str(found.experiment_id)


def _already_exists(error: mlflow.exceptions.MlflowException) -> bool:
    return error.error_code == "RESOURCE_ALREADY_EXISTS"


def get_or_create_experiment(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    """The experiment's id, creating it if it does not exist; race-free: when another worker creates it
    between the lookup and the creation, its experiment is used."""
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(
                name, artifact_location=artifact_location, tags={EXPERIMENT_KIND: MODEL_DEVELOPMENT}
            )
        except mlflow.exceptions.MlflowException as error:
            if not _already_exists(error):
                raise
            found = client.get_experiment_by_name(name)
    if found is None or found.lifecycle_stage != "active":
        raise RuntimeError(
            f"tracking.experiment = {name!r}: the experiment is deleted in the store; restore it "
            f"(mlflow experiments restore --experiment-id ...) or choose another name"
        )
    if EXPERIMENT_KIND not in found.tags:  # made by an older dpml, or by hand: opened in the GenAI view
        client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND, MODEL_DEVELOPMENT)
    return found.experiment_id


def _ensure_registered_model(client: MlflowClient, name: str) -> None:
    """Create the registered model if it does not exist; race-free like :func:`get_or_create_experiment`."""
    try:
        client.create_registered_model(name, description="dpml releases: DP-trained, audited")
    except mlflow.exceptions.MlflowException as error:
        if not _already_exists(error):
            raise


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)
    }


def _params(params: dict[str, Any]) -> dict[str, str]:
    """Parameters as MLflow stores them; an unset one (None) is left out, never logged as ``"None"``."""
    return {k: str(v)[:500] for k, v in params.items() if v is not None}


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _log_stage_runs(client: MlflowClient, experiment_id: str, parent_id: str, records: list[dict[str, Any]]) -> None:
    """One finished child run of ``parent_id`` per stage record (:mod:`dpml.stages.records`), with the
    stage's own start and end times, parameters and metrics. A record without ``ended`` ends now."""
    for record in records:
        child = client.create_run(
            experiment_id,
            start_time=_ms(record["started"]),
            run_name=record["stage"],
            tags={"mlflow.parentRunId": parent_id, "dpml.stage": record["stage"]},
        )
        ended = _ms(record["ended"]) if record.get("ended") is not None else None
        client.log_batch(
            child.info.run_id,
            metrics=[Metric(k, v, ended or _ms(record["started"]), 0) for k, v in _numeric(record["metrics"]).items()],
            params=[Param(k, v) for k, v in _params(record["params"]).items()],
        )
        client.set_terminated(child.info.run_id, "FINISHED", end_time=ended)


def _log_run_contents(
    client: MlflowClient,
    run_id: str,
    params: dict[str, Any],
    metrics: dict[str, Any],
    dataset: MetaDataset,
    artifacts: list[Path],
    documents: dict[str, Any],
) -> None:
    """The parent run's parameters, metrics, training data set, files and JSON documents."""
    now = _ms_now()
    logged = list(_params(params).items())
    for start in range(0, len(logged), 100):  # MLflow takes at most 100 parameters per batch
        client.log_batch(run_id, params=[Param(k, v) for k, v in logged[start : start + 100]])
    numbers = list(_numeric(metrics).items())
    for start in range(0, len(numbers), 1000):
        client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in numbers[start : start + 1000]])
    client.log_inputs(
        run_id, datasets=[DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", "training")])]
    )
    for path in artifacts:
        client.log_artifact(run_id, str(path))
    for name, document in documents.items():
        client.log_dict(run_id, document, name)


def _ms_now() -> int:
    return int(time.time() * 1000)


def _log_model(
    client: MlflowClient,
    experiment_id: str,
    run_id: str,
    model: torch.nn.Module,
    in_features: int,
    serving_spec: dict[str, Any],
) -> tuple[str, str]:
    """Log the raw-record pyfunc (:mod:`dpml.tracking.serving`) as the run's logged model ``model``, through the
    run's own client; returns (logged model id, its artifact location). The version's source is that
    location, not ``models:/<id>``: MLflow resolves the latter through its process-wide tracking URI."""
    from mlflow.entities import LoggedModelStatus  # lazy: MLflow only where a run is recorded
    from mlflow.models import Model  # lazy: MLflow only where a run is recorded

    logged = client.create_logged_model(experiment_id, name="model", source_run_id=run_id)
    client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
    description = Model(
        artifact_path=logged.artifact_location, model_uuid=logged.model_id, run_id=run_id, model_id=logged.model_id
    )
    with tempfile.TemporaryDirectory(prefix="dpml-model-") as workdir:
        folder = save_classifier(model, in_features, serving_spec, Path(workdir), description)
        client.log_model_artifacts(logged.model_id, str(folder))
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    return logged.model_id, logged.artifact_location


def log_release(
    *,
    config: TrackingConfig,
    run_name: str,
    params: dict[str, Any],
    metrics: dict[str, Any],
    artifacts: list[Path],
    model: torch.nn.Module,
    in_features: int,
    serving_spec: dict[str, Any],
    version_tags: dict[str, str],
    version_description: str,
    promote: bool,
    run_tags: dict[str, str],
    documents: dict[str, Any],
    dataset: MetaDataset,
    stage_runs: list[dict[str, Any]],
    after_version: Callable[[str, str], dict[str, str]] | None = None,
) -> dict[str, Any]:
    """Log one pipeline run, register its model with ``version_tags`` and ``version_description``, alias
    it if ``promote`` — all or nothing (module docstring). ``after_version(run_id, version)`` returns text
    files that name the version (the release card), logged with the run once the version number exists.

    The parent run starts when the first of ``stage_runs`` (the stages' records) started, so its duration
    is the pipeline's; each record becomes a nested run. ``dataset`` is logged as the training input. The
    model is the raw-record pyfunc of :mod:`dpml.tracking.serving`: ``model`` (taking ``in_features`` prepared
    inputs) behind the public preprocessing that ``serving_spec`` describes. The version is created last,
    after every file, child run and the model are stored; the run ends FINISHED only after it."""
    client = store_client(config)
    experiment_id = _experiment_id(config, client)
    model_name = config.model_name
    assert model_name is not None, "tracking.model_name is filled in when the configuration is validated"
    save_review_view(client, experiment_id)
    started = min((_ms(r["started"]) for r in stage_runs), default=None)
    parent = client.create_run(experiment_id, start_time=started, tags=run_tags, run_name=run_name)
    run_id = parent.info.run_id
    with _undone_unless_finished(client, config, run_id):
        _log_run_contents(client, run_id, params, metrics, dataset, artifacts, documents)
        model_id, model_source = _log_model(client, experiment_id, run_id, model, in_features, serving_spec)
        _log_stage_runs(client, experiment_id, run_id, stage_runs)
        fault_point("register:before_version")
        with store_lock(config):  # one registration at a time: the alias ends on the newest passing release
            _ensure_registered_model(client, model_name)
            version = client.create_model_version(
                name=model_name,
                source=model_source,
                run_id=run_id,
                tags=version_tags,
                model_id=model_id,
                description=version_description,
            )
            for name, text in (after_version(run_id, str(version.version)) if after_version else {}).items():
                client.log_text(run_id, text, name)
            fault_point("register:after_version")
            champion = _point_champion_at_newest_passing(client, model_name) if promote else None
            fault_point("register:after_alias")
        client.set_terminated(run_id, "FINISHED")
    return {
        "run_id": run_id,
        "experiment_id": experiment_id,
        "model_name": model_name,
        "model_version": str(version.version),
        "model_uri": f"models:/{model_name}/{version.version}",
        "champion": champion == str(version.version),
        "tracking_uri": config.uri,
        "registry_uri": config.registry,
    }


@contextmanager
def _undone_unless_finished(client: MlflowClient, config: TrackingConfig, run_id: str) -> Iterator[None]:
    """Whatever stops the block — an error, a transient store failure, Ctrl-C, SIGTERM turned into an
    exception — deletes the model versions the run made, puts the champion alias back on the newest
    passing release, and ends the run FAILED (KILLED for an interrupt) before it propagates. Undoing is
    best effort: if the store is gone too, the next registration finishes it
    (:func:`clean_up_unreleased_runs`), and the original error is the one reported."""
    try:
        yield
    except BaseException as error:
        status = "FAILED" if isinstance(error, Exception) else "KILLED"
        try:
            _withdraw_versions(client, config, run_id)
            client.set_terminated(run_id, status)
        except Exception:  # noqa: BLE001, S110 - the original error matters; the next run cleans up
            pass
        raise


def _withdraw_versions(client: MlflowClient, config: TrackingConfig, run_id: str) -> list[str]:
    """Delete every model version of ``run_id`` (under the registry's lock) and move the champion alias
    back to the newest passing release where it pointed at one of them; returns the deleted URIs."""
    deleted = []
    with store_lock(config):
        for version in client.search_model_versions(f"run_id = '{run_id}'"):
            held_alias = str(client.get_registered_model(version.name).aliases.get(CHAMPION)) == str(version.version)
            try:
                client.delete_model_version(version.name, version.version)
            except mlflow.exceptions.MlflowException as error:
                if error.error_code != "RESOURCE_DOES_NOT_EXIST":  # withdrawn meanwhile by its own run
                    raise
            deleted.append(f"models:/{version.name}/{version.version}")
            if held_alias:
                _point_champion_at_newest_passing(client, version.name)
    return deleted


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


Process = tuple[str, int]  # (host name, process id) of a process that registers a release
ProcessesOf = Callable[[dict[str, str]], list[Process]]
"""The processes that may be registering the release of a run with these tags (the ledger records them:
``registering`` events, :func:`dpml.stages.register.registering_processes`); none where it is not known."""


def _no_process_known(tags: dict[str, str]) -> list[Process]:
    return []


def _abandoned(run: Any, processes_of: ProcessesOf) -> bool:
    """A run that can never finish its registration: FAILED or KILLED, or RUNNING while every process that
    may be registering it ran on this host and no longer exists (killed outright). A RUNNING run with a
    process elsewhere, alive, or not known is left alone: nothing here can tell that it stopped."""
    status = run.info.status
    if status in ("FAILED", "KILLED"):
        return True
    if status != "RUNNING":
        return False
    processes = processes_of(run.data.tags)
    here = socket.gethostname()
    return bool(processes) and all(host == here and not _process_alive(pid) for host, pid in processes)


def clean_up_unreleased_runs(
    config: TrackingConfig,
    processes_of: ProcessesOf = _no_process_known,
) -> list[dict[str, str]]:
    """Withdraw the model versions of every run whose registration never finished (:func:`_abandoned`):
    delete them and put the champion alias back on the newest passing release; a RUNNING run of a dead
    process is ended KILLED. Returns, per run cleaned, its id, its spend id and the versions withdrawn."""
    client = store_client(config)
    experiment_id = _existing_experiment_id(config, client)
    if experiment_id is None:
        return []
    cleaned = []
    holding = {v.run_id for v in client.search_model_versions(f"name = '{config.model_name}'", max_results=10_000)}
    for run in client.search_runs([experiment_id], filter_string="attributes.status != 'FINISHED'", max_results=10_000):
        running = run.info.status == "RUNNING"
        if (
            not _abandoned(run, processes_of)
            or run.data.tags.get("mlflow.parentRunId")
            or (not running and run.info.run_id not in holding)
        ):  # an ended run without a version: nothing to do
            continue
        withdrawn = _withdraw_versions(client, config, run.info.run_id)
        if running:
            client.set_terminated(run.info.run_id, status="KILLED")
        cleaned.append(
            {
                "run_id": run.info.run_id,
                "spend_id": run.data.tags.get("ledger.spend_id", ""),
                "withdrawn": ", ".join(withdrawn),
            }
        )
    return cleaned


def release_of_spend(config: TrackingConfig, spend_tag: str) -> dict[str, Any] | None:
    """The finished release that already registered the spend tagged ``spend_tag`` (``ledger.spend``:
    the spend's id and reservation time, unique across ledgers) in this registry, as :func:`log_release`
    returns it plus the verdict its ``gate.passed`` tag records, or None. A version whose run did not
    finish is not a release (it is being withdrawn)."""
    client = store_client(config)
    model_name = config.model_name
    for version in client.search_model_versions(f"name = '{model_name}' and tags.`ledger.spend` = '{spend_tag}'"):
        run = client.get_run(version.run_id)
        if run.info.status != "FINISHED":
            continue
        champion = str(client.get_registered_model(model_name).aliases.get(CHAMPION)) == str(version.version)
        return {
            "run_id": version.run_id,
            "experiment_id": run.info.experiment_id,
            "model_name": model_name,
            "model_version": str(version.version),
            "model_uri": f"models:/{model_name}/{version.version}",
            "champion": champion,
            "tracking_uri": config.uri,
            "registry_uri": config.registry,
            "recorded_verdict": version.tags.get("gate.passed", ""),
        }
    return None


def _point_champion_at_newest_passing(client: MlflowClient, name: str) -> str | None:
    """The alias policy (newest release whose gate passed), applied to the model's versions; returns the
    version the alias ends on.

    On a tracking server no lock orders concurrent registrations, so the alias is set, read back and
    set again until the store agrees: the last worker to write re-reads after every other worker's
    version exists, so the alias always ends on the newest passing release."""
    for _ in range(50):
        passing = [v for v in client.search_model_versions(f"name = '{name}'") if v.tags.get("gate.passed") == "true"]
        if not passing:
            if CHAMPION in client.get_registered_model(name).aliases:  # its version no longer passes
                client.delete_registered_model_alias(name, CHAMPION)
            return None
        newest = str(max(int(v.version) for v in passing))
        if (
            str(client.get_registered_model(name).aliases.get(CHAMPION)) == newest
        ):  # an int from SQLite, a str from a server
            return newest
        client.set_registered_model_alias(name, CHAMPION, newest)
    raise RuntimeError(f"registered model {name!r}: the {CHAMPION} alias did not settle after 50 writes")


def record_verdict(
    config: TrackingConfig, release: dict[str, Any], tags: dict[str, str], description: str
) -> dict[str, Any]:
    """A spend's one version judged again (the gate re-ran on the same outputs, e.g. under a changed
    ``gate.epsilon_budget``): its verdict tags (``gate.passed``, ``gate.reason``, ``verdict``, ``verdict.*``)
    and description (the version's and its run's) take the new verdict,
    and the alias policy is applied again — the alias leaves a version that no longer passes. Returns
    ``release`` with ``champion`` as it now stands."""
    client = store_client(config)
    name, number = release["model_name"], release["model_version"]
    with store_lock(config):
        for key, value in tags.items():
            client.set_model_version_tag(name, number, key, value[:5000])
        client.update_model_version(name, number, description=description)
        client.set_tag(release["run_id"], "mlflow.note.content", description)  # the run page's description
        champion = _point_champion_at_newest_passing(client, name)
    return release | {"champion": champion == str(number)}


def finished_releases(config: TrackingConfig, spend_ids: dict[int, float]) -> dict[int, dict[str, str]]:
    """For ledger spends without a ``released`` event (id → creation time), the finished MLflow run
    that released each, if any: a kill between the end of registration and the ledger's event leaves
    exactly that. One search, bounded by the oldest spend's time: a run that released a spend ended after
    the spend was made (it may have started before: a parent run starts with the pipeline's first stage)."""
    if not spend_ids:
        return {}
    client = store_client(config)
    experiment_id = _existing_experiment_id(config, client)
    if experiment_id is None:
        return {}
    since = int(min(spend_ids.values()) * 1000) - 60_000
    found: dict[int, dict[str, str]] = {}
    for run in client.search_runs(
        [experiment_id],
        max_results=10_000,
        filter_string=f"attributes.status = 'FINISHED' AND attributes.end_time >= {since}",
    ):
        spend = run.data.tags.get("ledger.spend_id", "")
        if spend.isdigit() and int(spend) in spend_ids:
            versions = client.search_model_versions(f"run_id = '{run.info.run_id}'")
            if versions:
                found[int(spend)] = {
                    "run_id": run.info.run_id,
                    "model_uri": f"models:/{versions[0].name}/{versions[0].version}",
                }
    return found


def log_audit(config: TrackingConfig, model: dict[str, Any], metrics: dict[str, Any], artifacts: list[Path]) -> str:
    """Record a re-audit of a registered version as its own run, linked from the version's tags."""
    client = store_client(config)
    run = client.create_run(
        _experiment_id(config, client),
        run_name=f"audit-{model['name']}-v{model['version']}",
        tags={"audited_model": f"{model['name']}/{model['version']}", "audited_run": model["run_id"]},
    )
    run_id = run.info.run_id
    try:
        now = _ms_now()
        client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in _numeric(metrics).items()])
        for path in artifacts:
            client.log_artifact(run_id, str(path))
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
    client.set_model_version_tag(model["name"], model["version"], "audit.latest_reaudit_run", run_id)
    return run_id
