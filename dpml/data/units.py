"""Who a record belongs to: the privacy unit of each row, as a digest, and contribution bounding.

A *privacy unit* is what a budget protects: a person. ``data.id_column`` names the column that
identifies one (several rows may share it); without it, every row is its own unit, identified by
its content (features and label). At ingestion each row gets a 128-bit BLAKE2b digest of its unit's
id value, or of the row's bytes; files that hold the records anyway may hold their digests. The
ledger never stores a digest: it stores a keyed id of it (:mod:`dpml.ledger.units`).

Sensitivity acts on units through **contribution bounding** (Amin et al. 2019, "Bounding user
contributions"): before the split, each unit keeps exactly one of its rows (a seeded uniform
choice, which depends on nothing but that unit's own rows). Every trainer's record-level guarantee
is then a unit-level guarantee, under the same neighbouring relation and with the sampling rate
computed on units. The rows dropped are counted in the ingestion metadata.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

DIGEST_BYTES = 16


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=DIGEST_BYTES, person=b"dpml-unit").digest()


def id_value_text(value: object) -> str:
    """One spelling per id value: 7, 7.0, "7", "7.0" and " 007" are the same person (a table's cells are
    read as text, and a typed reader would have read those as the number 7; merging two spellings into
    one unit only ever makes the accounting more conservative)."""
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            return text
        return id_value_text(number) if np.isfinite(number) else text
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return str(int(value))
    if isinstance(value, (np.integer,)):
        return str(int(value))
    return str(value)


def digests_of_ids(values: Iterable[object]) -> np.ndarray:
    """(n, 16) uint8: the digest of each row's id value (rows sharing a value share a digest)."""
    out = [_digest(b"id\0" + id_value_text(v).encode("utf-8")) for v in values]
    return np.frombuffer(b"".join(out), dtype=np.uint8).reshape(len(out), DIGEST_BYTES).copy()


def digests_of_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(n, 16) uint8: the digest of each row's content (features as float64, then the label)."""
    x = np.ascontiguousarray(x, dtype=np.float64)
    y = np.ascontiguousarray(y, dtype=np.int64)
    rows, labels = x.view(np.uint8).reshape(x.shape[0], -1), y.view(np.uint8).reshape(-1, 8)
    out = [_digest(b"row\0" + r.tobytes() + label.tobytes()) for r, label in zip(rows, labels, strict=True)]
    return np.frombuffer(b"".join(out), dtype=np.uint8).reshape(len(out), DIGEST_BYTES).copy()


def one_row_per_unit(digests: np.ndarray, seed: int) -> np.ndarray:
    """Sorted indices of the rows kept: one uniformly chosen row of each unit (contribution bounding).

    The choice for a unit is the first of its rows in a seeded random permutation of all rows, so it
    depends on the seed and on the unit's own rows only.
    """
    n = digests.shape[0]
    order = np.random.default_rng([seed, 7]).permutation(n)
    as_void = np.ascontiguousarray(digests[order]).view(f"V{DIGEST_BYTES}").ravel()
    _, first = np.unique(as_void, return_index=True)
    return np.sort(order[first])
