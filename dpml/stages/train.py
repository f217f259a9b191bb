"""Stage train (and ``dpml tune``'s search in its place): reserve the spend, train, save the model.

Pre-flight checks (:mod:`dpml.preflight`) run before the reservation. The spend is committed to the
ledger before any training starts; it is cancelled if the run fails before the trainer is handed the
records (no ``started`` event yet), and counts for ever from then on. A run whose composed total
would exceed ``ledger.epsilon_budget`` is refused untrained. Which
trainer runs, what it will spend and how it trains are the registry's answers
(:mod:`dpml.train.registry`).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dpml import io
from dpml.audit.robustness import certified_accuracy
from dpml.faults import fault_point
from dpml.models.mlp import pick_device
from dpml.preflight import noise_seed_is_fixed, preflight
from dpml.privacy.ledger import Ledger
from dpml.privacy.mechanism import MechanismDescription
from dpml.stages.layout import Layout, load_part
from dpml.train.fit import fit, model_spec
from dpml.train.registry import trainer_for
from dpml.train.search import run_search, validation_rows

if TYPE_CHECKING:
    from dpml.config import Config


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


def released_noise_multiplier(config: Config, mechanism: dict[str, Any]) -> float | None:
    """σ of the released model's trainer (the audit's reference models train with the same)."""
    return trainer_for(config).released_noise_multiplier(config, mechanism)


def release_config(config: Config) -> Config:
    """The configuration of the released model: ``config``, plus the search's choice after ``dpml tune``,
    plus whatever the trainer fixed while training (NoisyCGD's calibrated λ)."""
    from dpml.config import with_hyperparameters

    layout = Layout(config)
    if layout.tuning.exists():
        config = with_hyperparameters(config, io.read_json(layout.tuning)["chosen"])
    metrics = io.read_json(layout.train_metrics) if layout.train_metrics.exists() else {}
    return trainer_for(config).release_config(config, metrics)


def forget_search(layout: Layout) -> None:
    """A plain training run releases no search: drop a previous ``dpml tune``'s files."""
    for path in (layout.tuning, layout.validation):
        path.unlink(missing_ok=True)


def _reserve(config: Config, layout: Layout, planned: MechanismDescription | None, purpose: str) -> tuple[Ledger, Any]:
    """Record the planned spend in the ledger (refused over budget), note its id beside the model, and
    mark it ``started`` — the moment the records are handed to the trainer. A failure in between
    cancels the spend: nothing about the data can have left the process."""
    meta = io.read_json(layout.prepared_meta)
    ledger = Ledger(config.ledger.path, config.ledger.delta)
    spend = ledger.reserve(meta["data_version"], planned, purpose, config.ledger.epsilon_budget,
                           kl_budget=config.ledger.kl_budget)
    try:
        io.write_json(layout.spend, {"spend_id": spend.id, "ledger": str(Path(config.ledger.path).resolve()),
                                     "epsilon_alone": spend.epsilon_alone})
        fault_point("train:reserved")
        ledger.record_event(spend.id, "started", {"pid": os.getpid()})
    except BaseException as error:
        ledger.cancel(spend.id, f"failed before training: {type(error).__name__}: {error}")
        raise
    return ledger, spend


def train(config: Config, progress: bool = False) -> dict[str, Any]:
    """Record the planned spend in the ledger, then train; save model, spec, mechanism."""
    preflight(config)
    layout = Layout(config)
    forget_search(layout)
    trainer = trainer_for(config)
    meta = io.read_json(layout.prepared_meta)
    x_np, y_np = load_part(layout, "train")
    n, n_classes = int(x_np.shape[0]), len(meta["classes"])
    check_delta(config, n)
    sigma = trainer.noise_multiplier(config)
    planned = trainer.plan(config, n, int(x_np.shape[1]), n_classes)
    ledger, spend = _reserve(config, layout, planned, f"{trainer.name} model ({config.data.source})")
    try:
        held_out = load_part(layout, "audit") if trainer.guarantee == "kl" else None  # KL-estimate probes
        result = fit(config, x_np, y_np, n_classes, private=trainer.private, noise_multiplier=sigma,
                     seed=config.train.seed, progress=progress, held_out=held_out)
        if result.mechanism != planned:
            raise RuntimeError("the trainer's mechanism differs from the one recorded in the ledger")
    except BaseException as error:
        ledger.record_event(spend.id, "failed", {"error": f"{type(error).__name__}: {error}"})
        raise
    ledger.record_event(spend.id, "trained", {"steps": result.history.get("steps")})
    return save_trained(config, layout, result.model, result.mechanism, x_np, y_np, result.history)


def tune(config: Config, progress: bool = False) -> dict[str, Any]:
    """Private hyperparameter search in place of :func:`train` (see :mod:`dpml.train.search`).

    The search's whole cost (Papernot & Steinke for a random number of candidates, composition
    for a fixed one) is recorded in the ledger before the first candidate trains; σ (or NoisyCGD's
    per-candidate μ) is calibrated so that this whole cost meets ``dp.target_epsilon``.
    """
    from dpml.config import check_tunable, with_hyperparameters

    check_tunable(config)
    preflight(config)
    layout = Layout(config)
    forget_search(layout)
    meta = io.read_json(layout.prepared_meta)
    x_np, y_np = load_part(layout, "train")
    n = int(x_np.shape[0])
    check_delta(config, n)
    rows = validation_rows(n, config)
    fit_mask = np.ones(n, dtype=bool)
    fit_mask[rows] = False
    x_fit, y_fit = x_np[fit_mask], y_np[fit_mask]
    plan = trainer_for(config).search_plan(config, int(x_fit.shape[0]), n)
    selection = plan.mechanism.selection.describe() if plan.mechanism.selection else ""
    ledger, spend = _reserve(config, layout, plan.mechanism, f"dpml tune: {selection} ({config.data.source})")
    try:
        best = run_search(config, x_fit, y_fit, x_np[rows], y_np[rows], len(meta["classes"]), plan, progress)
        if best is None:
            raise RuntimeError("the random number of candidates came out K = 0: nothing to release "
                               "(the search's privacy cost stays recorded in the ledger)")
    except BaseException as error:
        ledger.record_event(spend.id, "failed", {"error": f"{type(error).__name__}: {error}"})
        raise
    ledger.record_event(spend.id, "trained", {"chosen": best.chosen})
    io.write_npz(layout.validation, rows=rows)
    io.write_json(layout.tuning, {"chosen": best.chosen, "noisy_validation_accuracy": best.noisy_validation_accuracy,
                                  "selection": selection or None, "space": config.tune.space,
                                  "validation_records": int(rows.size)})
    extra = {"noisy_validation_accuracy": best.noisy_validation_accuracy,
             **{f"chosen.{k}": v for k, v in best.chosen.items()}}
    return save_trained(with_hyperparameters(config, best.chosen), layout, best.model, plan.mechanism, x_fit, y_fit,
                        best.history, extra)


def save_trained(config: Config, layout: Layout, model: torch.nn.Module, mechanism: MechanismDescription | None,
                 x_fit: np.ndarray, y_fit: np.ndarray, history: dict[str, Any],
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the released model, its spec, its mechanism and the train metrics."""
    n_classes = len(io.read_json(layout.prepared_meta)["classes"])
    with io.atomic_path(layout.model) as temp:
        torch.save(model.state_dict(), temp)
    io.write_json(layout.model_spec, model_spec(config, int(x_fit.shape[1]), n_classes).to_dict())
    io.write_json(layout.mechanism, mechanism.to_dict() if mechanism else None)
    x_test, y_test = load_part(layout, "test")
    metrics = {
        "test_accuracy": accuracy(model, x_test, y_test),
        "train_accuracy": accuracy(model, x_fit, y_fit),
        "device": str(pick_device(config.train.device)),
        "noise_seed_fixed": noise_seed_is_fixed(),
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
