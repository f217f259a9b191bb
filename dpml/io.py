"""Atomic file writes: a killed run never leaves a half-written artifact.

Each writer writes to a temporary file in the target's folder and renames it into place
(``os.replace`` is atomic on POSIX), so readers see the old file or the new one, never a part.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np


@contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; on success rename it to ``target``."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(handle)
    temp = Path(temp_name)
    try:
        yield temp
        os.replace(temp, target)
    finally:
        if temp.exists():
            temp.unlink()


def write_json(target: str | Path, payload: Any) -> None:
    with atomic_path(target) as temp:
        temp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=_jsonable) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def write_text(target: str | Path, text: str) -> None:
    with atomic_path(target) as temp:
        temp.write_text(text)


def write_npz(target: str | Path, **arrays: np.ndarray) -> None:
    with atomic_path(target) as temp:
        with open(temp, "wb") as handle:
            np.savez(handle, **arrays)


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as archive:
        return {key: archive[key] for key in archive.files}


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
