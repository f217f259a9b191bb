"""``dpml audit --model``: re-audit a registered model version with the data it was trained on."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpml import io
from dpml.audit.plots import plot_roc
from dpml.audit.run import run_audit
from dpml.config import validate
from dpml.stages.audit import audit_context, audit_detail_metrics
from dpml.stages.ingest import ingest
from dpml.stages.layout import Layout
from dpml.stages.preprocess import preprocess
from dpml.stages.split import split

if TYPE_CHECKING:
    from dpml.config import TrackingConfig


def audit_registered_model(model_uri: str, tracking: TrackingConfig, workdir: Path) -> dict[str, Any]:
    """Re-audit a registered version with the data it was trained on (``dpml audit --model``).

    Rebuilds the data stages from the run's logged configuration into ``workdir``, refuses when the
    data's content hash differs from the version's ``data.version`` tag, then runs the audit with the
    certified mechanism's σ and logs the result as a new MLflow run linked from the version.
    """
    from dpml.tracking import runs as mlflow_tracking  # lazy: MLflow only where a run is recorded
    from dpml.tracking.registered import load_run_json, resolve_model  # lazy: MLflow only where a run is recorded

    registered = resolve_model(model_uri, tracking)
    logged = validate(registered["config"], origin=f"config.json of run {registered['run_id']}")
    paths = {"data": str(workdir / "data"), "artifacts": str(workdir / "artifacts"), "cache": logged.paths.cache}
    config = logged.model_copy(update={"paths": logged.paths.model_copy(update=paths), "tracking": tracking})
    version = ingest(config)["version"]
    if version != registered["tags"].get("data.version"):
        raise ValueError(
            f"the data at {config.data.source} (version {version[:12]}…) is not the data "
            f"{model_uri} was trained on (data.version {registered['tags'].get('data.version', '?')[:12]}…)"
        )
    split(config)
    preprocess(config)
    layout = Layout(config)
    mechanism = load_run_json(tracking, registered["run_id"], "mechanism.json")
    io.write_json(layout.mechanism, mechanism)
    context = audit_context(config)
    certificate = load_run_json(tracking, registered["run_id"], "certificate.json")  # the exact ε, not the tag's text
    certified = float(certificate["epsilon"]) if certificate else float("inf")
    summary, raw, pictures = run_audit(
        config,
        registered["model"],
        context.noise_multiplier,
        context.records,
        *context.train,
        *context.audit,
        context.n_classes,
        context.data_version,
        certified_epsilon=certified,
        mechanism=mechanism,
    )
    plot_roc(pictures["target"][0], layout.roc_png, f"re-audit of {registered['name']} v{registered['version']}")
    io.write_json(layout.audit, summary)
    io.write_json(layout.scores, raw)
    metrics = audit_detail_metrics(summary) | {"audit.max_epsilon_lower_bound": summary["max_lower_bound"]}
    run_id = mlflow_tracking.log_audit(tracking, registered, metrics, [layout.audit, layout.scores, layout.roc_png])
    conforms = summary["conformance"]["passed"] is not False
    return {
        "model": f"{registered['name']}/{registered['version']}",
        "audit_run_id": run_id,
        "audit": summary,
        "certified_epsilon": certified,
        "conforms": conforms,
        "consistent": summary["max_lower_bound"] <= certified and conforms,
    }
