"""Per-layer closed forms of per-example gradient norms and clipped sums (the engine's fast path).

Every *fast* layer computes z_t = f(a_t; W) at positions t of one example (the rows of a dense
layer's input, the output pixels of a convolution, the tokens of an embedding, the positions that
share a normalisation's γ and β). Given the recorded input and the output gradient
δ_{i,t} = ∂ℓ_i/∂z_{i,t} of each example i, the per-example gradient follows without autograd:

- **Linear and Conv2d** (Goodfellow 2015; ghost norm / book-keeping of Li et al. 2022, Bu et al.
  2023): ∇_W ℓ_i = Σ_t δ_t a_tᵀ, ∇_b ℓ_i = Σ_t δ_t, and
      ‖∇_W ℓ_i‖_F² = Σ_{t,s} (a_t·a_s)(δ_t·δ_s)   (two T×T Gram matrices; ‖a‖²‖δ‖² for T = 1),
  or ∇_W ℓ_i materialised, whichever costs less arithmetic (:func:`materialise`; materialised
  gradients that fit in memory are kept, and the clipped sum is then Σ_i c_i ∇_W ℓ_i). Otherwise
  the clipped sum is one contraction Σ_i c_i Σ_t δ_{i,t} a_{i,t}ᵀ — for a convolution, the layer's
  own weight-gradient convolution of the clip-weighted δ, without unfolded patches. A convolution's per-example
  gradients and ghost norms: :func:`per_example_conv_way`, :func:`patch_slice_norms_squared` (for a stride-1
  convolution the patches' Gram matrix from that of the padded input's positions:
  :func:`dpml.train.clipping_conv.input_gram_norms_squared`). Kept gradients come in slices of examples
  that the CPU's heap keeps between steps (:func:`dpml.devices.heap_sized_slices`).
  A **Conv1d** is the Conv2d of height 1 (:mod:`dpml.train.clipping_conv`); ``padding="same"``/``"valid"`` resolved.
  A **grouped** convolution (``groups`` = g > 1, depthwise included) has one such matrix per group,
  materialised for all (example, group) pairs at once by one of three kernels, the fastest for the shape
  (:mod:`dpml.train.clipping_conv_ways`).
- **Embedding** (z_t = W[k_t]): ‖∇_W ℓ_i‖_F² = Σ_k ‖Σ_{t: k_t = k} δ_t‖², by sorting the
  (example, token) pairs; ``padding_idx`` positions get no gradient. Clipped sum by ``index_add``.
- **LayerNorm and GroupNorm** (affine, z = x̂⊙γ + β, x̂ recomputed with the layer's own function):
  ∇_γ ℓ_i = Σ_t x̂_t⊙δ_t, ∇_β ℓ_i = Σ_t δ_t, materialised (they are small); a GroupNorm's over many positions on a
  CPU by ATen's GroupNorm kernels on the batch folded into the channels
  (:func:`dpml.train.clipping_norms.group_norm_affine_gradients`).
- **Layers that know their own shortcut** (``ghost_clipping = True``, e.g.
  :class:`dpml.models.gated.GatedLinear`) supply ‖∇_W ℓ_i‖² and Σ_i c_i ∇_W ℓ_i themselves.

A layer that runs several times in one forward pass (a cell unrolled over time, a block applied
twice) has ∇_W ℓ_i = Σ_calls Σ_t δ_t a_tᵀ: its positions are the positions of all its calls, so the
calls' (a, δ) are concatenated along t and the formulas above apply unchanged (not for
``ghost_clipping`` layers, whose shortcut sees one call).

These formulas hold only when the layer's parameters reach the loss through the layer's own stock
forward; :mod:`dpml.train.clipping_check` verifies that on a probe batch before training.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard, TypeVar

import torch
import torch.nn.functional as F
import torch.nn.grad
from torch import nn
from torch.nn.utils import parametrize

from dpml.devices import convolution_weight_gradient_precision, heap_sized_slices
from dpml.train.clipping_conv import (
    Geometry,
    as_2d,
    clip_weighted_conv_weight,
    compiled_beats_ghost,
    compiled_norms,
    conv_geometry,
    kernel_from_taps,
    patch_slice_norms_squared,
    unfold_patches,
    weight_from_columns,
)
from dpml.train.clipping_conv_ways import (
    grouped_conv_live_tap_gradients,
    grouped_ghost_norms_squared,
    in_window,
    is_pointwise,
    live_window,
    per_example_conv_gradients,
    per_example_conv_way,
    pointwise_by_rows,
    pointwise_rows,
)
from dpml.train.clipping_norms import (
    clipped_outer_sum,
    embedding_norms_squared,
    group_norm_affine_gradients,
    grouped_by_ghost_norm,
    kept_sum,
    materialise,
    row_norms_squared,
    self_gram,
    without_silent_positions,
)
from dpml.train.keep_budget import keep_limit, room, spend

M = TypeVar("M", bound=nn.Module)

ClippedSums = Callable[
    [torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]
]  # c (B,) -> [(parameter p, Σ_i c_i ∇_p ℓ_i)]


def _stock(module: nn.Module, cls: type[M]) -> TypeGuard[M]:
    """``module`` is a ``cls`` that runs ``cls``'s own forward (a subclass may compute something else)."""
    return isinstance(module, cls) and type(module).forward is cls.forward


