"""The f-DP reading of the one-run audit (dpml/audit/one_run_fdp.py; Mahloujifar, Melis & Chaudhuri 2025).

A bound is valid when, for a mechanism that satisfies the hypothesis, it rejects the hypothesis with
probability at most the level τ. Tested where that probability is exact (each guess right independently:
randomized response is exactly ε-DP, a Gaussian coordinate exactly μ-GDP), by simulation where the auditor
abstains (top and bottom k of the scores, as the audit guesses), and against the bounds it must agree or order
with (Steinke, Nasr & Jagielski's, :mod:`dpml.audit.bounds`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpml.accounting.accountants import base_delta_profile
from dpml.accounting.mechanism import GaussianDP, MechanismDescription, PoissonGaussianSteps
from dpml.audit.bounds import epsilon_for_gdp, one_run_bound, one_run_guesses
from dpml.audit.one_run_fdp import (
    MECHANISM_DISCRETIZATION,
    PROFILE_EPSILONS,
    approximate_dp_blow_up_inverse,
    gaussian_blow_up_inverse,
    one_run_fdp_epsilon,
    one_run_gdp_bound,
    one_run_gdp_power,
    one_run_mechanism_bound,
    profile_blow_up_inverse,
    rejected,
)

LEVEL = 0.05


def least_rejecting_count(inverse, canaries: int, guesses: int) -> int | None:  # type: ignore[no-untyped-def]
    """The fewest right guesses that reject the hypothesis, by bisection; the counts beside it and every count
    from it to ``guesses`` in steps are checked, so a test that is not monotone in the count fails here."""

    def rejects(count: int) -> bool:
        return bool(rejected(inverse, canaries, guesses, count, LEVEL)[0])

    if not rejects(guesses):
        return None
    low, high = -1, guesses  # rejects(high); not rejects(low) (low = -1: none)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if rejects(middle) else (middle, high)
    assert all(rejects(c) for c in range(high, guesses + 1, max(1, (guesses - high) // 8)))
    assert not any(rejects(c) for c in range(max(0, high - 8), high))
    return high


@pytest.mark.parametrize("canaries, epsilon", [(100, 1.0), (400, 0.5), (1000, 2.0)])
def test_randomized_response_is_rejected_at_most_at_the_level_and_not_far_below(canaries: int, epsilon: float) -> None:
    """Randomized response with P[right] = e^ε/(1 + e^ε) on every canary is exactly ε-DP, and guessing every
    canary by its answer makes the right guesses Bin(m, e^ε/(1 + e^ε)): the probability that the (ε, 0) curve is
    rejected is a binomial tail, exactly. It must be ≤ τ (validity). It is also above τ/5 (the analysis loses
    little here, where the worst case is known), which a recursion made needlessly cautious fails."""
    count = least_rejecting_count(approximate_dp_blow_up_inverse(np.array([epsilon]), 0.0), canaries, canaries)
    assert count is not None
    q = math.exp(epsilon) / (1 + math.exp(epsilon))
    probability = float(stats.binom(canaries, q).sf(count - 1))
    assert LEVEL / 5 < probability <= LEVEL, probability


@pytest.mark.parametrize("canaries, mu", [(100, 1.0), (400, 0.5), (1000, 0.3)])
def test_a_gaussian_coordinate_per_canary_rejects_its_own_mu_at_most_at_the_level(canaries: int, mu: float) -> None:
    """Output μ·S_j + N(0, 1) for each canary is exactly μ-GDP in each S_j; the best guess (S_j = 1 iff the output
    exceeds μ/2) is right with probability Φ(μ/2), independently: right guesses ~ Bin(m, Φ(μ/2))."""
    count = least_rejecting_count(gaussian_blow_up_inverse(np.array([mu])), canaries, canaries)
    assert count is not None
    assert float(stats.binom(canaries, stats.norm.cdf(mu / 2)).sf(count - 1)) <= LEVEL


def test_the_bound_holds_when_the_auditor_abstains_as_the_audit_does() -> None:
    """The audit guesses IN for the k highest scores and OUT for the k lowest. Simulated on the μ-GDP mechanism
    above: the largest μ rejected exceeds the true μ in at most the binomial 99.9 % quantile of 60 trials at
    τ = 0.05, and typically reaches a third of it."""
    rng = np.random.default_rng(2025)
    mu, canaries, k, trials = 1.0, 200, 20, 60
    found = []
    for _ in range(trials):
        included = rng.random(canaries) < 0.5
        guesses, correct = one_run_guesses(mu * included + rng.standard_normal(canaries), included, k, k)
        found.append(one_run_gdp_bound(canaries, guesses, correct, 1e-5).inputs["mu"])
    assert sum(f > mu for f in found) <= stats.binom(trials, LEVEL).ppf(0.999)
    assert np.median(found) > mu / 3


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_without_privacy_loss_n_of_n_right_rejects_exactly_when_the_level_exceeds_two_to_the_minus_n(n: int) -> None:
    """μ = 0 (f̄(x) = x: the output says nothing of the bits): n right guesses of n canaries have probability
    exactly 2⁻ⁿ, so "0-GDP" must be rejected at every level above 2⁻ⁿ and at none below it."""
    no_loss = gaussian_blow_up_inverse(np.array([0.0]))
    assert rejected(no_loss, n, n, n, 1.01 * 2.0**-n)[0]
    assert not rejected(no_loss, n, n, n, 0.99 * 2.0**-n)[0]


@pytest.mark.parametrize(
    "canaries, guesses, level", [(20, 20, 0.05), (100, 40, 0.05), (650, 130, 0.05), (650, 130, 0.2)]
)
def test_without_privacy_loss_an_abstaining_auditor_is_rejected_at_most_at_the_level(
    canaries: int, guesses: int, level: float
) -> None:
    """μ = 0: every guess is a fair coin, whichever canaries the auditor picks: right guesses ~ Bin(c', ½)
    exactly. The probability of rejecting 0-GDP is at most τ, and above τ/4 (the least rejecting count is not
    needlessly high)."""
    no_loss = gaussian_blow_up_inverse(np.array([0.0]))
    least = min(c for c in range(guesses + 1) if rejected(no_loss, canaries, guesses, c, level)[0])
    assert level / 4 < float(stats.binom(guesses, 0.5).sf(least - 1)) <= level


def test_one_canary_rejects_nothing_and_two_follow_the_steps_by_hand() -> None:
    """m = c' = c = 1: r_1 = τ, h_1 = 0; h_0 = f̄⁻¹(τ); reject iff τ + Φ(Φ⁻¹(τ) − μ) > 1, i.e. μ < 2Φ⁻¹(τ) < 0:
    one right guess never rejects μ-GDP. m = c' = c = 2: h_1 = g(τ), r_1 = τ + g(τ), h_0 = max(h_1, g(r_1)),
    r_0 = r_1; reject iff r_0 + h_0 > 1, g = f̄_μ⁻¹."""
    mus = np.linspace(0.0, 10.0, 101)
    assert not rejected(gaussian_blow_up_inverse(mus), 1, 1, 1, LEVEL).any()
    for mu in (0.0, 1.0, 2.0, 3.0, 5.0):

        def g(y: float, mu: float = mu) -> float:
            return float(stats.norm.cdf(stats.norm.ppf(y) - mu))

        r_1 = LEVEL + g(LEVEL)
        by_hand = r_1 + max(g(LEVEL), g(min(r_1, 1.0))) > 1
        assert rejected(gaussian_blow_up_inverse(np.array([mu])), 2, 2, 2, LEVEL)[0] == by_hand


def test_the_blow_up_inverses_invert_their_trade_off_curves() -> None:
    """f̄ = 1 − f for f_μ(α) = Φ(Φ⁻¹(1 − α) − μ) and for (ε, δ)-DP's curve (Dong, Roth & Su 2022, eqs. 5–6)."""
    x = np.linspace(0.01, 0.6, 30)
    mu = 1.3
    blow_up = 1 - stats.norm.cdf(stats.norm.ppf(1 - x) - mu)
    assert gaussian_blow_up_inverse(np.full(x.size, mu))(blow_up) == pytest.approx(x, rel=1e-9)
    epsilon, delta = 0.8, 1e-3
    blow_up = np.minimum.reduce(
        [np.ones_like(x), math.exp(epsilon) * x + delta, 1 - (1 - delta - x) / math.exp(epsilon)]
    )
    inside = blow_up < 1
    assert approximate_dp_blow_up_inverse(np.full(x.size, epsilon), delta)(blow_up)[inside] == pytest.approx(x[inside])


@pytest.mark.parametrize(
    "canaries, guesses, correct",
    [(650, 130, 130), (650, 130, 120), (650, 130, 100), (1000, 200, 150), (1000, 1000, 900)],
)
def test_it_agrees_with_the_steinke_bound_on_one_point_and_orders_above_it_on_the_gaussian_curve(
    canaries: int, guesses: int, correct: int
) -> None:
    """Through the (ε, δ) curve the f-DP reading rests on the same information as Steinke et al.'s bound: the two
    agree to 0.05. The Gaussian curve at the μ of (ε, δ) lies above the (ε, δ) curve (μ-GDP is a stronger claim),
    so its bound in ε at δ is at least the (ε, δ) one; on these audits' numbers it is well above Steinke's."""
    delta = 1e-5
    steinke = one_run_bound(canaries, guesses, correct, delta).epsilon
    through_point = one_run_fdp_epsilon(canaries, guesses, correct, delta)
    gdp = one_run_gdp_bound(canaries, guesses, correct, delta)
    assert through_point == pytest.approx(steinke, abs=0.05)
    assert gdp.epsilon >= through_point - 0.05  # the grid's resolution
    assert gdp.epsilon > 1.2 * steinke > 0
    assert gdp.epsilon == pytest.approx(epsilon_for_gdp(gdp.inputs["mu"], delta))


def test_more_right_guesses_never_lower_the_bound_and_the_power_is_all_right() -> None:
    found = [one_run_gdp_bound(650, 130, c, 1e-5).inputs["mu"] for c in range(60, 131, 5)]
    assert found == sorted(found) and found[0] == 0.0 < found[-1]
    power = one_run_gdp_power(650, 130, 1e-5, 0.95)
    assert power.inputs["correct"] == 130 and power.inputs["mu"] == found[-1]
    assert one_run_gdp_power(650, 130, 1e-5, 0.99).inputs["mu"] < power.inputs["mu"]  # more confidence, less reach


def test_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError, match="correct"):
        one_run_gdp_bound(100, 8, 9, 1e-5)
    with pytest.raises(ValueError, match="guesses"):
        one_run_gdp_bound(100, 0, 0, 1e-5)


