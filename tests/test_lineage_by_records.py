"""The ledger counts people, not file names (issue 51).

The same records under three names and encodings are one account; a weekly export that grows keeps its
people's history; a run whose people another lineage holds is refused with one line naming both; a
rename or merge keeps every spend; a ledger written before that rule (the same people under several
lineages) composes each person's ε over every release that touched them, in the budget check and in
``dpml ledger``. Real SQLite and PostgreSQL ledgers, the real stages, the real CLI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from dpml.config import validate
from dpml.ledger.ledger import BudgetExceeded, Ledger, LedgerError, LineageConflict, _compose
from dpml.accounting.mechanism import ConcentratedDP, MechanismDescription
from dpml.data.units import digests_of_ids
from dpml.stages import run_stage
from dpml.stages.train import LineageFollowsRecords
from tests.conftest import REPO, small_params, write_params

DELTA = 1e-5
COLORS = ["rot", "grün", "blau"]


def run(rho: float = 0.05) -> MechanismDescription:
    """A ρ-zCDP release: composed in closed form (RDP), so the ledger's checks take milliseconds."""
    return MechanismDescription("onepass", (ConcentratedDP(rho),), "add-remove", 1.0, 100)


def people(ids: range | list[int]) -> np.ndarray:
    return digests_of_ids([f"p{i:05d}" for i in ids])


def spends_of(ledger: Ledger) -> list[tuple[str, str]]:
    return [(s.lineage, s.label) for s in ledger.spends(counted_only=False)]


# ------------------------------------------------------------------------------------ the ledger alone


def test_the_same_people_under_another_lineage_are_refused_and_nothing_is_recorded(
    ledger_location: str, tmp_path: Path
) -> None:
    ledger = Ledger(ledger_location, DELTA, unit_key=tmp_path / "unit.key")
    ledger.reserve("v1", run(), "plain.csv", 100.0, lineage="plain", units=people(range(100)))
    for lineage, units in (("bom", people(range(100))), ("weekly", people(range(90, 200)))):
        with pytest.raises(LineageConflict) as refused:
            ledger.reserve("v1", run(), "again", 100.0, lineage=lineage, units=units)
        line = str(refused.value)
        assert "\n" not in line and f"lineage {lineage!r}" in line and "lineage 'plain'" in line
        assert "set ledger.dataset: plain" in line and f"dpml ledger rename plain {lineage}" in line
        assert "Nothing was recorded" in line
    assert spends_of(ledger) == [("plain", "plain.csv")]
    # the exclude path (ledger.on_exhausted: exclude) refuses the same way, before anything is written
    with pytest.raises(LineageConflict):
        ledger.units_within_filter("bom", people(range(10)), run(), 100.0)
    # the default lineage follows the records: whoever holds most of the run's people
    assert ledger.lineage_holding(people(range(50, 150)), "patients-2026-11-27") == "plain"
    assert ledger.lineage_holding(people(range(500, 510)), "patients-2026-11-27") == "patients-2026-11-27"
    # charged to the lineage that holds them, the same people compose
    ledger.reserve("v2", run(), "plain again", 100.0, lineage="plain", units=people(range(50, 150)))
    assert ledger.total("plain") == pytest.approx(ledger.person(people([60]))["epsilon"])
    assert [r["spend"] for r in ledger.person(people([60]))["releases"]] == [1, 2]
    assert ledger.person(people([5000])) is None


def test_an_existing_lineage_with_other_people_is_refused_naming_the_merge(
    ledger_location: str, tmp_path: Path
) -> None:
    ledger = Ledger(ledger_location, DELTA, unit_key=tmp_path / "unit.key")
    ledger.reserve("v1", run(), "a", 100.0, lineage="A", units=people(range(100)))
    ledger.reserve("v1", run(), "b", 100.0, lineage="B", units=people(range(200, 300)))
    with pytest.raises(LineageConflict, match=r"lineage 'A' \(50 of them\).*dpml ledger rename B A --merge"):
        ledger.reserve("v2", run(), "c", 100.0, lineage="B", units=people(range(50, 150)))
    with pytest.raises(LineageConflict, match=r"'A' \(10 of them\), 'B' \(10 of them\).*rename B A --merge"):
        ledger.reserve("v2", run(), "d", 100.0, lineage="C", units=people([*range(10), *range(200, 210)]))
    assert len(ledger.spends(counted_only=False)) == 2


