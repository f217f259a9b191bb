"""Accountants are an extension point shaped like the trainer (docs/explanations/design.md): one file registers an
accountant that says which mechanism descriptions it supports, and the certificate asks it about those only.

- the example accountant of the documentation's Design page (``examples/full_batch_gaussian_accountant.py``) is
  shown there verbatim;
- listed under ``plugins:``, it answers for full-batch DP-GD, agreeing with dp_accounting's PLD (an independent
  accountant) and never above the moments closed form, and is not asked about a subsampled or random-count
  mechanism;
- each built-in accountant is asked exactly about the descriptions it supports: a zCDP event only by the zCDP
  ones, a random-count search by the Papernot–Steinke ones and no plain composition.
"""

from __future__ import annotations

import time
from pathlib import Path

import dp_accounting
import pytest
import yaml

from dpml.config import validate
from dpml.accounting.accountants import (
    ACCOUNTANTS,
    Accountant,
    ask_accountants,
    certify,
    epsilon_selection_autodp,
    epsilon_selection_dp_accounting,
    register_accountant,
    tight_epsilon,
)
from dpml.accounting.mechanism import ConcentratedDP, GaussianDP, MechanismDescription, PoissonGaussianSteps, Selection

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "full_batch_gaussian_accountant.py"
NAME = "gaussian.full_batch_exact"
DELTA = 1e-5


def registered_example() -> None:
    validate({**yaml.safe_load((ROOT / "params.yaml").read_text()), "plugins": [str(EXAMPLE)]})
    assert NAME in ACCOUNTANTS


def full_batch(sigma: float, steps: int, relation: str = "add-remove") -> MechanismDescription:
    return MechanismDescription("dpgd", (PoissonGaussianSteps(1.0, sigma, steps),), relation, 1.0, 1000)  # type: ignore[arg-type]


def test_the_design_page_shows_the_example_accountant_verbatim() -> None:
    assert EXAMPLE.read_text().strip() in (ROOT / "docs" / "explanations" / "design.md").read_text()


@pytest.mark.parametrize("relation", ["add-remove", "replace-one"])
def test_the_example_accountant_prices_full_batch_steps_as_an_independent_accountant_does(relation: str) -> None:
    registered_example()
    sigma, steps = 8.0, 50
    answers = {a.name: a for a in ask_accountants(full_batch(sigma, steps, relation), DELTA)}
    assert answers[NAME].error is None and answers[NAME].used_for_certificate
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    scale = 2.0 if relation == "replace-one" else 1.0  # replace-one: twice the sensitivity
    pld.compose(dp_accounting.GaussianDpEvent(sigma / scale), steps)
    independent = pld.get_epsilon(DELTA)
    assert answers[NAME].epsilon == pytest.approx(independent, rel=2e-3)
    assert answers[NAME].epsilon <= answers["moments_accountant.closed_form"].epsilon  # the exact one is tighter
    assert certify(full_batch(sigma, steps, relation), DELTA)["epsilon"] <= answers[NAME].epsilon


def test_the_example_accountant_is_not_asked_about_what_it_does_not_model() -> None:
    registered_example()
    subsampled = MechanismDescription("dpsgd", (PoissonGaussianSteps(0.01, 1.0, 100),), "add-remove", 1.0, 1000)
    searched = MechanismDescription(
        "dpsgd-search",
        (PoissonGaussianSteps(1.0, 8.0, 50),),
        "add-remove",
        1.0,
        1000,
        selection=Selection("poisson", 3.0),
    )
    fixed = MechanismDescription(
        "dpsgd-search",
        (PoissonGaussianSteps(1.0, 8.0, 50),),
        "add-remove",
        1.0,
        1000,
        selection=Selection("fixed", 3.0),
    )
    for mechanism in (subsampled, searched):
        assert NAME not in {a.name for a in ask_accountants(mechanism, DELTA)}
    three = {a.name: a.epsilon for a in ask_accountants(fixed, DELTA)}  # three candidates composed
    assert three[NAME] == pytest.approx({a.name: a.epsilon for a in ask_accountants(full_batch(8.0, 150), DELTA)}[NAME])


def test_a_second_accountant_of_the_same_name_is_refused() -> None:
    with pytest.raises(ValueError, match="an accountant named 'dp_accounting.pld' is already registered"):
        register_accountant(Accountant("dp_accounting.pld", "scipy", lambda m, d: 0.0, lambda m: True))


