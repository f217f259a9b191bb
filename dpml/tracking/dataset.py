"""The training data set as MLflow shows it: a source MLflow records but cannot load (dpml loads the data)."""

from __future__ import annotations

from typing import Any

from mlflow.data.dataset_source import DatasetSource
from mlflow.data.meta_dataset import MetaDataset


class DataSource(DatasetSource):
    """Where the training data came from: ``data.source`` (``sklearn:digits``, ``csv:PATH``, ``idx:DIR``…)
    and its full content version. Recorded for people and lineage; MLflow cannot load it."""

    def __init__(self, uri: str, version: str) -> None:
        self.uri, self.version = uri, version

    @staticmethod
    def _get_source_type() -> str:
        return "dpml"

    def load(self, **kwargs: Any) -> Any:
        raise NotImplementedError("load the data with dpml (data.source), not through MLflow")

    @staticmethod
    def _can_resolve(raw_source: Any) -> bool:
        return False

    @classmethod
    def _resolve(cls, raw_source: Any) -> DataSource:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return {"uri": self.uri, "version": self.version}

    @classmethod
    def from_dict(cls, source_dict: dict[Any, Any]) -> DataSource:
        return cls(source_dict["uri"], source_dict["version"])


def training_dataset(name: str, source: str, version: str) -> MetaDataset:
    """The training data set as MLflow shows it (the runs list's Dataset column): its name, its content
    version as the digest (MLflow keeps 36 characters of it; the source holds it whole) and its source."""
    return MetaDataset(DataSource(source, version), name=name, digest=version[:36])
