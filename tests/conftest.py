"""Shared fixtures: a small, fast configuration in a temporary working directory."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SHARED_FASHION = REPO.parent / "shared" / "datasets" / "fashion-mnist"

# Every subprocess a test starts (python -m dpml, dvc, prefect) imports the dpml under test, ahead of any
# other copy the interpreter would find (an editable install of another checkout): pytest run from the
# repository imports it from the working directory, a child started in a temporary directory would not.
_PATHS = [str(REPO), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(_PATHS))
# A suite started in the background (`pytest &` in a script, nohup, some CI runners) inherits SIGINT ignored, and
# so would every process a test starts (an ignored signal survives exec): the tests that interrupt a run would
# see it ignore Ctrl-C. The suite puts Python's own handling back, as an interactive terminal gives it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # the harness's server on 2 cores
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


_EMPTY_STORE: list[Path] = []  # one MLflow store created by dpml for the whole session, copied where a test needs one


def an_empty_store(database: Path, artifact_root: Path) -> None:
    """Put at ``database`` the SQLite store dpml's own ``prepare_store`` creates on first use (MLflow's tables
    and migrations, its default experiment rooted at ``artifact_root``), copied from one made once per session:
    creating a store costs seconds of migrations, which every pipeline test would otherwise pay again. Tests of
    store creation itself (tests/test_reliability.py, the README's commands) start without one."""
    import shutil
    import sqlite3
    import tempfile

    from dpml.sections_stores import TrackingConfig
    from dpml.tracking.store import prepare_store

    if not _EMPTY_STORE:
        template = Path(tempfile.mkdtemp(prefix="dpml-empty-store-")) / "mlflow.db"
        assert (
            prepare_store(TrackingConfig(uri=f"sqlite:///{template}", artifact_root=str(template.parent))) == "created"
        )
        _EMPTY_STORE.append(template)
    shutil.copyfile(_EMPTY_STORE[0], database)
    with contextlib.closing(sqlite3.connect(database)) as db, db:
        db.execute(
            "UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0", (str(artifact_root.resolve()),)
        )


def small_params(tmp: Path, *, store: bool = True, **sections: dict[str, Any]) -> dict[str, Any]:
    """The repository's params.yaml made quick (few epochs) and pointed at ``tmp``; its MLflow store
    ``tmp/mlflow.db`` already exists (empty, see ``an_empty_store``) unless ``store`` is false."""
    if store and tmp.is_dir() and not (tmp / "mlflow.db").exists():
        an_empty_store(tmp / "mlflow.db", tmp / "mlartifacts")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"]["epochs"] = 3
    params["dp"] = {"noise_multiplier": 1.0, "delta": 1e-5, "clip_norm": 1.0, "neighbouring": "add-remove"}
    params["tracking"] = {
        "uri": f"sqlite:///{tmp / 'mlflow.db'}",
        "artifact_root": str(tmp / "mlartifacts"),
        "experiment": "dpml-test",
        "model_name": "dpml-test-model",
    }
    params["paths"] = {"data": str(tmp / "data"), "artifacts": str(tmp / "artifacts"), "cache": str(tmp / "cache")}
    params["audit"] |= {"references": 2, "bootstrap": 50}
    params["ledger"] = {"path": str(tmp / "ledger.db"), "epsilon_budget": 1000.0, "delta": 1e-5}
    for name, values in sections.items():
        params.setdefault(name, {}).update(values)
    return params


@pytest.fixture(autouse=True)
def _tracking_uri_does_not_leak() -> Iterator[None]:
    """MLflow's ``set_tracking_uri`` writes MLFLOW_TRACKING_URI into the environment, where the next
    test's subprocesses would inherit a store that is not theirs: restore it after every test."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


def signal_state() -> dict[str, object]:
    """This thread's SIGINT/SIGTERM handlers and blocked signals: what every child process starts from (an
    ignored or blocked SIGINT survives exec, and Python then never raises KeyboardInterrupt in the child)."""

    return {
        "SIGINT handler": signal.getsignal(signal.SIGINT),
        "SIGTERM handler": signal.getsignal(signal.SIGTERM),
        "blocked signals": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    }


@pytest.fixture(autouse=True)
def _signal_state_does_not_leak() -> Iterator[None]:
    """Code that returns leaves the process's signal handling as it found it (a library embedding dpml
    inherits whatever it leaves; a later test's subprocess would ignore Ctrl-C): checked after every test."""
    before = signal_state()
    yield
    after = signal_state()
    if after != before:
        changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
        signal.signal(signal.SIGINT, before["SIGINT handler"])  # type: ignore[arg-type]
        signal.signal(signal.SIGTERM, before["SIGTERM handler"])  # type: ignore[arg-type]
        signal.pthread_sigmask(signal.SIG_SETMASK, before["blocked signals"])  # type: ignore[arg-type]
        pytest.fail(f"this test left the process's signal handling changed (before, after): {changed}")


