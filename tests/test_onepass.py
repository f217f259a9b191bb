"""Seed 002's one-pass DP-SGD with aggressive clipping on linear regression, certified by zCDP by iteration."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpml.accounting.zcdp import schedule_rho, zcdp_to_dp
from dpml.train.onepass import (
    clip_inputs,
    excess_risk,
    learning_rate_schedule,
    rho_for_epsilon,
    theory_rate,
    train_onepass_dpsgd,
)


def regression(n: int, d: int, seed: int, label_noise: float = 0.5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x ~ N(0, I_d), y = xᵀθ* + N(0, τ²), ‖θ*‖ = 1."""
    rng = np.random.default_rng(seed)
    theta_star = rng.standard_normal(d)
    theta_star /= np.linalg.norm(theta_star)
    x = rng.standard_normal((n, d))
    return x, x @ theta_star + label_noise * rng.standard_normal(n), theta_star


@pytest.mark.parametrize("epsilon,delta", [(0.1, 1e-5), (1.0, 1e-6), (8.0, 1e-3), (50.0, 1e-9)])
def test_rho_for_epsilon_inverts_the_zcdp_conversion_exactly(epsilon: float, delta: float) -> None:
    rho = rho_for_epsilon(epsilon, delta)
    assert zcdp_to_dp(rho, delta) == pytest.approx(epsilon, rel=1e-12)
    assert zcdp_to_dp(rho * 1.001, delta) > epsilon  # and it is the largest such ρ
    with pytest.raises(ValueError, match="epsilon = 0"):
        rho_for_epsilon(0.0, delta)
    with pytest.raises(ValueError, match="delta = 1"):
        rho_for_epsilon(1.0, 1.0)


@pytest.mark.parametrize("schedule", ["out", "const"])
def test_certified_rho_equals_the_target(schedule: str) -> None:
    x, y, _ = regression(500, 10, seed=0)
    result = train_onepass_dpsgd(
        x,
        y,
        epsilon=2.0,
        delta=1e-5,
        schedule=schedule,
        eta0=1.0,
        clip_constant=1.0,
        input_norm_bound=math.sqrt(10) + 3,
        seed=0,
    )
    target = rho_for_epsilon(2.0, 1e-5)
    assert result.rho == pytest.approx(target, rel=1e-9)
    assert result.rho == pytest.approx(schedule_rho(result.learning_rates, result.noise), rel=1e-12)
    assert result.epsilon == pytest.approx(2.0, rel=1e-9)
    expected_rates = learning_rate_schedule(schedule, 1.0, 500)  # type: ignore[arg-type]
    np.testing.assert_allclose(result.learning_rates, expected_rates)
    assert result.certificate()["zcdp"] == pytest.approx(target**2 / 2)
    if schedule == "out":
        assert np.all(result.noise[:-1] == 0) and result.noise[-1] > 0
    else:
        assert np.all(result.noise > 0)


def test_step_sizes_above_two_over_beta_are_refused() -> None:
    x, y, _ = regression(100, 4, seed=1)
    bound = 3.0  # β = X² = 9, so η_k ≤ 2/9; OUT gives η_k = eta0/100
    with pytest.raises(ValueError, match=r"η_1 = 0\.25 exceeds 2/β = 0\.222222 \(β = X² = 9\)"):
        train_onepass_dpsgd(
            x, y, epsilon=1.0, delta=1e-5, schedule="out", eta0=25.0, clip_constant=1.0, input_norm_bound=bound, seed=0
        )
    result = train_onepass_dpsgd(
        x, y, epsilon=1.0, delta=1e-5, schedule="out", eta0=22.0, clip_constant=1.0, input_norm_bound=bound, seed=0
    )
    assert result.inputs_clipped == int(np.sum(np.linalg.norm(x, axis=1) > bound)) > 0
    clipped, count = clip_inputs(x, bound)
    assert count == result.inputs_clipped and np.all(np.linalg.norm(clipped, axis=1) <= bound + 1e-12)


def test_noise_std_is_two_c_sigma_per_step() -> None:
    """Zero inputs give zero gradients, so θ_n is the noise alone: OUT puts all of it on the last step,
    std 2Cσ_n = 2·c√d·η_n/ρ (the convention of dpml.accounting.zcdp)."""
    n, d, c = 3, 20_000, 0.7
    x, y = np.zeros((n, d)), np.ones(n)
    result = train_onepass_dpsgd(
        x, y, epsilon=1.0, delta=1e-5, schedule="out", eta0=0.9, clip_constant=c, input_norm_bound=1.0, seed=3
    )
    expected = 2 * c * math.sqrt(d) * (0.9 / n) / rho_for_epsilon(1.0, 1e-5)
    assert result.clip_norm == pytest.approx(c * math.sqrt(d))
    assert float(np.std(result.theta)) == pytest.approx(expected, rel=0.03)


