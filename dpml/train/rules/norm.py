"""The affine part of a normalisation, z = x̂ ⊙ γ + β: ``F.layer_norm`` and ``F.group_norm`` (the stock
modules where their hooks do not apply). x̂ is recomputed from the recorded input with the same function
without γ, β; ∇_γ ℓ_i = Σ_t x̂_{i,t} ⊙ δ_{i,t} and ∇_β ℓ_i = Σ_t δ_{i,t} over the positions t sharing
γ and β, materialised (they are small).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dpml.train.rules.registry import Call, Dense, Pending, Use, rule


@rule(F.layer_norm)
def layer_norm(call: Call) -> Pending | str:
    x, shape = call.arg(0, "input"), tuple(call.arg(1, "normalized_shape"))
    weight, bias, eps = call.arg(2, "weight"), call.arg(3, "bias"), call.arg(4, "eps", 1e-5)
    if call.tracked(x) is not None or not call.batch_first(x) or x.dim() <= len(shape):
        return f"its input (shape {tuple(x.shape)}) is not batch-first"
    gamma, beta = call.tracked(weight), call.tracked(bias)
    batch, recorded = x.shape[0], x.detach()

    def finish(d: torch.Tensor) -> list[Use]:
        d = d.reshape(batch, -1, *shape)
        uses: list[Use] = []
        if gamma is not None:
            normalised = F.layer_norm(recorded, shape, eps=eps).reshape(d.shape)
            uses.append((gamma, Dense((normalised * d).sum(1))))
        if beta is not None:
            uses.append((beta, Dense(d.sum(1))))
        return uses

    return Pending(call.output, [t.param for t in (gamma, beta) if t is not None], finish)


@rule(F.group_norm)
def group_norm(call: Call) -> Pending | str:
    x, groups = call.arg(0, "input"), call.arg(1, "num_groups")
    weight, bias, eps = call.arg(2, "weight"), call.arg(3, "bias"), call.arg(4, "eps", 1e-5)
    if call.tracked(x) is not None or not call.batch_first(x) or x.dim() < 2:
        return f"its input (shape {tuple(x.shape)}) is not batch-first"
    gamma, beta = call.tracked(weight), call.tracked(bias)
    batch, channels, recorded = x.shape[0], x.shape[1], x.detach()

    def finish(d: torch.Tensor) -> list[Use]:
        d = d.reshape(batch, channels, -1)
        uses: list[Use] = []
        if gamma is not None:
            normalised = F.group_norm(recorded, groups, eps=eps).reshape(d.shape)
            uses.append((gamma, Dense((normalised * d).sum(2))))
        if beta is not None:
            uses.append((beta, Dense(d.sum(2))))
        return uses

    return Pending(call.output, [t.param for t in (gamma, beta) if t is not None], finish)
