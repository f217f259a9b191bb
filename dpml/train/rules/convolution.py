"""Convolutions ``F.conv1d`` / ``F.conv2d`` where the layer's hook does not apply (a kernel used twice, or by a
functional call: a weight standardised before use, as NFNet's and BiT's convolutions do): z_t = W a_t + b over the
output positions t, a_t the input patch under the kernel (:func:`dpml.train.clipping_conv.unfold_patches`; a Conv1d
is the Conv2d of height 1).

∇_W ℓ_i = Σ_t δ_{i,t} a_{i,t}ᵀ in W's (C_out, C_in·k) layout, factored (u = δ, v = a) like a dense layer where a
ghost norm is the cheaper, otherwise formed on demand by torch's own weight-gradient kernels
(:func:`dpml.train.rules.convolution_nd.kernel_form`; a computed kernel's closed forms, :mod:`.standardised` and
:mod:`.row_jacobian`, read either, and the factored form then carries the convolution's own output, W a_t), and
∇_b ℓ_i = Σ_t δ_{i,t}. With ``groups`` = g > 1 (depthwise when
g = C_in) group j's output channels see only its input channels, ∇_{W_j} ℓ_i = Σ_t δ_{i,j,t} a_{i,j,t}ᵀ: materialised
for the B·g (example, group) pairs at once (:func:`dpml.train.clipping_conv_ways.grouped_conv_per_example_gradients`,
at the kernel's live taps), B × |W| numbers; beyond the device's keep limit, factored in (group, position) slots
where few positions and few groups make that the cheaper (:func:`slots_pay`, :func:`group_slots`: NFNet-F0's
standardised 3×3 kernels of 768 channels in 6 groups on the 2×2 and 1×1 maps of 32×32 images), else formed on demand
a slice of examples at a time as an ungrouped kernel's are, and their clipped sum one weight gradient of the
clip-weighted δ (those kernels at batch 64: 57 M numbers, past the CPU's 33.5 M). (A convolution whose layer is hooked
keeps the layer's optimised kernels.)

An input whose images are grouped by example, (B·k, C, H, W) with each image one example's (MViT pools each head's
map, windowed models each window; the recorder's example map says whose), is an example's k images side by side:
the sums over t run over the positions of all k (:func:`by_example`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dpml.train.clipping_conv import Geometry, named_padding, unfold_patches
from dpml.train.clipping_norms import KEEP_TRAFFIC, materialise
from dpml.train.clipping_conv_ways import grouped_conv_per_example_gradients
from dpml.train.keep_budget import keep_limit
from dpml.train.rules.convolution_nd import Convolution, kernel_form, sizes
from dpml.train.rules.registry import (
    Call,
    Dense,
    Factored,
    Pending,
    Tracked,
    Use,
    beyond_keep_limit,
    by_example,
    rule,
)


def _pair(value: int | tuple[int, ...], one_d: bool, fill: int) -> tuple[int, int]:
    values = (value,) if isinstance(value, int) else tuple(value)
    if one_d:
        return fill, values[0]
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


@rule(F.conv1d, F.conv2d)
def convolution(call: Call) -> Pending | str:
    x, weight, bias = call.arg(0, "input"), call.arg(1, "weight"), call.arg(2, "bias")
    stride, padding, dilation = call.arg(3, "stride", 1), call.arg(4, "padding", 0), call.arg(5, "dilation", 1)
    groups = call.arg(6, "groups", 1)
    if isinstance(padding, str):
        taps = tuple(weight.shape[2:])
        padding = named_padding(padding, taps, (dilation,) * len(taps) if isinstance(dilation, int) else dilation)
        if padding is None:
            return "padding 'same' with an odd total (torch pads it unevenly)"
    w, b = call.tracked(weight), call.tracked(bias)
    one_d = weight.dim() == 3
    known, rows = call.slices_by_example(x)
    if call.tracked(x) is not None or x.dim() != weight.dim() or not known:
        return f"its input (shape {tuple(x.shape)}) is not batch-first"
    merged = None if rows is None else call.leading_examples(x)  # (each image's example)
    if w is not None and w.index is not None:
        w = Tracked(w.param, w.index.reshape(weight.shape[0], -1), w.shared)
    geometry = (
        _pair(tuple(weight.shape[2:]), one_d, 1),
        _pair(stride, one_d, 1),
        _pair(padding, one_d, 0),
        _pair(dilation, one_d, 1),
    )
    recorded, batch, out_channels, n = x.detach(), call.batch, weight.shape[0], weight.dim() - 2
    conv = Convolution(
        tuple(weight.shape), sizes(stride, n), sizes(padding, n), sizes(dilation, n), (0,) * n, groups, False
    )
    computed = w is not None and not isinstance(w.param, nn.Parameter)  # (a weight computed first reads the output)
    produced, written = (call.output, call.output._version) if computed else (None, 0)
    on_demand = groups == 1 or (w is not None and beyond_keep_limit(batch, weight.shape, x.device) is not None)

    def finish(output_grad: torch.Tensor) -> list[Use]:
        d = by_example(output_grad.reshape(output_grad.shape[0], out_channels, -1), rows)  # (B, C_out, T)
        uses: list[Use] = []
        if w is not None and groups > 1 and on_demand and rows is None and slots_pay(batch, d.shape[2], weight, groups):
            own = _own_product(produced, written, bias, out_channels)
            uses.append((w, group_slots(recorded.unsqueeze(2) if one_d else recorded, d, geometry, groups, own)))
        elif w is not None and on_demand:  # (grouped: factored in slots above, or formed by kernel_form)
            form = kernel_form(recorded, output_grad, conv, merged, rows)
            if isinstance(form, Factored) and (own := _own_product(produced, written, bias, out_channels)) is not None:
                form.applied = by_example(own, rows).transpose(1, 2)
            uses.append((w, form))
        elif w is not None:  # per image, then each example's images added up
            images = output_grad.unsqueeze(2) if one_d else output_grad
            grads = grouped_conv_per_example_gradients(
                recorded.unsqueeze(2) if one_d else recorded, images, geometry, groups
            ).flatten(1)
            uses.append((w, Dense((grads if rows is None else rows.of(grads).sum(1)).reshape(batch, *w.shape()))))
        if b is not None:
            uses.append((b, Dense(d.sum(2))))
        return uses

    return Pending(call.output, [t.param for t in (w, b) if t is not None], finish)


def _own_product(
    produced: torch.Tensor | None, written: int, bias: torch.Tensor | None, out_channels: int
) -> torch.Tensor | None:
    """The convolution's own W a_t, (images, C_out, T): its output less its bias, where the output was recorded (a
    computed weight) and not written in place since; else None."""
    if produced is None or produced._version != written:
        return None
    out = produced.detach().reshape(produced.shape[0], out_channels, -1)
    return out - bias.detach().reshape(1, -1, 1) if isinstance(bias, torch.Tensor) else out


STORED_PASSES = 7
"""Passes over B × |W| stored numbers a grouped kernel's gradients formed on demand take when a standardisation carries
them back (:mod:`.standardised`: formed, the row map's four, the norm; the clipped sum's weight gradient besides)."""


def slots_pay(batch: int, positions: int, weight: torch.Tensor, groups: int) -> bool:
    """Whether a grouped kernel past the keep limit is cheaper factored in (group, position) slots
    (:func:`group_slots`: ghost norms over g·T slots, B·(gT)²·(C_out + n), and a clipped sum over them,
    B·gT·C_out·n, g times the weight gradient's) than formed on demand (two weight gradients, B·T·C_out·n each, and
    ``STORED_PASSES`` passes over B·C_out·n stored numbers at ``KEEP_TRAFFIC`` multiply-adds a number) — few positions
    and few groups, as NFNet-F0's 768-channel kernels in 6 groups on 2×2 and 1×1 maps at 32×32 — and the ghost norm
    is what the slots' norms would take (:func:`dpml.train.clipping_norms.materialise`)."""
    out_channels, cols = weight.shape[0], math.prod(weight.shape[1:])
    slots = groups * positions
    factored = batch * slots * slots * (out_channels + cols) + batch * slots * out_channels * cols
    formed = 2 * batch * positions * out_channels * cols + STORED_PASSES * KEEP_TRAFFIC * batch * out_channels * cols
    ghost = not materialise(batch, slots, cols, out_channels, keep_limit(weight.device))
    return ghost and factored < formed


