"""Stage ingest: load the configured source, check the records, store them with their content hash and
each row's privacy-unit digest (:mod:`dpml.data.units`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dpml import io
from dpml.data.sources import content_hash, load_source
from dpml.data.units import digests_of_rows
from dpml.stages.layout import Layout

if TYPE_CHECKING:
    from dpml.config import Config


def ingest(config: Config) -> dict[str, Any]:
    """Load the configured source, check the records, store them with their content hash."""
    layout = Layout(config)
    raw = load_source(config.data, config.preprocess)
    arrays = {"x": raw.x, "y": raw.y}
    if raw.x_test is not None and raw.y_test is not None:
        arrays |= {"x_test": raw.x_test, "y_test": raw.y_test}
    version = records_version(arrays, raw.units)
    units = raw.units if raw.units is not None else digests_of_rows(raw.x, raw.y)
    io.write_npz(layout.raw, **arrays, units=units)
    meta = {
        "origin": raw.origin,
        "classes": raw.classes,
        "feature_names": raw.feature_names,
        "version": version,
        "n_records": int(raw.x.shape[0]),
        "n_features": int(raw.x.shape[1]),
        "predefined_test": raw.x_test is not None,
        "unit": f"column {config.data.id_column!r}" if config.data.id_column else "row content",
        "n_units": int(np.unique(np.ascontiguousarray(units).view("V16")).size),
    }
    if raw.columns is not None:  # a table: its declared columns, and the cells that went to a slot or a fill
        meta |= {"columns": raw.columns, "slot_counts": raw.slot_counts}
    io.write_json(layout.raw_meta, meta)
    return meta


def records_version(arrays: dict[str, np.ndarray], units: np.ndarray | None) -> str:
    """``data.version``: the content hash of the records (``x``, ``y``, a predefined test split) and,
    when an id column names each row's person, of those ids."""
    return content_hash(
        *(arrays[k] for k in ("x", "y", "x_test", "y_test") if k in arrays), *([units] if units is not None else [])
    )


def stored_records_version(path: Path, by_id_column: bool) -> str:
    """:func:`records_version` of the records the ingest stage stored at ``path``."""
    with np.load(path) as stored:
        arrays = {k: stored[k] for k in stored.files}
    return records_version(arrays, arrays["units"] if by_id_column else None)
