"""dpml as a library: train any ``nn.Module`` with DP-SGD on a map-style ``Dataset``, get its certificate.

:func:`train_private` is the pipeline's DP-SGD (Abadi et al. 2016, with true Poisson sampling) for
notebooks and other pipelines. Step t (:func:`dpml.train.dpsgd.run_dpsgd_steps`):

    B_t = {i : U_i < q}, U_i ~ Uniform(0, 1)                         (Poisson sampling at rate q)
    ĝ_t = (Σ_{i∈B_t} clip_C(∇ℓ_i(θ_t)) + N(0, σ²C² I)) / (q n),  θ_{t+1} = optimizer(θ_t, ĝ_t)

for T = round(epochs / q) steps. B_t is read in physical chunks of at most ``physical_batch_size``
records (:mod:`dpml.train.dataset_steps`), so memory is bounded whatever |B_t| turns out to be. The
mechanism is T Poisson-subsampled Gaussian steps with sensitivity C under the chosen neighbouring
relation; its (ε, δ) is certified by the smallest answer of the certifying accountants
(:func:`dpml.accounting.accountants.certify`), and σ, when a target ε is given, is the smallest whose
certified ε meets it (:func:`dpml.accounting.calibrate.calibrate_noise_multiplier`).

The guarantees of the pipeline hold here too, in this order, before any record is read for training:
every argument is checked (an error names it, its value and what is allowed); the model is probed by
:func:`dpml.train.clipping_check.plan_clipping` (a model the clipping engine cannot handle exactly is
refused); with a ``ledger``, the spend is reserved for the records' privacy units (refused when one
would go over ``epsilon_budget``); every record is checked, its label against the model's classes and its
input's shape against the first's (:func:`dpml.train.dataset_steps.check_every_record`: a bad record met in
training would end a run whose spend already counts; a failure cancels the reservation); and the spend is
marked ``started`` — from then on it counts, whatever happens. The Poisson samples and the noise come from a
secret seed (:func:`dpml.train.noise.secret_noise_seed`).

Distributed: ``world_size = N`` starts N processes on this machine (:func:`dpml.train.distributed.spawn`;
the model and the data set must then be picklable); under ``torchrun`` every process calls
:func:`train_private` and rank 0 reserves, logs and certifies (:mod:`dpml.train.distributed`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from dpml.devices import pick_device
from dpml.models.library import adapt, check_input_kind, eager, input_vocabulary
from dpml.sections import DpConfig, TrainSettings
from dpml.sections_stores import LedgerConfig
from dpml.accounting.accountants import certify
from dpml.accounting.calibrate import calibrate_noise_multiplier
from dpml.accounting.mechanism import MechanismDescription
from dpml.ledger.ledger import Ledger, Spend, ledger_of
from dpml.ledger.spending import Charge, charged_run
from dpml.data.units import digests_of_ids
from dpml.routing import resolve_api_tracking
from dpml.train.clipping import LossFn
from dpml.train.clipping_check import ClippingPlan, check_autocast, plan_clipping, probe_batch
from dpml.train.dataset_steps import (
    MappingRecords,
    check_every_record,
    check_record,
    dataset_size,
    dataset_steps,
    mapping_pair,
)
from dpml.train.distributed import Collective, check_picklable, from_environment, process_device, spawn
from dpml.train.trainers.dpsgd import DpSgdSettings
from dpml.train.dpsgd import (
    AUTOCAST,
    DpSgdLoop,
    dpsgd_mechanism,
    make_optimizer,
    number_of_steps,
    run_dpsgd,
)
from dpml.train.steps import Step, poisson_batches
from dpml.train.noise import secret_noise_seed
from dpml.train.token_records import TokenRecords, check_token_records
from dpml.api_settings import OptimizerChoice, check_workers, ledger_terms, library_settings

__all__ = ["DpConfig", "DpSgdSettings", "LedgerConfig", "PrivateTraining", "train_private"]
"""The library's names: the call, its result, and the pipeline's sections it takes its settings as."""


@dataclass
class PrivateTraining:
    """What :func:`train_private` returns: the trained model (the one passed in, trained in place and
    left on the training device), its certificate, mechanism and history, and where it was recorded."""

    model: nn.Module
    certificate: dict[str, Any]
    mechanism: MechanismDescription
    history: dict[str, Any] = field(default_factory=dict)
    spend_id: int | None = None
    mlflow_run_id: str | None = None

    @property
    def epsilon(self) -> float:
        return float(self.certificate["epsilon"])


@dataclass(frozen=True)
class RunSettings:
    """The checked settings of one call (everything a process of a distributed run needs)."""

    n: int
    sample_rate: float
    steps: int
    noise_multiplier: float
    clip_norm: float
    optimizer: OptimizerChoice
    learning_rate: float
    momentum: float
    physical_batch_size: int
    device: str
    num_workers: int
    n_classes: int
    progress: bool
    autocast: str = "none"
    tune_physical_batch: bool = True
    input_shape: tuple[int, ...] = ()
    input_dtype: torch.dtype = torch.float32


def _first_input(item: Any) -> torch.Tensor:
    """The input of the first record, ``dataset[0]``, read once (checked as a pair)."""
    check_record(item, 0)
    return torch.as_tensor(item[0])


def model_inputs(
    model: nn.Module, dataset: Dataset[Any], n: int, inputs: str
) -> tuple[nn.Module, Dataset[Any], torch.Tensor]:
    """The model as the engine calls it (one tensor in, logits out: :func:`dpml.models.library.adapt`), the
    records as it reads them, and the first input. Token inputs (a forward taking ``input_ids`` and
    ``attention_mask``) are checked record by record here, before any work (:mod:`dpml.train.token_records`).
    A ``torch.compile`` wrapper is trained through the module it compiled (:func:`dpml.models.library.eager`); mapping
    records are read as pairs (:func:`dpml.train.dataset_steps.mapping_pair`)."""
    model = eager(model)
    if check_input_kind(inputs, model):
        check_token_records(dataset, n, input_vocabulary(model))
        dataset = TokenRecords(dataset)
        first = _first_input(dataset[0])
        return adapt(model, tuple(first.shape), first.dtype, "tokens"), dataset, first
    item = dataset[0]
    if isinstance(item, Mapping):  # a Hugging Face datasets set's {"pixel_values": x, "label": y}
        dataset, item = MappingRecords(dataset), mapping_pair(item, 0)
    first = _first_input(item)
    dtype = first.dtype if not first.dtype.is_floating_point else next(model.parameters()).dtype
    return adapt(model, tuple(first.shape), dtype, "tensor"), dataset, first


def number_of_classes(model: nn.Module, first_input: torch.Tensor) -> int:
    """The model's output width on one record of ``first_input``'s shape and dtype: the labels must lie in [0, that).
    The record is the clipping probe's synthetic one (:func:`dpml.train.clipping_check.probe_batch`), not
    ``first_input``: no private record reaches the model before the probe has passed it (a forward pass may write
    into its parameters, :mod:`dpml.train.probe_checks`)."""
    synthetic = probe_batch(model, tuple(first_input.shape), first_input.dtype, size=0).to(first_input.dtype)
    was_training = model.training
    model.eval()
    with torch.no_grad(), torch.random.fork_rng():
        out = model(synthetic.to(next(model.parameters()).device))
    model.train(was_training)
    if out.dim() != 2:
        raise ValueError(
            f"model: its output on one record has shape {tuple(out.shape)}; a classifier returns "
            "(batch, classes) logits, one row of class scores per record (a language model's head gives a row per "
            "token: train a sequence-classification head, ...ForSequenceClassification)"
        )
    return int(out.shape[1])


def _label_tensor(dataset: Dataset[Any]) -> torch.Tensor | None:
    """A ``TensorDataset``'s labels, its last tensor (also under the token records' reading of it), for the check of
    every label before any work; None for any other data set (read record by record)."""
    inner = dataset.dataset if isinstance(dataset, TokenRecords) else dataset
    return inner.tensors[-1] if isinstance(inner, TensorDataset) else None


def build_optimizer(
    choice: OptimizerChoice, model: nn.Module, learning_rate: float, momentum: float
) -> torch.optim.Optimizer:
    """The user's optimizer factory over the trainable parameters, or the pipeline's ``sgd``/``adam``."""
    if callable(choice):
        return choice([p for p in model.parameters() if p.requires_grad])
    return make_optimizer(model, choice, learning_rate, momentum)


def train_in_process(
    collective: Collective | None,
    model: nn.Module,
    dataset: Dataset[Any],
    run: RunSettings,
    loss_fn: LossFn,
    plan: ClippingPlan,
    seed: int,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's part of the run (the whole run when ``collective`` is None)."""
    device = process_device(run.device, collective.rank if collective else 0)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    model.to(device)
    optimizer = build_optimizer(run.optimizer, model, run.learning_rate, run.momentum)
    dtype = next(p for p in model.parameters()).dtype
    loop = DpSgdLoop(
        run.steps,
        run.clip_norm,
        run.noise_multiplier,
        run.sample_rate * run.n,
        seed,
        loss_fn,
        plan,
        run.input_shape,
        run.input_dtype,
        run.physical_batch_size,
        run.tune_physical_batch,
        AUTOCAST[run.autocast],
        run.progress,
    )

    def steps_in_chunks(chunk: int) -> Iterator[Step]:
        return dataset_steps(
            dataset,
            poisson_batches(run.n, run.sample_rate, run.steps, seed),
            physical_batch_size=chunk,
            device=torch.device(device),
            dtype=dtype,
            n_classes=run.n_classes,
            collective=collective,
            num_workers=run.num_workers,
        )

    history = run_dpsgd(model, optimizer, loop, steps_in_chunks, collective)
    history["world_size"] = collective.world_size if collective else 1
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, history


