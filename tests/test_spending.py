"""A run's spend through its life (dpml/privacy/spending.py), as both front doors make it: cancelled when the run
fails before its trainer starts, counted and marked failed when it fails after, trained with its details."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpml.privacy.ledger import BudgetExceeded, Ledger
from dpml.privacy.mechanism import MechanismDescription, PoissonGaussianSteps
from dpml.privacy.spending import reserve_and_start, training_recorded


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
        reserve_and_start(ledger, "v1", mechanism(), "run", 10.0, before_start=fails)
    (spend,) = seen
    assert kinds(ledger, spend.id)[-1] == "cancelled" and "started" not in kinds(ledger, spend.id)
    assert ledger.spends() == []  # a cancelled spend counts for no one


def test_a_failure_during_training_is_recorded_and_the_spend_still_counts(ledger_location: str, tmp_path: Path) -> None:
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    spend = reserve_and_start(ledger, "v1", mechanism(), "run", 10.0)
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
    spend = reserve_and_start(ledger, "v1", mechanism(), "run", 10.0)
    with training_recorded(ledger, spend) as outcome:
        outcome["steps"] = 7
    assert ledger.events(spend.id)[-1] == ("trained", {"steps": 7})


def test_a_refused_reservation_starts_nothing(ledger_location: str, tmp_path: Path) -> None:
    ledger = Ledger(ledger_location, 1e-5, unit_key=tmp_path / "unit.key")
    called = []
    with pytest.raises(BudgetExceeded):
        reserve_and_start(ledger, "v1", mechanism(), "run", 0.01, before_start=called.append)
    assert called == [] and ledger.spends(counted_only=False) == []
