"""What every data source returns and checks: the loaded records (:class:`RawData`), the checks that
refuse malformed ones (:func:`check_records`) and the error that names the file and row at fault
(:class:`DataError`). The loaders (:mod:`dpml.data.sources`, :mod:`dpml.data.tables`) sit above it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np


class DataError(ValueError):
    """Malformed input data; the message names the file, the row/column and the reason."""


@dataclass(frozen=True)
class RawData:
    """Records as loaded: ``x`` (n, d) float64, ``y`` (n,) int64 indices into ``classes``.

    ``x_test``/``y_test`` hold a test part predefined by the source (IDX ``t10k``), else None.
    ``units`` holds each row's privacy-unit digest when the source names an id column
    (:mod:`dpml.data.units`); None: every row is its own unit, identified by its content.
    A table's ``columns`` are its declared feature columns (``feature_names`` the encoded features)
    and ``slot_counts`` how many cells went to a ``<missing>``/``<other>`` slot or a fill, per column.
    """

    x: np.ndarray
    y: np.ndarray
    classes: list[str]
    feature_names: list[str]
    origin: str
    x_test: np.ndarray | None = None
    y_test: np.ndarray | None = None
    notes: list[str] = field(default_factory=list)
    units: np.ndarray | None = None
    columns: list[str] | None = None
    slot_counts: dict[str, dict[str, int]] | None = None


def content_hash(*arrays: np.ndarray) -> str:
    """SHA-256 over dtype, shape and bytes of each array: the data version recorded with runs."""
    digest = hashlib.sha256()
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(str(array.dtype).encode())
        digest.update(str(array.shape).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def check_records(x: np.ndarray, y: np.ndarray, n_classes: int, origin: str) -> None:
    """Reject empty data, NaN/inf features, labels outside the class list, a single class."""
    if x.ndim != 2:
        raise DataError(f"{origin}: features must be a 2-D table, got shape {x.shape}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise DataError(f"{origin}: no records (shape {x.shape})")
    if y.shape != (x.shape[0],):
        raise DataError(f"{origin}: {x.shape[0]} feature rows but labels of shape {y.shape}")
    bad = ~np.isfinite(x)
    if bad.any():
        row, col = (int(v) for v in np.argwhere(bad)[0])
        raise DataError(
            f"{origin}: row {row}, column {col}: value {x[row, col]} is not finite "
            f"({int(bad.sum())} non-finite values in all)"
        )
    out_of_range = (y < 0) | (y >= n_classes)
    if out_of_range.any():
        row = int(np.argmax(out_of_range))
        raise DataError(f"{origin}: row {row}: label index {y[row]} is not one of the {n_classes} classes")
    present = np.unique(y)
    if present.size < 2:
        raise DataError(f"{origin}: only one class present ({present.tolist()}); a classifier needs at least two")