def open_book(ledger: str | Path | Ledger | LedgerConfig | None, delta: float) -> Ledger | None:
    """The ledger ``ledger=`` names: a :class:`Ledger` as given; a ``LedgerConfig`` as the pipeline opens it
    (at its own δ); a SQLite path or a URL at the run's δ."""
    if ledger is None or isinstance(ledger, Ledger):
        return ledger
    return ledger_of(ledger) if isinstance(ledger, LedgerConfig) else Ledger(ledger, delta)


def charge_of(
    book: Ledger | None,
    mechanism: MechanismDescription,
    lineage: str,
    budget: float,
    privacy_units: Sequence[object] | None,
    label: str,
    before_start: Callable[[Spend], None],
) -> Charge | None:
    """What the call asks of ``book`` (``None``: an uncharged run): the spend charged to ``lineage`` (also its
    dataset version: the API's records have no version of their own), per unit of ``privacy_units``;
    ``before_start``, the check of every record, runs once the reservation is granted (a run over budget reads no
    label) and cancels it when it fails (:func:`dpml.ledger.spending.reserve_and_start`)."""
    if book is None:
        return None
    units = digests_of_ids(privacy_units) if privacy_units is not None else None
    return Charge(book, lineage, mechanism, label, budget, lineage=lineage, units=units, before_start=before_start)


