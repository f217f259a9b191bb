"""What each stage run recorded about itself: when it started and ended, the parameters it depends on and
its numeric results, one small JSON per stage under ``artifacts/stages/`` (:attr:`Layout.stage_records`).

:func:`dpml.stages.run_stage` writes them (so the DVC stages, the Prefect tasks and ``dpml run --engine
local`` all do), and the register stage turns them into one nested MLflow run per stage: MLflow is
written by registration only, so a run killed earlier leaves no MLflow run behind.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from dpml import io
from dpml.stages.layout import CONTRACT, Layout

if TYPE_CHECKING:
    from dpml.config import Config


def stage_params(config: Config, stage: str) -> dict[str, str]:
    """The configuration values ``stage`` depends on (its ``params`` in the contract), as strings; unset
    values (None) are left out rather than written as ``"None"``."""
    sections = CONTRACT[stage].params
    return {
        key: str(value)
        for key, value in config.flat().items()
        if value is not None and any(key == s or key.startswith(s + ".") for s in sections)
    }


def stage_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The finite numbers among a stage's top-level results (a yes/no as 1 or 0)."""
    numbers = {k: float(v) for k, v in result.items() if isinstance(v, (int, float))}
    return {k: v for k, v in numbers.items() if math.isfinite(v)}


def record_stage(config: Config, stage: str, started: float, ended: float, result: dict[str, Any]) -> None:
    """Write ``stage``'s record: start and end (Unix seconds), its parameters and its metrics."""
    layout = Layout(config)
    layout.stage_records.mkdir(parents=True, exist_ok=True)
    io.write_json(
        layout.stage_records / f"{stage}.json",
        {
            "stage": stage,
            "started": started,
            "ended": ended,
            "params": stage_params(config, stage),
            "metrics": stage_metrics(result),
        },
    )


def stage_records(layout: Layout, stages: list[str]) -> list[dict[str, Any]]:
    """The records of ``stages`` that exist, in pipeline order (outputs made before dpml kept records, or
    restored by DVC from an older run, may have none)."""
    paths = [layout.stage_records / f"{stage}.json" for stage in stages]
    return [io.read_json(path) for path in paths if path.exists()]


_DRIVER: ContextVar[Mapping[str, str]] = ContextVar("dpml_driver_tags", default=MappingProxyType({}))


@contextmanager
def driven_by(tags: dict[str, str]) -> Iterator[None]:
    """Name the driver of the stages run inside the block (the Prefect flow run and the API it reports to:
    ``prefect.flow_run_id``, ``prefect.api_url``); registration tags the MLflow run with them. Set by the
    driver at its edge and scoped to this context, so a later run in the same process is not tagged."""
    token = _DRIVER.set(dict(tags))
    try:
        yield
    finally:
        _DRIVER.reset(token)


def driver_tags() -> dict[str, str]:
    """The tags of the driver running the current stages (:func:`driven_by`); empty outside one."""
    return dict(_DRIVER.get())
