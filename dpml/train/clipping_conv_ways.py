"""A convolution's per-example weight gradients ∇_W ℓ_i = Σ_t δ_t a_tᵀ, (B, C_out, C_in/g·kh·kw), materialised in
one of four ways that compute the same numbers by different kernels, and which way the engine takes where
(the patches, the live taps and the geometry are :mod:`dpml.train.clipping_conv`'s).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.nn.grad
from torch import nn

from dpml.train.clipping_conv import (
    Geometry,
    as_2d,
    compiled_gradients,
    compiled_kernel_takes,
    compiled_norms,
    conv_geometry,
    kernel_from_taps,
    live_taps,
    unfold_patches,
)
from dpml.devices import heap_sized_slices
from dpml.train.clipping_norms import materialise, row_norms_squared
from dpml.train.keep_budget import keep_limit


Taps = tuple[range, range]
"""The kernel's live taps, per axis (:func:`dpml.train.clipping_conv.live_taps`)."""


def _live_window(inputs: torch.Tensor, geometry: Geometry, taps: Taps, out_size: tuple[int, int]) -> torch.Tensor:
    """The padded input cropped to what the ``taps`` read: a convolution over it of the taps alone, at no padding,
    has the layer's output positions."""
    (_, (sh, sw), (ph, pw), (dh, dw)), (rows, columns), (out_h, out_w) = geometry, taps, out_size
    return F.pad(inputs, (pw, pw, ph, ph))[
        :,
        :,
        rows.start * dh : (rows.stop - 1) * dh + sh * (out_h - 1) + 1,
        columns.start * dw : (columns.stop - 1) * dw + sw * (out_w - 1) + 1,
    ]


def _taps_as_kernel(
    inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry, taps: Taps
) -> tuple[torch.Tensor, Geometry]:
    """The input and geometry of a convolution whose kernel is the live ``taps`` alone, with the layer's output
    positions: the layer's own where every tap is live (no padded copy), else the padded input cropped to what the
    taps read (:func:`_live_window`), at no padding."""
    (kernel, stride, _, dilation), (rows, columns) = geometry, taps
    if (len(rows), len(columns)) == tuple(kernel):
        return inputs, geometry
    window = _live_window(inputs, geometry, taps, (output_grad.shape[2], output_grad.shape[3]))
    return window, ((len(rows), len(columns)), stride, (0, 0), dilation)


def live_taps_by_grouped_forward(
    inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry, groups: int, taps: Taps
) -> torch.Tensor:
    """∇_W ℓ_i = Σ_t δ_t a_tᵀ of every example at the live ``taps``, (B, C_out, C_in/g, |rows|, |columns|), by one
    grouped convolution and without unfolding the patches (Rochette et al. 2019, with groups): an (example, group)
    pair's C_in/g input channels become the batch, the B·g pairs the groups, and the pair's output gradients
    δ_{i,o} (oh×ow) its kernels, dilated by the layer's stride, at the layer's dilation as stride, over the padded
    input cropped to what the taps read; output position (u, v) is then tap (u, v)'s gradient."""
    (_, (sh, sw), _, (dh, dw)), (rows, columns) = geometry, taps
    batch, channels = inputs.shape[:2]
    out_channels, out_h, out_w = output_grad.shape[1:]
    per_group = channels // groups
    window = _live_window(inputs, geometry, taps, (out_h, out_w))
    found = F.conv2d(
        window.reshape(batch * groups, per_group, *window.shape[2:]).transpose(0, 1),
        output_grad.reshape(batch * out_channels, 1, out_h, out_w),
        stride=(dh, dw),
        dilation=(sh, sw),
        groups=batch * groups,
    )  # (C_in/g, B·C_out, |rows|, |columns|)
    return found.reshape(per_group, batch, out_channels, len(rows), len(columns)).permute(1, 2, 0, 3, 4)


