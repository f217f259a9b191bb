"""A declared, public table schema turned into model features, one record at a time.

A user declares each feature column under ``data.columns`` (:class:`dpml.data.schema.DataConfig`):
- ``numeric`` with public bounds [lower, upper]: the value as a number; a missing value takes the
  declared public ``missing`` fill (default (lower + upper)/2) and, with ``indicator: true``, a 0/1
  column ``NAME:missing`` says it was missing;
- ``categorical`` with its public ``categories``: one-hot over them, plus an explicit slot
  ``NAME=<missing>`` for a missing value and ``NAME=<other>`` for a value outside the list (with
  ``strict: true`` such a value is an error instead, and the ``<other>`` slot does not exist);
- ``tokens`` (``length``, ``vocabulary``, ``pad_id``): a cell is the text of one example's token ids
  separated by spaces; it becomes ``length`` ids, padded at the end with ``pad_id``, then ``length`` mask
  values (1 = a token, 0 = padding), the inputs of a model taking ``input_ids`` and ``attention_mask``
  (:mod:`dpml.models.library`). A missing cell, a part that is not an integer, an id outside
  [0, vocabulary) and more than ``length`` ids are errors naming the row and the column.

Every constant here comes from the declaration, never from the records, and each record is encoded
on its own: neighbouring tables are encoded row by row by the same function, so the encoding costs
no privacy (the same argument as for the scaling in :mod:`dpml.data.preprocess`). The per-feature
bounds it returns (one-hot and indicator columns: [0, 1]) are what the preprocess stage scales by.

This module imports nothing from dpml: the registered MLflow model carries it (by value) to apply
the same encoding to raw rows wherever the model is loaded (:mod:`dpml.tracking.serving`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

OTHER = "<other>"
MISSING = "<missing>"


class EncodingError(ValueError):
    """A cell that cannot be encoded; the message names the row, the column and the reason."""


def cell_key(value: Any) -> str | None:
    """The text a cell is compared by: surrounding whitespace stripped, 3.0 → '3'; None for NaN/None."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return None
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return str(int(value))
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    return str(value).strip()


def numeric_spelling(key: str) -> str:
    """'3.0' → '3', '1e3' → '1000' (how a number written as text matches a declared integer); else ``key``."""
    try:
        number = float(key)
    except ValueError:
        return key
    return str(int(number)) if number.is_integer() and abs(number) < 2**63 else key


def category_codes(values: pd.Series, categories: list[str]) -> tuple[np.ndarray, pd.Series]:
    """Each cell's index in ``categories`` (-1: not one of them) and its :func:`cell_key` (None: NaN/None).

    A cell matches by its key, or else by its :func:`numeric_spelling` ('3.0' for a declared 3)."""
    keys = values.astype(object).map(cell_key)
    codes = pd.Categorical(keys, categories=categories).codes.astype(np.int64)
    retry = (codes < 0) & keys.notna().to_numpy()
    if retry.any():
        codes[retry] = pd.Categorical(keys[retry].map(numeric_spelling), categories=categories).codes
    return codes, keys


@dataclass(frozen=True)
class ColumnEncoding:
    """One declared feature column: ``kind`` numeric (``lower``, ``upper``, ``fill``, ``indicator``;
    ``fill`` None: a missing value is an error), categorical (``categories``) or tokens (``length``,
    ``vocabulary``, ``pad_id``)."""

    name: str
    kind: str
    lower: float = 0.0
    upper: float = 1.0
    fill: float | None = None
    indicator: bool = False
    categories: tuple[str, ...] = ()
    length: int = 0
    vocabulary: int = 0
    pad_id: int = 0

    def feature_names(self, strict: bool) -> list[str]:
        if self.kind == "numeric":
            return [self.name] + ([f"{self.name}:missing"] if self.indicator else [])
        if self.kind == "tokens":
            return [f"{self.name}[{i}]" for i in range(self.length)] + [
                f"{self.name}.mask[{i}]" for i in range(self.length)
            ]
        slots = [*self.categories, MISSING] + ([] if strict else [OTHER])
        return [f"{self.name}={slot}" for slot in slots]

    def bounds(self, strict: bool) -> tuple[list[float], list[float]]:
        """Per output feature: the public interval the preprocess stage clips and scales by."""
        if self.kind == "numeric":
            return [self.lower] + ([0.0] if self.indicator else []), [self.upper] + ([1.0] if self.indicator else [])
        if self.kind == "tokens":  # what the values can be; preprocess leaves token inputs unscaled
            return [0.0] * (2 * self.length), [float(self.vocabulary - 1)] * self.length + [1.0] * self.length
        width = len(self.feature_names(strict))
        return [0.0] * width, [1.0] * width


