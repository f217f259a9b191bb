"""NoisyCGD on the gated convex model (seed 001): the GDP bound, its hypotheses, the trainer, the accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from dpml.config import ConfigError, load
from dpml.models.gated import GatedLinear, GatedSpec, lipschitz_bound, smoothness_bound
from dpml.accounting.accountants import certify, epsilon_pld, tight_epsilon
from dpml.accounting.gdp import (
    calibrate_l2,
    contraction_factor,
    gdp_delta,
    gdp_epsilon,
    gdp_mu,
    noisycgd_mu,
    noisycgd_mu_factor,
)
from dpml.ledger.ledger import Ledger
from dpml.accounting.mechanism import GaussianDP, MechanismDescription, PoissonGaussianSteps
from dpml.train.clipping import clipped_gradient_sum
from dpml.train.dpsgd import LOSSES
from dpml.train.noisycgd import NoisyCgdSettings, cyclic_batches, noisycgd_mechanism, train_noisycgd


# --- Theorem 2.8 against the GDP composition it comes from ------------------------------------------


def shifted_interpolation_mu(c: float, k: int, epochs: int, position: int) -> float:
    """min sqrt(Σ_t a_t²) over shifts a_t ≥ 0 with z_t = c z_{t−1} + s_t − a_t ≥ 0, z_T = 0 (z_0 = 0).

    The privacy-amplification-by-iteration composition behind Theorem 2.8 for a record in batch
    ``position`` (1..k), in units of L/(bσ_g): step t is (a_t)-GDP, s_t = 1 when the record's batch
    is visited, z_t the distance the remaining steps must still absorb; GDP composes as Σ a_t².
    """
    steps = k * epochs
    s = np.zeros(steps)
    s[[position - 1 + k * e for e in range(epochs)]] = 1.0

    def distances(a: np.ndarray) -> np.ndarray:
        z, out = 0.0, []
        for t in range(steps):
            z = c * z + s[t] - a[t]
            out.append(z)
        return np.array(out)

    result = minimize(
        lambda a: float((a**2).sum()),
        s.copy(),
        jac=lambda a: 2 * a,
        method="SLSQP",
        bounds=[(0, None)] * steps,
        options={"ftol": 1e-14, "maxiter": 1000},
        constraints=[
            {"type": "eq", "fun": lambda a: distances(a)[-1]},
            {"type": "ineq", "fun": lambda a: distances(a)[:-1]},
        ],
    )
    assert result.success, result.message
    return math.sqrt(result.fun)


def linear_gaussian_mu(c: float, k: int, epochs: int, position: int) -> float:
    """Exact μ of one instance the theorem covers: h(θ) linear in θ plus (λ/2)‖θ‖², so each step is
    θ ← cθ − η(g_j + Z_j); the final θ is Gaussian and two neighbours differ only in its mean."""
    steps = k * epochs
    weights = np.array([c ** (steps - 1 - t) for t in range(steps)])
    visits = np.zeros(steps)
    visits[[position - 1 + k * e for e in range(epochs)]] = 1.0
    return float(weights @ visits / np.sqrt((weights**2).sum()))


@pytest.mark.parametrize("c", [0.5, 0.8, 0.95])
@pytest.mark.parametrize("k,epochs", [(2, 2), (3, 3), (4, 2), (2, 4)])
def test_mu_formula_is_the_optimal_shifted_interpolation_at_the_worst_position(c: float, k: int, epochs: int) -> None:
    per_position = [shifted_interpolation_mu(c, k, epochs, j) for j in range(1, k + 1)]
    assert noisycgd_mu_factor(c, k, epochs) == pytest.approx(max(per_position), rel=1e-5)
    assert int(np.argmax(per_position)) == k - 1  # the record in the last batch is the worst case


@pytest.mark.parametrize("c", [0.3, 0.9, 0.999])
@pytest.mark.parametrize("k,epochs", [(1, 3), (2, 5), (5, 3), (10, 20)])
def test_mu_formula_is_at_least_the_exact_mu_of_a_linear_instance(c: float, k: int, epochs: int) -> None:
    exact = max(linear_gaussian_mu(c, k, epochs, j) for j in range(1, k + 1))
    assert noisycgd_mu_factor(c, k, epochs) >= exact - 1e-12


def test_mu_is_monotone_in_epochs_and_in_eta_lambda() -> None:
    for k in (1, 7, 60):
        by_epochs = [noisycgd_mu(5.0, 1 - 1e-3, k, e) for e in range(1, 200, 7)]
        assert all(a <= b + 1e-15 for a, b in zip(by_epochs, by_epochs[1:], strict=False))
        by_forgetting = [noisycgd_mu(5.0, 1 - r, k, 50) for r in np.geomspace(1e-7, 0.9, 40)]
        assert all(a >= b - 1e-15 for a, b in zip(by_forgetting, by_forgetting[1:], strict=False))
    # c → 1 meets the c = 1 limit 1 + (E−1)/k, and E = 1 is a single Gaussian mechanism.
    assert noisycgd_mu_factor(1 - 1e-12, 6, 9) == pytest.approx(noisycgd_mu_factor(1.0, 6, 9), rel=1e-6)
    assert noisycgd_mu_factor(0.7, 6, 1) == 1.0


def test_the_digest_check_value_of_seed_001() -> None:
    """k = 60, E = 400, σ = 15, ηλ = 1e-4 (L = 2C, noise σC/b): ε ≈ 1.2 at δ = 1e-5."""
    assert gdp_epsilon(noisycgd_mu(15.0, 1 - 1e-4, 60, 400), 1e-5) == pytest.approx(1.2, abs=0.01)


# --- the exact GDP conversion ------------------------------------------------------------------


@pytest.mark.parametrize("mu", [0.05, 0.5, 1.0, 3.0])
def test_gdp_conversion_against_dp_accountings_gaussian(mu: float) -> None:
    delta = 1e-5
    epsilon = gdp_epsilon(mu, delta)
    assert gdp_delta(epsilon, mu) <= delta and gdp_delta(epsilon * (1 - 1e-6), mu) > delta
    for relation in ("add-remove", "replace-one"):
        mechanism = MechanismDescription("t", (GaussianDP(mu),), relation, 1.0, 100, "final-model")
        pld = epsilon_pld(mechanism, delta)
        assert epsilon - 1e-9 <= pld <= epsilon + 2e-3
    assert gdp_mu(epsilon, delta) == pytest.approx(mu, rel=1e-8)


def test_every_accountant_prices_a_gdp_event_and_none_is_below_the_exact_value() -> None:
    mu = noisycgd_mu(8.0, 1 - 1e-3, 30, 100)
    mechanism = MechanismDescription("noisycgd", (GaussianDP(mu),), "replace-one", 1.0, 3000, "final-model")
    certificate = certify(mechanism, 1e-5)
    answers = {a["name"]: a["epsilon"] for a in certificate["answers"]}
    exact = gdp_epsilon(mu, 1e-5)
    assert answers["gdp.exact"] == pytest.approx(exact)
    for name in ("dp_accounting.pld", "autodp.rdp", "dp_accounting.rdp"):
        assert answers[name] is not None and answers[name] >= exact - 1e-9, name
    assert answers["dp_accounting.pld"] <= exact + 2e-3
    assert certificate["epsilon"] <= exact + 1e-9
    assert "final model only" in certificate["statement"]


def test_ledger_composes_gdp_spends_and_dpsgd_spends(tmp_path) -> None:
    ledger = Ledger(tmp_path / "ledger.db", 1e-5)
    first = MechanismDescription("noisycgd", (GaussianDP(0.3),), "replace-one", 1.0, 1000, "final-model")
    second = MechanismDescription("noisycgd", (GaussianDP(0.4),), "replace-one", 1.0, 1000, "final-model")
    ledger.reserve("v1", first, "a", 100.0)
    ledger.reserve("v1", second, "b", 100.0)
    assert ledger.total("v1") == pytest.approx(gdp_epsilon(0.5, 1e-5), abs=2e-3)  # sqrt(0.3² + 0.4²)
    assert ledger.total("v1") >= gdp_epsilon(0.5, 1e-5) - 1e-9
    dpsgd = MechanismDescription("dpsgd", (PoissonGaussianSteps(0.01, 1.0, 500),), "replace-one", 1.0, 1000)
    ledger.reserve("v1", dpsgd, "c", 100.0)
    assert ledger.total("v1") > max(gdp_epsilon(0.5, 1e-5), tight_epsilon(dpsgd, 1e-5))


# --- the model's curvature and gradient bounds ---------------------------------------------------


def _loss_of_flat_weights(spec: GatedSpec, x: torch.Tensor, y: torch.Tensor, loss: str):
    model = GatedLinear(spec).double()

    def value(flat: torch.Tensor) -> torch.Tensor:
        weight = flat.view(spec.n_gates, spec.in_features, spec.n_classes)
        z = torch.einsum("p,pk->k", model.gate_pattern(x[None])[0], torch.einsum("d,pdk->pk", x, weight))
        return LOSSES[loss](z[None], y[None])[0]

    return model, value


@pytest.mark.parametrize("loss", ["cross_entropy", "squared"])
def test_smoothness_bound_is_never_exceeded_and_is_attained(loss: str) -> None:
    spec = GatedSpec(in_features=5, n_gates=6, n_classes=3, gate_seed=4)
    x0, rng = 2.0, np.random.default_rng(0)
    beta = smoothness_bound(spec.n_gates, x0, loss)
    largest = 0.0
    for _ in range(60):
        x = torch.as_tensor(rng.normal(size=5), dtype=torch.float64)
        x = x / x.norm() * x0 * rng.uniform(0.2, 1.0)
        model, value = _loss_of_flat_weights(spec, x, torch.tensor(int(rng.integers(3))), loss)
        flat = torch.as_tensor(rng.normal(scale=3.0, size=model.weight.numel()), dtype=torch.float64)
        hessian = torch.autograd.functional.hessian(value, flat)
        top = float(torch.linalg.eigvalsh(hessian).abs().max())
        assert top <= beta * (1 + 1e-9)
        largest = max(largest, top)
    assert largest > 0.05 * beta
    if loss == "squared":  # every gate open at ‖x‖ = X0: the Hessian is P·X0² exactly, so β is tight
        spec = GatedSpec(in_features=8, n_gates=6, n_classes=3, gate_seed=4)  # P ≤ d: a point opens every gate
        model = GatedLinear(spec).double()
        x = torch.linalg.pinv(model.gates.double().t()) @ torch.ones(6, dtype=torch.float64)  # uᵀx = 1 for every u
        x = x / x.norm() * x0
        assert bool((model.gate_pattern(x[None]) == 1).all())
        _, value = _loss_of_flat_weights(spec, x, torch.tensor(0), loss)
        hessian = torch.autograd.functional.hessian(value, torch.zeros(model.weight.numel(), dtype=torch.float64))
        assert float(torch.linalg.eigvalsh(hessian).max()) == pytest.approx(beta)


def test_cross_entropy_gradient_stays_below_the_lipschitz_bound() -> None:
    spec = GatedSpec(in_features=8, n_gates=10, n_classes=4, gate_seed=1)
    model = GatedLinear(spec).double()
    rng = np.random.default_rng(1)
    with torch.no_grad():
        model.weight.copy_(torch.as_tensor(rng.normal(scale=5.0, size=model.weight.shape)))
    x = torch.as_tensor(rng.normal(size=(200, 8)))
    x = x / x.norm(dim=1, keepdim=True) * 3.0
    y = torch.as_tensor(rng.integers(0, 4, size=200))
    _, norms = clipped_gradient_sum(model, LOSSES["cross_entropy"], x, y, clip_norm=1e9)
    assert float(norms.max()) <= lipschitz_bound(spec.n_gates, 3.0, "cross_entropy")


def test_unsafe_learning_rates_are_refused() -> None:
    beta = smoothness_bound(16, 2.0, "cross_entropy", 0.1)
    with pytest.raises(ValueError, match="2/β"):
        contraction_factor(2.0 / beta, 0.1, beta)
    assert contraction_factor(1.0 / beta, 0.1, beta) == pytest.approx(1 - 0.1 / beta)
    with pytest.raises(ConfigError, match="train.learning_rate = 0.5: must be < 2/β"):
        load("params.yaml", NOISYCGD + ["train.learning_rate=0.5"])


# --- configuration -----------------------------------------------------------------------------

NOISYCGD = [
    "train.algorithm=noisycgd",
    "model.kind=gated",
    "model.gates=16",
    "dp.neighbouring=replace-one",
    "dp.noise_multiplier=4",
    "dp.clip_norm=34",
    "train.learning_rate=0.005",
    "noisycgd.batch_size=100",
    "train.epochs=20",
]


def test_noisycgd_configuration_errors_name_each_key() -> None:
    with pytest.raises(ConfigError) as error:
        load("params.yaml", ["train.algorithm=noisycgd", "train.momentum=0.5", "train.epochs=2.5"])
    text = str(error.value)
    for expected in (
        "model.kind = 'mlp'",
        "dp.neighbouring = 'add-remove'",
        "dp.noise_multiplier: required",
        "train.momentum = 0.5",
        "train.epochs = 2.5",
        "dp.clip_norm = 1: below",
    ):
        assert expected in text
    with pytest.raises(ConfigError, match="exactly one of dp.target_epsilon and noisycgd.l2"):
        load("params.yaml", NOISYCGD + ["noisycgd.l2=0.1"])
    config = load("params.yaml", NOISYCGD + ["dp.clip_norm=1", "noisycgd.assume_clipping_preserves_convexity=true"])
    assert config.noisycgd.assume_clipping_preserves_convexity


def test_calibrated_lambda_meets_the_target_tightly() -> None:
    beta = smoothness_bound(16, 6.0, "cross_entropy")
    l2 = calibrate_l2(2.0, 1e-5, 4.0, 0.005, beta, 11, 50)

    def epsilon(lam: float) -> float:
        return gdp_epsilon(noisycgd_mu(4.0, contraction_factor(0.005, lam, beta + lam), 11, 50), 1e-5)

    assert epsilon(l2) <= 2.0 < epsilon(0.999 * l2)
    with pytest.raises(ValueError, match="out of reach"):
        calibrate_l2(0.05, 1e-5, 4.0, 0.005, beta, 11, 50)


# --- the model and the trainer -----------------------------------------------------------------


def test_gated_model_matches_explicit_gated_features_and_naive_clipping() -> None:
    spec = GatedSpec(in_features=7, n_gates=5, n_classes=3, gate_seed=2)
    model = GatedLinear(spec).double()
    rng = np.random.default_rng(3)
    with torch.no_grad():
        model.weight.copy_(torch.as_tensor(rng.normal(size=model.weight.shape)))
    x, y = torch.as_tensor(rng.normal(size=(12, 7))), torch.as_tensor(rng.integers(0, 3, size=12))
    phi = torch.cat([(x @ model.gates.double()[:, p] >= 0).double()[:, None] * x for p in range(5)], dim=1)
    flat = model.weight.detach().reshape(5 * 7, 3)  # (P·d, k): row p·d + j is V_p[j]
    torch.testing.assert_close(model(x), phi @ flat)
    for loss in ("cross_entropy", "squared"):
        sums, norms = clipped_gradient_sum(model, LOSSES[loss], x, y, clip_norm=0.5)
        expected, expected_norms = torch.zeros_like(model.weight), []
        for i in range(12):
            (g,) = torch.autograd.grad(LOSSES[loss](model(x[i : i + 1]), y[i : i + 1]).sum(), model.weight)
            expected_norms.append(g.norm())
            expected += g * min(1.0, 0.5 / (float(g.norm()) + 1e-6))
        torch.testing.assert_close(norms, torch.stack(expected_norms), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(sums["weight"], expected, rtol=1e-10, atol=1e-12)
        assert float((norms > 0.5).float().mean()) > 0.5  # the clip was active


def _settings(**overrides) -> NoisyCgdSettings:
    values = dict(
        noise_multiplier=3.0,
        clip_norm=2 * math.sqrt(8) * 1.0,
        batch_size=7,
        epochs=3,
        learning_rate=0.05,
        l2=0.5,
        n_gates=4,
        input_norm=1.0,
        loss="cross_entropy",
    )
    return NoisyCgdSettings(**(values | overrides))


def test_partition_uses_every_record_once_in_batches_of_at_most_b() -> None:
    batches = cyclic_batches(52, 7, seed=0)
    assert len(batches) == math.ceil(52 / 7) == 8
    assert sorted(torch.cat(batches).tolist()) == list(range(52))
    assert {len(b) for b in batches} <= {6, 7}
    mechanism = noisycgd_mechanism(_settings(), 52)
    assert mechanism.threat_model == "final-model" and mechanism.neighbouring == "replace-one"
    assert mechanism.events[0].mu == pytest.approx(noisycgd_mu(3.0, 1 - 0.05 * 0.5, 8, 3))
    assert any("never changes a gradient" in note for note in mechanism.notes)
    clipped = noisycgd_mechanism(_settings(clip_norm=0.5), 52)
    assert any(note.startswith("ASSUMPTION") for note in clipped.notes)


def test_noise_has_the_certified_scale() -> None:
    """Records at x = 0 have zero gradient, so with λ = 0 the final weights are −η Σ_t Z_t:
    each coordinate N(0, (η σ C / b)² · steps) — the noise the certificate assumes, no less."""
    settings = _settings(l2=0.0, epochs=40, learning_rate=0.01)
    spec = GatedSpec(in_features=30, n_gates=4, n_classes=10, gate_seed=0)
    model = GatedLinear(spec)
    x, y = torch.zeros(70, 30), torch.zeros(70, dtype=torch.long)
    result = train_noisycgd(
        model, x, y, settings=settings, loss_fn=LOSSES["cross_entropy"], partition_seed=0, noise_seed=123
    )
    steps = result.history["steps"]
    assert steps == 40 * 10
    expected = 0.01 * settings.noise_multiplier * settings.clip_norm / settings.batch_size * math.sqrt(steps)
    assert float(model.weight.detach().std()) == pytest.approx(expected, rel=0.05)
    assert result.mechanism == noisycgd_mechanism(settings, 70)


def test_noisycgd_learns_a_separable_problem() -> None:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 10))
    y = rng.integers(0, 3, size=600)
    x = centres[y] + 0.3 * rng.normal(size=(600, 10))
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    spec = GatedSpec(in_features=10, n_gates=8, n_classes=3, gate_seed=0)
    settings = _settings(
        noise_multiplier=1.0,
        clip_norm=4.0,
        batch_size=50,
        epochs=30,
        learning_rate=0.2,
        l2=1e-3,
        n_gates=8,
        input_norm=1.0,
    )
    model = GatedLinear(spec)
    train_noisycgd(
        model,
        torch.as_tensor(x, dtype=torch.float32),
        torch.as_tensor(y),
        settings=settings,
        loss_fn=LOSSES["cross_entropy"],
        partition_seed=0,
        noise_seed=0,
    )
    accuracy = float((model(torch.as_tensor(x, dtype=torch.float32)).argmax(1).numpy() == y).mean())
    assert accuracy > 0.9
