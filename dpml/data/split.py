"""A stable, seeded split of the privacy units into train / test / audit population.

Each unit keeps one row (contribution bounding, :func:`dpml.data.units.one_row_per_unit`) and is
placed by a number u ∈ [0, 1) drawn from its own digest and the seed: u < ``test_fraction`` → test,
then the next ``audit_fraction`` → audit population, the rest → train. A unit's part depends on
nothing but its own record and the seed, so

- when the table grows, every unit stays in its part: a record once in the test part never trains a
  later version, and the histories of a lineage's units stay nested (:mod:`dpml.ledger.cohorts`);
- neighbouring tables (one unit more) give training sets that differ in that unit alone, which is the
  relation the trainers' accountants assume (a split re-drawn over the whole table would not).

Classes are represented in each part in proportion up to sampling noise (exact stratification would
couple the units' placements); an empty part, or a training part with a single class, is an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpml.sections import SplitConfig
from dpml.data.records import DataError, RawData
from dpml.data.units import one_row_per_unit

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class Split:
    """Index arrays into the raw records; ``test`` indexes the predefined test part if any."""

    train: np.ndarray
    test: np.ndarray
    audit: np.ndarray
    test_is_predefined: bool
    rows_dropped: int = 0  # rows beyond the first of their unit (contribution bounding)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele, Lea & Flood 2014): a bijective 64-bit mixer."""
    with np.errstate(over="ignore"):
        z = values + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def unit_uniforms(digests: np.ndarray, seed: int) -> np.ndarray:
    """u ∈ [0, 1) per unit: its digest's first 64 bits (uniform: a BLAKE2b output) mixed with the seed."""
    head = np.ascontiguousarray(digests[:, :8]).view("<u8").ravel()
    salt = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]
    return (_splitmix64(head ^ salt) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def split_indices(raw: RawData, units: np.ndarray, config: SplitConfig) -> Split:
    """Split one row per unit into train / test / audit population by each unit's own u.

    With a predefined test part (IDX ``t10k``) the records are split only into train and audit
    population. ``split.max_train`` keeps the training units with the largest u (stable as the
    table grows).
    """
    kept = one_row_per_unit(units, config.seed)
    u = unit_uniforms(units[kept], config.seed)
    predefined = raw.x_test is not None
    test_share = 0.0 if predefined else config.test_fraction
    is_test = u < test_share
    is_audit = (u >= test_share) & (u < test_share + config.audit_fraction)
    is_train = ~(is_test | is_audit)
    parts = {"train": kept[is_train], "audit": kept[is_audit]}
    if not predefined:
        parts["test"] = kept[is_test]
    for name, rows in parts.items():
        if rows.size == 0:
            raise DataError(
                f"{raw.origin}: none of the {kept.size} privacy units fell in the {name} part; use more "
                "data or larger split fractions"
            )
    if np.unique(raw.y[parts["train"]]).size < 2:
        raise DataError(
            f"{raw.origin}: the {parts['train'].size} training units hold only one class; a classifier "
            "needs at least two (use more data or change split.seed)"
        )
    train = parts["train"]
    if config.max_train is not None and train.size > config.max_train:
        train = train[np.argsort(-u[is_train], kind="stable")[: config.max_train]]
    test = np.arange(raw.x_test.shape[0]) if predefined else parts["test"]  # type: ignore[union-attr]
    return Split(
        np.sort(train), np.sort(test), np.sort(parts["audit"]), predefined, rows_dropped=int(units.shape[0] - kept.size)
    )
