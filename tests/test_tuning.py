"""Private hyperparameter search: the Papernot–Steinke bounds, their implementation and dpml tune."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from dpml.config import ConfigError, check_tunable, validate, with_hyperparameters
from dpml.accounting import accountants, tuning
from dpml.accounting.calibrate import calibrate_noise_multiplier
from dpml.ledger.ledger import Ledger
from dpml.accounting.mechanism import MechanismDescription, PoissonGaussianSteps, Selection

DELTA = 1e-5
SELECTIONS = [
    Selection("poisson", 4.0),
    Selection("poisson", 1.0),
    Selection("truncated_negative_binomial", 4.0, 0.0),
    Selection("truncated_negative_binomial", 4.0, 1.0),
    Selection("truncated_negative_binomial", 10.0, 0.5),
]


# --- an exactly computable base mechanism: a discretised Gaussian score --------------------------------


def discrete_pair(shift: float, bins: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Output distributions of Q on neighbouring data: N(0, 1) and N(shift, 1) rounded to a grid.

    The grid spans ±6: every bin keeps a mass ≥ 1e-10, so the exact computations below stay
    accurate in float64."""
    edges = np.linspace(-6, 6 + shift, bins + 1)
    cdf_p, cdf_q = stats.norm.cdf(edges), stats.norm.cdf(edges - shift)
    p, q = np.diff(cdf_p), np.diff(cdf_q)
    p[0] += cdf_p[0]
    p[-1] += 1 - cdf_p[-1]  # noqa: E702  (tails into the end bins)
    q[0] += cdf_q[0]
    q[-1] += 1 - cdf_q[-1]  # noqa: E702
    return p, q


def renyi(p: np.ndarray, q: np.ndarray, order: float) -> float:
    from scipy.special import logsumexp

    assert p.min() > 0 and q.min() > 0
    return float(logsumexp(order * np.log(p) + (1 - order) * np.log(q)) / (order - 1))


def exact_rdp(p: np.ndarray, q: np.ndarray, order: float) -> float:
    return max(renyi(p, q, order), renyi(q, p, order))


def exact_delta(p: np.ndarray, q: np.ndarray, epsilon: float) -> float:
    return max(np.maximum(p - math.exp(epsilon) * q, 0).sum(), np.maximum(q - math.exp(epsilon) * p, 0).sum())


def pgf(selection: Selection, t: np.ndarray) -> np.ndarray:
    """E[t^K] of the number of candidates."""
    if selection.distribution == "poisson":
        return np.exp(selection.mean * (t - 1))
    gamma = tuning.truncated_negative_binomial_gamma(selection.shape, selection.mean)
    if selection.shape == 0:
        return np.log1p(-(1 - gamma) * t) / math.log(gamma)
    eta = selection.shape
    return ((1 - (1 - gamma) * t) ** (-eta) - 1) / (gamma ** (-eta) - 1)


def best_of_k(p: np.ndarray, selection: Selection) -> np.ndarray:
    """Exact distribution of the best of K draws (largest bin), with ⊥ (K = 0) as a last outcome."""
    cdf = np.concatenate([[0.0], np.cumsum(p)])
    cdf[-1] = 1.0
    g = pgf(selection, cdf)
    out = np.diff(g)  # P[max = y] = G(F(y)) − G(F(y−1))
    return np.append(out, g[0]) if g[0] > 0 else out  # P[⊥] = G(0) = P[K = 0] (Poisson only)


@pytest.mark.parametrize("selection", SELECTIONS, ids=lambda s: s.describe())
@pytest.mark.parametrize("shift", [0.3, 1.0])
def test_bound_holds_for_the_exact_best_of_k_distribution(selection: Selection, shift: float) -> None:
    p, q = discrete_pair(shift)
    orders = [o for o in tuning.ORDERS if o <= 32]
    base = [exact_rdp(p, q, o) for o in orders]
    bound = tuning.selection_rdp(orders, base, selection, delta_hat=np.vectorize(lambda e: exact_delta(p, q, e)))
    a, b = best_of_k(p, selection), best_of_k(q, selection)
    assert a.sum() == pytest.approx(1.0) and b.sum() == pytest.approx(1.0)
    for order, upper in zip(orders, bound, strict=True):
        truth = exact_rdp(a, b, order)
        assert truth <= upper * (1 + 1e-9) + 1e-12, (order, truth, upper)
    # …and not vacuous: at the orders that matter for δ = 1e-5 the bound is within a small factor.
    middle = [i for i, o in enumerate(orders) if 4 <= o <= 16]
    assert max(bound[i] / exact_rdp(a, b, orders[i]) for i in middle) < 40


@pytest.mark.parametrize("selection", SELECTIONS, ids=lambda s: s.describe())
def test_our_theorem_code_matches_dp_accountings_independent_implementation(selection: Selection) -> None:
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    p, q = discrete_pair(1.0)
    orders = [o for o in tuning.ORDERS if o <= 64]
    base = np.array([exact_rdp(p, q, o) for o in orders])
    ours = tuning.selection_rdp(orders, base, selection, delta_hat=np.vectorize(lambda e: exact_delta(p, q, e)))
    shape = math.inf if selection.distribution == "poisson" else selection.shape
    theirs = rdp._compute_rdp_repeat_and_select(orders, base, selection.mean, shape)
    if selection.distribution == "poisson":
        # Same theorem; our δ̂ is the exact profile, theirs is derived from RDP (looser): ours ≤ theirs.
        assert np.all(ours <= theirs * (1 + 1e-9))
        assert np.all(ours[1:] >= base[1:])
    else:
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def dpsgd(selection: Selection | None, sigma: float = 1.2, steps: int = 300) -> MechanismDescription:
    events = (PoissonGaussianSteps(0.02, sigma, steps), PoissonGaussianSteps(1.0, 5.0, 1))
    return MechanismDescription("dpsgd-search", events, "add-remove", 1.0, 5000, selection=selection)