def test_a_gaussian_mechanisms_profile_gives_back_its_gaussian_curve() -> None:
    """The trade-off function built from a privacy profile is exact for μ-GDP (Dong, Roth & Su 2022, Cor. 2.13
    gives δ(ε); Prop. 2.12 takes it back): the PLD profile of a μ-GDP event, read through
    :func:`profile_blow_up_inverse`, is f̄_μ⁻¹ to the grid's and the discretisation's resolution, and never above
    it (a coarse grid only loosens)."""
    mu = 1.5
    mechanism = MechanismDescription(
        trainer="", events=(GaussianDP(mu),), neighbouring="add-remove", clip_norm=1.0, dataset_size=1
    )
    deltas = base_delta_profile(mechanism, MECHANISM_DISCRETIZATION)(PROFILE_EPSILONS)
    y = np.linspace(0.02, 0.98, 49)
    from_profile = profile_blow_up_inverse(PROFILE_EPSILONS, deltas)(y)
    exact = gaussian_blow_up_inverse(np.full(y.size, mu))(y)
    assert np.all(from_profile <= exact + 1e-6)
    assert from_profile == pytest.approx(exact, abs=5e-3)


@pytest.mark.parametrize("true_mu", [1.0, 3.0])
def test_the_mechanisms_own_curve_flags_a_noisier_claim_and_not_the_true_one(
    true_mu: float,
) -> None:
    """A release certified as 1-GDP (σ = 1 on a sensitivity-1 query). Each canary's output is μ·S_j + N(0, 1),
    exactly μ-GDP in S_j, the auditor guesses the top and bottom 10 %. True μ = 1 (as certified): the certified
    mechanism (noise scale ≥ 1) is rejected in no more runs of 20 than the binomial 99.9 % quantile at τ = 0.05
    (5). True μ = 3 (a third of the noise: a broken trainer): it is rejected in at least 18 of 20."""
    mechanism = MechanismDescription(
        trainer="", events=(GaussianDP(1.0),), neighbouring="add-remove", clip_norm=1.0, dataset_size=1
    )
    rng = np.random.default_rng(7)
    canaries, k, runs, flagged = 1000, 100, 20, 0
    for _ in range(runs):
        included = rng.random(canaries) < 0.5
        guesses, correct = one_run_guesses(true_mu * included + rng.standard_normal(canaries), included, k, k)
        bound = one_run_mechanism_bound(mechanism, canaries, guesses, correct, 1e-5)
        flagged += bound.inputs["noise_scale"] <= 1.0
        if bound.epsilon > 0:
            assert bound.epsilon == pytest.approx(epsilon_for_gdp(1.0 / bound.inputs["noise_scale"], 1e-5), abs=0.05)
    if true_mu == 1.0:
        assert flagged <= stats.binom(runs, LEVEL).ppf(0.999), flagged
    else:
        assert flagged >= 18, flagged


def test_the_mechanisms_own_curve_is_at_least_the_one_point_reading() -> None:
    """The certified mechanism's whole profile says more than its one (ε, δ) point, so it rejects at least
    what the (ε, δ) curve rejects: on the default pipeline's white-box numbers (σ ≈ 3, q = 0.1, 200 steps, 130
    guesses among 650 canaries) its bound is at least Steinke's, and above it by a third when most guesses are
    right."""
    mechanism = MechanismDescription(
        trainer="dpsgd",
        events=(PoissonGaussianSteps(0.1, 3.0, 200),),
        neighbouring="add-remove",
        clip_norm=1.0,
        dataset_size=1107,
    )
    for correct in (95, 115):
        tight = one_run_mechanism_bound(mechanism, 650, 130, correct, 1e-5).epsilon
        steinke = one_run_bound(650, 130, correct, 1e-5).epsilon
        assert tight > 1.3 * steinke > 0