@pytest.fixture
def float32_on_the_gpu() -> Iterator[None]:
    """Float32 matrix products and cuDNN without TF32 for the test (a comparison of like with like), and after it
    the settings as they were: set for good, they changed what later tests in the process compared."""
    import torch

    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield tmp_path


SHORT_PRIVATE_RUN: dict[str, Any] = dict(
    noise_multiplier=1.0, delta=1e-5, epochs=1, clip_norm=1.0, expected_batch_size=16, learning_rate=0.5, seed=0
)


def trains_without_the_exact_path(model: Any, dataset: Any, **settings: Any) -> Any:
    """A short ``dpml.train_private`` run (:data:`SHORT_PRIVATE_RUN`, updated by ``settings``): the module passed in
    comes back as the result's model, trained in place, with a certified ε and no parameter on the exact path."""
    import torch

    import dpml

    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    result = dpml.train_private(model, dataset, **(SHORT_PRIVATE_RUN | settings))
    assert result.model is model and result.epsilon > 0
    assert result.history["exact_clipping_parameters"] == 0  # every parameter by a layer's shortcut or a rule
    assert any(not torch.equal(before[k], p) for k, p in model.named_parameters())  # it trained
    return result


CHARGED_RUN = {"noise_multiplier": 1.0, "delta": 1e-5, "expected_batch_size": 10, "epsilon_budget": 10.0}
"""The settings of :func:`refused_before_any_charge` and :func:`trains_charged_once` (updated by theirs)."""


def refused_before_any_charge(ledger: Path, model: Any, dataset: Any, match: str, **settings: Any) -> None:
    """``dpml.train_private`` charged to the ledger at ``ledger`` refuses ``model`` (:class:`ClippingUnsupported`
    matching ``match``) before anything is charged."""
    import dpml
    from dpml.ledger.ledger import Ledger
    from dpml.train.clipping_check import ClippingUnsupported

    with pytest.raises(ClippingUnsupported, match=match):
        dpml.train_private(model, dataset, ledger=str(ledger), lineage="records", **(CHARGED_RUN | settings))
    assert not ledger.exists() or Ledger(ledger, 1e-5).spends() == []


def trains_charged_once(ledger: Path, model: Any, dataset: Any, **settings: Any) -> Any:
    """``dpml.train_private`` (one epoch, seed 0) charged to the ledger at ``ledger``: one spend, ε certified within
    the budget."""
    import dpml
    from dpml.ledger.ledger import Ledger

    run = CHARGED_RUN | {"epochs": 1, "seed": 0} | settings
    result = dpml.train_private(model, dataset, ledger=str(ledger), lineage="records", **run)
    assert len(Ledger(ledger, 1e-5).spends()) == 1 and 0 < result.epsilon < run["epsilon_budget"]
    return result


