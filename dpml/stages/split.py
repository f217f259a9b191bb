"""Stage split: a seeded, stratified split into train / test / audit population (index arrays only)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dpml import io
from dpml.data.sources import RawData
from dpml.data.split import split_indices
from dpml.stages.layout import Layout

if TYPE_CHECKING:
    from dpml.config import Config


def split(config: Config) -> dict[str, Any]:
    """Seeded stratified split; stores index arrays (the records stay in ``raw``)."""
    layout = Layout(config)
    arrays, meta = io.read_npz(layout.raw), io.read_json(layout.raw_meta)
    raw = RawData(arrays["x"], arrays["y"], meta["classes"], meta["feature_names"], meta["origin"],
                  arrays.get("x_test"), arrays.get("y_test"))
    parts = split_indices(raw, config.split)
    io.write_npz(layout.split, train=parts.train, test=parts.test, audit=parts.audit,
                 test_is_predefined=np.array(parts.test_is_predefined))
    return {"n_train": int(parts.train.size), "n_test": int(parts.test.size), "n_audit": int(parts.audit.size)}
