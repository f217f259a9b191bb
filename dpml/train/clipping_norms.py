"""Per-example norms and clipped sums as tensor arithmetic, for the layers' closed forms
(:mod:`dpml.train.clipping_layers`): row norms, the weighted sum of kept per-example gradients, the positions a
dense layer's gradients can leave out, and an embedding's per-example norms by sorting (example, token) pairs."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
from collections.abc import Iterator

import torch


def row_norms_squared(t: torch.Tensor) -> torch.Tensor:
    """‖t_i‖² of each example's slice t_i = t[i] (B,), by one fused reduction (no squared copy of t)."""
    norms: torch.Tensor = torch.linalg.vector_norm(t.reshape(t.shape[0], -1), dim=1)
    return norms.square()


GRAMS_REMEMBERED = 2
"""How many Gram matrices :func:`self_gram` remembers within :func:`shared_grams`, the last asked for: a recurrent
layer's W_hh asks for its states' Gram between W_ih's δ Gram and its own; attention's key projection for its δ's
between the query's input Gram and the value's. One Gram more alive than without (B·T² numbers)."""

_GRAMS: contextvars.ContextVar[list[tuple[tuple[object, ...], torch.Tensor, int, torch.Tensor]] | None] = (
    contextvars.ContextVar("dpml_shared_grams", default=None)
)


@contextlib.contextmanager
def shared_grams() -> Iterator[None]:
    """Within the block, :func:`self_gram` of an operand it formed recently is not formed again: two parameters whose
    gradients share a factor (a recurrent layer's W_ih and W_hh, both Σ_t δ_t ·ᵀ with the same δ of the layer's
    input terms; attention's query, key and value projections, Σ_t · a_tᵀ with the same input a) ghost-norm it once."""
    token = _GRAMS.set([])
    try:
        yield
    finally:
        _GRAMS.reset(token)


