"""Seed 002's random-features model, its Hermite checks, and DP-GD with the privacy-for-free hyperparameters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpml.models.random_features import (
    RandomFeatures,
    RandomFeaturesSpec,
    check_activation,
    fit_min_norm,
    hermite_coefficients,
    tanh_even,
)
from dpml.accounting.accountants import epsilon_moments_closed_form
from dpml.train.clipping import clipped_gradient_sum
from dpml.train.privacy_for_free import (
    certified_epsilon,
    dpgd_noise_std,
    privacy_for_free_hyperparameters,
    sigma_for_epsilon,
    steps_for,
    train_dpgd_random_features,
)


def sphere_data(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=generator, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True) * math.sqrt(d)
    return x, torch.sign(torch.randn(n, generator=generator, dtype=torch.float64))


# ---------------------------------------------------------------- Hermite coefficients


def test_hermite_coefficients_of_known_functions() -> None:
    he3 = lambda t: (t**3 - 3 * t) / math.sqrt(6)  # noqa: E731 — the normalised He_3 itself
    np.testing.assert_allclose(hermite_coefficients(he3, 5), [0, 0, 0, 1, 0, 0], atol=1e-9)
    np.testing.assert_allclose(hermite_coefficients(lambda t: t**2, 4), [1, 0, math.sqrt(2), 0, 0], atol=1e-9)
    relu = hermite_coefficients(lambda t: np.maximum(t, 0.0), 2)  # 1/√(2π), 1/2, 1/(2√π)
    np.testing.assert_allclose(relu, [1 / math.sqrt(2 * math.pi), 0.5, 1 / (2 * math.sqrt(math.pi))], atol=1e-7)
    tanh = hermite_coefficients(torch.tanh, 21)
    np.testing.assert_allclose(tanh[0::2], 0.0, atol=1e-12)  # odd function: even coefficients vanish
    assert tanh[1] == pytest.approx(0.6057055, abs=1e-6) and tanh[3] == pytest.approx(-0.1484372, abs=1e-6)
    t = np.linspace(-12, 12, 240_001)
    second_moment = np.trapezoid(np.tanh(t) ** 2 * np.exp(-t * t / 2), t) / math.sqrt(2 * math.pi)
    assert float(np.sum(tanh**2)) == pytest.approx(second_moment, abs=1e-4)  # Parseval


def test_activation_conditions_are_enforced_with_a_clear_error() -> None:
    check_activation(torch.tanh)
    coefficients = check_activation(tanh_even, require_sign_recovery=True)
    assert abs(coefficients[0]) < 1e-9 and abs(coefficients[2]) < 1e-9  # e0 = e2 = 0 in closed form
    assert abs(coefficients[3]) > 0.1 and abs(coefficients[4]) > 0.1  # both parities of order ≥ 3
    with pytest.raises(ValueError, match=r"relu violates .*φ0 = 0\.39894.*φ2 = 0\.28209"):
        check_activation(torch.relu, "relu")
    with pytest.raises(ValueError, match=r"φ0 = 0\.5 \(must be 0\)"):
        check_activation(torch.sigmoid, "sigmoid")
    with pytest.raises(ValueError, match="non-linear"):
        check_activation(lambda t: 2 * t, "linear")
    with pytest.raises(ValueError, match=r"φ1 = .* \(must be ≠ 0\)"):
        check_activation(lambda t: t**3 - 3 * t, "He3")
    with pytest.raises(ValueError, match="different parity"):
        check_activation(torch.tanh, "tanh", require_sign_recovery=True)


def test_feature_kernel_matches_the_hermite_series() -> None:
    """E_v[φ(⟨v,x⟩)φ(⟨v,x'⟩)] = Σ_ℓ φ_ℓ² (⟨x,x'⟩/d)^ℓ for ‖x‖ = ‖x'‖ = √d (Monte Carlo over 200k features)."""
    d = 8
    model = RandomFeatures(RandomFeaturesSpec(d, 200_000, activation="tanh_even", feature_seed=3)).double()
    x, _ = sphere_data(3, d, seed=1)
    x[1] = (x[0] + 0.5 * x[1]) / (x[0] + 0.5 * x[1]).norm() * math.sqrt(d)  # a strongly correlated pair
    with torch.no_grad():
        phi = model.feature_map(x)
    empirical = (phi @ phi.t() / phi.shape[1]).numpy()
    coefficients = hermite_coefficients(tanh_even, 20)
    cosines = (x @ x.t() / d).numpy()
    series = sum(c * c * cosines**ell for ell, c in enumerate(coefficients))
    np.testing.assert_allclose(empirical, series, atol=6e-3)


# ---------------------------------------------------------------- the model


def test_spec_round_trip_public_features_and_zero_init() -> None:
    spec = RandomFeaturesSpec(12, 3000, n_outputs=2, activation="tanh_even", feature_seed=5)
    payload = spec.to_dict()
    assert payload["kind"] == "random_features" and RandomFeaturesSpec.from_dict(payload) == spec
    a, b = RandomFeatures(spec), RandomFeatures(RandomFeaturesSpec.from_dict(payload))
    assert torch.equal(a.features, b.features) and "features" in dict(a.named_buffers())
    assert [name for name, _ in a.named_parameters()] == ["weight"] and torch.all(a.weight == 0)
    assert a.features.shape == (3000, 12) and a.features.var().item() == pytest.approx(1 / 12, rel=0.03)
    assert a(torch.randn(4, 12)).shape == (4, 2)
    with pytest.raises(ValueError, match="activation = 'relu'"):
        RandomFeaturesSpec(12, 30, activation="relu")
    with pytest.raises(ValueError, match="n_features = 0"):
        RandomFeaturesSpec(12, 0)


def test_clipping_engine_shortcut_matches_per_example_autograd() -> None:
    model = RandomFeatures(RandomFeaturesSpec(6, 50, n_outputs=2)).double()
    with torch.no_grad():
        model.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    x = torch.randn(7, 6, dtype=torch.float64)
    y = torch.randn(7, 2, dtype=torch.float64)
    loss = lambda out, target: (out - target).pow(2).sum(1)  # noqa: E731
    sums, norms = clipped_gradient_sum(model, loss, x, y, clip_norm=1.0)
    grads = [torch.autograd.grad(loss(model(x[i : i + 1]), y[i : i + 1]).sum(), model.weight)[0] for i in range(7)]
    expected_norms = torch.stack([g.norm() for g in grads])
    torch.testing.assert_close(norms, expected_norms)
    factors = torch.clamp(1.0 / (expected_norms + 1e-6), max=1.0)
    torch.testing.assert_close(sums["weight"], sum(f * g for f, g in zip(factors, grads, strict=True)))


# ---------------------------------------------------------------- DP-GD and privacy for free


def test_privacy_for_free_hyperparameters_formula() -> None:
    hp = privacy_for_free_hyperparameters(n=1000, d=20, p=4000)
    assert hp.clip_norm == pytest.approx(math.sqrt(4000) * math.log(1000) ** 2)
    assert hp.continuous_time == pytest.approx(20 / 4000 * math.log(1000) ** 2)
    assert steps_for(hp.continuous_time, 0.01) == round(hp.continuous_time / 0.01)
    with pytest.raises(ValueError, match="n = 1"):
        privacy_for_free_hyperparameters(n=1, d=20, p=4000)
    with pytest.raises(ValueError, match="p = 0"):
        privacy_for_free_hyperparameters(n=10, d=20, p=0)


def test_dpgd_noise_matches_the_certificates_sigma() -> None:
    """With zero data the gradients vanish, so θ_T is the noise alone: its std must be
    sqrt(T)·sqrt(η)(2C/n)σ, which is what the mechanism's noise multiplier 2σ/√η means on the clipped sum."""
    p, n, eta, clip, sigma, steps = 40_000, 50, 0.04, 3.0, 1.7, 4
    model = RandomFeatures(RandomFeaturesSpec(5, p)).double()
    zeros = torch.zeros(n, 5, dtype=torch.float64)
    result = train_dpgd_random_features(
        model,
        zeros,
        torch.zeros(n, dtype=torch.float64),
        learning_rate=eta,
        steps=steps,
        clip_norm=clip,
        sigma=sigma,
        seed=11,
    )
    expected = math.sqrt(steps) * math.sqrt(eta) * 2 * clip / n * sigma
    assert result.noise_std == pytest.approx(dpgd_noise_std(eta, clip, n, sigma))
    assert float(result.theta.std()) == pytest.approx(expected, rel=0.02)
    event = result.mechanism.events[0]
    assert (event.sample_rate, event.steps, result.mechanism.neighbouring) == (1.0, steps, "replace-one")
    # dpml's dpgd: θ ← θ − η(Σ clip + N(0, s²C²))/n, so the per-step std on θ is η·s·C/n.
    assert eta * event.noise_multiplier * clip / n == pytest.approx(result.noise_std, rel=1e-12)
    a = eta * steps / (2 * sigma**2)
    assert certified_epsilon(result, 1e-5) == pytest.approx(a + 2 * math.sqrt(a * math.log(1e5)), rel=1e-12)


def test_sigma_for_epsilon_inverts_the_closed_form() -> None:
    for epsilon in (0.3, 1.0, 8.0):
        sigma = sigma_for_epsilon(epsilon, 1e-6, continuous_time=0.7)
        model = RandomFeatures(RandomFeaturesSpec(3, 10)).double()
        x, y = sphere_data(4, 3, seed=0)
        result = train_dpgd_random_features(
            model, x, y, learning_rate=0.07, steps=10, clip_norm=1.0, sigma=sigma, seed=0
        )
        assert epsilon_moments_closed_form(result.mechanism, 1e-6) == pytest.approx(epsilon, rel=1e-9)
    with pytest.raises(ValueError, match="epsilon = -1"):
        sigma_for_epsilon(-1, 1e-5, 1.0)


def test_clipped_fraction_is_zero_for_a_huge_clip_norm_and_one_for_a_tiny_one() -> None:
    x, y = sphere_data(30, 6, seed=2)
    # the noise std is proportional to C, so the huge-C run takes a tiny σ (noise std ≈ 7e-6 per coordinate)
    for clip, sigma, expected in ((1e9, 1e-12, 0.0), (1e-9, 0.5, 1.0)):
        model = RandomFeatures(RandomFeaturesSpec(6, 300)).double()
        result = train_dpgd_random_features(
            model, x, y, learning_rate=0.01, steps=20, clip_norm=clip, sigma=sigma, seed=1
        )
        assert result.clipped_fraction == expected


def test_noiseless_unclipped_dpgd_is_gradient_descent_on_the_square_loss() -> None:
    """σ = 0 and a huge C: θ ← θ − η∇R̂, R̂(θ) = (1/n)Σ(y_i − φ(Vx_i)ᵀθ)², checked against autograd; the
    iterates approach the min-norm interpolator."""
    x, y = sphere_data(8, 5, seed=4)
    model = RandomFeatures(RandomFeaturesSpec(5, 400, feature_seed=1)).double()
    eta = 0.01
    result = train_dpgd_random_features(model, x, y, learning_rate=eta, steps=7, clip_norm=1e12, sigma=0.0)
    assert result.mechanism is None and certified_epsilon(result, 1e-5) == math.inf
    reference = RandomFeatures(RandomFeaturesSpec(5, 400, feature_seed=1)).double()
    for _ in range(7):
        loss = (y - reference(x).squeeze(1)).pow(2).mean()
        (gradient,) = torch.autograd.grad(loss, reference.weight)
        with torch.no_grad():
            reference.weight -= eta * gradient
    torch.testing.assert_close(model.weight, reference.weight)
    long_run = RandomFeatures(RandomFeaturesSpec(5, 400, feature_seed=1)).double()
    train_dpgd_random_features(long_run, x, y, learning_rate=eta, steps=3000, clip_norm=1e12, sigma=0.0)
    min_norm = fit_min_norm(RandomFeatures(RandomFeaturesSpec(5, 400, feature_seed=1)).double(), x, y)
    assert float((long_run.weight.detach() - min_norm).norm() / min_norm.norm()) < 1e-3


def test_invalid_training_parameters_are_refused() -> None:
    model = RandomFeatures(RandomFeaturesSpec(4, 20)).double()
    x, y = sphere_data(5, 4, seed=0)
    with pytest.raises(ValueError, match="learning_rate = 0"):
        train_dpgd_random_features(model, x, y, learning_rate=0, steps=1, clip_norm=1.0, sigma=1.0)
    with pytest.raises(ValueError, match="sigma = -1"):
        train_dpgd_random_features(model, x, y, learning_rate=0.1, steps=1, clip_norm=1.0, sigma=-1.0)
    with pytest.raises(ValueError, match=r"x has shape \(5, 3\)"):
        train_dpgd_random_features(model, x[:, :3], y, learning_rate=0.1, steps=1, clip_norm=1.0, sigma=1.0)
