"""Empirical lower bounds on ε from membership-inference outcomes.

Every function is numpy-in, numbers-out and returns a :class:`LowerBound` holding the bound,
its confidence level, the assumption it rests on and every input, so a reviewer can recompute it.

1. **Hypothesis test** (Kairouz, Oh, Viswanath 2015, Thm 2.1): if a mechanism is (ε, δ)-DP,
   every test between neighbouring inputs satisfies
       FPR + e^ε·FNR ≥ 1 − δ   and   FNR + e^ε·FPR ≥ 1 − δ,
   so ε ≥ max{ ln((1 − δ − FNR)/FPR), ln((1 − δ − FPR)/FNR) }. With one-sided Clopper–Pearson
   upper bounds FPR_ub, FNR_ub (each at level α/2, so both hold with probability ≥ 1 − α), the
   bound with FPR, FNR replaced by FPR_ub, FNR_ub holds with confidence 1 − α. Choosing the
   threshold is corrected for either by choosing it on one random half of the scores and
   bounding on the other (``split``; every midpoint between distinct scores is a candidate), or by
   a union bound over K candidate thresholds, each at level α/(2K) (``bonferroni``).
2. **GDP** (Nasr et al. 2023, *Tight auditing*): under the assumption that the mechanism's
   trade-off curve is Gaussian, μ ≥ μ_lb = Φ⁻¹(1 − FPR_ub) − Φ⁻¹(FNR_ub), and ε_lb is the ε at
   which μ_lb-GDP has δ(ε) = δ: δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2) (Dong et al. 2019).
3. **One run** (Steinke, Nasr, Jagielski 2023, Thm 5.2 / Alg. 2): m canaries, each included
   independently with probability ½; the auditor guesses r of them and v guesses are right.
   For an (ε, δ)-DP mechanism, with q = e^ε/(1 + e^ε),
       β = P[Bin(r, q) ≥ v],  α = max_{1≤i≤v} (1/i)·P[v − i ≤ Bin(r, q) < v],
       p(ε) = min(1, β + 2mδ·α)
   is a valid p-value for "the mechanism is (ε, δ)-DP"; ε_lb = sup{ε : p(ε) < 1 − confidence}.

Bounds 1 and 2 computed from *one* trained model with many member / non-member records treat
each record's outcome as an independent trial (as ML Privacy Meter and TF Privacy do); that is
a heuristic there, rigorous when each trial is a fresh training run. Bound 3 is rigorous for a
single training run. Each result says which applies.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
from scipy import optimize, stats


@dataclass(frozen=True)
class LowerBound:
    method: str
    epsilon: float
    confidence: float
    assumption: str
    inputs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def clopper_pearson_upper(failures: int, trials: int, alpha: float) -> float:
    """One-sided (1 − α) Clopper–Pearson upper bound on a binomial proportion."""
    if trials <= 0:
        return 1.0
    if failures >= trials:
        return 1.0
    return float(stats.beta.ppf(1.0 - alpha, failures + 1, trials - failures))


def epsilon_from_error_rates(fpr: float, fnr: float, delta: float) -> float:
    """max{ln((1−δ−FNR)/FPR), ln((1−δ−FPR)/FNR), 0}, with x/0 = ∞ for x > 0."""
    best = 0.0
    for a, b in ((fnr, fpr), (fpr, fnr)):
        numerator = 1.0 - delta - a
        if numerator <= 0:
            continue
        best = max(best, math.inf if b <= 0 else math.log(numerator / b))
    return best


def _candidate_thresholds(member: np.ndarray, nonmember: np.ndarray, count: int) -> np.ndarray:
    """Up to ``count`` thresholds at midpoints between consecutive distinct pooled scores."""
    values = np.unique(np.r_[member, nonmember])
    if values.size < 2:
        return values
    midpoints = (values[:-1] + values[1:]) / 2
    positions = np.unique(np.linspace(0, midpoints.size - 1, min(count, midpoints.size)).round().astype(int))
    return midpoints[positions]


def _error_counts(member: np.ndarray, nonmember: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """False positives and false negatives of "member iff score ≥ t" for every threshold t."""
    nonmember, member = np.sort(nonmember), np.sort(member)
    fp = nonmember.size - np.searchsorted(nonmember, thresholds, side="left")
    fn = np.searchsorted(member, thresholds, side="left")
    return fp, fn


def _clopper_pearson_upper_many(failures: np.ndarray, trials: int, alpha: float) -> np.ndarray:
    upper = stats.beta.ppf(1.0 - alpha, failures + 1, np.maximum(trials - failures, 1))
    return np.where(failures >= trials, 1.0, upper)


def _bounded(
    member: np.ndarray, nonmember: np.ndarray, thresholds: np.ndarray, alpha_each: float, convert: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    fp, fn = _error_counts(member, nonmember, thresholds)
    fpr = _clopper_pearson_upper_many(fp, nonmember.size, alpha_each)
    fnr = _clopper_pearson_upper_many(fn, member.size, alpha_each)
    eps = np.array([convert(a, b) for a, b in zip(fpr, fnr, strict=True)])
    return eps, fpr, fnr, fp, fn


def hypothesis_test_bound(
    member_scores: np.ndarray,
    nonmember_scores: np.ndarray,
    delta: float,
    confidence: float = 0.95,
    correction: Literal["split", "bonferroni"] = "split",
    thresholds: int = 100,
    seed: int = 0,
    gdp: bool = False,
) -> LowerBound:
    """ε lower bound from the best threshold test, corrected for choosing the threshold.

    ``gdp=True`` converts the same bounded error rates to ε through μ-GDP instead (bound 2).
    """
    member, nonmember = np.asarray(member_scores, float), np.asarray(nonmember_scores, float)
    alpha = 1.0 - confidence

    def convert(fpr: float, fnr: float) -> float:
        return epsilon_from_gdp_rates(fpr, fnr, delta) if gdp else epsilon_from_error_rates(fpr, fnr, delta)

    if correction == "split":
        rng = np.random.default_rng(seed)
        m_perm, n_perm = rng.permutation(member.size), rng.permutation(nonmember.size)
        m_sel, m_eval = member[m_perm[: member.size // 2]], member[m_perm[member.size // 2 :]]
        n_sel, n_eval = nonmember[n_perm[: nonmember.size // 2]], nonmember[n_perm[nonmember.size // 2 :]]
        # Choosing on the selection half costs nothing on the other: try every distinct midpoint.
        candidates = _candidate_thresholds(m_sel, n_sel, m_sel.size + n_sel.size)
        chosen = candidates[int(np.argmax(_bounded(m_sel, n_sel, candidates, alpha / 2, convert)[0]))]
        eps, fpr, fnr, fp, fn = _bounded(m_eval, n_eval, np.array([chosen]), alpha / 2, convert)
        best, evaluated = 0, (m_eval.size, n_eval.size)
        extra: dict[str, Any] = {}
    else:
        candidates = _candidate_thresholds(member, nonmember, thresholds)
        eps, fpr, fnr, fp, fn = _bounded(member, nonmember, candidates, alpha / (2 * candidates.size), convert)
        best, evaluated = int(np.argmax(eps)), (member.size, nonmember.size)
        chosen = candidates[best]
        extra = {"thresholds_tested": int(candidates.size)}
    inputs = {
        "threshold": float(chosen),
        "false_positives": int(fp[best]),
        "false_negatives": int(fn[best]),
        "fpr_upper": float(fpr[best]),
        "fnr_upper": float(fnr[best]),
        "members_evaluated": int(evaluated[0]),
        "nonmembers_evaluated": int(evaluated[1]),
        "delta": delta,
        "correction": correction,
        "seed": seed,
    } | extra
    return LowerBound(
        method="gdp" if gdp else "hypothesis_test",
        epsilon=float(max(eps[best], 0.0)),
        confidence=confidence,
        assumption=("Gaussian trade-off curve (μ-GDP); " if gdp else "")
        + "records' outcomes treated as independent trials",
        inputs=inputs,
    )


def gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of μ-GDP: Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Dong, Roth, Su 2019, Cor. 2.13).

    The second term is formed as exp(ε + ln Φ(·)), so a large ε (the bracket :func:`epsilon_for_gdp` grows)
    gives its tiny value instead of overflowing e^ε."""
    if mu <= 0:
        return 0.0
    return float(stats.norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon + stats.norm.logcdf(-epsilon / mu - mu / 2)))


