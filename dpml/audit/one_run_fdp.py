"""One-run audits read through a whole trade-off curve (Mahloujifar, Melis & Chaudhuri, ICML 2025,
"Auditing f-Differential Privacy in One Run", arXiv 2410.22235).

The game is Steinke, Nasr & Jagielski's (:mod:`dpml.audit.bounds`, bound 3): m canaries, each included
independently with probability ½ (secret bits S_1 … S_m); after one training run the auditor guesses IN or
OUT for c' of them (abstaining on the rest) and C of its guesses are right. Instead of asking whether the
count is plausible under one (ε, δ) point, it asks whether it is plausible under a trade-off function f
(Dong, Roth & Su 2022): a mechanism is f-DP when every test between neighbouring inputs with type-I error
α has type-II error ≥ f(α). Write f̄(x) = 1 − f(x): an event of probability x under one input has
probability at most f̄(x) under a neighbour; f̄ is increasing and concave, f̄⁻¹ its inverse.

**The argument, step by step** (r_i, h_i are averages over the m canaries; "j right" means the auditor
guessed canary j and was right):

    r_i = (1/m)·Σ_j P[j right ∧ C ≥ i],     h_i = (1/m)·Σ_j P[j wrong ∧ C ≥ i].

1. *Privacy.* Fix j and the other bits. "j right ∧ C ≥ i" is the event "the guess for j is g ∧ the
   others have ≥ i − 1 right" under S_j = g; the same event under S_j ≠ g is "j wrong ∧ C ≥ i − 1".
   f-DP in S_j and the concavity of f̄ (averaging over g, the other bits and j) give r_i ≤ f̄(h_{i−1}),
   so h_{i−1} ≥ f̄⁻¹(r_i); and h_{i−1} ≥ h_i since the events shrink with i. Hence
       h_{i−1} ≥ max(h_i, f̄⁻¹(r_i)).
2. *Counting.* r_{i−1} − r_i = ((i − 1)/m)·P[C = i − 1] and h_{i−1} − h_i = ((c' − i + 1)/m)·P[C = i − 1],
   so r_{i−1} = r_i + ((i − 1)/(c' − i + 1))·(h_{i−1} − h_i).
3. *Total.* Every run makes c' guesses: r_0 + h_0 = (1/m)·E[C + wrong] = c'/m.
4. *Start.* If c or more right guesses had probability at least τ, then r_c ≥ τ·c/m; the procedure starts
   from r_c = τ·c/m and h_c = τ·(c' − c)/m (that probability sitting on exactly c right guesses), and steps
   1–2 taken with equality from i = c down to 0 give the least r_0 + h_0 consistent with them.
   If that least value exceeds c'/m (step 3), observing c right guesses had probability < τ under every
   f-DP mechanism: the hypothesis "f-DP" is rejected at level τ.

This is the paper's ``audit_rh_with_cap`` procedure for a membership game (two choices per canary); the
recursion above is derived here and agrees with jax_privacy's implementation of it. The paper's own text
(its equation numbers) was not available to this project: steps 1–4 are stated in full instead.

Two families of f are offered:

- **Gaussian** f_μ(α) = Φ(Φ⁻¹(1 − α) − μ) (μ-GDP), f̄_μ⁻¹(y) = Φ(Φ⁻¹(y) − μ). The bound is the largest μ
  rejected, and the ε at the run's δ of μ-GDP (:func:`dpml.audit.bounds.epsilon_for_gdp`). It *assumes*
  the mechanism's curve is Gaussian (DP-SGD's is close to it after many steps, not equal): it is reported
  beside the Steinke–Nasr–Jagielski bound, never gating.
- **(ε, δ)** f̄(x) = min(1, e^ε·x + δ, 1 − e^{−ε}·(1 − δ − x)), f̄⁻¹(y) = max(0, (y − δ)·e^{−ε},
  1 − δ − e^ε·(1 − y)): no assumption beyond the game's. It rests on the same information as Steinke et
  al.'s bound and, on the audits' numbers, agrees with it to within 0.02 (tests/test_one_run_fdp.py).

- **The mechanism's own curve** (:func:`one_run_mechanism_bound`): the trade-off function of the certified
  mechanism's privacy profile δ(ε) from the PLD accountant (a mechanism that is (ε_k, δ_k)-DP for every k is
  f-DP with f = sup_k f_{ε_k, δ_k}, Dong, Roth & Su 2022, Prop. 2.12; hence f̄⁻¹ = max_k f̄⁻¹_{ε_k, δ_k}). The
  family is the certified mechanism with every noise multiplier scaled by t; the bound is the ε (at the run's
  δ, from the same accountant) of the least-noise member the guesses reject. No assumption beyond the game's
  and the certificate's own mechanism: rejecting t = 1 says the implementation is less private than certified.

Rejection sets are searched on a grid and refined on a finer one; the value reported is always one at
which the test rejected, so a search that stops early reports less, never more.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
from scipy import stats

from dpml.accounting.accountants import base_delta_profile, epsilon_pld
from dpml.accounting.mechanism import MechanismDescription, gaussian_only
from dpml.audit.bounds import LowerBound, epsilon_for_gdp

BlowUpInverse = Callable[[np.ndarray], np.ndarray]

GAUSSIAN_ASSUMPTION = (
    "the mechanism's trade-off curve is Gaussian (μ-GDP); canaries included independently with "
    "probability 1/2 in one training run"
)
_MU_GRID = np.linspace(0.0, 16.0, 801)


def gaussian_blow_up_inverse(mu: np.ndarray) -> BlowUpInverse:
    """f̄_μ⁻¹(y) = Φ(Φ⁻¹(y) − μ), one μ per entry: the least probability, under one input, of an event that has
    probability y under its neighbour, for μ-GDP."""
    mu = np.asarray(mu, float)

    def inverse(y: np.ndarray) -> np.ndarray:
        return np.asarray(stats.norm.cdf(stats.norm.ppf(np.clip(y, 0.0, 1.0)) - mu))

    return inverse


def approximate_dp_blow_up_inverse(epsilon: np.ndarray, delta: float) -> BlowUpInverse:
    """f̄⁻¹(y) = max(0, (y − δ)·e^{−ε}, 1 − δ − e^ε·(1 − y)) of (ε, δ)-DP, one ε per entry (Kairouz, Oh &
    Viswanath 2015, Thm 2.1, as a trade-off function: Dong, Roth & Su 2022, eq. 6): a privacy profile of one
    point per curve (:func:`profile_blow_up_inverse`)."""
    epsilons = np.asarray(epsilon, float).reshape(-1, 1)
    return profile_blow_up_inverse(epsilons, np.full_like(epsilons, delta))


def rejected(inverse: BlowUpInverse, canaries: int, guesses: int, correct: int, level: float) -> np.ndarray:
    """Whether ``correct`` right guesses out of ``guesses`` among ``canaries`` reject f-DP at level τ = ``level``,
    for each curve of ``inverse`` (steps 1–4 of the module's docstring; arrays broadcast over the curves).

    r and h never decrease as i falls, so a curve whose r + h passes c'/m is rejected at once (its later
    values, which may overflow, are not needed)."""
    if not 0 <= correct <= guesses <= canaries or guesses == 0:
        raise ValueError(f"need 0 ≤ correct ({correct}) ≤ guesses ({guesses}) ≤ canaries ({canaries}), guesses > 0")
    total = guesses / canaries
    shape = np.shape(inverse(np.full(1, level)))  # the number of curves the inverse holds
    r = np.full(shape, level * correct / canaries)
    h = np.full(shape, level * (guesses - correct) / canaries)
    done = r + h > total
    for i in range(correct - 1, -1, -1):
        h_next = np.maximum(h, inverse(np.minimum(r, 1.0)))
        r = r + (i / (guesses - i)) * (h_next - h)
        h = h_next
        done |= r + h > total
        if done.all():
            break
    return np.asarray(done)


def largest_rejected(test: Callable[[np.ndarray], np.ndarray], grid: np.ndarray) -> float:
    """The largest parameter at which ``test`` rejects: on ``grid`` (increasing), then on 256 points between
    that grid point and the next. 0 when it rejects nowhere; the grid's end when it rejects there."""
    hits = np.flatnonzero(test(grid))
    if hits.size == 0:
        return 0.0
    last = int(hits[-1])
    if last == grid.size - 1:
        return float(grid[-1])
    finer = np.linspace(grid[last], grid[last + 1], 257)[:-1]
    return float(finer[np.flatnonzero(test(finer))[-1]])


