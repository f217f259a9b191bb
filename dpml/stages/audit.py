"""Stage audit: attack the trained model and its non-private positive control, bound ε empirically, plot.

The audit's work is :func:`dpml.audit.run.run_audit`; this module feeds it the released model, the
prepared records and σ of the released trainer, and lets the Prefect flow fan the reference models out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dpml import io
from dpml.audit.bounds import dp_limit_tpr
from dpml.audit.plots import plot_histograms, plot_roc
from dpml.audit.references import AuditRecords, audit_records, train_reference
from dpml.audit.run import needs_references, run_audit, subject_config
from dpml.stages.layout import Layout, load_model, load_part, load_trained_part
from dpml.stages.spend_outputs import stamp_for
from dpml.stages.train import release_config, released_noise_multiplier

if TYPE_CHECKING:
    from dpml.config import Config


@dataclass(frozen=True)
class AuditContext:
    records: AuditRecords
    n_classes: int
    data_version: str
    noise_multiplier: float | None
    train: tuple[np.ndarray, np.ndarray]
    audit: tuple[np.ndarray, np.ndarray]
    mechanism: dict[str, Any] | None = None
    certified_epsilon: float | None = None


def audit_context(config: Config) -> AuditContext:
    """Everything the audit needs besides the model: records, σ of the target, data version."""
    layout = Layout(config)
    x_train, y_train = load_trained_part(layout)  # less any units the ledger's filter excluded
    if layout.validation.exists():  # after dpml tune the model never trained on the validation rows
        keep = np.ones(y_train.size, dtype=bool)
        keep[io.read_npz(layout.validation)["rows"]] = False
        x_train, y_train = x_train[keep], y_train[keep]
    x_audit, y_audit = load_part(layout, "audit")
    mechanism = io.read_json(layout.mechanism) if layout.mechanism.exists() else None
    sigma = None if mechanism is None else released_noise_multiplier(config, mechanism)
    records = audit_records(x_train, y_train, x_audit, y_audit, config.audit.max_records, config.audit.seed)
    certificate = io.read_json(layout.certificate) if layout.certificate.exists() else None
    epsilon = None if not certificate or certificate.get("epsilon") is None else float(certificate["epsilon"])
    return AuditContext(
        records,
        len(io.read_json(layout.prepared_meta)["classes"]),
        io.read_json(layout.raw_meta)["version"],
        sigma,
        (x_train, y_train),
        (x_audit, y_audit),
        mechanism,
        epsilon,
    )


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
    return train_reference(
        subject_config(config, kind),
        context.records,
        context.n_classes,
        context.data_version,
        private=private,
        noise_multiplier=sigma,
        index=index,
    )


def power_and_conformance_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """MLflow metrics: each ε lower-bound method's power (``power.attack:lira-online`` …) and each
    conformance check's p-value and verdict (``conformance.noise.p_value`` …)."""
    metrics = {f"power.{name}": float(entry["power"]) for name, entry in summary.get("power", {}).items()}
    for check in summary.get("conformance", {}).get("checks", []):
        key = check["check"].replace(" ", "_")
        # 4 significant digits: the auditor's float32 per-example gradients can differ in the last bits
        # between processes (thread counts), and `dvc repro` compares these metrics exactly.
        metrics[f"conformance.{key}.p_value"] = float(f"{check['p_value']:.4g}")
        metrics[f"conformance.{key}.passed"] = float(check["passed"])
    return metrics


