"""Stage train (and ``dpml tune``'s search in its place): reserve the spend, train, save the model.

Pre-flight checks (:mod:`dpml.preflight`) run before the reservation. The spend and the privacy units
it touches are committed to the ledger before any training starts; the spend is cancelled if the run
fails before the trainer is handed the records (no ``started`` event yet), and counts for ever from
then on. A run that would take any unit of its training data over ``ledger.epsilon_budget`` is refused
untrained, or — ``ledger.on_exhausted: exclude`` — trains without those units. Which
trainer runs, what it will spend and how it trains are the registry's answers
(:mod:`dpml.train.registry`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dpml import io
from dpml.audit.robustness import certified_accuracy
from dpml.config import with_hyperparameters, check_tunable
from dpml.faults import fault_point
from dpml.models import build_model
from dpml.models.custom import factory_source
from dpml.models.library import LibraryModel
from dpml.models.predict import logits_of
from dpml.devices import pick_device
from dpml.preflight import noise_seed_is_fixed, preflight
from dpml.ledger.ledger import BudgetExceeded, Ledger, Spend, default_lineage, ledger_of
from dpml.accounting.mechanism import MechanismDescription
from dpml.ledger.spending import Charge, charged_run
from dpml.stages.layout import Layout, load_part, load_units
from dpml.stages.spend_outputs import stamp_for
from dpml.train.fit import fit, model_spec
from dpml.train.protocol import Trainer
from dpml.train.registry import trainer_for
from dpml.train.search import run_search, validation_rows

if TYPE_CHECKING:
    from dpml.config import Config

LOG = logging.getLogger("dpml.clipping")


def accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    return float((logits_of(model, x).argmax(1) == y).mean())


def check_delta(config: Config, n: int) -> None:
    """Refuse δ ≥ 1/n: such a δ allows mechanisms that publish a whole record ("name and shame")."""
    if config.dp.delta >= 1.0 / n:
        message = (
            f"dp.delta = {config.dp.delta:g} is ≥ 1/n = {1.0 / n:.3g} for n = {n} training records: a δ that "
            "large permits releasing some record outright; use δ ≪ 1/n"
        )
        if not config.dp.allow_delta_above_inverse_n:
            raise ValueError(message + " (or set dp.allow_delta_above_inverse_n: true to proceed anyway)")
        warnings.warn(message, stacklevel=2)


def check_model(trainer: Trainer, config: Config, in_features: int, n_classes: int) -> None:
    """The trainer's checks of its model (the clipping probe), before the spend is reserved: a model it
    cannot train exactly is refused with nothing spent. What it found goes to the run's log."""
    check_token_source(config, in_features, n_classes)
    lines = trainer.check_model(config, in_features, n_classes)
    for line in lines:
        LOG.log(logging.WARNING if len(lines) > 1 else logging.INFO, "%s", line)


def check_token_source(config: Config, in_features: int, n_classes: int) -> None:
    """A custom model called with ``input_ids`` and ``attention_mask`` needs records that are token ids and
    their mask (a table's ``tokens`` column): any other records would be read as ids. Refused before the spend."""
    if config.model.kind != "custom" or any(c.type == "tokens" for c in (config.data.columns or {}).values()):
        return
    model = build_model(model_spec(config, in_features, n_classes))
    if isinstance(model, LibraryModel) and model.tokens:
        raise ValueError(
            f"model.factory = {config.model.factory!r}: its module is called with input_ids and "
            f"attention_mask, but {config.data.source} has no tokens column; declare the token ids as "
            "one (data.columns: {NAME: {type: tokens, length, vocabulary}}) or set model.inputs: tensor"
        )


def released_noise_multiplier(config: Config, mechanism: dict[str, Any]) -> float | None:
    """σ of the released model's trainer (the audit's reference models train with the same)."""
    return trainer_for(config).released_noise_multiplier(config, mechanism)


def release_config(config: Config) -> Config:
    """The configuration of the released model: ``config``, plus the search's choice after ``dpml tune``,
    plus whatever the trainer fixed while training (NoisyCGD's calibrated λ)."""
    layout = Layout(config)
    if layout.tuning.exists():
        config = with_hyperparameters(config, io.read_json(layout.tuning)["chosen"])
    metrics = io.read_json(layout.train_metrics) if layout.train_metrics.exists() else {}
    return trainer_for(config).release_config(config, metrics)


