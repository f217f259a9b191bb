"""A parameter written into chosen places of an activation: ``x[mask] = v`` (wav2vec2's, HuBERT's and WavLM's learned
embedding for the time steps SpecAugment masks; an MAE-style mask token), ``x[:, 0] = v``. The recorder runs an
in-place write with a rule out of place (:func:`dpml.train.rules.operands.written_at`, then copied into x), so the
rule sees z = x with v broadcast over the places ``key`` chooses, S = z[key]. Each chosen element belongs to the
example of its row of x, and

∇_v ℓ_i = Σ_{e ∈ S of example i} δ_e, summed over the dimensions v is broadcast on,

materialised (the size of v per example). A value with one row per chosen element (not broadcast) is refused.
"""

from __future__ import annotations

import torch

from dpml.train.rules.operands import written_at
from dpml.train.rules.registry import Call, Dense, Pending, Use, rule


@rule(written_at)
def chosen_places(call: Call) -> Pending | str:
    x, key, value = call.arg(0, "input"), call.arg(1, "key"), call.arg(2, "value")
    v = call.tracked(value)
    owners = call.leading_examples(x)
    if v is None or call.tracked(x) is not None or not isinstance(value, torch.Tensor):
        return "a written value that is not the parameter's own"
    if owners is None:
        return f"its target (shape {tuple(x.shape)}) is not batch-first"
    chosen = call.output[key]
    padded = (1,) * (chosen.dim() - value.dim()) + tuple(value.shape)
    if chosen.dim() < 1 or len(padded) != chosen.dim() or padded[0] != 1 and chosen.shape[0] > 1:
        return "a value not broadcast over the chosen places"
    places = owners.to(x.device).reshape(-1, *[1] * (x.dim() - 1)).expand(x.shape)[key]  # each chosen element's example
    if places.dim() != chosen.dim():
        return "chosen places whose examples are not known"
    rows = places.reshape(places.shape[0], -1)[:, 0] if places.numel() else places.reshape(-1)
    summed = [k for k in range(1, chosen.dim()) if padded[k] == 1 and chosen.shape[k] != 1]
    batch = call.batch

    def finish(d: torch.Tensor) -> list[Use]:
        g = d[key]
        g = g.sum(summed, keepdim=True) if summed else g
        grads = g.new_zeros(batch, *g.shape[1:]).index_add_(0, rows, g)
        return [(v, Dense(grads.reshape(batch, *v.shape())))]

    return Pending(call.output, [v.param], finish)
