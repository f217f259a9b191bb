"""Convolutions as the fast path sees them: the patches a_t under the kernel at each output position t,
and the per-example weight gradients ∇_W ℓ_i = Σ_t δ_t a_tᵀ without them (pure tensor functions; the
pieces that use them are in :mod:`dpml.train.clipping_layers`).

A Conv1d is the Conv2d of height 1: its input (B, C, L) is seen as (B, C, 1, L) under a (1, k) kernel,
so one set of formulas serves both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpml.train.kernels import compiled_conv_norms

Geometry = tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]


def conv_geometry(module: nn.Conv1d | nn.Conv2d) -> Geometry | None:
    """(kernel, stride, padding, dilation) of a Conv1d or Conv2d as a Conv2d (a Conv1d is one of height 1),
    with ``padding="valid"`` as 0 and ``"same"`` as d·(k − 1)/2 on each side; None for a ``"same"`` whose
    total padding d·(k − 1) is odd (torch pads it unevenly: left to the exact path)."""
    def pair(values: tuple[int, ...], one_d: int) -> tuple[int, int]:
        return (one_d, values[0]) if isinstance(module, nn.Conv1d) else (values[0], values[1])

    kernel, stride, dilation = (pair(v, 1) for v in (module.kernel_size, module.stride, module.dilation))
    if module.padding == "valid":
        padding: tuple[int, ...] = (0,) * len(module.kernel_size)
    elif module.padding == "same":
        totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
        if any(total % 2 for total in totals):
            return None
        padding = tuple(total // 2 for total in totals)
    else:
        padding = tuple(module.padding)  # type: ignore[arg-type]
    return kernel, stride, pair(padding, 0), dilation


def as_2d(module: nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """A Conv1d's (B, C, L) input or output gradient as the (B, C, 1, L) of its Conv2d of height 1."""
    return tensor.unsqueeze(2) if isinstance(module, nn.Conv1d) else tensor


def unfold_patches(x: torch.Tensor, kernel: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
                   dilation: tuple[int, ...]) -> torch.Tensor:
    """The convolution's input patches, (B, C·kh·kw, T) — what ``F.unfold`` returns, as one strided view
    and one copy. (``F.unfold`` itself took ≈4 s instead of ≈30 ms for a 512×1×28×28 batch with two
    intra-op threads on this CPU build of torch 2.13.)"""
    if any(padding):
        x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    batch, channels, height, width = x.shape
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    out_h, out_w = (height - dh * (kh - 1) - 1) // sh + 1, (width - dw * (kw - 1) - 1) // sw + 1
    s = x.stride()
    patches = x.as_strided((batch, channels, kh, kw, out_h, out_w),
                           (s[0], s[1], s[2] * dh, s[3] * dw, s[2] * sh, s[3] * sw))
    return patches.reshape(batch, channels * kh * kw, out_h * out_w)


def channels_last_patches(x: torch.Tensor, kernel: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
                          dilation: tuple[int, ...]) -> torch.Tensor:
    """The convolution's input patches, (B, T, kh·kw·C) with the channel fastest within a patch (position
    (u, v, c) of the kernel at u·kw·C + v·C + c; :func:`unfold_patches` orders them c, u, v): taken from a
    channels-last copy of x, where every row of a patch is kw·C contiguous numbers, so the copy reads
    runs of memory instead of gathering single numbers (the gather was the larger half of a per-example
    gradient by patches on a CPU, ad hoc)."""
    if any(padding):
        x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    batch, channels, height, width = x.shape
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    out_h, out_w = (height - dh * (kh - 1) - 1) // sh + 1, (width - dw * (kw - 1) - 1) // sw + 1
    last = x.permute(0, 2, 3, 1).contiguous()  # (B, H, W, C)
    s = last.stride()
    patches = last.as_strided((batch, out_h, out_w, kh, kw, channels),
                              (s[0], s[1] * sh, s[2] * sw, s[1] * dh, s[2] * dw, s[3]))
    return patches.reshape(batch, out_h * out_w, kh * kw * channels)


def conv_per_example_gradients(module: nn.Conv2d, inputs: torch.Tensor, output_grad: torch.Tensor) -> torch.Tensor:
    """∇_W ℓ_i = Σ_t δ_t a_tᵀ of every example, (B, C_out, C_in·kh·kw), by one grouped convolution
    and without unfolding the patches (Rochette et al. 2019): the input's channels become the batch,
    its examples the groups, and each example's output gradient δ_{i,o} (oh×ow) the kernel of group
    i, dilated by the layer's stride; the result's first kh×kw positions are ∇_W ℓ_i."""
    batch, channels = inputs.shape[:2]
    out_channels, kernel = output_grad.shape[1], module.kernel_size
    _, stride, padding, dilation = conv_geometry(module)  # type: ignore[misc]
    grads = F.conv2d(inputs.transpose(0, 1), output_grad.reshape(batch * out_channels, 1, *output_grad.shape[2:]),
                     stride=dilation, padding=padding, dilation=stride, groups=batch)
    grads = grads[:, :, :kernel[0], :kernel[1]].reshape(channels, batch, out_channels, kernel[0], kernel[1])
    return grads.permute(1, 2, 0, 3, 4).reshape(batch, out_channels, -1)


