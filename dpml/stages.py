"""The pipeline stages as plain functions over files.

ingest → split → preprocess → train → certify → audit → gate → register

Each stage reads the previous stages' files and writes its own (atomically) under
``paths.data`` / ``paths.artifacts``. The DVC stages (``dpml stage NAME``) and the Prefect tasks
call exactly these functions, so both drivers produce the same files.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpml import io
from dpml.audit.attacks import ATTACKS
from dpml.audit.metrics import roc, summarize
from dpml.audit.plots import plot_roc
from dpml.config import Config
from dpml.data.preprocess import preprocess as preprocess_records
from dpml.data.sources import content_hash, load_source
from dpml.data.split import split_indices
from dpml.models.mlp import MlpSpec, build_mlp, pick_device
from dpml.privacy.accountants import certify as certify_mechanism
from dpml.privacy.calibrate import calibrate_noise_multiplier
from dpml.privacy.mechanism import MechanismDescription
from dpml.report.privacy_report import render
from dpml.train.dpsgd import make_optimizer, number_of_steps, train_dpsgd, train_nonprivate

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
        self.train_metrics = art / "train" / "metrics.json"
        self.certificate = art / "certify" / "certificate.json"
        self.certify_metrics = art / "certify" / "metrics.json"
        self.audit = art / "audit" / "audit.json"
        self.audit_metrics = art / "audit" / "metrics.json"
        self.roc_png = art / "audit" / "roc.png"
        self.roc_csv = art / "audit" / "roc.csv"
        self.gate = art / "gate" / "gate.json"
        self.report = art / "gate" / "privacy_report.md"
        self.release = art / "register" / "release.json"


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
    """Public scaling and input norm clipping of every part; reports the clipped fractions."""
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
    io.write_json(layout.prepared_meta, summary)
    return summary


def _load_part(layout: Layout, part: str) -> tuple[np.ndarray, np.ndarray]:
    arrays = io.read_npz(layout.prepared[part])
    return arrays["x"], arrays["y"]


def accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    from dpml.audit.signals import logits_of

    return float((logits_of(model, x).argmax(1) == y).mean())


def resolve_noise_multiplier(config: Config, n_train: int) -> float:
    """σ from the config, or calibrated so the certified ε meets ``dp.target_epsilon``."""
    if config.dp.noise_multiplier is not None:
        return config.dp.noise_multiplier
    assert config.dp.target_epsilon is not None
    steps = number_of_steps(config.train.epochs, config.train.sample_rate)
    return calibrate_noise_multiplier(config.dp.target_epsilon, config.train.sample_rate, steps,
                                      config.dp.delta, config.dp.neighbouring)


def train(config: Config, progress: bool = False) -> dict[str, Any]:
    """Train the configured model with the configured trainer; save model, spec, mechanism."""
    layout = Layout(config)
    meta = io.read_json(layout.prepared_meta)
    x_np, y_np = _load_part(layout, "train")
    device = pick_device(config.train.device)
    torch.manual_seed(config.train.seed)
    spec = MlpSpec(int(x_np.shape[1]), tuple(config.model.hidden), len(meta["classes"]), config.model.activation)
    model = build_mlp(spec).to(device)
    optimizer = make_optimizer(model, config.train.optimizer, config.train.learning_rate, config.train.momentum)
    x, y = torch.as_tensor(x_np, device=device), torch.as_tensor(y_np, device=device)
    if config.train.algorithm == "dpsgd":
        sigma = resolve_noise_multiplier(config, int(x_np.shape[0]))
        result = train_dpsgd(model, x, y, sample_rate=config.train.sample_rate, epochs=config.train.epochs,
                             clip_norm=config.dp.clip_norm, noise_multiplier=sigma,
                             neighbouring=config.dp.neighbouring, optimizer=optimizer, seed=config.train.seed,
                             physical_batch_size=config.train.physical_batch_size, progress=progress)
    else:
        result = train_nonprivate(model, x, y, sample_rate=config.train.sample_rate, epochs=config.train.epochs,
                                  optimizer=optimizer, seed=config.train.seed, progress=progress)
    model = result.model.to("cpu")
    with io.atomic_path(layout.model) as temp:
        torch.save(model.state_dict(), temp)
    io.write_json(layout.model_spec, spec.to_dict())
    io.write_json(layout.mechanism, result.mechanism.to_dict() if result.mechanism else None)
    x_test, y_test = _load_part(layout, "test")
    metrics = {
        "test_accuracy": accuracy(model, x_test, y_test),
        "train_accuracy": accuracy(model, x_np, y_np),
        "device": str(device),
        # Wall-clock time is left out: metrics must reproduce exactly under `dvc repro`.
        **{f"train_{k}": v for k, v in result.history.items() if k != "seconds"},
    }
    if result.mechanism is not None:
        metrics["noise_multiplier"] = result.mechanism.events[0].noise_multiplier
    io.write_json(layout.train_metrics, metrics)
    return metrics


def load_model(layout: Layout) -> torch.nn.Module:
    model = build_mlp(MlpSpec.from_dict(io.read_json(layout.model_spec)))
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
        metrics = {"epsilon": certificate["epsilon"], "delta": certificate["delta"], "private": True}
    io.write_json(layout.certificate, certificate)
    io.write_json(layout.certify_metrics, {k: (v if v != float("inf") else "inf") for k, v in metrics.items()})
    return {"certificate": certificate, **metrics}


def audit(config: Config) -> dict[str, Any]:
    """Run each configured attack: train members vs audit-population non-members (balanced)."""
    layout = Layout(config)
    model = load_model(layout)
    x_train, y_train = _load_part(layout, "train")
    x_out, y_out = _load_part(layout, "audit")
    rng = np.random.default_rng(config.audit.seed)
    m = min(config.audit.max_records, x_train.shape[0], x_out.shape[0])
    members = rng.choice(x_train.shape[0], size=m, replace=False)
    nonmembers = rng.choice(x_out.shape[0], size=m, replace=False)
    results, curves = {}, {}
    for name in config.audit.attacks:
        attack = ATTACKS[name]
        member_scores = attack(model, x_train[members], y_train[members])
        nonmember_scores = attack(model, x_out[nonmembers], y_out[nonmembers])
        results[name] = summarize(member_scores, nonmember_scores)
        curves[name] = roc(member_scores, nonmember_scores)
    plot_roc(curves, layout.roc_png, "membership inference: train members vs audit population")
    first = config.audit.attacks[0]
    fpr, tpr = curves[first]
    keep = np.unique(np.linspace(0, fpr.size - 1, min(fpr.size, 200)).astype(int))
    with io.atomic_path(layout.roc_csv) as temp:
        temp.write_text("fpr,tpr\n" + "".join(f"{a:.6f},{b:.6f}\n" for a, b in zip(fpr[keep], tpr[keep])))
    summary = {"attacks": results, "primary_attack": first, "records_per_side": int(m)}
    io.write_json(layout.audit, summary)
    io.write_json(layout.audit_metrics, {f"{name}.{k}": v for name, r in results.items() for k, v in r.items()})
    return summary


def gate(config: Config) -> dict[str, Any]:
    """Release gate: a certified ε within ``gate.epsilon_budget``; writes the privacy report."""
    layout = Layout(config)
    certificate = io.read_json(layout.certificate)
    reasons, passed = [], True
    if certificate is None:
        passed = False
        reasons.append("no DP certificate: the model was trained without differential privacy")
    elif certificate["epsilon"] > config.gate.epsilon_budget:
        passed = False
        reasons.append(f"certified ε = {certificate['epsilon']:.4g} exceeds the budget gate.epsilon_budget = "
                       f"{config.gate.epsilon_budget:g}")
    else:
        reasons.append(f"certified ε = {certificate['epsilon']:.4g} ≤ budget {config.gate.epsilon_budget:g}")
    decision = {"passed": passed, "reasons": reasons, "epsilon_budget": config.gate.epsilon_budget}
    io.write_json(layout.gate, decision)
    data = io.read_json(layout.prepared_meta) | {
        "lower": config.preprocess.lower, "upper": config.preprocess.upper,
        "clip_norm": config.preprocess.clip_norm, "clip_mode": config.preprocess.clip_mode,
        "version": io.read_json(layout.raw_meta)["version"],
    }
    report = render(data=data, train=io.read_json(layout.train_metrics), certificate=certificate,
                    audit=io.read_json(layout.audit), gate=decision)
    io.write_text(layout.report, report)
    return decision


def register(config: Config) -> dict[str, Any]:
    """Log the run to MLflow and register the model version with its privacy tags."""
    from dpml import tracking

    layout = Layout(config)
    certificate = io.read_json(layout.certificate)
    audit_summary = io.read_json(layout.audit)
    decision = io.read_json(layout.gate)
    train_metrics = io.read_json(layout.train_metrics)
    data_meta = io.read_json(layout.raw_meta)
    primary = audit_summary["attacks"][audit_summary["primary_attack"]]
    epsilon = certificate["epsilon"] if certificate else float("inf")
    mechanism = "none (non-private)"
    if certificate:
        event = certificate["mechanism"]["events"][0]
        mechanism = (f"dpsgd: poisson-gaussian q={event['sample_rate']:.6g} sigma={event['noise_multiplier']:.6g} "
                     f"steps={event['steps']} C={certificate['mechanism']['clip_norm']:g} "
                     f"{certificate['neighbouring']} {certificate['threat_model']}")
    version_tags = {
        "dp.epsilon": f"{epsilon:.6g}",
        "dp.delta": f"{config.dp.delta:g}",
        "dp.accountant": f"{certificate['accountant']} {certificate['accountant_version']}" if certificate else "none",
        "dp.mechanism": mechanism,
        "data.version": data_meta["version"],
        "audit.auc": f"{primary['auc']:.6g}",
        "audit.tpr_at_0.1pct_fpr": f"{primary['tpr_at_0.1pct_fpr']:.6g}",
        "gate.passed": str(decision["passed"]).lower(),
        "gate.reason": "; ".join(decision["reasons"])[:500],
    }
    metrics = {
        "test_accuracy": train_metrics["test_accuracy"], "train_accuracy": train_metrics["train_accuracy"],
        "epsilon": epsilon, "delta": config.dp.delta,
        **{f"audit.{name}.{k}": v for name, r in audit_summary["attacks"].items() for k, v in r.items()},
    }
    artifacts = [p for p in (layout.report, layout.certificate, layout.mechanism, layout.audit, layout.roc_png,
                             layout.gate, layout.model_spec) if p.exists()]
    release = tracking.log_release(
        config=config.tracking, run_name=f"{config.train.algorithm}-{data_meta['version'][:8]}",
        params=config.flat(), metrics=metrics, artifacts=artifacts, model=load_model(layout),
        in_features=int(data_meta["n_features"]), version_tags=version_tags, promote=decision["passed"],
        run_tags={"data.version": data_meta["version"], "data.origin": data_meta["origin"],
                  "gate.passed": str(decision["passed"]).lower()},
    )
    release |= {"gate_passed": decision["passed"], "epsilon": epsilon, "test_accuracy": train_metrics["test_accuracy"]}
    io.write_json(layout.release, release)
    return release


STAGES: dict[str, Callable[[Config], dict[str, Any]]] = {
    "ingest": ingest, "split": split, "preprocess": preprocess, "train": train, "certify": certify,
    "audit": audit, "gate": gate, "register": register,
}


def run_all(config: Config, progress: bool = False, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every stage in order (the CLI's ``dpml run`` without Prefect)."""
    results: dict[str, Any] = {}
    for name, stage in STAGES.items():
        start = time.perf_counter()
        echo(f"[dpml] {name} …")
        results[name] = stage(config, progress=progress) if name == "train" else stage(config)  # type: ignore[call-arg]
        echo(f"[dpml] {name} done in {time.perf_counter() - start:.1f}s")
    return results
