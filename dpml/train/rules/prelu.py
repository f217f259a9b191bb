"""A learned slope on the negative part: z = max(0, x) + w ⊙ min(0, x) (``F.prelu``, ``nn.PReLU``), w one slope
per channel (x's dimension 1) or one for all. ∇_w ℓ_i = Σ over the positions of δ_i ⊙ min(0, x_i), per channel or
all summed, materialised (the size of w per example).
"""

from __future__ import annotations

import torch

from dpml.train.rules.registry import Call, Dense, Pending, Use, rule


@rule(torch.prelu)  # (F.prelu is torch.prelu)
def prelu(call: Call) -> Pending | str:
    x, weight = call.arg(0, "input"), call.arg(1, "weight")
    w = call.tracked(weight)
    if w is None or call.tracked(x) is not None:
        return "a slope that is not the parameter's own"
    if not call.batch_first(x) or x.dim() < 2:
        return f"its input (shape {tuple(x.shape)}) is not batch-first with a channel dimension"
    batch, channels, negative = x.shape[0], x.shape[1], x.detach().clamp(max=0)

    def finish(d: torch.Tensor) -> list[Use]:
        g = (d * negative).reshape(batch, channels, -1).sum(2)  # (B, C)
        if weight.numel() == 1:
            g = g.sum(1)
        return [(w, Dense(g.reshape(batch, *w.shape())))]

    return Pending(call.output, [w.param], finish)