def test_clipped_fraction_extremes() -> None:
    x, y, _ = regression(300, 8, seed=2)
    kwargs = dict(epsilon=1.0, delta=1e-5, schedule="const", eta0=1.0, input_norm_bound=math.sqrt(8) + 3, seed=0)
    assert train_onepass_dpsgd(x, y, clip_constant=1e-6, **kwargs).clipped_fraction == 1.0  # type: ignore[arg-type]
    huge = train_onepass_dpsgd(x, y, clip_constant=1e4, **kwargs)  # type: ignore[arg-type]
    assert huge.clipped_fraction == 0.0


def test_excess_risk_decreases_with_n() -> None:
    """d = 20, ε = 2: one pass over n ∈ {200, 2000, 20000} records, η̃(0) = log(1/γ)/2, mean over 3 seeds."""
    d = 20
    for schedule in ("out", "const"):
        risks = []
        for n in (200, 2000, 20_000):
            eta0 = 0.5 * math.log(n / d)
            values = []
            for seed in range(3):
                x, y, theta_star = regression(n, d, seed)
                result = train_onepass_dpsgd(
                    x,
                    y,
                    epsilon=2.0,
                    delta=1e-5,
                    schedule=schedule,  # type: ignore[arg-type]
                    eta0=eta0,
                    clip_constant=1.0,
                    input_norm_bound=math.sqrt(d) + 4,
                    seed=seed,
                )
                values.append(excess_risk(result.theta, theta_star))
            risks.append(float(np.mean(values)))
        assert risks[0] > 2 * risks[1] > 4 * risks[2], (schedule, risks)
    assert theory_rate(0.1, 0.5) == pytest.approx(0.1 + 0.04)


