"""Per-example norms and clipped sums as tensor arithmetic, for the layers' closed forms
(:mod:`dpml.train.clipping_layers`): row norms, the weighted sum of kept per-example gradients, the positions a
dense layer's gradients can leave out, and an embedding's per-example norms by sorting (example, token) pairs."""

from __future__ import annotations

import functools
import itertools

import torch


def row_norms_squared(t: torch.Tensor) -> torch.Tensor:
    """‖t_i‖² of each example's slice t_i = t[i] (B,), by one fused reduction (no squared copy of t)."""
    norms: torch.Tensor = torch.linalg.vector_norm(t.reshape(t.shape[0], -1), dim=1)
    return norms.square()


def kept_sum(factors: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """Σ_i c_i G_i of per-example gradients kept in consecutive slices of examples, (B_k, …) each."""
    # accumulate's initial 0 gives one start more than there are parts (the last is the end): strict=False
    starts = itertools.accumulate((part.shape[0] for part in parts), initial=0)
    terms = [
        torch.einsum("b,b...->...", factors[start : start + part.shape[0]], part)
        for start, part in zip(starts, parts, strict=False)
    ]
    return functools.reduce(torch.add, terms)  # at least one (possibly empty) slice: heap_sized_slices


def without_silent_positions(a: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, Δ) over positions (B, T, …) without the positions t at which δ_{i,t} = 0 for every example i: they add
    nothing to any example's Σ_t δ_t a_tᵀ or Σ_t δ_t (a classifier that reads one token: every position but that
    one in its last block). Dropped where at least half the positions are silent (copying A and Δ costs more than
    a few positions save). The test reads Δ once; a sync on a GPU, so it is taken on a CPU only."""
    live = d.flatten(2).any(2).any(0)  # (T,): some example's δ_t has a non-zero entry
    count = int(live.sum())
    if 2 * count > d.shape[1]:
        return a, d
    index = live.nonzero().squeeze(1) if count else live.new_zeros(1, dtype=torch.int64)
    return a.index_select(1, index), d.index_select(1, index)


def embedding_norms_squared(tokens: torch.Tensor, d: torch.Tensor, vocabulary: int) -> torch.Tensor:
    """Σ_k ‖Σ_{t: k_t = k} δ_t‖² per example = Σ_{t,s} [k_t = k_s](δ_t·δ_s), for tokens (B, T), δ (B, T, D).

    The B·T pairs (i, k_{i,t}) are sorted; equal pairs are then adjacent, and a running count of
    "new pair" flags numbers them, so one ``index_add`` gives the row sums Σ_{t: k_t = k} δ_{i,t}.
    Shapes stay fixed (at most B·T distinct pairs; unused rows stay zero): no device synchronisation.
    """
    batch, count = tokens.shape
    keys = (torch.arange(batch, device=tokens.device)[:, None] * vocabulary + tokens).reshape(-1)
    keys, order = keys.sort()
    new = torch.ones_like(keys, dtype=torch.bool)
    new[1:] = keys[1:] != keys[:-1]
    pair = new.cumsum(0) - 1  # (B·T,): which distinct (example, token) pair each sorted position holds
    rows = d.new_zeros(batch * count, d.shape[2]).index_add_(0, pair, d.reshape(-1, d.shape[2])[order])
    example_of_pair = torch.zeros_like(pair).scatter_(0, pair, keys // vocabulary)
    return d.new_zeros(batch).index_add_(0, example_of_pair, rows.pow(2).sum(1))