def forget_search(layout: Layout) -> None:
    """A plain training run releases no search: drop a previous ``dpml tune``'s files."""
    for path in (layout.tuning, layout.validation):
        path.unlink(missing_ok=True)


def lineage_of(config: Config) -> str:
    """The ledger account of this run's people: ``ledger.dataset`` when set; else the lineage that already
    holds the people of the prepared training part (the records decide, not the file's name: a renamed
    file, another encoding or next week's export of the same people is the same account); else — people
    the ledger has never seen — a new lineage named after ``data.source``. The reservation refuses a run
    whose people another lineage holds (:class:`dpml.ledger.ledger.LineageConflict`), so an explicit
    ``ledger.dataset`` can never open a second account for them."""
    if config.ledger.dataset:
        return config.ledger.dataset
    fallback = default_lineage(config.data.source)
    units = Layout(config).prepared["train"]
    if not units.is_file():
        return fallback
    stat = units.stat()
    key = (
        config.ledger.location(),
        config.ledger.unit_key,
        str(units.resolve()),
        stat.st_mtime_ns,
        stat.st_size,
        fallback,
    )
    ledger = open_ledger(config)
    generation = ledger.generation()
    cached = _LINEAGE_OF.get(key)
    if cached is not None and cached[0] == generation:
        return cached[1]
    name = ledger.lineage_holding(load_units(Layout(config)), fallback)
    _LINEAGE_OF.clear()  # one run's answer is enough to keep
    _LINEAGE_OF[key] = (generation, name)
    if name != fallback:
        warnings.warn(
            f"lineage {name!r}: the people of {config.data.source} are already accounted under it, so this "
            f"run is charged there (ledger.dataset is not set: the lineage follows the records, not the "
            f"file's name {fallback!r}; dpml ledger rename renames a lineage)",
            LineageFollowsRecords,
            stacklevel=1,
        )  # one line per process, however many stages ask
    return name


class LineageFollowsRecords(UserWarning):
    """A run without ``ledger.dataset`` charged to the lineage that already holds its people, whose name
    is not the source's (a renamed file, another export of the same people)."""


# lineage_of's last answer, kept while the units file and the ledger are unchanged
_LINEAGE_OF: dict[tuple[Any, ...], tuple[tuple[int, int], str]] = {}


def open_ledger(config: Config) -> Ledger:
    return ledger_of(config.ledger)


def filter_units(
    config: Config, units: np.ndarray, plan_for: Callable[[np.ndarray], MechanismDescription | None]
) -> tuple[np.ndarray, MechanismDescription | None]:
    """``ledger.on_exhausted: exclude``: the mask of training units that may take part under the
    lineage's Rényi filter, and the mechanism planned for exactly those (fewer units → a larger
    sampling rate → more loss per unit, so this repeats until the set is stable)."""
    keep = np.ones(units.shape[0], dtype=bool)
    planned = plan_for(keep)
    if planned is None or config.ledger.on_exhausted != "exclude":
        return keep, planned
    if planned.guarantee == "kl":
        raise ValueError(
            f"ledger.on_exhausted = 'exclude' needs an (ε, δ)-DP trainer; train.algorithm = "
            f"{config.train.algorithm!r} is KL-private (use on_exhausted: refuse)"
        )
    ledger = open_ledger(config)
    for _ in range(50):
        allowed = keep & ledger.units_within_filter(lineage_of(config), units, planned, config.ledger.epsilon_budget)
        if not allowed.any():
            raise BudgetExceeded(
                f"lineage {lineage_of(config)!r}: every one of the {units.shape[0]:,} privacy units "
                "in this run's training data has exhausted its budget "
                f"(ledger.epsilon_budget = {config.ledger.epsilon_budget:g}); nothing to train on. "
                "Nothing was recorded."
            )
        if allowed.sum() == keep.sum():
            return keep, planned
        keep = allowed
        planned = plan_for(keep)
    raise RuntimeError("the set of units within their budget did not settle in 50 rounds")


