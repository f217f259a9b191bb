"""Clipless DP-SGD with Lipschitz networks (seed 004, Béthune et al., Algorithm 2).

No per-example clipping: with inputs of norm ≤ X0, the Lipschitz layers of
:mod:`dpml.models.lipschitz` (projected after every step) and an L-Lipschitz loss, every
per-example gradient has the analytic bound Δ_p per parameter (Algorithm 1,
:func:`dpml.models.lipschitz.gradient_bounds`), fixed before training. One step t:

    B_t = Poisson sample (rate q),   s = Σ_{i∈B_t} ∇ℓ_i   (one ordinary backward pass),
    global noise:    ĝ = (s + N(0, σ²Δ² I)) / (q n),        Δ = sqrt(Σ_p Δ_p²),
    per-layer noise: ĝ_d = (s_d + N(0, σ²Δ_d² I)) / (q n),  Δ_d = sqrt(Σ_{p∈d} Δ_p²),
    θ ← optimizer(θ, ĝ);  project every layer in place (post-processing).

Privacy: with global noise each step is the Poisson-subsampled Gaussian with noise multiplier σ
relative to the per-example bound Δ, exactly DP-SGD's event with C = Δ. With per-layer noise the
whitened sensitivity is sqrt(Σ_d (Δ_d/(σΔ_d))²) = √D/σ for D layers, so each step is the
subsampled Gaussian with multiplier σ/√D (the digest: D per-layer Gaussians with the same σ cost
like one with σ/√D). The neighbouring relation sets the sensitivity as for DP-SGD (add/remove Δ,
replace-one 2Δ), which is the errata's point: the accountant and the sensitivity use one relation.

**Soundness check.** The bounds assume ‖W‖₂ ≤ 1 for every projected layer at every step; power
iteration estimates the spectral norm from below. So the trainer checks a certified upper bound on
every constrained operator's norm after every epoch (:func:`largest_spectral_norm`: the exact σ_max
of dense weights, the FFT bound of convolutions) and, after training, the actual per-example
gradient norms of every parameter on (up to ``soundness_records``) training records against their
bounds. A violation is reported in the history and fails the certificate
(:meth:`dpml.train.trainers.clipless.Clipless.certify`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dpml.models.lipschitz import LipschitzLayer, gradient_bounds, project_all
from dpml.accounting.mechanism import MechanismDescription, Neighbouring, PoissonGaussianSteps
from dpml.progress import progress_range
from dpml.train.clipping import LossFn, per_example_gradients
from dpml.train.dpsgd import TrainResult, number_of_steps
from dpml.train.steps import poisson_batch
from dpml.train.noise import gaussian


@dataclass(frozen=True)
class GradientBounds:
    """Per-parameter bounds Δ_p and their grouping into layers (the prefix before the first dot)."""

    per_parameter: dict[str, float]

    @property
    def total(self) -> float:
        return math.sqrt(sum(b * b for b in self.per_parameter.values()))

    def per_layer(self) -> dict[str, float]:
        layers: dict[str, float] = {}
        for name, bound in self.per_parameter.items():
            layer = name.split(".")[0]
            layers[layer] = math.sqrt(layers.get(layer, 0.0) ** 2 + bound * bound)
        return layers


def clipless_bounds(model: nn.Sequential, input_bound: float, loss_lipschitz: float) -> GradientBounds:
    return GradientBounds(gradient_bounds(model, input_bound, loss_lipschitz))


def effective_noise_multiplier(noise_multiplier: float, noise: str, layers: int) -> float:
    """σ for global noise; σ/√D for per-layer noise over D parameterised layers (module docstring)."""
    return noise_multiplier if noise == "global" else noise_multiplier / math.sqrt(layers)


@dataclass(frozen=True)
class LossClipping:
    """Loss-gradient clipping with a privately estimated threshold (seed 004 §3.1 and App. B.5).

    Each step clips every example's ‖∂ℓ/∂z‖ (the logits' gradient, b × classes: cheap) to C_t, which
    turns the loss constant L of Algorithm 1 into min(L, C_t) — every bound, and so the noise, scales
    by min(L, C_t)/L. C_t tracks the ``quantile`` γ of the loss-gradient norms by Andrew et al.'s
    (2021) private quantile: the step also releases the count of unclipped examples plus
    N(0, ``count_noise``²), b̃ = (count + noise)/(qn), and C_{t+1} = min(L, C_t·exp(−``learning_rate``·(b̃ − γ))).
    The count has sensitivity 1 and is released on the same Poisson batch as the gradient sum, so
    the pair is one subsampled Gaussian with whitened sensitivity sqrt(1/σ² + 1/σ_b²): multiplier
    σ_eff = (σ⁻² + σ_b⁻²)^(−1/2) — the quantile's privacy cost is charged in the certificate. (Under
    replace-one the count moves by at most 1, less than the relation's 2: the charge is conservative.)
    """

    quantile: float
    initial: float
    count_noise: float
    learning_rate: float

    def __post_init__(self) -> None:
        if not 0 < self.quantile < 1:
            raise ValueError(f"train.loss_clip_quantile = {self.quantile}: must be in (0, 1)")
        if min(self.initial, self.count_noise, self.learning_rate) <= 0:
            raise ValueError(
                f"loss clipping: initial {self.initial}, count noise {self.count_noise} and rate "
                f"{self.learning_rate} must all be > 0"
            )


def combined_noise_multiplier(sigma: float, count_noise: float | None) -> float:
    """(σ⁻² + σ_b⁻²)^(−1/2): the gradient sum and the count as one Gaussian query (:class:`LossClipping`)."""
    return sigma if count_noise is None else 1.0 / math.sqrt(sigma**-2 + count_noise**-2)


def gradient_noise_for(effective: float, count_noise: float | None) -> float:
    """The inverse of :func:`combined_noise_multiplier`: the gradient's σ that makes the pair cost ``effective``."""
    if count_noise is None:
        return effective
    if count_noise <= effective:
        raise ValueError(
            f"train.loss_clip_count_noise = {count_noise:g}: the quantile's count alone would cost more than "
            f"the target allows (it must exceed the calibrated multiplier {effective:.4g}); raise it"
        )
    return 1.0 / math.sqrt(effective**-2 - count_noise**-2)


