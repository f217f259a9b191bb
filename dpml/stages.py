"""The pipeline stages as plain functions over files.

ingest → split → preprocess → train → certify → audit → gate → register

``dpml tune`` replaces ``train`` by :func:`tune` (a private hyperparameter search); it writes the
same files plus ``artifacts/tune/``, and the later stages apply the released candidate's
hyperparameters (:func:`release_config`).

Each stage reads the previous stages' files and writes its own (atomically) under
``paths.data`` / ``paths.artifacts``. The DVC stages (``dpml stage NAME``) and the Prefect tasks
call exactly these functions, so both drivers produce the same files.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpml import io
from dpml.audit.plots import plot_histograms, plot_roc
from dpml.audit.references import AuditRecords, audit_records, train_reference
from dpml.audit.run import gating_lower_bounds, needs_references, run_audit, subject_config
from dpml.config import Config, TrackingConfig, check_tunable, validate, with_hyperparameters
from dpml.data.preprocess import preprocess as preprocess_records
from dpml.data.sources import content_hash, load_source
from dpml.data.split import split_indices
from dpml.models import build_model, spec_from_dict
from dpml.models.mlp import pick_device
from dpml.audit.robustness import certified_accuracy
from dpml.train.clipless import clipless_mechanism, gradient_noise_for
from dpml.train.fit import (fit, loss_clipping_of, model_gradient_bounds, model_spec, noisycgd_settings,
                            noisygd_mechanism, onepass_mechanism)
from dpml.train.noisycgd import noisycgd_mechanism
from dpml.privacy.accountants import certify as certify_mechanism
from dpml.privacy.calibrate import calibrate_noise_multiplier
from dpml.privacy.mechanism import MechanismDescription
from dpml.report.privacy_report import render
from dpml.privacy.ledger import Ledger
from dpml.train.dpsgd import dpsgd_mechanism, number_of_steps
from dpml.train.search import (calibrate_base_mu, check_noisycgd_candidates, run_search, score_event, search_mechanism,
                               selection_of, validation_rows)

PARTS = ("train", "test", "audit")


class Layout:
    """Every file a run reads or writes, in one place."""

    def __init__(self, config: Config) -> None:
        data, art = Path(config.paths.data), Path(config.paths.artifacts)
        self.raw = data / "raw" / "records.npz"
        self.raw_meta = data / "raw" / "meta.json"
        self.split = data / "split" / "indices.npz"
        self.prepared = {part: data / "prepared" / f"{part}.npz" for part in PARTS}
        self.prepared_meta = data / "prepared" / "meta.json"
        self.model = art / "train" / "model.pt"
        self.model_spec = art / "train" / "model.json"
        self.mechanism = art / "train" / "mechanism.json"
        self.spend = art / "train" / "spend.json"
        self.train_metrics = art / "train" / "metrics.json"
        self.certificate = art / "certify" / "certificate.json"
        self.certify_metrics = art / "certify" / "metrics.json"
        self.audit = art / "audit" / "audit.json"
        self.audit_metrics = art / "audit" / "metrics.json"
        self.roc_png = art / "audit" / "roc.png"
        self.roc_csv = art / "audit" / "roc.csv"
        self.roc_control_png = art / "audit" / "roc_control.png"
        self.histograms_png = art / "audit" / "histograms.png"
        self.scores = art / "audit" / "scores.json"
        self.gate = art / "gate" / "gate.json"
        self.report = art / "gate" / "privacy_report.md"
        self.release = art / "register" / "release.json"
        self.tuning = art / "tune" / "tuning.json"
        self.validation = art / "tune" / "validation.npz"


def ingest(config: Config) -> dict[str, Any]:
    """Load the configured source, check the records, store them with their content hash."""
    layout = Layout(config)
    raw = load_source(config.data)
    arrays = {"x": raw.x, "y": raw.y}
    if raw.x_test is not None and raw.y_test is not None:
        arrays |= {"x_test": raw.x_test, "y_test": raw.y_test}
    version = content_hash(*arrays.values())
    io.write_npz(layout.raw, **arrays)
    meta = {
        "origin": raw.origin, "classes": raw.classes, "feature_names": raw.feature_names,
        "version": version, "n_records": int(raw.x.shape[0]), "n_features": int(raw.x.shape[1]),
        "predefined_test": raw.x_test is not None,
    }
    io.write_json(layout.raw_meta, meta)
    return meta


def split(config: Config) -> dict[str, Any]:
    """Seeded stratified split; stores index arrays (the records stay in ``raw``)."""
    from dpml.data.sources import RawData

    layout = Layout(config)
    arrays, meta = io.read_npz(layout.raw), io.read_json(layout.raw_meta)
    raw = RawData(arrays["x"], arrays["y"], meta["classes"], meta["feature_names"], meta["origin"],
                  arrays.get("x_test"), arrays.get("y_test"))
    parts = split_indices(raw, config.split)
    io.write_npz(layout.split, train=parts.train, test=parts.test, audit=parts.audit,
                 test_is_predefined=np.array(parts.test_is_predefined))
    return {"n_train": int(parts.train.size), "n_test": int(parts.test.size), "n_audit": int(parts.audit.size)}


def preprocess(config: Config) -> dict[str, Any]:
    """Public scaling, optional ScatterNet features and input norm clipping of every part."""
    layout = Layout(config)
    arrays, meta, index = io.read_npz(layout.raw), io.read_json(layout.raw_meta), io.read_npz(layout.split)
    sources = {"train": ("x", "y"), "audit": ("x", "y"),
               "test": ("x_test", "y_test") if bool(index["test_is_predefined"]) else ("x", "y")}
    summary: dict[str, Any] = {"data_version": meta["version"], "origin": meta["origin"],
                               "classes": meta["classes"], "n_features": meta["n_features"]}
    for part in PARTS:
        xs, ys = sources[part]
        rows = index[part]
        prepared = preprocess_records(arrays[xs][rows], config.preprocess)
        io.write_npz(layout.prepared[part], x=prepared.x.astype(np.float32), y=arrays[ys][rows].astype(np.int64))
        summary[f"n_{part}"] = int(rows.size)
        summary[f"clipped_fraction_{part}"] = prepared.clipped_fraction
        summary["n_features"] = int(prepared.x.shape[1])  # the model's inputs (after any feature extractor)
    summary["features"] = config.preprocess.features
    io.write_json(layout.prepared_meta, summary)
    return summary


def _load_part(layout: Layout, part: str) -> tuple[np.ndarray, np.ndarray]:
    arrays = io.read_npz(layout.prepared[part])
    return arrays["x"], arrays["y"]


def accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    from dpml.audit.signals import logits_of

    return float((logits_of(model, x).argmax(1) == y).mean())


def check_delta(config: Config, n: int) -> None:
    """Refuse δ ≥ 1/n: such a δ allows mechanisms that publish a whole record ("name and shame")."""
    if config.dp.delta >= 1.0 / n:
        message = (f"dp.delta = {config.dp.delta:g} is ≥ 1/n = {1.0 / n:.3g} for n = {n} training records: a δ that "
                   "large permits releasing some record outright; use δ ≪ 1/n")
        if not config.dp.allow_delta_above_inverse_n:
            raise ValueError(message + " (or set dp.allow_delta_above_inverse_n: true to proceed anyway)")
        warnings.warn(message, stacklevel=2)


def planned_mechanism(config: Config, sigma: float | None, n: int, in_features: int = 0,
                      n_classes: int = 0) -> MechanismDescription:
    """What the configured private trainer will do on n records: known before it runs (the ledger needs it)."""
    if config.train.algorithm == "noisycgd":
        return noisycgd_mechanism(noisycgd_settings(config, n), n)
    if config.train.algorithm == "noisygd":
        return noisygd_mechanism(config, n, in_features, n_classes)
    if config.train.algorithm == "onepass":
        return onepass_mechanism(config, n, in_features)
    if config.train.algorithm == "clipless":
        assert sigma is not None
        return clipless_mechanism(model_gradient_bounds(config, in_features, n_classes), config.train.sample_rate,
                                  sigma, config.train.clipless_noise, config.train.epochs, config.dp.neighbouring, n,
                                  loss_clipping_of(config))
    assert sigma is not None
    return dpsgd_mechanism(config.train.sample_rate, sigma, config.train.epochs, config.dp.neighbouring,
                           config.dp.clip_norm, n)


def resolve_noise_multiplier(config: Config) -> float:
    """σ from the config, or calibrated so the certified ε meets ``dp.target_epsilon`` (DP-SGD).

    NoisyCGD always has σ in the config: its ``dp.target_epsilon`` calibrates λ instead.
    """
    if config.dp.noise_multiplier is not None:
        return config.dp.noise_multiplier
    assert config.dp.target_epsilon is not None
    steps = number_of_steps(config.train.epochs, config.train.sample_rate)
    sigma = calibrate_noise_multiplier(config.dp.target_epsilon, config.train.sample_rate, steps,
                                       config.dp.delta, config.dp.neighbouring)
    # Clipless: the quantile's count shares the step (σ_eff = (σ⁻² + σ_b⁻²)^(−1/2)), and per-layer noise σ acts
    # like one Gaussian with σ/√D: calibrate the combination, then undo both.
    clipping = loss_clipping_of(config) if config.train.algorithm == "clipless" else None
    sigma = gradient_noise_for(sigma, None if clipping is None else clipping.count_noise)
    return sigma * math.sqrt(clipless_layer_count(config)) if _per_layer_noise(config) else sigma


def clipless_layer_count(config: Config) -> int:
    """D: the parameterised layers of a lipschitz model (convolutions, hidden layers and the output layer)."""
    return len(config.model.conv) + len(config.model.hidden) + 1


def _per_layer_noise(config: Config) -> bool:
    return config.train.algorithm == "clipless" and config.train.clipless_noise == "per_layer"


def train(config: Config, progress: bool = False) -> dict[str, Any]:
    """Record the planned spend in the ledger, then train; save model, spec, mechanism.

    The spend is committed before any training starts and stays counted whatever happens next;
    a run whose composed total would exceed ``ledger.epsilon_budget`` is refused untrained.
    """
    layout = Layout(config)
    _forget_search(layout)
    meta = io.read_json(layout.prepared_meta)
    x_np, y_np = _load_part(layout, "train")
    private = config.train.algorithm != "nonprivate"
    check_delta(config, int(x_np.shape[0]))
    sigma = resolve_noise_multiplier(config) if private and config.train.algorithm not in ("noisygd", "onepass") else None
    planned = (planned_mechanism(config, sigma, int(x_np.shape[0]), int(x_np.shape[1]), len(meta["classes"]))
               if private else None)
    ledger = Ledger(config.ledger.path, config.ledger.delta)
    spend = ledger.reserve(meta["data_version"], planned, f"{config.train.algorithm} model ({config.data.source})",
                           config.ledger.epsilon_budget, kl_budget=config.ledger.kl_budget)
    io.write_json(layout.spend, {"spend_id": spend.id, "ledger": str(Path(config.ledger.path).resolve()),
                                 "epsilon_alone": spend.epsilon_alone})
    try:
        held_out = _load_part(layout, "audit") if config.train.algorithm == "noisygd" else None  # KL-estimate probes
        result = fit(config, x_np, y_np, len(meta["classes"]), private=private, noise_multiplier=sigma,
                     seed=config.train.seed, progress=progress, held_out=held_out)
        if result.mechanism != planned:
            raise RuntimeError("the trainer's mechanism differs from the one recorded in the ledger")
    except BaseException as error:
        ledger.record_event(spend.id, "failed", {"error": f"{type(error).__name__}: {error}"})
        raise
    ledger.record_event(spend.id, "trained", {"steps": result.history.get("steps")})
    return _save_trained(config, layout, result.model, result.mechanism, x_np, y_np, result.history)


def _save_trained(config: Config, layout: Layout, model: torch.nn.Module, mechanism: MechanismDescription | None,
                  x_fit: np.ndarray, y_fit: np.ndarray, history: dict[str, Any],
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the released model, its spec, its mechanism and the train metrics."""
    n_classes = len(io.read_json(layout.prepared_meta)["classes"])
    with io.atomic_path(layout.model) as temp:
        torch.save(model.state_dict(), temp)
    io.write_json(layout.model_spec, model_spec(config, int(x_fit.shape[1]), n_classes).to_dict())
    io.write_json(layout.mechanism, mechanism.to_dict() if mechanism else None)
    x_test, y_test = _load_part(layout, "test")
    metrics = {
        "test_accuracy": accuracy(model, x_test, y_test),
        "train_accuracy": accuracy(model, x_fit, y_fit),
        "device": str(pick_device(config.train.device)),
        # Wall-clock time is left out: metrics must reproduce exactly under `dvc repro`.
        **{f"train_{k}": v for k, v in history.items() if k != "seconds"},
        **(extra or {}),
    }
    if mechanism is not None:
        metrics["noise_multiplier"] = released_noise_multiplier(config, mechanism.to_dict())
    if config.model.kind == "lipschitz":  # seed 004 App. A.3: certified robustness comes with the Lipschitz model
        robust = certified_accuracy(model, x_test, y_test)  # type: ignore[arg-type]
        metrics |= {f"robust_{k}": v for k, v in robust.items() if k != "records"}
    io.write_json(layout.train_metrics, metrics)
    return metrics


