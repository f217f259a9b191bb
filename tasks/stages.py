"""One Prefect task per pipeline stage; each re-validates nothing and computes nothing itself.

Every stage but registration may be stopped anywhere inside by a Prefect cancellation (``flows/cancellation.py``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NONE
from prefect.states import Cancelled as CancelledState
from prefect.states import State

from dpml import stages
from dpml.config import Config
from dpml.interrupts import Cancelled, stoppable

# Deterministic stages are not retried: a failure there is a bug or bad data, and retrying would
# hide it. MLflow writes can meet a transient "database is locked": those are retried.
_stage = dict(cache_policy=NONE, log_prints=True)


def _stoppable_stage(name: str, config: Config, **options: Any) -> Any:
    """A stage that a Prefect cancellation may stop anywhere inside (:func:`dpml.interrupts.stoppable`: only
    in the flow's main thread, under its cancellation watch); stopped, its task run ends ``Cancelled`` and the
    flow sees :class:`prefect.exceptions.CancelledRun`. Registration is not one: it runs to its end."""
    try:
        with stoppable():
            return stages.run_stage(name, config, **options)
    except Cancelled as stop:
        return CancelledState(message=stop.reason)


@task(name="ingest", **_stage)
def ingest(config: Config) -> dict[str, Any]:
    return _stoppable_stage("ingest", config)


@task(name="split", **_stage)
def split(config: Config) -> dict[str, Any]:
    return _stoppable_stage("split", config)


@task(name="preprocess", **_stage)
def preprocess(config: Config) -> dict[str, Any]:
    return _stoppable_stage("preprocess", config)


@task(name="train", **_stage)
def train(config: Config) -> dict[str, Any]:
    """Training, its progress in the task run's log."""
    return _stoppable_stage("train", config, progress=True)


@task(name="tune", **_stage)
def tune(config: Config) -> dict[str, Any]:
    """The private hyperparameter search; releases the best candidate only."""
    return _stoppable_stage("train", config, progress=True, search=True)


@task(name="certify", **_stage)
def certify(config: Config) -> dict[str, Any]:
    return _stoppable_stage("certify", config)


@task(name="reference-jobs", **_stage)
def reference_jobs(config: Config) -> list[tuple[str, bool, float | None, int]]:
    try:
        with stoppable():
            return stages.audit_reference_jobs(config)
    except Cancelled as stop:
        return CancelledState(message=stop.reason)


@task(name="train-reference", retries=1, retry_delay_seconds=2, **_stage)
def train_reference(config: Config, job: tuple[str, bool, float | None, int]) -> dict[str, Any]:
    """One reference model; these run in parallel on the Dask task runner."""
    return stages.train_audit_reference(config, job)


@task(name="audit", **_stage)
def audit(config: Config) -> dict[str, Any]:
    return _stoppable_stage("audit", config)


@task(name="gate", **_stage)
def gate(config: Config) -> dict[str, Any]:
    decision = _stoppable_stage("gate", config)
    if isinstance(decision, State):  # cancelled
        return decision
    create_markdown_artifact(
        key="privacy-report",
        markdown=stages.Layout(config).report.read_text(),
        description="dpml privacy report: guarantee, accountants, audit, release gate",
    )
    return decision


@task(name="register", retries=3, retry_delay_seconds=5, **_stage)
def register(config: Config) -> dict[str, Any]:
    return stages.run_stage("register", config)


@task(name="record-in-dvc", cache_policy=NONE, log_prints=True)
def record_in_dvc(workdir: str = ".") -> str:
    """Record the stage outputs in ``dvc.lock`` (``dvc commit``) so ``dvc repro`` sees them as done.

    Only meaningful when the run used ``params.yaml`` unchanged; the flow skips it otherwise.
    """
    root = Path(workdir)
    if not (root / "dvc.yaml").is_file() or not (root / ".dvc").is_dir():
        return "skipped: not a DVC workspace"
    done = subprocess.run(
        [sys.executable, "-m", "dvc", "commit", "--force", "--quiet"], cwd=root, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"dvc commit failed: {done.stderr.strip() or done.stdout.strip()}")
    return "recorded in dvc.lock"
