"""CSV and Parquet tables: read in chunks, encode each chunk with the declared public schema.

A table is read ``data.chunk_rows`` rows at a time (pandas for CSV, pyarrow batches for Parquet)
and every chunk is encoded on its own (:class:`dpml.data.encoding.TableEncoding`), so the text of
a table larger than memory streams through and only its encoded features are kept. CSV cells are
read as text (``data.missing_values`` decides what is missing; nothing else is guessed); Parquet
cells keep their types and a null is missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from dpml.data.encoding import ColumnEncoding, Counts, EncodingError, TableEncoding, category_codes
from dpml.data.preprocess import PublicTransform, public_transform

if TYPE_CHECKING:
    from dpml.config import Config, DataConfig, PreprocessConfig
    from dpml.data.sources import RawData


def table_encoding(data: DataConfig, preprocess: PreprocessConfig) -> TableEncoding | None:
    """The schema of a tabular source as an encoding (``feature_columns``: all numeric within
    ``preprocess.lower``/``upper``, a missing value an error); None for image and bundled sources."""
    if data.columns is not None:
        columns = []
        for name, column in data.columns.items():
            if column.type == "numeric":
                columns.append(ColumnEncoding(name=name, kind="numeric", lower=column.lower, upper=column.upper,
                                              fill=column.fill, indicator=column.indicator))
            else:
                columns.append(ColumnEncoding(name=name, kind="categorical",
                                              categories=tuple(str(c).strip() for c in column.categories)))
        return TableEncoding(columns=tuple(columns), missing_values=tuple(v.strip() for v in data.missing_values),
                             strict=data.strict)
    if data.feature_columns:
        return TableEncoding(columns=tuple(ColumnEncoding(name=name, kind="numeric", lower=preprocess.lower,
                                                          upper=preprocess.upper) for name in data.feature_columns),
                             missing_values=tuple(v.strip() for v in data.missing_values), strict=data.strict)
    return None


def transform_of(config: Config) -> PublicTransform:
    """The public preprocessing of this configuration: a schema's per-column bounds, else the scalar pair."""
    encoding = table_encoding(config.data, config.preprocess) if config.data.columns is not None else None
    if encoding is None:
        return public_transform(config.preprocess)
    lower, upper = encoding.bounds()
    return public_transform(config.preprocess, lower, upper)


def header(path: Path, kind: str) -> list[str]:
    """The column names of a table, reading no records."""
    from dpml.data.sources import DataError

    try:
        if kind == "csv":
            return [str(c) for c in pd.read_csv(path, nrows=0, dtype=str).columns]
        import pyarrow.parquet as pq

        return [str(c) for c in pq.ParquetFile(path).schema_arrow.names]
    except pd.errors.EmptyDataError:
        raise DataError(f"{path}: the file is empty") from None
    except Exception as error:  # parser errors of either format
        raise DataError(f"{path}: cannot parse as {kind}: {error}") from None


def check_columns(path: Path, kind: str, wanted: list[str], what: str = "column(s)") -> None:
    """Every ``wanted`` column is in the table's header, else a DataError naming the absent ones."""
    from dpml.data.sources import DataError

    present = header(path, kind)
    absent = [c for c in wanted if c not in present]
    if absent:
        raise DataError(f"{path}: {what} {absent} not found; the file has {present}")


def chunks(path: Path, kind: str, columns: list[str], rows: int) -> Iterator[pd.DataFrame]:
    """The table's ``columns``, ``rows`` records at a time (CSV as text, Parquet typed)."""
    from dpml.data.sources import DataError

    try:
        if kind == "csv":
            reader = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[], usecols=columns,
                                 chunksize=rows)
            with reader:
                yield from reader
        else:
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(path).iter_batches(batch_size=rows, columns=columns):
                yield batch.to_pandas()
    except (pd.errors.ParserError, UnicodeDecodeError, OSError) as error:
        raise DataError(f"{path}: cannot parse as {kind}: {' '.join(str(error).split())}") from None


def label_indices(values: pd.Series, classes: list[str], column: str, first_row: int, origin: str) -> np.ndarray:
    """Each label's index in the public ``classes``; a missing or unknown label is an error naming its row."""
    from dpml.data.sources import DataError

    codes, keys = category_codes(values, classes)
    absent = (keys.isna() | (keys == "")).to_numpy()
    if absent.any():
        raise DataError(f"{origin}: row {first_row + int(np.argmax(absent))}, column {column!r}: missing label")
    if (codes < 0).any():
        position = int(np.argmax(codes < 0))
        raise DataError(f"{origin}: row {first_row + position}, column {column!r}: label {values.iloc[position]!r} "
                        f"is not in data.classes {classes}")
    return codes


def unit_ids(values: pd.Series, column: str, first_row: int, origin: str) -> list[Any]:
    """The ids of the privacy units; every row needs one."""
    from dpml.data.sources import DataError

    absent = values.isna().to_numpy() | (values.astype(str).str.strip() == "").to_numpy()
    if absent.any():
        row = first_row + int(np.argmax(absent))
        raise DataError(f"{origin}: row {row}, column {column!r}: missing id; every row needs the id of the "
                        "person it belongs to (data.id_column)")
    return values.tolist()


def load_table(config: DataConfig, preprocess: PreprocessConfig) -> RawData:
    """Read, check and encode a CSV or Parquet table chunk by chunk."""
    from dpml.data.sources import DataError, RawData, check_records

    kind, _, rest = config.source.partition(":")
    path = Path(rest)
    encoding = table_encoding(config, preprocess)
    assert encoding is not None and config.label_column is not None and config.classes is not None
    wanted = config.named_columns()
    check_columns(path, kind, wanted)
    classes = [str(c) for c in config.classes]
    features, labels, ids, counts, start = [], [], [], Counts(), 0
    for frame in chunks(path, kind, wanted, config.chunk_rows):
        try:
            x, chunk_counts = encoding.encode(frame, first_row=start, origin=str(path))
        except EncodingError as error:
            raise DataError(str(error)) from None
        features.append(x)
        labels.append(label_indices(frame[config.label_column], classes, config.label_column, start, str(path)))
        if config.id_column:
            ids += unit_ids(frame[config.id_column], config.id_column, start, str(path))
        counts.add(chunk_counts)
        start += len(frame)
    if start == 0:
        raise DataError(f"{path}: no records")
    x, y = np.concatenate(features), np.concatenate(labels)
    check_records(x, y, len(classes), str(path))
    units = None
    if config.id_column:
        from dpml.privacy.units import digests_of_ids

        units = digests_of_ids(ids)
    return RawData(x=x, y=y, classes=classes, feature_names=encoding.feature_names(), origin=f"{kind}:{path}",
                   units=units, columns=encoding.column_names,
                   slot_counts={"missing": counts.missing, "other": counts.other})
