"""One run at a time in a checkout's output folders: runs that share ``paths.data`` or ``paths.artifacts`` take turns.

Two runs started in one checkout (two ``dpml run``, a ``dpml run`` beside a ``dvc repro``, a scheduled
flow beside a manual one) would otherwise overwrite each other's stage outputs between the spend that
paid for a model and its registration. Each of the two folders has a lock file beside it
(``.<folder>.dpml-run.lock`` in its parent, so the folders hold stage outputs only; an advisory
``flock``, released by the kernel when its holder exits or is killed): a whole run (``dpml run``/``dpml tune``,
either engine, the Prefect flow) holds both from pre-flight to registration, a single stage (``dpml stage NAME``,
what ``dvc repro`` calls) holds them for that stage. A second run waits its turn — it says once who holds the lock
and since when — and then runs against the state the first one left: its pre-flight and its budget check see the
first run's spend. Runs with their own ``paths.data`` and ``paths.artifacts`` run side by side.

Between the stages of a ``dvc repro`` another run can take its turn; the register stage then refuses
outputs that are not those of the spend it is asked to release (:mod:`dpml.stages.spend_outputs`).

The lock is re-entrant within a process (a run holds it and each of its stages takes it again), and
is never taken by the audit's reference-model workers (their run holds it for them).
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING

from dpml.preflight import PreflightError

if TYPE_CHECKING:
    from dpml.config import Config

LOCK_SUFFIX = ".dpml-run.lock"

_held: dict[Path, int] = {}  # lock file → how many times this process holds it (re-entrant)
_guard = threading.Lock()


def locked_folders(config: Config) -> list[tuple[Path, str]]:
    """The folders a run writes stage outputs to (with the key naming each), resolved and in a fixed order
    (no two runs deadlock)."""
    named = {Path(config.paths.artifacts).resolve(): "paths.artifacts", Path(config.paths.data).resolve(): "paths.data"}
    return sorted(named.items())


def lock_file(folder: Path) -> Path:
    """The lock file of ``folder``: beside it, never inside (``data/`` → ``.data.dpml-run.lock``)."""
    return folder.parent / f".{folder.name}{LOCK_SUFFIX}"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _holder(handle: IO[str]) -> str:
    handle.seek(0)
    text = handle.read().strip()
    return text or "another process"


def _open(path: Path, key: str) -> IO[str]:
    """The lock file, its folder created; a folder that cannot be written is refused like pre-flight does."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a+")  # noqa: SIM115 - closed by the caller's with-block
    except OSError as error:
        raise PreflightError(
            f"{key} = {str(path.parent / path.name.removeprefix('.').removesuffix(LOCK_SUFFIX))!r}: "
            f"cannot write there ({error.strerror or error}); choose a writable folder or free "
            "some space"
        ) from None


@contextmanager
def _one(path: Path, key: str, what: str, echo: Callable[[str], None]) -> Iterator[None]:
    with _guard:
        if _held.get(path):
            _held[path] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield
        finally:
            with _guard:
                _held[path] -= 1
        return
    with _open(path, key) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            folder = path.parent / path.name.removeprefix(".").removesuffix(LOCK_SUFFIX)
            echo(
                f"dpml: {folder} is in use by {_holder(handle)}; waiting for it to finish (runs in one "
                "checkout take turns; give this run its own paths.data and paths.artifacts to run side by side)"
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"{what} (pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%H:%M:%S')})\n")
        handle.flush()
        with _guard:
            _held[path] = 1
        try:
            yield
        finally:
            with _guard:
                _held.pop(path, None)
            handle.seek(0)
            handle.truncate()
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def outputs_locked(config: Config, what: str, echo: Callable[[str], None] = _say) -> Iterator[None]:
    """Hold the lock of every folder of :func:`locked_folders` (module docstring); ``what`` names the
    holder for a run that has to wait (``dpml run``, ``stage train``…)."""
    with ExitStack() as stack:
        for folder, key in locked_folders(config):
            stack.enter_context(_one(lock_file(folder), key, what, echo))
        yield
