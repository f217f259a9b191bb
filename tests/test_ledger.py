"""The budget ledger: composition, refusal, crash safety (SIGKILL), races for the last budget."""

from __future__ import annotations

import multiprocessing
import os
import queue
import select
import signal
import sqlite3
import subprocess
import sys
import time
import traceback
from contextlib import closing
from pathlib import Path

import pytest

from dpml.accounting.accountants import epsilon_pld
from dpml.ledger.ledger import BudgetExceeded, Ledger, LedgerError
from dpml.ledger.schema import SCHEMA_VERSION
from dpml.accounting.mechanism import MechanismDescription, PoissonGaussianSteps
from tests.conftest import small_params, write_params


def run(q: float = 0.05, sigma: float = 1.0, steps: int = 200, relation: str = "add-remove") -> MechanismDescription:
    return MechanismDescription("dpsgd", (PoissonGaussianSteps(q, sigma, steps),), relation, 1.0, 1000)  # type: ignore[arg-type]


def test_total_is_the_composition_of_every_release(ledger_location: str, tmp_path: Path) -> None:
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    releases = [run(0.05, 1.0, 200), run(0.1, 2.0, 100), run(0.05, 1.0, 200)]
    for i, mechanism in enumerate(releases):
        ledger.reserve("data-a", mechanism, f"release {i}", budget=100.0)
    ledger.reserve("data-b", run(), "other dataset", budget=100.0)
    together = MechanismDescription("all", tuple(e for m in releases for e in m.events), "add-remove", 1.0, 1000)
    alone = [epsilon_pld(m, 1e-5) for m in releases]
    total = ledger.total("data-a")
    assert total == pytest.approx(epsilon_pld(together, 1e-5))
    assert max(alone) < total < sum(alone)  # composition is tighter than adding ε's
    assert ledger.total("data-b") == pytest.approx(alone[0])
    summary = ledger.summary("data-a")[0]
    assert summary["private_spends"] == 3 and summary["epsilon_total"] == pytest.approx(total)


def test_refusal_leaves_the_ledger_unchanged(ledger_location: str, tmp_path: Path) -> None:
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    first = ledger.reserve("d", run(), "first", budget=6.0)
    with pytest.raises(BudgetExceeded, match=r"left") as error:
        ledger.reserve("d", run(), "second", budget=first.epsilon_alone * 1.2)
    assert "Nothing was recorded" in str(error.value)
    assert [s.label for s in ledger.spends("d")] == ["first"]


def test_nonprivate_runs_are_recorded_but_not_in_the_dp_total(ledger_location: str, tmp_path: Path) -> None:
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    ledger.reserve("d", None, "baseline", budget=1.0)
    ledger.reserve("d", run(), "dp", budget=100.0)
    summary = ledger.summary("d")[0]
    assert summary["nonprivate_runs"] == 1 and summary["epsilon_total"] == pytest.approx(epsilon_pld(run(), 1e-5))


def test_mixed_relations_are_refused(ledger_location: str, tmp_path: Path) -> None:
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    ledger.reserve("d", run(), "a", budget=100.0)
    with pytest.raises(LedgerError, match="different neighbouring relations"):
        ledger.reserve("d", run(relation="replace-one"), "b", budget=100.0)


def test_corrupt_or_newer_ledgers_are_refused_untouched(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"this is not a database" * 100)
    before = corrupt.read_bytes()
    with pytest.raises(LedgerError, match="not a readable or reachable ledger"):
        Ledger(corrupt, 1e-5)
    assert corrupt.read_bytes() == before
    newer = tmp_path / "newer.db"
    Ledger(newer, 1e-5)
    with sqlite3.connect(newer) as db:
        db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(LedgerError, match="newer dpml"):
        Ledger(newer, 1e-5)


