"""Gaussian differential privacy: the exact (ε, δ) conversion and NoisyCGD's hidden-state bound.

**μ-GDP** (Dong, Roth & Su 2022): a mechanism is μ-GDP when telling any two neighbouring data sets
apart from its output is no easier than telling N(0, 1) from N(μ, 1). Its privacy profile is
exactly that of the Gaussian mechanism with sensitivity 1 and noise std 1/μ (Cor. 2.13, seed 001
Lemma 2.5):

    δ(ε) = Φ(−ε/μ + μ/2) − e^ε · Φ(−ε/μ − μ/2),

decreasing in ε and increasing in μ, so ε(δ) and the largest μ for a target (ε, δ) are found by
bisection on an exact formula (:func:`gdp_epsilon`, :func:`gdp_mu`). k-fold composition of
μ_i-GDP mechanisms is sqrt(Σ μ_i²)-GDP; in Rényi terms μ-GDP is (α, αμ²/2)-RDP.

**NoisyCGD** (seed 001 Eq. 2.4): the data are split once into k disjoint batches; each of E epochs
visits them in order with θ ← θ − η((1/b) Σ_{x∈B_j} clip_C(∇h(θ, x)) + λθ + Z_j), Z_j ~
N(0, σ_g² I), and only the final θ is released. For λ-strongly convex, β-smooth losses with
gradient sensitivity L and 0 < η < 2/β, Theorem 2.8 (Bok, Su & Altschuler 2024, Thm 4.5) gives
μ-GDP with

    μ = L/(b σ_g) · sqrt(1 + c^{2k−2} (1 − c²)/(1 − c^k)² · (1 − c^{k(E−1)})/(1 + c^{k(E−1)})),
    c = max{|1 − ηλ|, |1 − ηβ|}

(the paper's "2/M" read as 2/β). Under replace-one neighbouring the clipped data term moves by
at most L = 2C; with dpml's noise convention σ_g = σC/b (σ the noise multiplier), L/(bσ_g) = 2/σ.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from scipy.special import log_ndtr, ndtr


def gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of μ-GDP: Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (the second term in log space)."""
    if mu <= 0:
        return 0.0
    a = -epsilon / mu
    return max(0.0, float(ndtr(a + mu / 2) - math.exp(epsilon + log_ndtr(a - mu / 2))))


