"""The registered model: an MLflow pyfunc that takes raw records.

A release is not the bare network (which takes preprocessed tensors) but the network behind the
same public preprocessing the pipeline applied: raw row → schema encoding (:mod:`dpml.data.encoding`,
for a table) → scaling by public bounds, optional feature extractor and input norm clipping
(:class:`dpml.data.preprocess.PublicTransform`) → network → class probabilities. So
``mlflow.pyfunc.load_model("models:/NAME@champion").predict(raw_rows)`` and ``mlflow models serve``
answer on raw rows, and the model can never be fed differently preprocessed inputs by mistake.

What the model holds, all public: the table encoding or the raw feature count, the transform, the
class names, and the network exported with ``torch.export`` (no dpml class is needed to run it). The
pyfunc's code and the two preprocessing modules travel inside the model by value (cloudpickle), so
loading it needs mlflow, torch, numpy and pandas but not dpml (a ScatterNet model also needs dpml
and kymatio, for the extractor). The signature is the schema's columns (numeric: double, categorical:
string; a tokens column: its ids as text, ``"101 7592 102"``; a column with a declared way to be missing is
optional) or the raw feature shape; the output
is a frame with the predicted ``label`` and ``probability(<class>)`` for each class (the softmax of
the network's outputs).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import torch

from dpml.data import encoding as encoding_module
from dpml.data import preprocess as preprocess_module
from dpml.data.encoding import TableEncoding
from dpml.data.preprocess import PublicTransform

NETWORK_FILE = "network.pt2"


class RawRecordClassifier(mlflow.pyfunc.PythonModel):
    """Raw records in, ``label`` and ``probability(<class>)`` out (module docstring)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec

    def load_context(self, context: Any) -> None:
        self._network = torch.export.load(context.artifacts["network"]).module()
        table = self.spec["input"].get("table")
        self._encoding = TableEncoding.from_dict(table) if table is not None else None
        self._transform = PublicTransform.from_dict(self.spec["transform"])

    def features(self, model_input: Any) -> np.ndarray:
        """The network's inputs for raw records: the pipeline's own public preprocessing."""
        if self._encoding is not None:
            frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
            absent = [
                c["name"]
                for c in self.spec["input"]["table"]["columns"]
                if c["name"] not in frame.columns and _optional(c)
            ]
            if absent:  # an optional column left out: missing in every row
                frame = frame.assign(**{name: [None] * len(frame) for name in absent})
            raw, _ = self._encoding.encode(frame, origin="model input")
        else:
            raw = np.asarray(
                model_input.to_numpy() if isinstance(model_input, pd.DataFrame) else model_input, dtype=np.float64
            )
            raw = raw.reshape(raw.shape[0], -1)
            expected = int(self.spec["input"]["n_features"])
            if raw.shape[1] != expected:
                raise ValueError(f"model input: {raw.shape[1]} features per record, the model takes {expected}")
            if not np.isfinite(raw).all():
                raise ValueError("model input: NaN or infinite values")
        return self._transform.apply(raw).x.astype(np.float32)

    def predict(self, context: Any, model_input, params: dict[str, Any] | None = None) -> pd.DataFrame:  # noqa: ANN001
        # model_input (a DataFrame of raw rows, or an array of raw features) has no annotation on purpose:
        # MLflow reads this method's type hints as a second signature, which would contradict ours.
        x = self.features(model_input)
        with torch.no_grad():
            logits = self._network(torch.from_numpy(x)) if len(x) else torch.zeros(0, len(self.spec["classes"]))
            probabilities = torch.softmax(logits.double(), dim=1).numpy()
        classes = self.spec["classes"]
        out = pd.DataFrame({"label": [classes[i] for i in probabilities.argmax(1)] if len(x) else []}, dtype=object)
        for i, name in enumerate(classes):
            out[f"probability({name})"] = probabilities[:, i] if len(x) else []
        return out


def synthetic_example(spec: dict[str, Any]) -> pd.DataFrame | np.ndarray:
    """Two made-up records of the right form (a real one would copy private data into the model):
    each numeric column at its fill (or midpoint), each categorical at its first category."""
    table = spec["input"].get("table")
    if table is None:
        return np.zeros((2, int(spec["input"]["n_features"])), dtype=np.float64)
    row = {}
    for column in table["columns"]:
        if column["kind"] == "numeric":
            fill = column["fill"]
            row[column["name"]] = float(fill if fill is not None else (column["lower"] + column["upper"]) / 2)
        elif column["kind"] == "tokens":  # one padding token
            row[column["name"]] = str(column["pad_id"])
        else:
            row[column["name"]] = str(column["categories"][0])
    return pd.DataFrame([row, row])


