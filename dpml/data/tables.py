"""CSV and Parquet tables: read in chunks, encode each chunk with the declared public schema.

A table is read ``data.chunk_rows`` rows at a time (pandas for CSV, pyarrow batches for Parquet)
and every chunk is encoded on its own (:class:`dpml.data.encoding.TableEncoding`), so the text of
a table larger than memory streams through and only its encoded features are kept. CSV cells are
read as text (``data.missing_values`` decides what is missing; nothing else is guessed); Parquet
cells keep their types and a null is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from dpml.data import table_files as files
from dpml.data.encoding import ColumnEncoding, Counts, EncodingError, TableEncoding, category_codes
from dpml.data.preprocess import PublicTransform, public_transform
from dpml.data.records import DataError, RawData, check_records
from dpml.data.schema import category_text
from dpml.data.units import digests_of_ids

if TYPE_CHECKING:
    from dpml.config import Config, DataConfig, PreprocessConfig


def table_encoding(data: DataConfig, preprocess: PreprocessConfig) -> TableEncoding | None:
    """The schema of a tabular source as an encoding (``feature_columns``: all numeric within
    ``preprocess.lower``/``upper``, a missing value an error); None for image and bundled sources."""
    if data.columns is not None:
        columns = []
        for name, column in data.columns.items():
            if column.type == "numeric":
                columns.append(
                    ColumnEncoding(
                        name=name,
                        kind="numeric",
                        lower=column.lower,
                        upper=column.upper,
                        fill=column.fill,
                        indicator=column.indicator,
                    )
                )
            elif column.type == "tokens":
                columns.append(
                    ColumnEncoding(
                        name=name,
                        kind="tokens",
                        length=column.length,
                        vocabulary=column.vocabulary,
                        pad_id=column.pad_id,
                    )
                )
            else:
                columns.append(
                    ColumnEncoding(
                        name=name, kind="categorical", categories=tuple(category_text(c) for c in column.categories)
                    )
                )
        return TableEncoding(
            columns=tuple(columns), missing_values=tuple(v.strip() for v in data.missing_values), strict=data.strict
        )
    if data.feature_columns:
        return TableEncoding(
            columns=tuple(
                ColumnEncoding(name=name, kind="numeric", lower=preprocess.lower, upper=preprocess.upper)
                for name in data.feature_columns
            ),
            missing_values=tuple(v.strip() for v in data.missing_values),
            strict=data.strict,
        )
    return None


def transform_of(config: Config) -> PublicTransform:
    """The public preprocessing of this configuration: a schema's per-column bounds, else the scalar pair;
    token ids and their mask pass unchanged."""
    encoding = table_encoding(config.data, config.preprocess) if config.data.columns is not None else None
    if encoding is None:
        return public_transform(config.preprocess)
    lower, upper = encoding.bounds()
    return public_transform(config.preprocess, lower, upper, unchanged=encoding.tokens)


def header(path: Path, kind: str, separator: str = ",", encoding: str = "auto") -> list[str]:
    """The column names of a table as written (duplicates kept), reading no records."""
    return _checked(lambda: files.header(files.TableFile(path, kind, separator, encoding)))


def check_columns(
    path: Path,
    kind: str,
    wanted: list[str],
    what: str = "column(s)",
    separator: str | None = None,
    encoding: str = "auto",
    categories: dict[str, list[str]] | None = None,
) -> dict[str, int]:
    """Each ``wanted`` column's position in the header, else a DataError naming the absent ones (with a
    separator hint), the ones named twice, or a Parquet column that is not one scalar per row
    (:func:`dpml.data.table_files.check_header`). ``separator`` None: any usual separator will do (a
    check made without the configuration; the reader checks again with the declared one)."""
    table = files.TableFile(path, kind, separator, encoding)
    return _checked(lambda: files.check_header(table, wanted, what, categories))


def _checked(step: Callable[[], Any]) -> Any:
    """``step()``, its :class:`~dpml.data.table_files.TableFileError` or parser error as a DataError."""

    try:
        return step()
    except files.TableFileError as error:
        raise DataError(str(error)) from None
    except UnicodeDecodeError as error:
        raise DataError(
            f"not valid text ({error.reason} at byte {error.start}); name the file's encoding with data.encoding"
        ) from None
    except OSError as error:
        raise DataError(f"{error.filename}: cannot read it ({error.strerror or error})") from None


def chunks(
    path: Path, kind: str, columns: list[str], rows: int, separator: str = ",", encoding: str = "auto"
) -> Iterator[pd.DataFrame]:
    """The table's ``columns``, ``rows`` records at a time (CSV as text, Parquet typed). A CSV column named
    twice is read from its first copy (:func:`check_columns` refuses that for the columns a run uses)."""

    table = files.TableFile(path, kind, separator, encoding)
    try:
        if kind == "csv":
            names = files.header(table)
            positions = {name: names.index(name) for name in dict.fromkeys(columns)}
            yield from files.csv_chunks(table, positions, rows, files.detect_encoding(path, encoding))
        else:
            import pyarrow.parquet as pq  # lazy: pyarrow only for Parquet files

            for batch in pq.ParquetFile(path).iter_batches(batch_size=rows, columns=columns):
                yield batch.to_pandas()
    except files.TableFileError as error:
        raise DataError(str(error)) from None
    except (pd.errors.ParserError, UnicodeDecodeError, OSError) as error:
        raise DataError(f"{path}: cannot parse as {kind}: {' '.join(str(error).split())}") from None


def label_indices(values: pd.Series, classes: list[str], column: str, first_row: int, origin: str) -> np.ndarray:
    """Each label's index in the public ``classes``; a missing or unknown label is an error naming its row."""

    codes, keys = category_codes(values, classes)
    absent = (keys.isna() | (keys == "")).to_numpy()
    if absent.any():
        raise DataError(f"{origin}: row {first_row + int(np.argmax(absent))}, column {column!r}: missing label")
    if (codes < 0).any():
        position = int(np.argmax(codes < 0))
        raise DataError(
            f"{origin}: row {first_row + position}, column {column!r}: label {values.iloc[position]!r} "
            f"is not in data.classes {classes}"
        )
    return codes


