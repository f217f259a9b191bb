"""DP-SGD with true Poisson sampling (Abadi et al. 2016), and the non-private baseline.

One step t of :func:`train_dpsgd`:
    B_t = {i : U_i < q}, U_i ~ Uniform(0, 1) independently     (Poisson sampling, rate q)
    ĝ_t = (Σ_{i∈B_t} clip_C(∇ℓ_i(θ_t)) + N(0, σ²C² I)) / (q n)
    θ_{t+1} = optimizer(θ_t, ĝ_t)
The denominator is the *expected* batch size q·n, a public constant: dividing by |B_t| would
leak the batch size. An empty batch still takes a (pure-noise) step, as the analysis assumes.
T = round(epochs / q) steps. The optimizer only post-processes ĝ_t, so any torch optimizer
keeps the guarantee. The trainer describes the mechanism; :mod:`dpml.accounting` prices it.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dpml.devices import host_to_device, keep_freed_cpu_memory, older_objects_left_out_of_collections
from dpml.models.lipschitz import (
    hinge_kantorovich_rubinstein,
    kantorovich_rubinstein,
    multiclass_hinge,
    tau_cross_entropy,
)
from dpml.accounting.mechanism import MechanismDescription, Neighbouring, PoissonGaussianSteps
from dpml.progress import progress_range
from dpml.train.chunking import physical_chunk
from dpml.train.captured import clipped_chunk_sum
from dpml.train.clipping import LossFn
from dpml.train.nonfinite import refuse_non_finite_model
from dpml.train.diracs import DiracGradients
from dpml.train.clipping_check import ClippingPlan, plan_clipping
from dpml.train.distributed import Collective
from dpml.train.noise import NoiseStream, cpu_noise_stream, gaussian_noise
from dpml.train.steps import Chunks, Step, poisson_batches, share_of_batch, tensor_chunks


@dataclass
class TrainResult:
    model: nn.Module
    mechanism: MechanismDescription | None
    history: dict[str, Any] = field(default_factory=dict)
    canary_scores: np.ndarray | None = None


StepObserver = Callable[[torch.Tensor, nn.Module], None]


@dataclass(frozen=True)
class GradientCanaries:
    """White-box Dirac gradient canaries and a step observer: the audit's instrument on one DP-SGD run
    (Steinke, Nasr, Jagielski 2023, §6, with the canaries moved in front of the clipping).

    Canary j is a record whose gradient is ``norm_multiple``·C·e_{k_j} (a Dirac on flat trainable-parameter
    coordinate k_j, distinct per canary, well above the clip norm). The canaries with ``included[j]``
    join the data set as records n, n+1, …: the trainer's own Poisson sampler draws them with the
    records, and the engine's own clipping (:func:`dpml.train.clipping.clipped_gradient_sum`) clips
    them with the records' factor line, so that what the audit sees of them is what the trainer does
    to any record. ``observer(batch, model)`` is called at every step just before the optimizer
    steps, with the step's batch (indices over the n + m_in records, canaries last) and the model
    whose ``.grad`` holds the update; the audit recomputes and tests everything from there
    (:mod:`dpml.audit.conformance`).
    """

    coordinates: np.ndarray  # (m,) flat trainable-parameter indices, distinct
    included: np.ndarray  # (m,) bool
    norm_multiple: float = 5.0
    observer: StepObserver | None = None

    def included_slots(self) -> np.ndarray:
        """Canary j of record n + r is ``included_slots()[r]``."""
        return np.flatnonzero(self.included)


def per_example_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y, reduction="none")


def per_example_squared(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """½‖z − e_y‖² (seed 001 Eq. 3.8's squared loss on one-hot labels)."""
    return 0.5 * (logits - F.one_hot(y, logits.shape[1]).to(logits.dtype)).pow(2).sum(1)


AUTOCAST: dict[str, torch.dtype | None] = {"none": None, "bf16": torch.bfloat16}
"""``train.autocast``: the forward pass's precision (norms, clipped sums and noise are float32 either way)."""

LOSSES: dict[str, LossFn] = {"cross_entropy": per_example_cross_entropy, "squared": per_example_squared}


@functools.lru_cache(maxsize=None)
def loss_function(name: str, tau: float = 1.0, alpha: float = 1.0) -> LossFn:
    """The per-example loss ``train.loss`` names (the Lipschitz losses of seed 004 included). One function
    per setting, so the clipping plans of a run's models (keyed by the loss) are computed once."""
    if name == "tau_cross_entropy":
        return tau_cross_entropy(tau)
    if name == "multiclass_hinge":
        return multiclass_hinge(1.0)
    if name == "kantorovich_rubinstein":
        return kantorovich_rubinstein()
    if name == "hinge_kantorovich_rubinstein":
        return hinge_kantorovich_rubinstein(alpha)
    return LOSSES[name]


def make_optimizer(model: nn.Module, name: str, learning_rate: float, momentum: float) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=learning_rate)
    return torch.optim.SGD(model.parameters(), lr=learning_rate, momentum=momentum)