def _optional(column: dict[str, Any]) -> bool:
    """A column the model can do without: categorical (a missing value has its slot) or numeric with a fill."""
    return column["kind"] == "categorical" or column["fill"] is not None


def _column_type(column: dict[str, Any], missing_values: list[str]) -> Any:
    """double/string where a raw frame read by pandas holds that type; ``any`` where it may not: a numeric
    column with a missing token such as '?' (read as text), categories that look like numbers (read as such)."""
    from mlflow.types.schema import AnyType  # lazy: MLflow only where a run is recorded

    if column["kind"] == "tokens":  # ids as text; a file whose cells hold one id each is read as numbers
        return AnyType()
    if column["kind"] == "numeric":
        text_tokens = column["fill"] is not None and any(token.strip() for token in missing_values)
        return AnyType() if text_tokens else "double"
    numeric_looking = []
    for category in column["categories"]:
        try:
            float(category)
            numeric_looking.append(category)
        except ValueError:
            pass
    return AnyType() if numeric_looking else "string"


def signature(spec: dict[str, Any]) -> mlflow.models.ModelSignature:
    """Inputs: the schema's columns (or the raw feature shape); outputs: label and probabilities."""
    from mlflow.types.schema import ColSpec, Schema, TensorSpec  # lazy: MLflow only where a run is recorded

    table = spec["input"].get("table")
    if table is None:
        inputs = Schema([TensorSpec(np.dtype(np.float64), (-1, int(spec["input"]["n_features"])))])
    else:
        inputs = Schema(
            [
                ColSpec(_column_type(c, table["missing_values"]), c["name"], required=not _optional(c))
                for c in table["columns"]
            ]
        )
    outputs = Schema([ColSpec("string", "label"), *[ColSpec("double", f"probability({c})") for c in spec["classes"]]])
    return mlflow.models.ModelSignature(inputs=inputs, outputs=outputs)


def export_network(network: torch.nn.Module, n_inputs: int, path: Path) -> None:
    """``torch.export`` the network with a dynamic batch dimension (traced on two zero records)."""
    network = network.to("cpu").eval()
    example = torch.zeros(2, n_inputs)
    program = torch.export.export(network, (example,), dynamic_shapes=({0: torch.export.Dim.AUTO},))
    torch.export.save(program, str(path))


def save_classifier(
    network: torch.nn.Module, n_inputs: int, spec: dict[str, Any], workdir: Path, mlflow_model: Any = None
) -> Path:
    """Save the raw-record pyfunc as an MLflow model folder under ``workdir`` (returned); ``mlflow_model``
    (an ``mlflow.models.Model``) carries the run and logged-model ids it is logged under. Storing it is
    :mod:`dpml.tracking.runs`'s job, against the run's own stores."""
    workdir.mkdir(parents=True, exist_ok=True)
    network_path = workdir / NETWORK_FILE
    export_network(network, n_inputs, network_path)
    import cloudpickle  # lazy: cloudpickle only when a model is packaged

    by_value = [encoding_module, preprocess_module, sys.modules[__name__]]
    for module in by_value:
        cloudpickle.register_pickle_by_value(module)
    folder = workdir / "model"
    try:
        mlflow.pyfunc.save_model(
            path=str(folder),
            python_model=RawRecordClassifier(spec),
            artifacts={"network": str(network_path)},
            signature=signature(spec),
            input_example=synthetic_example(spec),
            mlflow_model=mlflow_model,
            pip_requirements=[
                f"torch=={torch.__version__.split('+')[0]}",
                f"pandas=={pd.__version__}",
                f"numpy=={np.__version__}",
                f"mlflow=={mlflow.__version__}",
                f"cloudpickle=={cloudpickle.__version__}",
            ],
        )
    finally:
        for module in by_value:
            cloudpickle.unregister_pickle_by_value(module)
    for cache in folder.rglob("__pycache__"):  # written when MLflow loads the model to infer its requirements
        shutil.rmtree(cache, ignore_errors=True)
    return folder


def load_network(local: Path, model_uri: str) -> torch.nn.Module:
    """The network inside a downloaded raw-record model folder ``local`` (for a re-audit, which feeds it
    prepared records); ``model_uri`` names it in errors."""
    matches = sorted(Path(local).rglob(NETWORK_FILE))
    if not matches:
        raise ValueError(f"{model_uri}: no {NETWORK_FILE} inside; not a dpml raw-record model")
    return torch.export.load(str(matches[0])).module()