def test_each_built_in_accountant_is_asked_about_what_it_supports_only() -> None:
    """(Pins the mutants of the support predicates that widen them: an accountant asked about a mechanism it
    does not model answers with an error, recorded in every certificate.)"""
    builtin = {name for name in ACCOUNTANTS if name != NAME}
    subsampled = MechanismDescription("dpsgd", (PoissonGaussianSteps(0.01, 1.0, 100),), "add-remove", 1.0, 1000)
    asked = {a.name for a in ask_accountants(subsampled, DELTA)} & builtin
    assert asked == {"dp_accounting.pld", "prv_accountant.prv", "autodp.rdp", "dp_accounting.rdp"}
    for events in ((ConcentratedDP(0.1),), (ConcentratedDP(0.1), GaussianDP(0.3))):
        zcdp = MechanismDescription("onepass", events, "replace-one", 1.0, 1000)
        asked = {a.name for a in ask_accountants(zcdp, DELTA)} & builtin
        assert asked == {"zcdp.rdp[dp_accounting]", "zcdp.bun_steinke", "autodp.zcdp"}, events
    search = MechanismDescription(
        "dpsgd-search",
        (PoissonGaussianSteps(0.01, 1.0, 100), PoissonGaussianSteps(1.0, 10.0, 1)),
        "add-remove",
        1.0,
        1000,
        selection=Selection("poisson", 3.0),
    )
    answers = {a.name: a for a in ask_accountants(search, DELTA)}
    assert {"papernot_steinke.rdp[dp_accounting]", "papernot_steinke.rdp[autodp]"} <= set(answers)
    assert "moments_accountant.closed_form" not in answers and not set(answers) & {n for n in builtin if "zcdp" in n}
    gdp = MechanismDescription("noisycgd", (GaussianDP(0.5),), "replace-one", 1.0, 1000)
    asked = {a.name for a in ask_accountants(gdp, DELTA)}
    assert "gdp.exact" in asked and "moments_accountant.closed_form" not in asked and not asked & {"autodp.zcdp"}
    assert "moments_accountant.closed_form" in {a.name for a in ask_accountants(full_batch(8.0, 50), DELTA)}


