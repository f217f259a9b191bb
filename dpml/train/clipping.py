"""Per-example clipped gradient sums: Σ_i clip_C(∇_θ ℓ(θ; x_i, y_i)), clip_C(g) = g·min(1, C/‖g‖).

Two exact methods, chosen per model:

- **Linear layers, no per-example gradient tensor** (Goodfellow 2015; the "ghost norm" /
  book-keeping trick of Li et al. 2022 and Bu et al. 2023). For a dense layer z = W a + b and
  a per-example loss, ∇_W ℓ_i = δ_i a_iᵀ and ∇_b ℓ_i = δ_i with δ_i = ∂ℓ_i/∂z_i, so
      ‖∇_W ℓ_i‖_F² = ‖a_i‖² ‖δ_i‖²,   ‖∇_b ℓ_i‖² = ‖δ_i‖²,
  and the clipped sum is one matrix product Σ_i c_i δ_i a_iᵀ = Δᵀ diag(c) A. One forward and one
  backward pass to the layer outputs give every a_i and δ_i.
- **Any other model**: per-example gradients with ``torch.func.vmap(grad(·))`` (exact, more
  memory), then the same norms and weighted sum.

The clip factor is c_i = min(1, C / (‖g_i‖ + 1e-6)), so ‖c_i g_i‖ < C strictly (the 1e-6
guards rounding and g_i = 0); this is what makes the sum's sensitivity C.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, y) -> per-example losses


def clip_factors(norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
    return torch.clamp(clip_norm / (norms + 1e-6), max=1.0)


def _linear_only(model: nn.Module) -> bool:
    """True when every trainable parameter is the weight or bias of an ``nn.Linear``."""
    covered = set()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            covered.update(id(p) for p in module.parameters(recurse=False))
    return all(id(p) in covered for p in model.parameters() if p.requires_grad)


def _linear_clipped_sum(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                        clip_norm: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    records: dict[nn.Linear, tuple[torch.Tensor, torch.Tensor]] = {}

    def remember(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        records[module] = (inputs[0].detach(), output)  # type: ignore[index]

    handles = [layer.register_forward_hook(remember) for layer in layers]
    try:
        losses = loss_fn(model(x), y)
    finally:
        for handle in handles:
            handle.remove()
    if any(records[layer][0].dim() != 2 for layer in layers):
        raise ValueError("the linear fast path needs 2-D (batch, features) inputs to every Linear layer")
    outputs = [records[layer][1] for layer in layers]
    deltas = torch.autograd.grad(losses.sum(), outputs)
    squared = torch.zeros(x.shape[0], device=x.device, dtype=losses.dtype)
    for layer, delta in zip(layers, deltas):
        activation = records[layer][0]
        delta_sq = delta.pow(2).sum(1)
        squared += activation.pow(2).sum(1) * delta_sq
        if layer.bias is not None:
            squared += delta_sq
    norms = squared.sqrt()
    factors = clip_factors(norms, clip_norm)
    names = {id(p): n for n, p in model.named_parameters()}
    sums: dict[str, torch.Tensor] = {}
    for layer, delta in zip(layers, deltas):
        weighted = delta * factors[:, None]
        sums[names[id(layer.weight)]] = weighted.t() @ records[layer][0]
        if layer.bias is not None:
            sums[names[id(layer.bias)]] = weighted.sum(0)
    return sums, norms.detach()


def _vmap_clipped_sum(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                      clip_norm: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def one_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return loss_fn(logits, yi.unsqueeze(0)).sum()

    per_example = vmap(grad(one_loss), in_dims=(None, 0, 0))(params, x, y)
    squared = sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in per_example.values())
    norms = squared.sqrt()  # type: ignore[union-attr]
    factors = clip_factors(norms, clip_norm)
    sums = {n: torch.einsum("b,b...->...", factors, g) for n, g in per_example.items()}
    return sums, norms


def clipped_gradient_sum(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                         clip_norm: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Σ_i clip_C(∇ℓ_i) per parameter name, and the unclipped per-example norms ‖∇ℓ_i‖."""
    if _linear_only(model):
        return _linear_clipped_sum(model, loss_fn, x, y, clip_norm)
    return _vmap_clipped_sum(model, loss_fn, x, y, clip_norm)