def released_noise_multiplier(config: Config, mechanism: dict[str, Any]) -> float:
    """σ of the released model's trainer: from its DP-SGD or noisy-GD event, or NoisyCGD's configured σ."""
    if mechanism["trainer"].startswith("noisycgd"):
        assert config.dp.noise_multiplier is not None
        return float(config.dp.noise_multiplier)
    if mechanism["events"][0].get("kind") == "noisy_gd":
        return float(mechanism["events"][0]["sigma"])
    if mechanism["events"][0].get("kind") == "zcdp":
        return 1.0 / math.sqrt(2 * float(mechanism["events"][0]["rho"]))  # the Gaussian with the same zCDP (σ = 1/ρ_s)
    sigma = float(mechanism["events"][0]["noise_multiplier"])
    if mechanism["trainer"] == "clipless" and (clipping := loss_clipping_of(config)) is not None:
        sigma = gradient_noise_for(sigma, clipping.count_noise)  # the event's σ includes the quantile's count
    return sigma * math.sqrt(clipless_layer_count(config)) if _per_layer_noise(config) else sigma


def _forget_search(layout: Layout) -> None:
    """A plain training run releases no search: drop a previous ``dpml tune``'s files."""
    for path in (layout.tuning, layout.validation):
        path.unlink(missing_ok=True)


