"""One-pass DP-SGD with aggressive clipping for linear regression (Bombari, Seroussi & Mondelli 2025; seed 002).

Linear model f(x; θ) = xᵀθ, square loss ℓ = ½(xᵀθ − y)², θ^0 = 0; record k (k = 1..n, in the
given order, each used exactly once) drives step k:

    g_k = (x_kᵀθ^{k−1} − y_k)·x_k,                         (per-example gradient; r_k = x_kᵀθ − y_k the residual)
    θ^k = θ^{k−1} − η_k·clip_C(g_k) + 2C·σ_k·N(0, I_d),     C = c·√d,
    clip_C(g) = g·min(1, C/(‖g‖ + 10⁻⁶))                   (dpml's convention: ‖clip_C(g)‖ < C).

**What is clipped.** The per-example *gradient* g_k, to norm C = c√d. Since ‖g_k‖ = |r_k|·‖x_k‖
this is exactly clipping the residual: clip_C(g_k) = x_k·r_k·min(1, (C/‖x_k‖)/|r_k|), i.e. the
residual clipped at C/‖x_k‖ — the lectures' r_c(θ, x, y) = r/max(1, |r|/c) when ‖x_k‖ = √d. The
clipped step is a gradient step on the Huber loss h_{C/‖x‖}(xᵀθ − y), which is convex and
‖x‖²-smooth: that is what privacy amplification by iteration needs.

**Certificate** (seed 002's proposition, after Feldman, Koren & Talwar 2020; :mod:`dpml.accounting.zcdp`).
Replacing record k moves step k by ≤ 2Cη_k; the noise of steps k..n (std 2Cσ_j) hides it, so the
released last iterate θ^n (intermediate iterates stay hidden) is (ρ²/2)-zCDP with
ρ = max_k η_k/sqrt(Σ_{j≥k} σ_j²), provided each step map θ ↦ θ − η_k·clip_C(g_k(θ)) is
non-expansive: a convex β-smooth loss and η_k ≤ 2/β. With inputs of norm ≤ X (inputs above X are
scaled down to X: a per-record map, no privacy cost) β = X²; a schedule with some η_k > 2/X² is
refused. For a target (ε, δ), ρ is the exact inverse of (ρ²/2)-zCDP ⇒ (ρ²/2 + ρ·sqrt(2 ln(1/δ)), δ)-DP
(Bun & Steinke 2016):  ρ = sqrt(2 ln(1/δ) + 2ε) − sqrt(2 ln(1/δ)). The noise is the minimal
schedule ρ²σ_k² = η_k² − η_{k+1}², ρ²σ_n² = η_n², and the returned certificate recomputes ρ from the
schedules actually used.

**Schedules** (η_k = η̃(k/n)/n): OUT — η̃ constant, all the noise on the last step (output
perturbation); CONST — η̃(t) = η̃(0)·sqrt(1 − t), constant noise. The lectures' theorem (Σ = I,
γ = d/n → 0, c = O(1), η̃(0)·c = C·log(1/γ)): excess risk O(γ log(1/γ) + γ² log²(1/γ)/ρ²) for OUT,
O(γ log^{2/3}(1/γ) + γ² log^{4/3}(1/γ)/ρ²) for CONST; the optimal schedule reaches the minimax
O(γ + γ²/ρ²). Stability needs sup η̃ < 2/γ (here: η_k ≤ 2/X², X² ≈ d).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from dpml.accounting.zcdp import const_schedule, minimal_noise_schedule, out_schedule, schedule_rho, zcdp_to_dp
from dpml.train.noise import secret_noise_seed

if TYPE_CHECKING:
    import torch

Schedule = Literal["out", "const"]
SCHEDULES = {"out": out_schedule, "const": const_schedule}
NOISE_TAG = 2002  # mixed into the noise seed (see train_onepass_dpsgd)


@dataclass
class OnePassResult:
    """θ^n, its certificate (ρ recomputed from the schedules used, ε at δ) and what clipping did."""

    theta: np.ndarray
    rho: float
    epsilon: float
    delta: float
    clip_norm: float
    clipped_fraction: float
    inputs_clipped: int
    learning_rates: np.ndarray
    noise: np.ndarray
    history: dict[str, Any] = field(default_factory=dict)

    def certificate(self) -> dict[str, Any]:
        return {
            "kind": "zCDP by iteration (final iterate only)",
            "zcdp": self.rho**2 / 2,
            "rho": self.rho,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "neighbouring": "replace-one",
            "clip_norm": self.clip_norm,
            "dataset_size": int(self.learning_rates.size),
        }


def rho_for_epsilon(epsilon: float, delta: float) -> float:
    """The ρ with ρ²/2 + ρ·sqrt(2 ln(1/δ)) = ε: ρ = sqrt(2 ln(1/δ) + 2ε) − sqrt(2 ln(1/δ)) (inverse of zcdp_to_dp)."""
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon = {epsilon!r}: must be a finite number > 0")
    if not 0 < delta < 1:
        raise ValueError(f"delta = {delta!r}: must be in (0, 1)")
    b = math.sqrt(2 * math.log(1 / delta))
    return 2 * epsilon / (math.sqrt(b * b + 2 * epsilon) + b)  # = sqrt(b² + 2ε) − b, without cancellation


def learning_rate_schedule(schedule: Schedule, eta0: float, n: int) -> np.ndarray:
    """η_1..η_n of ``schedule`` ("out" or "const") with η̃(0) = eta0 (η_k = η̃(k/n)/n)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule = {schedule!r}: must be one of {', '.join(SCHEDULES)}")
    if not (math.isfinite(eta0) and eta0 > 0):
        raise ValueError(f"eta0 = {eta0!r}: must be a finite number > 0")
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n = {n!r}: must be an integer ≥ 1")
    return SCHEDULES[schedule](eta0, n)


