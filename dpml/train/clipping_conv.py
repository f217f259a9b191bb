"""Convolutions as the fast path sees them: the patches a_t under the kernel at each output position t,
and the per-example weight gradients ∇_W ℓ_i = Σ_t δ_t a_tᵀ without them (pure tensor functions; the
pieces that use them are in :mod:`dpml.train.clipping_layers`).

A Conv1d is the Conv2d of height 1: its input (B, C, L) is seen as (B, C, 1, L) under a (1, k) kernel,
so one set of formulas serves both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.grad
import torch.nn.functional as F
from torch import nn

from dpml.devices import heap_sized_slices
from dpml.train.kernels import compiled_conv_norms

Geometry = tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]


def conv_geometry(module: nn.Conv1d | nn.Conv2d) -> Geometry | None:
    """(kernel, stride, padding, dilation) of a Conv1d or Conv2d as a Conv2d (a Conv1d is one of height 1),
    with ``padding="valid"`` as 0 and ``"same"`` as d·(k − 1)/2 on each side; None for a ``"same"`` whose
    total padding d·(k − 1) is odd (torch pads it unevenly: left to the exact path)."""

    def pair(values: tuple[int, ...], one_d: int) -> tuple[int, int]:
        return (one_d, values[0]) if isinstance(module, nn.Conv1d) else (values[0], values[1])

    kernel, stride, dilation = (pair(v, 1) for v in (module.kernel_size, module.stride, module.dilation))
    if isinstance(module.padding, str):
        named = named_padding(module.padding, tuple(module.kernel_size), tuple(module.dilation))
        if named is None:
            return None
        padding = named
    else:
        padding = tuple(module.padding)
    return kernel, stride, pair(padding, 0), dilation


def named_padding(name: str, kernel: tuple[int, ...], dilation: tuple[int, ...]) -> tuple[int, ...] | None:
    """``padding="valid"`` as 0 and ``"same"`` as d·(k − 1)/2 on each side, per dimension; None for a ``"same"`` whose
    total padding d·(k − 1) is odd (torch pads it unevenly)."""
    if name == "valid":
        return (0,) * len(kernel)
    totals = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
    if name != "same" or any(total % 2 for total in totals):
        return None
    return tuple(total // 2 for total in totals)


def as_2d(module: nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """A Conv1d's (B, C, L) input or output gradient as the (B, C, 1, L) of its Conv2d of height 1."""
    return tensor.unsqueeze(2) if isinstance(module, nn.Conv1d) else tensor


def unfold_patches(
    x: torch.Tensor,
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
    taps: tuple[range, range] | None = None,
) -> torch.Tensor:
    """The convolution's input patches, (B, C·kh·kw, T) — what ``F.unfold`` returns, as one strided view
    and one copy; with ``taps``, only those rows and columns of the kernel, (B, C·|rows|·|columns|, T).
    (``F.unfold`` itself took ≈4 s instead of ≈30 ms for a 512×1×28×28 batch with two intra-op threads on
    this CPU build of torch 2.13.)"""
    if any(padding):
        x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    batch, channels, height, width = x.shape
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    out_h, out_w = (height - dh * (kh - 1) - 1) // sh + 1, (width - dw * (kw - 1) - 1) // sw + 1
    rows, columns = taps if taps is not None else (range(kh), range(kw))
    s = x.stride()
    patches = x.as_strided(
        (batch, channels, len(rows), len(columns), out_h, out_w),
        (s[0], s[1], s[2] * dh, s[3] * dw, s[2] * sh, s[3] * sw),
        x.storage_offset() + rows.start * dh * s[2] + columns.start * dw * s[3],
    )
    return patches.reshape(batch, channels * len(rows) * len(columns), out_h * out_w)


def channels_last_patches(
    x: torch.Tensor,
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
) -> torch.Tensor:
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
    patches = last.as_strided(
        (batch, out_h, out_w, kh, kw, channels), (s[0], s[1] * sh, s[2] * sw, s[1] * dh, s[2] * dw, s[3])
    )
    return patches.reshape(batch, out_h * out_w, kh * kw * channels)


PATCH_SLICE_ELEMENTS = 1 << 19  # numbers of patches and gradients per slice of examples (2 MiB in float32)


