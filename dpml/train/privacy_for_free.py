"""DP-GD for the random-features model with the "privacy for free" hyperparameters (seed 002).

The lectures' DP-GD (full batch, per-example clipping, Gaussian noise), square loss
ℓ(y, ŷ) = (y − ŷ)² on f(x; θ) = φ(Vx)ᵀθ (:mod:`dpml.models.random_features`), θ0 = 0:

    θ^{t+1} = θ^t − η·(1/n) Σ_i clip_C(∇_θ ℓ_i(θ^t)) + sqrt(η)·(2C/n)·σ·N(0, I_p),
    ∇_θ ℓ_i = 2(φ(Vx_i)ᵀθ − y_i) ⊗ φ(Vx_i),   ‖∇_θ ℓ_i‖ = 2‖r_i‖·‖φ(Vx_i)‖,
    clip_C(g) = g·min(1, C/(‖g‖ + 10⁻⁶))     (dpml's clipping convention: ‖clip_C(g)‖ < C).

**Certificate.** Replacing one record moves a step's mean by ≤ 2ηC/n; the step's noise has std
ρ_step = sqrt(η)(2C/n)σ, so each step is (λ, (η/(2σ²))(λ + λ²))-moments bounded and T steps give
the moments accountant's closed form (Abadi et al. 2016, as in the lectures)

    ε(δ) = a + 2·sqrt(a·log(1/δ)),        a = ηT/(2σ²) = (continuous time)/(2σ²).

In dpml's mechanism language this is a full-batch (q = 1) Gaussian step on the clipped *sum* with
noise std s·C, where the sum's noise s·C/n·η must equal sqrt(η)(2C/n)σ: s = 2σ/√η, under
replace-one (sensitivity 2C) — the mapping of :func:`dpml.train.dpsgd.dpsgd_mechanism`; the
moments closed form of :func:`dpml.accounting.closed_forms.epsilon_moments_closed_form` then divides
s by 2 (replace-one) and gives a = T/(2(σ/√η)²) = ηT/(2σ²) exactly.

**Privacy for free** (Bombari & Mondelli, PNAS 2025): with C = sqrt(p)·log²n and continuous time
ηT = (d/p)·log²n, clipping binds with vanishing probability and the excess risk is
Õ(d/(nε) + sqrt(d/n) + sqrt(n/d^{3/2})) for d ≪ n ≪ d^{3/2} (labels |y| ≤ O(1), ‖x‖ ≈ √d,
φ0 = φ2 = 0, φ1 ≠ 0). :func:`privacy_for_free_hyperparameters` gives C and ηT;
:func:`sigma_for_epsilon` inverts the closed form for σ. The fraction of per-example gradients
actually clipped (over all steps) is reported, so the "clipping never binds" claim is checked on
each run rather than assumed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dpml.models.random_features import RandomFeatures, hermite_coefficients, ACTIVATIONS
from dpml.accounting.closed_forms import epsilon_moments_closed_form
from dpml.accounting.mechanism import MechanismDescription, PoissonGaussianSteps
from dpml.train.clipping import clip_factors
from dpml.train.noise import secret_noise_seed
from dpml.train.noise import gaussian

NOISE_TAG = 2002  # mixed into the noise seed (noise_stream_seed)


@dataclass(frozen=True)
class PrivacyForFreeHyperparameters:
    """C = sqrt(p)·log²n and continuous time ηT = (d/p)·log²n (Bombari & Mondelli 2025)."""

    clip_norm: float
    continuous_time: float


@dataclass
class DpgdResult:
    """θ after training, what was done (the mechanism, None when σ = 0) and how often clipping bound."""

    theta: torch.Tensor
    mechanism: MechanismDescription | None
    clipped_fraction: float
    noise_std: float
    history: dict[str, Any] = field(default_factory=dict)


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} = {value!r}: must be a finite number > 0")


def privacy_for_free_hyperparameters(n: int, d: int, p: int) -> PrivacyForFreeHyperparameters:
    """C = sqrt(p)·(log n)² and ηT = (d/p)·(log n)² (seed 002, privacy-for-free proof, step 1)."""
    for name, value in (("n", n), ("d", d), ("p", p)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name} = {value!r}: must be an integer ≥ 1")
    if n < 2:
        raise ValueError(f"n = {n}: must be ≥ 2 (log²n = 0 at n = 1)")
    log_squared = math.log(n) ** 2
    return PrivacyForFreeHyperparameters(math.sqrt(p) * log_squared, d / p * log_squared)


def default_learning_rate(d: int, p: int, activation: str = "tanh") -> float:
    """η = d/(2p·E[φ(G)²]): a data-independent step size, half the GD stability limit for isotropic data.

    Hessian of R̂_n = (1/n)Σ(y_i − φ(Vx_i)ᵀθ)² is (2/n)ΦᵀΦ; for x ~ N(0, I_d) (or ‖x‖ = √d) and
    n ≫ d its top eigenvalue is ≈ 2pφ1²/d (the linear part of φ along the d data directions), so
    GD is stable for η < d/(pφ1²); E[φ²] ≥ φ1² makes this η at most half of that. A heuristic
    for well-spread data (it is not a bound); it reads no data, so it costs no privacy.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation = {activation!r}: must be one of {', '.join(sorted(ACTIVATIONS))}")
    phi = ACTIVATIONS[activation]
    second_moment = float(hermite_coefficients(lambda t: phi(t) ** 2, max_degree=0)[0])  # E[φ(G)²]
    return d / (2.0 * p * second_moment)


