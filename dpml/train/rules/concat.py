"""A parameter concatenated to the batch: ``torch.cat((cls.expand(B, -1, -1), x), dim=1)`` (ViT's cls token), or to a
time-major activation along its time (``nn.MultiheadAttention``'s ``add_bias_kv``: ``torch.cat([k, bias_k.repeat(1,
B, 1)])`` with k (S, B, E)).

The activations must hold the batch along one dimension, the same for all of them (their example maps: batch-first,
or time-major), and the concatenation run along another; the parameter's operand S must be expanded over the batch
there (the same elements in every example's slice); ∇_S ℓ_i is δ_i over S's slice of the result, materialised.
"""

from __future__ import annotations

import torch

from dpml.train.rules.registry import Call, Dense, Pending, Tracked, Use, rule, same_along


def _batch_at(call: Call, tensors: list[torch.Tensor]) -> int | str:
    """The dimension along which every activation operand holds the batch (each index one example's), or why none."""
    found = None
    for t in tensors:
        if call.tracked(t) is not None:
            continue
        axis = call.example_axis(t)
        if axis is None or not torch.equal(axis[1], torch.arange(call.batch)) or found not in (None, axis[0]):
            return f"an operand (shape {tuple(t.shape)}) whose batch is not along one dimension, as the others'"
        found = axis[0]
    return "no operand with a batch dimension" if found is None else found


@rule(torch.cat, torch.concat, torch.concatenate)
def concatenate(call: Call) -> Pending | str:
    tensors, dim = call.arg(0, "tensors"), call.arg(1, "dim", 0)
    z = call.output
    dim = dim % z.dim() if z.dim() else 0
    at = _batch_at(call, list(tensors))
    if isinstance(at, str):
        return at
    if dim == at:
        return "concatenation along the batch dimension"
    views, offset = [], 0
    for t in tensors:
        tracked = call.tracked(t)
        if tracked is not None:
            index = tracked.flat_index()
            if index.dim() != z.dim() or index.shape[at] != z.shape[at] or not same_along(index, at):
                return f"a parameter operand (shape {tuple(t.shape)}) that is not expanded over the batch"
            views.append((Tracked(tracked.param, index.select(at, 0)), offset, t.shape[dim]))
        offset += t.shape[dim]

    def finish(d: torch.Tensor) -> list[Use]:
        return [(view, Dense(d.narrow(dim, start, size).movedim(at, 0))) for view, start, size in views]

    return Pending(z, [view.param for view, _, _ in views], finish)