def train_private(
    model: nn.Module,
    dataset: Dataset[Any],
    dp: DpConfig | None = None,
    train: TrainSettings | None = None,
    *,
    expected_batch_size: int | None = None,
    num_workers: int = 0,
    seed: int | None = None,
    inputs: str = "auto",
    ledger: str | Path | Ledger | LedgerConfig | None = None,
    epsilon_budget: float | None = None,
    lineage: str | None = None,
    privacy_units: Sequence[object] | None = None,
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str | None = None,
    mlflow_artifact_location: str | None = None,
    run_name: str | None = None,
    progress: bool = False,
    **settings: Any,
) -> PrivateTraining:
    """Train ``model`` in place with DP-SGD on ``dataset`` and certify it (module docstring for the math).

    ``dataset``: map-style, ``dataset[i]`` a pair (input tensor, integer label), or a mapping of one input and
    ``labels`` / ``label`` (a Hugging Face ``datasets`` set in torch format); the labels must lie in
    [0, the model's output width).

    The settings are the pipeline's own sections (:mod:`dpml.api_settings`): ``dp=`` a
    :class:`dpml.DpConfig` (``delta``, ``clip_norm``, exactly one of ``target_epsilon`` — σ calibrated to
    meet it — and ``noise_multiplier`` σ, ``neighbouring``, ``allow_delta_above_inverse_n``) and ``train=``
    a :class:`dpml.DpSgdSettings` (``epochs``, ``sample_rate`` q, ``optimizer``, ``learning_rate``,
    ``momentum``, ``loss``, ``device``, ``physical_batch_size``, ``world_size``, ``autocast``,
    ``tune_physical_batch`` …), with the pipeline's defaults. Each may instead be given as a keyword
    (``delta=1e-5, epochs=3``), validated by its section the same way; a setting given both ways is refused.
    ``optimizer`` and ``loss`` may also be functions: params → a torch optimizer (it only post-processes
    the noisy gradient), and (logits, labels) → per-example losses of shape (B,).
    ``expected_batch_size``: q·n, in place of ``sample_rate``.

    ``seed``: ``None`` (a secret seed of batches and noise; what a model to release must use) or a fixed
    one to reproduce a run. ``ledger`` (a path, URL, :class:`dpml.ledger.ledger.Ledger` or the pipeline's
    :class:`dpml.LedgerConfig`, which then holds ``epsilon_budget`` and the lineage as ``dataset``): charge the run
    to ``lineage``'s account, per unit of ``privacy_units`` (one id per record; ``None`` charges every unit
    of the lineage), refusing it if a unit would exceed ``epsilon_budget`` at ``delta``.
    ``mlflow_tracking_uri``: log the run (settings, ε, certificate, weights) to that MLflow store, in
    ``mlflow_experiment`` (created with ``mlflow_artifact_location`` if new; MLflow's default is ./mlruns).
    Each is resolved once, when the call starts: the argument, else MLflow's own variable
    (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``), else not logged / ``dpml`` (:mod:`dpml.routing`);
    MLflow's process-wide URIs are neither read nor changed, so calls with other settings never mix.
    ``autocast``: ``bf16`` runs the forward pass under bf16 autocast (norms, sums and noise in float32).
    ``tune_physical_batch``: clip in the fastest chunk of at most ``physical_batch_size`` records, timed
    on a synthetic probe before training (:mod:`dpml.train.chunking`); the sums are the same either way.
    ``inputs``: ``auto`` calls a model whose forward names ``input_ids`` and ``attention_mask`` with them,
    reading ``dataset[i]`` as ``(input_ids, attention_mask, label)`` (or ``(input_ids, label)``, or a mapping of
    them: :mod:`dpml.train.token_records`), and any
    other model with the input tensor; ``tokens``/``tensor`` insist. A forward may return an output
    object with ``.logits`` (:mod:`dpml.models.library`); ``result.model`` is still the module passed in.
    """
    mlflow_tracking_uri, mlflow_experiment = resolve_api_tracking(mlflow_tracking_uri, mlflow_experiment, os.environ)
    n = dataset_size(dataset)
    checked = library_settings(n, dp, train, settings, expected_batch_size)
    check_workers(num_workers)
    epsilon_budget, lineage = ledger_terms(ledger, epsilon_budget, lineage, privacy_units, n)
    dpc, tr, q, loss_fn = checked.dp, checked.train, checked.sample_rate, checked.loss
    user_model = model
    model, dataset, first = model_inputs(user_model, dataset, n, inputs)  # token records checked before any work
    input_dtype = first.dtype if not first.dtype.is_floating_point else next(model.parameters()).dtype
    # refuses before any spend
    n_classes = number_of_classes(model, first)
    plan = plan_clipping(model, loss_fn, tuple(first.shape), input_dtype, neighbouring=dpc.neighbouring)
    check_autocast(model, loss_fn, tuple(first.shape), input_dtype, str(pick_device(tr.device)), AUTOCAST[tr.autocast])
    steps = number_of_steps(tr.epochs, q)
    sigma = (
        dpc.noise_multiplier
        if dpc.noise_multiplier is not None
        else calibrate_noise_multiplier(dpc.target_epsilon, q, steps, dpc.delta, dpc.neighbouring)
    )  # type: ignore[arg-type]
    mechanism = dpsgd_mechanism(q, sigma, tr.epochs, dpc.neighbouring, dpc.clip_norm, n)
    certificate = certify(mechanism, dpc.delta)
    run = RunSettings(
        n,
        q,
        steps,
        sigma,
        dpc.clip_norm,
        checked.optimizer,
        tr.learning_rate,
        tr.momentum,
        tr.physical_batch_size,
        str(pick_device(tr.device)),
        num_workers,
        n_classes,
        progress,
        tr.autocast,
        tr.tune_physical_batch,
        tuple(first.shape),
        input_dtype,
    )
    collective = from_environment()  # under torchrun: this process's rank
    if collective is None and tr.world_size > 1:
        check_picklable(
            "world_size", tr.world_size, model=model, dataset=dataset, loss=loss_fn, optimizer=checked.optimizer
        )
    if num_workers > 0:  # the loader's workers start from a fork server and receive the dataset pickled
        check_picklable("num_workers", num_workers, "read in this process (num_workers = 0)", dataset=dataset)
    lead = collective is None or collective.lead
    agreement_device = process_device(run.device, collective.rank) if collective else "cpu"
    book = open_book(ledger, dpc.delta) if lead else None
    label = f"dpml.train_private: {type(user_model).__name__} ({n} records)"

    def check_records(spend: Spend | None = None) -> None:
        check_every_record(dataset, n, n_classes, tuple(first.shape), _label_tensor(dataset))

    if ledger is None:  # (every process alike: none reaches a collective with a bad record)
        check_records()
    charge = charge_of(book, mechanism, lineage, epsilon_budget, privacy_units, label, check_records)  # type: ignore[arg-type]

    def agree(refusal: BaseException | None) -> None:
        """Under torchrun, no process trains when rank 0's reservation was refused."""
        if collective is not None and not collective.all_agree(refusal is None, agreement_device):
            raise refusal or RuntimeError("rank 0 refused the run before training (see its error); nothing trained")

    def train_here(outcome: dict[str, Any]) -> dict[str, Any]:
        secret = seed if seed is not None else secret_noise_seed()
        if collective is not None:
            secret = collective.broadcast_int(secret, agreement_device)
            _, history = train_in_process(collective, model, dataset, run, loss_fn, plan, secret)
        elif tr.world_size > 1:
            state, history = spawn(
                tr.world_size, run.device, train_in_process, model, dataset, run, loss_fn, plan, secret
            )
            model.load_state_dict(state)
            model.to(process_device(run.device, 0))
        else:
            _, history = train_in_process(None, model, dataset, run, loss_fn, plan, secret)
        outcome["steps"] = history.get("steps")
        return history

    history, spend = charged_run(charge, train_here, agree)
    result = PrivateTraining(user_model, certificate, mechanism, history, spend.id if spend else None)
    if mlflow_tracking_uri is not None and lead:
        logged = {
            "sample_rate": q,
            "steps": steps,
            "noise_multiplier": sigma,
            "clip_norm": dpc.clip_norm,
            "epochs": tr.epochs,
            "delta": dpc.delta,
            "neighbouring": dpc.neighbouring,
            "n": n,
            "physical_batch_size": tr.physical_batch_size,
            "physical_chunk": history.get("physical_chunk"),
            "world_size": history.get("world_size", 1),
            "spend_id": result.spend_id,
        }
        from dpml.tracking.library_runs import log_training  # lazy: MLflow only where a run is recorded

        result.mlflow_run_id = log_training(
            mlflow_tracking_uri,
            mlflow_experiment,
            run_name,
            logged,
            result.certificate,
            result.model,
            float(result.history.get("seconds", 0.0)),
            mlflow_artifact_location,
        )
    return result
