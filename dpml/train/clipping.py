"""Per-example clipped gradient sums: Σ_i clip_C(∇_θ ℓ(θ; x_i, y_i)), clip_C(g) = g·min(1, C/‖g‖).

The method is chosen per layer:

- **Linear and Conv2d layers: no per-example gradient tensor** (Goodfellow 2015; the ghost-norm
  / book-keeping technique of Li et al. 2022 and Bu et al. 2023). Such a layer computes
  z_t = W a_t (+ b) at positions t (one position for a plain dense layer; the output pixels of a
  convolution, with a_t the unfolded input patch), so with δ_t = ∂ℓ_i/∂z_t
      ∇_W ℓ_i = Σ_t δ_t a_tᵀ,        ∇_b ℓ_i = Σ_t δ_t,
      ‖∇_W ℓ_i‖_F² = Σ_{t,s} (a_t·a_s)(δ_t·δ_s)   ("ghost norm": two T×T Gram matrices),
  which for T = 1 is ‖a‖²‖δ‖². Per layer we take the ghost norm or materialise ∇_W ℓ_i,
  whichever is cheaper (T² against d_in·d_out), and the clipped sum is one contraction
  Σ_i c_i Σ_t δ_{i,t} a_{i,t}ᵀ. One forward and one backward pass to the layer outputs serve
  every such layer.
- **Any other parameter** (normalisation layers, embeddings, custom modules): exact
  per-example gradients of *those parameters only* with ``torch.func.vmap(grad(·))``; their
  squared norms join the layers' before the clip factor is formed.

c_i = min(1, C / (‖g_i‖ + 1e-6)), so ‖c_i g_i‖ < C strictly (the 1e-6 guards rounding and
g_i = 0): this is what makes the sum's sensitivity C.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, y) -> per-example losses


def clip_factors(norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
    return torch.clamp(clip_norm / (norms + 1e-6), max=1.0)


def _is_fast(module: nn.Module) -> bool:
    """Layers whose per-example gradients are products of activations and output gradients."""
    if isinstance(module, nn.Linear):
        return True
    return (isinstance(module, nn.Conv2d) and module.groups == 1 and module.padding_mode == "zeros"
            and isinstance(module.padding, tuple))


def _patches(module: nn.Module, inputs: torch.Tensor, output_grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, Δ): per-example activations (B, T, d_in) and output gradients (B, T, d_out) of a fast layer."""
    batch = inputs.shape[0]
    if isinstance(module, nn.Linear):
        return inputs.reshape(batch, -1, inputs.shape[-1]), output_grad.reshape(batch, -1, output_grad.shape[-1])
    unfolded = unfold_patches(inputs, module.kernel_size, module.stride, module.padding, module.dilation)
    return unfolded.transpose(1, 2), output_grad.reshape(batch, output_grad.shape[1], -1).transpose(1, 2)


def unfold_patches(x: torch.Tensor, kernel: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
                   dilation: tuple[int, ...]) -> torch.Tensor:
    """The convolution's input patches, (B, C·kh·kw, T) — what ``F.unfold`` returns, as one strided view
    and one copy. (``F.unfold`` itself took ≈4 s instead of ≈30 ms for a 512×1×28×28 batch with two
    intra-op threads on this CPU build of torch 2.13.)"""
    if any(padding):
        x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    batch, channels, height, width = x.shape
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    out_h, out_w = (height - dh * (kh - 1) - 1) // sh + 1, (width - dw * (kw - 1) - 1) // sw + 1
    s = x.stride()
    patches = x.as_strided((batch, channels, kh, kw, out_h, out_w),
                           (s[0], s[1], s[2] * dh, s[3] * dw, s[2] * sh, s[3] * sw))
    return patches.reshape(batch, channels * kh * kw, out_h * out_w)


KEEP_PER_EXAMPLE_LIMIT = 1 << 25  # elements: materialised per-example weight gradients kept for the sum


