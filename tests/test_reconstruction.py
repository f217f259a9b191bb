"""Seed 002's reconstruction attack on random-features models (Iurada, Bombari, Tommasi & Mondelli)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpml.audit.reconstruction import best_match_overlaps, reconstruction_audit, residual_fraction
from dpml.models.random_features import RandomFeatures, RandomFeaturesSpec, fit_min_norm
from dpml.train.privacy_for_free import (
    privacy_for_free_hyperparameters,
    sigma_for_epsilon,
    steps_for,
    train_dpgd_random_features,
)

D, N = 10, 5


def sphere_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=generator, dtype=torch.float64)
    return x / x.norm(dim=1, keepdim=True) * math.sqrt(D), torch.sign(
        torch.randn(N, generator=generator, dtype=torch.float64)
    )


def interpolator(p: int, seed: int, activation: str = "tanh") -> tuple[RandomFeatures, torch.Tensor]:
    x, y = sphere_data(seed)
    model = RandomFeatures(RandomFeaturesSpec(D, p, activation=activation, feature_seed=seed)).double()
    fit_min_norm(model, x, y)
    return model, x


def test_objective_vanishes_at_the_training_points_and_not_elsewhere() -> None:
    model, x = interpolator(2000, seed=0)
    theta = model.weight.detach()
    assert float(residual_fraction(model, theta, x)) < 1e-12
    assert float(residual_fraction(model, theta, -x)) < 1e-12  # odd φ: the span cannot see the sign
    others, _ = sphere_data(seed=99)
    assert float(residual_fraction(model, theta, others)) > 0.3
    signed_model, signed_x = interpolator(2000, seed=0, activation="tanh_even")
    signed_theta = signed_model.weight.detach()
    assert float(residual_fraction(signed_model, signed_theta, -signed_x)) > 0.01  # both parities: it can


def test_overlaps_are_best_match_absolute_cosines() -> None:
    x = torch.eye(3, dtype=torch.float64)
    candidates = torch.tensor([[-2.0, 0.0, 0.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    np.testing.assert_allclose(best_match_overlaps(x, candidates), [1.0, 1 / math.sqrt(2), 1 / math.sqrt(2)])
    np.testing.assert_allclose(
        best_match_overlaps(x, candidates, signed=True), [0.0, 1 / math.sqrt(2), 1 / math.sqrt(2)]
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_attack_recovers_the_training_points_of_a_wide_interpolator(seed: int) -> None:
    """p = 2000 = 40·dn: the min-norm (gradient-descent-from-zero) solution gives its training set away."""
    model, x = interpolator(2000, seed)
    report = reconstruction_audit(model, x, seed=seed)
    assert report["summary"]["fraction_above_0.9"] >= 0.8, report["overlaps"]
    assert report["summary"]["mean"] > report["chance_summary"]["mean"] + 0.3
    assert report["p_over_dn"] == pytest.approx(40.0) and len(report["overlaps"]) == N


def test_attack_fails_below_dn_parameters() -> None:
    """p = 25 < dn = 50: five candidates span θ whatever they are, so the objective carries no information."""
    model, x = interpolator(25, seed=0)
    report = reconstruction_audit(model, x, seed=0)
    assert report["residual_fraction"] < 1e-6  # the attack did solve its problem ...
    assert report["summary"]["fraction_above_0.9"] <= 0.4  # ... and the solution is not the training set


def test_dp_gd_model_leaks_much_less() -> None:
    """The same data and features, trained by DP-GD with the privacy-for-free C and T at ε = 1."""
    x, y = sphere_data(seed=0)
    p = 2000
    hp = privacy_for_free_hyperparameters(N, D, p)
    eta = hp.continuous_time / 20
    model = RandomFeatures(RandomFeaturesSpec(D, p, feature_seed=0)).double()
    train_dpgd_random_features(
        model,
        x,
        y,
        learning_rate=eta,
        steps=steps_for(hp.continuous_time, eta),
        clip_norm=hp.clip_norm,
        sigma=sigma_for_epsilon(1.0, 1e-5, hp.continuous_time),
        seed=5,
    )
    private = reconstruction_audit(model, x, seed=0)
    open_model, _ = interpolator(p, seed=0)
    public = reconstruction_audit(open_model, x, seed=0)
    assert private["summary"]["fraction_above_0.9"] <= 0.2
    assert private["summary"]["mean"] < public["summary"]["mean"] - 0.25


def test_invalid_audit_parameters_are_refused() -> None:
    model, x = interpolator(200, seed=0)
    with pytest.raises(ValueError, match=r"x_train has shape \(5, 9\)"):
        reconstruction_audit(model, x[:, :9])
    with pytest.raises(ValueError, match="restarts = 0"):
        reconstruction_audit(model, x, restarts=0)
    empty = RandomFeatures(RandomFeaturesSpec(D, 200))
    with pytest.raises(ValueError, match="θ is zero"):
        reconstruction_audit(empty, x)
