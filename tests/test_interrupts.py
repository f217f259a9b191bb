"""Stopping a run from outside (docs/explanations/reliability.md: stopping a run): a Prefect cancellation, Ctrl-C
and SIGTERM.

Real parts throughout: real signals (to the process, and to its process group as a terminal sends Ctrl-C),
real ``dpml`` subprocesses on the default Prefect engine with its temporary server, a real Prefect server
(the test session's) for the cancellation, the real ledger and MLflow store; every process a run started is
watched with psutil and must be gone once it has ended.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import REPO, small_params, write_params
from dpml.interrupts import Cancelled, StopRequests, Terminated, termination_raises
from dpml.ledger.ledger import Ledger

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
ENV.pop("DPML_NOISE_SEED", None)
ENV.pop("MLFLOW_TRACKING_URI", None)
ENV.pop("PREFECT_API_URL", None)  # the default engine resolves its own API (a temporary server)


# ------------------------------------------------------------------------------------------ in-process


def test_sigterm_raises_and_a_stop_swallowed_by_a_gc_callback_comes_again(capfd: pytest.CaptureFixture[str]) -> None:
    """A signal's exception raised inside a weakref callback is swallowed by Python; it must come again."""

    class Thing:
        pass

    def callback(_: Any) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):  # the handler runs here, inside the callback: its exception is swallowed
            pass

    before = signal.getsignal(signal.SIGTERM)
    with termination_raises():
        thing = Thing()
        ref = weakref.ref(thing, callback)
        with pytest.raises(Terminated):
            del thing
            gc.collect()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.01)
        assert ref() is None
    assert signal.getsignal(signal.SIGTERM) is before
    assert "Exception ignored" not in capfd.readouterr().err


def test_a_cancellation_swallowed_by_a_gc_callback_comes_again(capfd: pytest.CaptureFixture[str]) -> None:
    class Thing:
        pass

    with StopRequests() as stops:

        def callback(_: Any) -> None:
            stops.request("cancelled while collecting")
            for _ in range(10_000):  # the wake's handler raises here, inside the callback: swallowed
                pass

        with pytest.raises(Cancelled, match="cancelled while collecting"):
            with stops.stoppable():
                thing = Thing()
                ref = weakref.ref(thing, callback)
                del thing
                gc.collect()
                threading.Event().wait(5)
        assert ref() is None
    assert "Exception ignored" not in capfd.readouterr().err


def test_a_stop_request_wakes_the_main_thread_only_inside_a_stoppable_region() -> None:
    with StopRequests() as stops:
        threading.Timer(0.3, stops.request, ("cancelled from elsewhere",)).start()
        started = time.monotonic()
        with pytest.raises(Cancelled, match="cancelled from elsewhere"):
            with stops.stoppable():
                threading.Event().wait(20)  # blocked in a wait: woken by the signal
        assert time.monotonic() - started < 5
    with StopRequests() as stops:
        stops.request("too late")
        time.sleep(0.2)  # outside a region: nothing happens here ...
        with pytest.raises(Cancelled):
            stops.checkpoint()  # ... until the next safe point


def _sleeping_worker(collective: Any) -> None:
    time.sleep(600)