def assert_clips_as_a_per_example_loop(model: Any, loss: Any, x: Any, y: Any, clip: float, exact: Any = ()) -> None:
    """The engine's clipped sums and norms (:func:`dpml.train.clipping.clipped_gradient_sum`) equal a float64 loop
    of one backward pass per example, each from the buffers the batch's pass started from (spectral norm's power
    iteration moves them at every training-mode forward pass), c_i = min(1, C / (‖g_i‖ + 1e-6))."""
    import torch

    from dpml.train.clipping import clipped_gradient_sum

    buffers = {name: b.clone() for name, b in model.named_buffers()}

    def restored() -> None:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])

    sums, norms = clipped_gradient_sum(model, loss, x, y, clip, exact=exact)
    expected_norms, expected_sums = [], {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for i in range(x.shape[0]):
        restored()
        model.zero_grad()
        loss(model(x[i : i + 1]), y[i : i + 1]).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        norm = torch.sqrt(sum(g.square().sum() for g in grads.values()))
        expected_norms.append(norm)
        for name, g in grads.items():
            expected_sums[name] += g * torch.clamp(clip / (norm + 1e-6), max=1.0)
    torch.testing.assert_close(norms, torch.stack(expected_norms), rtol=1e-9, atol=1e-12)
    for name, total in expected_sums.items():
        torch.testing.assert_close(sums[name], total, rtol=1e-9, atol=1e-12)


def write_params(path: Path, params: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def run_pipeline_with_plugin(tmp: Path, plugin: Path, **sections: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """``dpml run --engine local`` in a fresh process in ``tmp`` (as `dvc repro` and a scheduled run start), on
    :func:`small_params` with ``plugin`` listed under ``plugins:``, a loss-only audit and ``sections`` on top."""
    audit = {
        "attacks": ["loss"],
        "references": 0,
        "white_box_canaries": 0,
        "black_box_canaries": 100,
        "control": False,
    } | sections.pop("audit", {})
    params = small_params(tmp, audit=audit, **sections)
    params["plugins"] = [str(plugin)]
    write_params(tmp / "params.yaml", params)
    return subprocess.run(
        [sys.executable, "-m", "dpml.cli", "run", "--engine", "local"],
        cwd=tmp,
        env={**os.environ, "DPML_NOISE_SEED": "7"},
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """One ephemeral Prefect API for the whole test run (≈10 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):  # 30 s by default: too short on a loaded machine
        yield


def postgres_binaries() -> Path | None:
    """The folder of PostgreSQL's server binaries (Debian's layout, then PATH), or None."""
    import glob
    import shutil

    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(folder) / "initdb").exists() and (Path(folder) / "pg_ctl").exists():
            return Path(folder)
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb and shutil.which("pg_ctl") else None


def _as_postgres_user(command: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run its binaries as the ``postgres`` system user then."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A real PostgreSQL server for this test session, on 127.0.0.1 and a free port, trust auth;
    yields its base URL (``postgresql://postgres@127.0.0.1:PORT``). Skipped, saying why, where no
    server binaries exist."""
    import shutil
    import socket
    import subprocess
    import tempfile

    import pwd

    binaries = postgres_binaries()
    if binaries is None:
        pytest.skip(
            "no PostgreSQL server binaries (initdb, pg_ctl) on this machine: the PostgreSQL ledger tests did not run"
        )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip(
                "running as root and there is no 'postgres' user to run the server as (PostgreSQL refuses "
                "root): the PostgreSQL ledger tests did not run"
            )
    root = Path(tempfile.mkdtemp(prefix="dpml-postgres-"))
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run(
        _as_postgres_user(
            [str(binaries / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"]
        ),
        check=True,
        capture_output=True,
    )
    options = f"-p {port} -h 127.0.0.1 -k {root} -c max_connections=200 -c fsync=on"
    subprocess.run(
        _as_postgres_user(
            [str(binaries / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(root / "server.log"), "-w", "start"]
        ),
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run(
            _as_postgres_user([str(binaries / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
            capture_output=True,
        )
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server: str) -> str:
    """A fresh, empty database on the session's PostgreSQL server."""
    import uuid

    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{postgres_server}/postgres", autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {name}")
    return f"{postgres_server}/{name}"


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a ledger test keeps its ledger: a SQLite file, and a database on a real PostgreSQL server."""
    if request.param == "sqlite":
        return str(tmp_path / "l.db")
    return request.getfixturevalue("postgres_url")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers(url: str, server: Any, seconds: float) -> bool:
    """Whether ``url`` answers 200 within ``seconds`` while the ``server`` process is still running."""
    import time
    import urllib.request

    deadline = time.monotonic() + seconds
    while server.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


@contextlib.contextmanager
def serving_mlflow(command: str, arguments: list[str], cwd: Path, log: Path) -> Iterator[str]:
    """``mlflow COMMAND ARGUMENTS`` (``server`` or ``ui``) on 127.0.0.1 and a free port, started in its own
    process group without the test's MLFLOW_* variables; yields its URL once ``/health`` answers and stops
    it (TERM, then KILL) afterwards."""
    import subprocess
    import sys

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    with open(log, "w") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", command, "--host", "127.0.0.1", "--port", str(port), *arguments],
            cwd=cwd,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        if not answers(f"{url}/health", server, 180):
            raise RuntimeError(f"mlflow {command} did not start: {log.read_text()[-3000:]}")
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real ``mlflow server`` on 127.0.0.1 and a free port, as a team would run it: its own backend
    store and a server-side artifact store (``--artifacts-destination``) that clients reach only through
    the server's proxy. Yields ``{"url", "artifacts", "log"}``."""
    root = tmp_path_factory.mktemp("mlflow-server")
    log = root / "server.log"
    with serving_mlflow(
        "server",
        [
            "--backend-store-uri",
            f"sqlite:///{root / 'server.db'}",
            "--artifacts-destination",
            str(root / "artifact-store"),
            "--workers",
            "2",
        ],
        root,
        log,
    ) as url:
        yield {"url": url, "artifacts": root / "artifact-store", "log": log}


@pytest.fixture
def vmapped(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The parameter names each call of the clipping engine's exact per-example path was asked for (calls with
    none left out)."""
    from dpml.train import clipping

    calls: list[list[str]] = []
    exact = clipping.exact_per_example_gradients

    def spy(losses, params):  # type: ignore[no-untyped-def]
        if params:
            calls.append(list(params))
        return exact(losses, params)

    monkeypatch.setattr(clipping, "exact_per_example_gradients", spy)
    return calls