def patch_slice_norms_squared(
    inputs: torch.Tensor, d: torch.Tensor, geometry: Geometry, ghost: bool = False
) -> torch.Tensor:
    """‖∇_W ℓ_i‖_F² of a Conv2d for every example, ∇_W ℓ_i = δ_i A_i with A_i (T, kh·kw·C_in) the example's
    channels-last patches (:func:`channels_last_patches`: W's columns reordered,
    the norm unchanged), or with ``ghost`` Σ_{t,s} (A_i A_iᵀ)_{ts} (δ_iᵀ δ_i)_{ts}, a slice of at most
    ``PATCH_SLICE_ELEMENTS`` numbers at a time, so the copy and the products stay in the cache (ad hoc, 2
    threads: the CNN's second conv at batch 512, ≈4 against ≈10 ms at once; WRN-16-4's ghost-normed
    layers, whose 58 MB of patches at once took new pages each time, ≈430 ms less in a 6.7 s step). A ghost norm
    that :func:`input_gram_pays` for comes from :func:`input_gram_norms_squared` instead (no patches)."""
    batch, out_channels, count = d.shape
    if ghost and input_gram_pays(inputs.shape, count, geometry):
        return input_gram_norms_squared(inputs, d, geometry)
    patch = inputs.shape[1] * geometry[0][0] * geometry[0][1]
    step = max(1, PATCH_SLICE_ELEMENTS // (count * patch + (2 * count * count if ghost else out_channels * patch)))
    last = inputs.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # one channels-last copy for every slice
    squared = d.new_empty(batch)
    for start in range(0, batch, step):
        a, dd = channels_last_patches(last[start : start + step], *geometry), d[start : start + step]
        squared[start : start + step] = (
            (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(dd.transpose(1, 2), dd)).sum((1, 2))
            if ghost
            else torch.linalg.vector_norm(torch.bmm(dd, a).flatten(1), dim=1).square()
        )
    return squared


INPUT_GRAM_SLICE_ELEMENTS = 1 << 22  # numbers per slice of examples (16 MiB in float32; ad hoc, 2 threads, the
# fastest or within 5% of it for WRN-16-4's 256-channel 7×7 layers at B = 128 (7.5 ms, against 11.1 at 1/16 of it)


def input_gram_pays(shape: torch.Size, count: int, geometry: Geometry) -> bool:
    """A stride-1 convolution whose padded input has P positions, P² < T²·kh·kw: the Gram matrix of the input's
    positions (P²·C_in products an example) is then cheaper than that of its patches (T²·C_in·kh·kw)."""
    (kh, kw), stride, _, _ = geometry
    positions = padded_positions(shape, geometry)
    return stride == (1, 1) and positions * positions < count * count * kh * kw


def padded_positions(shape: torch.Size, geometry: Geometry) -> int:
    """P, the positions of a (B, C, H, W) input once zero-padded: (H + 2·ph)(W + 2·pw)."""
    _, _, (ph, pw), _ = geometry
    return (shape[2] + 2 * ph) * (shape[3] + 2 * pw)


COMPILED_GHOST_RATIO = 3
"""How many times a ghost norm's multiply-adds the compiled kernel's norms may cost and still be taken
(:func:`compiled_beats_ghost`): ad hoc, 2 threads, norms only, against :func:`patch_slice_norms_squared`'s ghost
norm — the Opacus CNN's 16 → 32 stride 2 on 13×13 at B = 512 (1.1× the ghost's multiply-adds) 1.0 against 2.6 ms,
128 → 128 at 14×14 and B = 128 (2.2× the input Gram's) 19.6 against 29.4, ResNet-18's 64 → 64 on 8×8 at B = 64
(2.6×) 0.8 against 1.8; 128 → 256 stride 2 at 14×14 (4.3×) 12.8 against 8.4, 128 → 128 on 4×4 (12×) 1.4
against 0.6 and 256 → 256 at 7×7 (12.5×) 24.1 against 5.3, where the ghost norm stays."""


def ghost_cost(shape: torch.Size, count: int, out_channels: int, geometry: Geometry) -> int:
    """Multiply-adds of a Conv2d's ghost norm for one example: P²·C_in + T²·C_out from the input Gram
    (:func:`input_gram_pays`), else T²·(C_in·kh·kw + C_out) from the patches'."""
    (kh, kw) = geometry[0]
    channels = shape[1]
    if input_gram_pays(shape, count, geometry):
        positions = padded_positions(shape, geometry)
        return positions * positions * channels + count * count * out_channels
    return count * count * (channels * kh * kw + out_channels)


def compiled_beats_ghost(shape: torch.Size, count: int, out_channels: int, geometry: Geometry) -> bool:
    """Whether a Conv2d that keeps no per-example gradients takes its norms from the compiled kernel
    (T·C_out·C_in·kh·kw multiply-adds an example, in cache) rather than the ghost norm: while that costs at
    most ``COMPILED_GHOST_RATIO`` times :func:`ghost_cost` (the clipped sum is the same weight-gradient
    convolution either way)."""
    (kh, kw) = geometry[0]
    direct = count * out_channels * shape[1] * kh * kw
    return direct <= COMPILED_GHOST_RATIO * ghost_cost(shape, count, out_channels, geometry)


def input_gram_norms_squared(inputs: torch.Tensor, d: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """‖∇_W ℓ_i‖_F² = Σ_{t,s} (A_i A_iᵀ)_{ts} (δ_iᵀ δ_i)_{ts} of a stride-1 Conv2d (the ghost norm) without its
    patches. With x̃ the zero-padded input, p_t the corner of output position t and o_uv = (u·dh, v·dw), the
    patch is a_t = (x̃[c, p_t + o_uv])_{c,u,v}, so (A Aᵀ)_{ts} = Σ_{u,v} X[p_t + o_uv, p_s + o_uv] with
    X = x̃ᵀx̃ the P×P Gram matrix of the padded input's positions over its channels: kh·kw shifted T×T
    blocks of one P×P product (P²·C_in, against T²·C_in·kh·kw from the patches; WRN-16-4's 256-channel
    7×7 layers at B = 128, 7.5 against 17.9 ms, ad hoc). A slice of examples at a time
    (``INPUT_GRAM_SLICE_ELEMENTS`` numbers)."""
    (kh, kw), _, (ph, pw), (dh, dw) = geometry
    batch, channels, height, width = inputs.shape
    rows, cols = height + 2 * ph, width + 2 * pw  # the padded input
    out_h, out_w = rows - dh * (kh - 1), cols - dw * (kw - 1)
    count = out_h * out_w
    step = max(1, INPUT_GRAM_SLICE_ELEMENTS // ((rows * cols) ** 2 + 2 * count * count + channels * rows * cols))
    squared = d.new_empty(batch)
    for start in range(0, batch, step):
        padded = F.pad(inputs[start : start + step], (pw, pw, ph, ph)).flatten(2)  # (b, C, P)
        gram = torch.bmm(padded.transpose(1, 2), padded).view(-1, rows, cols, rows, cols)
        shifted = torch.zeros(gram.shape[0], out_h, out_w, out_h, out_w, dtype=gram.dtype, device=gram.device)
        for u in range(kh):
            for v in range(kw):
                r, c = slice(u * dh, u * dh + out_h), slice(v * dw, v * dw + out_w)
                shifted += gram[:, r, c, r, c]
        dd = d[start : start + step]
        squared[start : start + step] = (shifted.view(-1, count, count) * torch.bmm(dd.transpose(1, 2), dd)).sum((1, 2))
    return squared


COMPILED_MAX_POSITIONS = 256
"""The compiled kernel's patch way is taken for layers of at most this many output positions T per example:
in ``results/conv_per_example.md`` it is the fastest way at T = 25, 49 and 196 (the Opacus example CNN's
two convolutions, WRN-16-4's strided and deeper layers); at T = 784 it is faster for some input channel
counts (12, 16, 64) and slower for others (3 to 8, 24). Its direct way (:func:`direct_way`) builds no
patches and is taken at any T."""

DIRECT_CHANNELS = 16  # the kernel's vector of 16 floats: its direct way needs C_in a multiple of it


def direct_way(in_channels: int) -> bool:
    """Whether the compiled kernel reads each example's patches straight from a channels-last copy of its
    input (no patch buffer; the gradient's columns then in (u, v, c) order): where C_in is a multiple of
    ``DIRECT_CHANNELS``. Ad hoc, 2 threads, B = 128, kept gradients, against the patch way: WRN-16-4's
    128→128 at 14×14 40.1 against 49.0 ms, 64→64 at 28×28 37.4 against 51.5 (the torch way there: ≈41),
    16→64 at 28×28 9.5 against 15.2, 64→128 stride 2 22.3 against 24.8; 128→256 stride 2 29.4 against
    27.4 and the Opacus CNN's 16→32 stride 2 at B = 512 2.9 against 2.8, the two it does not win."""
    return in_channels % DIRECT_CHANNELS == 0


def weight_from_columns(total: torch.Tensor, shape: torch.Size, channels_last: bool) -> torch.Tensor:
    """A (C_out, C_in·kh·kw) sum of per-example weight gradients in the weight's shape (C_out, C_in, kh, kw),
    its columns in the weight's (c, u, v) order or, ``channels_last``, in the direct way's (u, v, c)."""
    if not channels_last:
        return total.reshape(shape)
    out_channels, channels, kh, kw = shape
    return total.reshape(out_channels, kh, kw, channels).permute(0, 3, 1, 2).contiguous()


def compiled_norms(
    inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry, keep: bool
) -> tuple[torch.Tensor, list[torch.Tensor] | None, bool] | None:
    """‖∇_W ℓ_i‖_F² of a Conv2d (groups = 1) for every example, and with ``keep`` the per-example gradients
    themselves, (B_k, C_out, C_in·kh·kw) for consecutive slices of examples small enough to come from the
    kept heap (:func:`dpml.devices.heap_sized_slices`), and whether their columns are in the direct way's
    channels-last order (:func:`weight_from_columns`). By the compiled kernel (``_conv_norms.c``: each
    example's patches built in a cache-sized buffer, or read from a channels-last copy of it
    (:func:`direct_way`), and multiplied there, G_i = δ_i A_i), the examples split over torch's own
    intra-op threads (the kernel's OpenMP threads are torch's). x and δ are read where they lie (a model in
    ``torch.channels_last``, ConvNeXt's LayerNorm2d permuted back: no contiguous copy first). None where the
    kernel is not available (no
    C compiler), the tensors are not float32 on the CPU, or the patch way would be taken for more than
    ``COMPILED_MAX_POSITIONS`` output positions (the caller then takes a torch way)."""
    direct = direct_way(inputs.shape[1])
    if not compiled_kernel_takes(inputs, output_grad) or (
        not direct and output_grad.shape[2] * output_grad.shape[3] > COMPILED_MAX_POSITIONS
    ):
        return None
    x, d = inputs, positions_in_one_stride(output_grad)  # read in place: channels last, permuted views
    squared, out_channels, patch = x.new_empty(x.shape[0]), d.shape[1], x.shape[1] * geometry[0][0] * geometry[0][1]
    shape, parts = _kernel_shape(x, d, geometry, direct), []
    for part in heap_sized_slices(x.shape[0], out_channels * patch * x.element_size(), x.device):
        grads = x.new_empty(part.stop - part.start, out_channels, patch) if keep else None
        _run_kernel(x[part], d[part], shape, squared[part], grads)
        parts.append(grads)
    return squared, parts if keep else None, direct  # type: ignore[return-value]


def compiled_gradients(
    inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry, groups: int = 1
) -> torch.Tensor | None:
    """Every example's Conv2d weight gradient G_i = δ_i A_i, (B, C_out, C_in/g·kh·kw) with its columns in the weight's
    (c, u, v) order, by the compiled kernel's patch way (:func:`compiled_norms`, one tensor for the whole batch); None
    where the kernel is not available or the tensors are not float32 on the CPU. With ``groups`` = g > 1 the kernel
    runs on the B·g (example, group) pairs as its examples: a group's input channels and its output channels are
    runs of C_in/g and C_out/g, so x (B, C_in, H, W) read as (B·g, C_in/g, H, W) and δ as (B·g, C_out/g, oh, ow), in
    place whatever their layout (:func:`_kernel_shape`), make pair (i, j) an example of a one-group convolution with
    group j's kernel, whose gradient is rows j·C_out/g … of example i's (ResNeXt-50's 32 groups of 16 channels on 2×2
    maps at batch 64: 5.6 against 7.7 ms for the fastest torch way, ``benchmarks/results/grouped_conv_ways.md``)."""
    if not compiled_kernel_takes(inputs, output_grad):
        return None
    batch, d = inputs.shape[0], positions_in_one_stride(output_grad)
    patch = inputs.shape[1] // groups * geometry[0][0] * geometry[0][1]
    grads = inputs.new_empty(batch * groups, d.shape[1] // groups, patch)
    _run_kernel(inputs, d, _kernel_shape(inputs, d, geometry, False, groups), inputs.new_empty(batch * groups), grads)
    return grads.reshape(batch, output_grad.shape[1], -1)


def compiled_kernel_takes(inputs: torch.Tensor, output_grad: torch.Tensor) -> bool:
    """The compiled kernel is built and takes a Conv2d's (input, output gradient): float32 on the CPU."""
    return (
        inputs.device.type == "cpu"
        and inputs.dtype == torch.float32
        and output_grad.dtype == torch.float32
        and compiled_conv_norms() is not None
    )


def positions_in_one_stride(output_grad: torch.Tensor) -> torch.Tensor:
    """δ (B, C_out, OH, OW) itself where its positions t = oh·OW + ow lie one stride apart (NCHW, channels last,
    any layout whose rows follow each other), as the compiled kernel reads them; else a contiguous copy."""
    out_h, out_w = output_grad.shape[2:]
    follow = out_h == 1 or out_w == 1 or output_grad.stride(2) == out_w * output_grad.stride(3)
    return output_grad if follow else output_grad.contiguous()


def _position_stride(d: torch.Tensor) -> int:
    """The stride between δ's consecutive positions (:func:`positions_in_one_stride` holds)."""
    return d.stride(2) if d.shape[3] == 1 else d.stride(3)


def _kernel_shape(x: torch.Tensor, d: torch.Tensor, geometry: Geometry, direct: bool, groups: int = 1) -> torch.Tensor:
    """The compiled kernel's description of a call (``_conv_norms.c``): the sizes of one of its examples, the
    geometry, the way (``direct``: the direct way's column order) and where each example's numbers are in x and
    δ as they lie in memory (their strides; with ``groups`` = g > 1 the kernel's examples are the (example,
    group) pairs, group j's channels a run of C/g from channel j·C/g)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = geometry
    channels, height, width = x.shape[1] // groups, *x.shape[2:]
    out_channels, out_h, out_w = d.shape[1] // groups, *d.shape[2:]
    where = [groups, x.stride(0), channels * x.stride(1), *x.stride()[1:]]
    where += [d.stride(0), out_channels * d.stride(1), d.stride(1), _position_stride(d)]
    sizes = [channels, height, width, out_channels, out_h, out_w, kh, kw, sh, sw, ph, pw, dh, dw, direct]
    return torch.tensor(sizes + where, dtype=torch.long)


def _run_kernel(
    x: torch.Tensor, d: torch.Tensor, shape: torch.Tensor, squared: torch.Tensor, grads: torch.Tensor | None
) -> None:
    """The compiled kernel on (x, δ) of some examples (``shape``: :func:`_kernel_shape`): their squared
    norms into ``squared`` and, unless ``grads`` is None, their gradients into it."""
    kernel = compiled_conv_norms()
    assert kernel is not None
    count = squared.shape[0]  # the kernel's examples (with groups: the (example, group) pairs)
    if count and kernel(
        x.data_ptr(),
        d.data_ptr(),
        count,
        shape.data_ptr(),
        squared.data_ptr(),
        0 if grads is None else grads.data_ptr(),
    ):
        raise MemoryError("the compiled convolution norms could not allocate their patch buffers")


def live_taps(geometry: Geometry, size: tuple[int, ...], out: tuple[int, ...]) -> tuple[range, range]:
    """Per axis, the kernel taps that read the input at some output position: tap k reads index
    o·s − p + k·d, for o < n_out, of an axis of n inputs. A tap outside these reads only padding, at every
    position, so its weight gradient is zero for every example (3×3 kernels on ResNet's 1×1 maps: 8 of 9)."""
    kernel, stride, padding, dilation = geometry
    axes = []
    for taps, s, p, d, n, n_out in zip(kernel, stride, padding, dilation, size, out, strict=True):
        live = [k for k in range(taps) if any(0 <= o * s - p + k * d < n for o in range(n_out))]
        axes.append(range(live[0], live[-1] + 1) if live else range(0))
    return axes[0], axes[1]


def kernel_from_taps(taps: torch.Tensor, kernel: Sequence[int], rows: range, columns: range) -> torch.Tensor:
    """The gradient over the whole ``kernel`` (…, kh, kw) from that of its live taps, ``taps`` (…, |rows|, |columns|),
    zero at every other tap: ``taps`` itself where they are the whole kernel, else copied in tap by tap. Copied as one
    block, the destination's runs are |columns| ≤ kw numbers long, which torch's copy takes a few at a time:
    ResNet-18's 256 → 512 stride-2 layer on 2×2 maps (2×2 live taps of 3×3) took 1.12 ms as a block against 0.25 ms
    tap by tap (ad hoc, 2 threads), a plane of C_out·C_in numbers each."""
    if (len(rows), len(columns)) == tuple(kernel):
        return taps
    whole = taps.new_zeros(*taps.shape[:-2], *kernel)
    for i, row in enumerate(rows):
        for j, column in enumerate(columns):
            whole[..., row, column] = taps[..., i, j]
    return whole


def clip_weighted_conv_weight(
    weight_shape: torch.Size, inputs: torch.Tensor, weighted: torch.Tensor, geometry: Geometry, groups: int = 1
) -> torch.Tensor:
    """Σ_i Σ_t (c_i δ_{i,t}) a_{i,t}ᵀ for a Conv2d of ``groups`` = g, given the clip-weighted output gradient
    (B, C_out, H', W'), in the weight's shape (C_out, C_in/g, kh, kw).

    The layer's own weight-gradient convolution, except on a CPU where each example has one output position
    (ResNet's last stage on small images): there group j's Σ_i (c_i δ_{i,j}) a_{i,j}ᵀ is one product,
    (C_out/g, B) @ (B, C_in/g·k), over the :func:`live_taps` only (the others' gradient is zero), the g products
    batched. oneDNN's weight-gradient convolution took 9.1 ms against 1.7 ms for the product over every tap at
    B = 64, 512 → 512 channels, 3×3, on 1×1 maps, and 2.1 against 1.0 ms for 256 → 512, stride 2, 2×2 → 1×1 (on
    an earlier machine 147 against 6 and 18.5 against 11.3 ms); grouped, 1.23 against 0.20 ms for RegNetX's 368
    channels in groups of 8 on 1×1 maps and 3.57 against 0.09 ms for a depthwise 7×7 kernel over 320 channels on
    1×1 maps. From 2×2 outputs up the convolution is the faster there (1.2 against 3.0 ms for 256 → 256 on 2×2;
    the earlier machine had 9.7 against 7.4; grouped, 0.60 against 0.88 ms for 152 channels in groups of 8)."""
    batch, out_channels = weighted.shape[:2]
    if inputs.device.type != "cpu" or weighted[0, 0].numel() > 1:
        total: torch.Tensor = torch.nn.grad.conv2d_weight(
            inputs, weight_shape, weighted, geometry[1], geometry[2], geometry[3], groups
        )
        return total
    rows, columns = live_taps(geometry, tuple(inputs.shape[-2:]), tuple(weighted.shape[-2:]))
    if not len(rows) or not len(columns):
        return weighted.new_zeros(weight_shape)
    patches = unfold_patches(inputs, *geometry, taps=(rows, columns))  # (B, C_in·|rows|·|columns|, 1)
    by_group = patches.reshape(batch, groups, -1).transpose(0, 1)  # (g, B, C_in/g·|rows|·|columns|)
    part = torch.bmm(weighted.reshape(batch, groups, -1).permute(1, 2, 0), by_group)  # (g, C_out/g, ·)
    return kernel_from_taps(part.view(out_channels, -1, len(rows), len(columns)), weight_shape[2:], rows, columns)
