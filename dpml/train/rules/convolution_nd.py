"""Convolutions the 1-D / 2-D rule (:mod:`dpml.train.rules.convolution`) does not take: ``F.conv3d`` (``nn.Conv3d``:
volumes, video) and the transposed convolutions ``F.conv_transpose1d`` / ``2d`` / ``3d`` (``nn.ConvTranspose*``: the
upsampling of U-Nets, decoders and generators), any number n of spatial dimensions.

P(a) (B, C·∏k, T) are the *patches* of a: a padded by p, the kernel's window at each of T output positions, its taps
spaced by the dilation d, the windows by the stride s (``F.unfold`` for any n).

- **Convolution**, z_t = W P(a)_t + b (W read as (C_out, C_in·∏k)): ∇_W ℓ_i = Σ_t δ_{i,t} P(a_i)_tᵀ — factored
  (u = δ, v = P(a)), so its norm is a ghost norm or a materialised one, as a dense layer's (Goodfellow 2015;
  :mod:`dpml.train.rules.combine`).
- **Transposed convolution**, y = convᵀ(x, W) with W (C_in, C_out, k…): the adjoint, in its input, of the convolution
  z ↦ conv(z, W) with the same stride, padding and dilation (W read as that convolution's (C_in, C_out·∏k) kernel), so
  ⟨δ, convᵀ(x, W)⟩ = ⟨x, conv(δ, W)⟩ = Σ_t x_tᵀ W P(δ)_t over x's positions t, and
  ∇_W ℓ_i = Σ_t x_{i,t} P(δ_i)_tᵀ — factored (u = x, v = P(δ)). ``output_padding`` (o < s or o < d) only lengthens y:
  P(δ) is taken at x's positions alone (the convolution of δ may have one more, which y's adjoint never reads).
- **Groups** g > 1: group j of W sees its own channels alone, ∇_{W_j} ℓ_i = Σ_t u_{i,j,t} v_{i,j,t}ᵀ.
- The bias: ∇_b ℓ_i = Σ_t δ_{i,t} over the output's positions.

**Factored or formed by the convolution's kernels.** Where a ghost norm is the cheaper (few positions T against the
kernel's size, the deep layers: :func:`dpml.train.clipping_norms.materialise` says not to materialise), the factored
form, whose Gram matrices hold T² numbers per example. Elsewhere, and for any groups, the per-example gradients are
formed on demand (:class:`dpml.train.rules.registry.Computed`) without the patches of the whole batch (∏k times the
input, and a copy): by one weight gradient of torch's with B·g groups (each example's channels a group), or one per
example, or the patches' product, or (a 2-D kernel in float32 on a CPU) the compiled kernel that builds each
example's patches, a group at a time, in a cache-sized buffer, whichever was fastest for the shape
(:func:`fastest_way`, timed once per shape on a CPU) — kept where they fit what the pass may keep (the clipped sum
is then Σ_i c_i G_i), else formed a slice of examples at a time for the norms and the clipped sum taken as one weight
gradient of the clip-weighted δ (δ_i c_i).

The input must be batch-first, or hold each example's k images among its first dimension ((B·k, C, …), the recorder's
example map says whose): an example's images are then its positions side by side
(:func:`by_example`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpml.train.clipping_conv import compiled_gradients, compiled_kernel_takes, named_padding
from dpml.train.clipping_conv_ways import least_seconds, timing_key
from dpml.train.clipping_norms import materialise
from dpml.train.keep_budget import keep_limit
from dpml.train.rules.registry import (
    Call,
    Computed,
    Dense,
    Factored,
    Form,
    Pending,
    Rows,
    Tracked,
    Use,
    by_example,
    rule,
)

Sizes = tuple[int, ...]
SumFn = Callable[[torch.Tensor], torch.Tensor]


def sizes(value: int | Sequence[int], n: int) -> Sizes:
    values = (value,) if isinstance(value, int) else tuple(value)
    return values * n if len(values) == 1 else values


@dataclass(frozen=True)
class Convolution:
    """One call's geometry (n sizes each) and kind: the kernel's shape, stride, padding, dilation, output padding,
    groups, transposed or not."""

    kernel: Sizes  # the weight's shape: (C_out, C_in/g, k…), transposed (C_in, C_out/g, k…)
    stride: Sizes
    padding: Sizes
    dilation: Sizes
    output_padding: Sizes
    groups: int
    transposed: bool

    @property
    def taps(self) -> Sizes:
        return self.kernel[2:]


def patches(x: torch.Tensor, taps: Sizes, stride: Sizes, padding: Sizes, dilation: Sizes, out: Sizes) -> torch.Tensor:
    """P(x), (N, C·∏taps, ∏out): x (N, C, *spatial) padded, the kernel's windows at the first ``out`` positions of
    each spatial dimension (what ``F.unfold`` gives in 2-D, for any number of dimensions): one strided view, one
    copy."""
    if any(padding):
        x = F.pad(x, [side for p in reversed(padding) for side in (p, p)])
    strides, n = x.stride(), len(taps)
    window = x.as_strided(
        (*x.shape[:2], *taps, *out),
        (
            *strides[:2],
            *(strides[2 + j] * dilation[j] for j in range(n)),
            *(strides[2 + j] * stride[j] for j in range(n)),
        ),
        x.storage_offset(),
    )
    return window.reshape(x.shape[0], x.shape[1] * math.prod(taps), math.prod(out))


def factors(x: torch.Tensor, d: torch.Tensor, conv: Convolution) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, v), (N, rows, T) and (N, cols, T), with each image's ∇_W = Σ_t u_t v_tᵀ in W's (rows, cols) layout: (δ,
    P(a)) for a convolution, (x, P(δ)) at x's positions for a transposed one (module docstring)."""
    geometry = (conv.taps, conv.stride, conv.padding, conv.dilation)
    if conv.transposed:
        return x.reshape(x.shape[0], x.shape[1], -1), patches(d, *geometry, tuple(x.shape[2:]))
    return d.reshape(d.shape[0], d.shape[1], -1), patches(x, *geometry, tuple(d.shape[2:]))