def release_config(config: Config) -> Config:
    """The configuration of the released model: ``config``, plus the search's choice after ``dpml tune``,
    plus NoisyCGD's calibrated λ (so the audit's reference models train with the released model's λ,
    as DP-SGD's train with its σ)."""
    layout = Layout(config)
    if layout.tuning.exists():
        config = with_hyperparameters(config, io.read_json(layout.tuning)["chosen"])
    if config.train.algorithm == "noisycgd" and config.noisycgd.l2 is None and layout.train_metrics.exists():
        l2 = io.read_json(layout.train_metrics)["train_l2"]
        config = with_hyperparameters(config, {"noisycgd.l2": l2, "dp.target_epsilon": None})
    return config


def tune(config: Config, progress: bool = False) -> dict[str, Any]:
    """Private hyperparameter search in place of :func:`train` (see :mod:`dpml.train.search`).

    The search's whole cost (Papernot & Steinke for a random number of candidates, composition
    for a fixed one) is recorded in the ledger before the first candidate trains; σ is calibrated
    so that this whole cost meets ``dp.target_epsilon``.
    """
    check_tunable(config)
    layout = Layout(config)
    _forget_search(layout)
    meta = io.read_json(layout.prepared_meta)
    x_np, y_np = _load_part(layout, "train")
    n = int(x_np.shape[0])
    check_delta(config, n)
    rows = validation_rows(n, config)
    fit_mask = np.ones(n, dtype=bool)
    fit_mask[rows] = False
    x_fit, y_fit = x_np[fit_mask], y_np[fit_mask]
    sigma = config.dp.noise_multiplier
    base_mu = None
    if config.train.algorithm == "noisycgd":  # σ fixed; the target fixes every candidate's μ (and so its λ)
        base_mu = calibrate_base_mu(config, int(x_fit.shape[0]), n)
        check_noisycgd_candidates(config, base_mu, int(x_fit.shape[0]))
    elif sigma is None:
        assert config.dp.target_epsilon is not None
        steps = number_of_steps(config.train.epochs, config.train.sample_rate)
        sigma = calibrate_noise_multiplier(config.dp.target_epsilon, config.train.sample_rate, steps, config.dp.delta,
                                           config.dp.neighbouring, extra=(score_event(config),),
                                           selection=selection_of(config))
    assert sigma is not None
    planned = search_mechanism(config, sigma, int(x_fit.shape[0]), n, base_mu=base_mu)
    ledger = Ledger(config.ledger.path, config.ledger.delta)
    spend = ledger.reserve(meta["data_version"], planned,
                           f"dpml tune: {planned.selection.describe() if planned.selection else ''} ({config.data.source})",
                           config.ledger.epsilon_budget, kl_budget=config.ledger.kl_budget)
    io.write_json(layout.spend, {"spend_id": spend.id, "ledger": str(Path(config.ledger.path).resolve()),
                                 "epsilon_alone": spend.epsilon_alone})
    try:
        best = run_search(config, x_fit, y_fit, x_np[rows], y_np[rows], len(meta["classes"]), sigma, progress,
                          base_mu=base_mu)
        if best is None:
            raise RuntimeError("the random number of candidates came out K = 0: nothing to release "
                               "(the search's privacy cost stays recorded in the ledger)")
    except BaseException as error:
        ledger.record_event(spend.id, "failed", {"error": f"{type(error).__name__}: {error}"})
        raise
    ledger.record_event(spend.id, "trained", {"chosen": best.chosen})
    io.write_npz(layout.validation, rows=rows)
    io.write_json(layout.tuning, {"chosen": best.chosen, "noisy_validation_accuracy": best.noisy_validation_accuracy,
                                  "selection": planned.selection.describe() if planned.selection else None,
                                  "space": config.tune.space, "validation_records": int(rows.size)})
    chosen_config = with_hyperparameters(config, best.chosen)
    extra = {"noisy_validation_accuracy": best.noisy_validation_accuracy,
             **{f"chosen.{k}": v for k, v in best.chosen.items()}}
    return _save_trained(chosen_config, layout, best.model, planned, x_fit, y_fit, best.history, extra)


