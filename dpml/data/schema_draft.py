"""``dpml schema``: draft a table's ``data:`` section from the table itself, marked as NOT private.

The schema dpml trains with must be *public*: bounds, categories and classes that come from a data
dictionary or domain knowledge, not from the records, because every constant read off the private
records leaks something about them (the largest income is one person's income; a rare category
names the few people in it) and that leak is outside the certified ε. Writing a schema by hand for a
wide table is tedious, so this drafts one from the file, with every value that was read from the
records marked ``READ FROM THE DATA``, for a person to review and replace with public knowledge.

Per column (read in chunks, so any size of table): numeric when every present value parses as a
number (bounds: the observed min and max), categorical otherwise (categories: the most frequent
values, at most ``max_categories``); a column whose values are nearly all distinct looks like an
identifier and is left out (commented). Cells equal to a common missing token ("", "?", "NA", …)
count as missing and the tokens found are listed under ``missing_values``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from dpml.data.records import DataError
from dpml.data.tables import chunks, header

MISSING_TOKENS = ("", "?", "NA", "N/A", "NaN", "nan", "null", "NULL", "None", "-", ".")
WARNING = """\
# ─────────────────────────────────────────────────────────────────────────────────────────────
# DRAFT SCHEMA, READ FROM THE DATA: NOT PRIVATE.
# Every value marked READ FROM THE DATA was computed from the records themselves (bounds are
# observed minima and maxima, categories and classes the values present). Training with them as
# they are leaks information about the people in the table (the oldest person's age, the members
# of a rare category) that the certified ε does not cover. Replace each one with public knowledge
# (a data dictionary or code book, legal ranges, the survey's published categories) before the
# first private run. Then use it as the data: section of params.yaml.
# ─────────────────────────────────────────────────────────────────────────────────────────────
"""


@dataclass
class ColumnProfile:
    """What one pass over a column saw (bounded memory: at most ``limit`` distinct values are kept)."""

    limit: int
    present: int = 0
    numeric: int = 0
    minimum: float = np.inf
    maximum: float = -np.inf
    tokens: Counter = field(default_factory=Counter)
    values: Counter = field(default_factory=Counter)
    overflow: bool = False

    def add(self, cells: pd.Series) -> None:
        text = cells.astype(object).map(
            lambda v: None if v is None or (isinstance(v, float) and np.isnan(v)) else str(v).strip()
        )
        is_token = text.isna() | text.isin(MISSING_TOKENS)
        self.tokens.update("" if v is None else v for v in text[is_token])
        present = text[~is_token]
        self.present += len(present)
        numbers = pd.to_numeric(present, errors="coerce")
        finite = numbers[np.isfinite(numbers.to_numpy(dtype=np.float64, na_value=np.nan))]
        self.numeric += len(finite)
        if len(finite):
            self.minimum = min(self.minimum, float(finite.min()))
            self.maximum = max(self.maximum, float(finite.max()))
        if not self.overflow:
            self.values.update(present.tolist())
            if len(self.values) > self.limit:
                self.overflow = True
                self.values = Counter(dict(self.values.most_common(self.limit)))


def _flow(value: object) -> str:
    """A YAML flow scalar or list (JSON is valid YAML)."""
    return json.dumps(value, ensure_ascii=False)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def draft_schema(
    source: str, label: str, id_column: str | None = None, max_categories: int = 30, chunk_rows: int = 100_000
) -> str:
    """The draft ``data:`` section (YAML text with the not-private warning) for ``csv:PATH`` or ``parquet:PATH``."""
    kind, _, rest = source.partition(":")
    if kind not in ("csv", "parquet") or not rest:
        raise DataError(f"{source}: expected csv:PATH or parquet:PATH")
    path = Path(rest)
    if not path.is_file():
        raise DataError(f"{path}: file does not exist")
    names = header(path, kind)
    for key, column in (("--label", label), ("--id", id_column)):
        if column is not None and column not in names:
            raise DataError(f"{key} {column!r}: no such column; the file has {names}")
    profiles = {
        name: ColumnProfile(limit=max_categories if name != label else 1000) for name in names if name != id_column
    }
    rows = 0
    for frame in chunks(path, kind, list(profiles), chunk_rows):
        rows += len(frame)
        for name, profile in profiles.items():
            profile.add(frame[name])
    if rows == 0:
        raise DataError(f"{path}: no records")
    return _render(source, label, id_column, profiles, rows, max_categories)


def _render(
    source: str, label: str, id_column: str | None, profiles: dict[str, ColumnProfile], rows: int, max_categories: int
) -> str:
    label_profile = profiles.pop(label)
    classes = sorted(label_profile.values, key=str)
    tokens = sorted({t for p in profiles.values() for t in p.tokens} | {""})
    lines = [
        WARNING,
        "data:",
        f"  source: {source}",
        f"  label_column: {_flow(label)}",
        f"  classes: {_flow(classes)}    # READ FROM THE DATA ({len(classes)} values present)",
    ]
    if id_column:
        lines.append(f"  id_column: {_flow(id_column)}")
    lines += [f'  missing_values: {_flow(tokens)}    # tokens found in the table ("" is always missing)', "  columns:"]
    for name, profile in profiles.items():
        lines.append("    " + _column_line(name, profile, rows, max_categories))
    return "\n".join(lines) + "\n"


def _column_line(name: str, profile: ColumnProfile, rows: int, max_categories: int) -> str:
    missing = sum(profile.tokens.values())
    note = f"{missing} missing" if missing else "none missing"
    if profile.present == 0:
        return f"# {_flow(name)}: every cell missing; left out"
    if profile.numeric == profile.present:
        low, high = profile.minimum, profile.maximum
        if high <= low:
            high = low + 1
        extra = ", indicator: true" if missing else ""
        return (
            f"{_flow(name)}: {{type: numeric, lower: {_number(low)}, upper: {_number(high)}{extra}}}"
            f"    # READ FROM THE DATA (observed min/max; {note})"
        )
    if profile.overflow and len(profile.values) >= max_categories and profile.present > 0.5 * rows:
        distinct_share = len(profile.values) / max(profile.present, 1)
        if distinct_share >= 0.9 or profile.values.most_common(1)[0][1] == 1:
            return f"# {_flow(name)}: nearly every value distinct (an identifier or free text?); left out"
    categories = [value for value, _ in profile.values.most_common(max_categories)]
    more = f"; more than {max_categories} values, the rest go to <other>" if profile.overflow else ""
    return (
        f"{_flow(name)}: {{type: categorical, categories: {_flow(categories)}}}"
        f"    # READ FROM THE DATA (values present, most frequent first; {note}{more})"
    )
