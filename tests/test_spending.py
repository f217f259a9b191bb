"""A run's spend through its life (dpml/ledger/spending.py), as both front doors make it: cancelled when the run
fails before its trainer starts, counted and marked failed when it fails after, trained with its details."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from dpml.data.units import digests_of_ids
from dpml.accounting.accountants import certify
from dpml.ledger.ledger import BudgetExceeded, Ledger, LedgerError
from dpml.accounting.mechanism import MechanismDescription, NoisyGradientDescent, PoissonGaussianSteps
from dpml.ledger.spending import Charge, charged_run, reserve_and_start, training_recorded
from tests.conftest import REPO


def mechanism() -> MechanismDescription:
    return MechanismDescription("dpsgd", (PoissonGaussianSteps(0.05, 1.0, 100),), "add-remove", 1.0, 1000)


def kinds(ledger: Ledger, spend_id: int) -> list[str]:
    return [kind for kind, _ in ledger.events(spend_id)]


def test_a_failure_before_the_start_cancels_the_spend(ledger_location: str, tmp_path: Path) -> None:
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    seen = []

    def fails(spend: object) -> None:
        seen.append(spend)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        reserve_and_start(Charge(ledger, "v1", mechanism(), "run", 10.0, before_start=fails))
    (spend,) = seen
    assert kinds(ledger, spend.id)[-1] == "cancelled" and "started" not in kinds(ledger, spend.id)
    assert ledger.events(spend.id)[-1][1] == {"reason": "failed before training: OSError: disk full"}
    assert ledger.spends() == []  # a cancelled spend counts for no one
    assert ledger.cancel(spend.id, "again") and kinds(ledger, spend.id).count("cancelled") == 1  # recorded once


def test_the_spend_returned_is_the_spend_stored(ledger_location: str, tmp_path: Path) -> None:
    """Its reservation time too: with its id it is the spend's identity on a model version (``id@time``); and the
    number of units it charged, as stored (a spend without a unit list charged every unit: ``None``)."""
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    three = digests_of_ids(["a", "b", "c"])
    for mechanism_of_run, units in ((mechanism(), None), (None, None), (mechanism(), three)):
        spend = reserve_and_start(Charge(ledger, "v1", mechanism_of_run, "run", 10.0, units=units))
        assert [s for s in ledger.spends(counted_only=False) if s.id == spend.id] == [spend]
    assert spend.n_units == 3


def test_a_failure_during_training_is_recorded_and_the_spend_still_counts(ledger_location: str, tmp_path: Path) -> None:
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    spend = reserve_and_start(Charge(ledger, "v1", mechanism(), "run", 10.0))
    assert kinds(ledger, spend.id)[-1] == "started"
    with pytest.raises(KeyboardInterrupt), training_recorded(ledger, spend) as outcome:
        outcome["steps"] = 3
        raise KeyboardInterrupt
    events = ledger.events(spend.id)
    assert events[-1][0] == "failed" and "KeyboardInterrupt" in events[-1][1]["error"]
    assert [s.id for s in ledger.spends()] == [spend.id]
    assert not ledger.cancel(spend.id, "too late")  # started: counted for ever


def test_a_finished_training_is_recorded_with_its_details(ledger_location: str, tmp_path: Path) -> None:
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    spend = reserve_and_start(Charge(ledger, "v1", mechanism(), "run", 10.0))
    with training_recorded(ledger, spend) as outcome:
        outcome["steps"] = 7
    assert ledger.events(spend.id)[-1] == ("trained", {"steps": 7})


def test_a_refused_reservation_starts_nothing(ledger_location: str, tmp_path: Path) -> None:
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    called = []
    with pytest.raises(BudgetExceeded):
        reserve_and_start(Charge(ledger, "v1", mechanism(), "run", 0.01, before_start=called.append))
    assert called == [] and ledger.spends(counted_only=False) == []


def test_the_spend_is_reserved_with_every_setting_it_was_given(ledger_location: str, tmp_path: Path) -> None:
    """Each argument of reserve_and_start reaches the reservation: the data version, purpose, lineage and units
    on the spend, the start's process id on its event (pins the pass-through mutation testing found unchecked)."""
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    spend = reserve_and_start(
        Charge(ledger, "v7", mechanism(), "census model", 10.0, lineage="census", units=digests_of_ids(range(20)))
    )
    assert (spend.dataset_version, spend.label, spend.lineage, spend.n_units) == ("v7", "census model", "census", 20)
    assert ledger.events(spend.id)[-1] == ("started", {"pid": os.getpid()})
    assert ledger.summary("census")[0]["filter_order"] is None  # refuse mode, the default: no Rényi filter