@pytest.mark.parametrize("selection", [s for s in SELECTIONS if s.mean > 1], ids=lambda s: s.describe())
def test_certificate_of_a_random_search(selection: Selection) -> None:
    certificate = accountants.certify(dpsgd(selection), DELTA)
    answers = {a["name"]: a for a in certificate["answers"]}
    assert certificate["accountant"].startswith("papernot_steinke")
    assert "hyperparameter search" in certificate["statement"]
    assert not {"dp_accounting.pld", "prv_accountant.prv", "autodp.rdp", "gdp.exact"} & set(
        answers
    )  # compositions only
    assert all(a["error"] is None for a in answers.values())
    # dp_accounting's own RepeatAndSelectDpEvent: never tighter than ours by more than its grid.
    cross = answers["dp_accounting.rdp"]["epsilon"]
    assert certificate["epsilon"] <= cross * 1.005
    if selection.distribution != "poisson":
        assert certificate["epsilon"] == pytest.approx(cross, rel=0.01)
    # A search costs more than one candidate.
    assert accountants.epsilon_pld(dpsgd(None), DELTA) < certificate["epsilon"]


def test_fixed_count_search_is_the_composition_of_its_candidates() -> None:
    fixed = accountants.certify(dpsgd(Selection("fixed", 3)), DELTA)
    composed = MechanismDescription("x", dpsgd(None).events * 3, "add-remove", 1.0, 5000)
    assert fixed["accountant"] in ("dp_accounting.pld", "prv_accountant.prv")
    assert fixed["epsilon"] == pytest.approx(accountants.epsilon_pld(composed, DELTA), rel=1e-9) or fixed[
        "epsilon"
    ] <= accountants.epsilon_pld(composed, DELTA)


@pytest.mark.parametrize("selection", SELECTIONS, ids=lambda s: s.describe())
def test_number_of_candidates_has_the_configured_distribution(selection: Selection) -> None:
    rng = np.random.default_rng(0)
    draws = np.array([tuning.sample_count(selection, rng) for _ in range(20000)])
    if selection.distribution != "poisson":
        assert draws.min() >= 1
    assert draws.mean() == pytest.approx(selection.mean, rel=0.04)


def test_selection_and_tuning_config_reject_bad_values() -> None:
    for bad in [
        dict(distribution="poisson", mean=0.5),
        dict(distribution="fixed", mean=2.5),
        dict(distribution="truncated_negative_binomial", mean=1.0, shape=1.0),
        dict(distribution="truncated_negative_binomial", mean=3.0, shape=-0.5),
    ]:
        with pytest.raises(ValueError):
            Selection(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tune.space key 'train.epochs': not tunable"):
        validate({"tune": {"space": {"train.epochs": [1, 2]}}, "dp": {"target_epsilon": 1}})
    with pytest.raises(ConfigError, match="non-empty list"):
        validate({"tune": {"space": {"train.learning_rate": []}}, "dp": {"target_epsilon": 1}})
    config = validate(
        {
            "dp": {"target_epsilon": 1, "neighbouring": "replace-one"},
            "tune": {"space": {"train.learning_rate": [0.1, -2.0]}},
        }
    )
    with pytest.raises(ConfigError) as error:
        check_tunable(config)
    assert "add-remove only" in str(error.value) and "value -2.0" in str(error.value)
    fixed = validate({"dp": {"target_epsilon": 1, "neighbouring": "replace-one"}, "tune": {"distribution": "fixed"}})
    check_tunable(fixed)  # a fixed count is a composition: both relations
    assert with_hyperparameters(fixed, {"model.hidden": [8, 4]}).model.hidden == [8, 4]


def test_calibration_for_a_search_lands_on_the_safe_side() -> None:
    selection = Selection("truncated_negative_binomial", 3.0, 1.0)
    extra = (PoissonGaussianSteps(1.0, 5.0, 1),)
    sigma = calibrate_noise_multiplier(2.0, 0.05, 200, DELTA, extra=extra, selection=selection)

    def eps(s: float) -> float:
        return accountants.certify(
            MechanismDescription(
                "x", (PoissonGaussianSteps(0.05, s, 200), *extra), "add-remove", 1.0, 1000, selection=selection
            ),
            DELTA,
        )["epsilon"]

    assert eps(sigma) <= 2.0
    assert eps(sigma * 0.98) > 2.0 * 0.995  # and tight: 2% less noise is (about) over the target


def test_ledger_composes_a_search_with_plain_releases(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.db", DELTA)
    search, plain = dpsgd(Selection("poisson", 3.0)), dpsgd(None)
    first = ledger.reserve("v1", search, "search", budget=100)
    ledger.reserve("v1", plain, "release", budget=100)
    total = ledger.total("v1")
    alone = accountants.certify(search, DELTA)["epsilon"]
    assert first.epsilon_alone == pytest.approx(alone, rel=1e-6)
    assert alone < total < alone + accountants.certify(plain, DELTA)["epsilon"]
    with pytest.raises(Exception, match="over the budget"):
        ledger.reserve("v1", search, "one more", budget=total + 0.1)
    assert len(ledger.spends("v1")) == 2