def clipless_mechanism(
    bounds: GradientBounds,
    sample_rate: float,
    noise_multiplier: float,
    noise: str,
    epochs: float,
    neighbouring: Neighbouring,
    dataset_size: int,
    loss_clipping: LossClipping | None = None,
) -> MechanismDescription:
    """What :func:`train_clipless` does: DP-SGD's event with C = Δ, σ_eff for the noise mode (and the count)."""
    layers = bounds.per_layer()
    per_noise = effective_noise_multiplier(noise_multiplier, noise, len(layers))
    sigma = combined_noise_multiplier(per_noise, None if loss_clipping is None else loss_clipping.count_noise)
    clipping_notes: tuple[str, ...] = ()
    if loss_clipping is not None:
        clipping_notes = (
            f"loss-gradient clipping at a private {loss_clipping.quantile:g}-quantile (Andrew et al. 2021): "
            f"every bound scales by min(L, C_t)/L; the count of unclipped examples is released with noise std "
            f"{loss_clipping.count_noise:g}, so each step is one Gaussian with multiplier (σ_g⁻² + σ_b⁻²)^(−1/2) = "
            f"{sigma:.6g} (σ_g = {per_noise:.6g})",
        )
    return MechanismDescription(
        trainer="clipless",
        events=(PoissonGaussianSteps(sample_rate, sigma, number_of_steps(epochs, sample_rate)),),
        neighbouring=neighbouring,
        clip_norm=bounds.total,
        dataset_size=dataset_size,
        threat_model="all-iterates",
        notes=(
            "clipless DP-SGD (Béthune et al., Algorithm 2): no clipping; the per-example gradient bound Δ = "
            f"{bounds.total:.6g} comes from the Lipschitz layers, the input bound X0 and the loss (Algorithm 1)",
            "per-layer bounds " + ", ".join(f"layer {k}: {v:.6g}" for k, v in layers.items()),
            f"{noise} noise with σ = {noise_multiplier:g}"
            + (
                f" per layer (std σΔ_d), equivalent to one Gaussian with multiplier σ/√{len(layers)} = {sigma:.6g}"
                if noise == "per_layer"
                else " (std σΔ on the sum)"
            ),
            "the bounds are verified after training (exact spectral norms each epoch, per-example gradient norms on "
            "training records); a violation voids this certificate",
        )
        + clipping_notes,
    )


