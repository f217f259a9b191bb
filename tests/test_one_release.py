"""One run, one release, where the user points it (issue: routing, concurrency, interrupts, retries).

Everything here is real: `dpml` subprocesses, SQLite MLflow stores (a separate registry store too),
real signals sent by the process to itself at named points of registration (``DPML_FAULT=point@SIGINT``),
a one-time store error at such a point (``point@error``), SIGKILL mid-training, and two runs started at
once in one checkout.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlflow
import pytest
from mlflow import MlflowClient

from conftest import REPO, small_params, write_params
from dpml.ledger.ledger import Ledger
from dpml.ledger.spending import Charge, reserve_and_start
from dpml.sections_stores import TrackingConfig
from dpml.stages.register import REGISTERING, identity_of, registering_processes
from dpml.tracking.store import prepare_store
from dpml.tracking.runs import clean_up_unreleased_runs

ENV = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | {
    "PYTHONPATH": str(REPO),
    "DPML_NOISE_SEED": "11",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}
MODEL = "dpml-one-release"


def dpml(
    workdir: Path, *args: str, fault: str | None = None, env: dict[str, str] | None = None, timeout: int = 600
) -> subprocess.CompletedProcess[str]:
    environment = {**ENV, **(env or {})}
    if fault:
        environment["DPML_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "dpml.cli", *args],
        cwd=workdir,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def quick_params(workdir: Path, **sections: dict[str, Any]) -> Path:
    params = small_params(
        workdir,
        audit={"references": 1, "attacks": ["loss"], "bootstrap": 0, "white_box_canaries": 0, "black_box_canaries": 0},
        gate={"epsilon_budget": 100.0},
        **sections,
    )
    params["tracking"]["model_name"] = MODEL
    return write_params(workdir / "params.yaml", params)


def store(workdir: Path, registry: str | None = None) -> MlflowClient:
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=registry or uri)


def versions(client: MlflowClient) -> list[Any]:
    return sorted(client.search_model_versions(f"name = '{MODEL}'"), key=lambda v: int(v.version))


def champion(client: MlflowClient) -> str | None:
    return client.get_registered_model(MODEL).aliases.get("champion")


def ledger(workdir: Path) -> Ledger:
    return Ledger(workdir / "ledger.db", 1e-5)


def events(workdir: Path, spend_id: int) -> list[str]:
    return [kind for kind, _ in ledger(workdir).events(spend_id)]


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("dpml: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


# ------------------------------------------------------------------ interrupts, store errors, repeats


EVERY_FAULT_IN_REGISTRATION = (
    ("register:before_version@SIGINT", 130, "KILLED"),
    ("register:after_version@SIGINT", 130, "KILLED"),
    ("register:after_alias@SIGINT", 130, "KILLED"),
    ("register:before_version@error", 1, "FAILED"),
    ("register:after_version@error", 1, "FAILED"),
    ("register:after_alias@error", 1, "FAILED"),
)


@pytest.mark.exhaustive  # ≈ 4 minutes on 2 cores: CI runs it with the exhaustive set
def test_registration_is_all_or_nothing_and_once_per_spend(workdir: Path) -> None:
    """A SIGINT at each step of registration, or a one-time store error in it, leaves no version, the
    alias where it was and the MLflow run KILLED/FAILED; the spend stays counted and unreleased, and the
    next `dpml stage register` releases it once — a repeat gets the same version back."""
    quick_params(workdir)
    assert dpml(workdir, "run", "--engine", "local").returncode == 0
    client = store(workdir)
    [first] = versions(client)
    assert champion(client) == first.version
    for stage in ("train", "certify", "audit", "gate"):  # spend 2, ready to register
        done = dpml(workdir, "stage", stage)
        assert done.returncode == 0, done.stderr[-2000:]
    spend = ledger(workdir).spends()[-1].id

    for fault, code, status in EVERY_FAULT_IN_REGISTRATION:
        runs_before = {r.info.run_id for r in client.search_runs(["1"])}
        result = dpml(workdir, "stage", "register", fault=fault)
        assert result.returncode == code, (fault, result.stderr[-2000:])
        assert [v.version for v in versions(client)] == [first.version], fault  # nothing left registered
        assert champion(client) == first.version, fault  # the alias is back on the last finished release
        [parent] = [
            r
            for r in client.search_runs(["1"])
            if r.info.run_id not in runs_before and "mlflow.parentRunId" not in r.data.tags
        ]
        assert parent.info.status == status, fault
        assert "released" not in events(workdir, spend), fault

    done = dpml(workdir, "stage", "register")
    assert done.returncode == 0, done.stderr[-2000:]
    first_again, second = versions(client)
    assert first_again.version == first.version and champion(client) == second.version
    assert second.tags["ledger.spend_id"] == str(spend)
    assert events(workdir, spend).count("released") == 1

    again = dpml(workdir, "stage", "register")  # a repeated (or retried) registration: the same version back
    assert again.returncode == 0, again.stderr[-2000:]
    assert [v.version for v in versions(client)] == [first.version, second.version]
    assert f'"model_uri": "models:/{MODEL}/{second.version}"' in again.stdout
    assert events(workdir, spend).count("released") == 1


def test_register_refuses_outputs_that_are_not_the_spends(workdir: Path) -> None:
    """Killed mid-training, the new spend's `spend.json` sits beside the previous run's model: registering
    would release the old model under the new spend. Refused in one line; nothing is registered."""
    quick_params(workdir)
    assert dpml(workdir, "run", "--engine", "local").returncode == 0
    client = store(workdir)
    [first] = versions(client)

    killed = dpml(workdir, "run", "--engine", "local", fault="train:started")
    assert killed.returncode == -signal.SIGKILL
    refused = dpml(workdir, "stage", "register")
    assert refused.returncode == 1
    assert "never finished training" in error_line(refused)
    assert [v.version for v in versions(client)] == [first.version]


@pytest.mark.exhaustive
def test_register_refuses_an_audit_and_gate_of_another_model(workdir: Path) -> None:
    """A train stage re-run by hand leaves the audit and the gate of the previous model beside the new one:
    refused, naming the audit; after the later stages run, the new spend registers."""
    quick_params(workdir)
    assert dpml(workdir, "run", "--engine", "local").returncode == 0
    client = store(workdir)
    [first] = versions(client)
    assert dpml(workdir, "stage", "train").returncode == 0  # a new model; audit and gate are the old one's
    refused = dpml(workdir, "stage", "register")
    assert refused.returncode == 1
    assert re.search(r"audit\.json: the audit stage judged another model than spend \d+", error_line(refused))
    assert [v.version for v in versions(client)] == [first.version]
    for stage in ("certify", "audit", "gate", "register"):
        done = dpml(workdir, "stage", stage)
        assert done.returncode == 0, done.stderr[-2000:]
    assert len(versions(client)) == 2


def empty_registry(tmp_path: Path) -> tuple[TrackingConfig, MlflowClient, str]:
    """A prepared MLflow store with the experiment ``dpml`` and the registered model, nothing else."""
    config = TrackingConfig(
        uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        artifact_root=str(tmp_path / "art"),
        experiment="dpml",
        model_name=MODEL,
    )
    prepare_store(config)
    client = store(tmp_path)
    experiment = client.create_experiment("dpml")
    client.create_registered_model(MODEL)
    return config, client, experiment


def test_the_next_registration_withdraws_versions_of_failed_and_killed_runs(tmp_path: Path) -> None:
    """Versions left behind by runs that ended FAILED or KILLED (an older dpml, a crash inside MLflow) are
    withdrawn before the next release registers, and the alias returns to the newest finished passing one."""
    config, client, experiment = empty_registry(tmp_path)
    made = {}
    for status in ("FINISHED", "FAILED", "KILLED"):
        run = client.create_run(experiment, tags={"ledger.spend_id": "7"})
        made[status] = client.create_model_version(
            MODEL, source=str(tmp_path), run_id=run.info.run_id, tags={"gate.passed": "true"}
        ).version
        client.set_terminated(run.info.run_id, status)
    client.set_registered_model_alias(MODEL, "champion", made["KILLED"])
    cleaned = clean_up_unreleased_runs(config)
    assert len(cleaned) == 2 and {c["spend_id"] for c in cleaned} == {"7"}
    assert [v.version for v in versions(client)] == [made["FINISHED"]]
    assert champion(client) == made["FINISHED"]
    assert clean_up_unreleased_runs(config) == []  # nothing left to withdraw


def test_a_running_run_is_withdrawn_only_when_every_process_registering_its_spend_is_gone(tmp_path: Path) -> None:
    """A run left RUNNING (its process killed outright mid-registration) is judged by the processes the ledger
    recorded as registering its spend (``registering`` events; the MLflow run carries no process id or host):
    all of them gone on this host → its version withdrawn and the run ended KILLED; one alive, one on another
    host, or none recorded (a run of another ledger) → left alone."""
    config, client, experiment = empty_registry(tmp_path)
    ledger = Ledger(str(tmp_path / "ledger.db"), 1e-5, unit_key=tmp_path / "unit.key")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, here = int(gone.stdout), socket.gethostname()
    registered_by = {
        "dead here": [(here, dead)],
        "alive here": [(here, os.getpid())],
        "dead elsewhere": [("another-host", dead)],
        "dead and alive": [(here, dead), (here, os.getpid())],
        "not recorded": [],
    }
    runs = {}
    for case, processes in registered_by.items():
        spend = reserve_and_start(Charge(ledger, "v1", None, case, 10.0))
        for host, pid in processes:
            ledger.record_event(spend.id, REGISTERING, {"host": host, "pid": pid})
        run = client.create_run(experiment, tags={"ledger.spend_id": str(spend.id), "ledger.spend": identity_of(spend)})
        client.create_model_version(MODEL, source=str(tmp_path), run_id=run.info.run_id, tags={"gate.passed": "true"})
        runs[case] = run.info.run_id
    assert clean_up_unreleased_runs(config) == []  # without the ledger no process is known: nothing is touched
    cleaned = clean_up_unreleased_runs(config, registering_processes(ledger))
    assert [c["run_id"] for c in cleaned] == [runs["dead here"]]
    assert client.get_run(runs["dead here"]).info.status == "KILLED"
    assert {v.run_id for v in versions(client)} == set(runs.values()) - {runs["dead here"]}
    assert all(client.get_run(runs[case]).info.status == "RUNNING" for case in registered_by if case != "dead here")


@pytest.mark.exhaustive
def test_two_runs_started_at_once_in_one_checkout_each_release_their_own_model(workdir: Path) -> None:
    """`dpml run & dpml run` with different ε in one checkout: both succeed, the second waits its turn, and
    each version carries the network its own run trained under its own spend, with its own ε."""
    quick_params(workdir)
    targets = ("1", "2.5")
    running = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dpml.cli",
                "run",
                "--engine",
                "local",
                "--set",
                f"dp.target_epsilon={target}",
                "--set",
                "dp.noise_multiplier=null",
            ],
            cwd=workdir,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for target in targets
    ]
    outcomes = [run.communicate(timeout=900) for run in running]
    assert [run.returncode for run in running] == [0, 0], [err[-2000:] for _, err in outcomes]
    assert sum("is in use by dpml run" in err for _, err in outcomes) == 1  # exactly one had to wait
    client = store(workdir)
    released = versions(client)
    assert len(released) == 2
    networks = set()
    for version in released:
        run = client.get_run(version.run_id)
        target = float(run.data.params["dp.target_epsilon"])
        assert float(version.tags["dp.epsilon"]) == pytest.approx(target, rel=1e-3)  # the version's ε is its run's
        spend = int(version.tags["ledger.spend_id"])
        assert dict(ledger(workdir).events(spend))["released"]["model_uri"] == f"models:/{MODEL}/{version.version}"
        with tempfile.TemporaryDirectory() as folder:
            local = mlflow.artifacts.download_artifacts(
                artifact_uri=client.get_model_version_download_uri(MODEL, version.version),
                dst_path=folder,
                tracking_uri=client.tracking_uri,
                registry_uri=client._registry_uri,
            )
            [network] = Path(local).rglob("network.pt2")
            networks.add(hashlib.sha256(network.read_bytes()).hexdigest())
        summary = next(out for out, _ in outcomes if f"models:/{MODEL}/{version.version}" in out)
        assert re.search(r"certified epsilon\s+" + re.escape(version.tags["dp.epsilon"]), summary)
    assert len(networks) == 2  # two models, not one registered twice


# ------------------------------------------------------------------------------------------- routing


def test_precedence_flag_over_environment_over_file_over_default(tmp_path: Path) -> None:
    """Each destination resolves by one rule, and says where it came from; variables dpml cannot follow for
    a whole run are refused when the configuration loads, naming them."""
    from dpml.config import ConfigError, load

    dp = {"dp": {"target_epsilon": 1.0}}
    file_only = write_params(tmp_path / "p.yaml", {**dp, "tracking": {"uri": "sqlite:///file.db"}})
    variables = {
        "MLFLOW_TRACKING_URI": "sqlite:///env.db",
        "MLFLOW_REGISTRY_URI": "sqlite:///reg.db",
        "MLFLOW_EXPERIMENT_NAME": "env-exp",
    }
    default = load(write_params(tmp_path / "d.yaml", dp), environ={}).tracking
    assert (default.uri, default.registry, default.experiment) == ("sqlite:///mlflow.db", "sqlite:///mlflow.db", "dpml")
    assert default.origins == {"uri": "default", "registry_uri": "default", "experiment": "default"}
    in_file = load(file_only, environ={}).tracking
    assert (in_file.uri, in_file.registry) == ("sqlite:///file.db", "sqlite:///file.db")
    assert in_file.origins["uri"] == f"{file_only} tracking.uri"
    from_environment = load(file_only, environ=variables).tracking
    assert (from_environment.uri, from_environment.registry, from_environment.experiment) == (
        "sqlite:///env.db",
        "sqlite:///reg.db",
        "env-exp",
    )
    assert from_environment.origins == {
        "uri": "environment MLFLOW_TRACKING_URI",
        "registry_uri": "environment MLFLOW_REGISTRY_URI",
        "experiment": "environment MLFLOW_EXPERIMENT_NAME",
    }
    flagged = load(file_only, ["tracking.uri=sqlite:///flag.db", "tracking.experiment=flag-exp"], environ=variables)
    assert (flagged.tracking.uri, flagged.tracking.experiment) == ("sqlite:///flag.db", "flag-exp")
    assert flagged.tracking.origins["uri"] == "--set tracking.uri"
    assert flagged.tracking.registry == "sqlite:///reg.db"  # the registry's own variable still applies
    assert flagged.flat()["tracking.uri"] == "sqlite:///flag.db"  # what the run logs
    assert load(file_only, environ={"MLFLOW_TRACKING_URI": "  "}).tracking.uri == "sqlite:///file.db"  # blank: unset
    for variable in ("MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        with pytest.raises(ConfigError, match=variable):
            load(file_only, environ={variable: "3"})
    for spelling in ({**dp, "tracking": {"origins": {"uri": "x"}}},):
        with pytest.raises(ConfigError, match="tracking.origins"):
            load(write_params(tmp_path / "o.yaml", spelling), environ={})
    with pytest.raises(ConfigError, match="tracking.origins"):
        load(file_only, ["tracking.origins={}"], environ={})


def test_mlflow_variables_route_the_whole_run(workdir: Path) -> None:
    """MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI / MLFLOW_EXPERIMENT_NAME send the run, its model version and
    its experiment where they say — nothing reaches the store params.yaml names — and the summary says so;
    a variable dpml cannot follow is refused before any spend, in one line."""
    params = quick_params(workdir, store=False)  # nothing may reach the store params.yaml names: none exists
    (workdir / "team").mkdir()
    team, registry = f"sqlite:///{workdir / 'team' / 'team.db'}", f"sqlite:///{workdir / 'team' / 'registry.db'}"
    variables = {"MLFLOW_TRACKING_URI": team, "MLFLOW_REGISTRY_URI": registry, "MLFLOW_EXPERIMENT_NAME": "team-exp"}
    done = dpml(workdir, "run", "--engine", "local", env=variables)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (workdir / "mlflow.db").exists()
    routed = MlflowClient(tracking_uri=team, registry_uri=registry)
    experiment = routed.get_experiment_by_name("team-exp")
    [run] = [r for r in routed.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    assert run.data.params["tracking.uri"] == team and run.data.params["tracking.experiment"] == "team-exp"
    [version] = routed.search_model_versions(f"name = '{MODEL}'")
    assert version.run_id == run.info.run_id
    assert not MlflowClient(tracking_uri=team, registry_uri=team).search_registered_models()  # not split
    for label, value, origin in (
        ("tracking store", team, "MLFLOW_TRACKING_URI"),
        ("model registry", registry, "MLFLOW_REGISTRY_URI"),
        ("experiment", "team-exp", "MLFLOW_EXPERIMENT_NAME"),
    ):
        assert re.search(rf"{label}\s+{re.escape(value)}\s+\(environment {origin}\)", done.stdout), done.stdout
    assert f"--backend-store-uri {team} --registry-store-uri {registry}" in done.stdout

    spends = len(Ledger(workdir / "ledger.db", 1e-5).spends())
    refused = dpml(workdir, "run", "--engine", "local", "--params", str(params), env={"MLFLOW_RUN_ID": "3"})
    assert refused.returncode == 2 and "MLFLOW_RUN_ID" in error_line(refused)
    assert len(Ledger(workdir / "ledger.db", 1e-5).spends()) == spends


def test_runs_in_one_process_each_go_where_their_configuration_says(workdir: Path) -> None:
    """Pipeline stages and `train_private` calls in one process, each with another store: each lands in its
    own, and MLflow's process-wide URIs and the environment are neither read nor changed."""
    import torch

    import dpml
    from dpml.config import load
    from dpml.stages import run_all, run_stage

    before = (mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI"), os.environ.get("MLFLOW_REGISTRY_URI"))
    params = small_params(
        workdir,
        store=False,  # no store where a run that honours its configuration never writes
        audit={
            "references": 0,
            "attacks": ["loss"],
            "bootstrap": 0,
            "white_box_canaries": 0,
            "black_box_canaries": 0,
            "control": False,
        },
        gate={"epsilon_budget": 100.0},
    )
    uris = [f"sqlite:///{workdir / f'{name}.db'}" for name in ("a", "b")]
    configs = []
    for name, uri in zip(("a", "b"), uris, strict=True):
        params["tracking"] |= {"uri": uri, "model_name": MODEL, "experiment": f"exp-{name}"}
        configs.append(load(write_params(workdir / f"{name}.yaml", params), environ={}))
    run_all(configs[0], echo=lambda _: None)
    release = run_stage("register", configs[1])  # the same outputs, released in another store
    assert release["tracking_uri"] == uris[1] and release["model_uri"] == f"models:/{MODEL}/1"
    for uri, name in zip(uris, ("a", "b"), strict=True):
        client = MlflowClient(uri, registry_uri=uri)
        assert [e.name for e in client.search_experiments() if e.name.startswith("exp-")] == [f"exp-{name}"]
        assert len(client.search_model_versions(f"name = '{MODEL}'")) == 1

    class Blobs(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return torch.full((3,), float(i % 2)), i % 2

    for name in ("c", "d"):
        dpml.train_private(
            torch.nn.Linear(3, 2),
            Blobs(),
            epochs=1,
            clip_norm=1.0,
            delta=1e-3,
            noise_multiplier=1.0,
            sample_rate=0.5,
            mlflow_tracking_uri=f"sqlite:///{workdir / f'{name}.db'}",
            mlflow_experiment=f"api-{name}",
            mlflow_artifact_location=str(workdir / name),
            tune_physical_batch=False,
        )
        client = MlflowClient(f"sqlite:///{workdir / f'{name}.db'}")
        [experiment] = [e for e in client.search_experiments() if e.name.startswith("api-")]
        assert experiment.name == f"api-{name}" and len(client.search_runs([experiment.experiment_id])) == 1
    after = (mlflow.get_tracking_uri(), os.environ.get("MLFLOW_TRACKING_URI"), os.environ.get("MLFLOW_REGISTRY_URI"))
    assert after == before
    assert not (workdir / "mlruns").exists() and not (workdir / "mlflow.db").exists()


def test_the_lock_makes_a_second_run_wait_and_is_released_by_a_kill(workdir: Path) -> None:
    """A holder of the checkout's lock (here a process that then gets SIGKILLed) makes `dpml stage` wait
    with one line naming it; the kernel frees the lock with the holder, and the stage then runs."""
    quick_params(workdir)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time\n"
                "from dpml.config import load\n"
                "from dpml.stages.checkout_lock import outputs_locked\n"
                "with outputs_locked(load('params.yaml', environ={}), 'the holder'):\n"
                "    print('held', flush=True); time.sleep(600)\n"
            ),
        ],
        cwd=workdir,
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    waiting = subprocess.Popen(
        [sys.executable, "-m", "dpml.cli", "stage", "ingest"],
        cwd=workdir,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    said = waiting.stderr.readline()  # blocks until the stage reaches the lock and says who holds it
    assert re.search(r"is in use by the holder \(pid \d+ on .*, since \d\d:\d\d:\d\d\); waiting", said), said
    time.sleep(2)
    assert waiting.poll() is None  # still waiting for the holder
    assert not (workdir / "data" / "raw").exists()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    _, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, err
    assert (workdir / "data" / "raw" / "records.npz").exists()


@pytest.mark.exhaustive
def test_a_retried_registration_under_prefect_registers_one_version(workdir: Path, prefect_harness: None) -> None:
    """A store error once inside registration, under the Prefect engine: the register task's retry
    registers the spend's model once — the failed attempt's version withdrawn, its MLflow run FAILED."""
    from prefect.settings import PREFECT_API_URL

    quick_params(workdir)
    done = dpml(
        workdir, "run", fault="register:after_alias@error", env={"PREFECT_API_URL": str(PREFECT_API_URL.value())}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    client = store(workdir)
    [version] = versions(client)
    assert champion(client) == version.version
    parents = [r for r in client.search_runs(["1"]) if "mlflow.parentRunId" not in r.data.tags]
    assert sorted(r.info.status for r in parents) == ["FAILED", "FINISHED"]
    assert client.get_run(version.run_id).info.status == "FINISHED"
    [spend] = ledger(workdir).spends()
    assert events(workdir, spend.id).count("released") == 1 and version.tags["ledger.spend_id"] == str(spend.id)