def test_an_answer_that_is_not_a_finite_non_negative_epsilon_is_recorded_as_an_error_and_never_certifies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(Pins the mutants of ``ask_accountants`` that mutation testing found alive: NaN or ∞ accepted when the
    test is an ``and``, ε = 0 refused, the failure's type or message dropped, a negative duration.)"""

    def probe(mechanism: MechanismDescription) -> bool:
        return mechanism.trainer == "probe"

    def failing(mechanism: MechanismDescription, delta: float) -> float:
        raise KeyError("boom")

    values = {"test.nan": float("nan"), "test.inf": float("inf"), "test.negative": -1.0, "test.zero": 0.0}
    for name, value in values.items():
        monkeypatch.setitem(
            ACCOUNTANTS, name, Accountant(name, "scipy", lambda m, d, v=value: v, probe, certifying=name != "test.zero")
        )
    monkeypatch.setitem(ACCOUNTANTS, "test.raises", Accountant("test.raises", "scipy", failing, probe))
    mechanism = MechanismDescription("probe", (PoissonGaussianSteps(1.0, 8.0, 5),), "add-remove", 1.0, 1000)
    start = time.perf_counter()
    answers = {a.name: a for a in ask_accountants(mechanism, DELTA)}
    elapsed = time.perf_counter() - start
    for name in ("test.nan", "test.inf", "test.negative"):
        assert answers[name].epsilon is None, name
        assert answers[name].error is not None and answers[name].error.startswith("returned a non-finite or negative ε")
    assert answers["test.zero"].epsilon == 0.0 and answers["test.zero"].error is None
    assert answers["test.raises"].epsilon is None and answers["test.raises"].error == "KeyError: 'boom'"
    assert all(0 <= a.seconds <= elapsed for a in answers.values())  # each answer's own time, within the call's
    certificate = certify(mechanism, DELTA)
    assert certificate["epsilon"] > 0 and certificate["epsilon"] == min(
        a.epsilon for a in answers.values() if a.used_for_certificate and a.epsilon is not None
    )


def supported_mechanisms() -> dict[str, MechanismDescription]:
    """One description of each kind the built-in accountants price."""
    steps = PoissonGaussianSteps(0.01, 1.0, 100)
    return {
        "DP-SGD, add/remove": MechanismDescription("dpsgd", (steps,), "add-remove", 1.0, 1000),
        "DP-SGD, replace-one": MechanismDescription("dpsgd", (steps,), "replace-one", 1.0, 1000),
        "DP-GD": full_batch(8.0, 50),
        "μ-GDP, replace-one": MechanismDescription("noisycgd", (GaussianDP(0.5),), "replace-one", 1.0, 1000),
        "zCDP and μ-GDP": MechanismDescription(
            "onepass", (ConcentratedDP(0.1), GaussianDP(0.3)), "replace-one", 1.0, 1000
        ),
        "fixed best-of-3": MechanismDescription(
            "dpsgd-search", (steps,), "add-remove", 1.0, 1000, selection=Selection("fixed", 3.0)
        ),
        "Poisson search": MechanismDescription(
            "dpsgd-search", (steps,), "add-remove", 1.0, 1000, selection=Selection("poisson", 3.0)
        ),
        "negative-binomial search": MechanismDescription(
            "dpsgd-search",
            (steps,),
            "add-remove",
            1.0,
            1000,
            selection=Selection("truncated_negative_binomial", 3.0, 1.0),
        ),
        "μ-GDP Poisson search, replace-one": MechanismDescription(
            "noisycgd-search", (GaussianDP(0.5),), "replace-one", 1.0, 1000, selection=Selection("poisson", 3.0)
        ),
    }


@pytest.mark.parametrize("kind", list(supported_mechanisms()))
def test_every_accountant_asked_answers_and_the_independent_ones_agree(kind: str) -> None:
    """Every built-in accountant asked about a description it supports answers with a finite ε, not an error (a
    failure is only recorded, and the certificate is the smallest answer left, so a broken accountant would
    pass unnoticed: pins the mutants of the Papernot–Steinke wrappers, dp_accounting's RDP curve and the
    selection checks that mutation testing found surviving). The two Papernot–Steinke accountants, on
    independent base curves (dp_accounting, autodp), agree within 2 %; the ledger's ε (``tight_epsilon``) is a
    valid bound no tighter than the certificate and within 10 % of it."""
    mechanism = supported_mechanisms()[kind]
    answers = {a.name: a for a in ask_accountants(mechanism, DELTA) if a.name in ACCOUNTANTS and a.name != NAME}
    assert answers
    for name, answer in answers.items():
        assert answer.error is None and answer.epsilon is not None and 0 <= answer.epsilon < 1e3, (name, answer)
    selection = [
        answers[n].epsilon
        for n in ("papernot_steinke.rdp[dp_accounting]", "papernot_steinke.rdp[autodp]")
        if n in answers
    ]
    if len(selection) == 2:
        assert selection[0] == pytest.approx(selection[1], rel=0.02)
        if any(isinstance(e, PoissonGaussianSteps) for e in mechanism.events):  # not one base curve twice (μ-GDP's
            assert selection[0] != selection[1]  # curve αμ²/2 is exact in both, subsampling's is not)
    certified = certify(mechanism, DELTA)["epsilon"]
    assert certified * (1 - 1e-9) <= tight_epsilon(mechanism, DELTA) <= 1.1 * certified


def test_a_random_count_accountant_refuses_what_it_does_not_price() -> None:
    """Asked directly (the registry never does), the Papernot–Steinke accountants refuse a plain composition and a
    subsampled search under replace-one, saying why."""
    plain = supported_mechanisms()["DP-SGD, add/remove"]
    replace_one = MechanismDescription(
        "dpsgd-search",
        (PoissonGaussianSteps(0.01, 1.0, 100),),
        "replace-one",
        1.0,
        1000,
        selection=Selection("poisson", 3.0),
    )
    for accountant in (epsilon_selection_dp_accounting, epsilon_selection_autodp):
        with pytest.raises(NotImplementedError, match="not a random-count selection"):
            accountant(plain, DELTA)
        with pytest.raises(NotImplementedError, match="add/remove only"):
            accountant(replace_one, DELTA)