def live_taps_by_weight_gradient(
    inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry, groups: int, taps: Taps
) -> torch.Tensor:
    """∇_W ℓ_i at the live ``taps``, (B, C_out, C_in/g, |rows|, |columns|), as the weight gradient of one
    convolution with B·g groups and the taps alone as its kernel, over the padded input cropped to what they read:
    the examples are folded into the channels, input (1, B·C_in, …) and output gradient (1, B·C_out, oh, ow), so
    group (i, j)'s weight gradient is example i's for the layer's group j. The faster of this and the grouped
    forward on a CPU from 8 input channels up for g = 1 (``benchmarks/conv_per_example.py``)."""
    rows, columns = taps
    batch, channels = inputs.shape[:2]
    out_channels = output_grad.shape[1]
    window, (_, stride, padding, dilation) = _taps_as_kernel(inputs, output_grad, geometry, taps)
    grads: torch.Tensor = torch.nn.grad.conv2d_weight(
        window.reshape(1, batch * channels, *window.shape[2:]),
        (batch * out_channels, channels // groups, len(rows), len(columns)),
        output_grad.reshape(1, batch * out_channels, *output_grad.shape[2:]),
        stride,
        padding,
        dilation,
        groups=batch * groups,
    )
    return grads.reshape(batch, out_channels, channels // groups, len(rows), len(columns))


def live_taps_by_patches(
    inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry, groups: int, taps: Taps
) -> torch.Tensor:
    """∇_W ℓ_i at the live ``taps``, (B, C_out, C_in/g, |rows|, |columns|), from the input's patches under them
    (:func:`unfold_patches`) by one batched product over the B·g (example, group) pairs
    (:func:`grouped_per_example_gradients`)."""
    batch, out_channels = output_grad.shape[:2]
    patches = unfold_patches(inputs, *geometry, taps=taps)  # (B, C_in·|rows|·|columns|, T)
    grads = grouped_per_example_gradients(output_grad.reshape(batch, out_channels, -1), patches, groups)
    return grads.reshape(batch, out_channels, -1, len(taps[0]), len(taps[1]))


def live_taps_by_compiled_kernel(
    inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry, groups: int, taps: Taps
) -> torch.Tensor:
    """∇_W ℓ_i at the live ``taps``, (B, C_out, C_in/g, |rows|, |columns|), by the compiled kernel on the B·g
    (example, group) pairs (:func:`dpml.train.clipping_conv.compiled_gradients`: each pair's patches built in a
    cache-sized buffer and multiplied there), the taps alone as its kernel over the padded input cropped to what
    they read. Float32 on a CPU with the kernel built only (:func:`compiled_kernel_takes`)."""
    window, at = _taps_as_kernel(inputs, output_grad, geometry, taps)
    grads = compiled_gradients(window, output_grad, at, groups)
    if grads is None:
        raise RuntimeError("the compiled convolution kernel does not take these tensors (float32 on a CPU only)")
    return grads.reshape(inputs.shape[0], output_grad.shape[1], inputs.shape[1] // groups, *map(len, taps))


LIVE_TAP_WAYS = {
    "weight gradient": live_taps_by_weight_gradient,
    "grouped forward": live_taps_by_grouped_forward,
    "patches": live_taps_by_patches,
    "compiled kernel": live_taps_by_compiled_kernel,
}


def _whole_kernel(way: str) -> Callable[[torch.Tensor, torch.Tensor, Geometry, int], torch.Tensor]:
    """``way``'s per-example gradients over the whole kernel, (B, C_out, C_in/g·kh·kw): the live taps' in place, the
    other taps' zero (they read only padding, at every output position)."""

    def whole(inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry, groups: int = 1) -> torch.Tensor:
        taps = live_taps(geometry, tuple(inputs.shape[2:]), tuple(output_grad.shape[2:]))
        batch, out_channels = output_grad.shape[:2]
        if not len(taps[0]) or not len(taps[1]):
            return inputs.new_zeros(batch, out_channels, inputs.shape[1] // groups * math.prod(geometry[0]))
        live = LIVE_TAP_WAYS[way](inputs, output_grad, geometry, groups, taps)
        return kernel_from_taps(live, geometry[0], *taps).reshape(batch, out_channels, -1)

    whole.__doc__ = f"∇_W ℓ_i of every example over the whole kernel by the {way} (:data:`LIVE_TAP_WAYS`)."
    return whole


per_example_by_weight_gradient = _whole_kernel("weight gradient")
per_example_by_grouped_forward = _whole_kernel("grouped forward")
per_example_by_patches = _whole_kernel("patches")
per_example_by_compiled_kernel = _whole_kernel("compiled kernel")

PER_EXAMPLE_WAYS = {
    "weight gradient": per_example_by_weight_gradient,
    "grouped forward": per_example_by_grouped_forward,
    "patches": per_example_by_patches,
    "compiled kernel": per_example_by_compiled_kernel,
}


def per_example_conv_gradients(
    way: str, module: nn.Conv2d, inputs: torch.Tensor, output_grad: torch.Tensor
) -> torch.Tensor:
    """∇_W ℓ_i (B, C_out, C_in/g·kh·kw) of a Conv2d by ``way`` (a key of ``PER_EXAMPLE_WAYS``)."""
    return PER_EXAMPLE_WAYS[way](inputs, output_grad, conv_geometry(module), module.groups)  # type: ignore[arg-type]


_FASTEST_GROUPED: dict[tuple[object, ...], str] = {}


def fastest_grouped_way(inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry, groups: int) -> str:
    """The fastest way to a grouped convolution's per-example gradients for this shape on a CPU, timed once per
    example shape and batch size class (the batch's power of two above, so that the sizes Poisson sampling
    draws are timed a handful of times, not once each) in a process, by the least of three runs of each way, the
    ways in turn (:func:`_seconds`); which one wins changes only the order of floating-point additions, never
    what is computed. The candidates are ``"grouped forward"`` and ``"weight gradient"``, ``"patches"`` where the
    live taps' patches hold no more numbers than the gradients (small maps), and ``"compiled kernel"`` where it
    takes the tensors (float32 on a CPU). None wins everywhere (``benchmarks/results/grouped_conv_ways.md``): at
    batch 64 on this project's 2-core CPU the grouped forward took 0.52 against 2.22 ms for ConvNeXt's 7×7 on 8×8
    maps, the weight gradient 1.30 against 2.29 ms for MobileNet's 3×3 on 16×16, the patches 0.19 against 0.24 ms
    for a 7×7 kernel on 1×1 maps (an earlier day's page), the compiled kernel 5.6 against 7.7 ms (the weight
    gradient) for ResNeXt-50's 32 groups of 16 channels on 2×2 maps.

    On a GPU, untimed (timing would synchronise with the host in every step whose batch size is new, and which
    way is fastest there is not measured yet: ``scripts/gpu_session.sh`` step 5): :func:`gpu_grouped_way`."""
    if inputs.device.type == "cuda":
        return gpu_grouped_way(inputs.shape, output_grad.shape, geometry, keep_limit(inputs.device))
    key = timing_key(inputs, output_grad, geometry, groups)
    if key not in _FASTEST_GROUPED:
        gradient_numbers = output_grad.shape[1] * (inputs.shape[1] // groups) * math.prod(geometry[0])
        small = live_patch_numbers(inputs.shape, output_grad.shape, geometry) <= gradient_numbers
        ways = ["grouped forward", "weight gradient"] + (["patches"] if small else [])
        ways += ["compiled kernel"] if compiled_kernel_takes(inputs, output_grad) else []
        seconds = _seconds(ways, inputs, output_grad, geometry, groups)
        _FASTEST_GROUPED[key] = min(ways, key=seconds.__getitem__)
    return _FASTEST_GROUPED[key]


def gpu_grouped_way(input_shape: torch.Size, output_shape: torch.Size, geometry: Geometry, limit: int) -> str:
    """A grouped convolution's way on a GPU: ``"patches"``, the way it took before (checked there against the
    CPU's sums, ``tests/test_devices.py``), while the live taps' patches of the batch hold at most ``limit``
    numbers (the device's keep limit); beyond it the weight gradient of one convolution with B·g groups, which
    holds no patches (ConvNeXt-T's first depthwise 7×7 on 56×56 maps at batch 256: 15 GB of patches)."""
    patches = int(input_shape[0]) * live_patch_numbers(input_shape, output_shape, geometry)
    return "patches" if patches <= limit else "weight gradient"


def live_patch_numbers(input_shape: torch.Size, output_shape: torch.Size, geometry: Geometry) -> int:
    """How many numbers one example's patches under the :func:`live_taps` hold: C_in · |live taps| · T."""
    rows, columns = live_taps(geometry, tuple(input_shape[2:]), tuple(output_shape[2:]))
    return int(input_shape[1]) * len(rows) * len(columns) * math.prod(output_shape[2:])


TIMED_ROUNDS = 3  # rounds of the ways in turn, after one untimed run each


def _seconds(
    ways: list[str], inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry, groups: int
) -> dict[str, float]:
    """Each way's least seconds on the CPU over ``TIMED_ROUNDS`` rounds of the ways in turn (so that a passing load
    falls on all of them alike), after one untimed run each that pays for its kernel's set-up."""
    taps = live_taps(geometry, tuple(inputs.shape[2:]), tuple(output_grad.shape[2:]))
    return least_seconds(
        {way: functools.partial(_formed, way, inputs, output_grad, geometry, groups, taps) for way in ways}
    )


def _formed(
    way: str, inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry, groups: int, taps: Taps
) -> torch.Tensor:
    """The live taps' per-example gradients by ``way``, laid out in memory (a way may return a view)."""
    return LIVE_TAP_WAYS[way](inputs, output_grad, geometry, groups, taps).contiguous()


def timing_key(inputs: torch.Tensor, output_grad: torch.Tensor, *call: object) -> tuple[object, ...]:
    """What a timed pick of ways is kept under: the dtype, the batch size class (the batch's power of two above, so
    that the sizes Poisson sampling draws are timed a handful of times, not once each), the shapes of one example's
    input and output gradient, and what else describes the ``call``."""
    return (
        inputs.dtype,
        (inputs.shape[0] - 1).bit_length(),
        tuple(inputs.shape[1:]),
        tuple(output_grad.shape[1:]),
        *call,
    )


def least_seconds(ways: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each way's least seconds over ``TIMED_ROUNDS`` rounds of the ways in turn (so that a passing load falls on
    all of them alike), after one untimed run each that pays for its kernel's set-up."""
    for way in ways.values():
        way()
    least = dict.fromkeys(ways, float("inf"))
    for _ in range(TIMED_ROUNDS):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            least[name] = min(least[name], time.perf_counter() - start)
    return least


def grouped_conv_per_example_gradients(
    inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry, groups: int
) -> torch.Tensor:
    """∇_W ℓ_i (B, C_out, C_in/g·kh·kw) of a grouped (or any) Conv2d, by :func:`fastest_grouped_way`."""
    return PER_EXAMPLE_WAYS[fastest_grouped_way(inputs, output_grad, geometry, groups)](
        inputs, output_grad, geometry, groups
    )


def grouped_conv_live_tap_gradients(
    inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry, groups: int
) -> tuple[torch.Tensor, Taps]:
    """∇_W ℓ_i of a grouped (or any) Conv2d at its live taps only, (B, C_out, C_in/g, |rows|, |columns|), by
    :func:`fastest_grouped_way`, and those taps: every other tap reads only padding, so its gradient is zero for
    every example, and the norms, the kept gradients and their clip-weighted sum need only these (ResNeXt's 3×3
    groups on 1×1 maps: 1 tap of 9)."""
    taps = live_taps(geometry, tuple(inputs.shape[2:]), tuple(output_grad.shape[2:]))
    if not len(taps[0]) or not len(taps[1]):
        return inputs.new_zeros(inputs.shape[0], output_grad.shape[1], inputs.shape[1] // groups, *map(len, taps)), taps
    way = fastest_grouped_way(inputs, output_grad, geometry, groups)
    return LIVE_TAP_WAYS[way](inputs, output_grad, geometry, groups, taps), taps


def live_window(calls: list[tuple[torch.Tensor, torch.Tensor]], geometry: Geometry) -> Taps:
    """The kernel taps some call of a layer reads the input with (its calls' :func:`live_taps`, joined)."""
    found = [live_taps(geometry, tuple(a.shape[2:]), tuple(d.shape[2:])) for a, d in calls]
    live = [taps for taps in found if len(taps[0]) and len(taps[1])]
    if not live:
        return range(0), range(0)
    return (
        range(min(t[0].start for t in live), max(t[0].stop for t in live)),
        range(min(t[1].start for t in live), max(t[1].stop for t in live)),
    )


def in_window(grads: torch.Tensor, taps: Taps, window: Taps) -> torch.Tensor:
    """Per-example gradients at ``taps`` (B, C_out, C_in/g, |rows|, |columns|) placed in the layer's ``window`` of
    live taps (zero at a tap of the window this call does not read)."""
    if taps == window:
        return grads
    placed = grads.new_zeros(*grads.shape[:3], len(window[0]), len(window[1]))
    if len(taps[0]) and len(taps[1]):
        rows = slice(taps[0].start - window[0].start, taps[0].stop - window[0].start)
        columns = slice(taps[1].start - window[1].start, taps[1].stop - window[1].start)
        placed[:, :, :, rows, columns] = grads
    return placed


def grouped_ghost_norms_squared(
    calls: list[tuple[torch.Tensor, torch.Tensor]], geometry: Geometry, groups: int, window: Taps
) -> torch.Tensor:
    """‖∇_W ℓ_i‖² (B,) of a grouped Conv2d without its per-example gradients: group j's gradient is
    Σ_t δ_{i,j,t} a_{i,j,t}ᵀ over the positions t of every call, so its squared norm is Σ_{t,s} (δ_t·δ_s)(a_t·a_s)
    (the ghost norm, Li et al. 2022, per group), from the B·g pairs' Gram matrices of the live ``window``'s patches
    and of δ, (B·g, T, T) each: T²·(C_in/g·|window| + C_out/g) multiply-adds a pair, against T·C_in/g·|window|·C_out/g
    to materialise it; at one position, ‖δ‖²‖a‖² (ResNeXt's 3×3 groups of 32 channels on 1×1 maps: 64 numbers read a
    pair, against 1,024 written)."""
    batch, out_channels = calls[0][1].shape[:2]
    patches = torch.cat([unfold_patches(a, *geometry, taps=window) for a, _ in calls], 2)  # (B, C_in·|window|, T)
    d = torch.cat([g.reshape(batch, out_channels, -1) for _, g in calls], 2)  # (B, C_out, T)
    a = patches.reshape(batch * groups, patches.shape[1] // groups, -1)
    d = d.reshape(batch * groups, out_channels // groups, -1)
    if d.shape[2] == 1:  # one position: each group's gradient δ aᵀ has rank one, ‖δ aᵀ‖² = ‖δ‖²‖a‖²
        return (row_norms_squared(a) * row_norms_squared(d)).reshape(batch, groups).sum(1)
    grams = torch.bmm(a.transpose(1, 2), a) * torch.bmm(d.transpose(1, 2), d)
    return grams.sum((1, 2)).reshape(batch, groups).sum(1)


def grouped_per_example_gradients(d: torch.Tensor, patches: torch.Tensor, groups: int) -> torch.Tensor:
    """∇_{W_j} ℓ_i = Σ_t δ_{i,j,t} a_{i,j,t}ᵀ of a convolution with ``groups`` = g, from δ (B, C_out, T) and the
    patches (B, C_in·k, T): one batched product over the B·g (example, group) pairs, each group's output rows
    against its own input channels' patches; (B, C_out, C_in/g·k)."""
    batch, out_channels, rows = d.shape[0], d.shape[1], d.shape[0] * groups
    grads = torch.bmm(
        d.reshape(rows, out_channels // groups, -1),
        patches.reshape(rows, patches.shape[1] // groups, -1).transpose(1, 2),
    )
    return grads.reshape(batch, out_channels, -1)


WEIGHT_GRAD_MIN_CHANNELS = 8  # from here on the grouped weight gradient beats the grouped forward (CPU)


def per_example_conv_way(device_type: str, in_channels: int, count: int, out_channels: int) -> str:
    """How :func:`dpml.train.clipping_layers._conv_piece` materialises a Conv2d's per-example gradients
    (B, C_out, C_in·kh·kw), by the measurements of ``benchmarks/conv_per_example.py``
    (``results/conv_per_example*.md``):

    - on a GPU ``"patches"``: from the unfolded patches by one batched product over the whole batch
      (a convolution with B groups, forward or weight gradient, is up to 9× slower there, for WRN-16-4's
      layers without TF32);
    - on a CPU, where the gradient is at least as large as a channel's patches (T ≤ C_out), ``"patch
      slices"`` (:func:`dpml.train.clipping_conv.patch_slice_norms_squared`): the same product a
      cache-sized slice of examples at a time, for the norms only; else ``"weight gradient"``, the
      weight gradient of one convolution with B groups (:func:`per_example_by_weight_gradient`),
      from ``WEIGHT_GRAD_MIN_CHANNELS`` input channels up, and below that ``"grouped forward"``
      (:func:`per_example_by_grouped_forward`), faster for images of one to a few channels. In float32 the
      compiled kernel (:func:`dpml.train.clipping_conv.compiled_norms`) does a CPU way's work where it applies."""
    if device_type == "cuda":
        return "patches"
    if count <= out_channels:
        return "patch slices"
    return "weight gradient" if in_channels >= WEIGHT_GRAD_MIN_CHANNELS else "grouped forward"


def pointwise_rows(
    module: nn.Module, inputs: torch.Tensor, output_grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pointwise convolution's (:func:`is_pointwise`) input and output gradient as a Linear's rows: the input at
    the strided positions and δ, (B, T, C_in) and (B, T, C_out), channels last (views where the layout allows:
    a channels-last tensor's are). Its weight gradient is then Σ_t δ_t a_tᵀ, a Linear's, with no patches."""
    return _rows(as_2d(module, inputs), as_2d(module, output_grad), conv_geometry(module))  # type: ignore[arg-type]


def _rows(inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    (sh, sw) = geometry[1]
    return inputs[:, :, ::sh, ::sw].flatten(2).transpose(1, 2), output_grad.flatten(2).transpose(1, 2)


def is_pointwise(module: nn.Module) -> bool:
    """A Conv1d or Conv2d with a kernel of one tap, no padding and one group: a Linear applied at each of its
    (strided) positions, whatever its dilation."""
    if not isinstance(module, (nn.Conv1d, nn.Conv2d)) or module.groups != 1:
        return False
    geometry = conv_geometry(module)
    return geometry is not None and geometry[0] == (1, 1) and geometry[2] == (0, 0)


_FASTEST_POINTWISE: dict[tuple[object, ...], str] = {}


def fastest_pointwise_way(inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry) -> str:
    """How a pointwise convolution's per-example gradients are formed on a CPU where the compiled kernel takes its
    tensors: ``"rows"`` (one batched product of its rows, :func:`pointwise_rows`, as a Linear's) or ``"compiled
    kernel"`` (:func:`dpml.train.clipping_conv.compiled_norms`), whichever was faster, timed once per example shape,
    layout and batch size class in a process as :func:`fastest_grouped_way` times its ways (the same numbers either
    way, up to the order of additions). Neither wins everywhere (ad hoc, 2 threads): at batch 64 on maps of 2×2 to
    16×16 the product took 0.06–0.51 ms against 0.17–1.42 ms for the kernel (RegNetX's, EfficientNet's, ConvNeXt's
    1×1 layers at 32 px); at batch 16 on ConvNeXt-atto's 28×28 and 14×14 maps of 160 to 640 channels (224 px) the
    kernel 2.7–3.5 against 3.8–4.0 ms. Both ways form the gradients of the first heap-sized slice of the examples
    (:func:`dpml.devices.heap_sized_slices`), as the layer's piece forms them a slice at a time."""
    key = timing_key(inputs, output_grad, geometry, (inputs.is_contiguous(), output_grad.is_contiguous()))
    if key not in _FASTEST_POINTWISE:  # timed on a heap-sized slice of the examples: what one slice's gradients take
        gradient_bytes = output_grad.shape[1] * inputs.shape[1] * inputs.element_size()
        part = heap_sized_slices(inputs.shape[0], gradient_bytes, inputs.device)[0]
        x, g = inputs[part], output_grad[part]
        a, d = _rows(x, g, geometry)
        ways: dict[str, Callable[[], object]] = {
            "rows": lambda: torch.bmm(d.transpose(1, 2), a),
            "compiled kernel": lambda: compiled_norms(x, g, geometry, True),
        }
        least = least_seconds(ways)
        _FASTEST_POINTWISE[key] = min(least, key=least.__getitem__)
    return _FASTEST_POINTWISE[key]


def pointwise_by_rows(module: nn.Module, inputs: torch.Tensor, output_grad: torch.Tensor, limit: int) -> bool:
    """Whether a pointwise convolution's piece is a Linear's on its rows (:func:`pointwise_rows`), not the
    convolution's own: where the compiled kernel does not take its tensors (a GPU, float64), at one position (rank
    one: ‖δ‖²‖a‖²), and where its per-example gradients are materialised (:func:`materialise`, ``limit`` the numbers
    it may keep) and the rows' product is the faster way to them (:func:`fastest_pointwise_way`). Ghost-normed at
    several positions on a CPU it keeps the convolution's piece, the compiled norms and the weight-gradient
    convolution of the clip-weighted δ (ad hoc, batch 64, the piece's norms and sums: ResNet-50's 128→512 layers on
    4×4 maps 0.82–1.14 against 1.16–1.53 ms by the rows, its 256→1024 on 2×2 0.88–1.03 against 1.07–1.16 ms)."""
    if not is_pointwise(module):
        return False
    x, d = as_2d(module, inputs), as_2d(module, output_grad)
    count = d[0, 0].numel()
    if not compiled_kernel_takes(x, d) or count == 1:
        return True
    if not materialise(x.shape[0], count, x.shape[1], d.shape[1], limit):
        return False
    return fastest_pointwise_way(x, d, conv_geometry(module)) == "rows"  # type: ignore[arg-type]
