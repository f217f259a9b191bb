"""The audit of one trained model: attacks, metrics, ε lower bounds, positive control, one-run audits.

Reads the pipeline's prepared data and the trained model, trains (or reuses) what the attacks
need, and returns a JSON-able summary plus the raw scores. Only indices and scores leave this
module — never the records themselves.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from dpml.audit import attacks as atk
from dpml.accounting.mechanism import MechanismDescription
from dpml.audit.bounds import hypothesis_test_bound, hypothesis_test_power, one_run_power
from dpml.audit.canaries import black_box_audit, black_box_guesses, white_box_audit, white_box_guesses
from dpml.audit.metrics import roc, summarize
from dpml.audit.one_run_fdp import mechanism_curve, one_run_mechanism_power
from dpml.audit.recompute import trainable_size
from dpml.audit.reconstruction import reconstruction_audit
from dpml.audit.references import AuditRecords, is_stored, load_references, train_reference
from dpml.audit.signals import logits_of
from dpml.formatting import format_epsilon
from dpml.config import AuditConfig, Config
from dpml.models import build_model
from dpml.progress import progress_over
from dpml.sections import TrainSettings
from dpml.train.fit import fit, model_spec
from dpml.train.registry import NONPRIVATE, trainer_for


def attack_functions(config: AuditConfig) -> dict[str, atk.Attack]:
    """The configured attacks (:data:`dpml.audit.attacks.ATTACKS`) with the audit section's settings bound."""
    return {name: partial(atk.ATTACKS[name].scores, audit=config) for name in config.attacks}


@dataclass(frozen=True)
class Subject:
    """A model under audit and how it was trained (its reference models are trained the same way)."""

    name: str
    model: nn.Module
    private: bool
    noise_multiplier: float | None
    config: Config


def control_config(config: Config) -> Config:
    """The positive control's configuration: the same model and data, trained without DP with the
    ``audit.control_*`` optimiser settings."""
    common = config.train.model_dump(include=set(TrainSettings.model_fields))
    train = NONPRIVATE.settings.model_validate(
        common
        | {
            "algorithm": NONPRIVATE.name,
            "optimizer": config.audit.control_optimizer,
            "learning_rate": config.audit.control_learning_rate,
            "epochs": config.audit.control_epochs,
            "momentum": 0.0,
        }
    )
    return config.model_copy(update={"train": train})


def subject_config(config: Config, kind: str) -> Config:
    return control_config(config) if kind == "control" else config


def needs_references(config: Config) -> bool:
    return any(atk.ATTACKS[name].needs_references for name in config.audit.attacks)


def ensure_references(
    records: AuditRecords, n_classes: int, data_version: str, subjects: list[Subject]
) -> list[dict[str, Any]]:
    """Train every reference model not already stored (sequentially, with progress when one must be trained;
    Prefect fans these out)."""
    jobs = [(s, j) for s in subjects if needs_references(s.config) for j in range(s.config.audit.references)]
    training = not all(is_stored(s.config, data_version, s.private, s.noise_multiplier, j) for s, j in jobs)
    return [
        train_reference(
            s.config, records, n_classes, data_version, private=s.private, noise_multiplier=s.noise_multiplier, index=j
        )
        for s, j in progress_over(jobs, len(jobs), "audit reference models", "model", show=training)
    ]


def attack_inputs(
    model: nn.Module, records: AuditRecords, references: tuple[np.ndarray, np.ndarray] | None
) -> atk.AttackInputs:
    candidates, population = records.candidates, records.population
    pool_logits = logits_of(model, records.pool_x)
    ref_logits, ref_in = references if references is not None else (None, None)
    return atk.AttackInputs(
        logits=pool_logits[candidates],
        labels=records.pool_y[candidates],
        population_logits=pool_logits[population],
        population_labels=records.pool_y[population],
        reference_logits=None if ref_logits is None else ref_logits[:, candidates],
        reference_in=None if ref_in is None else ref_in[:, candidates],
        population_reference_logits=None if ref_logits is None else ref_logits[:, population],
        population_reference_in=None if ref_in is None else ref_in[:, population],
    )