def load_model(layout: Layout) -> torch.nn.Module:
    model = build_model(spec_from_dict(io.read_json(layout.model_spec)))
    model.load_state_dict(torch.load(layout.model, weights_only=True))
    return model.eval()


def certify(config: Config) -> dict[str, Any]:
    """Price the trainer's mechanism with every accountant; certify the smallest valid ε."""
    layout = Layout(config)
    payload = io.read_json(layout.mechanism)
    if payload is None:
        certificate = None
        metrics: dict[str, Any] = {"epsilon": float("inf"), "delta": config.dp.delta, "private": False}
    else:
        certificate = certify_mechanism(MechanismDescription.from_dict(payload), config.dp.delta)
        certificate = _void_if_unsound(certificate, io.read_json(layout.train_metrics))
        metrics = {"epsilon": certificate["epsilon"], "delta": certificate["delta"], "private": True}
    io.write_json(layout.certificate, certificate)
    io.write_json(layout.certify_metrics, {k: (v if v != float("inf") else "inf") for k, v in metrics.items()})
    return {"certificate": certificate, **metrics}


def _void_if_unsound(certificate: dict[str, Any], train_metrics: dict[str, Any]) -> dict[str, Any]:
    """Clipless DP-SGD's sensitivity is an analytic bound: if the trainer's soundness check found it
    violated (a per-example gradient above its bound, or a layer with ‖W‖₂ > 1), there is no guarantee."""
    if train_metrics.get("train_soundness_passed", True):
        return certificate
    reason = (f"no guarantee: the soundness check found the gradient bounds violated "
              f"({train_metrics.get('train_soundness_violations')} per-example violations, worst ratio "
              f"{train_metrics.get('train_soundness_max_ratio', float('nan')):.4g}, largest spectral norm "
              f"{train_metrics.get('train_spectral_norm_max', float('nan')):.6g}); the accountants' answers assumed them")
    return certificate | {"epsilon": float("inf"), "statement": reason, "void": True}