def one_run_gdp_bound(canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95) -> LowerBound:
    """The largest μ whose μ-GDP the guesses reject at level 1 − ``confidence``, as ``inputs["mu"]``, and the ε of
    μ-GDP at ``delta`` as the bound's ε. Reported beside the one-run bound, never gating (its assumption)."""
    level = 1.0 - confidence
    mu = largest_rejected(
        lambda mus: rejected(gaussian_blow_up_inverse(mus), canaries, guesses, correct, level), _MU_GRID
    )
    inputs = {"canaries": canaries, "guesses": guesses, "correct": correct, "delta": delta, "mu": mu}
    return LowerBound("one_run_fdp_gdp", epsilon_for_gdp(mu, delta), confidence, GAUSSIAN_ASSUMPTION, inputs)


def one_run_fdp_epsilon(canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95) -> float:
    """The largest ε whose (ε, δ)-DP the guesses reject through the (ε, δ) trade-off curve (no Gaussian
    assumption): the f-DP reading of the same game as Steinke et al.'s bound."""
    level = 1.0 - confidence
    return largest_rejected(
        lambda eps: rejected(approximate_dp_blow_up_inverse(eps, delta), canaries, guesses, correct, level),
        np.linspace(0.0, 20.0, 801),
    )


def one_run_gdp_power(canaries: int, guesses: int, delta: float, confidence: float = 0.95) -> LowerBound:
    """The largest bound :func:`one_run_gdp_bound` can report here: every guess right."""
    return one_run_gdp_bound(canaries, guesses, guesses, delta, confidence)