def group_slots(
    x: torch.Tensor, d: torch.Tensor, geometry: Geometry, groups: int, output: torch.Tensor | None
) -> Factored:
    """A grouped convolution's per-example kernel gradient as one factored use over (group, position) slots: group j's
    rows see only its patches, ∇_{W_j} ℓ_i = Σ_t δ_{i,j,t} a_{i,j,t}ᵀ, so with slot (j, t) holding u = δ_t on group j's
    output channels (0 on the others) and v = a_{j,t} (group j's patch, W's (c, u, v) columns), ∇_W ℓ_i = Σ_{(j,t)}
    u vᵀ exactly. x (B, C_in, H, W), d (B, C_out, T); ``output`` (B, C_out, T), the convolution's own W a_t
    without its bias where it is at hand: each slot's ``applied`` (its other groups' channels are multiplied by u's
    zeros wherever they are read)."""
    batch, out_channels, positions = d.shape
    patches = unfold_patches(x.to(d.dtype), *geometry)  # (B, C_in·kh·kw, T), in δ's dtype (autocast: the parameters')
    cols = patches.shape[1] // groups
    v = patches.reshape(batch, groups, cols, positions).transpose(2, 3).reshape(batch, groups * positions, cols)
    by_group = d.reshape(batch, groups, out_channels // groups, positions).transpose(2, 3)  # (B, g, T, C_out/g)
    u = d.new_zeros(batch, groups, positions, groups, out_channels // groups)
    for j in range(groups):
        u[:, j, :, j] = by_group[:, j]
    applied = None
    if output is not None:
        each = output.to(d.dtype).reshape(batch, 1, out_channels, positions).transpose(2, 3)  # (B, 1, T, C_out)
        applied = each.expand(batch, groups, positions, out_channels).reshape(batch, groups * positions, out_channels)
    return Factored(u.reshape(batch, groups * positions, out_channels), v, out_channels, cols, applied=applied)