@dataclass(frozen=True)
class AuditContext:
    records: AuditRecords
    n_classes: int
    data_version: str
    noise_multiplier: float | None
    train: tuple[np.ndarray, np.ndarray]
    audit: tuple[np.ndarray, np.ndarray]


def audit_context(config: Config) -> AuditContext:
    """Everything the audit needs besides the model: records, σ of the target, data version."""
    layout = Layout(config)
    x_train, y_train = _load_part(layout, "train")
    if layout.validation.exists():  # after dpml tune the model never trained on the validation rows
        keep = np.ones(y_train.size, dtype=bool)
        keep[io.read_npz(layout.validation)["rows"]] = False
        x_train, y_train = x_train[keep], y_train[keep]
    x_audit, y_audit = _load_part(layout, "audit")
    mechanism = io.read_json(layout.mechanism) if layout.mechanism.exists() else None
    sigma = None if mechanism is None else released_noise_multiplier(config, mechanism)
    records = audit_records(x_train, y_train, x_audit, y_audit, config.audit.max_records, config.audit.seed)
    return AuditContext(records, len(io.read_json(layout.prepared_meta)["classes"]),
                        io.read_json(layout.raw_meta)["version"], sigma, (x_train, y_train), (x_audit, y_audit))


def audit_reference_jobs(config: Config) -> list[tuple[str, bool, float | None, int]]:
    """The reference models the audit will need: (kind, private, σ, index) — for Prefect to fan out."""
    config = release_config(config)
    if not needs_references(config):
        return []
    context = audit_context(config)
    private = context.noise_multiplier is not None
    kinds = [("target", private, context.noise_multiplier)]
    if private and config.audit.control:
        kinds.append(("control", False, None))
    return [(kind, p, s, j) for kind, p, s in kinds for j in range(config.audit.references)]


def train_audit_reference(config: Config, job: tuple[str, bool, float | None, int]) -> dict[str, Any]:
    """Train (or reuse) one reference model; safe to run in parallel with the others."""
    config = release_config(config)
    torch.set_num_threads(1)
    context = audit_context(config)
    kind, private, sigma, index = job
    return train_reference(subject_config(config, kind), context.records, context.n_classes, context.data_version,
                           private=private, noise_multiplier=sigma, index=index)


def _strongest(results: dict[str, Any], key: str) -> tuple[str, float]:
    name = max(results, key=lambda n: results[n][key])
    return name, float(results[name][key])


def audit(config: Config) -> dict[str, Any]:
    """Attack the trained model (and its non-private control); bound ε empirically; plot."""
    config = release_config(config)
    layout = Layout(config)
    context = audit_context(config)
    summary, raw, pictures = run_audit(config, load_model(layout), context.noise_multiplier, context.records,
                                       *context.train, *context.audit, context.n_classes, context.data_version)
    titles = {"target": (layout.roc_png, "membership inference against the released model"),
              "control": (layout.roc_control_png, "positive control: the same attacks, non-private model")}
    for subject, (curves, scores) in pictures.items():
        path, title = titles[subject]
        plot_roc(curves, path, title)
        if subject == "target":
            plot_histograms(scores, layout.histograms_png, "score distributions: members vs non-members")
            name, _ = _strongest(summary["target"]["attacks"], "auc")
            fpr, tpr = curves[name]
            keep = np.unique(np.linspace(0, fpr.size - 1, min(fpr.size, 200)).astype(int))
            with io.atomic_path(layout.roc_csv) as temp:
                temp.write_text("fpr,tpr\n" + "".join(f"{a:.6f},{b:.6f}\n" for a, b in zip(fpr[keep], tpr[keep])))
    io.write_json(layout.audit, summary)
    io.write_json(layout.scores, raw)
    metrics = {f"{name}.{k}": v for name, r in summary["target"]["attacks"].items() for k, v in r.items()
               if isinstance(v, (int, float))}
    metrics |= {"max_epsilon_lower_bound": summary["max_lower_bound"],
                "reference_models": summary["references"]["models"]}
    if summary["control_power"] is not None:
        metrics["control_best_tpr_at_1pct_fpr"] = summary["control_power"]
    io.write_json(layout.audit_metrics, metrics)
    return summary