def train_clipless(
    model: nn.Sequential,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    sample_rate: float,
    epochs: float,
    noise_multiplier: float,
    noise: str,
    bounds: GradientBounds,
    neighbouring: Neighbouring,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    seed: int,
    physical_batch_size: int = 1024,
    soundness_records: int = 1000,
    progress: bool = False,
    loss_clipping: LossClipping | None = None,
    loss_lipschitz: float | None = None,
) -> TrainResult:
    """Train in place with clipless DP-SGD; returns the model, its mechanism and a history with the soundness check.

    With ``loss_clipping`` (and the loss constant ``loss_lipschitz`` L the bounds were computed with),
    per-example logit gradients are clipped to an adaptive private threshold (:class:`LossClipping`).
    """
    if loss_clipping is not None and loss_lipschitz is None:
        raise ValueError("loss clipping needs loss_lipschitz: the constant L the bounds were computed with")
    n = x.shape[0]
    steps = number_of_steps(epochs, sample_rate)
    expected_batch = sample_rate * n
    sampler = torch.Generator().manual_seed(seed)
    noise_source = torch.Generator(device=x.device).manual_seed(seed + 1)
    params = dict(model.named_parameters())
    layer_bound = bounds.per_layer()
    noise_std = {
        name: noise_multiplier * (bounds.total if noise == "global" else layer_bound[name.split(".")[0]])
        for name in params
    }
    steps_per_epoch = max(1, int(round(1 / sample_rate)))
    threshold = None if loss_clipping is None else min(loss_clipping.initial, loss_lipschitz)  # type: ignore[type-var]
    thresholds, unclipped_total, seen_total = [], 0, 0
    spectral_max = 0.0
    start = time.perf_counter()
    project_all(model)
    model.train()
    for step in progress_range(steps, "clipless DP-SGD", "step", progress):
        batch = poisson_batch(sampler, n, sample_rate).to(x.device)
        for p in params.values():  # the batch's gradient sum accumulates here (an empty batch leaves zeros)
            p.grad = torch.zeros_like(p)
        unclipped = 0
        for chunk in torch.split(batch, physical_batch_size):
            if threshold is None:
                loss_fn(model(x[chunk]), y[chunk]).sum().backward()
            else:
                unclipped += backward_with_clipped_loss_gradient(model, loss_fn, x[chunk], y[chunk], threshold)
        scale = 1.0 if threshold is None else threshold / loss_lipschitz  # type: ignore[operator]
        with torch.no_grad():
            for name, p in params.items():
                noise_sample = gaussian(p.shape, noise_std[name] * scale, noise_source, p.dtype)
                assert p.grad is not None  # zeros at the start of the step, then the chunks' sums
                p.grad = (p.grad + noise_sample) / expected_batch
        optimizer.step()
        project_all(model)
        if loss_clipping is not None and threshold is not None:
            thresholds.append(threshold)
            unclipped_total, seen_total = unclipped_total + unclipped, seen_total + int(batch.numel())
            count_noise = float(gaussian((), loss_clipping.count_noise, noise_source, torch.float64))
            noisy = (unclipped + count_noise) / expected_batch
            threshold = min(
                loss_lipschitz,
                threshold
                * math.exp(
                    -loss_clipping.learning_rate  # type: ignore[type-var]
                    * (noisy - loss_clipping.quantile)
                ),
            )
        if (step + 1) % steps_per_epoch == 0 or step == steps - 1:
            spectral_max = max(spectral_max, largest_spectral_norm(model))
    history = {
        "steps": steps,
        "seconds": time.perf_counter() - start,
        "gradient_bound": bounds.total,
        **soundness_check(model, x, y, loss_fn, bounds, soundness_records, seed),
        "spectral_norm_max": spectral_max,
    }
    history["soundness_passed"] = bool(history["soundness_violations"] == 0 and spectral_max <= 1 + 1e-5)
    if thresholds:
        history |= {
            "loss_clip_final_threshold": thresholds[-1],
            "loss_clip_mean_threshold": float(np.mean(thresholds)),
            "loss_clip_unclipped_fraction": unclipped_total / max(seen_total, 1),
        }
    mechanism = clipless_mechanism(bounds, sample_rate, noise_multiplier, noise, epochs, neighbouring, n, loss_clipping)
    return TrainResult(model, mechanism, history)


