"""The ``data`` section of ``params.yaml``: where the records come from and a table's public schema.

A table's schema (``data.columns``) declares each feature column as numeric with public bounds or
categorical with public categories; :mod:`dpml.data.encoding` turns it into features and
:mod:`dpml.data.tables` reads the table with it. Validated with the other sections by
:mod:`dpml.config`; every mistake names the column before any ε is spent.
"""

from __future__ import annotations

import codecs
import math
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import Field, field_validator, model_validator

from dpml.data.encoding import numeric_spelling
from dpml.data.source_kinds import BUILT_IN, SOURCES
from dpml.sections import Section, check_scalable

SKLEARN_BUNDLED = ("digits", "iris", "wine", "breast_cancer")

# Where a parameter file's plain scalars keep the text the user typed (:mod:`dpml.params_yaml`): column
# names, category and class lists and missing-value tokens are texts compared with a table's cells, so
# YAML 1.1's readings (``no`` → False, ``1.10`` → 1.1, ``010`` → 8, ``2026-11-20`` → a date) would
# silently send every such cell to ``<other>``. "*": any key, "[]": any list item.
VERBATIM_VALUES: tuple[tuple[str, ...], ...] = (
    ("data", "label_column"),
    ("data", "id_column"),
    ("data", "feature_columns", "[]"),
    ("data", "classes", "[]"),
    ("data", "missing_values", "[]"),
    ("data", "columns", "*", "categories", "[]"),
)
VERBATIM_KEYS: tuple[tuple[str, ...], ...] = (("data", "columns"),)  # the column names of a schema
SEPARATORS = {",": "comma", ";": "semicolon", "\t": "tab", "|": "pipe"}


class NumericColumn(Section):
    """A numeric feature column with public bounds; ``missing``: the public fill of a missing value
    (default: the midpoint of the bounds); ``indicator``: add a 0/1 column saying it was missing."""

    type: Literal["numeric"]
    lower: float
    upper: float
    missing: float | None = None
    indicator: bool = False

    @model_validator(mode="after")
    def _ordered_bounds_and_fill(self) -> "NumericColumn":
        if not self.upper > self.lower:
            raise ValueError(f"upper = {self.upper} must be > lower = {self.lower}")
        check_scalable("", self.lower, self.upper)
        if self.missing is not None and not self.lower <= self.missing <= self.upper:
            raise ValueError(
                f"missing = {self.missing}: the fill must lie in [lower, upper] = [{self.lower}, {self.upper}]"
            )
        return self

    @property
    def fill(self) -> float:
        """The declared fill, else the midpoint (computed without overflow for bounds near the float range)."""
        if self.missing is not None:
            return self.missing
        middle = (self.lower + self.upper) / 2
        return middle if math.isfinite(middle) else self.lower / 2 + self.upper / 2


def _no_booleans(value: list[object], what: str) -> None:
    """A boolean in a list of category or class texts is YAML 1.1 reading ``no``/``yes``/``on``/``off`` (a
    configuration built in Python, or read by another YAML reader): refused with the fix."""
    flags = [v for v in value if isinstance(v, bool)]
    if flags:
        raise ValueError(
            f"{flags[0]!r} in {what} is a boolean, not a text a cell can hold; write the texts quoted "
            "(e.g. ['no', 'yes'])"
        )


def category_text(value: str | int | float) -> str:
    """The text a declared category or class is compared by: stripped, and a number in its plain spelling
    ('3.0' and 3 → '3', as a cell's text is matched: :func:`dpml.data.encoding.numeric_spelling`)."""
    text = str(value).strip()
    return numeric_spelling(text) if text else text


class CategoricalColumn(Section):
    """A categorical feature column, one-hot over its public ``categories`` (plus ``<missing>`` and
    ``<other>`` slots: :mod:`dpml.data.encoding`). Categories are texts; in ``params.yaml`` each keeps
    the text written (``[no, yes]``, ``[NO, SE, DK]``, ``[1.10, 1.2]`` are strings, not YAML 1.1's
    booleans and numbers: :mod:`dpml.params_yaml`)."""

    type: Literal["categorical"]
    categories: list[str | int]

    @field_validator("categories", mode="before")
    @classmethod
    def _texts_not_booleans(cls, value: object) -> object:
        if isinstance(value, list):
            _no_booleans(value, "categories")
        return value

    @field_validator("categories")
    @classmethod
    def _distinct_categories(cls, value: list[str | int]) -> list[str | int]:
        if not value:
            raise ValueError("an empty category list; declare the column's categories")
        texts = [category_text(c) for c in value]
        repeated = sorted({t for t in texts if texts.count(t) > 1})
        if repeated:
            raise ValueError(
                f"categories {repeated} are listed more than once (compared as a cell is: spaces stripped, 3.0 = 3)"
            )
        if any(not t for t in texts):
            raise ValueError("an empty category name; declare empty cells under data.missing_values instead")
        return value