def gate(config: Config) -> dict[str, Any]:
    """Release gate and privacy report.

    Fails when: there is no DP certificate; the certified ε exceeds ``gate.epsilon_budget``; or
    an empirical ε lower bound exceeds the certified ε (then the trainer or the accountant is
    wrong). When the non-private control shows no attack power the audit is not evidence: that
    fails the gate only with ``audit.require_control_power``.
    """
    layout = Layout(config)
    certificate = io.read_json(layout.certificate)
    summary = io.read_json(layout.audit)
    reasons, passed = [], True
    if certificate is None:
        passed = False
        reasons.append("no DP certificate: the model was trained without differential privacy")
    elif certificate.get("kind") == "kl":
        passed = _gate_kl(config, certificate, reasons)
    else:
        epsilon = certificate["epsilon"]
        if certificate.get("void"):
            reasons.append(certificate["statement"])
        if epsilon > config.gate.epsilon_budget:
            passed = False
            reasons.append(f"certified ε = {epsilon:.4g} exceeds the budget gate.epsilon_budget = "
                           f"{config.gate.epsilon_budget:g}")
        else:
            reasons.append(f"certified ε = {epsilon:.4g} ≤ budget {config.gate.epsilon_budget:g}")
        violations = [b for b in gating_lower_bounds(summary) if b["epsilon"] > epsilon]
        for bound in violations:
            passed = False
            reasons.append(
                f"empirical lower bound ε ≥ {bound['epsilon']:.4g} ({bound['method']}"
                f"{', ' + bound['attack'] if 'attack' in bound else ''}, confidence {bound['confidence']:.4g}) "
                f"exceeds the certified ε = {epsilon:.4g}: the trainer or the accountant is wrong"
            )
        if not violations:
            reasons.append(f"every empirical lower bound ≤ certified ε (largest {summary['max_lower_bound']:.4g})")
    power = summary.get("control_power")
    evidence = power is not None and power >= config.audit.control_min_tpr_at_1pct_fpr
    if power is not None and not evidence:
        message = (f"positive control: best TPR at 1% FPR against the non-private model is {power:.4g} < "
                   f"{config.audit.control_min_tpr_at_1pct_fpr:g}; the audit has no demonstrated power")
        if config.audit.require_control_power:
            passed = False
        reasons.append(message + ("" if config.audit.require_control_power else " (not required by audit.require_control_power)"))
    elif power is not None:
        reasons.append(f"positive control: the attacks reach TPR {power:.4g} at 1% FPR against the non-private model")
    decision = {"passed": passed, "reasons": reasons, "epsilon_budget": config.gate.epsilon_budget,
                "audit_is_evidence": evidence}
    io.write_json(layout.gate, decision)
    data = io.read_json(layout.prepared_meta) | {
        "lower": config.preprocess.lower, "upper": config.preprocess.upper,
        "clip_norm": config.preprocess.clip_norm, "clip_mode": config.preprocess.clip_mode, "features": config.preprocess.features,
        "version": io.read_json(layout.raw_meta)["version"],
    }
    ledger = Ledger(config.ledger.path, config.ledger.delta).summary(data["version"])
    report = render(data=data, train=io.read_json(layout.train_metrics), certificate=certificate,
                    audit=summary, gate=decision, ledger=ledger[0] if ledger else None,
                    budget=config.ledger.epsilon_budget)
    io.write_text(layout.report, report)
    return decision


def total_variation_violations(raw_scores: dict[str, Any], pinsker_delta: float,
                               confidence: float) -> list[dict[str, Any]]:
    """Attacks whose advantage contradicts a KL certificate.

    KL ≤ κ bounds the total variation between the outputs on neighbours by δ_P = sqrt(κ/2)
    (Pinsker), so every membership test has TPR − FPR ≤ δ_P, i.e. the (0, δ_P)-DP statement. The
    hypothesis-test lower bound at δ = δ_P (Clopper–Pearson limits, threshold chosen on a split) is
    then 0 for a sound certificate; a positive bound means the audit refutes it.
    """
    from dpml.audit.bounds import hypothesis_test_bound

    violations = []
    for attack, scores in raw_scores.items():
        bound = hypothesis_test_bound(np.asarray(scores["member"]), np.asarray(scores["nonmember"]),
                                      min(pinsker_delta, 1 - 1e-12), confidence)
        if bound.epsilon > 0:
            violations.append({"attack": attack, "epsilon_at_pinsker_delta": bound.epsilon})
    return violations