def by_patches(x: torch.Tensor, d: torch.Tensor, conv: Convolution) -> torch.Tensor:
    """Each image's Σ_t u_{j,t} v_{j,t}ᵀ per group j from the factors, (N, rows, cols / g)."""
    u, v = factors(x, d, conv)
    count, positions, g = u.shape[0], u.shape[2], conv.groups
    if g == 1:
        return torch.bmm(u, v.transpose(1, 2))
    per_group = torch.einsum("bgrt,bgct->bgrc", u.reshape(count, g, -1, positions), v.reshape(count, g, -1, positions))
    return per_group.reshape(count, u.shape[1], -1)


def _weight_gradient(x: torch.Tensor, d: torch.Tensor, conv: Convolution, images: int) -> torch.Tensor:
    """torch's weight gradient of the call on (x, δ) read as ``images`` images side by side in the channels, each its
    own g groups: (images · kernel[0], *kernel[1:])."""
    weight = x.new_empty(images * conv.kernel[0], *conv.kernel[1:])
    return torch.ops.aten.convolution_backward(  # type: ignore[no-any-return]
        d,
        x,
        weight,
        None,
        conv.stride,
        conv.padding,
        conv.dilation,
        conv.transposed,
        conv.output_padding,
        conv.groups * images,
        (False, True, False),
    )[1]


def by_grouped_weight_gradient(x: torch.Tensor, d: torch.Tensor, conv: Convolution) -> torch.Tensor:
    """Every image's gradient from one weight gradient with N·g groups (image i's channels the i-th block), (N, rows,
    cols / g)."""
    count = x.shape[0]
    flat = _weight_gradient(x.reshape(1, -1, *x.shape[2:]), d.reshape(1, -1, *d.shape[2:]), conv, count)
    return flat.reshape(count, conv.kernel[0], -1)


def by_weight_gradient_per_image(x: torch.Tensor, d: torch.Tensor, conv: Convolution) -> torch.Tensor:
    """Each image's gradient from its own weight gradient (N calls), (N, rows, cols / g)."""
    return torch.stack([_weight_gradient(x[i : i + 1], d[i : i + 1], conv, 1) for i in range(x.shape[0])]).reshape(
        x.shape[0], conv.kernel[0], -1
    )


