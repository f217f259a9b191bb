"""Empirical ε lower bounds against cases computed by hand, by exact enumeration, or by simulation.

The validity tests ("the bound exceeds the true ε with probability at most 1 − confidence") are exact, not
simulated: the bound of a binary-score mechanism depends only on its error counts, so the probability of
an over-claim is a finite sum over the binomial laws of those counts, with the bound itself computed by
the library at every count where it matters. There is no tolerance to widen.
"""

import math

import numpy as np
import pytest
from scipy import stats

from dpml.audit.bounds import (
    _candidate_thresholds,
    _clopper_pearson_upper_many,
    clopper_pearson_upper,
    epsilon_for_gdp,
    epsilon_from_error_rates,
    epsilon_from_gdp_rates,
    gdp_delta,
    hypothesis_test_bound,
    hypothesis_test_power,
    one_run_bound,
    one_run_guesses,
    one_run_p_value,
    one_run_power,
)


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


@pytest.mark.parametrize("levels", [2, 10])
def test_bonferroni_divides_the_level_by_twice_the_number_of_thresholds(levels: int) -> None:
    """K candidate thresholds: each Clopper–Pearson limit is taken at α/(2K), so the bound is the closed form
    with α/(2K) and zero errors. Pins the planted bug "the level divided by K instead of 2K" (and "by 2
    only"), which the K = 1 case above cannot see.

    Members score 1, …, K (n/K of each) and non-members 0: the K midpoints are the candidates (K ≤
    ``thresholds``), and the lowest, 0.5, separates the two sides with no error."""
    n = 400
    members = np.repeat(np.arange(1, levels + 1, dtype=float), n // levels)
    bound = hypothesis_test_bound(members, np.zeros(n), 0.0, correction="bonferroni", thresholds=50)
    assert bound.inputs["thresholds_tested"] == levels
    assert bound.inputs["threshold"] == 0.5 and bound.inputs["false_positives"] == bound.inputs["false_negatives"] == 0
    upper = 1 - (0.05 / (2 * levels)) ** (1 / n)
    assert bound.epsilon == pytest.approx(math.log((1 - upper) / upper), rel=1e-9)
    # … and every candidate counts: with at most K − 1 of them tested the bound is another one
    fewer = hypothesis_test_bound(members, np.zeros(n), 0.0, correction="bonferroni", thresholds=levels - 1)
    assert fewer.inputs["thresholds_tested"] < levels and fewer.epsilon > bound.epsilon


def test_chance_level_scores_give_no_bound() -> None:
    rng = np.random.default_rng(1)
    for correction in ("split", "bonferroni"):
        assert (
            hypothesis_test_bound(rng.normal(size=2000), rng.normal(size=2000), 1e-5, correction=correction).epsilon
            < 0.1
        )


def randomized_response_scores(
    false_positives: int, false_negatives: int, records: int, correction: str, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Binary scores of ``records`` members and as many non-members whose *evaluated* records hold exactly
    the given error counts: all of them under ``bonferroni``; under ``split`` the evaluation halves, found
    by drawing the permutations :func:`hypothesis_test_bound` draws for ``seed`` (the bound reports the
    counts it saw, and the caller checks them, so a change of split cannot go unnoticed)."""
    members, nonmembers = np.ones(records), np.zeros(records)
    if correction == "split":
        rng = np.random.default_rng(seed)
        member_order, nonmember_order = rng.permutation(records), rng.permutation(records)
        half = records // 2
        members[member_order[half:][:false_negatives]] = 0.0
        nonmembers[nonmember_order[half:][:false_positives]] = 1.0
        members[member_order[:1]] = 0.0  # the selection half shows both scores: its one candidate is 0.5
    else:
        members[:false_negatives], nonmembers[:false_positives] = 0.0, 1.0
    return members, nonmembers


@pytest.mark.parametrize("correction", ["split", "bonferroni"])
@pytest.mark.parametrize("epsilon", [0.5, 2.0])
def test_hypothesis_test_bound_is_valid_for_randomized_response(epsilon: float, correction: str) -> None:
    """Randomised response is exactly ε-DP and the tight case of FPR + e^ε·FNR ≥ 1: each record's score is
    right with probability p = e^ε/(1 + e^ε), so the evaluated error counts are independent Bin(m, 1 − p).
    The bound is non-increasing in each count, so {bound > ε} is a staircase {FP < F(FN)}, traced with
    the library's own bound, and P[bound > ε] = Σ_FN P[FN]·P[FP < F(FN)] exactly. The promise is
    P ≤ 1 − confidence = 0.05, for both threshold corrections; no simulation, no tolerance. (The old
    simulated version accepted 10 over-claims in 100 where 5 were expected.)"""
    records, seed = 400, 7
    evaluated = records // 2 if correction == "split" else records
    p = math.exp(epsilon) / (1 + math.exp(epsilon))

    def over(false_positives: int, false_negatives: int) -> bool:
        bound = hypothesis_test_bound(
            *randomized_response_scores(false_positives, false_negatives, records, correction, seed),
            0.0,
            correction=correction,
            seed=seed,
        )
        assert (bound.inputs["false_positives"], bound.inputs["false_negatives"]) == (false_positives, false_negatives)
        assert (bound.inputs["members_evaluated"], bound.inputs["nonmembers_evaluated"]) == (evaluated, evaluated)
        return bound.epsilon > epsilon

    errors = stats.binom(evaluated, 1 - p)
    probability, limit = 0.0, evaluated + 1  # limit: the least FP count at which the bound is ≤ ε
    for false_negatives in range(evaluated + 1):
        while limit > 0 and not over(limit - 1, false_negatives):
            limit -= 1
        probability += errors.pmf(false_negatives) * errors.cdf(limit - 1)
    assert 0.0 < probability <= 0.05, probability


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
    pmf = [math.comb(r, k) * q**k * (1 - q) ** (r - k) for k in range(r + 1)]
    beta = sum(pmf[v:])
    alpha = max(sum(pmf[v - i : v]) / i for i in range(1, v + 1))
    assert one_run_p_value(eps, delta, m, r, v) == pytest.approx(beta + 2 * m * delta * alpha, rel=1e-12)


def enumerated_p_value(epsilon: float, delta: float, m: int, r: int, v: int) -> tuple[float, int]:
    """β + 2mδ·α summed term by term from the binomial pmf, and the i at which α's maximum is reached."""
    q = 1 / (1 + math.exp(-epsilon))
    pmf = [math.comb(r, k) * q**k * (1 - q) ** (r - k) for k in range(r + 1)]
    terms = [sum(pmf[v - i : v]) / i for i in range(1, v + 1)]
    return sum(pmf[v:]) + 2 * m * delta * max(terms), int(np.argmax(terms)) + 1


@pytest.mark.parametrize("r, v, epsilon", [(20, 20, 0.1), (30, 25, 0.2), (40, 30, 0.3)])
def test_one_run_p_value_maximises_over_every_i(r: int, v: int, epsilon: float) -> None:
    """Points where α's maximum is at an interior i (not at i = 1, as at r = 6, v = 5 above): a p-value that
    takes only the i = 1 term, or stops the maximum early, is off here."""
    expected, at = enumerated_p_value(epsilon, 1e-3, 50, r, v)
    assert 1 < at < v
    assert one_run_p_value(epsilon, 1e-3, 50, r, v) == pytest.approx(expected, rel=1e-12)


def test_one_run_with_one_correct_guess_and_delta() -> None:
    """v = 1, δ > 0: α has the single term i = v = 1, P[Bin(r, q) = 0]. Pins the planted bug "the maximum
    over 1 ≤ i < v" (the i = v term dropped), which crashes here on an empty maximum. (For ε ≥ 0 and
    v ≥ 2 the i = v term never strictly wins — P[Bin = 0] is the least pmf value — so v = 1 is where
    dropping it shows.)"""
    r, m, delta = 8, 100, 1e-3
    for epsilon in (0.0, 0.7, 3.0):
        q = 1 / (1 + math.exp(-epsilon))
        beta, alpha = 1 - (1 - q) ** r, (1 - q) ** r
        assert one_run_p_value(epsilon, delta, m, r, 1) == pytest.approx(
            min(1.0, beta + 2 * m * delta * alpha), rel=1e-12
        )
        assert one_run_p_value(epsilon, delta, m, r, 1) == pytest.approx(enumerated_p_value(epsilon, delta, m, r, 1)[0])
    assert one_run_bound(100, 8, 1, delta).epsilon == 0.0  # one right guess in eight proves nothing
    assert one_run_bound(100, 1, 1, delta).epsilon == 0.0


@pytest.mark.parametrize("epsilon, delta", [(1.0, 0.0), (1.0, 1e-5), (3.0, 0.0)])
def test_one_run_chance_and_validity(epsilon: float, delta: float) -> None:
    """The worst an ε-DP mechanism allows is each guess right with probability q = e^ε/(1 + e^ε)
    independently: v ~ Bin(r, q). The bound is non-decreasing in v, so P[bound > ε] = P[v ≥ v*] for the
    least v* whose bound exceeds ε: exact, and at most 0.05 (for δ = 0 it is P[Bin ≥ v*] < 0.05 by the
    bound's own definition, within one pmf term of it)."""
    assert one_run_bound(1000, 200, 100, 1e-5).epsilon == 0.0
    guesses = 200
    q = 1 / (1 + math.exp(-epsilon))

    def bound(correct: int) -> float:
        return one_run_bound(1000, guesses, correct, delta).epsilon

    low, least = 0, guesses  # bisection for the least v whose bound exceeds ε
    assert bound(guesses) > epsilon >= bound(0)
    while least - low > 1:
        middle = (low + least) // 2
        low, least = (low, middle) if bound(middle) > epsilon else (middle, least)
    assert bound(least - 1) <= bound(least) <= bound(least + 1)  # monotone where it matters
    probability = float(stats.binom(guesses, q).sf(least - 1))
    assert 0.0 < probability <= 0.05, probability
    if delta == 0.0:
        assert probability > 0.05 - float(stats.binom(guesses, q).pmf(least - 1))


def test_one_run_guesses_counts_top_and_bottom() -> None:
    scores = np.array([0.9, 0.1, 0.8, 0.2, 0.5, 0.4])
    included = np.array([True, False, False, False, True, True])
    # top 2: indices 0 (in, right), 2 (out, wrong); bottom 2: 1 (out, right), 3 (out, right)
    assert one_run_guesses(scores, included, 2, 2) == (4, 3)
    with pytest.raises(ValueError):
        one_run_guesses(scores, included, 4, 4)


# --- Pinned by mutation testing (scripts/mutation.sh; benchmarks/results/mutation.md lists each mutant) -------


def test_clopper_pearson_edges_and_the_vectorised_form() -> None:
    """No trials: no information (1); one trial without failure: 1 − α; and the vectorised limit the bounds
    use equals the scalar one at every failure count, all failures included (1, not a Beta(n + 1, 1) value)."""
    assert clopper_pearson_upper(0, 0, 0.05) == 1.0 and clopper_pearson_upper(0, -1, 0.05) == 1.0
    assert clopper_pearson_upper(0, 1, 0.05) == pytest.approx(0.95, rel=1e-12)
    n = 30
    scalar = [clopper_pearson_upper(k, n, 0.01) for k in range(n + 1)]
    np.testing.assert_allclose(_clopper_pearson_upper_many(np.arange(n + 1), n, 0.01), scalar, rtol=1e-12)
    assert scalar[-1] == 1.0 and scalar[-2] < 1.0


def test_candidate_thresholds_are_midpoints_between_consecutive_distinct_scores() -> None:
    np.testing.assert_array_equal(
        _candidate_thresholds(np.array([0.0, 1.0, 3.0, 3.0]), np.array([6.0, 0.0]), 10), [0.5, 2.0, 4.5]
    )
    np.testing.assert_array_equal(_candidate_thresholds(np.arange(10.0), np.arange(10.0), 2), [0.5, 8.5])


@pytest.mark.parametrize("correction", ["split", "bonferroni"])
@pytest.mark.parametrize("gdp", [False, True])
def test_each_hypothesis_bound_records_what_a_reviewer_needs_to_recompute_it(correction: str, gdp: bool) -> None:
    """The record is the bound's evidence: its method, confidence and assumption, and inputs from which the
    reviewer recomputes it — the error counts, their Clopper–Pearson limits at α/2 (split) or α/(2K)
    (Bonferroni) over the records evaluated, and ε from those limits by the method's conversion (Kairouz
    et al. for the test, μ-GDP through μ = Φ⁻¹(1 − FPR) − Φ⁻¹(FNR) for ``gdp``). Unequal sides, so the
    two counts cannot be swapped unseen."""
    rng = np.random.default_rng(5)
    members, nonmembers = rng.normal(1.5, 1.0, 300), rng.normal(0.0, 1.0, 500)
    delta, confidence = 1e-5, 0.9
    bound = hypothesis_test_bound(members, nonmembers, delta, confidence, correction, thresholds=40, seed=3, gdp=gdp)
    record = bound.to_dict()
    inputs = record["inputs"]
    evaluated = (150, 250) if correction == "split" else (300, 500)
    extra = {"thresholds_tested"} if correction == "bonferroni" else set()
    assert (
        set(inputs)
        == {
            "threshold",
            "false_positives",
            "false_negatives",
            "fpr_upper",
            "fnr_upper",
            "members_evaluated",
            "nonmembers_evaluated",
            "delta",
            "correction",
            "seed",
        }
        | extra
    )
    assert (inputs["members_evaluated"], inputs["nonmembers_evaluated"]) == evaluated
    assert (inputs["delta"], inputs["correction"], inputs["seed"]) == (delta, correction, 3)
    tested = inputs.get("thresholds_tested", 1)
    assert tested == (40 if correction == "bonferroni" else 1)
    alpha_each = (1 - confidence) / (2 * tested)
    assert inputs["fpr_upper"] == pytest.approx(
        clopper_pearson_upper(inputs["false_positives"], evaluated[1], alpha_each)
    )
    assert inputs["fnr_upper"] == pytest.approx(
        clopper_pearson_upper(inputs["false_negatives"], evaluated[0], alpha_each)
    )
    if correction == "bonferroni":  # the counts are those of "member iff score ≥ threshold"
        assert inputs["false_positives"] == int((nonmembers >= inputs["threshold"]).sum())
        assert inputs["false_negatives"] == int((members < inputs["threshold"]).sum())
    fpr, fnr = inputs["fpr_upper"], inputs["fnr_upper"]
    if gdp:
        mu = stats.norm.ppf(1 - fpr) - stats.norm.ppf(fnr)
        expected = epsilon_for_gdp(mu, delta)
        assert record["method"] == "gdp"
        assert (
            record["assumption"] == "Gaussian trade-off curve (μ-GDP); records' outcomes treated as independent trials"
        )
    else:
        expected = epsilon_from_error_rates(fpr, fnr, delta)
        assert record["method"] == "hypothesis_test"
        assert record["assumption"] == "records' outcomes treated as independent trials"
    assert record["confidence"] == confidence and expected > 0.3
    assert record["epsilon"] == pytest.approx(expected, rel=1e-9)


def test_gdp_rates_to_epsilon_and_its_edges() -> None:
    """μ_lb = Φ⁻¹(1 − FPR) − Φ⁻¹(FNR), then ε at δ; a zero error rate is no limit (∞); rates no better than
    chance (μ ≤ 0) prove nothing (0); δ(ε) of 0-GDP is 0; and an ε below 1 is found too (the root bracket
    starts at 0)."""
    for fpr, fnr in ((0.05, 0.2), (0.3, 0.01), (0.4, 0.45)):
        mu = stats.norm.ppf(1 - fpr) - stats.norm.ppf(fnr)
        assert epsilon_from_gdp_rates(fpr, fnr, 1e-5) == pytest.approx(epsilon_for_gdp(mu, 1e-5), rel=1e-12)
        assert gdp_delta(epsilon_from_gdp_rates(fpr, fnr, 1e-5), mu) == pytest.approx(1e-5, rel=1e-6)
    assert epsilon_from_gdp_rates(0.0, 0.2, 1e-5) == math.inf and epsilon_from_gdp_rates(0.2, 0.0, 1e-5) == math.inf
    assert epsilon_from_gdp_rates(0.6, 0.5, 1e-5) == 0.0
    assert gdp_delta(0.5, 0.0) == 0.0 and gdp_delta(0.5, -1.0) == 0.0
    small = epsilon_for_gdp(0.5, 0.05)
    assert 0 < small < 1 and gdp_delta(small, 0.5) == pytest.approx(0.05, rel=1e-8)
    assert epsilon_for_gdp(math.inf, 1e-5) == math.inf and epsilon_for_gdp(200.0, 1e-5) == math.inf  # ε > 1e4
    assert epsilon_for_gdp(1e-6, 1e-5) == 0.0  # δ(0) = 2Φ(μ/2) − 1 ≈ 4e-7 is already below δ


def test_the_defaults_a_reviewer_reads_in_the_record() -> None:
    """100 candidate thresholds for Bonferroni and seed 0 for the split, unless asked otherwise."""
    rng = np.random.default_rng(8)
    members, nonmembers = rng.normal(1.0, 1.0, 400), rng.normal(0.0, 1.0, 400)
    assert hypothesis_test_bound(members, nonmembers, 1e-5, correction="bonferroni").inputs["thresholds_tested"] == 100
    assert hypothesis_test_bound(members, nonmembers, 1e-5).inputs["seed"] == 0


def test_the_split_chooses_on_the_whole_selection_half() -> None:
    """Split: the threshold is chosen on every record outside the evaluation half. One member (resp.
    non-member) of the selection half is placed where only it makes the recorded choice what it is: a
    selection that skipped it would record another threshold."""
    n, seed = 40, 0  # 20 per side per half: zero errors give ε > 0, one error less
    rng = np.random.default_rng(seed)
    member_order, nonmember_order = rng.permutation(n), rng.permutation(n)
    members, nonmembers = np.full(n, 100.0), np.zeros(n)
    members[member_order[n // 2 - 1]] = 1.0  # the last selection-half member: 0.5 separates, 50.5 does not
    assert hypothesis_test_bound(members, nonmembers, 0.0, seed=seed).inputs["threshold"] == 0.5
    members, nonmembers = np.full(n, 100.0), np.zeros(n)
    nonmembers[nonmember_order[n // 2 - 1]] = 99.0  # the last selection-half non-member: only 99.5 separates
    assert hypothesis_test_bound(members, nonmembers, 0.0, seed=seed).inputs["threshold"] == 99.5


def test_the_powers_are_the_bounds_of_perfect_outcomes() -> None:
    """hypothesis_test_power: every record right on both halves (split), so only the Clopper–Pearson limits
    remain; one_run_power: every guess right."""
    n, delta = 400, 1e-5
    upper = 1 - 0.025 ** (1 / (n // 2))
    assert hypothesis_test_power(n, n, delta) == pytest.approx(math.log((1 - delta - upper) / upper), rel=1e-9)
    upper = 1 - 0.025 ** (1 / n)  # Bonferroni with one threshold: α/2 each, all n evaluated
    assert hypothesis_test_power(n, n, 0.0, correction="bonferroni") == pytest.approx(math.log((1 - upper) / upper))
    assert hypothesis_test_power(n, n, delta, confidence=0.99) < hypothesis_test_power(n, n, delta)
    q_star = 0.05 ** (1 / 1000)
    assert one_run_power(1000, 1000, 0.0) == pytest.approx(math.log(q_star / (1 - q_star)), abs=1e-6)
    q_star = 0.01 ** (1 / 300)
    assert one_run_power(1000, 300, 0.0, confidence=0.99) == pytest.approx(math.log(q_star / (1 - q_star)), abs=1e-6)


@pytest.mark.parametrize("guesses, correct", [(200, 118), (200, 150), (500, 420), (50, 50)])
def test_one_run_bound_with_delta_zero_is_the_binomial_quantile(guesses: int, correct: int) -> None:
    """With δ = 0, p(ε) = P[Bin(r, q) ≥ v] = I_q(v, r − v + 1), so ε_lb is the logit of the 5 % quantile of
    Beta(v, r − v + 1): a closed form the bisection must reach to 1e-6, below 1 and above it."""
    q_star = stats.beta.ppf(0.05, correct, guesses - correct + 1)
    bound = one_run_bound(1000, guesses, correct, 0.0)
    assert bound.epsilon == pytest.approx(math.log(q_star / (1 - q_star)), abs=1e-6)


def test_each_one_run_bound_records_what_a_reviewer_needs_to_recompute_it() -> None:
    """Both answers (no evidence: 0; else the bisection's ε) carry the method, the confidence, the assumption
    and the counts p(ε) is computed from; a count out of order is refused, naming the three."""
    assumption = "canaries included independently with probability 1/2 in one training run"
    for correct, positive in ((100, False), (170, True)):
        record = one_run_bound(1000, 200, correct, 1e-5, confidence=0.9).to_dict()
        assert (record["epsilon"] > 0) == positive
        assert record == {
            "method": "one_run",
            "epsilon": record["epsilon"],
            "confidence": 0.9,
            "assumption": assumption,
            "inputs": {"canaries": 1000, "guesses": 200, "correct": correct, "delta": 1e-5},
        }
        if positive:
            assert one_run_p_value(record["epsilon"], 1e-5, 1000, 200, correct) == pytest.approx(0.1, abs=1e-6)
    with pytest.raises(ValueError, match=r"need 0 ≤ correct \(9\) ≤ guesses \(8\) ≤ canaries \(100\)"):
        one_run_bound(100, 8, 9, 0.0)


def test_one_run_p_value_edges() -> None:
    """No right guess: p = 1; a p-value above 1 is cut to 1 (a large 2mδ·α)."""
    assert one_run_p_value(2.0, 1e-5, 100, 10, 0) == 1.0
    assert one_run_p_value(0.0, 0.01, 1000, 8, 1) == 1.0  # β + 2mδ·α = 0.996 + 20·0.0039 > 1


def test_one_run_guesses_edges_and_ties() -> None:
    """All canaries guessed is allowed (k_in + k_out = m), one more is refused with the counts; no IN guess at
    all works; and ties are broken by position (stable order), so the guesses do not depend on the sort."""
    scores = np.array([0.9, 0.1, 0.8, 0.2, 0.5, 0.4])
    included = np.array([True, False, False, False, True, True])
    assert one_run_guesses(scores, included, 3, 3) == (6, 4)
    assert one_run_guesses(scores, included, 0, 2) == (2, 2)
    with pytest.raises(ValueError, match=r"k_in \+ k_out = 7 exceeds the 6 canaries"):
        one_run_guesses(scores, included, 4, 3)
    rng = np.random.default_rng(0)
    tied, inside = rng.integers(0, 3, 200).astype(float), rng.random(200) < 0.5
    order = np.lexsort((np.arange(200), tied))  # by score, then by position
    expected = int(inside[order[-40:]].sum()) + int((~inside[order[:30]]).sum())
    assert one_run_guesses(tied, inside, 40, 30) == (70, expected)
