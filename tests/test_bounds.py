"""Empirical ε lower bounds against cases computed by hand, by exact enumeration, or by simulation."""

import math

import numpy as np
import pytest

from dpml.audit.bounds import (clopper_pearson_upper, epsilon_for_gdp, epsilon_from_error_rates, gdp_delta,
                               hypothesis_test_bound, one_run_bound, one_run_guesses, one_run_p_value)


def test_clopper_pearson_zero_failures_closed_form() -> None:
    # P[Bin(n, p) = 0] = (1 − p)^n = α  ⇒  p_ub = 1 − α^{1/n}
    assert clopper_pearson_upper(0, 50, 0.05) == pytest.approx(1 - 0.05 ** (1 / 50))
    assert clopper_pearson_upper(50, 50, 0.05) == 1.0


def test_clopper_pearson_coverage() -> None:
    rng = np.random.default_rng(0)
    p, n = 0.1, 60
    misses = sum(clopper_pearson_upper(int(k), n, 0.05) < p for k in rng.binomial(n, p, size=4000))
    assert misses / 4000 <= 0.05


def test_error_rate_conversion_by_hand() -> None:
    # max(ln(0.8/0.1), ln(0.9/0.2)) = ln 8
    assert epsilon_from_error_rates(0.1, 0.2, 0.0) == pytest.approx(math.log(8))
    assert epsilon_from_error_rates(0.5, 0.5, 0.0) == 0.0
    assert epsilon_from_error_rates(0.0, 0.2, 0.0) == math.inf


def test_perfect_separation_split_bound_is_the_closed_form() -> None:
    n, delta = 400, 1e-5
    bound = hypothesis_test_bound(np.arange(5 * n, 6 * n, dtype=float), np.arange(0, n, dtype=float), delta)
    upper = 1 - 0.025 ** (1 / (n // 2))  # zero errors among n/2 evaluated per side, each at α/2
    assert bound.epsilon == pytest.approx(math.log((1 - delta - upper) / upper), rel=1e-9)
    assert bound.confidence == 0.95 and bound.inputs["members_evaluated"] == n // 2


def test_perfect_separation_bonferroni_bound_is_the_closed_form() -> None:
    n = 400  # two distinct scores: the single candidate threshold separates them
    bound = hypothesis_test_bound(np.ones(n), np.zeros(n), 0.0, correction="bonferroni", thresholds=50)
    k = bound.inputs["thresholds_tested"]
    assert k == 1
    upper = 1 - (0.05 / (2 * k)) ** (1 / n)
    assert bound.epsilon == pytest.approx(math.log((1 - upper) / upper), rel=1e-9)


def test_chance_level_scores_give_no_bound() -> None:
    rng = np.random.default_rng(1)
    for correction in ("split", "bonferroni"):
        assert hypothesis_test_bound(rng.normal(size=2000), rng.normal(size=2000), 1e-5, correction=correction).epsilon < 0.1


@pytest.mark.parametrize("epsilon", [0.5, 2.0])
def test_hypothesis_test_bound_is_valid_for_randomized_response(epsilon: float) -> None:
    """Scores from an exactly ε-DP mechanism (randomised response): the bound exceeds ε rarely."""
    rng = np.random.default_rng(2)
    p = math.exp(epsilon) / (1 + math.exp(epsilon))
    over = 0
    for _ in range(100):
        members = (rng.random(1000) < p).astype(float)
        nonmembers = (rng.random(1000) < 1 - p).astype(float)
        over += hypothesis_test_bound(members, nonmembers, 0.0, seed=int(rng.integers(1 << 30))).epsilon > epsilon
    assert over <= 10  # expected ≤ 5 at 95% confidence


def test_gdp_conversion_matches_the_gaussian_mechanism_pld() -> None:
    """μ-GDP is the Gaussian mechanism with σ = 1/μ: compare with dp_accounting's PLD."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    for mu in (0.5, 1.0, 2.0):
        reference = pld.from_gaussian_mechanism(1 / mu, value_discretization_interval=1e-4).get_epsilon_for_delta(1e-5)
        assert epsilon_for_gdp(mu, 1e-5) == pytest.approx(reference, abs=2e-3)
        assert gdp_delta(epsilon_for_gdp(mu, 1e-5), mu) == pytest.approx(1e-5, rel=1e-6)
    assert epsilon_for_gdp(0.0, 1e-5) == 0.0


def test_one_run_ceiling_for_perfect_guesses() -> None:
    """All 1000 guesses right, δ = 0: p(ε) = q^1000 < 0.05 ⇔ ε < ln(q*/(1 − q*)), q* = 0.05^{1/1000}."""
    q_star = 0.05 ** (1 / 1000)
    bound = one_run_bound(1000, 1000, 1000, 0.0)
    assert bound.epsilon == pytest.approx(math.log(q_star / (1 - q_star)), abs=1e-6)
    assert bound.epsilon == pytest.approx(5.809, abs=1e-3)
    assert one_run_bound(1000, 1000, 1000, 1e-5).epsilon <= bound.epsilon


def test_one_run_p_value_by_exact_enumeration() -> None:
    """β + 2mδ·α with β and α summed term by term from the binomial pmf."""
    r, v, m, delta, eps = 6, 5, 20, 1e-3, 1.0
    q = 1 / (1 + math.exp(-eps))
    pmf = [math.comb(r, k) * q ** k * (1 - q) ** (r - k) for k in range(r + 1)]
    beta = sum(pmf[v:])
    alpha = max(sum(pmf[v - i: v]) / i for i in range(1, v + 1))
    assert one_run_p_value(eps, delta, m, r, v) == pytest.approx(beta + 2 * m * delta * alpha, rel=1e-12)


def test_one_run_chance_and_validity() -> None:
    assert one_run_bound(1000, 200, 100, 1e-5).epsilon == 0.0
    rng = np.random.default_rng(3)
    epsilon, over = 1.0, 0
    q = 1 / (1 + math.exp(-epsilon))
    for _ in range(100):
        correct = int(rng.binomial(200, q))  # the worst an ε-DP mechanism allows
        over += one_run_bound(1000, 200, correct, 0.0).epsilon > epsilon
    assert over <= 12  # expected ≤ 5


def test_one_run_guesses_counts_top_and_bottom() -> None:
    scores = np.array([0.9, 0.1, 0.8, 0.2, 0.5, 0.4])
    included = np.array([True, False, False, False, True, True])
    # top 2: indices 0 (in, right), 2 (out, wrong); bottom 2: 1 (out, right), 3 (out, right)
    assert one_run_guesses(scores, included, 2, 2) == (4, 3)
    with pytest.raises(ValueError):
        one_run_guesses(scores, included, 4, 4)