def unit_ids(values: pd.Series, column: str, first_row: int, origin: str) -> list[Any]:
    """The ids of the privacy units; every row needs one."""

    absent = values.isna().to_numpy() | (values.astype(str).str.strip() == "").to_numpy()
    if absent.any():
        row = first_row + int(np.argmax(absent))
        raise DataError(
            f"{origin}: row {row}, column {column!r}: missing id; every row needs the id of the "
            "person it belongs to (data.id_column)"
        )
    return values.tolist()


def declared_texts(config: DataConfig) -> dict[str, list[str]]:
    """The texts each categorical feature column (and the label) is matched against, by column."""
    texts = {
        name: [category_text(c) for c in column.categories]
        for name, column in (config.columns or {}).items()
        if column.type == "categorical"
    }
    if config.label_column is not None and config.classes is not None:
        texts[config.label_column] = [category_text(c) for c in config.classes]
    return texts


def load_table(config: DataConfig, preprocess: PreprocessConfig) -> RawData:
    """Read, check and encode a CSV or Parquet table chunk by chunk: its shape is checked first
    (:func:`check_columns`: encoding, separator, duplicate names, Parquet types), every cell while it
    is encoded."""

    kind, _, rest = config.source.partition(":")
    path = Path(rest)
    encoding = table_encoding(config, preprocess)
    assert encoding is not None and config.label_column is not None and config.classes is not None
    wanted = config.named_columns()
    check_columns(
        path, kind, wanted, separator=config.separator, encoding=config.encoding, categories=declared_texts(config)
    )
    text_encoding = _checked(lambda: files.detect_encoding(path, config.encoding)) if kind == "csv" else None
    classes = [category_text(c) for c in config.classes]
    features, labels, ids, counts, start = [], [], [], Counts(), 0
    for frame in chunks(path, kind, wanted, config.chunk_rows, config.separator, text_encoding or "auto"):
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
        units = digests_of_ids(ids)
    notes = (
        [f"{path}: not UTF-8; read as {text_encoding} (data.encoding: auto)"]
        if (config.encoding == "auto" and text_encoding in ("cp1252", "latin-1"))
        else []
    )
    return RawData(
        x=x,
        y=y,
        classes=classes,
        feature_names=encoding.feature_names(),
        origin=f"{kind}:{path}",
        units=units,
        columns=encoding.column_names,
        notes=notes,
        slot_counts={"missing": counts.missing, "other": counts.other},
    )