def check_step_sizes(learning_rates: np.ndarray, smoothness: float) -> None:
    """Refuse any η_k > 2/β (privacy by iteration needs non-expansive steps)."""
    limit = 2.0 / smoothness
    largest = float(np.max(learning_rates))
    if largest > limit:
        k = int(np.argmax(learning_rates)) + 1
        raise ValueError(
            f"learning rate η_{k} = {largest:.6g} exceeds 2/β = {limit:.6g} (β = X² = {smoothness:.6g}): "
            "privacy by iteration needs η_k ≤ 2/β for every step; lower eta0 or the input norm bound"
        )


def clip_inputs(x: np.ndarray, input_norm_bound: float) -> tuple[np.ndarray, int]:
    """Rows with ‖x‖ > X scaled down to norm X (per record, no privacy cost); returns them and how many were scaled."""
    norms = np.linalg.norm(x, axis=1)
    scale = np.minimum(1.0, input_norm_bound / np.maximum(norms, 1e-300))
    return x * scale[:, None], int(np.sum(norms > input_norm_bound))


def excess_risk(theta: np.ndarray, theta_star: np.ndarray, covariance: np.ndarray | None = None) -> float:
    """R(θ) − R(θ*) = ½(θ − θ*)ᵀΣ(θ − θ*) for R(θ) = ½E(xᵀθ − y)², x ~ N(0, Σ) (Σ = I when None)."""
    diff = np.asarray(theta, dtype=float) - np.asarray(theta_star, dtype=float)
    return 0.5 * float(diff @ diff) if covariance is None else 0.5 * float(diff @ covariance @ diff)


def theory_rate(gamma: float | np.ndarray, rho: float) -> float | np.ndarray:
    """γ + γ²/ρ² (the minimax rate of ρ²/2-zCDP linear regression, γ = d/n; up to constants)."""
    return gamma + gamma**2 / rho**2