@dataclass
class Counts:
    """What the encoding did to declared slots (statistics of the records: kept with the stage outputs,
    never logged with a release)."""

    missing: dict[str, int] = field(default_factory=dict)
    other: dict[str, int] = field(default_factory=dict)

    def add(self, other: "Counts") -> None:
        for mine, theirs in ((self.missing, other.missing), (self.other, other.other)):
            for name, count in theirs.items():
                mine[name] = mine.get(name, 0) + count


@dataclass(frozen=True)
class TableEncoding:
    """The declared columns, in order, the tokens read as missing, and ``strict``."""

    columns: tuple[ColumnEncoding, ...]
    missing_values: tuple[str, ...] = ("",)
    strict: bool = False

    @property
    def column_names(self) -> list[str]:
        return [column.name for column in self.columns]

    def feature_names(self) -> list[str]:
        return [name for column in self.columns for name in column.feature_names(self.strict)]

    @property
    def tokens(self) -> bool:
        """Whether the features are token ids and their mask (which no scaling or norm clipping may touch)."""
        return any(column.kind == "tokens" for column in self.columns)

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        lower: list[float] = []
        upper: list[float] = []
        for column in self.columns:
            low, high = column.bounds(self.strict)
            lower += low
            upper += high
        return np.asarray(lower, dtype=np.float64), np.asarray(upper, dtype=np.float64)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TableEncoding":
        columns = tuple(ColumnEncoding(**{**c, "categories": tuple(c["categories"])}) for c in data["columns"])
        return cls(columns=columns, missing_values=tuple(data["missing_values"]), strict=bool(data["strict"]))

    def encode(self, frame: pd.DataFrame, first_row: int = 0, origin: str = "input") -> tuple[np.ndarray, Counts]:
        """Features of every row of ``frame`` (n, len(feature_names())) float64, and the slot counts.

        Row numbers in errors are ``first_row`` + the position in ``frame`` (0 = the first record)."""
        absent = [name for name in self.column_names if name not in frame.columns]
        if absent:
            raise EncodingError(f"{origin}: column(s) {absent} not found; it has {list(map(str, frame.columns))}")
        blocks, counts = [], Counts()
        for column in self.columns:
            values = frame[column.name]
            missing = self._is_missing(values)
            if column.kind == "numeric":
                blocks.append(self._numeric(column, values, missing, first_row, origin, counts))
            elif column.kind == "tokens":
                blocks.append(_tokens(column, values, missing, first_row, origin))
            else:
                blocks.append(self._categorical(column, values, missing, first_row, origin, counts))
        if not blocks:
            return np.zeros((len(frame), 0)), counts
        return np.concatenate(blocks, axis=1), counts

    def _is_missing(self, values: pd.Series) -> np.ndarray:
        missing = values.isna().to_numpy()
        if values.dtype == object or pd.api.types.is_string_dtype(values.dtype):
            tokens = set(self.missing_values)
            text = values.astype(object).map(lambda v: v.strip() if isinstance(v, str) else v)
            missing = missing | text.isin(tokens).to_numpy()
        return missing

    @staticmethod
    def _numeric(
        column: ColumnEncoding, values: pd.Series, missing: np.ndarray, first_row: int, origin: str, counts: Counts
    ) -> np.ndarray:
        present = values[~missing]
        numbers = pd.to_numeric(present, errors="coerce")
        unparsed = numbers.isna().to_numpy()
        if unparsed.any():
            position = int(np.flatnonzero(~missing)[np.argmax(unparsed)])
            raise EncodingError(
                f"{origin}: row {first_row + position}, column {column.name!r}: "
                f"{values.iloc[position]!r} is not a number"
            )
        out = np.empty(len(values), dtype=np.float64)
        out[~missing] = numbers.to_numpy(dtype=np.float64)
        infinite = ~np.isfinite(out) & ~missing
        if infinite.any():
            position = int(np.argmax(infinite))
            raise EncodingError(
                f"{origin}: row {first_row + position}, column {column.name!r}: value {out[position]} is not finite"
            )
        if missing.any():
            if column.fill is None:
                position = int(np.argmax(missing))
                raise EncodingError(
                    f"{origin}: row {first_row + position}, column {column.name!r}: missing value "
                    f"(NaN); declare the column under data.columns with a public fill to accept it"
                )
            out[missing] = column.fill
            counts.missing[column.name] = int(missing.sum())
        if column.indicator:
            return np.stack([out, missing.astype(np.float64)], axis=1)
        return out[:, None]

    def _categorical(
        self,
        column: ColumnEncoding,
        values: pd.Series,
        missing: np.ndarray,
        first_row: int,
        origin: str,
        counts: Counts,
    ) -> np.ndarray:
        missing_slot, other_slot = len(column.categories), len(column.categories) + 1
        codes, keys = category_codes(values, list(column.categories))
        missing = missing | keys.isna().to_numpy()
        unknown = (codes < 0) & ~missing
        if unknown.any() and self.strict:
            position = int(np.argmax(unknown))
            raise EncodingError(
                f"{origin}: row {first_row + position}, column {column.name!r}: "
                f"{values.iloc[position]!r} is not one of the declared categories "
                f"{list(column.categories)} (data.strict is true)"
            )
        slots = np.where(missing, missing_slot, np.where(unknown, other_slot, codes))
        out = np.zeros((len(values), len(column.feature_names(self.strict))), dtype=np.float64)
        out[np.arange(len(values)), slots] = 1.0
        if (slots == missing_slot).any():
            counts.missing[column.name] = int((slots == missing_slot).sum())
        if (slots == other_slot).any():
            counts.other[column.name] = int((slots == other_slot).sum())
        return out


