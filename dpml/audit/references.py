"""Reference (shadow) models for LiRA and RMIA, and the audit's record layout.

The **reference pool** is the training set ∪ the audit population. Reference model j trains on
a random half of the pool (each record independently with probability ½, seeded by j) with the
*same* training code and configuration as the target — DP-SGD with the target's σ for the DP
target, plain SGD for the non-private positive control — so for every candidate record some
reference models are IN and some OUT. Each model's logits on the whole pool are stored, keyed by
a hash of everything that determines them (data version, split, preprocessing, model, training,
privacy parameters, seed, j), so unchanged runs reuse them instead of retraining.

A cache entry cannot lie: it is written atomically and carries its key and a SHA-256 of what it
holds; an entry that is missing, cut short, unreadable, under another key or failing its checksum is
rebuilt (retrained), never used and never a crash (:func:`read_reference`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpml import io
from dpml.audit.signals import logits_of
from dpml.config import Config
from dpml.train.fit import fit


@dataclass(frozen=True)
class AuditRecords:
    """Pool coordinates: rows 0..n_train−1 are the training set, then the audit population."""

    pool_x: np.ndarray
    pool_y: np.ndarray
    n_train: int
    members: np.ndarray  # pool indices of member candidates (from the training set)
    nonmembers: np.ndarray  # pool indices of non-member candidates (audit population, first half)
    population: np.ndarray  # pool indices of population records z (audit population, second half)

    @property
    def candidates(self) -> np.ndarray:
        return np.r_[self.members, self.nonmembers]


def audit_records(
    x_train: np.ndarray, y_train: np.ndarray, x_audit: np.ndarray, y_audit: np.ndarray, max_records: int, seed: int
) -> AuditRecords:
    """Balanced candidates: m members from train, m non-members and the population from the audit set."""
    rng = np.random.default_rng(seed)
    n_train, n_audit = x_train.shape[0], x_audit.shape[0]
    order = rng.permutation(n_audit)
    half = n_audit // 2
    m = min(max_records, n_train, half)
    if m < 10:
        raise ValueError(f"the audit needs ≥ 20 audit-population records, got {n_audit}: raise split.audit_fraction")
    nonmembers = n_train + order[:m]
    population = n_train + order[half:]
    members = rng.choice(n_train, size=m, replace=False)
    return AuditRecords(
        np.concatenate([x_train, x_audit]), np.concatenate([y_train, y_audit]), n_train, members, nonmembers, population
    )


def reference_key(config: Config, data_version: str, private: bool, noise_multiplier: float | None, index: int) -> str:
    payload = {
        "data": data_version,
        "split": config.split.model_dump(mode="json"),
        "preprocess": config.preprocess.model_dump(mode="json"),
        "model": config.model.model_dump(mode="json"),
        "train": config.train.model_dump(mode="json", exclude={"device", "physical_batch_size", "world_size"}),
        "dp": config.dp.model_dump(mode="json") if private else None,
        "sigma": noise_multiplier if private else None,
        "audit_seed": config.audit.seed,
        "max_records": config.audit.max_records,
        "index": index,
        "private": private,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def reference_path(config: Config, key: str) -> Path:
    return Path(config.paths.cache) / "references" / f"{key}.npz"


def _checksum(logits: np.ndarray, inside: np.ndarray) -> str:
    digest = hashlib.sha256()
    for array in (np.ascontiguousarray(logits, dtype=np.float32), np.ascontiguousarray(inside, dtype=bool)):
        digest.update(str(array.shape).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def write_reference(path: Path, key: str, logits: np.ndarray, inside: np.ndarray, seconds: float) -> None:
    """Store one reference model's logits atomically, with its key and checksum."""
    logits = logits.astype(np.float32)
    io.write_npz(
        path,
        logits=logits,
        inside=inside,
        seconds=np.array(seconds),
        key=np.array(key),
        checksum=np.array(_checksum(logits, inside)),
    )


def read_reference(path: Path, key: str) -> dict[str, np.ndarray] | None:
    """The stored entry under ``key``, or None when it is absent or cannot be trusted (then it is removed)."""
    if not path.exists():
        return None
    try:
        stored = io.read_npz(path)
        valid = (
            str(stored["key"]) == key
            and stored["logits"].ndim == 2
            and stored["inside"].shape == stored["logits"].shape[:1]
            and str(stored["checksum"]) == _checksum(stored["logits"], stored["inside"])
        )
    except Exception:  # noqa: BLE001 - a cut-short zip, a missing field, garbage: all mean "rebuild"
        valid = False
    if not valid:
        path.unlink(missing_ok=True)
        return None
    return stored


def is_stored(config: Config, data_version: str, private: bool, noise_multiplier: float | None, index: int) -> bool:
    """Whether reference model ``index`` has a cache entry (read and checked only when it is used)."""
    return reference_path(config, reference_key(config, data_version, private, noise_multiplier, index)).exists()


def train_reference(
    config: Config,
    records: AuditRecords,
    n_classes: int,
    data_version: str,
    *,
    private: bool,
    noise_multiplier: float | None,
    index: int,
) -> dict[str, Any]:
    """Train reference model ``index`` on a seeded random half of the pool (or reuse it)."""
    key = reference_key(config, data_version, private, noise_multiplier, index)
    path = reference_path(config, key)
    stored = read_reference(path, key)
    if stored is not None:
        return {
            "index": index,
            "private": private,
            "reused": True,
            "seconds": float(stored["seconds"]),
            "path": str(path),
        }
    start = time.perf_counter()
    rng = np.random.default_rng([config.audit.seed, index, int(private)])
    inside = rng.random(records.pool_x.shape[0]) < 0.5
    result = fit(
        config,
        records.pool_x[inside],
        records.pool_y[inside],
        n_classes,
        private=private,
        noise_multiplier=noise_multiplier,
        seed=10_000 + 97 * index + int(private),
        noise_seed=20_000 + 97 * index + int(private),
    )
    seconds = time.perf_counter() - start
    write_reference(path, key, logits_of(result.model, records.pool_x), inside, seconds)
    return {"index": index, "private": private, "reused": False, "seconds": seconds, "path": str(path)}


def load_references(
    config: Config, data_version: str, private: bool, noise_multiplier: float | None, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """(N, pool, k) logits and (N, pool) IN masks of the stored reference models."""
    logits, inside = [], []
    for index in range(count):
        key = reference_key(config, data_version, private, noise_multiplier, index)
        stored = read_reference(reference_path(config, key), key)
        if stored is None:
            raise RuntimeError(
                f"reference model {index} ({'private' if private else 'control'}) is missing from the "
                f"cache {reference_path(config, key)} after training it; run the audit again"
            )
        logits.append(stored["logits"].astype(np.float64))
        inside.append(stored["inside"])
    return np.stack(logits), np.stack(inside)