def _gate_kl(config: Config, certificate: dict[str, Any], reasons: list[str]) -> bool:
    """A KL-private model (seed 000) passes only against ``gate.kl_budget``, and only when no attack's
    advantage exceeds the Pinsker bound (:func:`total_variation_violations`); it is never called (ε, δ)-DP."""
    if certificate.get("void"):
        reasons.append(certificate["statement"])
        return False
    kl = certificate["kl"]
    reasons.append(f"KL privacy, not (ε, δ)-DP: certified KL = {kl:.4g} (Pinsker: total variation ≤ "
                   f"{certificate['pinsker_delta']:.4g}); no finite ε holds, so gate.epsilon_budget cannot be met")
    layout = Layout(config)
    summary = io.read_json(layout.audit)
    violations = total_variation_violations(io.read_json(layout.scores)["target"], certificate["pinsker_delta"],
                                            summary["per_bound_confidence"])
    for violation in violations:
        reasons.append(f"attack {violation['attack']} beats the Pinsker bound: TPR − FPR > {certificate['pinsker_delta']:.4g} "
                       "at the audit's confidence — the trainer or the KL certificate is wrong")
    if violations:
        return False
    reasons.append(f"no attack's advantage (TPR − FPR) exceeds the Pinsker bound {certificate['pinsker_delta']:.4g}")
    if config.gate.kl_budget is None:
        reasons.append("gate.kl_budget is not set: KL-private releases are not accepted")
        return False
    if kl > config.gate.kl_budget:
        reasons.append(f"certified KL = {kl:.4g} exceeds gate.kl_budget = {config.gate.kl_budget:g}")
        return False
    reasons.append(f"certified KL = {kl:.4g} ≤ gate.kl_budget = {config.gate.kl_budget:g}")
    return True


def register(config: Config) -> dict[str, Any]:
    """Log the run to MLflow and register the model version with its privacy tags."""
    from dpml import tracking

    config = release_config(config)
    layout = Layout(config)
    certificate = io.read_json(layout.certificate)
    summary = io.read_json(layout.audit)
    decision = io.read_json(layout.gate)
    train_metrics = io.read_json(layout.train_metrics)
    data_meta = io.read_json(layout.raw_meta)
    attacks = summary["target"]["attacks"]
    strongest_auc, auc = _strongest(attacks, "auc")
    strongest_tpr, tpr = _strongest(attacks, "tpr_at_0.1pct_fpr")
    epsilon = certificate["epsilon"] if certificate else float("inf")
    mechanism = "none (non-private)"
    if certificate:
        mechanism = MechanismDescription.from_dict(certificate["mechanism"]).summary()
    ledger = Ledger(config.ledger.path, config.ledger.delta)
    spend = io.read_json(layout.spend)
    dataset_total = ledger.total(data_meta["version"])
    version_tags = {
        "dp.epsilon": f"{epsilon:.6g}",
        "privacy.guarantee": "none" if not certificate else certificate.get("kind", "dp"),
        "dp.dataset_epsilon_total": f"{dataset_total:.6g}",
        "dp.dataset_delta": f"{config.ledger.delta:g}",
        "ledger.spend_id": str(spend["spend_id"]),
        "dp.delta": f"{config.dp.delta:g}",
        "dp.accountant": f"{certificate['accountant']} {certificate['accountant_version']}" if certificate else "none",
        "dp.mechanism": mechanism,
        "data.version": data_meta["version"],
        "audit.auc": f"{auc:.6g}",
        "audit.auc_attack": strongest_auc,
        "audit.tpr_at_0.1pct_fpr": f"{tpr:.6g}",
        "audit.tpr_attack": strongest_tpr,
        "audit.epsilon_lower_bound": f"{summary['max_lower_bound']:.6g}",
        "audit.control_tpr_at_1pct_fpr": "none" if summary["control_power"] is None else f"{summary['control_power']:.6g}",
        "audit.is_evidence": str(decision["audit_is_evidence"]).lower(),
        "audit.references": str(summary["references"]["per_subject"]),
        "gate.passed": str(decision["passed"]).lower(),
        "gate.reason": "; ".join(decision["reasons"])[:5000],
    }
    metrics = {
        "test_accuracy": train_metrics["test_accuracy"], "train_accuracy": train_metrics["train_accuracy"],
        "epsilon": epsilon, "delta": config.dp.delta, "audit.max_epsilon_lower_bound": summary["max_lower_bound"],
        **{f"audit.{subject}.{name}.{k}": v for subject in ("target", "control") if subject in summary
           for name, r in summary[subject]["attacks"].items() for k, v in r.items() if isinstance(v, (int, float))},
        **{f"audit.{b['method']}.epsilon_lower_bound": b["epsilon"] for b in summary["one_run"]},
    }
    metrics |= {k: v for k, v in train_metrics.items() if k.startswith("robust_")}
    if certificate and certificate.get("kind") == "kl":
        version_tags |= {"kl.certified": f"{certificate['kl']:.6g}",
                         "kl.pinsker_delta": f"{certificate['pinsker_delta']:.6g}"}
        metrics["kl_certified"] = certificate["kl"]
    if layout.tuning.exists():
        tuning = io.read_json(layout.tuning)
        version_tags |= {"tune.chosen": json.dumps(tuning["chosen"], sort_keys=True),
                         "tune.selection": str(tuning["selection"]),
                         "tune.noisy_validation_accuracy": f"{tuning['noisy_validation_accuracy']:.6g}"}
    artifacts = [p for p in (layout.report, layout.certificate, layout.mechanism, layout.audit, layout.scores,
                             layout.roc_png, layout.roc_control_png, layout.histograms_png, layout.gate,
                             layout.model_spec, layout.tuning) if p.exists()]
    release = tracking.log_release(
        config=config.tracking, run_name=f"{config.train.algorithm}-{data_meta['version'][:8]}",
        params=config.flat(), metrics=metrics, artifacts=artifacts, model=load_model(layout),
        in_features=int(io.read_json(layout.prepared_meta)["n_features"]), version_tags=version_tags, promote=decision["passed"],
        run_tags={"data.version": data_meta["version"], "data.origin": data_meta["origin"],
                  "gate.passed": str(decision["passed"]).lower()},
        documents={"config.json": config.to_dict()},
    )
    ledger.record_event(spend["spend_id"], "released", {"run_id": release["run_id"], "model_uri": release["model_uri"]})
    release |= {"gate_passed": decision["passed"], "epsilon": epsilon, "test_accuracy": train_metrics["test_accuracy"],
                "dataset_epsilon_total": dataset_total}
    io.write_json(layout.release, release)
    return release


