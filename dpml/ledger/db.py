"""Where the ledger lives: an embedded SQLite file (the default) or a PostgreSQL server many workers share.

The ledger's statements are written once, in SQLite's dialect; :class:`PostgresConnection`
translates the few constructs that differ, in this one place:

- ``BEGIN IMMEDIATE`` (SQLite: take the database's write lock now) → ``BEGIN`` then
  ``pg_advisory_xact_lock(K)``: one lock per ledger database, held until ``COMMIT``/``ROLLBACK``,
  so a reservation's check and insert are one atomic step for every process on every machine;
- ``?`` parameters → ``%s``; ``INSERT OR IGNORE`` → ``ON CONFLICT DO NOTHING``; ``INSERT OR
  REPLACE`` → ``ON CONFLICT (primary key) DO UPDATE``; ``lastrowid`` → ``RETURNING id``;
- the DDL's ``INTEGER PRIMARY KEY AUTOINCREMENT`` / ``REAL`` / ``BLOB`` / ``INTEGER`` →
  ``BIGSERIAL PRIMARY KEY`` / ``DOUBLE PRECISION`` / ``BYTEA`` / ``BIGINT``; ``PRAGMA``s are SQLite's own.

Durability is each engine's: SQLite in WAL mode with ``synchronous=FULL``; PostgreSQL commits are
written to its WAL and fsynced before ``COMMIT`` returns (its defaults). Either way a spend is on
disk before training starts, and a crash or a SIGKILL of a worker leaves it counted.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from dpml.ledger.unit_accounts import LedgerError

POSTGRES_SCHEMES = ("postgresql://", "postgres://")
LOCK_WAIT_SECONDS = 3600.0  # how long a SQLite connection waits for the write lock
LOCK_KEY = 0x64706D6C  # "dpml": the advisory lock that serialises the ledger's transactions

# The primary key of each table an ``INSERT OR REPLACE`` writes to (its ``ON CONFLICT`` target).
_PRIMARY_KEYS = {"unit_shards": ("lineage", "shard"), "history_epsilon": ("key",), "meta": ("key",)}
_SERIAL_TABLES = ("spends", "events", "cohorts")  # tables whose ``id`` the ledger reads back


def is_postgres(location: str | Path) -> bool:
    return str(location).startswith(POSTGRES_SCHEMES)


def sqlite_file(location: str | Path) -> Path:
    """The file of a SQLite location: a path, or a ``sqlite:///path`` URL."""
    text = str(location)
    return Path(text[len("sqlite:///") :]) if text.startswith("sqlite:///") else Path(text)


def without_password(url: str) -> str:
    """A PostgreSQL URL fit for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class SqliteDatabase:
    """The embedded default: one SQLite file (WAL, full fsync)."""

    errors: tuple[type[Exception], ...] = (sqlite3.DatabaseError,)

    def __init__(self, path: Path) -> None:
        self.path = path
        if path.is_dir():
            raise LedgerError(f"{path} is a directory; the ledger is a file in it (e.g. {path / 'ledger.db'})")
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def describe(self) -> str:
        return str(self.path)

    @contextmanager
    def connect(self) -> Iterator[Any]:
        """A connection that waits up to :data:`LOCK_WAIT_SECONDS` for the write lock: reservations are
        serialised and each does its accounting inside the lock, so with many workers the queue can be
        long; it never deadlocks (one lock). A wait beyond that is a clear error, not a traceback."""
        connection = sqlite3.connect(self.path, timeout=LOCK_WAIT_SECONDS, isolation_level=None)
        try:
            _enter_wal_mode(connection, time.monotonic() + LOCK_WAIT_SECONDS)
            connection.execute("PRAGMA synchronous=FULL")
            yield connection
        except sqlite3.OperationalError as error:
            if not _is_busy(error):
                raise
            raise LedgerError(
                f"{self.path}: the ledger stayed locked by other runs for {LOCK_WAIT_SECONDS:.0f} s "
                f"({error}); nothing was recorded by this run — try again"
            ) from None
        finally:
            connection.close()


def _is_busy(error: sqlite3.OperationalError) -> bool:
    return "locked" in str(error) or "busy" in str(error)


def _enter_wal_mode(connection: sqlite3.Connection, deadline: float) -> None:
    """Put the file in WAL mode (persistent: a no-op once it is), waiting for the lock the switch needs.

    SQLite answers the switch of a file that another connection is making or switching at the same moment
    with "database is locked" at once, without calling the busy handler that waits for every other lock:
    two processes that open a new ledger together (a run and whoever watches it) would see one of them fail
    in a millisecond. The switch is retried, 1 ms doubling to 100 ms between tries, until ``deadline``.
    """
    pause = 0.001
    while True:
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if not _is_busy(error) or time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 0.1)


class PostgresCursor:
    """The part of a DB-API cursor the ledger uses, with SQLite's ``lastrowid``."""

    def __init__(self, cursor: Any, lastrowid: int | None = None) -> None:
        self._cursor, self.lastrowid = cursor, lastrowid

    def fetchone(self) -> Any:
        return self._cursor.fetchone() if self._cursor.description else None

    def fetchall(self) -> list[Any]:
        return self._cursor.fetchall() if self._cursor.description else []

    def __iter__(self) -> Iterator[Any]:
        return iter(self.fetchall())


