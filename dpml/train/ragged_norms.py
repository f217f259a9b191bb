"""Per-example norms and clipped sums of a factored use whose examples hold different numbers of positions: the tokens
a mixture of experts routes to one expert (:mod:`dpml.train.rules.grouped_mm`; a linear layer or an einsum on routed
rows). Padded, each example's rows would be followed by zero rows up to the most any example holds, W
(:class:`dpml.train.rules.registry.Rows`); example i, with r_i ≤ W real rows, has

    ‖G_i‖² = ‖Σ_{t<r_i} u_t v_tᵀ‖² = Σ_{t,s<r_i} (u_t·u_s)(v_t·v_s)   (Goodfellow 2015; Li et al. 2022, Eq. 2),

and zero rows would change nothing but the cost: a Gram of W² entries where r_i² are needed, a clipped sum over B·W
rows where Σ_i r_i are. Routing makes W several times the mean: an example's padding tokens, all alike, go to the same
experts (Mixtral's 2 of 8 experts over 128 tokens at batch 64, random weights: W of 80 to 120 against a mean of 32).
So the rows come packed, example by example (:class:`dpml.train.rules.ragged.Ragged`; :func:`packed` of padded ones),
and

* the examples are taken in buckets of similar r_i (sorted, every r in a bucket at least :data:`BUCKET_RATIO` of its
  longest), each bucket's rows cut to its longest: two Grams, or the bucket's per-example gradients where
  :func:`dpml.train.clipping_norms.materialise` says so for the bucket (kept where they fit what the pass may keep);
* the clipped sum Σ_i c_i G_i is the kept gradients' weighted sum, and for the other examples one product over their
  real rows only, each row scaled by its example's clip factor: Σ_{rows r} c_{i(r)} u_r v_rᵀ.

The same numbers as the padded arithmetic, added in another order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


def _spans(
    counts: torch.Tensor, examples: torch.Tensor, order: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the rows of ``examples`` lie among rows packed example by example (``counts`` rows each; or, with
    ``order``, among rows of which order[k] is the k-th in that packing), and each row's place within its example:
    both (N,) on the CPU."""
    firsts = torch.cumsum(counts, 0) - counts
    chosen = counts[examples]
    within = torch.arange(int(chosen.sum())) - (torch.cumsum(chosen, 0) - chosen).repeat_interleave(chosen)
    places = firsts[examples].repeat_interleave(chosen) + within
    return (places if order is None else order[places]), within


def packed(t: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Padded rows t (B, W, n), example i's real ones first (``lengths[i]``), as (N, n) example by example."""
    _, within = _spans(lengths, torch.arange(t.shape[0]))
    owners = torch.arange(t.shape[0]).repeat_interleave(lengths)
    return t.reshape(-1, t.shape[2]).index_select(0, (owners * t.shape[1] + within).to(t.device))


@dataclass
class _Buckets:
    """Where the buckets' rows come from: ``sources`` (size,) for each of the buckets' Σ_b n_b·top_b padded rows the
    packed row it copies, ``pads`` the padded rows that stay zero (None: no padding), and each bucket's (examples on
    the device, first padded row, top)."""

    sources: torch.Tensor
    pads: torch.Tensor | None
    spans: list[tuple[torch.Tensor, int, int]]

    def of(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Packed t (N, n) as each bucket's (n_b, top_b, n): one gather, its padding rows then zeroed."""
        picked = t.index_select(0, self.sources)
        if self.pads is not None:
            picked.index_fill_(0, self.pads, 0)
        return [picked[start : start + e.numel() * top].view(e.numel(), top, -1) for e, start, top in self.spans]


def _laid_out(
    counts: torch.Tensor, order: torch.Tensor | None, found: list[tuple[torch.Tensor, int]], device: torch.device
) -> _Buckets:
    examples = torch.cat([e for e, _ in found])
    tops = torch.cat([torch.full((e.numel(),), top) for e, top in found])
    places, within = _spans(counts, examples, order)
    starts = torch.cumsum(tops, 0) - tops  # each example's first padded row
    size = int(tops.sum())
    sources, pads = places, None
    if size != places.numel():
        slots = starts.repeat_interleave(counts[examples]) + within
        sources = torch.zeros(size, dtype=places.dtype).index_copy_(0, slots, places)
        is_pad = torch.ones(size, dtype=torch.bool).index_fill_(0, slots, False)
        pads = is_pad.nonzero().squeeze(1).to(device)
    on_device, spans, first = examples.to(device), [], 0
    for e, top in found:
        spans.append((on_device[first : first + e.numel()], int(starts[first]), top))
        first += e.numel()
    return _Buckets(sources.to(device), pads, spans)


def row_owners(counts: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Each row's example (N,) on the CPU, the rows packed example by example (``counts`` rows each) or, with
    ``order`` (order[k] the k-th row of that packing), where they lie."""
    by_example = torch.arange(counts.numel()).repeat_interleave(counts)
    return by_example if order is None else torch.empty_like(by_example).index_copy_(0, order, by_example)


def _gradients(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.bmm(u.transpose(1, 2), v)


def ragged_norms(
    u: torch.Tensor, v: torch.Tensor, counts: torch.Tensor, order: torch.Tensor | None = None
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """‖Σ_t u_t v_tᵀ‖² per example (B,) of rows u (N, rows) and v (N, cols), example i holding ``counts[i]`` of them
    (on the CPU), packed example by example — or, with ``order`` (N,) on the CPU, in any order, order[k] the k-th row
    of that packing (the clipped sum, a sum over rows, reads them where they lie) — and the clipped sum's function
    c (B,) → Σ_i c_i Σ_t u_{i,t} v_{i,t}ᵀ (rows, cols) (module docstring)."""
    batch, rows, cols, device = counts.numel(), u.shape[1], v.shape[1], u.device
    squared = torch.zeros(batch, dtype=torch.promote_types(u.dtype, v.dtype), device=device)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    summed: list[torch.Tensor] = []  # examples whose clipped sum is taken over their rows
    found = buckets(counts)
    laid = _laid_out(counts, order, found, device) if found else None
    pieces = zip(found, laid.spans, laid.of(u), laid.of(v), strict=True) if laid is not None else iter(())
    for (examples, top), (chosen, _, _), ub, vb in pieces:
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
    rest = torch.cat(summed) if summed else torch.zeros(0, dtype=torch.int64)
    everyone = int(counts[rest].sum()) == u.shape[0]  # the real rows of every example: u and v where they lie
    places = None if everyone or not summed else _spans(counts, rest, order)[0].to(device)
    owners = row_owners(counts, order) if everyone else rest.repeat_interleave(counts[rest])
    owners = owners.to(device)

    def clipped_sum(factors: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(rows, cols, dtype=squared.dtype, device=device)
        for chosen, grads in kept:
            total += torch.einsum("b,b...->...", factors[chosen].to(grads.dtype), grads)
        if summed:
            u_real = u if places is None else u.index_select(0, places)
            v_real = v if places is None else v.index_select(0, places)
            weights = factors[owners][:, None]
            if rows <= cols:
                u_real = u_real * weights.to(u_real.dtype)
            else:
                v_real = v_real * weights.to(v_real.dtype)
            total += u_real.t() @ v_real
        return total

    return squared, clipped_sum
