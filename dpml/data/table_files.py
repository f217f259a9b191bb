"""Reading a table file's shape before its records: encoding, separator, header, column types.

A table must not mislead: every check here runs on the header (and, for a CSV file's encoding, on
its bytes) before any record is encoded, so a refusal comes before the ledger reserves anything.

- **Encoding** (CSV; ``data.encoding``, default ``auto``): a byte-order mark decides (UTF-8, UTF-16,
  UTF-32); otherwise a file that is valid UTF-8 is UTF-8, and one that is not is Windows-1252 (or
  Latin-1 where Windows-1252 leaves a byte undefined) — the two single-byte encodings a file that is not
  UTF-8 almost always is. A file that is UTF-8 at first and then not (two encodings pasted together) is
  refused, naming where. NUL bytes mean a binary file: refused, with a hint when it is Parquet.
  Line endings (LF, CRLF, CR) and the mark change nothing: the same records are the same people.
- **Separator** (CSV; ``data.separator``): a header that does not hold the declared columns but would
  with ``;``, tab, ``|`` or ``,`` is refused with that hint.
- **Duplicate names**: a column the configuration names (label, feature, id) that appears twice in
  the header is refused, naming it and its positions: which copy is meant is ambiguous (pandas would
  quietly read the first and rename the second ``NAME.1``).
- **Types** (Parquet): a named column must hold one scalar per row; a list, struct, map or other
  nested type is refused with its type, as are dates, times and bytes as features or labels. A
  boolean column's cells read ``True``/``False``; its declared categories (or classes) must say so.
"""

from __future__ import annotations

import codecs
import csv
import io
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from dpml.data.schema import SEPARATORS

SCAN_BYTES = 1 << 20  # bytes decoded at a time when checking a CSV file's encoding
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


class TableFileError(ValueError):
    """A table file whose shape would mislead; the message names the file and what to change."""


@dataclass(frozen=True)
class TableFile:
    """A table on disk and how it is read: ``kind`` csv or parquet; a CSV file's ``separator`` (None:
    not declared, so any of the usual ones is accepted by :func:`check_header`) and ``encoding``."""

    path: Path
    kind: str
    separator: str | None = ","
    encoding: str = "auto"


# ------------------------------------------------------------------------------------------- encoding


def detect_encoding(path: Path, declared: str = "auto", whole: bool = True) -> str:
    """The codec a CSV file is read with: ``declared``, or (``auto``) what its bytes say (module
    docstring). ``whole``: scan the whole file (ingest), else only its first megabyte (a header)."""
    with open(path, "rb") as handle:
        head = handle.read(SCAN_BYTES)
        if declared != "auto":
            utf8 = codecs.lookup(declared).name == "utf-8"
            return "utf-8-sig" if utf8 and head.startswith(codecs.BOM_UTF8) else declared
        for mark, codec in _BOMS:
            if head.startswith(mark):
                return codec
        _refuse_binary(path, head)
        decoder = codecs.getincrementaldecoder("utf-8")()
        block, offset, seen_multibyte = head, 0, False
        while block:
            try:
                decoder.decode(block, final=False)
            except UnicodeDecodeError as error:
                return _not_utf8(path, offset + error.start, seen_multibyte or not block[: error.start].isascii())
            seen_multibyte = seen_multibyte or not block.isascii()
            offset += len(block)
            block = handle.read(SCAN_BYTES) if whole else b""
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            if whole:  # the file ends inside a UTF-8 sequence: not UTF-8
                return _not_utf8(path, offset - 1, seen_multibyte)
    return "utf-8"


def _refuse_binary(path: Path, head: bytes) -> None:
    if b"\x00" not in head:
        return
    hint = " It is a Parquet file: use data.source: parquet:" + str(path) if head.startswith(b"PAR1") else ""
    raise TableFileError(f"{path}: not a text file (it holds NUL bytes), so not CSV.{hint}")


def _not_utf8(path: Path, offset: int, mixed: bool) -> str:
    """A file that is not UTF-8: Windows-1252 if every byte is defined there, else Latin-1; refused when
    UTF-8's multi-byte characters came before the first invalid byte (two encodings in one file)."""
    if mixed:
        raise TableFileError(
            f"{path}: the file mixes encodings: valid UTF-8 (with non-ASCII characters) up to byte "
            f"{offset}, then a byte that is not UTF-8; re-export it in one encoding, or name one "
            "with data.encoding (e.g. utf-8, cp1252)"
        )
    decoder = codecs.getincrementaldecoder("cp1252")()
    with open(path, "rb") as handle:
        try:
            while block := handle.read(SCAN_BYTES):
                decoder.decode(block)
        except UnicodeDecodeError:
            return "latin-1"
    return "cp1252"