def audit_subject(
    config: Config,
    subject: Subject,
    records: AuditRecords,
    data_version: str,
    gating_confidence: float,
    plan: dict[str, dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Every configured attack against one model: metrics with CIs and ε lower bounds."""
    references = None
    if needs_references(config):
        references = load_references(
            subject.config, data_version, subject.private, subject.noise_multiplier, config.audit.references
        )
    inputs = attack_inputs(subject.model, records, references)
    m = records.members.size
    results, scores = {}, {}
    for name, attack in attack_functions(config.audit).items():
        score = attack(inputs)
        member, nonmember = score[:m], score[m:]
        summary = summarize(member, nonmember, config.audit.bootstrap, config.audit.seed)
        summary["bounds"] = [
            hypothesis_test_bound(
                member,
                nonmember,
                config.dp.delta,
                gating_confidence,
                config.audit.bound_correction,
                seed=config.audit.seed,
            ).to_dict()
            | (plan or {}).get(f"attack:{name}", {}),
            hypothesis_test_bound(
                member,
                nonmember,
                config.dp.delta,
                gating_confidence,
                config.audit.bound_correction,
                seed=config.audit.seed,
                gdp=True,
            ).to_dict(),
        ]
        results[name] = summary
        scores[name] = (member, nonmember)
    return results, scores


def reconstruction_of(config: Config, model: nn.Module, x_train: np.ndarray) -> dict[str, Any]:
    """Seed 002's reconstruction attack on a random-features model (training inputs from θ alone),
    or why it was skipped: it optimises n candidate inputs against an n×n system at every step."""
    n = int(x_train.shape[0])
    if n > config.audit.reconstruction_max_train:
        return {
            "skipped": f"n = {n} training records > audit.reconstruction_max_train = "
            f"{config.audit.reconstruction_max_train} (the attack's cost grows like n³ per step)"
        }
    result = reconstruction_audit(
        model,
        torch.as_tensor(x_train, dtype=torch.float32),  # type: ignore[arg-type]
        restarts=config.audit.reconstruction_restarts,
        steps=config.audit.reconstruction_steps,
        seed=config.audit.seed,
    )
    result.pop("restart_residuals", None)
    return result


def white_box_applies(config: Config, private: bool) -> bool:
    """The white-box run (conformance checks and the gradient-canary bound) needs a trainer that releases
    every iterate of clipped Poisson steps and accepts the probe: the trainer says (NoisyCGD, a
    final-model-only trainer, does not)."""
    return private and trainer_for(config).audit_with_gradient_canaries(config)


def bound_methods(
    config: Config,
    records: AuditRecords,
    n_params: int | None,
    black_box_pool: int,
    private: bool,
    curve: MechanismDescription | str | None = None,
) -> dict[str, Any]:
    """The gating ε lower-bound methods this audit will run, each with a function of the confidence
    that gives its **power**: the largest bound it can report (every guess right). A one-run method read
    through the certified mechanism's curve (``curve``, ``audit.mode: tight``) has that reading's power."""
    members = records.members.size
    split = config.audit.bound_correction == "split"
    evaluated = (
        (members - members // 2, records.nonmembers.size - records.nonmembers.size // 2)
        if split
        else (members, records.nonmembers.size)
    )
    delta = config.dp.delta
    methods: dict[str, Any] = {
        f"attack:{name}": partial(
            hypothesis_test_power, evaluated[0], evaluated[1], delta, correction=config.audit.bound_correction
        )
        for name in config.audit.attacks
    }
    if config.audit.white_box_canaries > 0 and n_params is not None and white_box_applies(config, private):
        m, guesses = white_box_guesses(config, n_params)
        methods["one_run_white_box"] = one_run_power_of(curve, m, guesses, delta)
    if config.audit.black_box_canaries > 0 and black_box_pool > 0:
        m, guesses = black_box_guesses(config, black_box_pool)
        methods["one_run_black_box"] = one_run_power_of(curve, m, guesses, delta)
    return methods


def one_run_power_of(curve: MechanismDescription | str | None, canaries: int, guesses: int, delta: float) -> Any:
    """The power, as a function of the confidence, of a one-run method: of the reading through ``curve`` when it
    is a mechanism (``audit.mode: tight``), of Steinke et al.'s bound otherwise."""
    if isinstance(curve, MechanismDescription):
        return partial(one_run_mechanism_power, curve, canaries, guesses, delta)
    return partial(one_run_power, canaries, guesses, delta)


def plan_bounds(
    config: Config, methods: dict[str, Any], certified_epsilon: float | None
) -> tuple[dict[str, dict[str, Any]], float]:
    """Which methods gate, and at what confidence each: before training, from their power.

    A method whose power at the confidence it would get is below the certified ε cannot detect a
    violation of that ε: it is reported but not counted, and gets no share of the confidence budget
    α = 1 − ``audit.confidence``. The budget is split equally (Bonferroni) among the largest set that
    can use it: for k = all methods, …, 1, the k most powerful (ties in configuration order) gate
    if each still has power ≥ ε at level α/k. Without a finite certified ε (a non-private target)
    every method gates."""
    alpha = 1.0 - config.audit.confidence
    names = list(methods)
    gating = names
    if certified_epsilon is not None and math.isfinite(certified_epsilon):
        gating = []
        for k in range(len(names), 0, -1):
            powers = {name: methods[name](1.0 - alpha / k) for name in names}
            top = sorted(names, key=lambda name: -powers[name])[:k]
            if all(powers[name] >= certified_epsilon for name in top):
                gating = [name for name in names if name in top]
                break
    confidence = 1.0 - alpha / max(len(gating), 1)
    plan = {}
    for name, power_at in methods.items():
        power = float(power_at(confidence))
        entry: dict[str, Any] = {"power": power, "gating": name in gating}
        if not entry["gating"] and power < (certified_epsilon or math.inf):
            entry["note"] = (
                f"cannot detect a violation of ε = {format_epsilon(certified_epsilon)}: the largest bound it can "
                f"report is {power:.4g}"
            )
        elif not entry["gating"]:
            entry["note"] = (
                "not counted: sharing the confidence budget with it would leave some gating method "
                f"unable to detect a violation of ε = {format_epsilon(certified_epsilon)}"
            )
        plan[name] = entry
    return plan, confidence


def run_audit(
    config: Config,
    target: nn.Module,
    noise_multiplier: float | None,
    records: AuditRecords,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_audit: np.ndarray,
    y_audit: np.ndarray,
    n_classes: int,
    data_version: str,
    *,
    certified_epsilon: float | None = None,
    mechanism: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The whole audit; returns (JSON summary, raw scores, {subject: (ROC curves, scores)} for plots).
    Reference models are reused when stored, trained otherwise.

    ``certified_epsilon`` decides which ε lower-bound methods have the power to gate (:func:`plan_bounds`);
    ``mechanism`` (``mechanism.json``) is what the conformance checks test the trainer against."""
    private = noise_multiplier is not None
    start = time.perf_counter()
    white_box = white_box_applies(config, private)
    n_params = trainable_size(build_model(model_spec(config, x_train.shape[1], n_classes))) if white_box else None
    pop = records.population - records.n_train  # black-box canaries: the population half of the audit part
    curve = mechanism_curve(mechanism) if config.audit.mode == "tight" else None
    plan, confidence = plan_bounds(
        config, bound_methods(config, records, n_params, pop.size, private, curve), certified_epsilon
    )
    subjects = [Subject("target", target, private, noise_multiplier, config)]
    if config.audit.control and private:
        settings = control_config(config)
        control = fit(
            settings, x_train, y_train, n_classes, private=False, noise_multiplier=None, seed=config.train.seed
        ).model
        subjects.append(Subject("control", control, False, None, settings))
    trained = ensure_references(records, n_classes, data_version, subjects)
    gating = sum(entry["gating"] for entry in plan.values())
    summary: dict[str, Any] = {
        "confidence": config.audit.confidence,
        "per_bound_confidence": confidence,
        "gating_bounds": gating,
        "records_per_side": int(records.members.size),
        "population": int(records.population.size),
        "certified_epsilon": certified_epsilon,
        "power": plan,
    }
    raw: dict[str, Any] = {"members": records.members.tolist(), "nonmembers": records.nonmembers.tolist()}
    pictures: dict[str, Any] = {}
    for subject in subjects:
        results, scores = audit_subject(
            config, subject, records, data_version, confidence, plan if subject.name == "target" else None
        )
        summary[subject.name] = {"attacks": results, "private": subject.private}
        raw[subject.name] = {name: {"member": m.tolist(), "nonmember": n.tolist()} for name, (m, n) in scores.items()}
        pictures[subject.name] = ({name: roc(m, n) for name, (m, n) in scores.items()}, scores)
    one_runs = []
    checks = None
    if white_box and (config.audit.conformance or config.audit.white_box_canaries > 0):
        assert noise_multiplier is not None
        checked = time.perf_counter()
        bound, checks = white_box_audit(
            config, x_train, y_train, n_classes, noise_multiplier, confidence, mechanism, curve
        )
        if config.audit.white_box_canaries > 0:
            one_runs.append(bound | plan.get("one_run_white_box", {}))
        summary["white_box_seconds"] = time.perf_counter() - checked
    if config.audit.black_box_canaries > 0 and pop.size > 0:
        # The canary records come from the audit population's population half (never trained on).
        bound = black_box_audit(
            config,
            x_train,
            y_train,
            x_audit[pop],
            y_audit[pop],
            n_classes,
            noise_multiplier,
            private,
            confidence,
            curve,
        )
        one_runs.append(bound | plan.get("one_run_black_box", {}))
    summary["one_run"] = one_runs
    summary["mode"] = config.audit.mode
    summary["conformance"] = conformance_summary(config, private, checks)
    if config.model.kind == "random_features":
        summary["reconstruction"] = {s.name: reconstruction_of(config, s.model, x_train) for s in subjects}
    summary["references"] = {
        "per_subject": config.audit.references if trained else 0,
        "models": len(trained),
        "trained_by_this_stage": sum(not t["reused"] for t in trained),
        "found_stored": sum(t["reused"] for t in trained),
        "training_seconds": float(sum(t["seconds"] for t in trained)),
    }
    summary["max_lower_bound"] = max((b["epsilon"] for b in gating_lower_bounds(summary)), default=0.0)
    summary["control_power"] = control_power(summary)
    summary["seconds"] = time.perf_counter() - start
    return summary, raw, pictures


def conformance_summary(config: Config, private: bool, checks: list[Any] | str | None) -> dict[str, Any]:
    """``audit.json``'s ``conformance``: every check with its statistic, or why none ran (``checks`` may be
    that reason, from :func:`dpml.audit.canaries.white_box_audit`)."""
    if isinstance(checks, str) and config.audit.conformance:
        return {"ran": False, "passed": None, "reason": checks, "checks": []}
    if checks is not None and config.audit.conformance:
        return {
            "ran": True,
            "passed": all(c.passed for c in checks),
            "false_alarm": config.audit.conformance_false_alarm,
            "checks": [c.to_dict() for c in checks],
        }
    if not private:
        why = "the model is not private"
    elif not config.audit.conformance:
        why = "audit.conformance is false"
    else:
        why = (
            f"trainer {config.train.algorithm!r} has no white-box probe: its noise, clipping and sampling "
            "are not checked against its certificate"
        )
    return {"ran": False, "passed": None, "reason": why, "checks": []}


def gating_lower_bounds(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The bounds the release gate compares with the certified ε: hypothesis tests and one-run audits
    of the released configuration. GDP-converted bounds assume a Gaussian trade-off curve that DP-SGD
    does not have, so they are reported but never gate."""
    bounds = [
        b | {"attack": name}
        for name, r in summary["target"]["attacks"].items()
        for b in r["bounds"]
        if b["method"] == "hypothesis_test"
    ]
    return [b for b in bounds + list(summary.get("one_run", [])) if b.get("gating", True)]


def reported_lower_bounds(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Every ε lower bound of the target, gating or not (those without the power to gate are marked)."""
    bounds = [
        b | {"attack": name}
        for name, r in summary["target"]["attacks"].items()
        for b in r["bounds"]
        if b["method"] == "hypothesis_test"
    ]
    return bounds + list(summary.get("one_run", []))


def control_power(summary: dict[str, Any]) -> float | None:
    """The best TPR at 1% FPR any attack reaches against the non-private control."""
    control = summary.get("control")
    if control is None:
        return None
    return max(r["tpr_at_1pct_fpr"] for r in control["attacks"].values())