def write_exclusions(layout: Layout, keep: np.ndarray) -> None:
    """The training-part rows left out by the filter: the audit must not count them as members."""
    io.write_npz(layout.excluded, rows=np.flatnonzero(~keep))


def charge_of(
    config: Config, layout: Layout, planned: MechanismDescription | None, purpose: str, units: np.ndarray
) -> Charge:
    """What this run asks of the ledger: the planned spend for the units of its training data, charged to their
    lineage; once the spend has its id, it is noted beside the model (:data:`Layout.spend`)."""
    ledger = open_ledger(config)

    def note_beside_the_model(spend: Spend) -> None:
        io.write_json(
            layout.spend,
            {
                "spend_id": spend.id,
                "ledger": ledger.location,
                "epsilon_alone": spend.epsilon_alone,
                "lineage": spend.lineage,
                "units": spend.n_units,
            },
        )
        fault_point("train:reserved")

    return Charge(
        ledger,
        io.read_json(layout.prepared_meta)["data_version"],
        planned,
        purpose,
        config.ledger.epsilon_budget,
        kl_budget=config.ledger.kl_budget,
        lineage=lineage_of(config),
        units=units,
        mode=config.ledger.on_exhausted,
        before_start=note_beside_the_model,
    )


def train(config: Config, progress: bool = False) -> dict[str, Any]:
    """Record the planned spend in the ledger, then train; save model, spec, mechanism."""
    preflight(config)
    layout = Layout(config)
    forget_search(layout)
    trainer = trainer_for(config)
    meta = io.read_json(layout.prepared_meta)
    x_np, y_np = load_part(layout, "train")
    units, n_classes, d = load_units(layout), len(meta["classes"]), int(x_np.shape[1])
    keep, planned = filter_units(config, units, lambda keep: trainer.plan(config, int(keep.sum()), d, n_classes))
    x_np, y_np, units = x_np[keep], y_np[keep], units[keep]
    check_delta(config, int(x_np.shape[0]))
    check_model(trainer, config, d, n_classes)
    sigma = trainer.noise_multiplier(config)
    write_exclusions(layout, keep)
    charge = charge_of(config, layout, planned, f"{trainer.name} model ({config.data.source})", units)

    def train_and_save(outcome: dict[str, Any]) -> dict[str, Any]:
        fault_point("train:started")  # the spend counts from here; the previous run's model is still in place
        held_out = load_part(layout, "audit") if trainer.guarantee == "kl" else None  # KL-estimate probes
        result = fit(
            config,
            x_np,
            y_np,
            n_classes,
            private=trainer.private,
            noise_multiplier=sigma,
            seed=config.train.seed,
            progress=progress,
            held_out=held_out,
        )
        if result.mechanism != planned:
            raise RuntimeError("the trainer's mechanism differs from the one recorded in the ledger")
        metrics = save_trained(
            config,
            layout,
            result.model,
            result.mechanism,
            x_np,
            y_np,
            result.history,
            {"units_excluded": int((~keep).sum())},
        )
        outcome.update({"steps": result.history.get("steps"), **stamp_for(layout)})
        return metrics

    metrics, _ = charged_run(charge, train_and_save)
    return metrics


