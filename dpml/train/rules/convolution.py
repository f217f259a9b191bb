"""Convolutions ``F.conv1d`` / ``F.conv2d`` where the layer's hook does not apply (a kernel used twice, or by a
functional call: a weight standardised before use, as NFNet's and BiT's convolutions do): z_t = W a_t + b over the
output positions t, a_t the input patch under the kernel (:func:`dpml.train.clipping_conv.unfold_patches`; a Conv1d
is the Conv2d of height 1).

∇_W ℓ_i = Σ_t δ_{i,t} a_{i,t}ᵀ in W's (C_out, C_in·k) layout, factored (u = δ, v = a) like a dense layer,
and ∇_b ℓ_i = Σ_t δ_{i,t}. With ``groups`` = g > 1 (depthwise when g = C_in) group j's output channels see only its
input channels, ∇_{W_j} ℓ_i = Σ_t δ_{i,j,t} a_{i,j,t}ᵀ: materialised, one batched product over the B·g (example,
group) pairs, B × |W| numbers (refused beyond the device's keep limit). (A convolution whose layer is hooked keeps
the layer's optimised kernels.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dpml.train.clipping_conv import grouped_per_example_gradients, unfold_patches
from dpml.train.rules.registry import Call, Dense, Factored, Pending, Tracked, Use, beyond_keep_limit, rule


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
        return "padding given by name"
    w, b = call.tracked(weight), call.tracked(bias)
    one_d = weight.dim() == 3
    if call.tracked(x) is not None or not call.batch_first(x) or x.dim() != weight.dim():
        return f"its input (shape {tuple(x.shape)}) is not batch-first"
    if w is not None and w.index is not None:
        w = Tracked(w.param, w.index.reshape(weight.shape[0], -1), w.shared)
    geometry = (
        _pair(tuple(weight.shape[2:]), one_d, 1),
        _pair(stride, one_d, 1),
        _pair(padding, one_d, 0),
        _pair(dilation, one_d, 1),
    )
    recorded, batch, out_channels = x.detach(), x.shape[0], weight.shape[0]
    beyond = None if groups == 1 or w is None else beyond_keep_limit(batch, weight.shape, x.device)
    if beyond is not None:
        return f"a grouped convolution: {beyond}"

    def finish(d: torch.Tensor) -> list[Use]:
        d = d.reshape(batch, out_channels, -1)  # (B, C_out, T)
        uses: list[Use] = []
        if w is not None:
            patches = unfold_patches(recorded.unsqueeze(2) if one_d else recorded, *geometry)  # (B, C_in·k, T)
            if groups == 1:
                uses.append((w, Factored(d.transpose(1, 2), patches.transpose(1, 2), out_channels, patches.shape[1])))
            else:
                grads = grouped_per_example_gradients(d, patches, groups)
                uses.append((w, Dense(grads.reshape(batch, *w.shape()))))
        if b is not None:
            uses.append((b, Dense(d.sum(2))))
        return uses

    return Pending(call.output, [t.param for t in (w, b) if t is not None], finish)