def _weight_norms_squared(a: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """‖Σ_t δ_t a_tᵀ‖_F² per example, by the cheaper of the Gram trick and materialising.

    When it materialises the per-example gradients G_i = Σ_t δ_t a_tᵀ and they are small enough,
    they are returned too: the clipped sum is then Σ_i c_i G_i, not a second pass over all positions.
    """
    positions = a.shape[1]
    if positions == 1:
        return a[:, 0].pow(2).sum(1) * d[:, 0].pow(2).sum(1), None
    if positions * positions <= a.shape[2] * d.shape[2]:
        return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(d, d.transpose(1, 2))).sum((1, 2)), None
    per_example = torch.bmm(d.transpose(1, 2), a)  # (B, d_out, d_in)
    keep = per_example if per_example.numel() <= KEEP_PER_EXAMPLE_LIMIT else None
    return per_example.pow(2).sum((1, 2)), keep


def _per_example_gradients(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                           names: list[str]) -> dict[str, torch.Tensor]:
    """Exact per-example gradients of the named parameters only (the others held fixed)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def one_loss(trainable: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, ({**params, **trainable}, buffers), (xi.unsqueeze(0),))
        return loss_fn(logits, yi.unsqueeze(0)).sum()

    return vmap(grad(one_loss), in_dims=(None, 0, 0))({n: params[n] for n in names}, x, y)


def _all_by_vmap(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                 clip_norm: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    per_example = _per_example_gradients(model, loss_fn, x, y, names)
    norms = sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in per_example.values()).sqrt()  # type: ignore[union-attr]
    factors = clip_factors(norms, clip_norm)
    return {n: torch.einsum("b,b...->...", factors, g) for n, g in per_example.items()}, norms.detach()


def clipped_gradient_sum(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                         clip_norm: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Σ_i clip_C(∇ℓ_i) per parameter name, and the unclipped per-example norms ‖∇ℓ_i‖."""
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    fast = [m for m in model.modules() if _is_fast(m) and any(id(p) in names for p in m.parameters(recurse=False))]
    covered = {id(p) for m in fast for p in m.parameters(recurse=False)}
    slow = [n for i, n in names.items() if i not in covered]
    squared = torch.zeros(x.shape[0], device=x.device, dtype=next(model.parameters()).dtype)
    pieces: list[tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    if fast:
        records: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        reused: list[nn.Module] = []

        def remember(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            if module in records:
                reused.append(module)
            records[module] = (inputs[0].detach(), output)

        handles = [m.register_forward_hook(remember) for m in fast]
        try:
            losses = loss_fn(model(x), y)
        finally:
            for handle in handles:
                handle.remove()
        if reused:  # a layer applied twice shares its weight across calls: exact path for everything
            return _all_by_vmap(model, loss_fn, x, y, clip_norm)
        used = [m for m in fast if m in records]
        output_grads = torch.autograd.grad(losses.sum(), [records[m][1] for m in used], allow_unused=True)
        for module, output_grad in zip(used, output_grads):
            if output_grad is None:
                output_grad = torch.zeros_like(records[module][1])
            a, d = _patches(module, records[module][0], output_grad)
            kept = None
            if module.weight.requires_grad:
                weight_squared, kept = _weight_norms_squared(a, d)
                squared += weight_squared
            pieces.append((module, a, d, kept))
            if module.bias is not None and module.bias.requires_grad:
                squared += d.sum(1).pow(2).sum(1)
    per_example = _per_example_gradients(model, loss_fn, x, y, slow) if slow else {}
    if per_example:
        for g in per_example.values():
            squared += g.reshape(g.shape[0], -1).pow(2).sum(1)
    norms = squared.sqrt()
    factors = clip_factors(norms, clip_norm)
    sums: dict[str, torch.Tensor] = {}
    for module, a, d, kept in pieces:
        weighted = d * factors[:, None, None]
        if module.weight.requires_grad:
            if kept is not None:
                flat = torch.einsum("b,boi->oi", factors, kept)
            else:
                flat = weighted.reshape(-1, d.shape[2]).t() @ a.reshape(-1, a.shape[2])  # (d_out, d_in)
            sums[names[id(module.weight)]] = flat.reshape(module.weight.shape)
        if module.bias is not None and module.bias.requires_grad:
            sums[names[id(module.bias)]] = weighted.sum((0, 1))
    for name, g in per_example.items():
        sums[name] = torch.einsum("b,b...->...", factors, g)
    return sums, norms.detach()
