"""DP-GD (seed 002): full-batch DP-SGD, and its moments-accountant closed-form certificate."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dpml.config import ConfigError, load
from dpml.accounting.accountants import epsilon_moments_closed_form, epsilon_pld
from dpml.train.dpsgd import dpsgd_mechanism
from tests.conftest import small_params, write_params


@pytest.mark.parametrize(
    "sigma_seed,eta,steps", [(1.0, 0.1, 100), (4.0, 0.5, 1000), (0.5, 1.0, 10), (20.0, 0.01, 5000)]
)
def test_closed_form_is_seed_002s_formula_and_never_below_the_pld(sigma_seed: float, eta: float, steps: int) -> None:
    """θ ← θ − η·mean clip + sqrt(η)(2C/n)σ'·Z is the replace-one Gaussian step with σ = 2σ'/√η."""
    delta = 1e-5
    mechanism = dpsgd_mechanism(1.0, 2 * sigma_seed / math.sqrt(eta), steps, "replace-one", 1.0, 1000)
    assert mechanism.trainer == "dpgd"
    a = eta * steps / (2 * sigma_seed**2)
    closed = epsilon_moments_closed_form(mechanism, delta)
    assert closed == pytest.approx(a + 2 * math.sqrt(a * math.log(1 / delta)), rel=1e-12)
    assert closed >= epsilon_pld(mechanism, delta) - 1e-9


def test_closed_form_under_add_remove_and_refusal_of_subsampling() -> None:
    mechanism = dpsgd_mechanism(1.0, 3.0, 50, "add-remove", 1.0, 1000)
    a = 50 / (2 * 9.0)
    assert epsilon_moments_closed_form(mechanism, 1e-5) == pytest.approx(a + 2 * math.sqrt(a * math.log(1e5)))
    assert epsilon_moments_closed_form(mechanism, 1e-5) >= epsilon_pld(mechanism, 1e-5)
    with pytest.raises(NotImplementedError, match="full-batch"):
        epsilon_moments_closed_form(dpsgd_mechanism(0.1, 3.0, 50, "add-remove", 1.0, 1000), 1e-5)


def test_dpgd_needs_the_full_batch() -> None:
    with pytest.raises(ConfigError, match="train.sample_rate = 0.1: DP-GD"):
        load("params.yaml", ["train.algorithm=dpgd"])


def test_dpgd_trains_full_batch_and_is_certified_by_the_closed_form_too(workdir: Path) -> None:
    from dpml.stages import STAGES

    config = load(
        write_params(
            workdir / "gd.yaml",
            small_params(
                workdir,
                train={"algorithm": "dpgd", "sample_rate": 1.0, "epochs": 30, "learning_rate": 2.0},
                dp={"noise_multiplier": 8.0, "delta": 1e-5, "clip_norm": 1.0, "neighbouring": "replace-one"},
            ),
        )
    )
    for name in ("ingest", "split", "preprocess"):
        STAGES[name](config)
    metrics = STAGES["train"](config)
    assert metrics["train_steps"] == 30 and metrics["train_empty_batches"] == 0
    certificate = STAGES["certify"](config)["certificate"]
    answers = {a["name"]: a["epsilon"] for a in certificate["answers"]}
    assert certificate["mechanism"]["trainer"] == "dpgd"
    assert answers["moments_accountant.closed_form"] >= answers["dp_accounting.pld"] - 1e-9
    assert certificate["epsilon"] == pytest.approx(answers["dp_accounting.pld"])
    assert metrics["test_accuracy"] > 0.5