def test_rename_keeps_the_history_and_merge_composes_every_shared_person(
    ledger_location: str, tmp_path: Path, older_dpml: Callable[[Ledger, str, np.ndarray], None]
) -> None:
    ledger = Ledger(ledger_location, DELTA, unit_key=tmp_path / "unit.key")
    ledger.reserve("w1", run(), "week 1", 100.0, lineage="patients-2026-11-20", units=people(range(100)))
    before = ledger.total("patients-2026-11-20")
    moved = ledger.rename_lineage("patients-2026-11-20", "patients")
    assert moved["spends"] == 1 and not moved["merged"]
    assert ledger.total("patients") == pytest.approx(before) and ledger.total("patients-2026-11-20") == 0.0
    [spend] = ledger.spends("patients")
    assert ("lineage_renamed", {"from": "patients-2026-11-20", "to": "patients", "merged": False}) in ledger.events(
        spend.id
    )
    with pytest.raises(LedgerError, match="no lineage 'patients-2026-11-20'"):
        ledger.rename_lineage("patients-2026-11-20", "x")
    # the renamed account refuses what the old one would have refused
    ledger.reserve("w2", run(), "week 2", 100.0, lineage="patients", units=people(range(150)))
    with pytest.raises(BudgetExceeded, match="100 of the 150"):
        ledger.reserve(
            "w3", run(), "week 3", ledger.total("patients") * 1.01, lineage="patients", units=people(range(150))
        )
    # merge: another account with some of the same people (as an older dpml allowed) becomes one account
    older_dpml(ledger, "clinic", people(range(120, 130)))
    with pytest.raises(LedgerError, match="lineage 'patients' exists; to merge 'clinic' into it .* add --merge"):
        ledger.rename_lineage("clinic", "patients")
    merged = ledger.rename_lineage("clinic", "patients", merge=True)
    assert merged["merged"] and merged["shared_units"] == 10 and merged["spends"] == 1
    assert [s.lineage for s in ledger.spends(counted_only=False)] == ["patients"] * 3
    both = ledger.person(people([125]))
    assert [r["spend"] for r in both["releases"]] == [2, 3] and both["lineages"] == ["patients"]
    assert ledger.person(people([0]))["epsilon"] == pytest.approx(ledger.total("patients"))
    assert sum(n for _, n in ledger.unit_epsilons("patients")) == 150


@pytest.fixture
def older_dpml(monkeypatch: pytest.MonkeyPatch) -> Callable[[Ledger, str, np.ndarray], None]:
    """Writes a spend as a dpml before issue 51 did: the same people under another lineage name."""

    def write(ledger: Ledger, lineage: str, units: np.ndarray) -> None:
        with monkeypatch.context() as patch:
            patch.setattr(Ledger, "_refuse_other_lineages", staticmethod(lambda db, lineage, ids: None))
            ledger.reserve("1d8fc654fa6d", run(), f"dpml model (csv:{lineage}.csv)", 1e6, lineage=lineage, units=units)

    return write


def test_a_ledger_with_the_same_people_under_three_lineages_composes_them(
    ledger_location: str, tmp_path: Path, older_dpml: Callable[[Ledger, str, np.ndarray], None]
) -> None:
    ledger = Ledger(ledger_location, DELTA, unit_key=tmp_path / "unit.key")
    for name in ("plain", "bom", "crlf"):  # the bug: each file name its own account
        older_dpml(ledger, name, people(range(100)))
    three, one = _compose([run()] * 3, DELTA), _compose([run()], DELTA)
    for entry in ledger.summary():  # every lineage reports its people's ε over all three releases
        assert entry["epsilon_total"] >= three * 0.999 > one * 1.5
        assert set(entry["shared_with"]) == {"plain", "bom", "crlf"} - {entry["lineage"]}
        [group] = entry["people"]
        assert group["units"] == 100 and [r["spend"] for r in group["releases"]] == [1, 2, 3]
        assert [r["lineage"] for r in group["releases"]] == ["plain", "bom", "crlf"]
    assert ledger.total("bom") >= three * 0.999
    # a run charged to every unit of a lineage (units unknown) is checked against the composed ε
    with pytest.raises(BudgetExceeded):
        ledger.reserve("v", run(), "unknown units", three * 1.01, lineage="bom", units=None)
    # the people of those lineages are one account once merged, with the same ε
    for name in ("bom", "crlf"):
        ledger.rename_lineage(name, "plain", merge=True)
    [entry] = ledger.summary()
    assert entry["lineage"] == "plain" and entry["units"] == 100 and entry["shared_with"] == {}
    assert entry["epsilon_total"] == pytest.approx(ledger.person(people([7]))["epsilon"])
    assert entry["epsilon_total"] >= three * 0.999


# ------------------------------------------------------------------------------------- the pipeline


def patients(ids: range, seed: int = 0) -> pd.DataFrame:
    """A small table: a person id, two numbers, a colour with a non-ASCII category, a yes/no label."""
    rng = np.random.default_rng(seed)
    label = np.array([i % 2 for i in ids])
    return pd.DataFrame(
        {
            "pid": [f"p{i:05d}" for i in ids],
            "age": rng.integers(18, 90, len(ids)),
            "score": np.round(rng.normal(label * 2 - 1, 1.0), 3),
            "color": [COLORS[i % 3] for i in ids],
            "label": np.where(label == 1, "yes", "no"),
        }
    )