def _token_ids(column: ColumnEncoding, cell: Any, row: int, origin: str) -> list[int]:
    """The ids written in one cell (space-separated integers in [0, vocabulary), at most ``length``)."""
    text = cell_key(cell) or ""
    ids = []
    for part in text.split():
        if not (part.isascii() and part.isdigit()):
            raise EncodingError(
                f"{origin}: row {row}, column {column.name!r}: {part!r} is not a token id; a tokens "
                f"cell holds integers in [0, {column.vocabulary}) separated by spaces"
            )
        ids.append(int(part))
    if not ids:
        raise EncodingError(
            f"{origin}: row {row}, column {column.name!r}: no token ids; each example needs at least one"
        )
    outside = [i for i in ids if i >= column.vocabulary]
    if outside:
        raise EncodingError(
            f"{origin}: row {row}, column {column.name!r}: token id {outside[0]} is outside the "
            f"vocabulary [0, {column.vocabulary})"
        )
    if len(ids) > column.length:
        raise EncodingError(
            f"{origin}: row {row}, column {column.name!r}: {len(ids)} token ids, more than its length "
            f"{column.length}; truncate the examples or raise data.columns.{column.name}.length"
        )
    return ids


def _tokens(column: ColumnEncoding, values: pd.Series, missing: np.ndarray, first_row: int, origin: str) -> np.ndarray:
    """(n, 2·length): each row's ids padded with ``pad_id``, then its mask (1 = a token, 0 = padding)."""
    if missing.any():
        row = first_row + int(np.argmax(missing))
        raise EncodingError(
            f"{origin}: row {row}, column {column.name!r}: missing value; a tokens column has no fill "
            "(each example needs its token ids)"
        )
    out = np.zeros((len(values), 2 * column.length), dtype=np.float64)
    out[:, : column.length] = column.pad_id
    for position, cell in enumerate(values.to_numpy(dtype=object)):
        ids = _token_ids(column, cell, first_row + position, origin)
        out[position, : len(ids)] = ids
        out[position, column.length : column.length + len(ids)] = 1.0
    return out
