"""The experiment's review view: a shared view of the runs list (the UI's ``viewStateShareKey``) with the
release's headline columns, stored on the experiment and opened by :func:`review_url`."""

from __future__ import annotations

import json

from mlflow import MlflowClient

REVIEW_VIEW = "dpml-review"  # the runs list with the release's headline columns (:func:`review_url`)
# What a reviewer decides from, all inside a 1600-pixel window (tests/test_review_desk.py measures it in a real
# browser): the certified ε and δ as sortable metrics, the accuracy, the largest empirical lower bound and the
# three parts of the verdict in words. MLflow draws the run's name, date and duration before them.
REVIEW_COLUMNS = [
    "metrics.`epsilon`",
    "metrics.`delta`",
    "metrics.`test_accuracy`",
    "metrics.`audit.max_epsilon_lower_bound`",
    "tags.`verdict.certificate`",
    "tags.`verdict.implementation`",
    "tags.`verdict.attacks`",
]


def save_review_view(client: MlflowClient, experiment_id: str) -> None:
    """Store the review view as a shared view of the experiment (the UI's ``viewStateShareKey``): the runs
    list with :data:`REVIEW_COLUMNS` as its columns. A reviewer opens :func:`review_url` and may keep it as their
    own view."""
    client.set_experiment_tag(
        experiment_id, f"mlflow.sharedViewState.{REVIEW_VIEW}", json.dumps({"selectedColumns": REVIEW_COLUMNS})
    )


def review_url(experiment_id: str, ui: str = "") -> str:
    """The experiment's runs list in the review view, under the UI at ``ui`` (e.g. ``http://127.0.0.1:5000``)."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs?viewStateShareKey={REVIEW_VIEW}"
