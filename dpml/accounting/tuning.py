"""The privacy cost of hyperparameter search: best-of-K with a random number of candidates.

Papernot & Steinke, *Hyperparameter Tuning with Rényi Differential Privacy* (ICLR 2022). A base
algorithm Q (draw hyperparameters at random, train with DP-SGD, score the model with a noisy
validation count) runs K times; only the candidate with the best score is released (K and the
other candidates stay secret). If Q is (λ, ε_λ)-RDP at every order λ, the search A satisfies:

- **Poisson K ~ Poisson(μ)** (their Thm 6): for λ > 1, with ε̂ = log(1 + 1/(λ−1)) and δ̂ the
  δ at which Q is (ε̂, δ̂)-DP,
      ε'_λ = ε_λ + μ·δ̂ + log(μ)/(λ−1).
  δ̂ comes from the base mechanism's privacy profile — here the PLD accountant, whose
  pessimistic discretisation makes it an upper bound, so the result stays an upper bound.
- **Truncated negative binomial K ~ D_{η,γ}** (their Thm 2; η = 0 is the logarithmic
  distribution, η = 1 the geometric): P[K = k] ∝ (1−γ)^k · C(k+η−1, k) for k ≥ 1, and
      ε'_λ = ε_λ + (1+η)·(1 − 1/λ̂)·ε_λ̂ + (1+η)·log(1/γ)/λ̂ + log(E[K])/(λ−1)
  for every λ̂ ≥ 1; we take the best λ̂ on the order grid, with
  E[K] = η(1−γ)/(γ(1−γ^η)) (η > 0) or (1/γ − 1)/log(1/γ) (η = 0).
  Rényi divergence is non-decreasing in λ, so ε'_λ ≤ min_{λ' ≥ λ} ε'_λ' also holds.

The RDP curve of A converts to (ε, δ) with the RDP→DP conversion of Canonne, Kamath & Steinke
(2020) (dp_accounting's ``compute_epsilon``).

About seed 001 (Koskela): its Eq. 5.1 states a privacy-profile bound of Koskela, Redberg & Wang
(2024) in a form that, implemented literally, does not reproduce the paper's 2.88 / 8.91 (see the
seed digest). dpml therefore prices random-count searches with the RDP theorems above, which are
published with proofs and independently implemented in dp_accounting
(``RepeatAndSelectDpEvent``, a cross-check in the tests); they are looser than a privacy-profile
analysis, never tighter than the truth.

The RDP analysis of Poisson subsampling used here holds for add-or-remove neighbouring only: a
random-count search under replace-one is refused (a fixed count works under both relations).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy.optimize import brentq

from dpml.accounting.mechanism import Selection

ORDERS: tuple[float, ...] = tuple(
    [1 + x / 20.0 for x in range(1, 40)]
    + [3 + x / 4.0 for x in range(28)]
    + list(range(10, 64))
    + [64, 80, 96, 128, 192, 256, 384, 512, 1024]
)


def truncated_negative_binomial_gamma(shape: float, mean: float) -> float:
    """γ of D_{η,γ} with E[K] = ``mean`` (solved to machine precision; E[K] is decreasing in γ)."""
    if mean <= 1:
        raise ValueError(f"mean = {mean}: a truncated negative binomial has E[K] > 1")

    def expected(gamma: float) -> float:
        if shape == 0:
            return (1.0 / gamma - 1.0) / math.log(1.0 / gamma)
        return float(shape * (1.0 - gamma) / (gamma * (1.0 - gamma**shape)))

    return float(brentq(lambda g: expected(g) - mean, 1e-15, 1.0 - 1e-12, xtol=1e-15, rtol=1e-14))


def sample_count(selection: Selection, rng: np.random.Generator) -> int:
    """Draw K. Use an unseeded generator: K is secret randomness of the mechanism."""
    if selection.distribution == "fixed":
        return int(selection.mean)
    if selection.distribution == "poisson":
        return int(rng.poisson(selection.mean))
    gamma = truncated_negative_binomial_gamma(selection.shape, selection.mean)
    if selection.shape == 0:
        return int(rng.logseries(1.0 - gamma))  # P[k] ∝ (1−γ)^k / k, k ≥ 1
    while True:  # negative binomial (failures before η successes, success prob γ), conditioned on ≥ 1
        k = int(rng.negative_binomial(selection.shape, gamma))
        if k >= 1:
            return k


def selection_rdp(
    orders: Sequence[float],
    rdp: Sequence[float] | np.ndarray,
    selection: Selection,
    delta_hat: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """RDP curve of the best-of-K search from the base algorithm's curve (module docstring).

    ``delta_hat(ε̂s)`` must return upper bounds on the base algorithm's δ at each ε̂ (Poisson
    only; vectorised). Orders ≤ 1 get +inf (the theorems need λ > 1).
    """
    lam = np.asarray(orders, dtype=float)
    base = np.asarray(rdp, dtype=float)
    if lam.shape != base.shape:
        raise ValueError(f"orders and rdp differ in length ({lam.size} vs {base.size})")
    out = np.full_like(lam, np.inf)
    valid = lam > 1
    if selection.distribution == "fixed":
        out[valid] = selection.mean * base[valid]
    elif selection.distribution == "poisson":
        if delta_hat is None:
            raise ValueError("a Poisson selection needs the base mechanism's privacy profile δ̂(ε̂)")
        mu = selection.mean
        eps_hat = np.log1p(1.0 / (lam[valid] - 1.0))
        deltas = np.asarray(delta_hat(eps_hat), dtype=float)
        out[valid] = base[valid] + mu * deltas + math.log(mu) / (lam[valid] - 1.0)
    else:
        eta = selection.shape
        gamma = truncated_negative_binomial_gamma(eta, selection.mean)
        hat = lam >= 1
        constant = (1.0 + eta) * np.min((1.0 - 1.0 / lam[hat]) * base[hat] + math.log(1.0 / gamma) / lam[hat])
        out[valid] = base[valid] + constant + math.log(selection.mean) / (lam[valid] - 1.0)
    # Rényi divergence is non-decreasing in the order: a bound at λ' ≥ λ bounds order λ too.
    return np.minimum.accumulate(out[::-1])[::-1]


def rdp_to_epsilon(orders: Sequence[float], rdp: Sequence[float] | np.ndarray, delta: float) -> float:
    """(ε, δ) from an RDP curve: Canonne, Kamath & Steinke (2020), Prop. 12 (dp_accounting)."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon  # lazy: when this accountant is asked

    epsilon, _ = compute_epsilon(list(orders), list(rdp), delta)
    return float(epsilon)