def _plain(value: Any) -> Any:
    """numpy scalars as Python values (the driver adapts only the latter)."""
    return value.item() if isinstance(value, np.generic) else value


def translate(sql: str) -> tuple[str, bool]:
    """A statement in the ledger's SQLite dialect, in PostgreSQL's; and whether it returns the new row's id."""
    text = sql.strip().replace("%", "%%").replace("?", "%s")
    if text.upper().startswith("CREATE TABLE"):
        text = re.sub(r"INTEGER PRIMARY KEY AUTOINCREMENT", "BIGSERIAL PRIMARY KEY", text)
        text = re.sub(r"\bREAL\b", "DOUBLE PRECISION", text)
        text = re.sub(r"\bBLOB\b", "BYTEA", text)
        text = re.sub(r"\bINTEGER\b", "BIGINT", text)
        return text, False
    replace = re.match(r"INSERT OR REPLACE INTO (\w+) \(([^)]*)\)", text)
    if replace:
        table, columns = replace.group(1), [c.strip() for c in replace.group(2).split(",")]
        keys = _PRIMARY_KEYS[table]
        updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in columns if c not in keys)
        text = text.replace("INSERT OR REPLACE INTO", "INSERT INTO", 1)
        return f"{text} ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {updates}", False
    if text.startswith("INSERT OR IGNORE INTO"):
        return text.replace("INSERT OR IGNORE INTO", "INSERT INTO", 1) + " ON CONFLICT DO NOTHING", False
    serial = re.match(r"INSERT INTO (\w+)\b", text)
    if serial and serial.group(1) in _SERIAL_TABLES:
        return text + " RETURNING id", True
    return text, False


class PostgresConnection:
    """A PostgreSQL connection that speaks the ledger's SQLite dialect (module docstring)."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection

    @property
    def in_transaction(self) -> bool:
        """Inside an explicit transaction (as ``sqlite3.Connection.in_transaction``)."""
        from psycopg.pq import TransactionStatus  # lazy: PostgreSQL's driver only for a PostgreSQL ledger

        return bool(self._connection.info.transaction_status != TransactionStatus.IDLE)

    def execute(self, sql: str, parameters: Sequence[Any] = ()) -> PostgresCursor:
        head = sql.strip().upper()
        if head.startswith("PRAGMA"):
            return PostgresCursor(self._connection.cursor())
        if head == "BEGIN IMMEDIATE":
            self._connection.execute("BEGIN")
            return PostgresCursor(self._connection.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,)))
        text, returns_id = translate(sql)
        cursor = self._connection.execute(text, tuple(_plain(v) for v in parameters))
        if returns_id:
            return PostgresCursor(cursor, int(cursor.fetchone()[0]))
        return PostgresCursor(cursor)


class PostgresDatabase:
    """A ledger on a PostgreSQL server (``postgresql://user[:password]@host:port/database``)."""

    def __init__(self, url: str) -> None:
        import psycopg  # lazy: PostgreSQL's driver only for a PostgreSQL ledger

        self.url = url
        self.errors: tuple[type[Exception], ...] = (psycopg.Error,)

    def describe(self) -> str:
        return without_password(self.url)

    @contextmanager
    def connect(self) -> Iterator[PostgresConnection]:
        import psycopg  # lazy: PostgreSQL's driver only for a PostgreSQL ledger

        connection = psycopg.connect(self.url, autocommit=True, connect_timeout=30)
        try:
            yield PostgresConnection(connection)
        finally:
            connection.close()


def open_database(location: str | Path) -> SqliteDatabase | PostgresDatabase:
    """The ledger database at ``location``: a PostgreSQL URL, a ``sqlite:///`` URL or a file path."""
    if is_postgres(location):
        return PostgresDatabase(str(location))
    return SqliteDatabase(sqlite_file(location))
