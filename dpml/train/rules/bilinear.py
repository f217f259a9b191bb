"""A bilinear form of two activations: z_k = x₁ᵀ W_k x₂ + b_k (``F.bilinear``, ``nn.Bilinear``), x₁ and x₂
(B, …, n₁) and (B, …, n₂) batch-first, over the positions t of their middle dimensions.

∇_W ℓ_i = Σ_t δ_{i,t,k} x₁_{i,t} x₂_{i,t}ᵀ, (B, K, n₁, n₂), materialised (refused beyond the device's keep limit),
and ∇_b ℓ_i = Σ_t δ_{i,t}.
"""

from __future__ import annotations

import torch

from dpml.train.rules.registry import Call, Dense, Pending, Use, beyond_keep_limit, rule


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
    beyond = None if w is None else beyond_keep_limit(batch, weight.shape, x1.device)
    if beyond is not None:
        return beyond
    left, right = x1.detach().reshape(batch, -1, x1.shape[-1]), x2.detach().reshape(batch, -1, x2.shape[-1])

    def finish(d: torch.Tensor) -> list[Use]:
        d = d.reshape(batch, -1, d.shape[-1])  # (B, T, K)
        uses: list[Use] = []
        if w is not None:
            uses.append((w, Dense(torch.einsum("btk,bti,btj->bkij", d, left, right).reshape(batch, *w.shape()))))
        if b is not None:
            uses.append((b, Dense(d.sum(1).reshape(batch, *b.shape()))))
        return uses

    return Pending(call.output, [t.param for t in (w, b) if t is not None], finish)
