"""The MLflow store, made ready before any privacy budget is spent, and safe against kills and races.

A SQLite store is created or migrated exactly once, under a file lock beside it (``<db>.lock``):

- **created** in a temporary file in the same folder and renamed into place, so the store's path only
  ever holds a fully migrated database (a kill during creation leaves a stray temporary file, which the
  next run removes under the lock);
- **migrated** on a copy, renamed over the original when the migration finished, so a kill during an
  upgrade leaves the old, intact store;
- **rolled back** first when a killed writer left a hot journal (``<db>-journal``): SQLite restores the
  last committed state, so nothing below reads or copies half-written pages;
- **repaired** when it is half-migrated (a kill inside MLflow's own creation, by an older dpml or by
  ``mlflow ui``): a store at a schema revision other than the head that holds no run and no registered
  model is set aside as ``<db>.broken-<time>`` and created afresh; one that holds runs is migrated on a
  copy, and if that fails it is left untouched with a clear error.

Registration (registered model, version, ``champion`` alias) runs under the same lock (:func:`store_lock`),
so concurrent runs on one store all register and the alias moves to the newest passing release. A
tracking *server* (``http(s)://``) serialises writes itself; it is checked for reachability only.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dpml.sections_stores import TrackingConfig


class StoreError(RuntimeError):
    """The MLflow store cannot be used; the message names it and what to do."""


def tracking_uri(config: TrackingConfig) -> str:
    """The run's tracking store: ``config.uri``, resolved once at the edge (:mod:`dpml.routing`)."""
    return config.uri


def stores(config: TrackingConfig) -> list[str]:
    """The stores a run writes: the tracking store, and the model registry when it is another one."""
    return [config.uri] + ([config.registry] if config.registry != config.uri else [])


def client(config: TrackingConfig) -> Any:
    """An ``MlflowClient`` naming both of the run's stores explicitly, so that neither MLflow's
    process-wide URIs nor its environment variables can send any call elsewhere."""
    from mlflow import MlflowClient  # lazy: MLflow only where a run is recorded

    return MlflowClient(tracking_uri=config.uri, registry_uri=config.registry)


def is_server(uri: str) -> bool:
    """A tracking *server* (``http(s)://``): it owns its artifact store and serialises writes itself."""
    return uri.startswith(("http://", "https://"))


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for any other store)."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///"))


@contextmanager
def store_lock(config: TrackingConfig, uri: str | None = None) -> Iterator[None]:
    """Hold the file lock of the SQLite store ``uri`` (default: the model registry, where releases are
    registered); a no-op for a tracking server, which serialises writes itself."""
    path = sqlite_path(uri or config.registry)
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare_store(config: TrackingConfig) -> str:
    """Create, migrate or repair the tracking store and, when it is another one, the model registry (see the
    module docstring); return what was done."""
    done = [_prepare_one(uri, config) for uri in stores(config)]
    return done[0] if len(done) == 1 else f"tracking store {done[0]}, model registry {done[1]}"


def _prepare_one(uri: str, config: TrackingConfig) -> str:
    path = sqlite_path(uri)
    if path is None:
        return _check_server(uri, config)
    try:
        with store_lock(config, uri):
            for stray in path.parent.glob(f".{path.name}.creating-*"):
                stray.unlink(missing_ok=True)  # left by a run killed while creating the store
            if not path.exists():
                _create(path, config)
                return "created"
            _roll_back_interrupted_write(path)
            revision = _revision(path)
            if revision == _head():
                return "ready"
            if _holds_nothing(path):
                broken = path.with_name(f"{path.name}.broken-{int(time.time())}")
                os.replace(path, broken)
                for suffix in ("-journal", "-wal", "-shm"):  # never leave them to be read as the new store's
                    if path.with_name(path.name + suffix).exists():
                        os.replace(path.with_name(path.name + suffix), broken.with_name(broken.name + suffix))
                _create(path, config)
                return f"repaired (a half-created store was set aside as {broken.name})"
            _upgrade_copy(path, revision)
            return f"migrated from schema {revision}"
    except OSError as error:
        raise StoreError(
            f"{_key_of(uri, config)} = {uri!r}: cannot use {path} ({error.strerror or error}); choose a writable folder"
        ) from None


def _head() -> str:
    from mlflow.store.db.utils import _get_latest_schema_revision  # lazy: MLflow only where a run is recorded

    return str(_get_latest_schema_revision())