def profile_blow_up_inverse(epsilons: np.ndarray, deltas: np.ndarray) -> BlowUpInverse:
    """f̄⁻¹(y) = max_k max(0, (y − δ_k)·e^{−ε_k}, 1 − δ_k − e^{ε_k}·(1 − y)) for a mechanism that is
    (ε_k, δ_k)-DP at every ε_k of ``epsilons``; ``deltas`` holds one profile per row (one curve each), and
    ``epsilons`` is one grid for all rows or a column per row. The inverse of a pointwise minimum of
    increasing functions is the pointwise maximum of their inverses. Fewer ε_k give a smaller f̄⁻¹, i.e. a
    test that rejects less: a coarse grid costs tightness, never validity."""
    growth = np.atleast_2d(np.exp(np.minimum(np.asarray(epsilons, float), 700.0)))
    profiles = np.atleast_2d(np.asarray(deltas, float))

    def inverse(y: np.ndarray) -> np.ndarray:
        y = np.clip(np.asarray(y, float), 0.0, 1.0).reshape(-1, 1)
        each = np.maximum((y - profiles) / growth, 1.0 - profiles - growth * (1.0 - y))
        return np.maximum(each.max(axis=1), 0.0)

    return inverse


PROFILE_EPSILONS = np.concatenate([np.linspace(0.0, 4.0, 161)[:-1], np.geomspace(4.0, 60.0, 120)])
NOISE_SCALES = np.array([0.2, 20.0])  # the family searched: σ/5 … 20σ
BISECTIONS = 8  # log t to 1/256 of log 100: t within 1.8 %
MECHANISM_DISCRETIZATION = 1e-3  # the PLD's pessimistic grid: coarser only loosens the test