def self_gram(t: torch.Tensor) -> torch.Tensor:
    """(t_s · t_u) per example, (B, T, T) of t (B, T, n): the Gram matrix of a ghost norm (Goodfellow 2015; Li et al.
    2022: ‖Σ_t δ_t a_tᵀ‖² = Σ_{s,u} (δ_s·δ_u)(a_s·a_u)). Within :func:`shared_grams` the same operand (the same
    numbers: address, shape, strides, dtype and version) asked again gives the Gram formed before; the entry holds
    the operand, so its memory cannot become another tensor's while it is remembered (a tensor at its address is a
    view of it, with its version counter)."""
    remembered = _GRAMS.get()
    if remembered is None:
        return torch.bmm(t, t.transpose(1, 2))
    key = (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
    for place, (k, _, version, gram) in enumerate(remembered):
        if k == key and t._version == version:
            remembered.append(remembered.pop(place))  # the last asked for is the last let go
            return gram
    gram = torch.bmm(t, t.transpose(1, 2))
    remembered.append((key, t, t._version, gram))
    del remembered[:-GRAMS_REMEMBERED]
    return gram


def kept_sum(factors: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """Σ_i c_i G_i of per-example gradients kept in consecutive slices of examples, (B_k, …) each."""
    # accumulate's initial 0 gives one start more than there are parts (the last is the end): strict=False
    starts = itertools.accumulate((part.shape[0] for part in parts), initial=0)
    terms = [
        torch.einsum("b,b...->...", factors[start : start + part.shape[0]], part)
        for start, part in zip(starts, parts, strict=False)
    ]
    return functools.reduce(torch.add, terms)  # at least one (possibly empty) slice: heap_sized_slices


def clipped_outer_sum(d: torch.Tensor, a: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Σ_i c_i Σ_t δ_{i,t} a_{i,t}ᵀ, (d_out, d_in), of δ (B, T, d_out) and a (B, T, d_in): a dense layer's clipped sum
    by one product over all positions. The clip factors scale the narrower operand (the fewer numbers to write), and
    the positions are taken in the order both operands lie in memory: time-major rows (a recurrent layer's, a module's
    with ``batch_first=False``), read as (B, T, ·) views, are not gathered into examples' rows first."""
    if d.shape[2] <= a.shape[2]:
        d = d * factors[:, None, None]  # (keeps d's layout)
    else:
        a = a * factors[:, None, None]
    time_major = d.shape[1] > 1 and d.transpose(0, 1).is_contiguous() and a.transpose(0, 1).is_contiguous()
    if time_major:
        d, a = d.transpose(0, 1), a.transpose(0, 1)
    return d.reshape(-1, d.shape[2]).t() @ a.reshape(-1, a.shape[2])


def without_silent_positions(a: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, Δ) over positions (B, T, …) without the positions t at which δ_{i,t} = 0 for every example i: they add
    nothing to any example's Σ_t δ_t a_tᵀ or Σ_t δ_t (a classifier that reads one token: every position but that
    one in its last block). Dropped where at least half the positions are silent (copying A and Δ costs more than
    a few positions save). A position live for one example is live, so the first example's live positions, more than
    half of them in most layers (ad hoc: 17 of Swin's calls, 7.4 ms a step, read all of Δ to keep every position),
    settle it after reading 1/B of Δ; otherwise the test reads Δ once. A sync on a GPU, so it is taken on a CPU only."""
    if d.shape[0] and 2 * int(d[0].flatten(1).any(1).sum()) > d.shape[1]:
        return a, d
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


KEEP_TRAFFIC = 4
"""Multiply-adds per kept number in :func:`materialise`: ResNet-18's 128-channel 3×3 convolutions on 4×4 maps
(B = 64, T²(d_in + d_out) = 2.2·d_in·d_out) took 2.9 ms a layer materialised and kept against 1.6 ms by ghost norm
and the weight-gradient convolution of the clip-weighted δ; its 64-channel ones on 8×8 (17.8·) stay materialised."""


def materialise(batch: int, count: int, d_in: int, d_out: int, limit: int) -> bool:
    """Whether a dense layer's per-example weight gradients (B, d_out, d_in) over T = ``count`` positions
    are to be materialised rather than ghost-normed.

    Ghost norm costs T²·(d_in + d_out) per example for the two Gram matrices and then a second pass
    over the positions for the clipped sum (T·d_in·d_out); materialising costs T·d_in·d_out once, and
    the clipped sum is then a weighted sum of the kept gradients — but the kept gradients are written
    and read again, d_in·d_out numbers per example each way, memory traffic worth about
    ``KEEP_TRAFFIC`` multiply-adds per number. So when they fit in ``limit`` elements (the device's
    :func:`keep_limit`) they are materialised as soon as the Gram matrices cost more than that traffic;
    when they do not fit, only where the Gram matrices alone (T² numbers) are larger than the gradient
    (d_in·d_out numbers), the memory-saving rule of ghost clipping."""
    if batch * d_in * d_out <= limit:
        return count * count * (d_in + d_out) > KEEP_TRAFFIC * d_in * d_out
    return count * count > d_in * d_out


def grouped_by_ghost_norm(pairs: int, count: int, d_in: int, d_out: int, limit: int) -> bool:
    """Whether a grouped convolution's per-example norm is the ghost norm of its groups (each a dense layer from
    its live patch, d_in numbers, to d_out output channels, over ``count`` positions; ``pairs`` = B·g), not its
    per-example gradients: where :func:`materialise` says so for the groups, and the gradients would hold more
    than ``KEEP_TRAFFIC`` times the patches the ghost norm reads (d_out > ``KEEP_TRAFFIC``·T). A depthwise layer's
    (d_out = 1) are as small as its patches, and kept they spare its clipped sum a second pass."""
    return d_out > KEEP_TRAFFIC * count and not materialise(pairs, count, d_in, d_out, limit)


FOLDED_GROUP_NORM_MIN_POSITIONS = 32
"""From this many positions per channel up, :func:`group_norm_affine_gradients` takes ATen's GroupNorm kernels (ad hoc
on this project's 2-core CPU at batch 64: 10.8 against 20.0 ms for 64 channels of 8×16×16, a video model's; 0.09
against 0.12 ms for 64 channels of 8×8; 0.29 against 0.10 ms for 256 channels of 2×2)."""


def group_norm_affine_gradients(
    inputs: torch.Tensor, output_grad: torch.Tensor, groups: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A GroupNorm's per-example ∇_γ ℓ_i = Σ_t x̂_{i,c,t} δ_{i,c,t} and ∇_β ℓ_i = Σ_t δ_{i,c,t}, (B, C) each, by
    ATen's own GroupNorm forward (for the groups' means and 1/σ) and backward on the batch folded into the channels:
    one sample of B·C channels in B·G groups, whose γ and β gradients are then every example's (the backward's sums
    over the batch run over that one sample). None on a GPU (unmeasured there) or below
    ``FOLDED_GROUP_NORM_MIN_POSITIONS`` positions per channel, where recomputing x̂ is the faster."""
    batch, channels = inputs.shape[:2]
    count = inputs[0, 0].numel()
    if inputs.device.type != "cpu" or count < FOLDED_GROUP_NORM_MIN_POSITIONS:
        return None
    flat, d = inputs.reshape(1, batch * channels, count), output_grad.reshape(1, batch * channels, count)
    ones = inputs.new_ones(batch * channels)
    _, mean, rstd = torch.ops.aten.native_group_norm(flat, ones, None, 1, batch * channels, count, batch * groups, eps)
    _, weight, bias = torch.ops.aten.native_group_norm_backward(
        d, flat, mean, rstd, ones, 1, batch * channels, count, batch * groups, (False, True, True)
    )
    return weight.view(batch, channels), bias.view(batch, channels)