def test_an_interrupted_distributed_launch_leaves_no_process_and_its_children_ignore_ctrl_c() -> None:
    from dpml.train.distributed import spawn

    me = psutil.Process()
    seen: dict[int, psutil.Process] = {}
    blocked: list[bool] = []
    earlier = {p.pid for p in children_of(me.pid)}  # other tests' pool workers (spawn_main too) are not this launch's

    def interrupt_once_both_run() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            workers = [p for p in children_of(me.pid) if "spawn_main" in command_line(p) and p.pid not in earlier]
            seen.update({p.pid: p for p in workers})
            if len(workers) == 2:
                time.sleep(2)
                for p in workers:  # SIGINT (bit 2) blocked for life: a terminal's Ctrl-C never reaches them
                    mask = int(Path(f"/proc/{p.pid}/status").read_text().split("SigBlk:")[1].split()[0], 16)
                    blocked.append(bool(mask & (1 << (signal.SIGINT - 1))))
                break
            time.sleep(0.1)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]

    # Ctrl-C as a terminal delivers it: Python's own SIGINT handler (an earlier test in the session may have
    # left another one installed, and then no KeyboardInterrupt would come)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt_once_both_run, daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            spawn(2, "cpu", _sleeping_worker)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(seen) == 2 and blocked == [True, True]
    assert time.monotonic() - started < 150
    assert not [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


CHILD = """
import os, sys, time
from dpml.interrupts import die_with_parent
die_with_parent(os.getppid())
time.sleep(600)
"""

PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_child_tied_to_its_parent_dies_with_it_even_by_sigkill() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    child = psutil.Process(int(parent.stdout.readline()))
    time.sleep(2)
    assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    parent.kill()
    parent.wait()
    _, alive = psutil.wait_procs([child], timeout=10)
    assert not alive


# ------------------------------------------------------------------------------------------ the Prefect API


def test_the_prefect_api_is_the_flag_then_prefect_s_setting_then_a_temporary_server() -> None:
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED, temporary_settings

    from dpml.preflight import PreflightError
    from flows.prefect_api import PrefectApi, prefect_api

    environment = dict(os.environ)
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        with prefect_api("http://127.0.0.1:8/api/") as api:
            assert api == PrefectApi("http://127.0.0.1:8/api", "--prefect-api")
            assert PREFECT_API_URL.value() == api.url  # in Prefect's scoped settings for the run
        with prefect_api(None) as api:
            assert api == PrefectApi("http://127.0.0.1:9/api", "PREFECT_API_URL")
    with temporary_settings(updates={PREFECT_SERVER_EPHEMERAL_ENABLED: False}, restore_defaults={PREFECT_API_URL}):
        with pytest.raises(PreflightError, match="no Prefect API: pass --prefect-api URL"):
            with prefect_api(None):
                pass
    assert dict(os.environ) == environment  # nothing written to the process's environment


@pytest.mark.exhaustive  # ≈ 1 minute: two servers migrating a fresh database one after the other
def test_two_temporary_servers_started_at_once_on_a_fresh_prefect_home_both_serve_each_in_its_own_session(
    tmp_path: Path,
) -> None:
    import contextvars

    from prefect.settings import PREFECT_HOME, temporary_settings

    from flows.prefect_api import temporary_server

    urls: list[str] = []
    errors: list[BaseException] = []
    release = threading.Event()

    def serve() -> None:
        try:
            with temporary_server() as url:
                urls.append(url)
                release.wait(300)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    # Servers already running (Prefect's own ephemeral server, started by an earlier test's in-process flow,
    # lives as long as this process) are not this test's.
    earlier = {p.pid for p in psutil.Process().children()}
    with temporary_settings(updates={PREFECT_HOME: tmp_path / "prefect-home"}):
        threads = [threading.Thread(target=contextvars.copy_context().run, args=(serve,)) for _ in range(2)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 400
        while len(urls) + len(errors) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        servers = [p for p in psutil.Process().children() if "create_app" in command_line(p) and p.pid not in earlier]
        import httpx

        healthy = [httpx.get(f"{url}/health", timeout=10).status_code for url in urls]
        own_sessions = [os.getsid(p.pid) != os.getsid(0) for p in servers]
        release.set()
        for thread in threads:
            thread.join(60)
    assert errors == [] and healthy == [200, 200] and own_sessions == [True, True]
    _, alive = psutil.wait_procs(servers, timeout=15)
    assert alive == []


# ------------------------------------------------------------------------------------------ dpml runs


def command_line(process: psutil.Process) -> str:
    """The process's command line, or "" once it has ended (a zombie or gone)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def children_of(pid: int, recursive: bool = False) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=recursive)
    except psutil.Error:
        return []


class Descendants:
    """Every process descended from ``root`` while it runs (sampled), to check that none outlives it."""

    def __init__(self, root: int) -> None:
        self.root, self.seen = root, {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.is_set():
            for p in children_of(self.root, recursive=True):
                self.seen.setdefault(p.pid, p)
            time.sleep(0.1)

    def left_behind(self, grace_s: float = 10) -> list[str]:
        self._done.set()
        self._thread.join()
        _, alive = psutil.wait_procs(list(self.seen.values()), timeout=grace_s)
        return [command_line(p)[:200] for p in alive if command_line(p)]


def slow_training_params(workdir: Path, **sections: dict[str, Any]) -> Path:
    """Training long enough (≈ minutes) that a stop lands inside it; everything after it kept small."""
    params = small_params(
        workdir,
        train={"epochs": 3000},
        audit={"references": 1, "attacks": ["loss"], "bootstrap": 0, "white_box_canaries": 0, "black_box_canaries": 0},
        **sections,
    )
    return write_params(workdir / "params.yaml", params)


def start_dpml(workdir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``dpml ARGS`` in its own process group (a terminal's foreground job), output to files."""
    with open(workdir / "out.txt", "w") as out, open(workdir / "err.txt", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "dpml", *args],
            cwd=workdir,
            env=env or ENV,
            text=True,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )


def wait_until_training(workdir: Path, process: subprocess.Popen[str], timeout: float = 300) -> int:
    """Block until the run's spend has ``started`` (the trainer has the records); return the spend id."""
    ledger_path = workdir / "ledger.db"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, (workdir / "err.txt").read_text()[-3000:]
        if ledger_path.exists():
            ledger = Ledger(ledger_path, 1e-5)
            started = [
                s.id
                for s in ledger.spends(counted_only=False)
                if "started" in [kind for kind, _ in ledger.events(s.id)]
            ]
            if started:
                return started[-1]
        time.sleep(0.3)
    raise AssertionError("training did not start in time: " + (workdir / "err.txt").read_text()[-3000:])


def ended_in_one_line(workdir: Path, process: subprocess.Popen[str], started: float, bound_s: float) -> str:
    """The run ended within ``bound_s`` of ``started`` with exactly one ``dpml:`` line and no traceback."""
    process.wait(timeout=bound_s + 60)
    took = time.monotonic() - started
    stderr = (workdir / "err.txt").read_text()
    assert took < bound_s, f"took {took:.1f} s: {stderr[-2000:]}"
    lines = [line for line in stderr.splitlines() if line.startswith("dpml:") and not line.startswith("dpml: warning:")]
    assert len(lines) == 1 and "Traceback" not in stderr and "ConnectError" not in stderr, stderr[-3000:]
    return lines[0]


def spent_and_settled(workdir: Path, spend_id: int) -> None:
    """The started spend still counts, settled by the ``interrupted`` event; nothing was registered."""
    ledger = Ledger(workdir / "ledger.db", 1e-5)
    assert spend_id in {s.id for s in ledger.spends()}
    assert "interrupted" in [kind for kind, _ in ledger.events(spend_id)]
    if (workdir / "mlflow.db").exists():
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
        assert client.search_model_versions("name='dpml-test-model'") == []


@pytest.mark.exhaustive  # ≈ 35–60 s on 2 cores: dpml starts its temporary Prefect server, then trains
def test_ctrl_c_stops_dpml_run_within_seconds_and_its_temporary_prefect_server_with_it(workdir: Path) -> None:
    """The terminal's Ctrl-C goes to the whole process group; the temporary Prefect server is in a session of
    its own, so the flow engine can still report the crash, and the run ends in one line, promptly."""
    slow_training_params(workdir)
    run = start_dpml(workdir, "run")
    spend_id = wait_until_training(workdir, run)
    family = Descendants(run.pid)
    time.sleep(2)
    [server] = [p for p in family.seen.values() if "prefect.server.api.server:create_app" in command_line(p)]
    assert os.getsid(server.pid) != os.getsid(run.pid)  # its own session: the terminal's Ctrl-C misses it
    os.killpg(run.pid, signal.SIGINT)
    line = ended_in_one_line(workdir, run, time.monotonic(), bound_s=30)
    assert run.returncode == 130, line  # (the one line says what ended the run otherwise)
    assert line.startswith("dpml: interrupted (Ctrl-C) during train: ε = ") and f"ledger spend {spend_id}" in line
    assert family.left_behind() == []
    spent_and_settled(workdir, spend_id)


@pytest.mark.parametrize("command", ["run", pytest.param("tune", marks=pytest.mark.exhaustive)])
def test_sigterm_stops_a_local_run_within_seconds_saying_what_was_spent(workdir: Path, command: str) -> None:
    sections = (
        {"tune": {"distribution": "fixed", "mean": 1, "space": {"train.learning_rate": [0.5]}}}
        if command == "tune"
        else {}
    )
    slow_training_params(workdir, **sections)
    run = start_dpml(workdir, command, "--engine", "local")
    spend_id = wait_until_training(workdir, run)
    family = Descendants(run.pid)
    time.sleep(1)
    os.kill(run.pid, signal.SIGTERM)
    line = ended_in_one_line(workdir, run, time.monotonic(), bound_s=20)
    assert run.returncode == 143, line
    stage = "tune" if command == "tune" else "train"
    assert line.startswith(f"dpml: terminated (SIGTERM) during {stage}: ε = "), line
    assert family.left_behind() == []
    spent_and_settled(workdir, spend_id)


def test_sigterm_before_training_spends_nothing(workdir: Path) -> None:
    slow_training_params(workdir)
    env = {**ENV, "DPML_FAULT": "before:train@SIGTERM"}
    run = start_dpml(workdir, "run", "--engine", "local", env=env)
    line = ended_in_one_line(workdir, run, time.monotonic(), bound_s=120)
    assert run.returncode == 143 and line == "dpml: terminated (SIGTERM) during train: nothing was spent"
    assert not (workdir / "ledger.db").exists() or Ledger(workdir / "ledger.db", 1e-5).spends() == []


def _flow_run_of(client: Any, params: Path, timeout: float = 120) -> Any:
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["privacy_audited_pipeline"])))
        mine = [r for r in runs if r.parameters.get("params_path") == str(params)]
        if mine:
            return mine[0]
        time.sleep(0.5)
    raise AssertionError("the flow run did not appear on the Prefect server")