def _race(
    location: str,
    key: str,
    mechanism: MechanismDescription,
    budget: float,
    barrier: multiprocessing.synchronize.Barrier,
    results: "multiprocessing.Queue[str]",
) -> None:
    """One racer: reports "spent", "refused", or how it crashed (any other exception, with its traceback),
    so a crashed racer fails the test at once instead of leaving it waiting for an answer."""
    try:
        ledger = Ledger(location, 1e-5, unit_key=key)
        barrier.wait(timeout=600)
        ledger.reserve("d", mechanism, f"pid {os.getpid()}", budget=budget)
        results.put("spent")
    except BudgetExceeded:
        results.put("refused")
    except BaseException:  # noqa: BLE001 — reported to the test, which fails on it
        results.put(f"crashed in pid {os.getpid()}: {traceback.format_exc()}")


def _outcomes(workers: list[multiprocessing.process.BaseProcess], results: "multiprocessing.Queue[str]") -> list[str]:
    """Every racer's report; a racer that exits without one (killed, or dead before its ``try``) fails the
    test as soon as its exit is seen, instead of the test waiting out a timeout."""
    outcomes: list[str] = []
    deadline = time.monotonic() + 900  # a bound on a racer that hangs, not an ordering
    while len(outcomes) < len(workers):
        assert time.monotonic() < deadline, f"racers still running after 900 s; reports: {outcomes}"
        try:
            outcomes.append(results.get(timeout=1))  # a bound on each wait, not an ordering
            continue
        except queue.Empty:
            pass
        silent = [w.exitcode for w in workers if w.exitcode is not None]
        if len(silent) > len(outcomes):  # more racers ended than reported: drain once more, then fail
            try:
                outcomes.append(results.get(timeout=5))
            except queue.Empty:
                raise AssertionError(
                    f"a racer died without reporting (exit codes {silent}); reports: {outcomes}"
                ) from None
    crashed = [outcome for outcome in outcomes if outcome.startswith("crashed")]
    assert not crashed, "\n".join(crashed)
    return outcomes


# The racers' spend: full-batch Gaussian steps, whose accounting takes a fraction of a second (a Poisson-sampled
# run's PLD takes seconds, and each racer computes it inside the lock: the race would be a queue of accountants).
RACING = run(q=1.0, sigma=4.0, steps=10)


@pytest.mark.parametrize("racers", [pytest.param(16, marks=pytest.mark.exhaustive), 3])
def test_runs_racing_for_the_last_budget(racers: int, ledger_location: str, tmp_path: Path) -> None:
    """Processes reserve at once with room for exactly 2 more runs: exactly 2 get it, on either store.
    With 16 racers each waits its turn for the lock (every check is done inside it)."""
    key = str(tmp_path / "unit.key")
    ledger = Ledger(ledger_location, 1e-5, unit_key=key)
    first = ledger.reserve("d", RACING, "earlier release", budget=100.0)

    def composed(count: int) -> float:
        return epsilon_pld(MechanismDescription("x", RACING.events * count, "add-remove", 1.0, 0), 1e-5)

    budget = (composed(3) + composed(4)) / 2  # room for two more runs, not three
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(racers), context.Queue()
    workers = [
        context.Process(target=_race, args=(ledger_location, key, RACING, budget, barrier, results))
        for _ in range(racers)
    ]
    for w in workers:
        w.start()
    outcomes = sorted(_outcomes(workers, results))
    for w in workers:
        w.join(timeout=60)
    assert outcomes == ["refused"] * (racers - 2) + ["spent"] * 2
    assert len(ledger.spends("d")) == 3 and first.id == ledger.spends("d")[0].id
    assert ledger.total("d") == pytest.approx(composed(3), rel=1e-3) and ledger.total("d") <= budget