def steps_for(continuous_time: float, learning_rate: float) -> int:
    """T = max(1, round(ηT / η)) discrete steps."""
    _positive("continuous_time", continuous_time)
    _positive("learning_rate", learning_rate)
    return max(1, int(round(continuous_time / learning_rate)))


def moments_a(epsilon: float, delta: float) -> float:
    """The a with a + 2·sqrt(a·log(1/δ)) = ε: a = (sqrt(log(1/δ) + ε) − sqrt(log(1/δ)))²."""
    _positive("epsilon", epsilon)
    if not 0 < delta < 1:
        raise ValueError(f"delta = {delta}: must be in (0, 1)")
    log_term = math.log(1 / delta)
    return (math.sqrt(log_term + epsilon) - math.sqrt(log_term)) ** 2


def sigma_for_epsilon(epsilon: float, delta: float, continuous_time: float) -> float:
    """σ (seed 002's) with a = ηT/(2σ²) meeting ε exactly: σ = sqrt(ηT/(2a))."""
    _positive("continuous_time", continuous_time)
    return math.sqrt(continuous_time / (2.0 * moments_a(epsilon, delta)))


def dpgd_noise_std(learning_rate: float, clip_norm: float, n: int, sigma: float) -> float:
    """Per-coordinate std of the noise added to θ per step: sqrt(η)·(2C/n)·σ."""
    return math.sqrt(learning_rate) * 2.0 * clip_norm / n * sigma


def dpgd_mechanism(learning_rate: float, sigma: float, steps: int, clip_norm: float, n: int) -> MechanismDescription:
    """The DP-GD run as a mechanism: T full-batch replace-one Gaussian steps with multiplier 2σ/√η."""
    _positive("learning_rate", learning_rate)
    _positive("sigma", sigma)
    _positive("clip_norm", clip_norm)
    return MechanismDescription(
        trainer="dpgd",
        events=(PoissonGaussianSteps(1.0, 2.0 * sigma / math.sqrt(learning_rate), int(steps)),),
        neighbouring="replace-one",
        clip_norm=clip_norm,
        dataset_size=n,
        threat_model="all-iterates",
        notes=(
            "DP-GD on a random-features model (Mondelli's lectures, 'privacy for free'): "
            "θ ← θ − η·mean clip_C(∇ℓ_i) + sqrt(η)(2C/n)σ·N(0, I); "
            f"σ = {sigma:.6g}, η = {learning_rate:.6g}; noise multiplier on the clipped sum = 2σ/√η",
        ),
    )


