"""Stage split: one row per privacy unit, each unit placed in train / test / audit population by its own
seeded draw (index arrays only; :mod:`dpml.data.split`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dpml import io
from dpml.data.records import RawData
from dpml.data.split import split_indices
from dpml.stages.layout import Layout

if TYPE_CHECKING:
    from dpml.config import Config


def split(config: Config) -> dict[str, Any]:
    """One row per unit, split by each unit's own draw; stores index arrays (the records stay in ``raw``)."""
    layout = Layout(config)
    arrays, meta = io.read_npz(layout.raw), io.read_json(layout.raw_meta)
    raw = RawData(
        arrays["x"],
        arrays["y"],
        meta["classes"],
        meta["feature_names"],
        meta["origin"],
        arrays.get("x_test"),
        arrays.get("y_test"),
    )
    parts = split_indices(raw, arrays["units"], config.split)
    io.write_npz(
        layout.split,
        train=parts.train,
        test=parts.test,
        audit=parts.audit,
        test_is_predefined=np.array(parts.test_is_predefined),
    )
    return {
        "n_train": int(parts.train.size),
        "n_test": int(parts.test.size),
        "n_audit": int(parts.audit.size),
        "rows_dropped_one_per_unit": parts.rows_dropped,
    }
