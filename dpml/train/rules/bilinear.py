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
        return _summed_products(d[examples], left[examples], right[examples])

    def cast(dtype: torch.dtype) -> Computed:
        if d.dtype == left.dtype == right.dtype == dtype:
            return form
        return weight_form(*(t.to(dtype) for t in (d, left, right)))

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
        return d.square().sum((1, 2)) * left.square().sum((1, 2)) * right.square().sum((1, 2))
    parts = []
    for s in _slices(d.shape[0], 3 * d.shape[1] ** 2, d):
        grams = [torch.bmm(t[s], t[s].transpose(1, 2)) for t in (d, left, right)]
        parts.append((grams[0] * grams[1] * grams[2]).sum((1, 2)))
    return torch.cat(parts)


def _weighted_sum(d: torch.Tensor, left: torch.Tensor, right: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Σ_i c_i G_i = Σ_{i,t} c_i δ_{i,t} ⊗ x₁_{i,t} ⊗ x₂_{i,t} (K, n₁, n₂): the rows scaled by their example's c_i,
    then :func:`_summed_products` over all the rows, a slice of rows at a time."""
    scaled = (d * factors.to(d.dtype)[:, None, None]).reshape(-1, d.shape[2])
    a, b = left.reshape(-1, left.shape[2]), right.reshape(-1, right.shape[2])
    total = d.new_zeros(d.shape[2], a.shape[1], b.shape[1])
    for s in _slices(scaled.shape[0], _joined(scaled.shape[1], a.shape[1], b.shape[1]), d):
        total += _summed_products(scaled[s], a[s], b[s])
    return total


def _joined(k: int, n1: int, n2: int) -> int:
    """Columns of the pair of factors :func:`_summed_products` joins: the fewest of K·n₂, K·n₁ and n₁·n₂."""
    return min(k * n2, k * n1, n1 * n2)


def _summed_products(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_t g_t ⊗ a_t ⊗ b_t over the rows t of g (…, T, K), a (…, T, n₁), b (…, T, n₂): (…, K, n₁, n₂), batched over
    the leading dimensions. Two of the three factors are joined row by row into one (the pair whose product has the
    fewest columns: δ ⊗ x₂, δ ⊗ x₁ or x₁ ⊗ x₂) and multiplied by the third over the rows, one matrix product."""
    k, n1, n2 = g.shape[-1], a.shape[-1], b.shape[-1]
    lead, rows = g.shape[:-2], g.shape[-2]
    joined = _joined(k, n1, n2)
    if joined == k * n2:  # x₁ᵀ (δ ⊗ x₂): (n₁, K·n₂)
        pair = (g[..., :, None] * b[..., None, :]).reshape(*lead, rows, k * n2)
        return (a.transpose(-1, -2) @ pair).view(*lead, n1, k, n2).transpose(-3, -2)
    if joined == k * n1:  # (δ ⊗ x₁)ᵀ x₂: (K·n₁, n₂)
        pair = (g[..., :, None] * a[..., None, :]).reshape(*lead, rows, k * n1)
        return (pair.transpose(-1, -2) @ b).view(*lead, k, n1, n2)
    pair = (a[..., :, None] * b[..., None, :]).reshape(*lead, rows, n1 * n2)  # δᵀ (x₁ ⊗ x₂): (K, n₁·n₂)
    return (g.transpose(-1, -2) @ pair).view(*lead, k, n1, n2)


def _slices(count: int, numbers_each: int, like: torch.Tensor) -> list[slice]:
    """Consecutive slices of ``count`` items (examples or rows) of ``numbers_each`` numbers of scratch each: on a CPU
    within the heap's blocks (:func:`dpml.devices.heap_sized_slices`), elsewhere within the device's keep limit."""
    if like.device.type == "cpu":
        return heap_sized_slices(count, numbers_each * like.element_size(), like.device)
    step = max(1, keep_limit(like.device) // max(1, numbers_each))
    return [slice(start, min(count, start + step)) for start in range(0, count, step)]