def certified_epsilon(result: DpgdResult, delta: float) -> float:
    """ε of the moments accountant's closed form (∞ for a non-private run)."""
    if result.mechanism is None:
        return math.inf
    return epsilon_moments_closed_form(result.mechanism, delta)


def noise_stream_seed(seed: int) -> int:
    """A torch seed derived from (seed, tag): the noise never replays a data generator given the same seed."""
    return int(np.random.SeedSequence([seed, NOISE_TAG]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def _targets(y: torch.Tensor, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    targets = y.to(dtype).reshape(n, -1)
    if targets.shape[1] != k:
        raise ValueError(f"y has {targets.shape[1]} outputs per record; the model has n_outputs = {k}")
    return targets


def train_dpgd_random_features(
    model: RandomFeatures,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    learning_rate: float,
    steps: int,
    clip_norm: float,
    sigma: float,
    seed: int | None = None,
) -> DpgdResult:
    """Run seed 002's DP-GD on θ (model.weight, from its current value — 0 for a fresh model), in place.

    ``sigma`` is the lectures' σ (0: clipped GD without noise, no certificate). ``seed`` drives the
    noise; None takes a secret one (:func:`dpml.train.noise.secret_noise_seed`) — a fixed seed
    is for experiments only. Returns θ, the mechanism and the clipped fraction
    #{(i, t): ‖∇ℓ_i(θ^t)‖ > C} / (nT).
    """
    _positive("learning_rate", learning_rate)
    _positive("clip_norm", clip_norm)
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps = {steps!r}: must be an integer ≥ 1")
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma = {sigma!r}: must be a finite number ≥ 0")
    n = x.shape[0]
    if n < 1 or x.ndim != 2 or x.shape[1] != model.spec.in_features:
        raise ValueError(f"x has shape {tuple(x.shape)}: expected (n ≥ 1, {model.spec.in_features})")
    dtype = model.weight.dtype
    with torch.no_grad():
        phi = model.feature_map(x.to(dtype))
        feature_norms = phi.norm(dim=1)
        targets = _targets(y, n, model.spec.n_outputs, dtype)
        theta = model.weight.detach().clone()
        noise_std = dpgd_noise_std(learning_rate, clip_norm, n, sigma)
        generator = torch.Generator().manual_seed(noise_stream_seed(secret_noise_seed() if seed is None else seed))
        clipped, losses = 0, []
        start = time.perf_counter()
        for _ in range(steps):
            residual = phi @ theta - targets  # r_i = f(x_i) − y_i, (n, k)
            losses.append(float(residual.pow(2).sum() / n))
            norms = 2.0 * residual.norm(dim=1) * feature_norms  # ‖∇ℓ_i‖ = 2‖r_i‖‖φ_i‖
            clipped += int((norms > clip_norm).sum())
            factors = clip_factors(norms, clip_norm)
            mean_gradient = phi.t() @ (2.0 * factors[:, None] * residual) / n
            theta -= learning_rate * mean_gradient
            if noise_std > 0:
                theta += noise_std * gaussian(theta.shape, 1.0, generator, dtype)
        model.weight.copy_(theta)
        final_loss = float((phi @ theta - targets).pow(2).sum() / n)
    mechanism = dpgd_mechanism(learning_rate, sigma, steps, clip_norm, n) if sigma > 0 else None
    history = {
        "steps": steps,
        "continuous_time": learning_rate * steps,
        "train_loss": losses + [final_loss],
        "max_feature_norm": float(feature_norms.max()),
        "seconds": time.perf_counter() - start,
    }
    return DpgdResult(theta, mechanism, clipped / (n * steps), noise_std, history)
