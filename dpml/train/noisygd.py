"""Noisy full-batch gradient descent without clipping, and its *estimated* KL privacy loss (seed 000).

**The algorithm** (Ye et al., *Initialization Matters*, App. E, Thm E.1): for K steps,

    W_{k+1} = W_k − η ∇L(W_k; D) + sqrt(2ησ²) · Z_k,      Z_k ~ N(0, I),

full batch, no clipping, L(W; D) = (1/n) Σ_i ℓ(f_W(x_i), y_i) the *mean* loss over the n records.
It is the Euler discretisation of the Langevin diffusion dW = −∇L dt + sqrt(2σ²) dB (Eq. 4).
Z_k is drawn from the caller's generator (which must be secret-seeded), parameter by parameter in
``model.parameters()`` order, after the step's gradient is computed.

**Estimated KL** (Thm 3.1 / E.1, Eq. 74). For neighbouring D, D', the KL divergence between the
trajectories of noisy GD on D and on D' is

    KL(W_{1:K} ‖ W'_{1:K}) = (1/(2σ²)) Σ_{k=0}^{K−1} η · E‖∇L(W_k; D) − ∇L(W_k; D')‖²,

the expectation over the trajectory on D. :func:`train_noisy_gd` evaluates the sum along the one
trajectory it trains (one sample of the expectation; the paper averages over runs) for a few probe
neighbours, with the paper's constant 1/(2σ²). (For the update as written the exact per-step KL of
two Gaussians N(μ, 2ησ²I), N(μ', 2ησ²I) with μ − μ' = −ηΔ is η‖Δ‖²/(4σ²): the paper's constant is
conservative by a factor 2; it is kept, so numbers compare with the paper's.) Such numbers are
**estimates** of the privacy loss at the probes, not certificates: they hold for neither the worst
neighbour nor the expectation. The only closed-form certificate is Cor. 4.2 for the *linearised*
network, :func:`dpml.accounting.kl.kl_bound`.

**Neighbour gradient differences** Δ = ∇L(D) − ∇L(D') from the step's ∇L(D) = ḡ and per-example
gradients g of the probe records, with mean losses over n and |D'| records:

    remove-one  D' = D \\ {z_j}:          L(D') = (n L(D) − ℓ_j)/(n − 1)  ⇒  Δ = (g_j − ḡ)/(n − 1)
    add-one     D' = D ∪ {z'}:            L(D') = (n L(D) + ℓ')/(n + 1)   ⇒  Δ = (ḡ − g')/(n + 1)
    replace-one D' = D \\ {z_j} ∪ {z'}:    L(D') = L(D) + (ℓ' − ℓ_j)/n      ⇒  Δ = (g_j − g')/n

**The linearised network** (Eq. 3): f_lin(W) = f(W0) + J(W0)(W − W0), evaluated with one forward-mode
Jacobian-vector product at W0 (``torch.func.jvp``); Cor. 4.2's certificate is for training it.

The history's losses and KL estimates are computed from the data: they are diagnostics that no
certificate covers.

The estimate's machinery (per-example gradients, neighbour differences, the probe recorder) is in
:mod:`dpml.train.noisygd_kl`; this module holds the trainer and the linearised network.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn
from dpml.models.linearised import LinearisedNetwork
from dpml.progress import progress_range
from dpml.train.noise import gaussian
from dpml.train.noisygd_kl import (
    KL_CONVENTION,
    KL_LABEL,
    LOSSES,
    PROBE_CHUNK,
    RELATIONS,
    KLPairs,
    LinearFactors,
    _GapRecorder,
    _require_positive,
    add_one_difference,
    check_loss_targets,
    estimated_kl,
    flatten,
    linear_layers,
    mean_loss_and_gradient,
    neighbour_squared_gaps,
    per_example_gradients,
    per_example_loss,
    remove_one_difference,
    replace_one_difference,
    squared_norms,
)

__all__ = [
    "KL_CONVENTION",
    "KL_LABEL",
    "LOSSES",
    "PROBE_CHUNK",
    "RELATIONS",
    "KLPairs",
    "LinearFactors",
    "LinearisedNetwork",
    "NoisyGdResult",
    "add_one_difference",
    "check_loss_targets",
    "estimated_kl",
    "flatten",
    "linear_layers",
    "mean_loss_and_gradient",
    "neighbour_squared_gaps",
    "noisy_gd_step_noise_std",
    "noisy_gd_update",
    "per_example_gradients",
    "per_example_loss",
    "remove_one_difference",
    "replace_one_difference",
    "squared_norms",
    "train_noisy_gd",
]


# ------------------------------------------------------------------------------------------------ noise


def noisy_gd_step_noise_std(learning_rate: float, sigma: float) -> float:
    """Per-coordinate standard deviation sqrt(2ησ²) of the noise added by one noisy GD step (App. E)."""
    _require_positive("learning_rate", learning_rate)
    _require_positive("sigma", sigma)
    return math.sqrt(2.0 * learning_rate * sigma * sigma)


# --------------------------------------------------------------------------------------------- trainer


@dataclass
class NoisyGdResult:
    """The trained model (trained in place) and its history.

    history keys: ``steps``, ``seconds``, ``n``, ``learning_rate``, ``sigma``, ``noise_std``, ``loss_function``,
    ``initial_loss`` (L(W_0; D)), ``final_loss`` (L(W_K; D)), and with probes ``kl_estimate``:
    {``label``, ``convention``, and per tracked relation {``probes``, ``step_worst``, ``step_mean``,
    ``cumulative_worst``, ``cumulative_mean`` (lists of K floats; entry k covers steps 0..k),
    ``final_per_probe``}}.
    """

    model: nn.Module
    history: dict[str, Any] = field(default_factory=dict)


def train_noisy_gd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    learning_rate: float,
    sigma: float,
    steps: int,
    loss: str,
    generator: torch.Generator,
    kl_pairs: KLPairs | None = None,
    progress: bool = False,
) -> NoisyGdResult:
    """Train ``model`` in place by K = ``steps`` noisy GD steps W ← W − η∇L(W; D) + sqrt(2ησ²)·Z (App. E).

    Full batch, no clipping, L the mean of ``loss`` over the n records. Z comes from ``generator``
    (secret-seeded by the caller). With ``kl_pairs``, each step also records the Eq. 74 terms
    η‖∇L(W_k; D) − ∇L(W_k; D')‖²/(2σ²) for the probe neighbours, evaluated at W_k before the update
    (labelled *estimated* in the history).
    """
    _require_positive("learning_rate", learning_rate)
    _require_positive("sigma", sigma)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps = {steps!r}: must be an integer ≥ 0")
    if loss not in LOSSES:
        raise ValueError(f"loss = {loss!r}: expected one of {', '.join(LOSSES)}")
    if x.dim() < 2 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)}: need n ≥ 1 matching rows")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"model {type(model).__name__}: has no parameters")
    x = x.to(device=params[0].device, dtype=params[0].dtype)
    y = y.to(params[0].device)
    with torch.no_grad():
        outputs = model(x[:1]).shape[-1]
    check_loss_targets(loss, outputs, y)
    recorder = None
    if kl_pairs is not None:
        kl_pairs.check_against(x.shape[0])
        recorder = _GapRecorder(kl_pairs, x, y, loss)
    noise_std = noisy_gd_step_noise_std(learning_rate, sigma)
    start = time.perf_counter()
    losses = []
    for _ in progress_range(steps, "noisy GD", "step", progress):
        value, grads = mean_loss_and_gradient(model, x, y, loss)
        losses.append(value)
        if recorder is not None:
            recorder.record(model, [g.detach() for g in grads])
        noisy_gd_update(params, grads, learning_rate, noise_std, generator)
    with torch.no_grad():
        final = float(per_example_loss(model(x), y, loss).mean())
    history: dict[str, Any] = {
        "steps": steps,
        "n": int(x.shape[0]),
        "learning_rate": learning_rate,
        "sigma": sigma,
        "noise_std": noise_std,
        "loss_function": loss,
        "initial_loss": losses[0] if losses else final,
        "final_loss": final,
        "seconds": time.perf_counter() - start,
    }
    if recorder is not None:
        history["kl_estimate"] = recorder.summary(learning_rate, sigma)
    return NoisyGdResult(model, history)


def noisy_gd_update(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    learning_rate: float,
    noise_std: float,
    generator: torch.Generator,
) -> None:
    """In place: W ← W − η g + noise_std · Z, Z ~ N(0, I) from ``generator`` (drawn on its device in float64,
    per parameter: :func:`dpml.train.noise.gaussian`)."""
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            noise = gaussian(p.shape, 1.0, generator, p.dtype)
            p.add_(g, alpha=-learning_rate)
            p.add_(noise.to(p.device), alpha=noise_std)
