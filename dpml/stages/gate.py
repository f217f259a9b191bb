"""Stage gate: the release decision and the privacy report.

Fails when: there is no DP certificate; the certified ε exceeds ``gate.epsilon_budget``; an
empirical ε lower bound (of a method with the power to show it) exceeds the certified ε (then the
trainer or the accountant is wrong); or a conformance check finds that the trainer's noise, clipping
or sampling is not what its certificate prices (:mod:`dpml.audit.conformance`); or the ledger's
lineage has spent more on some person than ``ledger.epsilon_budget`` allows as it stands now (the
budget was lowered after the model trained: the train stage does not depend on the budget, so a changed
budget re-runs this stage, never training). A
KL-private model passes only against ``gate.kl_budget`` and only when no attack beats the Pinsker
bound. When the non-private control shows no attack power the audit is not evidence: that fails the
gate only with ``audit.require_control_power``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dpml import io
from dpml.audit.bounds import hypothesis_test_bound
from dpml.audit.run import gating_lower_bounds
from dpml.formatting import format_epsilon, format_lower_bound
from dpml.ledger.ledger import Ledger
from dpml.report.privacy_report import render
from dpml.stages.audit import strongest
from dpml.stages.layout import Layout
from dpml.stages.spend_outputs import STAMP
from dpml.stages.train import lineage_of, open_ledger
from dpml.report.verdict import (
    ATTACKS,
    CERTIFICATE,
    IMPLEMENTATION,
    PARTS,
    attacks_part,
    certificate_part,
    implementation_part,
    verdict_record,
)

if TYPE_CHECKING:
    from dpml.config import Config


def gate(config: Config) -> dict[str, Any]:
    """Release gate and privacy report.

    Fails when: there is no DP certificate; the certified ε exceeds ``gate.epsilon_budget``; an
    empirical ε lower bound exceeds the certified ε (then the trainer or the accountant is wrong);
    or a conformance check fails; or the ledger's lineage is over ``ledger.epsilon_budget`` as it stands now.
    When the non-private control shows no attack power the audit is not evidence: that fails the gate only with
    ``audit.require_control_power``. Writes the decision, the privacy report and the run's summary metrics.
    """
    layout = Layout(config)
    certificate = io.read_json(layout.certificate)
    summary = io.read_json(layout.audit)
    reasons, passed, violations = [], True, []
    budget_ok = True  # the certificate within its gate budget (KL: everything _gate_kl requires)
    if certificate is None:
        passed = False
        reasons.append("no DP certificate: the model was trained without differential privacy")
    elif certificate.get("kind") == "kl":
        passed, violations = _gate_kl(config, certificate, reasons)
        budget_ok = passed
    else:
        epsilon = certificate["epsilon"]
        if certificate.get("void"):
            reasons.append(certificate["statement"])
        if epsilon > config.gate.epsilon_budget:
            passed = budget_ok = False
            reasons.append(
                f"certified ε = {format_epsilon(epsilon)} exceeds the budget gate.epsilon_budget = "
                f"{config.gate.epsilon_budget:g}"
            )
        else:
            reasons.append(f"certified ε = {format_epsilon(epsilon)} ≤ budget {config.gate.epsilon_budget:g}")
        violations = [b for b in gating_lower_bounds(summary) if b["epsilon"] > epsilon]
        for bound in violations:
            passed = False
            reasons.append(
                f"empirical lower bound ε ≥ {bound['epsilon']:.4g} ({bound['method']}"
                f"{', ' + bound['attack'] if 'attack' in bound else ''}, confidence {bound['confidence']:.4g}) "
                f"exceeds the certified ε = {format_epsilon(epsilon)}: the trainer or the accountant is wrong"
            )
        if not violations:
            reasons.append(
                f"every empirical lower bound ≤ certified ε (largest {format_lower_bound(summary['max_lower_bound'])})"
            )
        passed = _gate_conformance(summary, reasons) and passed
        reasons += power_lines(summary)
    power = summary.get("control_power")
    evidence = power is not None and power >= config.audit.control_min_tpr_at_1pct_fpr
    if power is not None and not evidence:
        message = (
            f"positive control: best TPR at 1% FPR against the non-private model is {power:.4g} < "
            f"{config.audit.control_min_tpr_at_1pct_fpr:g}; the audit has no demonstrated power"
        )
        if config.audit.require_control_power:
            passed = False
        reasons.append(
            message + ("" if config.audit.require_control_power else " (not required by audit.require_control_power)")
        )
    elif power is not None:
        reasons.append(f"positive control: the attacks reach TPR {power:.4g} at 1% FPR against the non-private model")
    ledger = open_ledger(config)
    ledger_ok = _gate_ledger(config, ledger, certificate, reasons)
    passed = ledger_ok and passed
    parts = {
        CERTIFICATE: certificate_part(certificate, config.gate.epsilon_budget, ledger_ok and budget_ok),
        IMPLEMENTATION: implementation_part(summary),
        ATTACKS: attacks_part(summary, len(violations), evidence, config.audit.control_min_tpr_at_1pct_fpr),
    }
    decision = {
        "passed": passed,
        "verdict": verdict_record(passed, parts),
        "reasons": reasons,
        "epsilon_budget": config.gate.epsilon_budget,
        "audit_is_evidence": evidence,
        STAMP: summary.get(STAMP),
    }  # the model judged (its audit's stamp)
    io.write_json(layout.gate, decision)
    data = io.read_json(layout.prepared_meta) | {
        "lower": config.preprocess.lower,
        "upper": config.preprocess.upper,
        "clip_norm": config.preprocess.clip_norm,
        "clip_mode": config.preprocess.clip_mode,
        "features": config.preprocess.features,
        "version": io.read_json(layout.raw_meta)["version"],
        "schema": None if config.data.columns is None else {name: c.type for name, c in config.data.columns.items()},
    }
    train_metrics = io.read_json(layout.train_metrics)
    standing = ledger.summary(lineage_of(config))
    report = render(
        data=data,
        train=train_metrics,
        certificate=certificate,
        audit=summary,
        gate=decision,
        ledger=standing[0] if standing else None,
        budget=config.ledger.epsilon_budget,
    )
    io.write_text(layout.report, report)
    io.write_json(layout.summary, summary_metrics(train_metrics, certificate, summary, decision))
    return decision


def summary_metrics(
    train: dict[str, Any], certificate: dict[str, Any] | None, audit: dict[str, Any], decision: dict[str, Any]
) -> dict[str, Any]:
    """The run's headline numbers (``dvc metrics show``/``diff``, ``dvc exp show``): test accuracy, the
    certified ε and δ (``inf``/``null`` without an (ε, δ) certificate), the largest empirical ε lower
    bound, the strongest attack's AUC and TPR at 1% FPR, the control's TPR, σ, the gate's verdict and the
    word of each of its three parts (:mod:`dpml.report.verdict`).
    Nothing from the ledger: its totals grow with every run, and these must reproduce under ``dvc repro``."""
    attacks = audit["target"]["attacks"]
    epsilon = None if certificate is None else certificate.get("epsilon")
    return {
        "test_accuracy": train["test_accuracy"],
        "train_accuracy": train["train_accuracy"],
        "epsilon": "inf" if epsilon is None or epsilon == float("inf") else epsilon,
        "delta": None if certificate is None else certificate.get("delta"),
        "max_epsilon_lower_bound": audit["max_lower_bound"],
        "attack_auc": strongest(attacks, "auc")[1],
        "attack_tpr_at_1pct_fpr": strongest(attacks, "tpr_at_1pct_fpr")[1],
        "control_tpr_at_1pct_fpr": audit.get("control_power"),
        "noise_multiplier": train.get("noise_multiplier"),
        "gate_passed": decision["passed"],
        **{f"verdict_{name}": decision["verdict"][name]["word"] for name in PARTS},
    }


def _gate_ledger(config: Config, ledger: Ledger, certificate: dict[str, Any] | None, reasons: list[str]) -> bool:
    """The lineage's largest per-person ε (KL for KL-private releases) must be within the ledger's budget
    as it stands now. The train stage refused any run that would have gone over the budget of its day;
    this catches a budget lowered since, which re-runs the gate but not training (nothing more is spent)."""
    if certificate is None:
        return True  # a non-private run charges no person's account: the missing certificate fails it
    lineage = lineage_of(config)
    if certificate.get("kind") == "kl":
        spent, budget, key, unit = ledger.kl_total(lineage), config.ledger.kl_budget, "ledger.kl_budget", "KL"
        if budget is None:
            return True  # the KL part of the gate answers for a KL release without a KL budget
    else:
        spent, budget, key, unit = ledger.total(lineage), config.ledger.epsilon_budget, "ledger.epsilon_budget", "ε"
    if spent > budget:
        reasons.append(
            f"ledger: lineage {lineage!r} has spent {unit} = {format_epsilon(spent)} on some person, over {key} = "
            f"{budget:g} (lowered after this model trained?): not released as champion"
        )
        return False
    reasons.append(
        f"ledger: lineage {lineage!r}'s largest per-person {unit} = {format_epsilon(spent)} ≤ {key} = {budget:g}"
    )
    return True


def _gate_conformance(summary: dict[str, Any], reasons: list[str]) -> bool:
    """The trainer must do what its certificate prices: every conformance check of the audit passes.
    One line per failed check, naming it and its figure."""
    conformance = summary.get("conformance")
    if not conformance or not conformance.get("ran"):
        if conformance:
            reasons.append(f"conformance not checked: {conformance['reason']}")
        return True
    failed = [c for c in conformance["checks"] if not c["passed"]]
    for check in failed:
        reasons.append(f"{check['line']}: the trainer does not do what its certificate prices")
    if not failed:
        reasons.append(
            f"the trainer conforms to its certificate: {', '.join(c['check'] for c in conformance['checks'])} "
            f"checked (false-alarm rate {conformance['false_alarm']:g})"
        )
    return not failed


def power_lines(summary: dict[str, Any]) -> list[str]:
    """The ε lower-bound methods that cannot detect a violation of the certified ε (not counted as evidence)."""
    weak = sorted(name for name, entry in summary.get("power", {}).items() if not entry["gating"])
    if not weak:
        return []
    return [
        f"not counted as evidence ({len(weak)} ε lower-bound method(s) without the power to show a violation "
        f"of the certified ε at their share of the confidence): "
        + ", ".join(f"{name} (power {summary['power'][name]['power']:.3g})" for name in weak)
    ]


def total_variation_violations(
    raw_scores: dict[str, Any], pinsker_delta: float, confidence: float
) -> list[dict[str, Any]]:
    """Attacks whose advantage contradicts a KL certificate.

    KL ≤ κ bounds the total variation between the outputs on neighbours by δ_P = sqrt(κ/2)
    (Pinsker), so every membership test has TPR − FPR ≤ δ_P, i.e. the (0, δ_P)-DP statement. The
    hypothesis-test lower bound at δ = δ_P (Clopper–Pearson limits, threshold chosen on a split) is
    then 0 for a sound certificate; a positive bound means the audit refutes it.
    """
    violations = []
    for attack, scores in raw_scores.items():
        bound = hypothesis_test_bound(
            np.asarray(scores["member"]), np.asarray(scores["nonmember"]), min(pinsker_delta, 1 - 1e-12), confidence
        )
        if bound.epsilon > 0:
            violations.append({"attack": attack, "epsilon_at_pinsker_delta": bound.epsilon})
    return violations


def _gate_kl(config: Config, certificate: dict[str, Any], reasons: list[str]) -> tuple[bool, list[dict[str, Any]]]:
    """A KL-private model (seed 000) passes only against ``gate.kl_budget``, and only when no attack's
    advantage exceeds the Pinsker bound (:func:`total_variation_violations`); it is never called (ε, δ)-DP.
    Returns the verdict and the attacks that beat the Pinsker bound."""
    if certificate.get("void"):
        reasons.append(certificate["statement"])
        return False, []
    kl = certificate["kl"]
    reasons.append(
        f"KL privacy, not (ε, δ)-DP: certified KL = {kl:.4g} (Pinsker: total variation ≤ "
        f"{certificate['pinsker_delta']:.4g}); no finite ε holds, so gate.epsilon_budget cannot be met"
    )
    layout = Layout(config)
    summary = io.read_json(layout.audit)
    violations = total_variation_violations(
        io.read_json(layout.scores)["target"], certificate["pinsker_delta"], summary["per_bound_confidence"]
    )
    for violation in violations:
        reasons.append(
            f"attack {violation['attack']} beats the Pinsker bound: TPR − FPR > {certificate['pinsker_delta']:.4g} "
            "at the audit's confidence — the trainer or the KL certificate is wrong"
        )
    if violations:
        return False, violations
    reasons.append(f"no attack's advantage (TPR − FPR) exceeds the Pinsker bound {certificate['pinsker_delta']:.4g}")
    if config.gate.kl_budget is None:
        reasons.append("gate.kl_budget is not set: KL-private releases are not accepted")
        return False, []
    if kl > config.gate.kl_budget:
        reasons.append(f"certified KL = {kl:.4g} exceeds gate.kl_budget = {config.gate.kl_budget:g}")
        return False, []
    reasons.append(f"certified KL = {kl:.4g} ≤ gate.kl_budget = {config.gate.kl_budget:g}")
    return True, []
