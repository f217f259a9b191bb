"""Which Prefect API a ``dpml run`` talks to, decided once at the edge, and the temporary server it may start.

Resolution, in order (:func:`prefect_api`):

1. ``--prefect-api URL`` on the command line;
2. Prefect's own setting ``PREFECT_API_URL`` (the environment variable, or the active Prefect profile);
3. a temporary server for this run alone, when Prefect's ephemeral mode is allowed
   (``PREFECT_SERVER_ALLOW_EPHEMERAL_MODE``, on in Prefect's default profile); otherwise the run is refused
   before any work.

The chosen URL is put in place for the flow run through Prefect's scoped settings
(``prefect.settings.temporary_settings``: a context variable, never ``os.environ``); the flow reads it
back from its own client, logs it, passes it to its Dask workers explicitly and returns it for the
summary (``flows/pipeline.py``).

**Why dpml starts the temporary server itself.** Prefect 3's ephemeral API is a ``uvicorn`` subprocess in
the caller's process group: Ctrl-C in a terminal reaches it too, it dies while the flow engine still
reports states to it, and the run ends minutes later in ``ConnectError``; SIGTERM to dpml left it
running. dpml starts the same server (Prefect's application, the same database under ``PREFECT_HOME``)
in a session of its own, so the terminal's signals reach dpml only; stops it on the way out of every
run, after Prefect's log and event queues are drained into it; and asks the kernel to kill it should
dpml itself die without cleaning up (:func:`dpml.interrupts.die_with_parent`).
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from dpml.preflight import PreflightError

STARTUP_TIMEOUT_S = 180.0
"""A first start migrates a fresh database: on a 2-core machine this can exceed Prefect's default 20 s."""

STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PrefectApi:
    """The Prefect API of a run and where that choice came from."""

    url: str
    origin: str  # "--prefect-api", "PREFECT_API_URL" or "temporary server"

    def describe(self) -> str:
        return f"{self.url} ({self.origin})"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Runs in the server's process before uvicorn: die with dpml, even when dpml is SIGKILLed.
_LAUNCHER = (
    "import runpy, sys; from dpml.interrupts import die_with_parent; die_with_parent(int(sys.argv[1])); "
    "sys.argv = ['uvicorn', *sys.argv[2:]]; runpy.run_module('uvicorn', run_name='__main__')"
)


def _server_command(port: int) -> list[str]:
    import prefect

    return [
        sys.executable,
        "-c",
        _LAUNCHER,
        str(os.getpid()),
        "--app-dir",
        str(Path(prefect.__file__).parent.parent),
        "--factory",
        "prefect.server.api.server:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]


def _server_environment() -> dict[str, str]:
    """The caller's environment and Prefect settings (as Prefect's own ephemeral server gets them), no UI, no
    analytics; dpml's source folder importable (the launcher imports :mod:`dpml.interrupts`)."""
    from prefect.settings import get_current_settings

    source = str(Path(__file__).resolve().parent.parent)
    env = {
        **os.environ,
        **get_current_settings().to_environment_variables(exclude_unset=True),
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH", "")) if p)
    return env


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's session, SIGKILL after :data:`STOP_TIMEOUT_S`."""
    if process.poll() is not None:
        return
    for signum, wait in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _start(log: IO[bytes], deadline: float) -> tuple[subprocess.Popen[bytes], str]:
    """One try: the server on a fresh port; returns it once it answers, or once it has ended or the time is up."""
    port = _free_port()
    process = subprocess.Popen(
        _server_command(port),
        env=_server_environment(),
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    while process.poll() is None and time.monotonic() < deadline and not _healthy(url):
        time.sleep(0.2)
    return process, url


@contextmanager
def _one_start_at_a_time() -> Iterator[None]:
    """Temporary servers share Prefect's database (under ``PREFECT_HOME``) and migrate it when they start;
    Prefect guards its migrations against threads only, so two runs starting at once on a fresh database
    could race. They start one after the other (an advisory lock beside the database, freed by the kernel
    if its holder dies)."""
    from prefect.settings import PREFECT_HOME

    home = Path(PREFECT_HOME.value()).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "dpml-temporary-server.lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def temporary_server(timeout: float = STARTUP_TIMEOUT_S, tries: int = 3) -> Iterator[str]:
    """Prefect's API server on 127.0.0.1 and a free port, in its own session, for the duration of the block;
    yields its API URL (``http://127.0.0.1:PORT/api``). A server that ends while starting (its port taken
    in the meantime) is tried again on another port."""
    with tempfile.TemporaryFile() as log:
        process: subprocess.Popen[bytes] | None = None
        try:
            with _one_start_at_a_time():
                deadline = time.monotonic() + timeout
                for _ in range(tries):
                    process, url = _start(log, deadline)
                    if process.poll() is None and time.monotonic() < deadline:
                        break
                    _stop(process)
                else:
                    log.seek(0)
                    tail = " ".join(log.read().decode(errors="replace").strip().splitlines()[-3:])
                    raise RuntimeError(
                        f"the temporary Prefect server did not start within {timeout:.0f} s"
                        + (f" (exit status {process.returncode})" if process and process.returncode else "")
                        + (f": {tail}" if tail else "")
                        + "; set PREFECT_API_URL (or pass --prefect-api) to a running Prefect server"
                    )
            yield url
        finally:
            if process is not None:
                _stop(process)


def configured_api() -> PrefectApi | None:
    """Prefect's ``PREFECT_API_URL`` setting (environment or active profile), or None."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    return PrefectApi(str(url).rstrip("/"), "PREFECT_API_URL") if url else None


def _drain_prefect_queues() -> None:
    """Send Prefect's queued logs and events to the API now, while it still answers."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        try:
            service.drain_all(timeout=5)
        except RuntimeError:  # never started
            pass


@contextmanager
def prefect_api(flag: str | None = None) -> Iterator[PrefectApi]:
    """Resolve the run's Prefect API once (module docstring), start the temporary server if that is the
    answer, and put the URL in place for the block through Prefect's scoped settings."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED, temporary_settings

    chosen = PrefectApi(flag.rstrip("/"), "--prefect-api") if flag else configured_api()
    if chosen is None and not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        raise PreflightError(
            "no Prefect API: pass --prefect-api URL or set PREFECT_API_URL to a running Prefect "
            "server, or allow a temporary one (PREFECT_SERVER_ALLOW_EPHEMERAL_MODE=true)"
        )
    with _server_if(chosen) as api, temporary_settings(updates={PREFECT_API_URL: api.url}):
        try:
            yield api
        finally:
            _drain_prefect_queues()


@contextmanager
def _server_if(chosen: PrefectApi | None) -> Iterator[PrefectApi]:
    if chosen is not None:
        yield chosen
        return
    with temporary_server() as url:
        yield PrefectApi(url, "temporary server")