# ------------------------------------------------------------------------------------------- header


def header(table: TableFile) -> list[str]:
    """The column names of a table as written (duplicates kept), reading no records."""
    if table.kind == "parquet":
        return [field.name for field in _parquet_schema(table.path)]
    names = _csv_header(table, table.separator or ",")
    if names is None:
        raise TableFileError(f"{table.path}: the file is empty")
    return names


def _csv_header(table: TableFile, separator: str) -> list[str] | None:
    """The first row of a CSV file, split at ``separator`` (quotes respected); None for an empty file."""
    encoding = detect_encoding(table.path, table.encoding, whole=False)
    try:
        with open(table.path, encoding=encoding, newline="") as handle:
            first = _first_record(handle)
    except UnicodeDecodeError as error:
        raise TableFileError(
            f"{table.path}: the header is not {encoding} text ({error.reason} at byte "
            f"{error.start}); name the file's encoding with data.encoding (e.g. cp1252, "
            "latin-1, utf-16)"
        ) from None
    if first is None:
        return None
    return next(csv.reader(io.StringIO(first), delimiter=separator), [])


def _first_record(handle: io.TextIOBase) -> str | None:
    """The text of the first non-blank line (enough for a header; a quoted name spanning lines is kept
    whole by reading on while quotes are unbalanced)."""
    text = ""
    for line in handle:
        if not text and not line.strip():
            continue
        text += line
        if text.count('"') % 2 == 0:
            return text
    return text or None


def _parquet_schema(path: Path) -> list[object]:
    import pyarrow.parquet as pq  # lazy: pyarrow only for Parquet files

    try:
        return list(pq.ParquetFile(path).schema_arrow)
    except Exception as error:  # noqa: BLE001 - pyarrow's errors for a file that is not Parquet
        hint = ""
        with open(path, "rb") as handle:
            start = handle.read(4096)
        if start and b"\x00" not in start:
            hint = f"; it looks like text (CSV?): use data.source: csv:{path}"
        raise TableFileError(f"{path}: cannot parse as parquet: {error}{hint}") from None


# ------------------------------------------------------------------------------------------- checks


def check_header(
    table: TableFile, wanted: list[str], what: str = "column(s)", categories: dict[str, list[str]] | None = None
) -> dict[str, int]:
    """Each ``wanted`` column's position in the header, or :class:`TableFileError`: a column absent (with
    a separator hint), named twice, or (Parquet) of a type that is not one scalar per row.
    ``categories``: the declared texts of categorical columns (and the label's classes), checked
    against a Parquet boolean column's ``True``/``False``. A table with ``separator`` None accepts the
    first usual separator that finds every column (a check that does not know the configuration)."""
    if table.kind == "csv" and table.separator is None:
        return _any_separator(table, wanted, what)
    names = header(table)
    absent = [name for name in wanted if name not in names]
    if absent:
        raise TableFileError(
            f"{table.path}: {what} {absent} not found; the file has {names}"
            + (_separator_hint(table, names, wanted) or _spelling_hint(names, absent))
        )
    repeated = {name: [i for i, n in enumerate(names) if n == name] for name in wanted if names.count(name) > 1}
    if repeated:
        where = "; ".join(f"{name!r} at columns {', '.join(str(i + 1) for i in at)}" for name, at in repeated.items())
        raise TableFileError(
            f"{table.path}: the file has the column(s) {sorted(repeated)} more than once ({where}); "
            "which copy is meant is ambiguous: rename or drop the extra copies"
        )
    if table.kind == "parquet":
        _check_parquet_types(table.path, wanted, categories or {})
    return {name: names.index(name) for name in wanted}


def _any_separator(table: TableFile, wanted: list[str], what: str) -> dict[str, int]:
    """:func:`check_header` for a caller that does not know the separator: the first of ``,`` and the
    usual others that finds every column decides; the reader with the declared one checks again."""
    first_error: TableFileError | None = None
    for separator in SEPARATORS:
        try:
            return check_header(TableFile(table.path, "csv", separator, table.encoding), wanted, what)
        except TableFileError as error:
            first_error = first_error or error
    assert first_error is not None
    raise first_error