def write_table(
    frame: pd.DataFrame, path: Path, encoding: str = "utf-8", separator: str = ",", newline: str = "\n"
) -> Path:
    text = frame.to_csv(index=False, sep=separator, lineterminator=newline)
    path.write_bytes(text.encode(encoding))
    return path


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One MLflow store for the module's runs (the train stage's pre-flight creates it once; nothing here
    registers a model)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def train_on(
    workdir: Path, store: str, table: Path, id_column: bool = True, dataset: str | None = None, **data: Any
) -> None:
    """ingest → split → preprocess → train (the stages every driver runs) on ``table``; ``dataset``: the
    lineage named by ``ledger.dataset`` (None: the default, which follows the records). One-pass DP-SGD
    (a zCDP release, ε = 1 alone) keeps the ledger's accounting closed-form and quick."""
    params = small_params(
        workdir,
        ledger={"dataset": dataset},
        data={
            "source": f"csv:{table}",
            "label_column": "label",
            "classes": ["no", "yes"],
            "columns": {
                "age": {"type": "numeric", "lower": 0, "upper": 120},
                "score": {"type": "numeric", "lower": -5, "upper": 5},
                "color": {"type": "categorical", "categories": COLORS},
            },
            **({"id_column": "pid"} if id_column else {}),
            **data,
        },
        train={"algorithm": "onepass", "loss": "squared", "epochs": 1},
        model={"hidden": []},
        dp={"target_epsilon": 1.0, "noise_multiplier": None, "neighbouring": "replace-one"},
        preprocess={"clip_norm": 2.0},
        tracking={"uri": store},
    )
    config = validate(params)
    for stage in ("ingest", "split", "preprocess", "train"):
        run_stage(stage, config)


@pytest.mark.parametrize("id_column", [True, False], ids=["id-column", "row-content"])
def test_the_same_records_under_three_names_and_encodings_are_one_account(
    workdir: Path, mlflow_store: str, id_column: bool
) -> None:
    frame = patients(range(300))
    files = [
        write_table(frame, workdir / "plain.csv"),
        write_table(frame, workdir / "bom.csv", encoding="utf-8-sig", newline="\r\n"),
        write_table(frame, workdir / "latin.txt", encoding="cp1252", separator=";"),
    ]
    train_on(workdir, mlflow_store, files[0], id_column)
    for table in files[1:]:  # the records decide the account, and one warning line says so
        with pytest.warns(LineageFollowsRecords, match=rf"lineage 'plain': the people of csv:.*{table.name}"):
            train_on(workdir, mlflow_store, table, id_column, **({"separator": ";"} if table.suffix == ".txt" else {}))
    ledger = Ledger(workdir / "ledger.db", DELTA)
    spends = ledger.spends()
    assert {s.lineage for s in spends} == {"plain"} and len(spends) == 3
    assert len({s.dataset_version for s in spends}) == 1  # the same records, whatever the file's bytes
    [entry] = ledger.summary()
    one = spends[0].epsilon_alone
    assert entry["epsilon_total"] > 1.4 * one  # the people in all three composed, not "largest unit ε = one"
    assert [r["spend"] for r in entry["people"][0]["releases"]] == [s.id for s in spends]
    # naming another account for them is refused before anything is spent
    with pytest.raises(LineageConflict, match=r"lineage 'elsewhere'.*lineage 'plain'.*ledger\.dataset: plain"):
        train_on(workdir, mlflow_store, files[1], id_column, dataset="elsewhere")
    assert len(ledger.spends(counted_only=False)) == 3


def test_a_weekly_export_that_grows_stays_one_account_and_renames_keep_it(workdir: Path, mlflow_store: str) -> None:
    week1 = write_table(patients(range(200)), workdir / "patients-2026-11-20.csv")
    week2 = write_table(patients(range(260)), workdir / "patients-2026-11-27.csv")
    train_on(workdir, mlflow_store, week1)
    with pytest.warns(
        LineageFollowsRecords,
        match=r"lineage 'patients-2026-11-20': the people of csv:.*"
        r"patients-2026-11-27\.csv are already accounted under it",
    ):
        train_on(workdir, mlflow_store, week2)
    ledger = Ledger(workdir / "ledger.db", DELTA)
    first, second = ledger.spends()
    assert first.lineage == second.lineage == "patients-2026-11-20"  # the records decided, not the file name
    entry = ledger.summary()[0]
    twice = [g for g in entry["people"] if len(g["releases"]) == 2]
    assert twice and sum(g["units"] for g in twice) <= min(first.n_units or 0, second.n_units or 0)
    assert entry["units"] > first.n_units  # the new people joined the account
    renamed = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpml",
            "ledger",
            "rename",
            "patients-2026-11-20",
            "patients",
            "--params",
            str(write_params(workdir / "view.yaml", small_params(workdir))),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert renamed.returncode == 0, renamed.stderr
    assert "lineage 'patients-2026-11-20' renamed to 'patients': 2 spend(s) moved" in renamed.stdout
    [after] = ledger.summary()
    assert after["lineage"] == "patients" and after["epsilon_total"] == pytest.approx(entry["epsilon_total"])
    assert all("lineage_renamed" in s["events"] for s in after["spends"])
    trained = next(f"p{i:05d}" for i in range(200) if ledger.person(digests_of_ids([f"p{i:05d}"])))
    person = subprocess.run(
        [sys.executable, "-m", "dpml", "ledger", "--person", trained, "--json", "--params", str(workdir / "view.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    found = json.loads(person.stdout)
    assert found["person"] == trained and found["lineages"] == ["patients"] and found["releases"]