def is_fast(module: nn.Module) -> bool:
    """Layers whose per-example gradients follow from their activations and output gradients."""
    if parametrize.is_parametrized(module):  # W = g(W₀): the gradient wanted is W₀'s (the operation rules pull it back)
        return False
    if getattr(module, "ghost_clipping", False):  # a dpml layer that computes its own (e.g. GatedLinear)
        return True
    if _stock(module, nn.Linear):
        return True
    if _stock(module, nn.Conv2d) or _stock(module, nn.Conv1d):
        return module.padding_mode == "zeros" and conv_geometry(module) is not None
    if _stock(module, nn.Embedding):
        # max_norm renormalises rows of W inside the forward; scale_grad_by_freq scales by counts in
        # the whole batch. (sparse only changes the layout of .grad, which the sums here never use.)
        return module.max_norm is None and not module.scale_grad_by_freq
    if _stock(module, nn.LayerNorm):
        return module.weight is not None
    if _stock(module, nn.GroupNorm):
        return module.affine
    return False


def takes_runs_of_rows(module: nn.Module) -> bool:
    """A layer whose input's dimensions between the batch's and its own last ones are all positions (``nn.Linear``,
    ``nn.LayerNorm``, ``nn.Embedding``): its call on (B·k, …) with each example's slices in one run of k is the same
    layer's call on (B, k, …), whose shortcut takes the positions of each example together."""
    return any(_stock(module, cls) for cls in (nn.Linear, nn.LayerNorm, nn.Embedding)) and is_fast(module)


def layer_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters a fast layer's shortcut accounts for: its weight and (if any) bias."""
    return [p for p in (getattr(module, "weight", None), getattr(module, "bias", None)) if p is not None]


def trainable(p: torch.Tensor | None) -> bool:
    return p is not None and p.requires_grad


def batch_first(module: nn.Module, inputs: torch.Tensor, batch: int) -> bool:
    """The recorded input has the batch as its leading dimension (the shortcuts need it)."""
    if inputs.dim() == 0 or inputs.shape[0] != batch:
        return False
    if isinstance(module, nn.Conv2d):
        return inputs.dim() == 4
    if isinstance(module, nn.Conv1d):
        return inputs.dim() == 3
    if isinstance(module, nn.LayerNorm):
        return inputs.dim() > len(module.normalized_shape)
    return isinstance(module, nn.Embedding) or inputs.dim() >= 2


