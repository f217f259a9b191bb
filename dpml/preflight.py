"""Pre-flight: everything that can be checked before training is checked before the ledger reserves ε.

:func:`preflight` runs at the start of every pipeline run (CLI, Prefect flow) and again inside the
train stage before its reservation (so ``dvc repro`` and ``dpml stage train`` get it too). It checks,
in order, and stops at the first problem with one line naming the key, value or file:

1. the device (``train.device: cuda`` on a machine without CUDA);
2. the noise-seed variable (``DPML_NOISE_SEED`` must be a non-negative integer when set; a fixed seed
   is allowed — ``dvc repro`` needs it — but warned about, and recorded on the release);
3. that the data, artifact, cache, ledger and MLflow artifact folders are writable;
4. the MLflow store: created, migrated or repaired under its lock (:func:`dpml.tracking.store.prepare_store`),
   or, for a server, reachable;
5. the ledger: readable, not from a newer dpml, and its unit key present and its own;
6. a table's header: every declared column (label, features, id) is in the file;
7. for a run of the workspace's DVC pipeline, its default DVC remote (a local one must be writable),
   where registration pushes the release's records (:mod:`dpml.provenance`).

The configuration itself was validated when it was loaded, and the records are read by the ingest
stage, which runs before any spend.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dpml.data.records import DataError
from dpml.data.tables import check_columns
from dpml.ledger.ledger import LedgerError, ledger_of
from dpml.ledger.db import is_postgres, sqlite_file, without_password
from dpml.provenance import ProvenanceError, default_remote, is_dvc_pipeline_run
from dpml.tracking.store import StoreError, is_server, prepare_store, sqlite_path
from dpml.train.noise import NOISE_SEED_VARIABLE

if TYPE_CHECKING:
    from dpml.config import Config


class PreflightError(ValueError):
    """A run that cannot succeed, found before any privacy budget was spent."""


class FixedNoiseSeedWarning(UserWarning):
    """``DPML_NOISE_SEED`` is set: the release is private only while that value stays secret."""


def check_device(preference: str) -> None:
    """``train.device: cuda`` needs a CUDA device; ``auto`` and ``cpu`` always work."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise PreflightError(
            f"train.device = 'cuda': no CUDA device is available on this machine (torch "
            f"{torch.__version__}); use train.device: auto (CUDA when present, else CPU) or cpu"
        )


def noise_seed_is_fixed() -> bool:
    """True when the operator fixed the noise seed (reproducible, and private only while secret)."""
    return bool(os.environ.get(NOISE_SEED_VARIABLE, "").strip())


def check_noise_seed() -> None:
    """``DPML_NOISE_SEED``, when set, must be an integer in [0, 2⁶³); a fixed seed is warned about."""
    text = os.environ.get(NOISE_SEED_VARIABLE, "").strip()
    if not text:
        return
    try:
        value = int(text)
    except ValueError:
        raise PreflightError(
            f"{NOISE_SEED_VARIABLE} = {text!r}: must be a non-negative integer (or unset, for a "
            "fresh secret seed per run)"
        ) from None
    if not 0 <= value < 2**63:
        raise PreflightError(f"{NOISE_SEED_VARIABLE} = {text!r}: must be in [0, 2^63)")
    warnings.warn(
        f"{NOISE_SEED_VARIABLE} is set: the noise is reproducible, and the release is private only while "
        "that value stays secret (recorded on the MLflow run and model version as noise_seed.fixed=true; "
        "the value itself is never written)",
        FixedNoiseSeedWarning,
        stacklevel=2,
    )


def check_writable(key: str, folder: str | Path) -> None:
    """Create ``folder`` if needed and write (then remove) a file in it."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=".dpml-preflight-", dir=folder)
        os.close(handle)
        os.unlink(name)
    except OSError as error:
        raise PreflightError(
            f"{key} = {str(folder)!r}: cannot write there ({error.strerror or error}); choose a "
            "writable folder or free some space"
        ) from None


def folders(config: Config) -> dict[str, Path]:
    """Every folder a run writes to, by the key that names it."""
    out = {
        "paths.data": Path(config.paths.data),
        "paths.artifacts": Path(config.paths.artifacts),
        "paths.cache": Path(config.paths.cache),
        "paths.metrics": Path(config.paths.metrics_folder()),
    }
    for key, uri in (("tracking.uri", config.tracking.uri), ("tracking.registry_uri", config.tracking.registry)):
        database = sqlite_path(uri)
        if database is not None:
            out.setdefault(key, database.parent)
    if not is_server(config.tracking.uri):  # a server keeps its own artifacts
        out["tracking.artifact_root"] = Path(config.tracking.artifact_root)
    if not is_postgres(config.ledger.location()):
        out["ledger.url" if config.ledger.url else "ledger.path"] = sqlite_file(config.ledger.location()).parent
    return out


def preflight(config: Config) -> None:
    """Run every check (module docstring); raise :class:`PreflightError` at the first failure."""
    check_device(config.train.device)
    check_noise_seed()
    for key, folder in folders(config).items():
        check_writable(key, folder)
    try:
        prepare_store(config.tracking)
    except StoreError as error:
        raise PreflightError(str(error)) from None
    try:
        ledger_of(config.ledger).check_unit_key()
    except LedgerError as error:
        key = "ledger.url" if config.ledger.url else "ledger.path"
        raise PreflightError(f"{key} = {without_password(config.ledger.location())!r}: {error}") from None
    check_table_header(config)
    check_dvc_remote(config)


def check_dvc_remote(config: Config) -> None:
    """A run that registration will record in DVC has a default DVC remote to push its records to."""
    root = Path.cwd()
    if is_dvc_pipeline_run(config, root) is not None:
        return
    try:
        name, url = default_remote(root)
    except ProvenanceError as error:
        raise PreflightError(str(error)) from None
    if "://" not in url:
        check_writable(f"DVC remote {name!r}", Path(url))


def check_table_header(config: Config) -> None:
    """A csv/parquet source's header holds every column the configuration names (no record is read)."""
    data = config.data
    kind, _, rest = data.source.partition(":")
    if kind not in ("csv", "parquet"):
        return
    try:
        check_columns(
            Path(rest),
            kind,
            data.named_columns(),
            what="column(s) named under data:",
            separator=data.separator,
            encoding=data.encoding,
        )
    except DataError as error:
        raise PreflightError(str(error)) from None