def audit_detail_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The audit's numbers beyond the headline: every attack's on the target and the control, each one-run
    method's lower bound (and its f-DP reading: μ, ε, their power), each bound's power and each conformance
    check (``audit.target.loss.auc`` …)."""
    return {
        **{
            f"audit.{subject}.{name}.{k}": v
            for subject in ("target", "control")
            if subject in summary
            for name, r in summary[subject]["attacks"].items()
            for k, v in r.items()
            if isinstance(v, (int, float))
        },
        **{f"audit.{b['method']}.epsilon_lower_bound": b["epsilon"] for b in summary["one_run"]},
        **{
            f"audit.{b['method']}.fdp.{k}": b["fdp"][k]
            for b in summary["one_run"]
            if "fdp" in b
            for k in ("mu", "epsilon", "power_mu", "power")
        },
        **{f"audit.{k}": v for k, v in power_and_conformance_metrics(summary).items()},
    }


def write_dp_limit(path: Path, epsilon: float | None, delta: float) -> None:
    """The ROC no membership test can exceed against the release's certificate, beside the attack's
    (``dvc plots show``): TPR ≤ min(1, e^ε·FPR + δ, 1 − e^{−ε}(1 − δ − FPR)) (:func:`dp_limit_tpr`), on a grid
    of FPRs with the corner FPR = (1 − δ)/(e^ε + 1) where its two lines meet; TPR = 1 without a certificate."""
    eps = math.inf if epsilon is None else epsilon
    corner = [] if math.isinf(eps) else [(1 - delta) / (math.exp(min(eps, 700.0)) + 1)]
    fpr = np.unique(np.concatenate([np.linspace(0.0, 1.0, 201), corner]))
    tpr = dp_limit_tpr(fpr, eps, delta)
    with io.atomic_path(path) as temp:
        temp.write_text("fpr,tpr\n" + "".join(f"{a:.6f},{b:.6f}\n" for a, b in zip(fpr, tpr, strict=True)))


def strongest(results: dict[str, Any], key: str) -> tuple[str, float]:
    name = max(results, key=lambda n: results[n][key])
    return name, float(results[name][key])


def audit(config: Config) -> dict[str, Any]:
    """Attack the trained model (and its non-private control); bound ε empirically; plot."""
    config = release_config(config)
    layout = Layout(config)
    context = audit_context(config)
    summary, raw, pictures = run_audit(
        config,
        load_model(layout),
        context.noise_multiplier,
        context.records,
        *context.train,
        *context.audit,
        context.n_classes,
        context.data_version,
        certified_epsilon=context.certified_epsilon,
        mechanism=context.mechanism,
    )
    titles = {
        "target": (layout.roc_png, "membership inference against the released model"),
        "control": (layout.roc_control_png, "positive control: the same attacks, non-private model"),
    }
    for subject, (curves, scores) in pictures.items():
        path, title = titles[subject]
        plot_roc(curves, path, title)
        if subject == "target":
            plot_histograms(scores, layout.histograms_png, "score distributions: members vs non-members")
            name, _ = strongest(summary["target"]["attacks"], "auc")
            fpr, tpr = curves[name]
            keep = np.unique(np.linspace(0, fpr.size - 1, min(fpr.size, 200)).astype(int))
            with io.atomic_path(layout.roc_csv) as temp:
                temp.write_text(
                    "fpr,tpr\n" + "".join(f"{a:.6f},{b:.6f}\n" for a, b in zip(fpr[keep], tpr[keep], strict=True))
                )
            write_dp_limit(layout.roc_limit_csv, context.certified_epsilon, config.dp.delta)
    summary |= stamp_for(layout)  # the model this audit attacked (dpml.stages.spend_outputs)
    io.write_json(layout.audit, summary)
    io.write_json(layout.scores, raw)
    metrics = {
        f"{name}.{k}": v
        for name, r in summary["target"]["attacks"].items()
        for k, v in r.items()
        if isinstance(v, (int, float))
    }
    metrics |= {
        "max_epsilon_lower_bound": summary["max_lower_bound"],
        "reference_models": summary["references"]["models"],
    }
    metrics |= power_and_conformance_metrics(summary)
    if summary["control_power"] is not None:
        metrics["control_best_tpr_at_1pct_fpr"] = summary["control_power"]
    io.write_json(layout.audit_metrics, metrics)
    return summary
