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
bounds. A violation is reported in the history and fails the certificate (:func:`dpml.stages.certify`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dpml.models.lipschitz import LipschitzLayer, gradient_bounds, project_all
from dpml.privacy.mechanism import MechanismDescription, Neighbouring, PoissonGaussianSteps
from dpml.train.clipping import LossFn, _per_example_gradients
from dpml.train.dpsgd import TrainResult, number_of_steps, poisson_batch, progress_range


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


def clipless_mechanism(bounds: GradientBounds, sample_rate: float, noise_multiplier: float, noise: str,
                       epochs: float, neighbouring: Neighbouring, dataset_size: int) -> MechanismDescription:
    """What :func:`train_clipless` does: DP-SGD's event with C = Δ, σ_eff for the noise mode."""
    layers = bounds.per_layer()
    sigma = effective_noise_multiplier(noise_multiplier, noise, len(layers))
    return MechanismDescription(
        trainer="clipless",
        events=(PoissonGaussianSteps(sample_rate, sigma, number_of_steps(epochs, sample_rate)),),
        neighbouring=neighbouring,
        clip_norm=bounds.total,
        dataset_size=dataset_size,
        threat_model="all-iterates",
        notes=(
            "clipless DP-SGD (seed 004, Algorithm 2): no clipping; the per-example gradient bound Δ = "
            f"{bounds.total:.6g} comes from the Lipschitz layers, the input bound X0 and the loss (Algorithm 1)",
            "per-layer bounds " + ", ".join(f"layer {k}: {v:.6g}" for k, v in layers.items()),
            f"{noise} noise with σ = {noise_multiplier:g}" + (
                f" per layer (std σΔ_d), equivalent to one Gaussian with multiplier σ/√{len(layers)} = {sigma:.6g}"
                if noise == "per_layer" else " (std σΔ on the sum)"),
            "the bounds are verified after training (exact spectral norms each epoch, per-example gradient norms on "
            "training records); a violation voids this certificate",
        ),
    )


def train_clipless(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, *, sample_rate: float, epochs: float,
                   noise_multiplier: float, noise: str, bounds: GradientBounds, neighbouring: Neighbouring,
                   loss_fn: LossFn, optimizer: torch.optim.Optimizer, seed: int, physical_batch_size: int = 1024,
                   soundness_records: int = 1000, progress: bool = False) -> TrainResult:
    """Train in place with clipless DP-SGD; returns the model, its mechanism and a history with the soundness check."""
    n = x.shape[0]
    steps = number_of_steps(epochs, sample_rate)
    expected_batch = sample_rate * n
    sampler = torch.Generator().manual_seed(seed)
    noise_source = torch.Generator(device=x.device).manual_seed(seed + 1)
    params = dict(model.named_parameters())
    layer_bound = bounds.per_layer()
    noise_std = {name: noise_multiplier * (bounds.total if noise == "global" else layer_bound[name.split(".")[0]])
                 for name in params}
    steps_per_epoch = max(1, int(round(1 / sample_rate)))
    spectral_max = 0.0
    start = time.perf_counter()
    project_all(model)
    model.train()
    for step in progress_range(steps, "clipless DP-SGD", "step", progress):
        batch = poisson_batch(sampler, n, sample_rate).to(x.device)
        for p in params.values():  # the batch's gradient sum accumulates here (an empty batch leaves zeros)
            p.grad = torch.zeros_like(p)
        for chunk in torch.split(batch, physical_batch_size):
            loss_fn(model(x[chunk]), y[chunk]).sum().backward()
        with torch.no_grad():
            for name, p in params.items():
                noise_sample = torch.normal(0.0, noise_std[name], size=p.shape, generator=noise_source,
                                            device=p.device, dtype=p.dtype)
                p.grad = (p.grad + noise_sample) / expected_batch
        optimizer.step()
        project_all(model)
        if (step + 1) % steps_per_epoch == 0 or step == steps - 1:
            spectral_max = max(spectral_max, largest_spectral_norm(model))
    history = {"steps": steps, "seconds": time.perf_counter() - start, "gradient_bound": bounds.total,
               **soundness_check(model, x, y, loss_fn, bounds, soundness_records, seed), "spectral_norm_max": spectral_max}
    history["soundness_passed"] = bool(history["soundness_violations"] == 0 and spectral_max <= 1 + 1e-5)
    mechanism = clipless_mechanism(bounds, sample_rate, noise_multiplier, noise, epochs, neighbouring, n)
    return TrainResult(model, mechanism, history)


@torch.no_grad()
def largest_spectral_norm(model: nn.Module) -> float:
    """A certified upper bound on the largest operator norm over the constrained layers: each
    :class:`~dpml.models.lipschitz.LipschitzLayer`'s ``operator_norm_bound()`` — σ_max by SVD (float64)
    for dense weights, the exact norm of the circular convolution (FFT of the kernel, float64) for
    convolutions, which is ≥ the zero-padded operator's norm. 0 when no layer is constrained."""
    norms = [bound for m in model.modules() if isinstance(m, LipschitzLayer)
             if (bound := m.operator_norm_bound()) is not None]
    return max(norms, default=0.0)


def soundness_check(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, bounds: GradientBounds,
                    records: int, seed: int) -> dict[str, float | int]:
    """Actual per-example gradient norms of every parameter on up to ``records`` training records vs Δ_p."""
    rows = np.random.default_rng(seed).choice(x.shape[0], size=min(records, x.shape[0]), replace=False)
    names = list(bounds.per_parameter)
    was_training = model.training
    model.eval()
    worst, violations = 0.0, 0
    for chunk in np.array_split(rows, max(1, len(rows) // 256)):
        index = torch.as_tensor(chunk, device=x.device)
        grads = _per_example_gradients(model, loss_fn, x[index], y[index], names)
        for name in names:
            ratio = grads[name].flatten(1).norm(dim=1) / bounds.per_parameter[name]
            worst = max(worst, float(ratio.max()))
            violations += int((ratio > 1 + 1e-5).sum())
    model.train(was_training)
    return {"soundness_records": int(len(rows)), "soundness_max_ratio": worst, "soundness_violations": violations}