def backward_with_clipped_loss_gradient(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, threshold: float
) -> int:
    """Accumulate Σ_i J_iᵀ·clip(∂ℓ_i/∂z_i, threshold) into the parameters' .grad; return how many were not clipped.

    Each example's loss depends on its own logits only, so clipping the rows of ∂(Σℓ)/∂z clips every
    example's logit gradient, and one backward pass from z carries the clipped rows to the parameters.
    """
    logits = model(x)
    (gradient,) = torch.autograd.grad(loss_fn(logits, y).sum(), logits)
    norms = gradient.flatten(1).norm(dim=1)
    factor = (threshold / norms.clamp_min(1e-30)).clamp(max=1.0)
    logits.backward(gradient * factor.view(-1, *([1] * (gradient.dim() - 1))))
    return int((norms <= threshold).sum())


@torch.no_grad()
def largest_spectral_norm(model: nn.Module) -> float:
    """A certified upper bound on the largest operator norm over the constrained layers: each
    :class:`~dpml.models.lipschitz.LipschitzLayer`'s ``operator_norm_bound()`` — σ_max by SVD (float64)
    for dense weights, the exact norm of the circular convolution (FFT of the kernel, float64) for
    convolutions, which is ≥ the zero-padded operator's norm. 0 when no layer is constrained."""
    norms = [
        bound
        for m in model.modules()
        if isinstance(m, LipschitzLayer)
        if (bound := m.operator_norm_bound()) is not None
    ]
    return max(norms, default=0.0)


def soundness_check(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, bounds: GradientBounds, records: int, seed: int
) -> dict[str, float | int]:
    """Actual per-example gradient norms of every parameter on up to ``records`` training records vs Δ_p."""
    rows = np.random.default_rng(seed).choice(x.shape[0], size=min(records, x.shape[0]), replace=False)
    names = list(bounds.per_parameter)
    was_training = model.training
    model.eval()
    worst, violations = 0.0, 0
    for chunk in np.array_split(rows, max(1, len(rows) // 256)):
        index = torch.as_tensor(chunk, device=x.device)
        grads = per_example_gradients(model, loss_fn, x[index], y[index], names)
        for name in names:
            ratio = grads[name].flatten(1).norm(dim=1) / bounds.per_parameter[name]
            worst = max(worst, float(ratio.max()))
            violations += int((ratio > 1 + 1e-5).sum())
    model.train(was_training)
    return {"soundness_records": int(len(rows)), "soundness_max_ratio": worst, "soundness_violations": violations}
