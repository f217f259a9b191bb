"""An example data source: records in a NumPy .npz file, data.source: npz:PATH."""

from pathlib import Path

import numpy as np

from dpml.data.records import DataError, RawData
from dpml.data.source_kinds import SourceKind, register_source


def check(rest: str) -> str | None:
    """Run when the configuration is validated, before any work."""
    return None if Path(rest).is_file() else f"file {rest} does not exist"


def load(rest: str) -> RawData:
    """Arrays x (n, …), y (n,) label indices and classes, the public class list shipped with the data."""
    with np.load(rest, allow_pickle=False) as arrays:
        missing = [name for name in ("x", "y", "classes") if name not in arrays.files]
        if missing:
            raise DataError(f"{rest}: no array {missing[0]!r} (an npz source holds x, y and classes)")
        x, y, classes = arrays["x"], arrays["y"], arrays["classes"]
    x = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    return RawData(
        x=x,
        y=np.asarray(y, dtype=np.int64),
        classes=[str(c) for c in classes],
        feature_names=[f"x{i}" for i in range(x.shape[1])],
        origin=f"npz:{rest}",
    )


register_source(SourceKind("npz", load, check))
