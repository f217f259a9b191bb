"""A bilinear form of two activations: z_k = x₁ᵀ W_k x₂ + b_k (``F.bilinear``, ``nn.Bilinear``), x₁ and x₂
(B, …, n₁) and (B, …, n₂) batch-first, over the positions t of their middle dimensions (T per example; one for
``nn.Bilinear`` on vectors), with output gradients δ_t (K,).

Each example's weight gradient is a sum of three-way outer products, and its squared norm factors as the ghost norm
of a linear layer does (Goodfellow 2015; Li et al. 2022, Eq. 2), one Gram matrix for each factor:

    G_i = ∇_W ℓ_i = Σ_t δ_t ⊗ x₁_t ⊗ x₂_t   (K, n₁, n₂),
    ‖G_i‖² = Σ_{t,s} (δ_t·δ_s)(x₁_t·x₁_s)(x₂_t·x₂_s),

T²(K + n₁ + n₂) multiply-adds an example against T·K·n₁·n₂ to form G_i. The clipped sum Σ_i c_i G_i is one weight
gradient of the rows δ_t scaled by their example's c_i (:func:`_weighted_sum`), so no G_i is formed where the Grams
are the cheaper (:func:`_ghost_normed`); elsewhere they are formed on demand and kept where they fit
(:func:`dpml.train.rules.combine.computed_norms`). ∇_b ℓ_i = Σ_t δ_t.
"""

from __future__ import annotations

import torch

from dpml.devices import heap_sized_slices
from dpml.train.clipping_norms import KEEP_TRAFFIC
from dpml.train.keep_budget import keep_limit
from dpml.train.rules.registry import Call, Computed, Dense, Pending, Use, rule


@rule(torch.bilinear)  # (F.bilinear is torch.bilinear)
def bilinear(call: Call) -> Pending | str:
    x1, x2 = call.arg(0, "input1"), call.arg(1, "input2")
    weight, bias = call.arg(2, "weight"), call.arg(3, "bias")
    w, b = call.tracked(weight), call.tracked(bias)
    if call.tracked(x1) is not None or call.tracked(x2) is not None:
        return "a parameter as an input"
    if not (call.batch_first(x1) and call.batch_first(x2)) or x1.shape[:-1] != x2.shape[:-1]:
        return f"its inputs (shapes {tuple(x1.shape)}, {tuple(x2.shape)}) are not batch-first alike"
    batch = x1.shape[0]
    left, right = x1.detach().reshape(batch, -1, x1.shape[-1]), x2.detach().reshape(batch, -1, x2.shape[-1])

    def finish(d: torch.Tensor) -> list[Use]:
        d = d.reshape(batch, -1, d.shape[-1])  # (B, T, K)
        uses: list[Use] = []
        if w is not None:
            uses.append((w, weight_form(d, left, right)))
        if b is not None:
            uses.append((b, Dense(d.sum(1).reshape(batch, *b.shape()))))
        return uses

    return Pending(call.output, [t.param for t in (w, b) if t is not None], finish)


def weight_form(d: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> Computed:
    """The weight's use from δ (B, T, K), x₁ (B, T, n₁) and x₂ (B, T, n₂): G_i formed on demand, its norm by the
    Grams where :func:`_ghost_normed` says so."""
    batch, positions = d.shape[:2]
    shape = (d.shape[2], left.shape[2], right.shape[2])

    def gradients(examples: slice) -> torch.Tensor:  # (|s|, K, n₁, n₂)
        return torch.einsum("btk,bti,btj->bkij", d[examples], left[examples], right[examples])

    def cast(dtype: torch.dtype) -> Computed:
        return (
            form
            if d.dtype == left.dtype == right.dtype == dtype
            else weight_form(*(t.to(dtype) for t in (d, left, right)))
        )

    ghost = _ghost_normed(batch, positions, shape, keep_limit(d.device))
    norms = (lambda: _ghost_norms(d, left, right)) if ghost else None
    form = Computed(batch, shape, d.device, gradients, lambda c: _weighted_sum(d, left, right, c), cast, norms)
    return form


def _ghost_normed(batch: int, positions: int, shape: tuple[int, int, int], limit: int) -> bool:
    """Whether the Grams are the cheaper way to the norms (as :func:`dpml.train.clipping_norms.materialise` weighs a
    linear layer's): where B·K·n₁·n₂ numbers fit ``limit``, kept gradients spare the clipped sum its own pass, so the
    Grams, T²(K + n₁ + n₂) an example, must cost less than writing and reading those (``KEEP_TRAFFIC`` a number);
    beyond it, wherever their T² numbers are fewer than a gradient's K·n₁·n₂."""
    k, n1, n2 = shape
    numbers = k * n1 * n2
    if batch * numbers <= limit:
        return positions * positions * (k + n1 + n2) <= KEEP_TRAFFIC * numbers
    return positions * positions <= numbers


def _ghost_norms(d: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """‖G_i‖² = Σ_{t,s} (δ_t·δ_s)(x₁_t·x₁_s)(x₂_t·x₂_s) (B,), a slice of examples at a time (three T × T Grams
    each)."""
    if d.shape[1] == 1:  # one position: ‖δ‖²‖x₁‖²‖x₂‖²
        return (d.square().sum((1, 2)) * left.square().sum((1, 2)) * right.square().sum((1, 2))).to(d.dtype)
    parts = []
    for s in heap_sized_slices(d.shape[0], 3 * d.shape[1] ** 2 * d.element_size(), d.device):
        grams = [torch.bmm(t[s], t[s].transpose(1, 2)) for t in (d, left, right)]
        parts.append((grams[0] * grams[1] * grams[2]).sum((1, 2)))
    return torch.cat(parts)


def _weighted_sum(d: torch.Tensor, left: torch.Tensor, right: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Σ_i c_i G_i = Σ_{i,t} c_i δ_{i,t} ⊗ x₁_{i,t} ⊗ x₂_{i,t} (K, n₁, n₂): the rows scaled, two of the three factors
    joined into one (the pair whose product has the fewest columns: δ ⊗ x₂, δ ⊗ x₁ or x₁ ⊗ x₂) and multiplied by the
    third over all rows, a slice of examples at a time so that the joined rows stay small."""
    k, n1, n2 = d.shape[2], left.shape[2], right.shape[2]
    scaled = d * factors.to(d.dtype)[:, None, None]
    total = d.new_zeros(k, n1, n2)
    joined = min(k * n2, k * n1, n1 * n2)
    for s in heap_sized_slices(d.shape[0], d.shape[1] * joined * d.element_size(), d.device):
        g, a, b = (t[s].reshape(-1, t.shape[2]) for t in (scaled, left, right))  # (rows, ·)
        if joined == k * n2:  # x₁ᵀ (δ ⊗ x₂): (n₁, K·n₂)
            total += (a.t() @ (g[:, :, None] * b[:, None, :]).reshape(-1, k * n2)).view(n1, k, n2).transpose(0, 1)
        elif joined == k * n1:  # (δ ⊗ x₁)ᵀ x₂: (K·n₁, n₂)
            total += ((g[:, :, None] * a[:, None, :]).reshape(-1, k * n1).t() @ b).view(k, n1, n2)
        else:  # δᵀ (x₁ ⊗ x₂): (K, n₁·n₂)
            total += (g.t() @ (a[:, :, None] * b[:, None, :]).reshape(-1, n1 * n2)).view(k, n1, n2)
    return total