def gdp_epsilon(mu: float, delta: float, tolerance: float = 1e-10) -> float:
    """The smallest ε ≥ 0 with δ(ε) ≤ δ for μ-GDP (an upper end of the bisection: never below)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta = {delta}: must be in (0, 1)")
    if gdp_delta(0.0, mu) <= delta:
        return 0.0
    low, high = 0.0, max(1.0, mu * mu)
    while gdp_delta(high, mu) > delta:
        low, high = high, 2 * high
    while high - low > tolerance * max(1.0, high):
        middle = (low + high) / 2
        if gdp_delta(middle, mu) > delta:
            low = middle
        else:
            high = middle
    return high


def gdp_mu(epsilon: float, delta: float, tolerance: float = 1e-12) -> float:
    """The largest μ whose μ-GDP profile meets (ε, δ): δ(ε; μ) ≤ δ (a lower end: never above)."""
    if not (epsilon > 0 and 0 < delta < 1):
        raise ValueError(f"(epsilon, delta) = ({epsilon}, {delta}): need ε > 0 and δ in (0, 1)")
    low, high = 0.0, 1.0
    while gdp_delta(epsilon, high) <= delta:
        low, high = high, 2 * high
    while high - low > tolerance * high:
        middle = (low + high) / 2
        if gdp_delta(epsilon, middle) <= delta:
            low = middle
        else:
            high = middle
    return low


def contraction_factor(learning_rate: float, l2: float, smoothness: float) -> float:
    """c = max{|1 − ηλ|, |1 − ηβ|}: the Lipschitz constant of one noiseless gradient step.

    Raises unless 0 < η < 2/β (the theorem's condition; beyond it a step can expand distances).
    """
    if not 0 <= l2 <= smoothness:
        raise ValueError(f"λ = {l2:g}: must be in [0, β = {smoothness:g}]")
    if not 0 < learning_rate < 2.0 / smoothness:
        raise ValueError(
            f"learning rate η = {learning_rate:g} must be in (0, 2/β) = (0, {2.0 / smoothness:.6g}) "
            f"for the hidden-state bound (β = {smoothness:.6g} is the loss's smoothness bound)"
        )
    return max(abs(1.0 - learning_rate * l2), abs(1.0 - learning_rate * smoothness))


def noisycgd_mu_factor(c: float, batches: int, epochs: int) -> float:
    """sqrt(1 + c^{2k−2} (1−c²)/(1−c^k)² · (1−c^{k(E−1)})/(1+c^{k(E−1)})) of Theorem 2.8.

    At c = 1 (no strong convexity) the limit 1 + (E−1)/k is used. Computed with expm1 so that
    c close to 1 (ηλ ≈ 1e-4, the paper's regime) keeps its precision.
    """
    if not 0 <= c <= 1:
        raise ValueError(f"c = {c}: must be in [0, 1]")
    if batches < 1 or epochs < 1:
        raise ValueError(f"k = {batches}, E = {epochs}: must both be ≥ 1")
    k, later = batches, epochs - 1
    if later == 0:
        return 1.0
    if c == 1.0:
        return math.sqrt(1.0 + later / k)
    if c == 0.0:
        return math.sqrt(2.0) if k == 1 else 1.0
    log_c = math.log(c)

    def one_minus(power: float) -> float:  # 1 − c^power
        return -math.expm1(power * log_c)

    tail = one_minus(k * later) / (2.0 - one_minus(k * later))
    return math.sqrt(1.0 + math.exp((2 * k - 2) * log_c) * one_minus(2) / one_minus(k) ** 2 * tail)


def noisycgd_mu(noise_multiplier: float, c: float, batches: int, epochs: int, sensitivity_ratio: float = 2.0) -> float:
    """μ of NoisyCGD: (L / (b σ_g)) · factor = (sensitivity_ratio / σ) · factor.

    ``sensitivity_ratio`` = L / C: 2 under replace-one (a record replaced inside its batch moves the
    clipped sum by up to 2C); the noise std on the averaged gradient is σ·C/b.
    """
    if noise_multiplier <= 0:
        raise ValueError(f"noise multiplier σ = {noise_multiplier}: must be > 0")
    return sensitivity_ratio / noise_multiplier * noisycgd_mu_factor(c, batches, epochs)


def calibrate_l2(
    target_epsilon: float,
    delta: float,
    noise_multiplier: float,
    learning_rate: float,
    data_smoothness: float,
    batches: int,
    epochs: int,
) -> float:
    """The smallest λ for which NoisyCGD's certified ε ≤ target, at this η, σ, k, E
    (see :func:`calibrate_l2_for_mu`)."""
    try:
        return calibrate_l2_for_mu(
            gdp_mu(target_epsilon, delta), noise_multiplier, learning_rate, data_smoothness, batches, epochs
        )
    except ValueError as error:
        raise ValueError(f"target ε = {target_epsilon:g} at δ = {delta:g}: {error}") from None


def calibrate_l2_for_mu(
    mu_target: float, noise_multiplier: float, learning_rate: float, data_smoothness: float, batches: int, epochs: int
) -> float:
    """The smallest λ with NoisyCGD's μ ≤ ``mu_target``, at this η, σ, k, E.

    β = β_data + λ. While 1 − ηλ ≥ |1 − ηβ| (the usual regime, c = 1 − ηλ) μ falls as λ grows, so
    λ is found by bisection on that stretch; a target that needs more forgetting than η allows is
    refused (μ ≥ 2/σ always: the last visit of a record is never forgotten). Returns the upper end
    of the bisection, so μ(λ) ≤ target always holds.
    """

    def mu_of(l2: float) -> float:
        c = contraction_factor(learning_rate, l2, data_smoothness + l2)
        return noisycgd_mu(noise_multiplier, c, batches, epochs)

    if mu_of(0.0) <= mu_target:
        return 0.0
    # c = 1 − ηλ dominates while ηβ_data + 2ηλ ≤ 2, i.e. λ ≤ (2/η − β_data)/2 =: λ_max.
    l2_max = (2.0 / learning_rate - data_smoothness) / 2.0
    if l2_max <= 0 or mu_of(l2_max * (1 - 1e-12)) > mu_target:
        raise ValueError(
            f"μ ≤ {mu_target:.4g} is out of reach for NoisyCGD with σ = {noise_multiplier:g}, η = {learning_rate:g}, "
            f"k = {batches}, E = {epochs}: even the strongest regularisation the learning rate allows gives "
            f"μ = {mu_of(max(l2_max, 0.0) * (1 - 1e-12)):.4g} (never below 2/σ = {2 / noise_multiplier:.4g}); "
            "raise σ or lower E"
        )
    return _bisect_smallest(lambda l2: mu_of(l2) <= mu_target, 0.0, l2_max * (1 - 1e-12))


def _bisect_smallest(ok: Callable[[float], bool], bad: float, good: float, iterations: int = 200) -> float:
    for _ in range(iterations):
        middle = (bad + good) / 2
        if ok(middle):
            good = middle
        else:
            bad = middle
        if good - bad <= 1e-15 * good:
            break
    return good
