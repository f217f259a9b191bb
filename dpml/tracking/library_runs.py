"""The MLflow run of one :func:`dpml.train_private` call: its settings, ε and δ, the certificate and the trained
weights, through an explicit client of the given store (MLflow's process-wide URIs are neither read nor changed).
A model is *registered* only by the pipeline, after its audit and gate (:mod:`dpml.tracking.runs`)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from mlflow import MlflowClient
from torch import nn

from dpml.tracking.runs import get_or_create_experiment


def log_training(
    tracking_uri: str,
    experiment: str,
    run_name: str | None,
    settings: dict[str, Any],
    certificate: dict[str, Any],
    model: nn.Module,
    train_seconds: float,
    artifact_location: str | None = None,
) -> str:
    """One finished MLflow run in ``experiment`` (created at ``artifact_location`` when new); its id. A failure
    while logging leaves the run FAILED, never RUNNING."""
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    experiment_id = get_or_create_experiment(client, experiment, artifact_location)
    run_id: str = client.create_run(experiment_id, run_name=run_name, tags={"dpml.source": "python-api"}).info.run_id
    try:
        for key, value in settings.items():
            client.log_param(run_id, key, str(value)[:500])
        client.log_metric(run_id, "epsilon", float(certificate["epsilon"]))
        client.log_metric(run_id, "delta", float(certificate["delta"]))
        client.log_metric(run_id, "train_seconds", train_seconds)
        client.log_dict(run_id, certificate, "certificate.json")
        with tempfile.TemporaryDirectory(prefix="dpml-api-") as work:
            path = Path(work) / "model_state.pt"
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, path)
            client.log_artifact(run_id, str(path))
        client.set_terminated(run_id, "FINISHED")
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    return run_id