def _roll_back_interrupted_write(path: Path) -> None:
    """Let SQLite roll back a transaction a killed writer left in a hot journal (``<db>-journal``).

    A process killed inside a write transaction (MLflow runs all its migrations in one) can leave pages
    of the unfinished transaction in the database file; only the journal beside it can restore them, and
    SQLite does so on the first read through a *writable* connection. A read-only connection refuses
    (``SQLITE_READONLY_ROLLBACK``), and a copy of the file alone would carry the half-written pages, so
    this runs before the store is inspected or copied. It is a no-op when there is nothing to roll back,
    and SQLite's own locks keep it from touching a transaction that a live process still holds.
    """
    try:
        with sqlite3.connect(path, timeout=30) as db:
            db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        db.close()
    except sqlite3.DatabaseError:
        return  # not a database, or unreadable: inspected (and reported) below


def _revision(path: Path) -> str | None:
    """The store's alembic revision (None: no revision recorded — never finished creating)."""
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            row = db.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.DatabaseError:
        return None
    return None if row is None else str(row[0])


def _holds_nothing(path: Path) -> bool:
    """True when the store has no run and no registered model (nothing would be lost by recreating it)."""
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            for table in ("runs", "registered_models", "model_versions"):
                if table in tables and db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]:  # noqa: S608
                    return False
    except sqlite3.DatabaseError:
        return not path.stat().st_size  # unreadable: only an empty file is safe to replace
    return True


def _initialise(path: Path, artifact_root: str) -> None:
    """Run MLflow's own creation and migrations on the database at ``path``."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore  # lazy: MLflow only where a run is recorded

    store = SqlAlchemyStore(f"sqlite:///{path}", str(Path(artifact_root).resolve()))
    store.engine.dispose()


def _create(path: Path, config: TrackingConfig) -> None:
    """MLflow's creation on a temporary file, renamed into place: a failure or a kill leaves no store."""
    temp = path.with_name(f".{path.name}.creating-{os.getpid()}")
    try:
        _initialise(temp, config.artifact_root)
        os.replace(temp, path)
    except Exception as error:  # noqa: BLE001 - whatever MLflow or SQLite raise, say which store and why
        reason = (
            str(error).strip().splitlines()[0].split(" [SQL:")[0][:200] if str(error).strip() else type(error).__name__
        )
        raise StoreError(
            f"cannot create the MLflow store {path}: {reason} (is the disk full or the folder "
            "read-only?); nothing was created and nothing was spent"
        ) from None
    finally:
        temp.unlink(missing_ok=True)


def _upgrade_copy(path: Path, revision: str | None) -> None:
    from mlflow.store.db.utils import _upgrade_db, create_sqlalchemy_engine  # lazy: MLflow only where a run is recorded

    temp = path.with_name(f".{path.name}.creating-{os.getpid()}")
    try:
        shutil.copy2(path, temp)
        engine = create_sqlalchemy_engine(f"sqlite:///{temp}")
        try:
            _upgrade_db(engine)
        finally:
            engine.dispose()
        os.replace(temp, path)
    except Exception as error:  # noqa: BLE001 - any migration failure leaves the original untouched
        raise StoreError(
            f"MLflow store {path} is at schema {revision} and could not be migrated to {_head()} "
            f"({type(error).__name__}: {str(error).strip().splitlines()[0][:200]}); "
            "it was not modified — back it up and run "
            f"`mlflow db upgrade sqlite:///{path}`"
        ) from None
    finally:
        temp.unlink(missing_ok=True)


def _key_of(uri: str, config: TrackingConfig) -> str:
    """The configuration key a store's URI came from, and the variable when the environment set it."""
    key = "tracking.uri" if uri == config.uri else "tracking.registry_uri"
    origin = (config.origins or {}).get(key.removeprefix("tracking."), "")
    return f"{key} ({origin.removeprefix('environment ')})" if origin.startswith("environment ") else key


def _check_server(uri: str, config: TrackingConfig | None = None) -> str:
    """A tracking server or other store must answer a cheap query (one quick try: a pre-flight check)."""
    from mlflow import MlflowClient  # lazy: MLflow only where a run is recorded

    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
    try:
        with _environment_while_checking(quick):
            MlflowClient(tracking_uri=uri, registry_uri=uri).search_experiments(max_results=1)
    except Exception as error:  # noqa: BLE001 - whatever the client raises, the store is not usable
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        key = _key_of(uri, config) if config is not None else "tracking.uri"
        raise StoreError(
            f"{key} = {uri!r}: the MLflow store does not answer ({first}); start the server or fix the URI"
        ) from None
    return "reachable"


@contextmanager
def _environment_while_checking(values: dict[str, str]) -> Iterator[None]:
    """MLflow's HTTP retry settings for one quick reachability check, then as they were: the run's own
    requests keep MLflow's (or the user's) retries for transient errors."""
    before = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        os.environ.setdefault(name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
