"""The release verdict's three parts (certificate, implementation, attacks): each word decided by its own
evidence, a pass without attack power saying so in its first words, and the same words in every output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dpml.report.verdict import (
    ATTACKS,
    CERTIFICATE,
    IMPLEMENTATION,
    attacks_part,
    certificate_part,
    implementation_part,
    verdict_lines,
    verdict_metrics,
    verdict_record,
    verdict_tags,
)

CERT = {"epsilon": 1.9999967848742883, "delta": 1e-5}


def audit(
    max_lower_bound: float = 0.1,
    control_power: float | None = 0.2,
    checks: list[dict[str, Any]] | None = None,
    conformance_ran: bool = True,
) -> dict[str, Any]:
    checks = (
        [{"check": "noise", "passed": True, "p_value": 0.4}, {"check": "clipping", "passed": True, "p_value": 0.07}]
        if checks is None
        else checks
    )
    conformance = (
        {"ran": True, "checks": checks}
        if conformance_ran
        else {"ran": False, "reason": "trainer 'x' has no white-box probe", "checks": []}
    )
    return {"max_lower_bound": max_lower_bound, "control_power": control_power, "conformance": conformance}


def test_the_certificate_part_is_the_budget_and_the_ledger_together() -> None:
    """Within the gate's budget and the ledger's: *within budget* with ε as its number; over either: *over budget*
    (a ledger over budget is not hidden by a certificate within the gate's); no certificate: *none*."""
    assert certificate_part(CERT, 3.0, ledger_ok=True).word == "within budget"
    assert certificate_part(CERT, 3.0, ledger_ok=True).number == CERT["epsilon"]
    assert (
        "ε = 1.999997 at δ = 1e-05" in certificate_part(CERT, 3.0, ledger_ok=True).detail
    )  # format_epsilon: never rounded up
    assert certificate_part(CERT, 1.5, ledger_ok=True).word == "over budget"
    over_ledger = certificate_part(CERT, 3.0, ledger_ok=False)
    assert over_ledger.word == "over budget" and "ledger" in over_ledger.detail
    assert certificate_part(None, 3.0, ledger_ok=True).word == "none"
    assert certificate_part(CERT | {"void": True}, 3.0, ledger_ok=True).word == "void"


def test_the_implementation_part_is_the_conformance_checks() -> None:
    """Every check passed: *conforms*, with the smallest p-value; one failed: *does not conform*, naming it;
    none ran: *not checked*, with the reason."""
    part = implementation_part(audit())
    assert (part.word, part.number) == ("conforms", 0.07)
    failed = implementation_part(
        audit(
            checks=[
                {"check": "noise", "passed": False, "p_value": 1e-13},
                {"check": "sampling", "passed": True, "p_value": 0.5},
            ]
        )
    )
    assert failed.word == "does not conform" and "noise" in failed.detail and failed.number == 1e-13
    skipped = implementation_part(audit(conformance_ran=False))
    assert skipped.word == "not checked" and "no white-box probe" in skipped.detail


def test_the_attacks_part_tells_evidence_from_silence_and_a_violation_beats_both() -> None:
    """Attacks that cannot tell members from non-members even without DP are *no demonstrated power* (their
    number the control's TPR), not evidence; a bound above the certified ε is a *violation* whatever the power."""
    assert attacks_part(audit(control_power=0.2), 0, has_power=True, min_power=0.01).word == "evidence"
    silent = attacks_part(audit(control_power=0.0057), 0, has_power=False, min_power=0.01)
    assert (silent.word, silent.number) == ("no demonstrated power", 0.0057)
    assert attacks_part(audit(control_power=None), 0, has_power=False, min_power=0.01).word == "no demonstrated power"
    for power in (True, False):
        violation = attacks_part(audit(max_lower_bound=4.2), 2, has_power=power, min_power=0.01)
        assert (violation.word, violation.number) == ("violation", 4.2)


def test_a_pass_without_attack_power_says_so_in_its_first_words() -> None:
    """The issue's case: the gate passes (control power not required) but the attacks show nothing. The title,
    the headline's first words, the tag and every line say it — not a fifth clause."""
    parts = {
        CERTIFICATE: certificate_part(CERT, 3.0, True),
        IMPLEMENTATION: implementation_part(audit()),
        ATTACKS: attacks_part(audit(control_power=0.0057), 0, False, 0.01),
    }
    record = verdict_record(True, parts)
    assert record["title"] == "PASSED without demonstrated attack power"
    assert record["headline"].startswith("PASSED without demonstrated attack power: certificate within budget")
    tags = verdict_tags(record)
    assert tags["verdict.attacks"] == "no demonstrated power" and tags["verdict"] == record["headline"]
    assert verdict_metrics(record) == {
        "verdict.certificate": 1.0,
        "verdict.implementation": 1.0,
        "verdict.attacks": 0.0,
    }
    lines = verdict_lines(record)
    assert [line.split()[0] for line in lines] == ["certificate", "implementation", "attacks"]
    unchecked = dict(parts, implementation=implementation_part(audit(conformance_ran=False)))
    assert verdict_record(True, unchecked)["title"] == (
        "PASSED without demonstrated attack power and without implementation checks"
    )
    evidence = dict(parts, attacks=attacks_part(audit(control_power=0.3), 0, True, 0.01))
    assert verdict_record(True, evidence)["title"] == "PASSED"
    assert verdict_record(False, evidence)["title"] == "FAILED"  # a failure needs no caveat: the parts say why


def test_the_dp_limit_is_the_tradeoff_bound_and_a_dp_mechanism_stays_under_it() -> None:
    """TPR(α) ≤ min(1, e^ε α + δ, 1 − e^{−ε}(1 − δ − α)) (Kairouz et al. 2015): the exact ROC of the Laplace
    mechanism's likelihood-ratio test (ε-DP, δ = 0) touches it and never crosses it; at α = 0 the limit is δ."""
    import numpy as np
    from scipy import stats

    from dpml.audit.bounds import dp_limit_tpr

    epsilon = 1.3
    alpha = np.logspace(-6, 0, 400)
    limit = dp_limit_tpr(alpha, epsilon, 0.0)
    assert np.all(np.diff(limit) >= -1e-15) and limit[-1] == 1.0
    assert dp_limit_tpr(np.array([0.0]), epsilon, 1e-5)[0] == 1e-5
    # Laplace(0, 1/ε) vs Laplace(1, 1/ε): threshold t gives FPR = S0(t), TPR = S1(t)
    t = np.linspace(-20, 20, 4001)
    fpr, tpr = stats.laplace.sf(t, 0, 1 / epsilon), stats.laplace.sf(t, 1, 1 / epsilon)
    assert np.all(tpr <= dp_limit_tpr(fpr, epsilon, 0.0) + 1e-12)
    assert np.max(tpr - dp_limit_tpr(fpr, epsilon, 0.0)) > -1e-9  # tight somewhere
    assert np.any(tpr > dp_limit_tpr(fpr, epsilon * 0.8, 0.0) + 1e-6)  # a smaller ε would be refuted


def test_the_dp_limit_written_for_dvc_plots_is_the_limit_with_its_corner(tmp_path: Path) -> None:
    """``roc_limit.csv`` (drawn by ``dvc plots show`` beside the attack's ROC): the limit at the certified ε and δ
    on a grid that holds the corner where its two lines meet (each line's value there), and TPR = 1 without one."""
    import math

    import numpy as np

    from dpml.stages.audit import write_dp_limit

    epsilon, delta = 2.0, 1e-5
    write_dp_limit(tmp_path / "limit.csv", epsilon, delta)
    lines = (tmp_path / "limit.csv").read_text().splitlines()
    assert lines[0] == "fpr,tpr"
    fpr, tpr = np.array([[float(v) for v in line.split(",")] for line in lines[1:]]).T
    assert fpr[0] == 0.0 and fpr[-1] == 1.0 and np.all(np.diff(fpr) > 0) and np.all(np.diff(tpr) >= 0)
    corner = (1 - delta) / (math.exp(epsilon) + 1)
    at = int(np.argmin(np.abs(fpr - corner)))
    assert abs(fpr[at] - corner) < 1e-6
    assert tpr[at] == pytest.approx(math.exp(epsilon) * corner + delta, abs=2e-6)
    assert tpr[at] == pytest.approx(1 - math.exp(-epsilon) * (1 - delta - corner), abs=2e-6)
    assert tpr[0] == pytest.approx(delta, abs=1e-6) and tpr[-1] == 1.0
    write_dp_limit(tmp_path / "none.csv", None, delta)
    assert {line.split(",")[1] for line in (tmp_path / "none.csv").read_text().splitlines()[1:]} == {"1.000000"}


def test_the_card_roc_is_the_attack_roc_at_every_threshold() -> None:
    """The card draws the attack's own ROC: every threshold's (FPR, TPR), as scikit-learn's roc_curve has it."""
    import numpy as np
    from sklearn.metrics import roc_curve

    from dpml.report.release_card import roc_points

    rng = np.random.default_rng(3)
    member, nonmember = rng.normal(0.4, 1, 300).round(1), rng.normal(0, 1, 500).round(1)  # ties included
    fpr, tpr = roc_points(member, nonmember)
    ref_fpr, ref_tpr, _ = roc_curve(
        np.r_[np.ones(300), np.zeros(500)], np.r_[member, nonmember], drop_intermediate=False
    )
    # our curve walks ties one record at a time; at each distinct threshold it passes through sklearn's points
    ours = set(zip(np.round(fpr, 12), np.round(tpr, 12), strict=True))
    assert all((round(a, 12), round(b, 12)) in ours for a, b in zip(ref_fpr, ref_tpr, strict=True))
    assert fpr[0] == tpr[0] == 0 and fpr[-1] == tpr[-1] == 1


def test_the_card_draws_every_attacks_roc_however_many_attacks_there_are() -> None:
    """Twelve attacks (more than the palette's eight colours): twelve curves and twelve legend entries, no two
    with the same colour and dash."""
    import re

    import numpy as np

    from dpml.report.release_card import _svg_roc

    grid = np.linspace(0.0, 1.0, 11)
    svg = _svg_roc({f"attack-{i}": (grid, grid**0.5) for i in range(12)}, 2.0, 1e-5)
    styles = re.findall(
        r'<path d="[^"]+" fill="none" stroke="([^"]+)" stroke-width="1.5" stroke-dasharray="([^"]*)"', svg
    )
    assert len(styles) == 12 and len(set(styles)) == 12
    assert all(f">attack-{i}<" in svg for i in range(12))


def test_the_card_says_the_guarantee_in_plain_words_and_refuses_nothing_silently() -> None:
    """ε and δ in plain words with the catch rate at 1% FPR from the DP limit; no certificate says so."""
    from dpml.report.release_card import plain_words

    words = plain_words({"epsilon": 2.0, "delta": 1e-5})
    assert "ε = 2 at δ = 1e-05" in words and "7.39 times" in words and "7.39%" in words
    assert plain_words(None).startswith("<strong>No privacy guarantee.")
