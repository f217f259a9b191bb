"""Stage preprocess: public scaling (a table's per-column bounds), optional ScatterNet features and input
norm clipping of every part (:class:`dpml.data.preprocess.PublicTransform`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dpml import io
from dpml.data.tables import transform_of
from dpml.stages.layout import PARTS, Layout

if TYPE_CHECKING:
    from dpml.config import Config


def preprocess(config: Config) -> dict[str, Any]:
    """Public scaling, optional ScatterNet features and input norm clipping of every part."""
    layout = Layout(config)
    arrays, meta, index = io.read_npz(layout.raw), io.read_json(layout.raw_meta), io.read_npz(layout.split)
    sources = {
        "train": ("x", "y"),
        "audit": ("x", "y"),
        "test": ("x_test", "y_test") if bool(index["test_is_predefined"]) else ("x", "y"),
    }
    summary: dict[str, Any] = {
        "data_version": meta["version"],
        "origin": meta["origin"],
        "classes": meta["classes"],
        "n_features": meta["n_features"],
    }
    transform = transform_of(config)
    for part in PARTS:
        xs, ys = sources[part]
        rows = index[part]
        prepared = transform.apply(arrays[xs][rows])
        units = {"units": arrays["units"][rows]} if part == "train" else {}  # whom the trainer's records belong to
        io.write_npz(
            layout.prepared[part], x=prepared.x.astype(np.float32), y=arrays[ys][rows].astype(np.int64), **units
        )
        summary[f"n_{part}"] = int(rows.size)
        summary[f"clipped_fraction_{part}"] = prepared.clipped_fraction
        summary["n_features"] = int(prepared.x.shape[1])  # the model's inputs (after any feature extractor)
    summary["features"] = config.preprocess.features
    io.write_json(layout.prepared_meta, summary)
    return summary
