"""The privacy-audited pipeline as a Prefect flow.

ingest → split → preprocess → train → certify → audit → gate → register, then ``dvc commit``
so DVC's lock file matches what this run produced (when it ran ``params.yaml`` unchanged).
Runs on an ephemeral Prefect API by default, or against a server (``PREFECT_API_URL``); the
scheduled deployment is declared in ``prefect.yaml``.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from dpml.config import load
from tasks import stages as t


@flow(name="privacy_audited_pipeline", log_prints=True)
def privacy_audited_pipeline(params_path: str = "params.yaml", overrides: list[str] | None = None) -> dict[str, Any]:
    """Run every stage for the configuration in ``params_path`` (plus ``overrides``)."""
    config = load(params_path, overrides or [])
    results: dict[str, Any] = {}
    results["ingest"] = t.ingest(config)
    results["split"] = t.split(config)
    results["preprocess"] = t.preprocess(config)
    results["train"] = t.train(config)
    results["certify"] = t.certify(config)
    results["audit"] = t.audit(config)
    results["gate"] = t.gate(config)
    results["register"] = t.register(config)
    if not overrides and params_path == "params.yaml":
        results["dvc"] = t.record_in_dvc()
    return results


if __name__ == "__main__":
    privacy_audited_pipeline()