def tune(config: Config, progress: bool = False) -> dict[str, Any]:
    """Private hyperparameter search in place of :func:`train` (see :mod:`dpml.train.search`).

    The search's whole cost (Papernot & Steinke for a random number of candidates, composition
    for a fixed one) is recorded in the ledger before the first candidate trains; σ (or NoisyCGD's
    per-candidate μ) is calibrated so that this whole cost meets ``dp.target_epsilon``.
    """
    check_tunable(config)
    preflight(config)
    layout = Layout(config)
    forget_search(layout)
    meta = io.read_json(layout.prepared_meta)
    x_np, y_np = load_part(layout, "train")
    units, trainer = load_units(layout), trainer_for(config)

    def plan_for(m: int) -> Any:
        return trainer.search_plan(config, m - validation_rows(m, config).size, m)

    keep, _ = filter_units(config, units, lambda keep: plan_for(int(keep.sum())).mechanism)
    x_np, y_np, units = x_np[keep], y_np[keep], units[keep]
    n = int(x_np.shape[0])
    check_delta(config, n)
    check_model(trainer, config, int(x_np.shape[1]), len(meta["classes"]))
    write_exclusions(layout, keep)
    rows = validation_rows(n, config)
    fit_mask = np.ones(n, dtype=bool)
    fit_mask[rows] = False
    x_fit, y_fit = x_np[fit_mask], y_np[fit_mask]
    plan = plan_for(n)
    selection = plan.mechanism.selection.describe() if plan.mechanism.selection else ""
    charge = charge_of(config, layout, plan.mechanism, f"dpml tune: {selection} ({config.data.source})", units)

    def search_and_save(outcome: dict[str, Any]) -> dict[str, Any]:
        best = run_search(config, x_fit, y_fit, x_np[rows], y_np[rows], len(meta["classes"]), plan, progress)
        if best is None:
            raise RuntimeError(
                "the random number of candidates came out K = 0: nothing to release "
                "(the search's privacy cost stays recorded in the ledger)"
            )
        io.write_npz(layout.validation, rows=rows)
        io.write_json(
            layout.tuning,
            {
                "chosen": best.chosen,
                "noisy_validation_accuracy": best.noisy_validation_accuracy,
                "selection": selection or None,
                "space": config.tune.space,
                "validation_records": int(rows.size),
            },
        )
        extra = {
            "noisy_validation_accuracy": best.noisy_validation_accuracy,
            "units_excluded": int((~keep).sum()),
            **{f"chosen.{k}": v for k, v in best.chosen.items()},
        }
        metrics = save_trained(
            with_hyperparameters(config, best.chosen),
            layout,
            best.model,
            plan.mechanism,
            x_fit,
            y_fit,
            best.history,
            extra,
        )
        outcome.update({"chosen": best.chosen, **stamp_for(layout)})
        return metrics

    metrics, _ = charged_run(charge, search_and_save)
    return metrics


def keep_model_source(config: Config, layout: Layout) -> None:
    """A custom model's source file as it was when the model trained (logged with the MLflow run)."""
    source = factory_source(config.model.factory) if config.model.factory else None
    if source is None:
        layout.model_source.unlink(missing_ok=True)
        return
    with io.atomic_path(layout.model_source) as temp:
        temp.write_bytes(source.read_bytes())


TIMED = frozenset({"train_physical_chunk"})
"""Train metrics chosen by timing on this machine (the tuned chunk, :mod:`dpml.train.chunking`): left out of
``metrics.json``, which must reproduce exactly under ``dvc repro``, and kept on the train stage's record (its
nested MLflow run)."""


def save_trained(
    config: Config,
    layout: Layout,
    model: torch.nn.Module,
    mechanism: MechanismDescription | None,
    x_fit: np.ndarray,
    y_fit: np.ndarray,
    history: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the released model, its spec, its mechanism and the train metrics; return the metrics with the
    entries that depend on this machine's timing (:data:`TIMED`), which ``metrics.json`` leaves out."""
    n_classes = len(io.read_json(layout.prepared_meta)["classes"])
    with io.atomic_path(layout.model) as temp:
        torch.save(model.state_dict(), temp)
    io.write_json(layout.model_spec, model_spec(config, int(x_fit.shape[1]), n_classes).to_dict())
    keep_model_source(config, layout)
    io.write_json(layout.mechanism, mechanism.to_dict() if mechanism else None)
    x_test, y_test = load_part(layout, "test")
    metrics = {
        "test_accuracy": accuracy(model, x_test, y_test),
        "train_accuracy": accuracy(model, x_fit, y_fit),
        "device": str(pick_device(config.train.device)),
        "noise_seed_fixed": noise_seed_is_fixed(),
        **{f"train_{k}": v for k, v in history.items() if k != "seconds"},  # the stage record has the times
        **(extra or {}),
    }
    if mechanism is not None:
        metrics["noise_multiplier"] = released_noise_multiplier(config, mechanism.to_dict())
    if config.model.kind == "lipschitz":  # seed 004 App. A.3: certified robustness comes with the Lipschitz model
        robust = certified_accuracy(model, x_test, y_test)  # type: ignore[arg-type]
        metrics |= {f"robust_{k}": v for k, v in robust.items() if k != "records"}
    io.write_json(layout.train_metrics, {k: v for k, v in metrics.items() if k not in TIMED})
    return metrics
