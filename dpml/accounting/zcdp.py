"""One-pass DP-SGD with aggressive clipping, certified by privacy amplification by iteration (seed 002).

The iteration (Bombari, Seroussi & Mondelli 2025; Feldman, Koren & Talwar 2020) uses each record
once, k = 1..n:

    θ^{k+1} = θ^k − η_k · clip_C(∇ℓ(θ^k; x_{k+1}, y_{k+1})) + 2C σ_k · N(0, I).

A replaced record k moves step k by at most 2Cη_k, and the Gaussian noise of steps k..n (std 2Cσ_j)
hides it: the released last iterate is (ρ²/2)-zCDP with

    ρ = max_k η_k / sqrt(Σ_{j≥k} σ_j²)        (requires a convex, smooth loss and η_k ≤ 2/β),

and (ρ²/2)-zCDP ⇒ (ρ²/2 + ρ·sqrt(2 ln(1/δ)), δ)-DP (Bun & Steinke 2016). For a given learning-rate
schedule the least noise that achieves ρ is η_k = ρ·sqrt(Σ_{j≥k} σ_j²), i.e.

    ρ²σ_k² = η_k² − η_{k+1}² (k < n),    ρ²σ_n² = η_n².

Schedules (with η_k = η̃(k/n)/n): OUT (output perturbation) η̃ constant — no noise until the last
step, which carries all of it; CONST η̃(t) = η̃(0)·sqrt(1 − t) — η² decays linearly, the noise is
constant over the steps (and the last step again gets η_n/ρ).
"""

from __future__ import annotations

import math

import numpy as np


def schedule_rho(learning_rates: np.ndarray, noise: np.ndarray) -> float:
    """ρ = max_k η_k / sqrt(Σ_{j≥k} σ_j²) of a schedule (∞ when some record has no noise after it)."""
    etas, sigmas = np.asarray(learning_rates, dtype=float), np.asarray(noise, dtype=float)
    if etas.shape != sigmas.shape or etas.ndim != 1 or etas.size == 0:
        raise ValueError("learning rates and noise levels must be two equal-length, non-empty sequences")
    remaining = np.sqrt(np.cumsum((sigmas**2)[::-1])[::-1])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(etas > 0, etas / remaining, 0.0)
    return float(np.max(ratios))


def minimal_noise_schedule(learning_rates: np.ndarray, rho: float) -> np.ndarray:
    """σ_k with ρ²σ_k² = η_k² − η_{k+1}² (k < n), ρ²σ_n² = η_n²: the least noise reaching ρ (η non-increasing)."""
    etas = np.asarray(learning_rates, dtype=float)
    if rho <= 0:
        raise ValueError(f"rho = {rho}: must be > 0")
    if np.any(np.diff(etas) > 0):
        raise ValueError("the learning-rate schedule must be non-increasing (η_k² − η_{k+1}² ≥ 0)")
    squares = etas**2 - np.append(etas[1:], 0.0) ** 2
    return np.asarray(np.sqrt(squares) / rho, dtype=float)


def out_schedule(eta0: float, n: int) -> np.ndarray:
    """OUT: η_k = η̃(0)/n at every step (the noise then all lands on the last step)."""
    return np.full(n, eta0 / n)


def const_schedule(eta0: float, n: int) -> np.ndarray:
    """CONST: η_k = η̃(k/n)/n with η̃(t) = η̃(0)·sqrt(1 − t), t = (k − 1)/n (so η̃ > 0 at every step)."""
    t = np.arange(n) / n
    return eta0 * np.sqrt(1.0 - t) / n


def zcdp_to_dp(rho: float, delta: float) -> float:
    """ε of (ρ²/2)-zCDP at δ (Bun & Steinke 2016, Prop. 1.3): ρ²/2 + ρ·sqrt(2 ln(1/δ))."""
    if not 0 < delta < 1:
        raise ValueError(f"delta = {delta}: must be in (0, 1)")
    return rho * rho / 2 + rho * math.sqrt(2 * math.log(1 / delta))