def scaled(mechanism: MechanismDescription, factor: float) -> MechanismDescription:
    """The mechanism with every Gaussian event's noise scaled by ``factor`` (NotImplementedError for others)."""
    return replace(mechanism, events=tuple(e.with_noise_scaled(factor) for e in gaussian_only(mechanism.events)))


@functools.lru_cache(maxsize=256)
def scaled_profile(mechanism: MechanismDescription, factor: float) -> np.ndarray:
    """δ(ε) on :data:`PROFILE_EPSILONS` of the mechanism with its noise scaled by ``factor`` (PLD, pessimistic),
    kept per process: an audit's bisections, its power and its second scoring ask for the same scales."""
    return base_delta_profile(scaled(mechanism, factor), MECHANISM_DISCRETIZATION)(PROFILE_EPSILONS)


def one_run_mechanism_bound(
    mechanism: MechanismDescription,
    canaries: int,
    guesses: int,
    correct: int,
    delta: float,
    confidence: float = 0.95,
    scales: np.ndarray = NOISE_SCALES,
) -> LowerBound:
    """The one-run guesses read through the certified mechanism's own trade-off curve: the least noise scale t
    (between the ends of ``scales``, by bisection on log t) whose mechanism the guesses reject at level 1 −
    ``confidence``, and its ε at ``delta``. ``inputs["noise_scale"]`` ≤ 1 means the certified mechanism itself
    is rejected: a violation. 0 (and scale ∞) when no member of the family is rejected."""
    level = 1.0 - confidence

    def rejects(factor: float) -> bool:
        inverse = profile_blow_up_inverse(PROFILE_EPSILONS, scaled_profile(mechanism, factor))
        return bool(rejected(inverse, canaries, guesses, correct, level)[0])

    least, most = float(scales.min()), float(scales.max())
    if not rejects(most):
        factor = math.inf
    elif rejects(least):
        factor = least
    else:  # more noise is rejected more easily: bisect log t between a kept and a rejected scale
        kept, factor = math.log(least), math.log(most)
        for _ in range(BISECTIONS):
            middle = 0.5 * (kept + factor)
            kept, factor = (kept, middle) if rejects(math.exp(middle)) else (middle, factor)
        factor = math.exp(factor)
    inputs = {"canaries": canaries, "guesses": guesses, "correct": correct, "delta": delta}
    assumption = (
        "the certified mechanism's trade-off curve, scaled in noise; canaries included independently with "
        "probability 1/2"
    )
    if math.isinf(factor):
        return LowerBound("one_run_mechanism", 0.0, confidence, assumption, inputs | {"noise_scale": factor})
    epsilon = epsilon_pld(scaled(mechanism, factor), delta, MECHANISM_DISCRETIZATION)
    return LowerBound("one_run_mechanism", float(epsilon), confidence, assumption, inputs | {"noise_scale": factor})


def one_run_mechanism_power(
    mechanism: MechanismDescription, canaries: int, guesses: int, delta: float, confidence: float = 0.95
) -> float:
    """The largest ε :func:`one_run_mechanism_bound` can report here: every guess right."""
    return one_run_mechanism_bound(mechanism, canaries, guesses, guesses, delta, confidence).epsilon


def mechanism_curve(mechanism: dict[str, Any] | None) -> MechanismDescription | str:
    """The certified mechanism (``mechanism.json``) whose curve reads the guesses in ``audit.mode: tight``, or
    why it cannot: no certificate, or an event that is not Gaussian steps."""
    if mechanism is None:
        return "no certified mechanism (a non-private target): the (ε, δ) reading is used"
    described = MechanismDescription.from_dict(mechanism)
    try:
        gaussian_only(described.events)
    except NotImplementedError as error:
        return f"{error}: the (ε, δ) reading is used"
    return described
