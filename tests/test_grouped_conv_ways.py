"""A grouped convolution's per-example weight gradients by each of the engine's four ways (grouped forward
convolution, grouped weight-gradient convolution, patches × δ, and in float32 the compiled kernel over the (example,
group) pairs), against autograd one example at a time, for
depthwise layers (with a channel multiplier), grouped ones, strides, dilations, rectangular kernels and maps so
small that most taps of the kernel only read padding; the clipped sum at one output position by the batched
product over the live taps; and whole models whose depthwise and grouped layers take each way in turn, against
a one-example-at-a-time loop, through a layer's hook and through the operation rule."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_clipping_layers import LAYOUTS, assert_matches_naive_loop, labels, laid_out
from test_dpsgd import naive_clipped_sum_and_norms
from torch import nn

from dpml.train import clipping_conv, clipping_conv_ways, keep_budget, kernels
from dpml.train.clipping import clipped_gradient_sum
from dpml.train.clipping_conv import Geometry, conv_geometry
from dpml.train.dpsgd import per_example_cross_entropy

WAYS = list(clipping_conv_ways.PER_EXAMPLE_WAYS)
COMPILED = "compiled kernel"  # float32 on a CPU only: its tests run in float32, against float64 autograd
TORCH_WAYS = [way for way in WAYS if way != COMPILED]


def needs_the_compiled_kernel() -> None:
    if kernels.c_compiler() is None:
        pytest.skip("no C compiler here: the compiled convolution kernel is not built (torch's ways are tested)")
    assert kernels.compiled_conv_norms() is not None, "the C compiler failed on _conv_norms.c, or it did not load"


LAYERS = [  # (layer, input height, width): each layer's kind in its comment
    (nn.Conv2d(6, 6, 7, padding=3, groups=6), 5, 4),  # depthwise 7×7 (ConvNeXt's)
    (nn.Conv2d(6, 6, 7, padding=3, groups=6), 1, 1),  # …on a 1×1 map: 48 of 49 taps read only padding
    (nn.Conv2d(6, 6, 7, padding=3, groups=6), 2, 3),  # …on 2×3: some rows and columns of taps dead
    (nn.Conv2d(4, 8, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=4), 7, 6),  # multiplier 2
    (nn.Conv2d(6, 9, 3, stride=2, padding=1, groups=3), 6, 7),  # groups of 2 inputs → 3 outputs
    (nn.Conv2d(8, 4, (2, 3), padding=(0, 1), dilation=(2, 1), groups=2), 5, 5),
    (nn.Conv2d(5, 3, 3, padding=2, dilation=2), 4, 3),  # no groups
]


def per_example_autograd(layer: nn.Conv2d, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """∇_W of Σ (layer(x_i) ⊙ δ_i), one example at a time."""
    return torch.stack(
        [torch.autograd.grad((layer(x[i : i + 1]) * delta[i : i + 1]).sum(), layer.weight)[0] for i in range(len(x))]
    )


def layer_case(layer: nn.Conv2d, height: int, width: int) -> tuple[nn.Conv2d, torch.Tensor, torch.Tensor, Geometry]:
    generator = torch.Generator().manual_seed(height * 10 + width)
    layer = layer.double()
    x = torch.randn(5, layer.in_channels, height, width, generator=generator, dtype=torch.float64)
    delta = torch.randn(layer(x).shape, generator=generator, dtype=torch.float64)
    geometry = conv_geometry(layer)
    assert geometry is not None
    return layer, x, delta, geometry


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(("layer", "height", "width"), LAYERS)
def test_each_way_gives_autograds_per_example_gradients(way: str, layer: nn.Conv2d, height: int, width: int) -> None:
    layer, x, delta, geometry = layer_case(layer, height, width)
    expected = per_example_autograd(layer, x, delta)
    if way == COMPILED:
        needs_the_compiled_kernel()
        got = clipping_conv_ways.PER_EXAMPLE_WAYS[way](x.float(), delta.float(), geometry, layer.groups)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double().reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="float32 on a CPU only"):
            clipping_conv_ways.PER_EXAMPLE_WAYS[way](x, delta, geometry, layer.groups)
        return
    got = clipping_conv_ways.PER_EXAMPLE_WAYS[way](x, delta, geometry, layer.groups)
    assert got.shape == (5, layer.out_channels, layer.weight[0].numel())
    torch.testing.assert_close(got.reshape(expected.shape), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", [0, 3], ids=["depthwise", "grouped-strided"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("way", WAYS)
def test_each_way_reads_inputs_and_gradients_in_any_layout(way: str, layout: str, case: int) -> None:
    """A grouped layer's input and output gradient channels last (a model in ``torch.channels_last``), rows apart,
    inside a larger tensor or with the examples interleaved: each way's per-example gradients are autograd's, and the
    compiled kernel's (which reads them where they lie) the same bits as from contiguous copies."""
    layer, x, delta, geometry = layer_case(*LAYERS[case])
    expected = per_example_autograd(layer, x, delta)
    if way == COMPILED:
        needs_the_compiled_kernel()
        way_of = clipping_conv_ways.PER_EXAMPLE_WAYS[way]
        plain = way_of(x.float(), delta.float(), geometry, layer.groups)
        got = way_of(laid_out(x.float(), layout), laid_out(delta.float(), layout), geometry, layer.groups)
        assert torch.equal(got, plain)
        return
    got = clipping_conv_ways.PER_EXAMPLE_WAYS[way](laid_out(x, layout), laid_out(delta, layout), geometry, layer.groups)
    torch.testing.assert_close(got.reshape(expected.shape), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("rows", "columns"),
    [(range(1, 3), range(1, 3)), (range(1, 2), range(3)), (range(2, 5), range(1, 6)), (range(7), range(7))],
)
def test_a_kernel_from_its_live_taps_is_the_block_assignment_into_zeros(rows: range, columns: range) -> None:
    """``kernel_from_taps`` (tap by tap) gives what ``zeros[..., rows, columns] = taps`` gives, from taps in any layout;
    taps that are the whole kernel come back as they are."""
    generator = torch.Generator().manual_seed(0)
    contiguous = torch.randn(3, 4, 5, len(rows), len(columns), generator=generator, dtype=torch.float64)
    for taps in (contiguous, contiguous.permute(4, 3, 0, 1, 2).contiguous().permute(2, 3, 4, 1, 0)):
        expected = torch.zeros(3, 4, 5, 7, 7, dtype=torch.float64)
        expected[..., rows.start : rows.stop, columns.start : columns.stop] = taps
        got = clipping_conv.kernel_from_taps(taps, (7, 7), rows, columns)
        assert torch.equal(got, expected)
        assert (got is taps) == (len(rows) == len(columns) == 7)