def _open_new_ledgers(
    folder: str, rounds: int, barrier: multiprocessing.synchronize.Barrier, results: "multiprocessing.Queue[str]"
) -> None:
    """One opener: in each round, at the barrier with the others, opens that round's ledger (a file nobody
    has made yet) and reads its spends. Reports "opened", or each round's failure (the error's last line),
    going on with the next round so that the others are never left waiting at the barrier."""
    failures = []
    for round_ in range(rounds):
        barrier.wait(timeout=600)
        try:
            Ledger(Path(folder) / f"{round_}.db", 1e-5).spends(counted_only=False)
        except Exception:  # noqa: BLE001 — reported to the test, which fails on it
            failures.append(f"round {round_}: {traceback.format_exc().strip().splitlines()[-1]}")
    results.put("crashed: " + "; ".join(failures) if failures else "opened")


def test_processes_opening_a_new_ledger_at_once_all_open_it(tmp_path: Path) -> None:
    """A run and whoever watches it (a test, a dashboard, a second run) may open a ledger file at the
    same moment, before anyone has made it. SQLite answers a second connection's switch of a new file to
    WAL with "database is locked" at once, without waiting for the lock; every opener must still get the
    ledger, in WAL mode. Four processes open 60 new ledgers together (on the code before the fix, several
    of the 240 openings failed so in every run)."""
    openers, rounds = 4, 60
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(openers), context.Queue()
    workers = [
        context.Process(target=_open_new_ledgers, args=(str(tmp_path), rounds, barrier, results))
        for _ in range(openers)
    ]
    for w in workers:
        w.start()
    outcomes = _outcomes(workers, results)
    for w in workers:
        w.join(timeout=60)
    assert outcomes == ["opened"] * openers
    for round_ in range(rounds):
        with closing(sqlite3.connect(tmp_path / f"{round_}.db")) as db:
            assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
            version = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall()
            assert version == [(str(SCHEMA_VERSION),)]


_TRAIN_UNTIL_STEP = """
import os, signal, sys
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dpml.cli import main

stop_at, steps = int(sys.argv[1]), 0


def count(optimizer, args, kwargs):
    global steps
    steps += 1
    if steps == stop_at:  # say so, then stop here for the test's SIGKILL
        print(f"step {steps}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


register_optimizer_step_pre_hook(count)
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_sigkill_during_training_keeps_the_spend(workdir: Path) -> None:
    params = small_params(workdir, train={"epochs": 2000})  # long enough to be killed mid-training
    path = write_params(workdir / "p.yaml", params)
    for stage in ("ingest", "split", "preprocess"):
        subprocess.run(
            [sys.executable, "-m", "dpml", "stage", stage, "--params", str(path)], check=True, capture_output=True
        )
    # Stopped at its third optimizer step (a hook on every torch optimizer, in the process itself): the kill
    # lands inside the training loop by the loop's own progress, not after a guessed delay.
    process = subprocess.Popen(
        [sys.executable, "-c", _TRAIN_UNTIL_STEP, "3", "stage", "train", "--params", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        said = ""
        while said != "step 3":  # whatever the stage prints first, then the hook's line
            ready, _, _ = select.select([process.stdout], [], [], 600)  # a bound on a hang, not an ordering
            said = process.stdout.readline() if ready else ""
            assert said, "training never reached its third step"
            said = said.strip()
        _, status = os.waitpid(process.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)  # stopped inside the loop
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    ledger_path = workdir / "ledger.db"
    ledger = Ledger(ledger_path, 1e-5)
    [spend] = ledger.spends()
    assert spend.mechanism is not None and [k for k, _ in ledger.events(spend.id)] == [
        "started"
    ]  # counted, never trained
    assert ledger.total(spend.lineage) == pytest.approx(spend.epsilon_alone)
    assert not (workdir / "artifacts" / "train" / "model.pt").exists()  # no half-written model
    # The next run sees the killed run's spend.
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpml",
            "stage",
            "train",
            "--params",
            str(path),
            "--set",
            f"ledger.epsilon_budget={spend.epsilon_alone * 1.5}",
        ],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 1 and "over the budget" in refused.stderr