def epsilon_for_gdp(mu: float, delta: float) -> float:
    """The ε with δ_μ(ε) = δ (0 when μ-GDP already gives δ at ε = 0)."""
    if mu <= 0 or gdp_delta(0.0, mu) <= delta:
        return 0.0
    if not math.isfinite(mu):
        return math.inf
    upper = 1.0
    while gdp_delta(upper, mu) > delta:
        upper *= 2.0
        if upper > 1e4:
            return math.inf
    return float(optimize.brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, upper, xtol=1e-10))


def epsilon_from_gdp_rates(fpr: float, fnr: float, delta: float) -> float:
    """μ_lb = Φ⁻¹(1 − FPR) − Φ⁻¹(FNR), then ε at δ (bound 2)."""
    if fpr <= 0 or fnr <= 0:
        return math.inf
    mu = float(stats.norm.ppf(1.0 - fpr) - stats.norm.ppf(fnr))
    return epsilon_for_gdp(max(mu, 0.0), delta)


def one_run_p_value(epsilon: float, delta: float, canaries: int, guesses: int, correct: int) -> float:
    """p(ε) of Steinke, Nasr, Jagielski 2023 (Thm 5.2): small when (ε, δ)-DP is implausible."""
    if correct <= 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-epsilon))
    binom = stats.binom(guesses, q)
    beta = float(binom.sf(correct - 1))  # P[Bin ≥ v]
    if delta == 0:
        return min(1.0, beta)
    # P[v − i ≤ Bin < v] = cdf(v − 1) − cdf(v − i − 1)
    cdf_below = float(binom.cdf(correct - 1))
    i = np.arange(1, correct + 1)
    alpha = float(np.max((cdf_below - binom.cdf(correct - i - 1)) / i))
    return min(1.0, beta + 2.0 * canaries * delta * alpha)


