"""Where a run writes, decided once at the edge: MLflow's tracking store, model registry and experiment.

A run's destinations come from one precedence, applied when the configuration is loaded by the
process that starts the run (the CLI, the Prefect flow, a DVC stage) and never again below it:

    --set tracking.KEY=…   >   MLflow's environment variable   >   params.yaml   >   the default

================================  ==========================  =========================
params key                        environment variable        default
================================  ==========================  =========================
``tracking.uri``                  ``MLFLOW_TRACKING_URI``     ``sqlite:///mlflow.db``
``tracking.registry_uri``         ``MLFLOW_REGISTRY_URI``     the tracking store
``tracking.experiment``           ``MLFLOW_EXPERIMENT_NAME``  ``dpml``
================================  ==========================  =========================

The resolved values live in the configuration (``tracking.*``, with ``tracking.origins`` saying where
each came from), which every stage, task and worker receives; they are logged with the MLflow run and
printed in the run's summary. Every MLflow call below the edge names its store explicitly
(:func:`dpml.tracking.store.client`): nothing reads these variables or MLflow's process-wide URIs
(``mlflow.set_tracking_uri``), and nothing writes them, so a second run in the same process with
another setting goes where its own configuration says.

Variables that would send part of a run elsewhere and that dpml cannot honour for a whole run are
refused, naming the variable: ``MLFLOW_EXPERIMENT_ID`` (dpml names its experiment) and
``MLFLOW_RUN_ID`` (dpml opens one MLflow run per pipeline run).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

ROUTES: dict[str, str] = {
    "uri": "MLFLOW_TRACKING_URI",
    "registry_uri": "MLFLOW_REGISTRY_URI",
    "experiment": "MLFLOW_EXPERIMENT_NAME",
}
"""``tracking.KEY`` → the MLflow environment variable that sets it (below a flag, above params.yaml)."""

REFUSED: dict[str, str] = {
    "MLFLOW_EXPERIMENT_ID": "dpml logs into the experiment it names (tracking.experiment); set "
    "MLFLOW_EXPERIMENT_NAME or --set tracking.experiment=NAME instead, and unset it",
    "MLFLOW_RUN_ID": "dpml opens one MLflow run per pipeline run and cannot log into an existing one; unset it",
}
"""MLflow variables that would route part of a run elsewhere and that dpml refuses rather than ignores."""


class RoutingError(ValueError):
    """An environment variable that would send part of a run where dpml cannot follow."""


def _set(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name, "")
    return value.strip() or None


def refuse_unfollowable(environ: Mapping[str, str]) -> None:
    """Raise :class:`RoutingError` for the first variable of :data:`REFUSED` that is set."""
    for name, why in REFUSED.items():
        if _set(environ, name) is not None:
            raise RoutingError(f"{name} = {environ[name]!r}: {why}")


def override_keys(overrides: list[str]) -> set[str]:
    """The ``section.key`` names that ``--set section.key=value`` flags set."""
    return {item.partition("=")[0].strip() for item in overrides if "=" in item}


def resolve_tracking(
    raw: dict[str, Any], overrides: list[str], environ: Mapping[str, str], origin: str
) -> dict[str, Any]:
    """``raw`` (a params mapping, before its ``--set`` overrides are applied) with ``tracking.uri``,
    ``registry_uri`` and ``experiment`` taken from the environment where no flag sets them, and
    ``tracking.origins`` naming where each resolved value comes from (module docstring).

    ``origins`` is dpml's record; a file or a flag that sets it is refused (a ``RoutingError``)."""
    refuse_unfollowable(environ)
    flagged = override_keys(overrides)
    if "tracking.origins" in flagged:
        raise RoutingError("tracking.origins: recorded by dpml when it resolves where a run writes; not a parameter")
    resolved = copy.deepcopy(raw)
    tracking = resolved.get("tracking")
    if tracking is None:
        tracking = resolved["tracking"] = {}
    if not isinstance(tracking, dict):
        return resolved  # validation names the malformed section
    if "origins" in tracking:
        raise RoutingError(
            f"tracking.origins ({origin}): recorded by dpml when it resolves where a run writes; "
            "not a parameter — remove it"
        )
    origins: dict[str, str] = {}
    for key, variable in ROUTES.items():
        from_environment = _set(environ, variable)
        if f"tracking.{key}" in flagged:
            origins[key] = f"--set tracking.{key}"
        elif from_environment is not None:
            tracking[key] = from_environment
            origins[key] = f"environment {variable}"
        elif tracking.get(key) is not None:
            origins[key] = f"{origin} tracking.{key}"
        else:
            origins[key] = "default"
    tracking["origins"] = origins
    return resolved


def resolve_api_tracking(
    tracking_uri: str | None, experiment: str | None, environ: Mapping[str, str]
) -> tuple[str | None, str]:
    """``dpml.train_private``'s MLflow destination: (tracking URI, experiment), each from its argument,
    else MLflow's environment variable (else the experiment ``dpml``); no URI anywhere means the run is
    not logged (None). The API logs a run and registers no model, so no registry is resolved."""
    refuse_unfollowable(environ)
    uri = tracking_uri or _set(environ, ROUTES["uri"])
    return uri, experiment or _set(environ, ROUTES["experiment"]) or "dpml"


def describe(tracking: Any) -> list[tuple[str, str, str]]:
    """(what, value, where it came from) for the summary: the tracking store, the registry, the experiment."""
    origins = getattr(tracking, "origins", {}) or {}
    registry = tracking.registry_uri or f"{tracking.uri}"
    registry_origin = origins.get("registry_uri", "default")
    if tracking.registry_uri is None:
        registry_origin = "the tracking store"
    return [
        ("tracking store", tracking.uri, origins.get("uri", "default")),
        ("model registry", registry, registry_origin),
        ("experiment", tracking.experiment, origins.get("experiment", "default")),
    ]