def test_the_exclude_mode_and_the_kl_budget_reach_the_reservation(ledger_location: str, tmp_path: Path) -> None:
    """``mode="exclude"`` fixes the lineage's Rényi filter order at its first filtered run; a KL-private run is
    checked against ``kl_budget`` (refused without one, and over it)."""
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    reserve_and_start(
        Charge(
            ledger, "v1", mechanism(), "filtered", 10.0, lineage="F", units=digests_of_ids(range(10)), mode="exclude"
        )
    )
    assert ledger.summary("F")[0]["filter_order"] is not None
    kl_run = MechanismDescription(
        "noisygd", (NoisyGradientDescent("lecun", (20, 64, 3), 2.0, 50, 0.05, 0.5, True),), "replace-one", 0.0, 400
    )
    kl = certify(kl_run, 1e-5)["kl"]
    with pytest.raises(BudgetExceeded, match="kl_budget is not set"):
        reserve_and_start(Charge(ledger, "k", kl_run, "kl run", 10.0))
    with pytest.raises(BudgetExceeded, match="summed KL"):
        reserve_and_start(Charge(ledger, "k", kl_run, "kl run", 10.0, kl_budget=0.5 * kl))
    assert reserve_and_start(Charge(ledger, "k", kl_run, "kl run", 10.0, kl_budget=2 * kl)).lineage == "k"


def test_an_event_for_no_spend_is_refused_and_leaves_the_ledger_usable(ledger_location: str, tmp_path: Path) -> None:
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    spend = reserve_and_start(Charge(ledger, "v1", mechanism(), "run", 10.0))
    with pytest.raises(LedgerError, match="no spend with id 999"):
        ledger.record_event(999, "trained", {})
    ledger.record_event(spend.id, "trained", {"steps": 1})  # the refused event's transaction was rolled back
    assert kinds(ledger, spend.id) == ["started", "trained"]


def test_the_run_core_reserves_starts_trains_and_records(ledger_location: str, tmp_path: Path) -> None:
    """reserve → start → train → record, in that order: the training function runs after ``started``, receives
    the dict whose contents the ``trained`` event records, and its result comes back with the spend."""
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    seen: list[list[str]] = []

    def train(details: dict[str, object]) -> str:
        (spend,) = ledger.spends()
        seen.append(kinds(ledger, spend.id))
        details["steps"] = 11
        return "model"

    result, spend = charged_run(Charge(ledger, "v1", mechanism(), "run", 10.0, lineage="L"), train)
    assert result == "model" and spend is not None and spend.lineage == "L"
    assert seen == [["started"]]
    assert ledger.events(spend.id)[-1] == ("trained", {"steps": 11})


def test_the_run_core_trains_nothing_when_the_reservation_is_refused(ledger_location: str, tmp_path: Path) -> None:
    """Over budget: the refusal reaches ``agree`` (every process of a distributed run hears of it), no training
    starts, nothing is recorded, and the refusal is raised even when ``agree`` lets it through."""
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    agreed: list[BaseException | None] = []
    trained: list[object] = []
    with pytest.raises(BudgetExceeded):
        charged_run(Charge(ledger, "v1", mechanism(), "run", 0.01), trained.append, agreed.append)
    assert len(agreed) == 1 and isinstance(agreed[0], BudgetExceeded)
    assert trained == [] and ledger.spends(counted_only=False) == []


def test_the_run_core_records_a_failed_training_and_keeps_counting_it(ledger_location: str, tmp_path: Path) -> None:
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")

    def train(details: dict[str, object]) -> None:
        raise MemoryError("out of memory in step 3")

    with pytest.raises(MemoryError):
        charged_run(Charge(ledger, "v1", mechanism(), "run", 10.0), train)
    (spend,) = ledger.spends()  # counted
    assert ledger.events(spend.id)[-1] == ("failed", {"error": "MemoryError: out of memory in step 3"})


def test_a_disagreement_after_the_start_is_the_runs_failure(ledger_location: str, tmp_path: Path) -> None:
    """A distributed run whose processes fail to agree once the lead's spend has started trains nothing, and the
    spend — started, so the records may have been handed out — is recorded failed and counts."""
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    trained: list[object] = []

    def agree(refusal: BaseException | None) -> None:
        assert refusal is None
        raise RuntimeError("rank 1 is gone")

    with pytest.raises(RuntimeError, match="rank 1 is gone"):
        charged_run(Charge(ledger, "v1", mechanism(), "run", 10.0), trained.append, agree)
    (spend,) = ledger.spends()
    assert trained == [] and kinds(ledger, spend.id) == ["started", "failed"]


def test_an_uncharged_run_trains_without_a_ledger() -> None:
    agreed: list[BaseException | None] = []
    result, spend = charged_run(None, lambda details: sorted(details), agreed.append)
    assert (result, spend, agreed) == ([], None, [None])


def calls_in_dpml(names: set[str]) -> dict[str, list[int]]:
    """Lines of ``dpml/`` modules that call a function of these names (as ``f(…)`` or ``x.f(…)``)."""
    found: dict[str, list[int]] = {}
    for path in sorted((REPO / "dpml").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name in names:
                    found.setdefault(str(path.relative_to(REPO)), []).append(node.lineno)
    return found


def test_both_front_doors_spend_through_the_run_core() -> None:
    """The pipeline's train and tune stages and :func:`dpml.train_private` reserve and record only through
    :func:`charged_run`: no other module reserves a spend or wraps a training in its record."""
    assert set(calls_in_dpml({"reserve_and_start", "training_recorded", "reserve"})) == {"dpml/ledger/spending.py"}
    runs = calls_in_dpml({"charged_run"})
    assert set(runs) == {"dpml/api.py", "dpml/stages/train.py"} and len(runs["dpml/stages/train.py"]) == 2
