"""Data sources: scikit-learn bundled sets, IDX files, CSV and Parquet (:mod:`dpml.data.tables`).

Every loader returns a :class:`RawData` whose labels are indices into a *public* class list
(the source's metadata, or ``data.classes`` for tabular files) and checks the records: no
empty file, no NaN/inf, no unknown label, at least two classes. Each failure is a
:class:`DataError` naming the file and the row/column at fault.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

from dpml.data.schema import DataConfig
from dpml.sections import PreprocessConfig
from dpml.data.records import DataError, RawData, check_records, content_hash
from dpml.data.source_kinds import SOURCES, load_registered
from dpml.data.tables import load_table

__all__ = [
    "DataError",
    "RawData",
    "check_records",
    "content_hash",
    "load_idx",
    "load_sklearn",
    "load_source",
    "read_idx",
]


def load_sklearn(name: str) -> RawData:
    """A scikit-learn bundled data set (shipped with the package, no download)."""
    import sklearn.datasets as sk  # lazy: scikit-learn's data sets only for the sources that read them

    loader = getattr(sk, f"load_{name}", None)
    if loader is None:
        raise DataError(f"sklearn:{name}: no bundled scikit-learn data set of that name")
    bunch = loader()
    x = np.asarray(bunch.data, dtype=np.float64)
    y = np.asarray(bunch.target, dtype=np.int64)
    names = getattr(bunch, "target_names", None)
    classes = [str(c) for c in (names if names is not None else np.unique(y))]
    features = [str(f) for f in getattr(bunch, "feature_names", [f"x{i}" for i in range(x.shape[1])])]
    origin = f"sklearn:{name}"
    check_records(x, y, len(classes), origin)
    return RawData(x=x, y=y, classes=classes, feature_names=features, origin=origin)


_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (optionally gzipped): magic 0x0000TTNN, NN big-endian dims, then data."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            blob = handle.read()
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(f"{path}: cannot read ({error}): the file is cut short or corrupt; replace it") from None
    if len(blob) < 4 or blob[0] != 0 or blob[1] != 0 or blob[2] not in _IDX_TYPES:
        raise DataError(f"{path}: wrong magic number {blob[:4].hex() or '(empty file)'}; expected 0000TTNN")
    ndim = blob[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(blob) < header:
        raise DataError(f"{path}: truncated header ({len(blob)} bytes, {ndim} dimensions)")
    shape = tuple(int.from_bytes(blob[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_TYPES[blob[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(blob) - header != expected:
        raise DataError(
            f"{path}: truncated or oversized content: header says shape {shape} "
            f"({expected} bytes) but {len(blob) - header} bytes follow"
        )
    return np.frombuffer(blob, dtype=dtype, offset=header).reshape(shape)


def _find_idx(directory: Path, stem: str) -> Path | None:
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _idx_pair(directory: Path, images: str, labels: str) -> tuple[np.ndarray, np.ndarray] | None:
    image_path, label_path = _find_idx(directory, images), _find_idx(directory, labels)
    if image_path is None and label_path is None:
        return None
    if image_path is None or label_path is None:
        raise DataError(f"{directory}: found only one of {images} and {labels}")
    x = read_idx(image_path)
    y = read_idx(label_path)
    if y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise DataError(f"{label_path}: {y.shape} labels do not match {x.shape[0]} images in {image_path}")
    return x.reshape(x.shape[0], -1).astype(np.float64), y.astype(np.int64)


def load_idx(directory: str | Path) -> RawData:
    """MNIST-format IDX files: ``train-images-idx3-ubyte[.gz]`` + labels, and optional ``t10k-*``.

    Labels are the digits 0..9 of the format (the public class list of MNIST-like sets).
    """
    directory = Path(directory)
    train = _idx_pair(directory, "train-images-idx3-ubyte", "train-labels-idx1-ubyte")
    if train is None:
        raise DataError(f"{directory}: no train-images-idx3-ubyte[.gz] / train-labels-idx1-ubyte[.gz]")
    test = _idx_pair(directory, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    classes = [str(i) for i in range(10)]
    origin = f"idx:{directory}"
    check_records(*train, len(classes), f"{origin} (train)")
    if test is not None:
        check_records(*test, len(classes), f"{origin} (t10k)")
    features = [f"px{i}" for i in range(train[0].shape[1])]
    return RawData(
        x=train[0],
        y=train[1],
        classes=classes,
        feature_names=features,
        origin=origin,
        x_test=None if test is None else test[0],
        y_test=None if test is None else test[1],
    )


def load_source(config: DataConfig, preprocess: PreprocessConfig | None = None) -> RawData:
    """Dispatch on the scheme of ``data.source`` (a table is encoded with its declared schema,
    :mod:`dpml.data.tables`; ``preprocess`` gives the shorthand ``feature_columns`` their bounds; a scheme a
    plugin registered, :mod:`dpml.data.source_kinds`)."""
    scheme, _, rest = config.source.partition(":")
    if scheme in SOURCES:
        return load_registered(scheme, rest)
    if scheme == "sklearn":
        return load_sklearn(rest)
    if scheme == "idx":
        return load_idx(rest)
    if not Path(rest).is_file():
        raise DataError(f"{rest}: file does not exist")
    return load_table(config, preprocess or PreprocessConfig())