def positions(module: nn.Module, inputs: torch.Tensor, output_grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of a fast layer as (A, Δ) over positions t: A (B, T, …) what multiplies γ or W at each
    position (dense input rows, conv patches, tokens, normalised inputs x̂), Δ (B, T, …) the output
    gradients there. Calls of one layer concatenate along T."""
    batch = inputs.shape[0]
    if isinstance(module, nn.Linear):
        return inputs.reshape(batch, -1, inputs.shape[-1]), output_grad.reshape(batch, -1, output_grad.shape[-1])
    if is_pointwise(module):  # a Linear at each position: its rows, no patches
        return pointwise_rows(module, inputs, output_grad)
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):  # patches (B, C_in·K, T), δ (B, C_out, T), transposed
        unfolded = unfold_patches(as_2d(module, inputs), *conv_geometry(module))  # type: ignore[misc]
        return unfolded.transpose(1, 2), output_grad.reshape(batch, output_grad.shape[1], -1).transpose(1, 2)
    if isinstance(module, nn.Embedding):
        tokens = inputs.reshape(batch, -1)
        d = output_grad.reshape(batch, tokens.shape[1], module.embedding_dim)
        if module.padding_idx is not None:
            d = d * (tokens != module.padding_idx).unsqueeze(2)
        return tokens, d
    if isinstance(module, nn.LayerNorm):
        shape = (batch, -1, *module.normalized_shape)
        normalised = F.layer_norm(inputs, module.normalized_shape, eps=module.eps)
        return normalised.reshape(shape), output_grad.reshape(shape)
    if isinstance(module, nn.GroupNorm):
        channels = inputs.shape[1]
        normalised = F.group_norm(inputs, module.num_groups, eps=module.eps)
        return (
            normalised.reshape(batch, channels, -1).transpose(1, 2),
            output_grad.reshape(batch, channels, -1).transpose(1, 2),
        )
    raise TypeError(f"{type(module).__name__} has no position form")


def weight_norms_squared(
    a: torch.Tensor, d: torch.Tensor, freed: int = 0
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """‖Σ_t δ_t a_tᵀ‖_F² per example, by the cheaper of the Gram trick and materialising. When it materialises the
    per-example gradients G_i = Σ_t δ_t a_tᵀ (in slices of examples: :func:`dpml.devices.heap_sized_slices`) and
    they are small enough, they are returned too: the clipped sum is then Σ_i c_i G_i (:func:`kept_sum`), not a
    second pass over all positions. ``freed``: what keeping them lets go (:func:`.keep_budget.room`)."""
    (batch, count, d_in), d_out, limit = a.shape, d.shape[2], room(keep_limit(a.device), freed)
    if not materialise(batch, count, d_in, d_out, limit):
        return (self_gram(a) * self_gram(d)).sum((1, 2)), None
    parts = [
        torch.bmm(d[s].transpose(1, 2), a[s])
        for s in heap_sized_slices(batch, d_out * d_in * a.element_size(), a.device)
    ]
    keep = batch * d_in * d_out <= limit
    if keep:
        spend(batch * d_in * d_out, freed)
    return torch.cat([row_norms_squared(part) for part in parts]), parts if keep else None


@dataclass
class Piece:
    """One fast layer's share: the per-example squared norm (B,) of the gradient of its trainable
    parameters, and ``sums``, which maps the clip factors c (B,) to Σ_i c_i ∇_p ℓ_i for each of them."""

    squared: torch.Tensor
    sums: ClippedSums


def added_up(terms: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Σ of squared-norm terms (B,) in the dtype that adding them to zeros like ``like`` (B, …) would give, and those
    zeros when there is none; without the zeros to start from, and many terms in two launches (stack, sum)."""
    if not terms:
        return like.new_zeros(like.shape[0])
    total = functools.reduce(torch.add, terms) if len(terms) <= 2 else torch.stack(terms).sum(0)
    return total if total.dtype == like.dtype else total.to(torch.promote_types(total.dtype, like.dtype))


def materialised_piece(per_example: list[tuple[torch.Tensor, torch.Tensor]], like: torch.Tensor) -> Piece:
    """A piece from explicit per-example gradients G_i (B, *p.shape): ‖G_i‖² and Σ_i c_i G_i (B = len(like))."""
    squared = added_up([row_norms_squared(g) for _, g in per_example], like)
    return Piece(squared, lambda factors: [(p, torch.einsum("b,b...->...", factors, g)) for p, g in per_example])


def _dense_piece(module: nn.Linear | nn.Conv1d | nn.Conv2d, a: torch.Tensor, d: torch.Tensor) -> Piece:
    """Linear / Conv1d / Conv2d: ‖Σ_t δ_t a_tᵀ‖² by ghost norm or materialised (at one position, as a Linear on
    rows: ‖a‖²‖δ‖², with the bias's ‖δ‖² in the same product), ‖Σ_t δ_t‖², and their clipped sums; on a CPU
    over the positions where some example's δ_t is not zero only (:func:`without_silent_positions`)."""
    if a.device.type == "cpu" and d.shape[1] > 1:  # (one position is never dropped)
        a, d = without_silent_positions(a, d)
    weight, bias, kept = trainable(module.weight), trainable(module.bias), None
    bias_grads = (d[:, 0] if d.shape[1] == 1 else d.sum(1)) if bias else None  # ∇_b ℓ_i = Σ_t δ_t, (B, d_out)
    if d.shape[1] == 1:
        squared = row_norms_squared(d[:, 0])  # ‖δ‖²: the bias's
        if weight:  # ‖δ aᵀ‖² = ‖δ‖²‖a‖², plus the bias's ‖δ‖² in one launch
            a_squared = row_norms_squared(a[:, 0])
            squared = torch.addcmul(squared, squared, a_squared) if bias else squared * a_squared
    else:
        terms = [row_norms_squared(bias_grads)] if bias_grads is not None else []
        if weight:
            weight_squared, kept = weight_norms_squared(a, d, a.numel() + d.numel())  # (kept: a and δ let go)
            terms.append(weight_squared)
        squared = added_up(terms, d)
    held = [(d, a)] if weight and kept is None else []  # (where the sum reads neither, a and δ are let go)

    def sums(factors: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        if weight:
            flat = kept_sum(factors, kept) if kept is not None else clipped_outer_sum(*held[0], factors)
            out.append((module.weight, flat.reshape(module.weight.shape)))  # (d_out, d_in)
        if bias_grads is not None and module.bias is not None:
            out.append((module.bias, factors @ bias_grads))
        return out

    return Piece(squared, sums)


def _conv_piece(module: nn.Conv2d, inputs: torch.Tensor, output_grad: torch.Tensor) -> Piece:
    """Conv2d, one call: ‖∇_W ℓ_i‖² by ghost norm (on a CPU from the Gram matrix of the input's positions or
    patches a slice at a time: :func:`patch_slice_norms_squared`; or by the compiled kernel, keeping nothing,
    where it is the cheaper: :func:`compiled_beats_ghost`) or from the materialised
    per-example gradients (:func:`materialise` decides), the latter in the way
    :func:`per_example_conv_way` picks for the device and shape (kept ones on a GPU at the precision of the
    layer's own weight gradient: :func:`convolution_weight_gradient_precision`). The clipped sum: from the kept
    per-example gradients, or else (also after ``"patch slices"``, which keep none) without patches, by
    the layer's own weight-gradient convolution of the clip-weighted δ."""
    batch, out_channels = output_grad.shape[:2]
    count, patch = output_grad[0, 0].numel(), module.weight[0].numel()
    geometry: Geometry = conv_geometry(module)  # type: ignore[assignment]
    d = output_grad.reshape(batch, out_channels, count)  # (B, C_out, T)
    terms: list[torch.Tensor] = []  # the squared norms of the weight's and the bias's gradients
    freed = inputs.numel() + output_grad.numel()  # (what keeping lets go: :func:`.keep_budget.room`)
    limit, kept, channels_last = room(keep_limit(output_grad.device), freed), None, False
    if trainable(module.weight):
        if not materialise(batch, count, patch, out_channels, limit):
            if inputs.device.type == "cpu":  # the compiled kernel's norms, or a cache-sized slice of examples at a time
                cheaper = compiled_beats_ghost(inputs.shape, count, out_channels, geometry)
                compiled = compiled_norms(inputs, output_grad, geometry, False) if cheaper else None
                terms.append(
                    compiled[0] if compiled is not None else patch_slice_norms_squared(inputs, d, geometry, ghost=True)
                )
            else:
                a = unfold_patches(inputs, *geometry)
                terms.append((torch.bmm(a.transpose(1, 2), a) * torch.bmm(d.transpose(1, 2), d)).sum((1, 2)))
        else:
            way = per_example_conv_way(inputs.device.type, module.in_channels, count, out_channels)
            keep = way != "patch slices" and batch * out_channels * patch <= limit
            compiled = compiled_norms(inputs, output_grad, geometry, keep)  # None on a GPU
            if compiled is not None:  # the CPU ways' numbers, by the compiled kernel (float32)
                terms.append(compiled[0])
                kept, channels_last = compiled[1], compiled[2]
            elif way == "patch slices":
                terms.append(patch_slice_norms_squared(inputs, d, geometry))
            else:
                with convolution_weight_gradient_precision(inputs.device) if keep else contextlib.nullcontext():
                    parts = [
                        per_example_conv_gradients(way, module, inputs[s], output_grad[s])  # (B_k, C_out, C_in·kh·kw)
                        for s in heap_sized_slices(batch, out_channels * patch * inputs.element_size(), inputs.device)
                    ]
                terms.append(torch.cat([row_norms_squared(part) for part in parts]))
                kept = parts if keep else None
            if kept is not None:
                spend(batch * out_channels * patch, freed)
    bias_grads = d.sum(2) if trainable(module.bias) else None  # ∇_b ℓ_i = Σ_t δ_t, (B, C_out)
    if bias_grads is not None:
        terms.append(row_norms_squared(bias_grads))
    squared = added_up(terms, d)
    if kept is None and trainable(module.weight):
        return Piece(squared, _conv_sums(module, bias_grads, by_convolution=(inputs, output_grad, geometry)))
    return Piece(squared, _conv_sums(module, bias_grads, kept, channels_last))  # (the input and δ let go)


def _conv_sums(
    module: nn.Conv2d,
    bias_grads: torch.Tensor | None,
    kept: list[torch.Tensor] | None = None,
    channels_last: bool = False,
    by_convolution: tuple[torch.Tensor, torch.Tensor, Geometry] | None = None,
) -> ClippedSums:
    """Σ_i c_i ∇ℓ_i of a convolution, holding only what it reads: the kept per-example weight gradients, or (input, δ,
    geometry) for its weight-gradient convolution of the clip-weighted δ (Σ_i c_i a_i ⋆ δ_i); the bias gradients."""

    def sums(factors: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        if kept is not None:
            total = weight_from_columns(kept_sum(factors, kept), module.weight.shape, channels_last)
            out.append((module.weight, total))
        elif by_convolution is not None:
            inputs, output_grad, geometry = by_convolution
            weighted = output_grad * factors[:, None, None, None]
            out.append((module.weight, clip_weighted_conv_weight(module.weight.shape, inputs, weighted, geometry)))
        if bias_grads is not None and module.bias is not None:
            out.append((module.bias, factors @ bias_grads))
        return out

    return sums


def _grouped_conv_piece(module: nn.Conv1d | nn.Conv2d, calls: list[tuple[torch.Tensor, torch.Tensor]]) -> Piece:
    """A Conv1d or Conv2d with ``groups`` = g > 1 (depthwise when g = C_in): group j maps input channels
    j·C_in/g … to output channels j·C_out/g …, so ∇_{W_j} ℓ_i = Σ_calls Σ_t δ_{i,j,t} a_{i,j,t}ᵀ over group j's
    patches. Its norm by the ghost norm per group where :func:`grouped_by_ghost_norm` says so (each group a dense
    layer over the live taps: :func:`dpml.train.clipping_conv_ways.grouped_ghost_norms_squared`), else
    materialised at the live taps only (every other tap reads only padding: its gradient is zero), (B,
    C_out·C_in/g·|live taps|), call by call in the fastest way for the shape
    (:func:`dpml.train.clipping_conv_ways.grouped_conv_live_tap_gradients`), in batch slices of at most
    :func:`keep_limit` numbers; kept when the whole batch fits, else the clipped sum is the layer's own
    weight-gradient convolution of the clip-weighted δ, summed over the calls."""
    geometry: Geometry = conv_geometry(module)  # type: ignore[assignment]
    groups, weight = module.groups, module.weight
    batch, out_channels = calls[0][1].shape[:2]
    device = weight.device
    squared, kept = calls[0][1].new_zeros(batch), None
    planar = [(as_2d(module, a), as_2d(module, d)) for a, d in calls]
    window = live_window(planar, geometry)
    size = max(1, out_channels * weight.shape[1] * len(window[0]) * len(window[1]))  # an example's live numbers
    count = sum(math.prod(d.shape[2:]) for _, d in planar)  # T: the positions of every call
    per_group = (size // out_channels, out_channels // groups)  # a group's d_in (its live patch) and d_out
    if trainable(weight) and grouped_by_ghost_norm(batch * groups, count, *per_group, room(keep_limit(device))):
        squared = grouped_ghost_norms_squared(planar, geometry, groups, window)
    elif trainable(weight):
        step = max(1, keep_limit(device) // size)
        keep = batch * size <= room(keep_limit(device))  # the whole batch in one slice, within the budget
        for start in range(0, batch, step):
            part = slice(start, start + step)
            per_example = functools.reduce(
                torch.add,
                [
                    in_window(
                        *grouped_conv_live_tap_gradients(
                            as_2d(module, inputs[part]), as_2d(module, output_grad[part]), geometry, groups
                        ),
                        window,
                    ).reshape(min(step, batch - start), -1)
                    for inputs, output_grad in calls
                ],
            )
            squared[part] += row_norms_squared(per_example)
        if keep:
            kept = per_example
            spend(kept.numel())
    bias_grads = (  # ∇_b ℓ_i = Σ_calls Σ_t δ_t, (B, C_out)
        functools.reduce(torch.add, [g.reshape(batch, out_channels, -1).sum(2) for _, g in calls])
        if trainable(module.bias)
        else None
    )
    if bias_grads is not None:
        squared = squared + row_norms_squared(bias_grads)
    shape = torch.Size((weight.shape[0], weight.shape[1], *geometry[0]))  # a Conv1d's as a Conv2d's

    def weight_sum(factors: torch.Tensor) -> torch.Tensor:
        if kept is not None:
            rows, columns = window
            live = (factors @ kept).reshape(shape[0], shape[1], len(rows), len(columns))
            return kernel_from_taps(live, shape[2:], rows, columns).reshape(weight.shape)
        return functools.reduce(
            torch.add,
            [
                clip_weighted_conv_weight(
                    shape,
                    as_2d(module, inputs),
                    as_2d(module, output_grad * factors.reshape(-1, *[1] * (output_grad.dim() - 1))),
                    geometry,
                    groups,
                ).reshape(weight.shape)
                for inputs, output_grad in calls
            ],
        )

    def sums(factors: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = [(weight, weight_sum(factors))] if trainable(weight) else []
        return out + ([(module.bias, factors @ bias_grads)] if bias_grads is not None else [])  # type: ignore[list-item]

    return Piece(squared, sums)


def _embedding_piece(module: nn.Embedding, tokens: torch.Tensor, d: torch.Tensor) -> Piece:
    """Embedding: ∇_W ℓ_i = Σ_t e_{k_t} δ_tᵀ (padding positions already zeroed); clipped sum by ``index_add``."""

    def sums(factors: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        weighted = (d * factors[:, None, None]).reshape(-1, module.embedding_dim)
        return [(module.weight, torch.zeros_like(module.weight).index_add_(0, tokens.reshape(-1), weighted))]

    return Piece(embedding_norms_squared(tokens, d, module.num_embeddings), sums)


def _affine_norm_piece(module: nn.LayerNorm | nn.GroupNorm, weight: torch.Tensor, bias: torch.Tensor) -> Piece:
    """z = x̂⊙γ + β: ∇_γ ℓ_i = Σ_t x̂_t⊙δ_t and ∇_β ℓ_i = Σ_t δ_t (``weight``, ``bias``: (B, *γ.shape) each), side by
    side in one (B, |γ| + |β|) matrix G, so that ‖G_i‖² is one reduction and Σ_i c_i G_i one product."""
    per_example = []
    if trainable(module.weight):
        per_example.append((module.weight, weight))
    if trainable(module.bias):
        per_example.append((module.bias, bias))
    if len(per_example) < 2:
        return materialised_piece(per_example, bias)  # type: ignore[arg-type]
    batch = bias.shape[0]
    side_by_side = torch.cat([g.reshape(batch, -1) for _, g in per_example], 1)

    def sums(factors: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        total = factors @ side_by_side
        sizes = [p.numel() for p, _ in per_example]
        return [(p, part.view(p.shape)) for (p, _), part in zip(per_example, total.split(sizes), strict=True)]

    return Piece(row_norms_squared(side_by_side), sums)


def _own_piece(module: nn.Module, inputs: torch.Tensor, output_grad: torch.Tensor) -> Piece:
    """A layer with ``ghost_clipping = True`` and only a ``weight``: it supplies ‖∇_W ℓ_i‖² and Σ_i c_i ∇_W ℓ_i
    through ``per_example_norms_squared(inputs, δ)`` and ``clipped_weight_sum(inputs, δ, c)``."""
    if not trainable(module.weight):  # type: ignore[arg-type]
        return Piece(output_grad.new_zeros(output_grad.shape[0]), lambda factors: [])
    return Piece(
        module.per_example_norms_squared(inputs, output_grad),  # type: ignore[operator]
        lambda factors: [(module.weight, module.clipped_weight_sum(inputs, output_grad, factors))],  # type: ignore[operator, list-item]
    )


def layer_piece(module: nn.Module, calls: list[tuple[torch.Tensor, torch.Tensor]]) -> Piece:
    """The piece of a fast layer from its calls' (input, output gradient), positions concatenated."""
    if getattr(module, "ghost_clipping", False):
        if len(calls) != 1:
            raise ValueError("a ghost_clipping layer's own shortcut covers one call per forward pass")
        return _own_piece(module, *calls[0])
    if isinstance(module, (nn.Conv1d, nn.Conv2d)) and module.groups > 1:
        return _grouped_conv_piece(module, calls)
    if isinstance(module, nn.Conv2d) and len(calls) == 1:
        if not pointwise_by_rows(module, *calls[0], room(keep_limit(calls[0][0].device))):
            return _conv_piece(module, *calls[0])
    if isinstance(module, nn.GroupNorm) and len(calls) == 1:
        folded = group_norm_affine_gradients(*calls[0], module.num_groups, module.eps)
        if folded is not None:
            return _affine_norm_piece(module, *folded)
    parts = [positions(module, inputs, output_grad) for inputs, output_grad in calls]
    a = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts], 1)
    d = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts], 1)
    if isinstance(module, nn.Embedding):
        return _embedding_piece(module, a, d)
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm)):
        return _affine_norm_piece(module, (a * d).sum(1), d.sum(1))
    return _dense_piece(module, a, d)  # type: ignore[arg-type]
