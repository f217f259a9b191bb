"""Unattended runs: misconfigurations cost nothing, kills leave a usable store and an honest ledger,
caches cannot lie, and every user error is one line.

Faults are real: subprocesses killed by SIGKILL at named points (``DPML_FAULT``), MLflow's own store
creation killed mid-migration, concurrent first runs on one new store, cut-short cache files.
"""

from __future__ import annotations

import gzip
import os
import select
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import REPO, small_params, write_params
from dpml.ledger.ledger import Ledger

ENV = {**os.environ, "PYTHONPATH": str(REPO), "DPML_NOISE_SEED": "11"}


def dpml(
    workdir: Path, *args: str, fault: str | None = None, extra_env: dict[str, str] | None = None, timeout: int = 600
) -> subprocess.CompletedProcess[str]:
    env = {**ENV, **(extra_env or {})}
    env.pop("MLFLOW_TRACKING_URI", None)
    if fault:
        env["DPML_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "dpml.cli", *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout
    )


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The run failed with exactly one ``dpml: error:`` line and no traceback."""
    assert result.returncode not in (0, -signal.SIGKILL), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("dpml: error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def quick_params(workdir: Path, attacks: tuple[str, ...] = ("loss",), **sections: dict) -> Path:
    params = small_params(
        workdir,
        audit={"references": 1, "attacks": list(attacks), "bootstrap": 0, "white_box_canaries": 0},
        gate={"epsilon_budget": 10.0},
        **sections,
    )
    params["tracking"]["model_name"] = "dpml-reliability"
    return write_params(workdir / "params.yaml", params)


def ledger_of(workdir: Path) -> Ledger:
    return Ledger(workdir / "ledger.db", 1e-5)


def counted_spends(workdir: Path) -> int:
    return len(ledger_of(workdir).spends()) if (workdir / "ledger.db").exists() else 0


# ------------------------------------------------------------------------- misconfigurations cost nothing


@pytest.mark.parametrize(
    "override, env, message",
    [
        (["--set", "train.device=cuda"], {}, r"train\.device = 'cuda': no CUDA device"),
        pytest.param(
            [],
            {"DPML_NOISE_SEED": "abc"},
            r"DPML_NOISE_SEED = 'abc': must be a non-negative integer",
            marks=pytest.mark.exhaustive,
        ),
    ],
)
def test_a_misconfigured_run_spends_nothing(
    workdir: Path, override: list[str], env: dict[str, str], message: str
) -> None:
    import torch

    if "train.device=cuda" in override and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: train.device=cuda is valid here")
    quick_params(workdir)
    result = dpml(workdir, "run", "--engine", "local", *override, extra_env=env)
    line = one_error_line(result)
    assert __import__("re").search(message, line), line
    assert counted_spends(workdir) == 0
    assert not (workdir / "data" / "raw").exists()  # stopped before the first stage
    # the same failure from the train stage alone (what dvc repro runs) also spends nothing
    assert dpml(workdir, "stage", "ingest").returncode == 0
    for stage in ("split", "preprocess"):
        assert dpml(workdir, "stage", stage).returncode == 0
    one_error_line(dpml(workdir, "stage", "train", *override, extra_env=env))
    assert counted_spends(workdir) == 0
    # and from a Prefect flow run
    line = one_error_line(dpml(workdir, "run", "--engine", "prefect", *override, extra_env=env))
    assert __import__("re").search(message, line), line
    assert counted_spends(workdir) == 0


def _disk_of(size: int):  # noqa: ANN202 — a preexec_fn
    """A disk that fills after ``size`` bytes a file: writes beyond it fail (EFBIG) instead of killing."""

    def fill() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return fill


@pytest.mark.parametrize("when", ["first run", pytest.param("later run", marks=pytest.mark.exhaustive)])
def test_a_full_disk_fails_in_one_line_and_loses_nothing(workdir: Path, when: str) -> None:
    """A disk that fills on the first run (MLflow's store cannot even be created) or on a later run (the
    store's file may grow by 2 KiB: registration fails): one error line, every spend accounted for, no
    model version from the failed run, and the next run on a free disk works."""
    from mlflow import MlflowClient

    quick_params(workdir)
    env = {**ENV}
    env.pop("MLFLOW_TRACKING_URI", None)
    releases = 0
    size = 400_000
    if when == "later run":
        assert dpml(workdir, "run", "--engine", "local").returncode == 0
        releases, size = 1, (workdir / "mlflow.db").stat().st_size + 2048
    full = subprocess.run(
        [sys.executable, "-m", "dpml.cli", "run", "--engine", "local"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=_disk_of(size),
    )
    line = one_error_line(full)
    assert "disk" in line and "full" in line, line
    if (workdir / "ledger.db").exists():
        ledger = ledger_of(workdir)
        for spend in ledger.spends(counted_only=False)[releases:]:
            kinds = [k for k, _ in ledger.events(spend.id)]
            assert "released" not in kinds  # nothing was released …
            assert "started" in kinds or "cancelled" in kinds  # … and the spend says what became of it
    done = dpml(workdir, "run", "--engine", "local")
    assert done.returncode == 0, done.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    versions = client.search_model_versions("name='dpml-reliability'")
    assert len(versions) == releases + 1
    runs = client.search_runs([client.get_experiment_by_name("dpml-test").experiment_id])
    assert all(run.info.status != "RUNNING" for run in runs)


def test_an_unwritable_output_folder_is_refused_before_any_work(workdir: Path) -> None:
    blocker = workdir / "not-a-folder"
    blocker.write_text("a file where a folder should be")
    quick_params(workdir)
    line = one_error_line(dpml(workdir, "run", "--engine", "local", "--set", f"paths.artifacts={blocker}/art"))
    assert "paths.artifacts" in line and "cannot write there" in line
    assert counted_spends(workdir) == 0


@pytest.mark.exhaustive  # CI runs it after the default suite, which stays near 20 min on 2 cores
def test_a_failure_between_reservation_and_training_cancels_the_spend(workdir: Path) -> None:
    quick_params(workdir)
    for stage in ("ingest", "split", "preprocess"):
        assert dpml(workdir, "stage", stage).returncode == 0
    (workdir / "artifacts" / "train" / "spend.json").mkdir(parents=True)  # the spend note cannot be written
    one_error_line(dpml(workdir, "stage", "train"))
    ledger = ledger_of(workdir)
    [spend] = ledger.spends(counted_only=False)
    assert ledger.spends() == [] and [kind for kind, _ in ledger.events(spend.id)] == ["cancelled"]
    listing = dpml(workdir, "ledger")
    assert listing.returncode == 0 and "(not counted)" in listing.stdout and "1 cancelled" in listing.stdout
    # a spend that has started can never be cancelled
    (workdir / "artifacts" / "train" / "spend.json").rmdir()
    assert dpml(workdir, "stage", "train").returncode == 0
    started = ledger.spends()[0]
    assert ledger.cancel(started.id, "too late") is False and len(ledger.spends()) == 1


# --------------------------------------------------------------------------------------- kills and races


@pytest.mark.exhaustive  # CI runs it after the default suite, which stays near 20 min on 2 cores
def test_kills_at_stage_boundaries_and_inside_registration(workdir: Path) -> None:
    """SIGKILL after the reservation, after training, inside registration: the ledger counts what was
    spent, the store stays usable, the half-registered version is removed, and the next run completes."""
    from mlflow import MlflowClient

    quick_params(workdir)
    killed = dpml(workdir, "run", "--engine", "local", fault="train:reserved")
    assert killed.returncode == -signal.SIGKILL
    assert counted_spends(workdir) == 1  # reserved and not cancelled: a kill is indistinguishable from a crash
    killed = dpml(workdir, "run", "--engine", "local", fault="after:train")
    assert killed.returncode == -signal.SIGKILL and counted_spends(workdir) == 2
    killed = dpml(workdir, "run", "--engine", "local", fault="register:after_version")
    assert killed.returncode == -signal.SIGKILL and counted_spends(workdir) == 3
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    [half] = client.search_model_versions("name='dpml-reliability'")
    assert client.get_run(half.run_id).info.status == "RUNNING"
    total_before = ledger_of(workdir).summary()[0]["epsilon_total"]

    done = dpml(workdir, "run", "--engine", "local")
    assert done.returncode == 0, done.stderr
    assert client.get_run(half.run_id).info.status == "KILLED"
    versions = client.search_model_versions("name='dpml-reliability'")
    assert [v.run_id for v in versions] != [half.run_id] and len(versions) == 1
    assert client.get_registered_model("dpml-reliability").aliases["champion"] == versions[0].version
    ledger = ledger_of(workdir)
    spends = ledger.spends()
    assert len(spends) == 4
    assert "release_abandoned" in [k for k, _ in ledger.events(spends[2].id)]
    assert "released" in [k for k, _ in ledger.events(spends[3].id)]
    assert ledger.summary()[0]["epsilon_total"] > total_before  # nothing forgotten, the new run added

    # Killed after the alias moved, inside the still-RUNNING MLflow run: the next run removes that version
    # and points the alias back at the newest passing release before registering its own.
    champion = client.get_registered_model("dpml-reliability").aliases["champion"]
    killed = dpml(workdir, "run", "--engine", "local", fault="register:after_alias")
    assert killed.returncode == -signal.SIGKILL
    [aliased] = [v for v in client.search_model_versions("name='dpml-reliability'") if v.version != champion]
    assert client.get_registered_model("dpml-reliability").aliases["champion"] == aliased.version
    # The next run fails its gate (no promotion) and is killed after MLflow finished, before the ledger's event.
    killed = dpml(
        workdir, "run", "--engine", "local", "--set", "gate.epsilon_budget=0.01", fault="register:before_released_event"
    )
    assert killed.returncode == -signal.SIGKILL
    assert client.get_run(aliased.run_id).info.status == "KILLED"
    assert client.get_registered_model("dpml-reliability").aliases["champion"] == champion  # back where it was
    unreleased = ledger_of(workdir).spends()[-1]
    assert "released" not in [k for k, _ in ledger_of(workdir).events(unreleased.id)]
    [finished] = [v for v in client.search_model_versions("name='dpml-reliability'") if v.version not in (champion,)]
    assert client.get_run(finished.run_id).info.status == "FINISHED"

    done = dpml(workdir, "run", "--engine", "local")
    assert done.returncode == 0, done.stderr
    events = dict(ledger_of(workdir).events(unreleased.id))
    assert events["released"]["reconciled"] == "true" and events["released"]["run_id"] == finished.run_id
    newest = max(int(v.version) for v in client.search_model_versions("name='dpml-reliability'"))
    assert int(client.get_registered_model("dpml-reliability").aliases["champion"]) == newest
    assert len(ledger_of(workdir).spends()) == 7  # every spend still counted


@pytest.mark.exhaustive
def test_concurrent_first_runs_on_one_new_store_all_register(tmp_path: Path) -> None:
    shared = {
        "tracking": {
            "uri": f"sqlite:///{tmp_path / 'shared' / 'mlflow.db'}",
            "artifact_root": str(tmp_path / "shared" / "mlartifacts"),
            "experiment": "dpml-test",
            "model_name": "dpml-race",
        },
        "ledger": {"path": str(tmp_path / "shared" / "ledger.db"), "epsilon_budget": 1000.0, "delta": 1e-5},
    }
    runs = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        params = small_params(
            folder, audit={"references": 1, "attacks": ["loss"], "bootstrap": 0, "white_box_canaries": 0}
        )
        params |= {key: dict(value) for key, value in shared.items()}
        write_params(folder / "params.yaml", params)
        env = {**ENV}
        env.pop("MLFLOW_TRACKING_URI", None)
        runs.append(
            subprocess.Popen(
                [sys.executable, "-m", "dpml.cli", "run", "--engine", "local"],
                cwd=folder,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [run.communicate(timeout=900) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in outputs]
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=shared["tracking"]["uri"])
    versions = client.search_model_versions("name='dpml-race'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    assert len(Ledger(shared["ledger"]["path"], 1e-5).spends()) == 2


_CREATE_STORE_UNTIL = """
import os, signal, sys
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
from sqlalchemy import event
from sqlalchemy.engine import Engine

point, uri, artifacts = sys.argv[1:4]


def stop() -> None:  # say where, then stop here for the test's SIGKILL
    print(point, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


@event.listens_for(Engine, "before_cursor_execute")
def before(conn, cursor, statement, parameters, context, executemany):
    words = " ".join(statement.split()).lower()
    if point == "initial tables" and words.startswith("create table alembic_version"):
        stop()  # MLflow's initial tables are written, no migration has started
    if point.startswith("migration ") and words.startswith(("insert into alembic_version", "update alembic_version")) \
            and f"'{point.split()[1]}'" in words:
        stop()  # inside that migration: its schema changes made, its revision not yet written
    if point == "default experiment" and words.startswith("insert into experiments"):
        stop()  # every migration done, the default experiment not yet created


if point == "imported":
    stop()  # MLflow imported, no database file yet
SqlAlchemyStore(uri, artifacts)
print("finished", flush=True)
"""


def _migrations() -> list[tuple[str, str | None]]:
    """(revision, the revision before it) of MLflow's tracking-store migrations, first to last."""
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config

    script = ScriptDirectory.from_config(_get_alembic_config(db_url=""))
    return [(r.revision, r.down_revision) for r in reversed(list(script.walk_revisions()))]  # type: ignore[misc]


def _store_state(database: Path) -> tuple[set[str], str | None]:
    """The tables of the store and its recorded alembic revision, read back without writing."""
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        row = db.execute("SELECT version_num FROM alembic_version").fetchone() if "alembic_version" in tables else None
    db.close()
    return tables, None if row is None else str(row[0])


@pytest.mark.parametrize(
    "where",
    [
        "middle migration",
        *(
            pytest.param(w, marks=pytest.mark.exhaustive)
            for w in ("imported", "initial tables", "first migration", "last migration", "default experiment")
        ),
    ],
)
def test_a_store_killed_while_mlflow_creates_it_is_repaired(tmp_path: Path, where: str) -> None:
    """MLflow's own creation SIGKILLed at a named point of it: dpml's next run still works.

    The kill lands where the case says, by the store's own progress, not a clock (a fixed delay once
    killed before MLflow had even been imported): the creating process stops itself at the SQL
    statement that marks the point (a listener on SQLAlchemy's statements) and says so on a pipe; the
    test reads that, checks the process is stopped there, kills it, and reads the store state the kill
    left back (no file, tables without a revision, the revision before the migration it was in, or a
    fully migrated store without its default experiment) before dpml repairs it."""
    from dpml.sections_stores import TrackingConfig
    from dpml.tracking.store import prepare_store

    migrations = _migrations()
    revision, before = {
        "first migration": migrations[0],
        "middle migration": migrations[len(migrations) // 2],
        "last migration": migrations[-1],
    }.get(where, (None, None))
    point = f"migration {revision}" if revision else where
    database = tmp_path / "mlflow.db"
    with open(tmp_path / "creator.log", "w") as log:
        creator = subprocess.Popen(
            [sys.executable, "-c", _CREATE_STORE_UNTIL, point, f"sqlite:///{database}", str(tmp_path / "art")],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        assert creator.stdout is not None
        ready, _, _ = select.select([creator.stdout], [], [], 600)  # a bound on a hang, not an ordering
        said = creator.stdout.readline().strip() if ready else "(nothing in 600 s)"
        assert said == point, (
            f"the creator never reached {point!r}: {said!r}; {(tmp_path / 'creator.log').read_text()[-2000:]}"
        )
        _, status = os.waitpid(creator.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)  # stopped at the point: nothing after it has run
    finally:
        creator.kill()
        creator.wait()
    if where == "imported":
        assert not database.exists()
    else:
        tables, recorded = _store_state(database)
        assert {"experiments", "runs"} <= tables
        if where == "initial tables":
            assert "alembic_version" not in tables
        elif where == "default experiment":
            assert recorded == migrations[-1][0]
        else:
            assert recorded == before and recorded != migrations[-1][0]  # half-migrated: in migration `revision`
    config = TrackingConfig(uri=f"sqlite:///{database}", artifact_root=str(tmp_path / "art"))
    outcome = prepare_store(config)
    expected = {"imported": "created", "default experiment": "ready"}.get(where, "repaired")
    assert outcome.startswith(expected), outcome
    assert prepare_store(config) == "ready"
    _log_one_run(config)


_KILLED_MID_TRANSACTION = """
import os, signal, sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA cache_size = 1")  # spill the unfinished transaction's pages into the database file
db.execute("BEGIN")
db.execute("DELETE FROM runs")
db.execute("UPDATE alembic_version SET version_num = '0a8213491aaa'")
db.execute("CREATE TABLE filler (x BLOB)")
for _ in range(64):
    db.execute("INSERT INTO filler VALUES (randomblob(4096))")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_store_whose_writer_was_killed_mid_transaction_is_rolled_back_not_copied(tmp_path: Path) -> None:
    """A hot journal beside the store: dpml lets SQLite roll it back, and the store's runs survive."""
    from mlflow import MlflowClient

    from dpml.sections_stores import TrackingConfig
    from dpml.tracking.store import prepare_store

    database = tmp_path / "mlflow.db"
    config = TrackingConfig(uri=f"sqlite:///{database}", artifact_root=str(tmp_path / "art"))
    assert prepare_store(config) == "created"
    _log_one_run(config)
    killed = subprocess.run([sys.executable, "-c", _KILLED_MID_TRANSACTION, str(database)], check=False)
    assert killed.returncode == -signal.SIGKILL
    assert (tmp_path / "mlflow.db-journal").stat().st_size > 0
    with pytest.raises(sqlite3.OperationalError, match="readonly"):  # the journal is hot: a reader must roll back
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as reader:
            reader.execute("SELECT COUNT(*) FROM runs").fetchone()
    assert prepare_store(config) == "ready"
    assert not list(tmp_path.glob("mlflow.db.broken-*"))
    runs = MlflowClient(tracking_uri=config.uri).search_runs(["0"])
    assert len(runs) == 1 and runs[0].data.metrics == {"x": 1.0}


def test_a_half_migrated_store_is_set_aside_and_one_with_runs_is_never_touched(tmp_path: Path) -> None:
    from dpml.sections_stores import TrackingConfig
    from dpml.tracking.store import StoreError, prepare_store

    config = TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "art"))
    assert prepare_store(config) == "created"
    with sqlite3.connect(tmp_path / "mlflow.db") as db:  # what a kill between two migrations leaves
        db.execute("UPDATE alembic_version SET version_num = '0a8213491aaa'")
    assert prepare_store(config).startswith("repaired")
    assert list(tmp_path.glob("mlflow.db.broken-*"))
    _log_one_run(config)
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        db.execute("UPDATE alembic_version SET version_num = '0a8213491aaa'")
    before = (tmp_path / "mlflow.db").read_bytes()
    with pytest.raises(StoreError, match="could not be migrated .* it was not modified"):
        prepare_store(config)
    assert (tmp_path / "mlflow.db").read_bytes() == before


def _log_one_run(config) -> None:  # noqa: ANN001
    from dpml.tracking.store import client

    store = client(config)
    run = store.create_run("0")
    store.log_metric(run.info.run_id, "x", 1.0)
    store.set_terminated(run.info.run_id)
    assert store.search_runs(["0"])


# ------------------------------------------------------------------------------------- caches cannot lie


def test_a_cut_short_or_foreign_cache_entry_is_rebuilt_and_never_used(tmp_path: Path) -> None:
    from dpml.audit.references import read_reference, write_reference

    logits, inside = np.random.default_rng(0).normal(size=(50, 3)), np.arange(50) % 2 == 0
    path = tmp_path / "ref.npz"
    write_reference(path, "key-a", logits, inside, 1.5)
    stored = read_reference(path, "key-a")
    assert stored is not None and np.array_equal(stored["logits"], logits.astype(np.float32))
    assert read_reference(path, "key-b") is None and not path.exists()  # another key's entry
    write_reference(path, "key-a", logits, inside, 1.5)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # cut short
    assert read_reference(path, "key-a") is None and not path.exists()
    write_reference(path, "key-a", logits, inside, 1.5)
    tampered = dict(np.load(path))
    tampered["logits"] = tampered["logits"] + 1.0
    np.savez(path.with_suffix(""), **tampered)  # valid archive, wrong content for its checksum
    assert read_reference(path, "key-a") is None


@pytest.mark.exhaustive  # CI runs it after the default suite, which stays near 20 min on 2 cores
def test_a_corrupted_reference_cache_does_not_change_the_audit(workdir: Path) -> None:
    import json

    quick_params(workdir, attacks=("loss", "rmia-online"))
    assert dpml(workdir, "run", "--engine", "local").returncode == 0
    first = json.loads((workdir / "artifacts" / "audit" / "audit.json").read_text())
    entries = sorted((workdir / "cache" / "references").glob("*.npz"))
    assert entries
    entries[0].write_bytes(entries[0].read_bytes()[:100])
    if len(entries) > 1:
        entries[1].write_bytes(b"not a zip file")
    again = dpml(workdir, "stage", "audit")
    assert again.returncode == 0, again.stderr
    second = json.loads((workdir / "artifacts" / "audit" / "audit.json").read_text())
    assert second["target"]["attacks"] == first["target"]["attacks"]
    assert second["references"]["trained_by_this_stage"] >= 1


# ------------------------------------------------------------------------------ one line per user error


def _bad_gz_folder(root: Path) -> Path:
    folder = root / "idx"
    folder.mkdir()
    images = np.zeros((20, 2, 2), dtype=np.uint8)
    blob = bytes([0, 0, 8, 3]) + b"".join(int(d).to_bytes(4, "big") for d in images.shape) + images.tobytes()
    full = gzip.compress(blob)
    (folder / "train-images-idx3-ubyte.gz").write_bytes(full[: len(full) // 2])
    labels = bytes([0, 0, 8, 1]) + (20).to_bytes(4, "big") + bytes(range(2)) * 10
    (folder / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(labels))
    return folder


@pytest.mark.exhaustive  # CI runs it after the default suite, which stays near 20 min on 2 cores
def test_a_corpus_of_bad_inputs_each_gives_one_line(workdir: Path) -> None:
    quick_params(workdir)
    bomb = workdir / "bomb.yaml"
    bomb.write_text(
        "a: &a [x,x,x,x,x,x,x,x,x,x]\n"
        + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(8))
    )
    folder = _bad_gz_folder(workdir)
    corpus = [
        (["epsilon", "--noise-multiplier", "inf", "--sample-rate", "0.01", "--steps", "100"], "finite"),
        (["epsilon", "--noise-multiplier", "nan", "--sample-rate", "0.01", "--steps", "100"], "finite"),
        (["calibrate", "--target-epsilon", "1", "--noise-multiplier", "inf", "--sample-rate", "0.01"], "finite"),
        (["epsilon", "--noise-multiplier", "1e9", "--sample-rate", "0.01", "--steps", "100"], "(0, 1e6]"),
        (["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", "1e99"], "integer"),
        (["run", "--engine", "local", "--params", str(bomb)], "aliases expand"),
        (["run", "--engine", "local", "--set", "dp.delta=[1,"], "dp.delta"),
        (["run", "--engine", "local", "--set", "dp.delta=1.5"], "dp.delta = 1.5"),
        (["audit", "--model", "models:/dpml-reliability"], "models:/NAME@ALIAS or models:/NAME/VERSION"),
        (["reproduce", "models:/dpml-reliability", "--verify"], "models:/NAME@ALIAS or models:/NAME/VERSION"),
        (["run", "--engine", "local", "--set", f"data.source=idx:{folder}"], "cut short or corrupt"),
        (["run", "--engine", "local", "--params", str(workdir / "missing.yaml")], "does not exist"),
    ]
    for args, expected in corpus:
        line = one_error_line(dpml(workdir, *args, timeout=300))
        assert expected in line, (args, line)
    assert counted_spends(workdir) == 0
    # a closed pipe is not an error
    piped = subprocess.run(
        f"{sys.executable} -m dpml.cli epsilon --noise-multiplier 1 --sample-rate 0.01 --steps 100 | head -c 1",
        shell=True,
        cwd=workdir,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "Traceback" not in piped.stderr and "BrokenPipe" not in piped.stderr
    # --debug shows the traceback
    debug = dpml(workdir, "--debug", "run", "--engine", "local", "--set", f"data.source=idx:{folder}")
    assert "Traceback" in debug.stderr


def test_a_fixed_noise_seed_is_warned_about_and_recorded(workdir: Path) -> None:
    from mlflow import MlflowClient

    quick_params(workdir)
    result = dpml(workdir, "run", "--engine", "local")
    assert result.returncode == 0, result.stderr
    assert "dpml: warning: DPML_NOISE_SEED is set" in result.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    [version] = client.search_model_versions("name='dpml-reliability'")
    assert version.tags["noise_seed.fixed"] == "true"
    assert client.get_run(version.run_id).data.tags["noise_seed.fixed"] == "true"
    assert "11" not in {v for k, v in client.get_run(version.run_id).data.params.items() if "seed" in k.lower()}
    params = yaml.safe_load((workdir / "params.yaml").read_text())
    assert "DPML_NOISE_SEED" not in str(params)