def test_invalid_parameters_are_refused() -> None:
    x, y, _ = regression(10, 3, seed=0)
    kwargs = dict(epsilon=1.0, delta=1e-5, eta0=1.0, clip_constant=1.0, input_norm_bound=4.0)
    with pytest.raises(ValueError, match="schedule = 'opt'"):
        train_onepass_dpsgd(x, y, schedule="opt", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip_constant = 0"):
        train_onepass_dpsgd(x, y, schedule="out", **(kwargs | {"clip_constant": 0.0}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"x has shape \(10, 3\) and y \(9,\)"):
        train_onepass_dpsgd(x, y[:9], schedule="out", **kwargs)  # type: ignore[arg-type]
    assert excess_risk(np.ones(3), np.zeros(3)) == pytest.approx(1.5)
    assert excess_risk(np.ones(2), np.zeros(2), np.diag([2.0, 0.0])) == pytest.approx(1.0)


# ---- the zCDP event in the accountants, the ledger and the pipeline (train.algorithm: onepass) ----


@pytest.mark.parametrize("rho", [0.005, 0.05, 0.5, 2.0])
def test_zcdp_accountants_are_never_below_the_exact_gaussian_and_agree_in_order(rho: float) -> None:
    """A Gaussian mechanism with μ = sqrt(2ρ) is ρ-zCDP, so no valid ρ-zCDP conversion may be below its exact ε."""
    from dpml.accounting.accountants import certify
    from dpml.accounting.gdp import gdp_epsilon
    from dpml.accounting.mechanism import ConcentratedDP, MechanismDescription

    mechanism = MechanismDescription("onepass", (ConcentratedDP(rho),), "replace-one", 1.0, 1000, "final-model")
    certificate = certify(mechanism, 1e-5)
    answers = {a["name"]: a["epsilon"] for a in certificate["answers"]}
    assert set(answers) == {"zcdp.rdp[dp_accounting]", "zcdp.bun_steinke", "autodp.zcdp"}  # nothing else is asked
    exact_gaussian = gdp_epsilon(math.sqrt(2 * rho), 1e-5)
    assert all(value >= exact_gaussian * (1 - 1e-6) for value in answers.values())
    assert answers["zcdp.bun_steinke"] == pytest.approx(rho + 2 * math.sqrt(rho * math.log(1e5)))
    assert answers["zcdp.rdp[dp_accounting]"] <= answers["zcdp.bun_steinke"]
    assert certificate["epsilon"] == min(answers.values())


def test_ledger_composes_a_zcdp_spend_with_dp_sgd_in_rdp(tmp_path) -> None:
    from dpml.accounting.accountants import tight_epsilon
    from dpml.ledger.ledger import Ledger
    from dpml.accounting.mechanism import ConcentratedDP, MechanismDescription, PoissonGaussianSteps

    zcdp = MechanismDescription("onepass", (ConcentratedDP(0.05),), "add-remove", 1.0, 1000, "final-model")
    dpsgd = MechanismDescription("dpsgd", (PoissonGaussianSteps(0.01, 1.0, 500),), "add-remove", 1.0, 1000)
    ledger = Ledger(tmp_path / "ledger.db", 1e-5)
    ledger.reserve("data", zcdp, "one pass", 100.0)
    ledger.reserve("data", dpsgd, "dp-sgd", 100.0)
    total = ledger.total("data")
    alone = [tight_epsilon(zcdp, 1e-5), tight_epsilon(dpsgd, 1e-5)]
    assert max(alone) < total <= sum(alone) + 1e-9  # composed in RDP: more than either, not above their sum


def test_onepass_pipeline_certifies_the_final_model_by_zcdp(workdir) -> None:
    from dpml import io
    from dpml.config import ConfigError, load
    from dpml.stages import STAGES, Layout
    from tests.conftest import small_params, write_params

    params = small_params(
        workdir,
        model={"kind": "mlp", "hidden": []},
        train={"algorithm": "onepass", "loss": "squared", "epochs": 1},
        dp={"noise_multiplier": None, "target_epsilon": 8.0, "delta": 1e-5, "neighbouring": "replace-one"},
        onepass={"schedule": "const", "eta0": 30.0, "clip_constant": 0.5},
        audit={"white_box_canaries": 0, "black_box_canaries": 0},
        gate={"epsilon_budget": 8.0},
    )
    config = load(write_params(workdir / "op.yaml", params))
    for name in ("ingest", "split", "preprocess", "train", "certify", "audit"):
        STAGES[name](config)
    layout = Layout(config)
    certificate = io.read_json(layout.certificate)
    assert certificate["mechanism"]["trainer"] == "onepass" and certificate["threat_model"] == "final-model"
    assert 7.9 < certificate["epsilon"] <= 8.0  # calibrated to the target by the certifying conversion
    metrics = io.read_json(layout.train_metrics)
    rho = math.sqrt(2 * certificate["mechanism"]["events"][0]["rho"])
    assert metrics["train_rho_by_iteration"] == pytest.approx(rho, rel=1e-9)  # the schedules actually used
    assert metrics["test_accuracy"] > 0.5  # ≈0.7 measured on digits
    assert STAGES["gate"](config)["passed"]
    with pytest.raises(ConfigError, match="model.hidden"):
        load(write_params(workdir / "bad.yaml", params | {"model": {"kind": "mlp", "hidden": [16]}}))
    too_fast = params | {"onepass": {"schedule": "out", "eta0": 500.0, "clip_constant": 1.0}}
    with pytest.raises(ValueError, match="onepass.eta0 = 500"):
        STAGES["train"](load(write_params(workdir / "fast.yaml", too_fast)))


def test_inputs_projected_in_float32_onto_the_ball_are_accepted_and_held_exactly_inside_it() -> None:
    """Rows projected onto the X = 1 ball in float32 (as the pipeline's preprocessing hands them over) sit a
    rounding error outside it in float64: they train (re-projected in float64, so β = X² + 1 holds exactly),
    the caller's array is not modified; a row clearly outside the ball is still refused."""
    import torch

    from dpml.train.onepass import onepass_linear_classifier

    rng = np.random.default_rng(3)
    x = rng.normal(size=(400, 7)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True).astype(np.float32)
    assert np.linalg.norm(x.astype(np.float64), axis=1).max() > 1.0  # outside by a float32 rounding error
    before = x.copy()
    y = rng.integers(0, 3, size=400)
    arguments = dict(rho=0.5, schedule="const", eta0=1.0, clip_norm=1.0, input_norm_bound=1.0, seed=0)
    onepass_linear_classifier(torch.nn.Linear(7, 3), x, y, **arguments)
    np.testing.assert_array_equal(x, before)
    x[0] *= 1.01
    with pytest.raises(ValueError, match="exceed the bound X = 1"):
        onepass_linear_classifier(torch.nn.Linear(7, 3), x, y, **arguments)