@pytest.mark.slow
def test_a_prefect_cancellation_stops_dpml_run_before_registration(workdir: Path, prefect_harness: None) -> None:
    """``prefect flow-run cancel`` (the same state change through the client) on a flow run that ``dpml run``
    started itself, against a Prefect server: the run stops inside training, the flow run ends Cancelled,
    the spend stays counted, nothing is registered."""
    from prefect import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL
    from prefect.states import State

    params = slow_training_params(workdir)
    run = start_dpml(workdir, "run", "--params", str(params), "--prefect-api", str(PREFECT_API_URL.value()))
    spend_id = wait_until_training(workdir, run)
    family = Descendants(run.pid)
    with get_client(sync_client=True) as client:
        flow_run = _flow_run_of(client, params)
        assert flow_run.state.is_running()
        client.set_flow_run_state(flow_run.id, State(type=StateType.CANCELLING))  # what `prefect flow-run cancel` does
        line = ended_in_one_line(workdir, run, time.monotonic(), bound_s=30)
        final = client.read_flow_run(flow_run.id).state
    assert run.returncode == 130, line
    assert final.type == StateType.CANCELLED and f"ledger spend {spend_id}" in final.message
    assert line.startswith(f"dpml: the Prefect flow run {flow_run.name!r} was cancelled during train: ε = "), line
    assert family.left_behind() == []
    spent_and_settled(workdir, spend_id)


