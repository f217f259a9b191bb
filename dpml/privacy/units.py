"""Privacy units: who a record belongs to, and how the ledger recognises them without storing who.

A *privacy unit* is what a budget protects: a person. ``data.id_column`` names the column that
identifies one (several rows may share it); without it, every row is its own unit, identified by
its content (features and label).

Two steps keep identities out of the ledger:

1. **Digest** (at ingestion, beside the records it describes): a 128-bit BLAKE2b digest of the unit's
   id value, or of the row's bytes. Files that hold the records anyway may hold their digests.
2. **Keyed id** (at reservation): AES-256 of the digest under the ledger's *unit key* (a secret file,
   ``ledger.unit_key``; by default ``<ledger path>.key``, created with mode 0600), cut to 64 bits. A
   ledger without its key reveals nobody: testing "was record r used?" needs the key. Two different
   units that collide in 64 bits (≈ n²/2⁶⁵: 3·10⁻⁶ for ten million units) are accounted as one unit
   whose history is the union of both: an over-count, never an under-count.

Sensitivity acts on units through **contribution bounding** (Amin et al. 2019, "Bounding user
contributions"): before the split, each unit keeps exactly one of its rows (a seeded uniform
choice, which depends on nothing but that unit's own rows). Every trainer's record-level guarantee
is then a unit-level guarantee, under the same neighbouring relation and with the sampling rate
computed on units. The rows dropped are counted in the ingestion metadata.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

import numpy as np

DIGEST_BYTES = 16
KEY_BYTES = 32
_FINGERPRINT_MESSAGE = b"dpml unit key fingerprint v1"


class UnitKeyError(RuntimeError):
    """The unit key file is missing (for a ledger that has units), unreadable, or not this ledger's."""


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
    out = [_digest(b"row\0" + r.tobytes() + label.tobytes()) for r, label in zip(rows, labels)]
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


def load_or_create_key(path: str | Path, create: bool) -> bytes:
    """The unit key (32 random bytes); created with mode 0600 when absent and ``create``."""
    path = Path(path)
    if path.is_dir():
        raise UnitKeyError(f"{path} is a directory; ledger.unit_key names the unit key file itself")
    if path.exists():
        key = path.read_bytes()
        if len(key) != KEY_BYTES:
            raise UnitKeyError(f"{path}: a unit key is {KEY_BYTES} bytes, this file has {len(key)}; "
                               "restore the ledger's key file")
        return key
    if not create:
        raise UnitKeyError(f"{path}: the ledger's unit key file is missing; without it the ledger cannot recognise "
                           "anyone it has accounted for. Restore the file (or point ledger.unit_key at it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(KEY_BYTES)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(key)
        handle.flush()
        os.fsync(handle.fileno())
    try:
        os.link(temp, path)  # never replaces a key another process created meanwhile
    except FileExistsError:
        pass
    finally:
        temp.unlink(missing_ok=True)
    return load_or_create_key(path, create=False)


def key_fingerprint(key: bytes) -> str:
    """A public fingerprint of the key (HMAC of a constant), stored in the ledger to catch a wrong key."""
    return hmac.new(key, _FINGERPRINT_MESSAGE, hashlib.sha256).hexdigest()[:32]


def keyed_unit_ids(digests: np.ndarray, key: bytes) -> np.ndarray:
    """uint64 keyed id of each digest, in input order: AES-256(key, digest) cut to 64 bits.

    AES is a pseudorandom permutation of 128-bit blocks, so each block is encrypted on its own
    (ECB is exactly "one PRF call per unit" here; no block is ever a message in itself).
    """
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    digests = np.ascontiguousarray(digests, dtype=np.uint8)
    if digests.ndim != 2 or digests.shape[1] != DIGEST_BYTES:
        raise ValueError(f"unit digests must have shape (n, {DIGEST_BYTES}), got {digests.shape}")
    encryptor = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    blocks = encryptor.update(digests.tobytes()) + encryptor.finalize()
    return np.frombuffer(blocks, dtype="<u8")[::2].copy()