def number_of_steps(epochs: float, sample_rate: float) -> int:
    """T = round(epochs / q), at least 1: each step sees q·n records in expectation."""
    return max(1, int(round(epochs / sample_rate)))


def clipped_chunks_and_noise(
    model: nn.Module,
    chunks: Chunks,
    clip_norm: float,
    noise_multiplier: float,
    generator: torch.Generator | NoiseStream | None,
    loss_fn: LossFn = per_example_cross_entropy,
    diracs: DiracGradients | None = None,
    exact: Collection[str] = (),
    autocast: torch.dtype | None = None,
    most_rows: int | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """One DP-SGD step's ingredients: Σ_i clip_C(∇ℓ_i) over the chunks of the batch (so a large Poisson
    batch runs in bounded memory; the audit's Dirac canaries, if any, join the first chunk), Gaussian
    noise N(0, σ²C² I) per trainable parameter drawn from ``generator`` by :func:`gaussian_noise` (or the
    next draw of a CPU noise stream, :func:`dpml.train.noise.cpu_noise_stream`; zeros where it is ``None``: a worker
    of a distributed run, whose lead draws the step's one noise), and how many records were
    clipped (a tensor: no device synchronisation in the training loop). ``exact``: the clipping plan's
    parameters (:func:`dpml.train.clipping_check.plan_clipping`); ``autocast``: the forward pass's
    lower precision (:func:`dpml.train.clipping.engine_pass`; norms, sums and noise stay float32); ``most_rows``: the
    physical batch size, where known (no chunk is larger)."""
    sums: dict[str, torch.Tensor] | None = None
    clipped: torch.Tensor | None = None  # (in torch's default dtype)
    for index, (x, y) in enumerate(chunks):
        chunk_sums, norms = clipped_chunk_sum(  # (on a GPU, replayed from a CUDA graph where that is exact and faster)
            model, loss_fn, x, y, clip_norm, diracs if index == 0 else None, exact, autocast, most_rows
        )
        if sums is None:  # the first chunk's sums are fresh tensors: they become the step's accumulators
            sums = chunk_sums
        else:
            for name, value in chunk_sums.items():
                sums[name] += value
        count = (~(norms <= clip_norm)).sum()  # (a record left out, its norm nan or inf, counts)
        clipped = count.to(torch.get_default_dtype()) if clipped is None else clipped + count
    if sums is None or clipped is None:  # an empty batch: no chunk at all
        params = trainable_parameters(model)
        sums = {name: torch.zeros_like(p) for name, p in params.items()}
        clipped = torch.zeros((), device=next(iter(params.values())).device)
    if isinstance(generator, NoiseStream):  # (the stream knows the parameters)
        return sums, generator.draw(noise_multiplier * clip_norm), clipped
    params = trainable_parameters(model)
    if generator is None:
        return sums, {name: torch.zeros_like(p) for name, p in params.items()}, clipped
    return sums, gaussian_noise(params, noise_multiplier * clip_norm, generator), clipped


def clipped_sum_and_noise(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    clip_norm: float,
    noise_multiplier: float,
    physical_batch_size: int,
    generator: torch.Generator,
    loss_fn: LossFn = per_example_cross_entropy,
    diracs: DiracGradients | None = None,
    exact: Collection[str] = (),
    autocast: torch.dtype | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """:func:`clipped_chunks_and_noise` of a batch held as tensors."""
    return clipped_chunks_and_noise(
        model,
        tensor_chunks(x, y, physical_batch_size, diracs is not None),
        clip_norm,
        noise_multiplier,
        generator,
        loss_fn,
        diracs,
        exact,
        autocast,
        physical_batch_size,
    )


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters DP-SGD updates: frozen ones (``requires_grad = False``) get neither gradient nor noise."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def dpsgd_mechanism(
    sample_rate: float,
    noise_multiplier: float,
    epochs: float,
    neighbouring: Neighbouring,
    clip_norm: float,
    dataset_size: int,
) -> MechanismDescription:
    """What :func:`train_dpsgd` does with these settings: known before training (the ledger needs it).

    With q = 1 it is **DP-GD** (seed 002): every step uses the full batch, so each step is a plain
    Gaussian mechanism on the clipped sum (the trainer is then named ``dpgd``). Seed 002 writes the
    step as θ ← θ − η(1/n)Σ clip(g_i) + sqrt(η)(2C/n)σ'·N(0, I): that is this mechanism under
    replace-one with σ = 2σ'/√η (noise std σC on the sum, sensitivity 2C), and its moments-
    accountant certificate ε = a + 2·sqrt(a·log(1/δ)), a = ηT/(2σ'²) = 2T/σ², is one of the
    accountants asked (``moments_accountant.closed_form``).
    """
    return MechanismDescription(
        trainer="dpgd" if sample_rate == 1.0 else "dpsgd",
        events=(PoissonGaussianSteps(sample_rate, noise_multiplier, number_of_steps(epochs, sample_rate)),),
        neighbouring=neighbouring,
        clip_norm=clip_norm,
        dataset_size=dataset_size,
        threat_model="all-iterates",
        notes=("Poisson sampling; noise std σ·C added to the clipped sum; divided by the expected batch size q·n",),
    )


def run_dpsgd_steps(
    model: nn.Module,
    steps: Iterable[Step],
    *,
    count: int,
    clip_norm: float,
    noise_multiplier: float,
    expected_batch: float,
    optimizer: torch.optim.Optimizer,
    noise_source: torch.Generator,
    loss_fn: LossFn,
    exact: Collection[str],
    observer: StepObserver | None = None,
    collective: Collective | None = None,
    progress: bool = False,
    autocast: torch.dtype | None = None,
) -> dict[str, Any]:
    """The DP-SGD loop: ĝ_t = (Σ_{i∈B_t} clip_C(∇ℓ_i) + N(0, σ²C² I)) / (q n), then the optimizer.

    Distributed (``collective``): each process clips its share of the one global sample B_t, the lead
    (rank 0) alone draws the noise, and the sums plus the noise are all-reduced, so every process holds
    the same ĝ_t as one process would: the mechanism, and its certificate, are the single-process ones.
    """
    params = trainable_parameters(model)
    if all(p.device.type == "cpu" for p in params.values()):
        keep_freed_cpu_memory()  # the pages a step frees serve the next step
    batch_sizes: list[int] = []
    clipped: list[torch.Tensor] = []
    start = time.perf_counter()
    lead = collective is None or collective.lead
    noise: torch.Generator | NoiseStream | None = noise_source if lead else None
    if lead and noise_source.device.type == "cpu":  # a GPU draws asynchronously already
        noise = cpu_noise_stream(noise_source, params, noise_multiplier * clip_norm)
    model.train()
    try:
        with older_objects_left_out_of_collections():  # (the user's heap out of the step's collections)
            for _, step in zip(progress_range(count, "DP-SGD", "step", progress), steps, strict=True):
                sums, noises, clipped_count = clipped_chunks_and_noise(
                    model,
                    step.chunks,
                    clip_norm,
                    noise_multiplier,
                    noise,
                    loss_fn,
                    step.diracs,
                    exact,
                    autocast,
                    step.most_rows,
                )
                update = [sums[name] for name in params]  # the sums are this step's own: updated in place
                # one multi-tensor launch, not one a tensor
                torch._foreach_add_(update, [noises[name] for name in params])
                if collective is not None:
                    clipped_count = collective.sum_in_place([*update, clipped_count])[-1]
                torch._foreach_div_(update, expected_batch)
                for p, gradient in zip(params.values(), update, strict=True):
                    p.grad = gradient
                clipped.append(clipped_count)
                if observer is not None:
                    observer(step.batch, model)
                optimizer.step()
                batch_sizes.append(int(step.batch.numel()))
    finally:
        if isinstance(noise, NoiseStream):
            noise.close()
    refuse_non_finite_model(model)  # (a GPU's loop leaves no record out: :mod:`dpml.train.nonfinite`)
    return {
        "steps": len(batch_sizes),
        "mean_batch_size": float(np.mean(batch_sizes)) if batch_sizes else 0.0,
        "empty_batches": int(sum(b == 0 for b in batch_sizes)),
        "clipped_fraction": float(torch.stack(clipped).sum()) / max(sum(batch_sizes), 1) if clipped else 0.0,
        "seconds": time.perf_counter() - start,
    }


@dataclass(frozen=True)
class DpSgdLoop:
    """The settings of one run of the DP-SGD loop (:func:`run_dpsgd`), the same for records held as tensors
    (:func:`train_dpsgd`) and for a map-style data set read by a loader (:func:`dpml.api.train_private`).

    ``steps`` T, ``clip_norm`` C, ``noise_multiplier`` σ, ``expected_batch`` q·n (the public divisor of the
    update); ``seed``: the run's secret seed (the loop seeds its noise generator with ``seed + 1``; the
    caller's Poisson sampler uses ``seed``); ``plan``: the clipping plan of the model
    (:func:`dpml.train.clipping_check.plan_clipping`); ``input_shape``/``input_dtype``: one record's input, for
    the chunk timing probe; ``physical_batch_size``: the largest chunk clipped at once (the fastest smaller one
    when ``tune_physical_batch``).
    """

    steps: int
    clip_norm: float
    noise_multiplier: float
    expected_batch: float
    seed: int
    loss_fn: LossFn
    plan: ClippingPlan
    input_shape: tuple[int, ...]
    input_dtype: torch.dtype
    physical_batch_size: int
    tune_physical_batch: bool = True
    autocast: torch.dtype | None = None
    progress: bool = False


def run_dpsgd(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loop: DpSgdLoop,
    steps_in_chunks: Callable[[int], Iterable[Step]],
    collective: Collective | None = None,
    observer: StepObserver | None = None,
) -> dict[str, Any]:
    """Pick this process's physical chunk (:func:`dpml.train.chunking.physical_chunk`: a distributed run's
    process clips 1/world_size of each batch), then run the T steps that ``steps_in_chunks(chunk)`` yields
    (:func:`run_dpsgd_steps`). The history has the chunk and the number of exactly clipped parameters."""
    share = loop.expected_batch / (collective.world_size if collective else 1)
    chunk = physical_chunk(
        loop.tune_physical_batch,
        model,
        loop.loss_fn,
        loop.input_shape,
        loop.input_dtype,
        loop.physical_batch_size,
        share,
        loop.plan.exact,
        loop.autocast,
    )
    device = next(iter(trainable_parameters(model).values())).device
    history = run_dpsgd_steps(
        model,
        steps_in_chunks(chunk),
        count=loop.steps,
        clip_norm=loop.clip_norm,
        noise_multiplier=loop.noise_multiplier,
        expected_batch=loop.expected_batch,
        optimizer=optimizer,
        noise_source=torch.Generator(device=device).manual_seed(loop.seed + 1),
        loss_fn=loop.loss_fn,
        exact=loop.plan.exact,
        observer=observer,
        collective=collective,
        progress=loop.progress and (collective is None or collective.lead),
        autocast=loop.autocast,
    )
    history["physical_chunk"] = chunk
    history["exact_clipping_parameters"] = len(loop.plan.exact_parameters)
    return history


def train_dpsgd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    sample_rate: float,
    epochs: float,
    clip_norm: float,
    noise_multiplier: float,
    neighbouring: Neighbouring,
    optimizer: torch.optim.Optimizer,
    seed: int,
    physical_batch_size: int = 1024,
    canaries: GradientCanaries | None = None,
    progress: bool = False,
    loss_fn: LossFn = per_example_cross_entropy,
    collective: Collective | None = None,
    autocast: torch.dtype | None = None,
    tune_physical_batch: bool = True,
) -> TrainResult:
    """Train in place with DP-SGD on records held as tensors; returns the model, its mechanism description
    and a history. ``collective``: this process's place in a distributed run (:mod:`dpml.train.distributed`);
    ``autocast``: ``torch.bfloat16`` for a bf16 forward pass (:func:`dpml.train.clipping.engine_pass`).

    Before the first step the clipping engine is checked on a synthetic probe batch of x's shape
    (:func:`dpml.train.clipping_check.plan_clipping`): a layer whose shortcut is wrong for this model
    takes the exact path, and a model the engine cannot handle exactly is refused; ``tune_physical_batch``:
    chunks of the fastest size ≤ ``physical_batch_size`` (:mod:`dpml.train.chunking`)."""
    if canaries is not None and collective is not None:
        raise ValueError("the audit's gradient canaries run in one process (collective must be None)")
    n = n_total = x.shape[0]
    plan = plan_clipping(model, loss_fn, tuple(x.shape[1:]), x.dtype, neighbouring=neighbouring)
    steps = number_of_steps(epochs, sample_rate)
    if canaries is not None:
        slots = torch.as_tensor(canaries.included_slots(), dtype=torch.long)
        coordinates = torch.as_tensor(np.asarray(canaries.coordinates), dtype=torch.long)
        n_total += int(slots.numel())  # included canaries are records n, n+1, … of the data set

    def steps_of_run(chunk: int) -> Iterator[Step]:
        for batch in poisson_batches(n_total, sample_rate, steps, seed):
            records, diracs = share_of_batch(batch, collective), None
            if canaries is not None:  # the audit's run: canaries are indices n, n+1, … of the sample
                records = batch[batch < n]
                diracs = DiracGradients(coordinates[slots[batch[batch >= n] - n]], canaries.norm_multiple * clip_norm)
            records = host_to_device(records, x.device)
            yield Step(batch, tensor_chunks(x[records], y[records], chunk, diracs is not None), diracs, chunk)

    loop = DpSgdLoop(
        steps,
        clip_norm,
        noise_multiplier,
        sample_rate * n_total,
        seed,
        loss_fn,
        plan,
        tuple(x.shape[1:]),
        x.dtype,
        physical_batch_size,
        tune_physical_batch,
        autocast,
        progress,
    )
    observer = canaries.observer if canaries is not None else None
    history = run_dpsgd(model, optimizer, loop, steps_of_run, collective, observer)
    mechanism = dpsgd_mechanism(sample_rate, noise_multiplier, epochs, neighbouring, clip_norm, n_total)
    return TrainResult(model, mechanism, history)


def train_nonprivate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    sample_rate: float,
    epochs: float,
    optimizer: torch.optim.Optimizer,
    seed: int,
    progress: bool = False,
    loss_fn: LossFn = per_example_cross_entropy,
) -> TrainResult:
    """Baseline: shuffled minibatches of size ⌈q·n⌉, mean loss, no clipping, no noise."""
    n = x.shape[0]
    batch_size = max(1, math.ceil(sample_rate * n))
    generator = torch.Generator().manual_seed(seed)
    steps, start = 0, time.perf_counter()
    model.train()
    epoch_count = max(1, int(round(epochs)))
    for _ in progress_range(epoch_count, "SGD", "epoch", progress):
        order = host_to_device(torch.randperm(n, generator=generator), x.device)
        for chunk in torch.split(order, batch_size):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x[chunk]), y[chunk]).mean().backward()
            optimizer.step()
            steps += 1
    return TrainResult(
        model, None, {"steps": steps, "mean_batch_size": float(batch_size), "seconds": time.perf_counter() - start}
    )