# ------------------------------------------------------------------------------------------ world_size


@pytest.mark.exhaustive  # ≈ 2–3 minutes on 2 cores: a whole Prefect run with Dask reference models
def test_train_world_size_2_runs_end_to_end_under_the_default_prefect_engine(workdir: Path) -> None:
    """The release and the audit's reference models (in Dask worker processes) each train on 2 gloo processes."""
    write_params(
        workdir / "params.yaml",
        small_params(
            workdir,
            train={"world_size": 2, "epochs": 2},
            audit={
                "references": 1,
                "attacks": ["loss", "lira-online"],
                "bootstrap": 0,
                "white_box_canaries": 0,
                "black_box_canaries": 0,
            },
        ),
    )
    run = start_dpml(workdir, "run")
    family = Descendants(run.pid)
    run.wait(timeout=900)
    out, err = (workdir / "out.txt").read_text(), (workdir / "err.txt").read_text()
    assert run.returncode == 0, err[-3000:]
    assert "daemonic" not in err and "Traceback" not in err
    import json

    assert json.loads((workdir / "artifacts" / "train" / "metrics.json").read_text())["train_world_size"] == 2
    assert "reference models 2 (2 stored, 0 trained)" in out  # trained by the Dask workers, found by the audit
    assert (
        re.search(r"Prefect +flow run .* via API http://127\.0\.0\.1:", out)
        and "(a temporary server for this run" in out
    )
    assert family.left_behind() == []


@pytest.mark.exhaustive  # ≈ 2 minutes on 2 cores
def test_sigterm_during_distributed_reference_models_leaves_no_dask_or_training_process(workdir: Path) -> None:
    """SIGTERM while Dask workers train the audit's reference models, one of them on 2 processes of its own:
    the workers and their training processes are killed (not asked to finish), the run ends in one line."""
    write_params(
        workdir / "params.yaml",
        small_params(
            workdir,
            train={"world_size": 2, "epochs": 100},  # LiRA needs reference models: the Dask subflow
            audit={
                "references": 1,
                "attacks": ["loss", "lira-online"],
                "bootstrap": 0,
                "white_box_canaries": 0,
                "black_box_canaries": 0,
                "control_epochs": 5000,
            },
        ),
    )
    run = start_dpml(workdir, "run")
    family = Descendants(run.pid)
    spend_id = wait_until_training(workdir, run)
    deadline = time.monotonic() + 600
    while True:  # a Dask worker's own training processes: grandchildren of dpml (after the release's children)
        assert time.monotonic() < deadline, "no Dask worker started training processes"
        if (workdir / "artifacts" / "certify").exists() and any(children_of(p.pid) for p in children_of(run.pid)):
            break
        assert run.poll() is None, (workdir / "err.txt").read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(3)
    os.kill(run.pid, signal.SIGTERM)
    line = ended_in_one_line(workdir, run, time.monotonic(), bound_s=30)
    assert run.returncode == 143 and line.startswith("dpml: terminated (SIGTERM) during audit: ε = "), line
    assert family.left_behind() == []
    spent_and_settled(workdir, spend_id)
