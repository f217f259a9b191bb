"""A parameter concatenated to the batch: ``torch.cat((cls.expand(B, -1, -1), x), dim=1)`` (ViT's cls token), or to a
time-major activation along its time (``nn.MultiheadAttention``'s ``add_bias_kv``: ``torch.cat([k, bias_k.repeat(1,
B, 1)])`` with k (S, B, E)).

The activations must hold the batch along one dimension, the same for all of them (their example maps: batch-first,
or time-major), and the concatenation run along another; the parameter's operand S must be expanded over the batch
there (the same elements in every example's slice); ∇_S ℓ_i is δ_i over S's slice of the result, materialised.

Views of one parameter concatenated with nothing from the batch (``torch.cat((w[:2], w[5:]))``), or with the empty
1-D tensors ``torch.cat`` skips (a key cache's first update, ``torch.cat([torch.tensor([]), prefix_keys], dim=-2)``,
as ``transformers``' caches start), are a view of that parameter: its index tensors concatenated the same way
(:func:`view_of_one_parameter`), tracked, so that where the result meets the batch its rule sees the parameter.
"""

from __future__ import annotations

import torch

from dpml.train.rules.flat_indices import same_along
from dpml.train.rules.registry import Call, Dense, Pending, Shared, Tracked, Use, rule


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


def view_of_one_parameter(call: Call, tensors: list[torch.Tensor], dim: int) -> Shared | None:
    """The concatenation as a view of one parameter (module docstring), or None: every operand but the skipped empty
    ones (shape (0,), z's dtype, not tracked) a view of the same parameter."""
    z = call.output
    skipped = [t for t in tensors if call.tracked(t) is None]
    if any(t.shape != (0,) or t.dtype != z.dtype or t.requires_grad for t in skipped):
        return None
    views = [v for v in map(call.tracked, tensors) if v is not None]
    if not views or any(v.param is not views[0].param for v in views):
        return None
    index = torch.cat([v.flat_index() for v in views], dim)
    if index.shape != z.shape:
        return None
    return Shared([(z, Tracked(views[0].param, index, all(v.shared for v in views)))])


@rule(torch.cat, torch.concat, torch.concatenate)
def concatenate(call: Call) -> Pending | Shared | str:
    tensors, dim = call.arg(0, "tensors"), call.arg(1, "dim", 0)
    z = call.output
    if (view := view_of_one_parameter(call, list(tensors), dim)) is not None:
        return view
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