def conv_per_example_gradients_by_weight_grad(module: nn.Conv2d, inputs: torch.Tensor,
                                              output_grad: torch.Tensor) -> torch.Tensor:
    """∇_W ℓ_i = Σ_t δ_t a_tᵀ of every example, (B, C_out, C_in·kh·kw), as the weight gradient of one
    convolution with B groups: the examples are folded into the channels, input (1, B·C_in, H, W) and
    output gradient (1, B·C_out, oh, ow), so group i's weight gradient is example i's. Same numbers as
    :func:`conv_per_example_gradients`, by another kernel (the grouped weight-gradient convolution),
    which is the faster of the two on a CPU from 8 input channels up (``benchmarks/conv_per_example.py``)."""
    batch, channels = inputs.shape[:2]
    out_channels = output_grad.shape[1]
    kernel, stride, padding, dilation = conv_geometry(module)  # type: ignore[misc]
    grads = torch.nn.grad.conv2d_weight(inputs.reshape(1, batch * channels, *inputs.shape[2:]),
                                        (batch * out_channels, channels, *kernel),
                                        output_grad.reshape(1, batch * out_channels, *output_grad.shape[2:]),
                                        stride, padding, dilation, groups=batch)
    return grads.reshape(batch, out_channels, -1)


def per_example_conv_gradients(way: str, module: nn.Conv2d, inputs: torch.Tensor, output_grad: torch.Tensor) -> torch.Tensor:
    """∇_W ℓ_i (B, C_out, C_in·kh·kw) in torch by ``way`` (``"weight gradient"``, ``"grouped forward"`` or
    ``"patches"``: the batched product δ_i A_iᵀ of the unfolded patches)."""
    if way == "weight gradient":
        return conv_per_example_gradients_by_weight_grad(module, inputs, output_grad)
    if way == "grouped forward":
        return conv_per_example_gradients(module, inputs, output_grad)
    d = output_grad.reshape(*output_grad.shape[:2], -1)
    return torch.bmm(d, unfold_patches(inputs, *conv_geometry(module)).transpose(1, 2))  # type: ignore[misc]


WEIGHT_GRAD_MIN_CHANNELS = 8  # from here on the grouped weight gradient beats the grouped forward (CPU)


def per_example_conv_way(device_type: str, in_channels: int, count: int, out_channels: int) -> str:
    """How :func:`dpml.train.clipping_layers._conv_piece` materialises a Conv2d's per-example gradients
    (B, C_out, C_in·kh·kw), by the measurements of ``benchmarks/conv_per_example.py``
    (``results/conv_per_example*.md``):

    - on a GPU ``"patches"``: from the unfolded patches by one batched product over the whole batch
      (a convolution with B groups, forward or weight gradient, is up to 9× slower there, for WRN-16-4's
      layers without TF32);
    - on a CPU, where the gradient is at least as large as a channel's patches (T ≤ C_out), ``"patch
      slices"`` (:func:`dpml.train.clipping_layers.patch_slice_norms_squared`): the same product a
      cache-sized slice of examples at a time, for the norms only; else ``"weight gradient"``, the
      weight gradient of one convolution with B groups (:func:`conv_per_example_gradients_by_weight_grad`),
      from ``WEIGHT_GRAD_MIN_CHANNELS`` input channels up, and below that ``"grouped forward"``
      (:func:`conv_per_example_gradients`), faster for images of one to a few channels. In float32 the
      compiled kernel (:func:`compiled_norms`) does a CPU way's work where it applies."""
    if device_type == "cuda":
        return "patches"
    if count <= out_channels:
        return "patch slices"
    return "weight gradient" if in_channels >= WEIGHT_GRAD_MIN_CHANNELS else "grouped forward"


COMPILED_MAX_POSITIONS = 256
"""The compiled kernel is taken for layers of at most this many output positions T per example: in
``results/conv_per_example.md`` it is the fastest way at T = 25, 49 and 196 (the Opacus example CNN's
two convolutions, WRN-16-4's strided and deeper layers); at T = 784 it is faster for some input channel
counts (12, 16, 64) and slower for others (3 to 8, 24), a rule not yet measured well enough to take."""


def compiled_norms(inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry,
                   keep: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """‖∇_W ℓ_i‖_F² of a Conv2d (groups = 1) for every example, and with ``keep`` the per-example gradients
    (B, C_out, C_in·kh·kw) themselves, by the compiled kernel (``_conv_norms.c``: each example's patches
    built in a cache-sized buffer and multiplied there, G_i = δ_i A_i), the examples split over torch's
    own intra-op threads (the kernel's OpenMP threads are torch's); None where the kernel is not
    available (no C compiler), the tensors are not float32 on the CPU, or the layer has more than
    ``COMPILED_MAX_POSITIONS`` output positions (the caller then takes a torch way)."""
    kernel = compiled_conv_norms()
    if (kernel is None or inputs.device.type != "cpu" or inputs.dtype != torch.float32
            or output_grad.dtype != torch.float32 or output_grad.shape[2] * output_grad.shape[3] > COMPILED_MAX_POSITIONS):
        return None
    x, d = inputs.contiguous(), output_grad.contiguous()
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = geometry
    batch, channels, height, width = x.shape
    out_channels, out_h, out_w = d.shape[1:]
    shape = torch.tensor([channels, height, width, out_channels, out_h, out_w, kh, kw, sh, sw, ph, pw, dh, dw],
                         dtype=torch.long)
    squared = x.new_empty(batch)
    grads = x.new_empty(batch, out_channels, channels * kh * kw) if keep else None
    if batch == 0:
        return squared, grads
    if kernel(x.data_ptr(), d.data_ptr(), batch, shape.data_ptr(), squared.data_ptr(),
              0 if grads is None else grads.data_ptr()):
        raise MemoryError("the compiled convolution norms could not allocate their patch buffers")
    return squared, grads