MAX_VOCABULARY = 2**24  # every id below it is exact in the float32 records the pipeline stores


class TokensColumn(Section):
    """A column of token ids, the inputs of a model taking ``input_ids`` and ``attention_mask``
    (``model.kind: custom``, :mod:`dpml.models.library`). Each cell is the text of one example's ids,
    separated by spaces (``"101 7592 2088 102"``): at most ``length`` of them, each an integer in
    [0, ``vocabulary``). It becomes ``length`` ids, padded at the end with ``pad_id``, and ``length`` mask
    values (1 = a token, 0 = padding): features ``NAME[i]`` then ``NAME.mask[i]``. It is the table's only
    feature column, and preprocess's scaling and input-norm clipping leave it as it is."""

    type: Literal["tokens"]
    length: int = Field(gt=0)
    vocabulary: int = Field(gt=0, le=MAX_VOCABULARY)
    pad_id: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _pad_in_vocabulary(self) -> "TokensColumn":
        if self.pad_id >= self.vocabulary:
            raise ValueError(f"pad_id = {self.pad_id}: must be a token id in [0, vocabulary = {self.vocabulary})")
        return self


Column = Annotated[Union[NumericColumn, CategoricalColumn, TokensColumn], Field(discriminator="type")]


class DataConfig(Section):
    """Where the raw records come from, and the public schema of a table.

    ``source`` is one of ``sklearn:NAME`` (a scikit-learn *bundled* set: digits, iris, wine,
    breast_cancer), ``idx:DIR`` (MNIST-format IDX files), ``csv:PATH`` or ``parquet:PATH``.
    Tabular sources need ``label_column`` and, because the label set is a constant that must not be
    read off the private data, the list of ``classes``, and their feature columns either as
    ``columns`` (the schema: each column ``numeric`` with public bounds or ``categorical`` with public
    categories, or one ``tokens`` column of token ids for a model taking ``input_ids`` and
    ``attention_mask``, :mod:`dpml.data.encoding`) or as ``feature_columns`` (shorthand: all numeric, bounded
    by ``preprocess.lower``/``upper``, no missing values). ``missing_values``: the cell texts read as
    missing (compared after stripping surrounding whitespace); ``strict``: a categorical value
    outside its list is an error instead of going to the ``<other>`` slot. ``chunk_rows``: rows read
    at a time, so a table larger than memory streams through.

    ``id_column`` (tabular sources) names the column that identifies the *privacy unit* — the person
    a budget protects; several rows may share one id, and each unit then keeps one of its rows
    (:mod:`dpml.ledger.units`). Without it every row is its own unit, identified by its content.

    A CSV file's ``separator`` (default ``,``; ``;``, ``"\t"`` (or ``tab``), ``|`` or any one character)
    and ``encoding`` (default ``auto``: UTF-8, with or without a byte-order mark, UTF-16/32 by their
    mark, and a file that is not UTF-8 read as Windows-1252/Latin-1; or any Python codec name). The
    same records are the same people whatever their file's encoding or line endings: a unit is its id
    or its encoded content, never the bytes of the file.
    """

    source: str = "sklearn:digits"
    label_column: str | None = None
    feature_columns: list[str] | None = None
    columns: dict[str, Column] | None = None
    classes: list[str | int] | None = None
    missing_values: list[str] = Field(default_factory=lambda: [""])
    strict: bool = False
    chunk_rows: int = Field(100_000, gt=0)
    id_column: str | None = None
    separator: str = ","
    encoding: str = "auto"

    @field_validator("source")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        scheme, sep, rest = value.partition(":")
        allowed = (*BUILT_IN, *SOURCES)
        if not sep or scheme not in allowed or not rest:
            raise ValueError(
                f"must look like one of {', '.join(s + ':…' for s in allowed)} (a source of your own: "
                "register it in a module listed under plugins:)"
            )
        if scheme in SOURCES:
            problem = SOURCES[scheme].check(rest)
            if problem:
                raise ValueError(problem)
            return value
        if scheme == "sklearn" and rest not in SKLEARN_BUNDLED:
            raise ValueError(f"unknown bundled scikit-learn set; allowed: {', '.join(SKLEARN_BUNDLED)}")
        path = Path(rest)
        if scheme == "idx" and not path.is_dir():
            raise ValueError(
                f"{rest} is a file, not a directory of IDX files"
                if path.exists()
                else f"directory {rest} does not exist"
            )
        if scheme in ("csv", "parquet") and not path.is_file():
            if path.is_dir():
                raise ValueError(f"{rest} is a directory, not a {scheme} file; name the file itself")
            raise ValueError(f"{rest} is not a regular file" if path.exists() else f"file {rest} does not exist")
        return value

    @field_validator("separator")
    @classmethod
    def _one_character(cls, value: str) -> str:
        named = {"tab": "\t", "\\t": "\t", "comma": ",", "semicolon": ";", "pipe": "|"}
        value = named.get(value.lower() if len(value) > 1 else value, value)
        if len(value) != 1 or value in ('"', "\n", "\r"):
            raise ValueError(
                "a CSV separator is one character other than a quote or a line break: ',', ';', '\\t' (tab) or '|'"
            )
        return value

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, value: str) -> str:
        if value == "auto":
            return value
        try:
            return codecs.lookup(value).name
        except LookupError:
            raise ValueError(
                "not a text encoding Python knows; use auto (UTF-8, with or without BOM, else "
                "Windows-1252), or a codec name such as utf-8, latin-1, cp1252, utf-16"
            ) from None

    @field_validator("classes", mode="before")
    @classmethod
    def _classes_are_texts(cls, value: object) -> object:
        if isinstance(value, list):
            _no_booleans(value, "classes")
        return value

    @field_validator("classes")
    @classmethod
    def _distinct_classes(cls, value: list[str | int] | None) -> list[str | int] | None:
        if value is not None:
            texts = [category_text(c) for c in value]
            repeated = sorted({t for t in texts if texts.count(t) > 1})
            if repeated:
                raise ValueError(f"classes {repeated} are listed more than once")
            if len(value) == 1:
                raise ValueError("a classifier needs at least two classes")
        return value

    @model_validator(mode="after")
    def _tabular_needs_columns(self) -> "DataConfig":
        scheme = self.source.partition(":")[0]
        tabular = scheme in ("csv", "parquet")
        if tabular:
            missing = [k for k in ("label_column", "classes") if getattr(self, k) in (None, [])]
            if self.columns is None and not self.feature_columns:
                missing.append("columns (or feature_columns)")
            if missing:
                raise ValueError(f"a {scheme} source needs data.{', data.'.join(missing)}")
            if self.columns is not None and self.feature_columns is not None:
                raise ValueError(
                    "data.columns and data.feature_columns: give one (feature_columns is the "
                    "all-numeric shorthand of columns)"
                )
            if self.columns is not None and not self.columns:
                raise ValueError("data.columns is empty: declare at least one feature column")
            tokens = [name for name, column in (self.columns or {}).items() if column.type == "tokens"]
            if tokens and len(self.columns or {}) > 1:
                raise ValueError(
                    f"data.columns: {tokens[0]!r} is a tokens column, so it must be the only feature column "
                    f"(a model taking input_ids and attention_mask reads one sequence); got "
                    f"{list(self.columns or {})}"
                )
        elif self.columns is not None or self.feature_columns is not None:
            key = "data.columns" if self.columns is not None else "data.feature_columns"
            raise ValueError(
                f"{key}: only a csv or parquet source has columns; {scheme}: its features are given by the format"
            )
        if scheme != "csv" and (self.separator != "," or self.encoding != "auto"):
            key = "separator" if self.separator != "," else "encoding"
            raise ValueError(
                f"data.{key} = {getattr(self, key)!r}: only a csv source has a {key}; {scheme}: the format says it"
            )
        features = self.feature_names_declared()
        repeated = sorted({name for name in features if features.count(name) > 1})
        if repeated:
            raise ValueError(f"data.feature_columns: {repeated} listed more than once; each column is one feature")
        if self.label_column is not None and self.label_column in features:
            raise ValueError(
                f"data.label_column = {self.label_column!r} is also a feature column; the label must "
                "not be a model input"
            )
        if self.id_column is not None:
            if not tabular:
                raise ValueError(
                    f"data.id_column = {self.id_column!r}: only a csv or parquet source has columns; "
                    f"{scheme}: records are units by their content"
                )
            if self.id_column == self.label_column or self.id_column in features:
                raise ValueError(
                    f"data.id_column = {self.id_column!r} is also the label or a feature column; an id "
                    "must never be a model input"
                )
        return self

    def feature_names_declared(self) -> list[str]:
        """The declared feature columns (schema or shorthand), in order."""
        return list(self.columns) if self.columns is not None else list(self.feature_columns or [])

    def named_columns(self) -> list[str]:
        """Every column of a table the configuration names: label, features, id."""
        return [c for c in (self.label_column, *self.feature_names_declared(), self.id_column) if c is not None]