def test_the_dead_taps_of_a_small_map_are_zero_and_the_live_ones_are_not() -> None:
    """A 7×7 kernel with padding 3 on a 2×3 map: the taps that read the map are rows 2–4 and columns 1–5."""
    layer, x, delta, geometry = layer_case(nn.Conv2d(6, 6, 7, padding=3, groups=6), 2, 3)
    assert clipping_conv.live_taps(geometry, (2, 3), tuple(delta.shape[2:])) == (range(2, 5), range(1, 6))
    for way in TORCH_WAYS + ([COMPILED] if kernels.compiled_conv_norms() is not None else []):
        a, d = (x.float(), delta.float()) if way == COMPILED else (x, delta)
        grads = clipping_conv_ways.PER_EXAMPLE_WAYS[way](a, d, geometry, 6).reshape(5, 6, 7, 7)
        live = torch.zeros(7, 7, dtype=torch.bool)
        live[2:5, 1:6] = True
        assert bool((grads[..., ~live] == 0).all()), way
        assert bool((grads[..., live] != 0).all()), way


@pytest.mark.parametrize(("layer", "height", "width"), LAYERS)
def test_the_fastest_way_is_one_of_the_ways_and_chosen_once_per_shape(
    layer: nn.Conv2d, height: int, width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The choice is timed on the first call for an example shape and batch size class and remembered (batches of
    5 to 8 examples share one, 9 begins the next); the patches are a candidate only where the live taps' patches
    hold no more numbers than the per-example gradients."""
    layer, x, delta, geometry = layer_case(layer, height, width)
    monkeypatch.setattr(clipping_conv_ways, "_FASTEST_GROUPED", {})
    timed: list[str] = []
    seconds = clipping_conv_ways._seconds

    def spy(ways: list[str], *args: object) -> dict[str, float]:
        timed.extend(ways)
        found = seconds(ways, *args)  # type: ignore[arg-type]
        assert set(found) == set(ways) and all(0 < value < float("inf") for value in found.values())
        return found

    monkeypatch.setattr(clipping_conv_ways, "_seconds", spy)
    first = clipping_conv_ways.fastest_grouped_way(x, delta, geometry, layer.groups)
    again = clipping_conv_ways.fastest_grouped_way(x, delta, geometry, layer.groups)
    assert first == again and first in timed
    rows, columns = clipping_conv.live_taps(geometry, (height, width), tuple(delta.shape[2:]))
    patch_numbers = layer.in_channels * len(rows) * len(columns) * delta[0, 0].numel()
    small = patch_numbers <= layer.out_channels * layer.weight[0].numel()
    assert timed == ["grouped forward", "weight gradient"] + (["patches"] if small else [])
    more_x, more_delta = torch.cat([x, x[:4]]), torch.cat([delta, delta[:4]])
    assert clipping_conv_ways.fastest_grouped_way(more_x[:8], more_delta[:8], geometry, layer.groups) == first
    assert len(timed) == 2 + small  # 8 examples: the class of 5's
    clipping_conv_ways.fastest_grouped_way(more_x, more_delta, geometry, layer.groups)
    assert len(timed) == 2 * (2 + small)  # 9: timed again
    expected = per_example_autograd(layer, x, delta)
    got = clipping_conv_ways.grouped_conv_per_example_gradients(x, delta, geometry, layer.groups)
    torch.testing.assert_close(got.reshape(expected.shape), expected, rtol=1e-10, atol=1e-12)


def test_the_compiled_kernel_is_timed_for_float32_tensors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate for float32 tensors on a CPU where the kernel is built; not for float64, and not where it is not
    built (no C compiler)."""
    needs_the_compiled_kernel()
    layer, x, delta, geometry = layer_case(nn.Conv2d(8, 12, 3, padding=1, groups=4), 3, 3)
    timed: list[list[str]] = []
    seconds = clipping_conv_ways._seconds

    def spy(ways: list[str], *args: object) -> dict[str, float]:
        timed.append(list(ways))
        return seconds(ways, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(clipping_conv_ways, "_seconds", spy)
    for inputs, output_grad in [(x.float(), delta.float()), (x, delta)]:
        monkeypatch.setattr(clipping_conv_ways, "_FASTEST_GROUPED", {})
        clipping_conv_ways.fastest_grouped_way(inputs, output_grad, geometry, layer.groups)
    monkeypatch.setattr(clipping_conv, "compiled_conv_norms", lambda: None)
    monkeypatch.setattr(clipping_conv_ways, "_FASTEST_GROUPED", {})
    clipping_conv_ways.fastest_grouped_way(x.float(), delta.float(), geometry, layer.groups)
    assert [COMPILED in ways for ways in timed] == [True, False, False]


@pytest.mark.parametrize(
    ("layer", "size"),
    [
        (nn.Conv2d(8, 8, 7, padding=3, groups=8), 1),  # depthwise 7×7 on 1×1 maps: one live tap
        (nn.Conv2d(8, 12, 3, padding=1, groups=4), 1),  # grouped 3×3 on 1×1 maps (RegNet's last stage)
        (nn.Conv2d(6, 4, 3, stride=2, padding=1, groups=2), 2),  # 2×2 → 1×1
        (nn.Conv2d(6, 4, 3, padding=1, groups=2), 3),  # 3×3 maps: the convolution
    ],
)
def test_the_clip_weighted_sum_of_a_grouped_layer_equals_the_weighted_per_example_gradients(
    layer: nn.Conv2d, size: int
) -> None:
    layer, x, delta, geometry = layer_case(layer, size, size)
    factors = torch.rand(5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = torch.einsum("b,b...->...", factors, per_example_autograd(layer, x, delta))
    got = clipping_conv.clip_weighted_conv_weight(
        layer.weight.shape, x, delta * factors[:, None, None, None], geometry, layer.groups
    )
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


class DepthwiseBlocks(nn.Module):
    """A ConvNeXt-like block (depthwise 7×7, then pointwise) on 5×5 maps and again on 1×1 maps after a strided
    grouped layer; a depthwise Conv1d over a sequence (ConvBERT's, Mamba's); and a depthwise kernel applied by
    ``F.conv2d`` itself with a standardised weight (the operation rule's path, as NFNet's layers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(4, 4, 7, padding=3, groups=4)
        self.pointwise = nn.Conv2d(4, 8, 1)
        self.down = nn.Conv2d(8, 8, 5, stride=5, groups=2)
        self.small = nn.Conv2d(8, 8, 7, padding=3, groups=8)
        self.line = nn.Conv1d(8, 8, 4, padding=3, groups=8)
        self.standardised = nn.Parameter(torch.randn(8, 1, 3, 3))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.pointwise(torch.tanh(self.depthwise(x))))  # (B, 8, 5, 5)
        h = torch.tanh(self.small(torch.tanh(self.down(h))))  # (B, 8, 1, 1)
        w = self.standardised
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        s = torch.tanh(F.conv2d(torch.tanh(x.repeat(1, 2, 1, 1)), w, padding=1, groups=8))  # (B, 8, 5, 5)
        line = torch.tanh(self.line(s.flatten(2)))[..., :25]  # causal, as Mamba's: (B, 8, 25)
        return self.out(h.flatten(1) + line.mean(2))


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("way", TORCH_WAYS)
def test_depthwise_and_grouped_layers_match_the_naive_loop_by_each_way(
    way: str, keep: bool, monkeypatch: pytest.MonkeyPatch, vmapped: list
) -> None:
    """Each way in turn for every grouped layer, the per-example gradients kept (their weighted sum is the
    clipped sum) or not (the clip-weighted weight-gradient convolution, or at one position the product). No
    parameter takes the exact path: where nothing may be kept, the functional layer's rule forms its per-example
    gradients on demand, a slice of examples at a time."""
    monkeypatch.setattr(clipping_conv_ways, "fastest_grouped_way", lambda *args: way)
    if not keep:
        monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 0)
    torch.manual_seed(11)
    model = DepthwiseBlocks().double()
    x = torch.randn(6, 4, 5, 5, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    assert_matches_naive_loop(model, x, labels(6), 0.05)
    assert vmapped == []


class HeadsDepthwise(nn.Module):
    """A depthwise layer over each example's two "heads" as separate images, (B·2, 4, H, W), as MViT pools each
    head's map: an example's gradient is the sum over its two images (the operation rule's example map)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Conv2d(4, 8, 1)
        self.pool = nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=4)
        self.out = nn.Linear(8 * 3 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(x))  # (B, 8, 5, 5)
        heads = torch.tanh(self.pool(h.reshape(-1, 4, 5, 5)))  # (B·2, 4, 3, 3)
        return self.out(heads.reshape(x.shape[0], -1))


@pytest.mark.parametrize("way", TORCH_WAYS)
def test_a_depthwise_layer_over_each_examples_images_matches_the_naive_loop(
    way: str, monkeypatch: pytest.MonkeyPatch, vmapped: list
) -> None:
    monkeypatch.setattr(clipping_conv_ways, "fastest_grouped_way", lambda *args: way)
    torch.manual_seed(13)
    model = HeadsDepthwise().double()
    x = torch.randn(5, 4, 5, 5, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    assert_matches_naive_loop(model, x, labels(5), 0.05)
    assert vmapped == []


@pytest.mark.parametrize(
    ("model_class", "keep"),
    [(name, keep) for name in ["DepthwiseBlocks", "HeadsDepthwise", "GroupedTwice"] for keep in [True, False]],
)
def test_float32_grouped_layers_by_the_compiled_kernel_match_the_float64_loop(
    model_class: str, keep: bool, monkeypatch: pytest.MonkeyPatch, vmapped: list
) -> None:
    """The compiled kernel for every grouped layer of float32 models (depthwise 7×7 on 5×5 and 1×1 maps, a strided
    grouped layer, a depthwise Conv1d, a functional standardised depthwise kernel, one layer over each example's two
    images, one layer called on a 1×1 and a 4×4 map), by a layer's hook (at its live taps) and by the convolution
    rule (formed on demand where nothing may be kept): norms and clipped sums equal the float64 naive loop's within
    float32 rounding, the per-example gradients kept or not, the kernel taken for every grouped kernel, and no
    parameter on the exact path."""
    from dpml.train import clipping_layers
    from dpml.train.rules import convolution_nd

    needs_the_compiled_kernel()
    seen: set[tuple[int, int]] = set()  # (C_out, C_in/g) of the kernels the compiled ways formed gradients of
    live_taps_way, rule_way, rule_pick = (
        clipping_conv_ways.LIVE_TAP_WAYS[COMPILED],
        convolution_nd.WAYS[COMPILED],
        convolution_nd.fastest_way,
    )

    def by_live_taps(inputs: torch.Tensor, output_grad: torch.Tensor, geometry: Geometry, groups: int, taps):  # type: ignore[no-untyped-def]
        seen.add((output_grad.shape[1], inputs.shape[1] // groups))
        return live_taps_way(inputs, output_grad, geometry, groups, taps)

    def by_rule(x: torch.Tensor, d: torch.Tensor, conv: convolution_nd.Convolution) -> torch.Tensor:
        seen.add((conv.kernel[0], conv.kernel[1]))
        return rule_way(x, d, conv)

    def pick(x: torch.Tensor, d: torch.Tensor, conv: convolution_nd.Convolution) -> str:
        return COMPILED if conv.groups > 1 and convolution_nd.APPLIES[COMPILED](x, d, conv) else rule_pick(x, d, conv)

    monkeypatch.setitem(clipping_conv_ways.LIVE_TAP_WAYS, COMPILED, by_live_taps)
    monkeypatch.setattr(clipping_conv_ways, "fastest_grouped_way", lambda *args: COMPILED)
    monkeypatch.setitem(convolution_nd.WAYS, COMPILED, by_rule)
    monkeypatch.setattr(convolution_nd, "fastest_way", pick)
    monkeypatch.setattr(clipping_layers, "grouped_by_ghost_norm", lambda *args: False)  # (materialised: the kernel)
    if not keep:
        monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 0)
    torch.manual_seed(17)
    model, shape, kernels_grouped = {
        "DepthwiseBlocks": (DepthwiseBlocks(), (4, 5, 5), {(4, 1), (8, 4), (8, 1)}),
        "HeadsDepthwise": (HeadsDepthwise(), (4, 5, 5), {(4, 1)}),
        "GroupedTwice": (GroupedTwice(), (6, 4, 4), {(6, 3), (6, 2)}),
    }[model_class]
    x, y = torch.randn(6, *shape, generator=torch.Generator().manual_seed(18)), labels(6)
    reference, reference_norms = naive_clipped_sum_and_norms(copy.deepcopy(model).double(), x.double(), y, 0.05)
    sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.05)
    assert seen == kernels_grouped
    torch.testing.assert_close(norms.double(), reference_norms, rtol=1e-5, atol=0.0)
    for name, expected in reference.items():
        assert float((sums[name].double() - expected).norm() / expected.norm()) < 1e-5, name
    assert float((reference_norms > 0.05).double().mean()) > 0.75
    assert vmapped == []


def test_a_gpu_takes_the_patches_while_they_fit_its_keep_limit_and_else_the_weight_gradient() -> None:
    """Untimed on a GPU: the patches (the way it had) up to the keep limit's numbers, counted over the live taps
    only; beyond, the weight gradient, which holds no patches (ConvNeXt-T's first depthwise layer at batch 256)."""
    geometry: Geometry = ((7, 7), (1, 1), (3, 3), (1, 1))
    big, out = torch.Size((256, 96, 56, 56)), torch.Size((256, 96, 56, 56))
    patches = 256 * 96 * 49 * 56 * 56
    assert clipping_conv_ways.gpu_grouped_way(big, out, geometry, patches) == "patches"
    assert clipping_conv_ways.gpu_grouped_way(big, out, geometry, patches - 1) == "weight gradient"
    one = torch.Size((256, 96, 1, 1))  # on 1×1 maps one tap of 49 is live
    assert clipping_conv_ways.gpu_grouped_way(one, one, geometry, 256 * 96) == "patches"
    assert clipping_conv_ways.gpu_grouped_way(one, one, geometry, 256 * 96 - 1) == "weight gradient"


class GroupedTwice(nn.Module):
    """One grouped 3×3 layer (groups of 3 channels) called on a 1×1 map, where only its centre tap reads the input,
    then on a 4×4 map, where every tap does, and a ResNeXt-like stride-2 grouped layer from 2×2 to 1×1 (4 live
    taps of 9): an example's gradient of the shared layer is the sum over both calls."""

    def __init__(self) -> None:
        super().__init__()
        self.grouped = nn.Conv2d(6, 6, 3, padding=1, groups=2)
        self.down = nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=3)
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        point = torch.tanh(self.grouped(x.mean((2, 3), keepdim=True)))  # (B, 6, 1, 1)
        grid = torch.tanh(self.grouped(x))  # (B, 6, 4, 4)
        small = torch.tanh(self.down(torch.nn.functional.avg_pool2d(grid, 2)))  # (B, 6, 1, 1)
        return self.out(torch.cat([point.flatten(1), small.flatten(1)], 1))


@pytest.mark.parametrize("ghost", [True, False])
@pytest.mark.parametrize("model_class", [GroupedTwice, DepthwiseBlocks])
def test_a_grouped_layers_norm_by_its_groups_ghost_norm_or_its_live_taps_matches_the_naive_loop(
    ghost: bool, model_class: type[nn.Module], monkeypatch: pytest.MonkeyPatch, vmapped: list
) -> None:
    """Each grouped layer's norm by the ghost norm of its groups (its calls' positions joined, over the taps any call
    reads) or from its per-example gradients at those taps only (kept, their weighted sum placed in the kernel):
    clipped sums and norms equal the naive loop's either way, the way forced for every layer."""
    from dpml.train import clipping_layers

    taken: list[int] = []
    ghost_norms = clipping_layers.grouped_ghost_norms_squared

    def counted(*args: object) -> torch.Tensor:
        taken.append(1)
        return ghost_norms(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(clipping_layers, "grouped_ghost_norms_squared", counted)
    monkeypatch.setattr(clipping_layers, "grouped_by_ghost_norm", lambda *args: ghost)
    torch.manual_seed(15)
    model = model_class().double()
    shape = (6, 4, 4) if model_class is GroupedTwice else (4, 5, 5)
    x = torch.randn(6, *shape, generator=torch.Generator().manual_seed(16), dtype=torch.float64)
    assert_matches_naive_loop(model, x, labels(6), 0.05)
    grouped_layers = sum(isinstance(m, nn.Conv2d | nn.Conv1d) and m.groups > 1 for m in model.modules())
    assert len(taken) == (grouped_layers if ghost else 0)
    assert vmapped == []


class FunctionalGrouped(nn.Module):
    """Grouped kernels applied by the functional calls themselves, as weight-standardised networks do: a 1-D
    depthwise kernel with a channel multiplier over a sequence, and a 2-D one in 2 groups with a stride and a
    dilation, its kernel used a second time on another input."""

    def __init__(self) -> None:
        super().__init__()
        self.line = nn.Parameter(torch.randn(8, 1, 3) * 0.5)
        self.grid = nn.Parameter(torch.randn(6, 2, 3, 3) * 0.5)
        self.out = nn.Linear(8 + 6 + 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 4, 5, 5)
        line = torch.tanh(F.conv1d(x.flatten(2), self.line, padding=1, groups=4))  # (B, 8, 25)
        grid = torch.tanh(F.conv2d(x, self.grid, stride=2, dilation=2, padding=2, groups=2))  # (B, 6, 3, 3)
        again = torch.tanh(F.conv2d(x.flip(3), self.grid, padding=1, groups=2))  # (B, 6, 5, 5)
        return self.out(torch.cat([line.mean(2), grid.flatten(2).mean(2), again.flatten(2).mean(2)], 1))


@pytest.mark.parametrize("limit", [1 << 25, 0], ids=["kept", "beyond the keep limit"])
def test_functional_grouped_kernels_match_the_naive_loop_within_and_beyond_the_keep_limit(
    limit: int, monkeypatch: pytest.MonkeyPatch, vmapped: list
) -> None:
    """Within the keep limit the rule materialises the grouped kernels' per-example gradients at once; beyond it
    they are formed on demand, a slice of examples at a time, and the clipped sum is one weight gradient of the
    clip-weighted δ: the naive loop's clipped sums and norms either way, nothing on the exact path."""
    monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", limit)
    torch.manual_seed(19)
    model = FunctionalGrouped().double()
    x = torch.randn(6, 4, 5, 5, generator=torch.Generator().manual_seed(20), dtype=torch.float64)
    assert_matches_naive_loop(model, x, labels(6), 0.05)
    assert vmapped == []