def by_compiled_kernel(x: torch.Tensor, d: torch.Tensor, conv: Convolution) -> torch.Tensor:
    """Every image's gradient by the compiled kernel's patch way (each image's patches built in a cache-sized buffer and
    multiplied there: :func:`dpml.train.clipping_conv.compiled_gradients`, each group of an image as an image of its
    own), (N, rows, cols / g); only where :func:`compiled_kernel_applies`."""
    geometry = (conv.taps, conv.stride, conv.padding, conv.dilation)
    grads = compiled_gradients(x, d, geometry, conv.groups)  # type: ignore[arg-type]
    assert grads is not None
    return grads


def compiled_kernel_applies(x: torch.Tensor, d: torch.Tensor, conv: Convolution) -> bool:
    """The compiled kernel takes the call: a 2-D convolution (not transposed), float32 on a CPU, the kernel built."""
    plain = len(conv.kernel) == 4 and not conv.transposed
    return plain and compiled_kernel_takes(x, d)


WAYS: dict[str, Callable[[torch.Tensor, torch.Tensor, Convolution], torch.Tensor]] = {
    "grouped weight gradient": by_grouped_weight_gradient,
    "weight gradient per image": by_weight_gradient_per_image,
    "patches": by_patches,
    "compiled kernel": by_compiled_kernel,
}
APPLIES: dict[str, Callable[[torch.Tensor, torch.Tensor, Convolution], bool]] = {
    "compiled kernel": compiled_kernel_applies
}
"""Ways that take only some calls, with what says which (a way not named here takes every call)."""
_FASTEST: dict[tuple[object, ...], str] = {}


def fastest_way(x: torch.Tensor, d: torch.Tensor, conv: Convolution) -> str:
    """The way (a key of :data:`WAYS`) to the per-image gradients of this shape: on a CPU the fastest of those that
    take the call (:data:`APPLIES`), timed once per image shape and batch size class (its power of two above) in a
    process, by the least of a few rounds of the ways in turn after one untimed run each (:func:`least_seconds`; no
    way wins everywhere: ad hoc at batch 16, R3D-18's 64-channel 3×3×3 on 8×16×16 maps took 16 ms grouped, 73 ms
    per image, 101 ms by patches; its 512-channel ones on 1×2×2 maps 2,343 ms grouped, 55 ms per image; at batch 64,
    ResNet-18's standardised 64-channel 3×3 on 8×8 maps 11.9 ms grouped, 13.2 per image, 4.6 by patches and 2.5 by
    the compiled kernel). They compute the same numbers, in another order of additions. On a GPU, untimed: the
    patches while they fit the keep limit, else the grouped weight gradient."""
    if x.device.type != "cpu":
        positions = math.prod((x if conv.transposed else d).shape[2:])
        numbers = x.shape[0] * math.prod(conv.kernel[1:]) * conv.groups * positions  # the patches'
        return "patches" if numbers <= keep_limit(x.device) else "grouped weight gradient"
    key = timing_key(x, d, conv)
    if key not in _FASTEST:
        ways = {name: way for name, way in WAYS.items() if name not in APPLIES or APPLIES[name](x, d, conv)}
        least = least_seconds({name: functools.partial(way, x, d, conv) for name, way in ways.items()})
        _FASTEST[key] = min(least, key=least.__getitem__)
    return _FASTEST[key]


def _weighted_sum(x: torch.Tensor, d: torch.Tensor, conv: Convolution, owners: torch.Tensor | None) -> SumFn:
    """c ↦ Σ_i c_i ∇_W ℓ_i: the weight gradient of the call with each image's δ scaled by its example's c (one call of
    torch's kernel, no per-example gradient), (rows, cols)."""

    def weighted(c: torch.Tensor) -> torch.Tensor:
        per_image = c if owners is None else c[owners.to(c.device)]
        scaled = d * per_image.reshape(-1, *(1,) * (d.dim() - 1)).to(d.dtype)
        return _weight_gradient(x, scaled, conv, 1).reshape(conv.kernel[0], -1)

    return weighted