def _separator_hint(table: TableFile, names: list[str], wanted: list[str]) -> str:
    """``; its header looks ';'-separated: set data.separator: ';'`` when another usual separator splits
    the header into the declared columns (or a one-column header holds one)."""
    if table.kind != "csv":
        return ""
    for separator, name in SEPARATORS.items():
        if separator == table.separator:
            continue
        split = _csv_header(table, separator) or []
        fits = all(w in split for w in wanted)
        if fits or (len(names) == 1 and len(split) > 1):
            spelled = '"\\t"' if separator == "\t" else f"'{separator}'"
            return (
                f". Its header looks {name}-separated ({len(split)} columns with {spelled}): set "
                f"data.separator: {spelled}"
            )
    return ""


def _spelling_hint(names: list[str], absent: list[str]) -> str:
    """``. Did you mean 'Age ' for 'age'?`` when a header name differs from a declared one only by case or
    surrounding spaces (names are compared exactly: a table's names are what it says)."""
    close = {want: name for want in absent for name in names if name.strip().casefold() == want.strip().casefold()}
    if not close:
        return ""
    return ". Did you mean " + ", ".join(f"{name!r} for {want!r}" for want, name in close.items()) + "?"


_SCALAR_TYPES = (
    "is_integer",
    "is_floating",
    "is_boolean",
    "is_string",
    "is_large_string",
    "is_decimal",
    "is_null",
    "is_dictionary",
)
_NESTED_TYPES = (
    "is_list",
    "is_large_list",
    "is_fixed_size_list",
    "is_struct",
    "is_map",
    "is_union",
    "is_list_view",
    "is_large_list_view",
)


def _check_parquet_types(path: Path, wanted: list[str], categories: dict[str, list[str]]) -> None:
    """Every named Parquet column holds one scalar per row (module docstring)."""
    import pyarrow.types as pt  # lazy: pyarrow only for Parquet files

    fields = {field.name: field for field in _parquet_schema(path)}  # type: ignore[attr-defined]
    for name in wanted:
        kind = fields[name].type
        if any(getattr(pt, test, lambda _t: False)(kind) for test in _NESTED_TYPES):
            raise TableFileError(
                f"{path}: column {name!r} is {kind} in the Parquet file, a nested type (several "
                "values per row); each named column must hold one value per row: flatten it (one "
                "column per value) or store it as text"
            )
        if name in categories and not any(getattr(pt, test)(kind) for test in _SCALAR_TYPES):
            raise TableFileError(
                f"{path}: column {name!r} is {kind} in the Parquet file; a feature or label is a "
                "number, a boolean or a text (store it as one of them)"
            )
        if name in categories and pt.is_boolean(kind) and not {"True", "False"} <= set(categories[name]):
            raise TableFileError(
                f"{path}: column {name!r} is boolean in the Parquet file, so its cells read True and "
                f'False; declare them as its categories (or classes): ["True", "False"] '
                f"(declared: {categories[name]})"
            )


# ------------------------------------------------------------------------------------------- records


def csv_chunks(table: TableFile, positions: dict[str, int], rows: int, encoding: str) -> Iterator[pd.DataFrame]:
    """The CSV file's named columns, ``rows`` records at a time, as text; every field of every row is
    parsed (a row with more fields than the header is an error: an unquoted separator inside a value)."""
    separator = table.separator or ","
    with warnings.catch_warnings():
        # pandas warns, and drops or shifts fields, when the rows have more fields than the header
        warnings.simplefilter("error", pd.errors.ParserWarning)
        try:
            reader = pd.read_csv(
                table.path,
                sep=separator,
                encoding=encoding,
                dtype=str,
                keep_default_na=False,
                na_values=[],
                chunksize=rows,
                header=0,
                index_col=False,
            )
            with reader:
                for frame in reader:
                    picked = frame.iloc[:, list(positions.values())]
                    picked.columns = list(positions)
                    yield picked
        except (pd.errors.ParserError, pd.errors.ParserWarning) as error:
            text = " ".join(str(error).split())
            hint = (
                " (a row with more fields than the header: a value holding the separator must be quoted)"
                if "Expected" in text or "does not match" in text
                else ""
            )
            raise TableFileError(f"{table.path}: cannot parse as csv: {text}{hint}") from None
        except UnicodeDecodeError as error:
            raise TableFileError(
                f"{table.path}: not {encoding} text ({error.reason} at byte {error.start}); name the "
                "file's encoding with data.encoding (e.g. cp1252, latin-1, utf-16)"
            ) from None