def _validate_data(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x has shape {x.shape} and y {y.shape}: expected (n, d) and (n,) with n ≥ 1")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("x and y must be finite")
    return x, y


def train_onepass_dpsgd(
    x: np.ndarray,
    y: np.ndarray,
    *,
    epsilon: float,
    delta: float,
    schedule: Schedule,
    eta0: float,
    clip_constant: float,
    input_norm_bound: float,
    seed: int | None = None,
) -> OnePassResult:
    """One pass of DP-SGD over (x_k, y_k) in order, at (ε, δ); see the module docstring for every formula.

    ``clip_constant`` is c in C = c·√d; ``input_norm_bound`` is X (β = X², η_k ≤ 2/X² enforced);
    ``seed`` drives the noise (None: a secret one, :func:`dpml.train.noise.secret_noise_seed`).
    """
    x, y = _validate_data(x, y)
    n, d = x.shape
    for name, value in (("clip_constant", clip_constant), ("input_norm_bound", input_norm_bound)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} = {value!r}: must be a finite number > 0")
    target_rho = rho_for_epsilon(epsilon, delta)
    etas = learning_rate_schedule(schedule, eta0, n)
    check_step_sizes(etas, input_norm_bound**2)
    sigmas = minimal_noise_schedule(etas, target_rho)
    clip_norm = clip_constant * math.sqrt(d)
    x, inputs_clipped = clip_inputs(x, input_norm_bound)
    # the noise stream is derived from (seed, tag) so that it never replays a data generator seeded alike
    rng = np.random.default_rng(np.random.SeedSequence([secret_noise_seed() if seed is None else seed, NOISE_TAG]))
    noisy_steps = np.flatnonzero(sigmas > 0)
    noise = np.zeros((n, d))
    noise[noisy_steps] = rng.standard_normal((noisy_steps.size, d)) * (2.0 * clip_norm * sigmas[noisy_steps])[:, None]
    theta = np.zeros(d)
    clipped = 0
    start = time.perf_counter()
    for k in range(n):
        xk = x[k]
        residual = float(xk @ theta) - y[k]
        gradient_norm = abs(residual) * math.sqrt(float(xk @ xk))
        factor = min(1.0, clip_norm / (gradient_norm + 1e-6))
        clipped += gradient_norm > clip_norm
        theta = theta - (etas[k] * factor * residual) * xk + noise[k]
    rho = schedule_rho(etas, sigmas)
    history = {"schedule": schedule, "eta0": eta0, "target_rho": target_rho, "seconds": time.perf_counter() - start}
    return OnePassResult(
        theta, rho, zcdp_to_dp(rho, delta), delta, clip_norm, clipped / n, inputs_clipped, etas, sigmas, history
    )


def onepass_linear_classifier(
    model: "torch.nn.Linear",
    x: np.ndarray,
    y: np.ndarray,
    *,
    rho: float,
    schedule: Schedule,
    eta0: float,
    clip_norm: float,
    input_norm_bound: float,
    seed: int,
) -> dict[str, Any]:
    """One pass of DP-SGD (each record once, in a secret random order) for a multi-output linear model.

    The pipeline's classifier: z = Wx + b, targets e_y, squared loss ½‖z − e_y‖². With x' = (x, 1)
    and Θ = [W b], the per-example gradient is G_k = r_k x'ᵀ (r_k = Θx'_k − e_y ∈ R^k), of Frobenius
    norm ‖r_k‖·‖x'_k‖; clipping G_k to ``clip_norm`` C clips the residual *vector* to C/‖x'_k‖,
    which is the gradient of the vector Huber function of the residual — convex and
    ‖x'_k‖²-smooth in Θ, so each step is non-expansive when η_k ≤ 2/β, β = X² + 1 (inputs are
    already projected onto the X ball by the pipeline; the bias adds the 1). Replacing record k
    moves step k by ≤ 2Cη_k in Frobenius norm and the noise 2Cσ_j·N(0, I) of steps j ≥ k hides
    it: the last iterate is (ρ_s²/2)-zCDP with ρ_s = max_k η_k/sqrt(Σ_{j≥k} σ_j²) (the module
    docstring), for the minimal noise schedule of the target ρ_s = ``rho``. Writes Θ into ``model``;
    returns the history (ρ_s recomputed from the schedules used, the clipped fraction).
    """
    x = np.array(x, dtype=np.float64)  # a copy: projected again below
    n, d = x.shape
    k = model.out_features
    etas = learning_rate_schedule(schedule, eta0, n)
    check_step_sizes(etas, input_norm_bound**2 + 1.0)
    norms = np.linalg.norm(x, axis=1)
    if np.any(norms > input_norm_bound * (1 + 1e-5)):
        raise ValueError(f"input norms up to {norms.max():.9g} exceed the bound X = {input_norm_bound:g}")
    # Inputs projected onto the X ball in float32 can sit a rounding error (~1e-7 relative) outside it in
    # float64; the smoothness bound β = X² + 1 needs ‖x‖ ≤ X exactly, so project again here, in float64.
    outside = norms > input_norm_bound
    x[outside] *= (input_norm_bound / norms[outside])[:, None]
    sigmas = minimal_noise_schedule(etas, rho)
    rng = np.random.default_rng(np.random.SeedSequence([seed, NOISE_TAG]))
    order = rng.permutation(n)
    augmented = np.hstack([x, np.ones((n, 1))])[order]
    targets = np.eye(k)[np.asarray(y)[order]]
    theta = np.zeros((k, d + 1))
    clipped = 0
    for step in range(n):
        xk = augmented[step]
        residual = theta @ xk - targets[step]
        gradient_norm = float(np.linalg.norm(residual)) * float(np.linalg.norm(xk))
        factor = min(1.0, clip_norm / max(gradient_norm, 1e-300))
        clipped += gradient_norm > clip_norm
        theta -= (etas[step] * factor) * np.outer(residual, xk)
        if sigmas[step] > 0:
            theta += rng.standard_normal(theta.shape) * (2.0 * clip_norm * sigmas[step])

    with torch.no_grad():
        model.weight.copy_(torch.as_tensor(theta[:, :d], dtype=model.weight.dtype))
        model.bias.copy_(torch.as_tensor(theta[:, d], dtype=model.bias.dtype))
    return {
        "steps": n,
        "rho_by_iteration": schedule_rho(etas, sigmas),
        "clipped_fraction": clipped / n,
        "schedule": schedule,
        "eta0": eta0,
        "clip_norm": clip_norm,
    }
