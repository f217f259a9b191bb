"""The privacy-audited pipeline as a Prefect flow.

ingest → split → preprocess → train → certify → [reference models, in parallel] → audit → gate
→ register, then ``dvc commit`` so DVC's lock file matches what this run produced (when it ran
``params.yaml`` unchanged). Runs on an ephemeral Prefect API by default, or against a server
(``PREFECT_API_URL``); the scheduled deployment is declared in ``prefect.yaml``.

The audit's reference models are independent: a subflow fans them out over a Dask task runner
(a local cluster of ``audit.workers`` processes, or the scheduler at ``audit.dask_address``).
Models already stored for the same data, split and configuration are reused, not retrained.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect import flow, get_client, unmapped
from prefect.artifacts import create_markdown_artifact
from prefect.futures import as_completed
from prefect_dask import DaskTaskRunner

from dpml.cli_text import run_summary
from dpml.config import AuditConfig, Config, ConfigBase, absolute_paths, check_tunable, load
from dpml.preflight import preflight
from dpml.progress import progress_over
from tasks import stages as t

RELEASE_ARTIFACT = "dpml-release"
"""Key of the markdown artifact each flow run leaves with its release summary."""


def dask_runner(audit: AuditConfig) -> DaskTaskRunner:
    if audit.dask_address:
        return DaskTaskRunner(address=audit.dask_address)
    return DaskTaskRunner(cluster_kwargs={"n_workers": audit.workers, "threads_per_worker": 1,
                                          "processes": True, "dashboard_address": None})


@contextmanager
def api_shared_with_workers() -> Iterator[None]:
    """Point Dask worker processes at this run's Prefect API.

    With no ``PREFECT_API_URL`` the run uses an ephemeral API inside this process; workers spawned
    without the variable would each start an ephemeral API of their own (slow, and their task runs
    would not show in this one). Exporting the URL while the cluster starts avoids both.
    """
    previous = os.environ.get("PREFECT_API_URL")
    if previous is None:
        os.environ["PREFECT_API_URL"] = str(get_client(sync_client=True).api_url).rstrip("/")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("PREFECT_API_URL", None)


@flow(name="train-reference-models", log_prints=True)
def train_reference_models(config: ConfigBase, jobs: list[tuple[str, bool, float | None, int]]) -> list[dict[str, Any]]:
    # ConfigBase, not Config: Prefect validates a flow's arguments against the annotation, and a trainer
    # registered at run time (a plugin) rebuilds Config, so an older Config class would refuse them.
    futures = t.train_reference.map(config=unmapped(config), job=jobs)
    for _ in progress_over(as_completed(futures), len(futures), "audit reference models", "model"):
        pass  # each model's completion advances the progress in this subflow's log
    return [future.result() for future in futures]


def release_markdown(results: dict[str, Any]) -> str:
    """The flow run's ``dpml-release`` artifact: the release gate's verdict, then the run summary."""
    gate, release = results["gate"], results["register"]
    verdict = "PASSED" if gate["passed"] else "FAILED"
    return (f"# dpml release: gate {verdict}\n\n`{release['model_uri']}`"
            + (" (alias `champion`)" if release["champion"] else "")
            + f"\n\n```\n{run_summary(results).strip()}\n```\n")


def _prepare(config: Config) -> dict[str, Any]:
    return {"ingest": t.ingest(config), "split": t.split(config), "preprocess": t.preprocess(config)}


def _certify_audit_release(config: Config, results: dict[str, Any]) -> dict[str, Any]:
    results["certify"] = t.certify(config)
    jobs = t.reference_jobs(config)
    if jobs:
        with api_shared_with_workers():
            runner = train_reference_models.with_options(task_runner=dask_runner(config.audit))
            results["references"] = runner(config, jobs)
    results["audit"] = t.audit(config)
    results["gate"] = t.gate(config)
    results["register"] = t.register(config)
    create_markdown_artifact(key=RELEASE_ARTIFACT, markdown=release_markdown(results),
                             description="dpml release summary: accuracy, certified ε, audit, gate, model version")
    return results


@flow(name="privacy_audited_pipeline", log_prints=True)
def privacy_audited_pipeline(params_path: str = "params.yaml", overrides: list[str] | None = None) -> dict[str, Any]:
    """Run every stage for the configuration in ``params_path`` (plus ``overrides``)."""
    config = absolute_paths(load(params_path, overrides or []))
    preflight(config)  # before any work: device, noise seed, writable folders, MLflow store, ledger
    results = _prepare(config)
    results["train"] = t.train(config)
    results = _certify_audit_release(config, results)
    if not overrides and params_path == "params.yaml":
        results["dvc"] = t.record_in_dvc()
    return results


@flow(name="private_hyperparameter_search", log_prints=True)
def private_hyperparameter_search(params_path: str = "params.yaml",
                                  overrides: list[str] | None = None) -> dict[str, Any]:
    """``dpml tune``: the pipeline with a private search (``tune`` section) in place of one training run.

    The released model is the best candidate; its certificate and the ledger charge the whole
    search. DVC is not updated: ``dvc.yaml`` describes the single-run pipeline.
    """
    config = absolute_paths(load(params_path, overrides or []))
    check_tunable(config)  # before any work
    preflight(config)
    results = _prepare(config)
    results["train"] = t.tune(config)
    return _certify_audit_release(config, results)


if __name__ == "__main__":
    privacy_audited_pipeline()