def one_run_bound(canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95) -> LowerBound:
    """ε_lb = sup{ε : p(ε) < 1 − confidence}, by bisection (p is increasing in ε)."""
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 ≤ correct ({correct}) ≤ guesses ({guesses}) ≤ canaries ({canaries})")
    level = 1.0 - confidence
    inputs = {"canaries": canaries, "guesses": guesses, "correct": correct, "delta": delta}
    assumption = "canaries included independently with probability 1/2 in one training run"
    if one_run_p_value(0.0, delta, canaries, guesses, correct) >= level:
        return LowerBound("one_run", 0.0, confidence, assumption, inputs)
    lo, hi = 0.0, 1.0
    while one_run_p_value(hi, delta, canaries, guesses, correct) < level:
        lo, hi = hi, hi * 2.0
        if hi > 200:
            break
    while hi - lo > 1e-7:
        mid = 0.5 * (lo + hi)
        if one_run_p_value(mid, delta, canaries, guesses, correct) < level:
            lo = mid
        else:
            hi = mid
    return LowerBound("one_run", float(lo), confidence, assumption, inputs)


def one_run_guesses(scores: np.ndarray, included: np.ndarray, k_in: int, k_out: int) -> tuple[int, int]:
    """Guess IN for the ``k_in`` highest scores and OUT for the ``k_out`` lowest: (guesses, correct)."""
    order = np.argsort(scores, kind="stable")
    k_in, k_out = min(k_in, scores.size), min(k_out, scores.size)
    if k_in + k_out > scores.size:
        raise ValueError(f"k_in + k_out = {k_in + k_out} exceeds the {scores.size} canaries")
    top = order[scores.size - k_in :] if k_in else np.array([], int)
    bottom = order[:k_out]
    correct = int(included[top].sum()) + int((~included[bottom]).sum())
    return k_in + k_out, correct


def hypothesis_test_power(
    members: int,
    nonmembers: int,
    delta: float,
    confidence: float = 0.95,
    correction: Literal["split", "bonferroni"] = "split",
    thresholds: int = 100,
) -> float:
    """The largest ε :func:`hypothesis_test_bound` can report on this many records: every record
    classified right (FPR = FNR = 0 observed, so only the Clopper–Pearson limits remain). A certified
    ε above it can be violated without this method ever showing it."""
    return hypothesis_test_bound(
        np.ones(members), np.zeros(nonmembers), delta, confidence, correction, thresholds
    ).epsilon


def one_run_power(canaries: int, guesses: int, delta: float, confidence: float = 0.95) -> float:
    """The largest ε :func:`one_run_bound` can report: all ``guesses`` right."""
    return one_run_bound(canaries, guesses, guesses, delta, confidence).epsilon


def dp_limit_tpr(fpr: np.ndarray, epsilon: float, delta: float) -> np.ndarray:
    """The largest TPR any membership test can have at false-positive rate α = ``fpr`` against an (ε, δ)-DP
    release (Kairouz, Oh & Viswanath 2015, Thm. 2.1; the trade-off function of Dong, Roth & Su 2022, eq. 6):
    TPR(α) ≤ min(1, e^ε·α + δ, 1 − e^{−ε}·(1 − δ − α)); 1 everywhere for ε = ∞ (no certificate)."""
    if math.isinf(epsilon):
        return np.ones_like(fpr)
    e = math.exp(min(epsilon, 700.0))
    return np.asarray(np.minimum.reduce([np.ones_like(fpr), e * fpr + delta, 1 - (1 - delta - fpr) / e]))
