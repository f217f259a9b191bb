"""Privacy units: who a record belongs to, and how the ledger recognises them without storing who.

A *privacy unit* is what a budget protects: a person. ``data.id_column`` names the column that
identifies one (several rows may share it); without it, every row is its own unit, identified by
its content (features and label).

Two steps keep identities out of the ledger:

1. **Digest** (at ingestion, beside the records it describes, :mod:`dpml.data.units`): a 128-bit BLAKE2b
   digest of the unit's id value, or of the row's bytes. Files that hold the records anyway may hold their
   digests.
2. **Keyed id** (at reservation): AES-256 of the digest under the ledger's *unit key* (a secret file,
   ``ledger.unit_key``; by default ``<ledger path>.key``, created with mode 0600), cut to 64 bits. A
   ledger without its key reveals nobody: testing "was record r used?" needs the key. Two different
   units that collide in 64 bits (≈ n²/2⁶⁵: 3·10⁻⁶ for ten million units) are accounted as one unit
   whose history is the union of both: an over-count, never an under-count.

Sensitivity acts on units through contribution bounding (one row per unit, :mod:`dpml.data.units`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

import numpy as np

from dpml.data.units import DIGEST_BYTES

KEY_BYTES = 32
_FINGERPRINT_MESSAGE = b"dpml unit key fingerprint v1"


class UnitKeyError(RuntimeError):
    """The unit key file is missing (for a ledger that has units), unreadable, or not this ledger's."""


def load_or_create_key(path: str | Path, create: bool) -> bytes:
    """The unit key (32 random bytes); created with mode 0600 when absent and ``create``."""
    path = Path(path)
    if path.is_dir():
        raise UnitKeyError(f"{path} is a directory; ledger.unit_key names the unit key file itself")
    if path.exists():
        key = path.read_bytes()
        if len(key) != KEY_BYTES:
            raise UnitKeyError(
                f"{path}: a unit key is {KEY_BYTES} bytes, this file has {len(key)}; restore the ledger's key file"
            )
        return key
    if not create:
        raise UnitKeyError(
            f"{path}: the ledger's unit key file is missing; without it the ledger cannot recognise "
            "anyone it has accounted for. Restore the file (or point ledger.unit_key at it)"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(KEY_BYTES)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")  # (each thread its own)
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
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes  # lazy: keyed unit ids only

    digests = np.ascontiguousarray(digests, dtype=np.uint8)
    if digests.ndim != 2 or digests.shape[1] != DIGEST_BYTES:
        raise ValueError(f"unit digests must have shape (n, {DIGEST_BYTES}), got {digests.shape}")
    encryptor = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    blocks = encryptor.update(digests.tobytes()) + encryptor.finalize()
    return np.frombuffer(blocks, dtype="<u8")[::2].copy()
