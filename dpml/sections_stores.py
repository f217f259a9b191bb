"""The sections of ``params.yaml`` that say where things are kept: the privacy ledger, the MLflow stores and
the local folders (split from :mod:`dpml.sections`, whose :class:`~dpml.sections.Section` they share)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from dpml.sections import Section


class LedgerConfig(Section):
    """The privacy budget ledger: each person's composed ε over every release that touched them, at ``delta``.

    ``dataset`` names the lineage — one account for the people of a data set, shared by every version
    of it. Left out, the records decide: the lineage that already holds the run's people (a renamed
    file, another encoding, next week's export), else a new one named after ``data.source`` (``adult``
    for ``csv:data/adult.csv``). The same people are never two accounts: a run whose people another
    lineage holds is refused, naming both (``dpml ledger rename`` renames or merges lineages, keeping
    their history; :mod:`dpml.ledger.lineages`). ``epsilon_budget`` is per privacy unit.
    ``on_exhausted``: ``refuse`` a run when any unit of its training data would go over (default), or
    ``exclude`` such units and train without them (an individual Rényi filter, Feldman & Zrnic 2021).
    ``unit_key`` is the secret file that keys the unit ids the ledger stores (default ``<path>.key``,
    created with mode 0600).

    KL-private runs (seed 000) are summed in KL (the chain rule composes adaptively) against
    ``kl_budget`` (``null``: refused). A unit with a KL-only release has no finite (ε, δ), and
    (ε, δ)-DP runs have no KL bound, so the two kinds exclude each other on one unit.

    ``url``: where the ledger lives when it is not the SQLite file ``path`` — ``sqlite:///file`` or a
    PostgreSQL database (``postgresql://user[:password]@host:port/db``) that every worker of a team
    shares; it then needs ``unit_key`` named (the one secret file every worker holds).
    """

    path: str = "ledger.db"
    url: str | None = Field(None, pattern=r"^(sqlite:///|postgresql://|postgres://)\S+$")
    epsilon_budget: float = Field(10.0, gt=0)
    delta: float = Field(1e-5, gt=0, lt=1)
    kl_budget: float | None = Field(None, gt=0)
    dataset: str | None = Field(None, min_length=1, max_length=200)
    on_exhausted: Literal["refuse", "exclude"] = "refuse"
    unit_key: str | None = None

    @model_validator(mode="after")
    def _shared_ledger_needs_its_key(self) -> LedgerConfig:
        if self.url and self.url.startswith(("postgresql://", "postgres://")) and not self.unit_key:
            raise ValueError(
                "ledger.unit_key: a PostgreSQL ledger (ledger.url) is shared by workers; name the unit "
                "key file that every worker holds (the same secret file), e.g. ledger.unit_key: "
                "/secrets/dpml-unit.key"
            )
        return self

    def location(self) -> str:
        """The ledger's database: ``url`` when given, else the SQLite file ``path``."""
        return self.url or self.path


MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"


class TrackingConfig(Section):
    """MLflow: where a run's MLflow run and its model version go.

    ``uri`` (the tracking store), ``registry_uri`` (the model registry; ``null``: the tracking store) and
    ``experiment`` are resolved once, when the configuration is loaded at the edge of a run (the CLI, the
    Prefect flow, a DVC stage), by one precedence: ``--set tracking.KEY=…`` > MLflow's own environment
    variable (``MLFLOW_TRACKING_URI``, ``MLFLOW_REGISTRY_URI``, ``MLFLOW_EXPERIMENT_NAME``) > ``params.yaml``
    > the default (:mod:`dpml.routing`). ``origins`` records where each resolved value came from (set by
    dpml, never by hand); both are logged with the run. Nothing below the edge reads those variables or
    MLflow's process-wide URIs.

    ``model_name``: the registered model the releases become versions of; left out, each data set gets
    its own, ``dpml-<name of data.source>`` (``dpml-census`` for ``csv:data/census.csv``; filled in by
    :func:`dpml.config.validate`, so the logged configuration names it). ``artifact_root`` is where the
    embedded store keeps artifacts; with a tracking server (``http(s)://``) the server's artifact store is
    used instead, so every machine can load what any worker registered."""

    uri: str = Field("sqlite:///mlflow.db", min_length=1)
    registry_uri: str | None = Field(None, min_length=1)
    artifact_root: str = "mlartifacts"
    experiment: str = Field("dpml", min_length=1, max_length=500)
    model_name: str | None = None
    origins: dict[str, str] = Field(default_factory=dict)

    @property
    def registry(self) -> str:
        """The model registry's URI: ``registry_uri``, else the tracking store itself."""
        return self.registry_uri or self.uri

    @model_validator(mode="before")
    @classmethod
    def _renamed_key(cls, value: Any) -> Any:
        if isinstance(value, dict) and "registered_model" in value:
            raise ValueError(f"registered_model = {value['registered_model']!r}: renamed to tracking.model_name")
        return value

    @field_validator("model_name")
    @classmethod
    def _valid_model_name(cls, value: str | None) -> str | None:
        if value is not None and not re.match(MODEL_NAME_PATTERN, value):
            raise ValueError(
                "a registered model name is 1-200 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return value


class PathsConfig(Section):
    """Where stage outputs go (relative paths are relative to the working directory).

    ``metrics``: the folder of the run's summary metrics (``summary.json``), the one stage output kept
    in git so that ``dvc metrics diff`` and ``dvc exp show`` compare commits and experiments; ``null``
    (default): ``metrics`` beside the ``artifacts`` folder.
    """

    data: str = "data"
    artifacts: str = "artifacts"
    cache: str = ".dpml-cache"
    metrics: str | None = None

    def metrics_folder(self) -> str:
        """``metrics``, or the folder ``metrics`` beside ``artifacts`` when it is not set."""
        return self.metrics if self.metrics is not None else str(Path(self.artifacts).parent / "metrics")
