"""The experiment's review view: a shared view of the runs list (the UI's ``viewStateShareKey``) with the
release's headline columns, stored on the experiment and opened by :func:`review_url`."""

from __future__ import annotations

import json

from mlflow import MlflowClient

REVIEW_VIEW = "dpml-review"  # the runs list with the release's headline columns (:func:`review_url`)
REVIEW_COLUMNS = ["attributes.`Dataset`", "attributes.`Duration`", "attributes.`Models`", "metrics.`test_accuracy`",
                  "tags.`dp.epsilon`", "metrics.`delta`", "metrics.`audit.max_epsilon_lower_bound`", "tags.`gate.passed`"]


def save_review_view(client: MlflowClient, experiment_id: str) -> None:
    """Store the review view as a shared view of the experiment (the UI's ``viewStateShareKey``): the runs
    list with the data set, duration, model, test accuracy, certified ε, δ, the largest empirical ε lower
    bound and the gate as columns. A reviewer opens :func:`review_url` and may keep it as their own view."""
    client.set_experiment_tag(experiment_id, f"mlflow.sharedViewState.{REVIEW_VIEW}",
                              json.dumps({"selectedColumns": REVIEW_COLUMNS}))


def review_url(experiment_id: str, ui: str = "") -> str:
    """The experiment's runs list in the review view, under the UI at ``ui`` (e.g. ``http://127.0.0.1:5000``)."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs?viewStateShareKey={REVIEW_VIEW}"
