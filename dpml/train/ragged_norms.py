"""Per-example norms and clipped sums of a factored use whose examples hold different numbers of positions: the tokens
a mixture of experts routes to one expert (:mod:`dpml.train.rules.grouped_mm`; a linear layer or an einsum on routed
rows). The rule pads each example's rows with zero rows to the most any example holds, W
(:class:`dpml.train.rules.registry.Rows`), so example i, with r_i ≤ W real rows first, has

    ‖G_i‖² = ‖Σ_{t<r_i} u_t v_tᵀ‖² = Σ_{t,s<r_i} (u_t·u_s)(v_t·v_s)   (Goodfellow 2015; Li et al. 2022, Eq. 2),

and the zero rows change nothing but the cost: a Gram of W² entries where r_i² are needed, a clipped sum over B·W rows
where Σ_i r_i are. Routing makes W several times the mean: an example's padding tokens, all alike, go to the same
experts (Mixtral's 2 of 8 experts over 128 tokens at batch 64, random weights: W of 80 to 120 against a mean of 32).
So here

* the examples are taken in buckets of similar r_i (sorted, every r in a bucket at least :data:`BUCKET_RATIO` of its
  longest), each bucket's rows cut to its longest: two Grams, or the bucket's per-example gradients where
  :func:`dpml.train.clipping_norms.materialise` says so for the bucket (kept where they fit what the pass may keep);
* the clipped sum Σ_i c_i G_i is the kept gradients' weighted sum, and for the other examples one product over their
  real rows only, each row scaled by its example's clip factor: Σ_{rows r} c_{i(r)} u_r v_rᵀ.

The same numbers as the padded arithmetic, added in another order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dpml.devices import heap_sized_slices
from dpml.train.clipping_norms import materialise, row_norms_squared
from dpml.train.keep_budget import keep_limit, room, spend

BUCKET_RATIO = 0.8
"""Each bucket's shortest example holds at least this share of its longest's rows: the Grams of a bucket cost at most
1/0.8² ≈ 1.56 times what its examples' own rows need."""

ONE_BUCKET_BELOW = 8
"""Examples of fewer rows than this, after the longer ones, make one last bucket (a few small products, not many)."""


def buckets(lengths: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """The examples with rows (``lengths`` (B,) on the CPU), longest first, in buckets of similar length: (their
    indices, the bucket's longest)."""
    order = torch.argsort(lengths, descending=True, stable=True)
    ordered = lengths[order].tolist()
    with_rows = sum(1 for length in ordered if length > 0)
    found: list[tuple[torch.Tensor, int]] = []
    start = 0
    while start < with_rows:
        top = int(ordered[start])
        floor = 0.0 if top < ONE_BUCKET_BELOW else BUCKET_RATIO * top
        end = start + 1
        while end < with_rows and ordered[end] >= floor:
            end += 1
        found.append((order[start:end], top))
        start = end
    return found


def _real_rows(lengths: torch.Tensor, width: int, examples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the real rows of ``examples`` lie among the B·W padded ones (example by example), and each one's example:
    both (N,) on the CPU."""
    counts = lengths[examples]
    owners = examples.repeat_interleave(counts)
    firsts = torch.cumsum(counts, 0) - counts
    within = torch.arange(owners.numel()) - firsts.repeat_interleave(counts)
    return owners * width + within, owners


def _gradients(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.bmm(u.transpose(1, 2), v)


def ragged_norms(
    u: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """‖Σ_t u_t v_tᵀ‖² per example (B,) of u (B, W, rows) and v (B, W, cols), example i's rows from ``lengths[i]`` on
    zero, and the clipped sum's function c (B,) → Σ_i c_i Σ_t u_{i,t} v_{i,t}ᵀ (rows, cols) (module docstring)."""
    batch, width, rows = u.shape
    cols, device = v.shape[2], u.device
    squared = torch.zeros(batch, dtype=torch.promote_types(u.dtype, v.dtype), device=device)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    summed: list[torch.Tensor] = []  # examples whose clipped sum is taken over their rows
    for examples, top in buckets(lengths):
        chosen = examples.to(device)
        ub, vb = u[:, :top].index_select(0, chosen), v[:, :top].index_select(0, chosen)
        count, limit = examples.numel(), room(keep_limit(device))
        if not materialise(count, top, cols, rows, limit):
            part = (torch.bmm(ub, ub.transpose(1, 2)) * torch.bmm(vb, vb.transpose(1, 2))).sum((1, 2))
            summed.append(examples)
        elif count * rows * cols <= limit:
            spend(count * rows * cols)
            grads = _gradients(ub, vb)
            part = row_norms_squared(grads)
            kept.append((chosen, grads))
        else:
            slices = heap_sized_slices(count, rows * cols * u.element_size(), device)
            part = torch.cat([row_norms_squared(_gradients(ub[s], vb[s])) for s in slices])
            summed.append(examples)
        squared.index_copy_(0, chosen, part.to(squared.dtype))
    places, owners = _real_rows(lengths, width, torch.cat(summed)) if summed else (None, None)
    if places is not None and owners is not None:
        places, owners = places.to(device), owners.to(device)

    def clipped_sum(factors: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(rows, cols, dtype=squared.dtype, device=device)
        for chosen, grads in kept:
            total += torch.einsum("b,b...->...", factors[chosen].to(grads.dtype), grads)
        if places is not None and owners is not None:
            u_real = u.reshape(-1, rows).index_select(0, places)
            v_real = v.reshape(-1, cols).index_select(0, places)
            weights = factors[owners][:, None]
            if rows <= cols:
                u_real = u_real * weights.to(u_real.dtype)
            else:
                v_real = v_real * weights.to(v_real.dtype)
            total += u_real.t() @ v_real
        return total

    return squared, clipped_sum