def audit_registered_model(model_uri: str, tracking: TrackingConfig, workdir: Path) -> dict[str, Any]:
    """Re-audit a registered version with the data it was trained on (``dpml audit --model``).

    Rebuilds the data stages from the run's logged configuration into ``workdir``, refuses when the
    data's content hash differs from the version's ``data.version`` tag, then runs the audit with the
    certified mechanism's σ and logs the result as a new MLflow run linked from the version.
    """
    from dpml import tracking as mlflow_tracking

    registered = mlflow_tracking.resolve_model(model_uri, tracking)
    logged = validate(registered["config"], origin=f"config.json of run {registered['run_id']}")
    paths = {"data": str(workdir / "data"), "artifacts": str(workdir / "artifacts"), "cache": logged.paths.cache}
    config = logged.model_copy(update={"paths": logged.paths.model_copy(update=paths), "tracking": tracking})
    version = ingest(config)["version"]
    if version != registered["tags"].get("data.version"):
        raise ValueError(f"the data at {config.data.source} (version {version[:12]}…) is not the data "
                         f"{model_uri} was trained on (data.version {registered['tags'].get('data.version', '?')[:12]}…)")
    split(config)
    preprocess(config)
    layout = Layout(config)
    mechanism = mlflow_tracking.load_run_json(tracking, registered["run_id"], "mechanism.json")
    io.write_json(layout.mechanism, mechanism)
    context = audit_context(config)
    summary, raw, pictures = run_audit(config, registered["model"], context.noise_multiplier, context.records,
                                       *context.train, *context.audit, context.n_classes, context.data_version)
    plot_roc(pictures["target"][0], layout.roc_png, f"re-audit of {registered['name']} v{registered['version']}")
    io.write_json(layout.audit, summary)
    io.write_json(layout.scores, raw)
    metrics = {f"audit.target.{n}.{k}": v for n, r in summary["target"]["attacks"].items() for k, v in r.items()
               if isinstance(v, (int, float))} | {"audit.max_epsilon_lower_bound": summary["max_lower_bound"]}
    run_id = mlflow_tracking.log_audit(tracking, registered, metrics, [layout.audit, layout.scores, layout.roc_png])
    certified = float(registered["tags"].get("dp.epsilon", "inf"))
    return {"model": f"{registered['name']}/{registered['version']}", "audit_run_id": run_id, "audit": summary,
            "certified_epsilon": certified, "consistent": summary["max_lower_bound"] <= certified}


STAGES: dict[str, Callable[[Config], dict[str, Any]]] = {
    "ingest": ingest, "split": split, "preprocess": preprocess, "train": train, "certify": certify,
    "audit": audit, "gate": gate, "register": register,
}


def run_all(config: Config, progress: bool = False, echo: Callable[[str], None] = print,
            search: bool = False) -> dict[str, Any]:
    """Run every stage in order (the CLI's ``dpml run``/``dpml tune`` without Prefect)."""
    results: dict[str, Any] = {}
    stages = STAGES | {"train": tune} if search else STAGES
    if search:
        check_tunable(config)
    for name, stage in stages.items():
        start = time.perf_counter()
        echo(f"[dpml] {'tune' if search and name == 'train' else name} …")
        results[name] = stage(config, progress=progress) if name == "train" else stage(config)  # type: ignore[call-arg]
        echo(f"[dpml] {name} done in {time.perf_counter() - start:.1f}s")
    return results