def kernel_form(
    x: torch.Tensor, d: torch.Tensor, conv: Convolution, owners: torch.Tensor | None, rows: Rows | None
) -> Form:
    """The kernel's use, W read as (rows, cols) (module docstring): factored where a ghost norm is the cheaper (few
    positions against the kernel's size: :func:`dpml.train.clipping_norms.materialise` at the layer's keep limit),
    else formed on demand by the fastest of torch's kernels and the patches (:func:`fastest_way`). ``owners``: the
    example of each image where the images are grouped by example (``rows``), else None (batch-first)."""
    batch = x.shape[0] if rows is None else rows.batch
    out_rows, cols = conv.kernel[0], math.prod(conv.kernel[1:])
    positions = math.prod((x if conv.transposed else d).shape[2:]) * x.shape[0] // batch  # T per example
    if conv.groups == 1 and not materialise(batch, positions, cols, out_rows, keep_limit(x.device)):
        u, v = (by_example(f, rows).transpose(1, 2) for f in factors(x, d, conv))
        return Factored(u, v, out_rows, cols)

    def gradients(examples: slice) -> torch.Tensor:  # (|s|, rows, cols)
        if owners is None:
            part_x, part_d = x[examples], d[examples]
            return WAYS[fastest_way(part_x, part_d, conv)](part_x, part_d, conv)
        start, stop, _ = examples.indices(batch)  # the slice's examples' images, each example's added up
        chosen = ((owners >= start) & (owners < stop)).nonzero().squeeze(1)
        part_x, part_d = x[chosen.to(x.device)], d[chosen.to(x.device)]
        grads = WAYS[fastest_way(part_x, part_d, conv)](part_x, part_d, conv).reshape(chosen.numel(), -1)
        added = grads.new_zeros(stop - start, grads.shape[1])
        return added.index_add_(0, (owners[chosen] - start).to(x.device), grads).reshape(-1, out_rows, cols)

    def cast(dtype: torch.dtype) -> Computed:
        if x.dtype == dtype and d.dtype == dtype:
            return form
        return kernel_form(x.to(dtype), d.to(dtype), conv, owners, rows)  # type: ignore[return-value]

    form = Computed(batch, (out_rows, cols), x.device, gradients, _weighted_sum(x, d, conv, owners), cast)
    return form


@rule(F.conv3d)
def convolution_3d(call: Call) -> Pending | str:
    """F.conv3d(input, weight, bias, stride, padding, dilation, groups)."""
    return _convolution(call, transposed=False, at=(3, 4, 5, 6))


@rule(F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)
def transposed_convolution(call: Call) -> Pending | str:
    """F.conv_transpose{n}d(input, weight, bias, stride, padding, output_padding, groups, dilation)."""
    return _convolution(call, transposed=True, at=(3, 4, 7, 6))


def _convolution(call: Call, transposed: bool, at: tuple[int, int, int, int]) -> Pending | str:
    """The uses of the kernel and the bias; ``at``: where stride, padding, dilation and groups stand in the call."""
    x, weight, bias = call.arg(0, "input"), call.arg(1, "weight"), call.arg(2, "bias")
    n = weight.dim() - 2
    stride, dilation = sizes(call.arg(at[0], "stride", 1), n), sizes(call.arg(at[2], "dilation", 1), n)
    padding_arg, groups = call.arg(at[1], "padding", 0), int(call.arg(at[3], "groups", 1))
    padding = (
        named_padding(padding_arg, tuple(weight.shape[2:]), dilation)
        if isinstance(padding_arg, str)
        else sizes(padding_arg, n)
    )
    if padding is None:
        return "padding 'same' with an odd total (torch pads it unevenly)"
    known, rows = call.slices_by_example(x)
    if call.tracked(x) is not None or x.dim() != weight.dim() or not known:
        return f"its input (shape {tuple(x.shape)}) is not batch-first"
    merged = None if rows is None else call.leading_examples(x)  # (each image's example)
    w, b = call.tracked(weight), call.tracked(bias)
    if w is not None and w.index is not None:
        w = Tracked(w.param, w.index.reshape(weight.shape[0], -1), w.shared)
    output_padding = sizes(call.arg(5, "output_padding", 0), n) if transposed else (0,) * n
    conv = Convolution(tuple(weight.shape), stride, padding, dilation, output_padding, groups, transposed)
    recorded, out_channels = x.detach(), call.output.shape[1]

    def finish(output_grad: torch.Tensor) -> list[Use]:
        uses: list[Use] = []
        if w is not None:
            uses.append((w, kernel_form(recorded, output_grad, conv, merged, rows)))
        if b is not None:
            d = output_grad.reshape(output_grad.shape[0], out_channels, -1)
            uses.append((b, Dense(by_example(d, rows).sum(2))))
        return uses

    return Pending(call.output, [t.param for t in (w, b) if t is not None], finish)
