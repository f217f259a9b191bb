"""A parameter concatenated to the batch: ``torch.cat((cls.expand(B, -1, -1), x), dim=1)`` (ViT's cls token).

The parameter's operand S must be expanded over the batch (the same elements in every example's slice);
∇_S ℓ_i is δ_i over S's slice of the result, materialised.
"""

from __future__ import annotations

import torch

from dpml.train.rules.registry import Call, Dense, Pending, Tracked, Use, rule, same_along


@rule(torch.cat, torch.concat, torch.concatenate)
def concatenate(call: Call) -> Pending | str:
    tensors, dim = call.arg(0, "tensors"), call.arg(1, "dim", 0)
    z = call.output
    dim = dim % z.dim() if z.dim() else 0
    if dim == 0:
        return "concatenation along the batch dimension"
    batch, views, offset = z.shape[0], [], 0
    for t in tensors:
        tracked = call.tracked(t)
        if tracked is None:
            if not call.batch_first(t):
                return f"an operand (shape {tuple(t.shape)}) that is not batch-first"
        else:
            index = tracked.flat_index()
            if index.shape[0] != batch or not same_along(index, 0):
                return f"a parameter operand (shape {tuple(t.shape)}) that is not expanded over the batch"
            views.append((Tracked(tracked.param, index[0]), offset, t.shape[dim]))
        offset += t.shape[dim]

    def finish(d: torch.Tensor) -> list[Use]:
        return [(view, Dense(d.narrow(dim, start, size))) for view, start, size in views]

    return Pending(z, [view.param for view, _, _ in views], finish)
