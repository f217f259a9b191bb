"""3-D and transposed convolutions (``nn.Conv3d``, ``nn.ConvTranspose1d/2d/3d`` and their functional forms) take the
convolution rules, not the exact path: clipped sums and norms equal a float64 per-example autograd loop, over strides,
paddings (``"same"`` too), dilations, output paddings, groups, a kernel used twice, images grouped by example, and
transformers' DPT, whose neck upsamples by transposed convolutions."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from test_op_rules import ConvolutionTwice, assert_exact_without_the_exact_path, generator, loop_reference
from torch import nn

from dpml.train import kernels
from dpml.train.clipping import clipped_gradient_sum, engine_pass
from dpml.train.dpsgd import per_example_cross_entropy
from dpml.train.rules import combine, convolution_nd
from dpml.train.rules.convolution_nd import APPLIES, WAYS, patches


class Volumes(nn.Module):
    """A 3-D convolution with a stride and padding, a grouped one with ``padding="same"`` and a dilation, a grouped
    transposed one with a bias (stride 2), and the first kernel again through ``F.conv3d`` (stride 2, no bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1, stride=(1, 2, 2))
        self.grouped = nn.Conv3d(4, 4, (1, 3, 3), padding="same", dilation=(1, 2, 1), groups=2, bias=False)
        self.up = nn.ConvTranspose3d(4, 2, 2, stride=2, groups=2)
        self.out = nn.Linear(2 * 8 * 6 * 6 + 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 2, 4, 6, 6)
        h = torch.tanh(self.conv(x))  # (B, 4, 4, 3, 3)
        h = torch.tanh(self.grouped(h))
        up = torch.tanh(self.up(h))  # (B, 2, 8, 6, 6)
        again = F.conv3d(x[:, :, :, :4, :4], self.conv.weight, stride=2)  # (B, 4, 1, 1, 1)
        return self.out(torch.cat([up.flatten(1), again.flatten(1)], 1))


class Decoder(nn.Module):
    """Transposed convolutions: 2-D with stride 2, padding and an output padding (U-Net's upsampling), the same kernel
    again through ``F.conv_transpose2d`` without its bias, 1-D with a dilation and an output padding below it (the
    adjoint convolution of δ has one position more than the input), and 2-D on each example's channels split into
    two images, (2B, C/2, H, W): example by example, or (``head_major``) every example's first image, then every
    example's second."""

    def __init__(self, head_major: bool = False) -> None:
        super().__init__()
        self.head_major = head_major
        self.up = nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1)
        self.line = nn.ConvTranspose1d(4, 2, 3, dilation=2, output_padding=1)
        self.halves = nn.ConvTranspose2d(2, 3, 2, stride=2)
        self.out = nn.Linear(2 * 11 + 4 * 7 * 7 + 2 * 3 * 12 * 12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 3, 3, 3)
        batch = x.shape[0]
        h = torch.tanh(self.up(x))  # (B, 4, 6, 6)
        twice = F.conv_transpose2d(torch.tanh(x), self.up.weight, stride=2)  # (B, 4, 7, 7)
        line = torch.tanh(self.line(h.mean(3)))  # (B, 2, 6 + 4 + 1)
        images = h.reshape(batch, 2, 2, 6, 6)
        images = images.transpose(0, 1) if self.head_major else images
        halves = torch.tanh(self.halves(images.reshape(2 * batch, 2, 6, 6)))  # (2B, 3, 12, 12)
        halves = halves.reshape(2, batch, -1).transpose(0, 1) if self.head_major else halves
        return self.out(torch.cat([line.flatten(1), twice.flatten(1), halves.reshape(batch, -1)], 1))


@pytest.mark.parametrize(
    ("model", "shape"),
    [(Volumes, (2, 4, 6, 6)), (Decoder, (3, 3, 3)), (lambda: Decoder(head_major=True), (3, 3, 3))],
    ids=["volumes", "transposed", "transposed-head-major"],
)
def test_three_dimensional_and_transposed_convolutions_clip_like_the_loop(
    model: Callable[[], nn.Module], shape: tuple[int, ...]
) -> None:
    torch.manual_seed(3)
    x = torch.randn(5, *shape, generator=generator(4), dtype=torch.float64)
    assert_exact_without_the_exact_path(model(), per_example_cross_entropy, x, torch.randint(0, 3, (5,)))


def test_patches_are_unfold_in_two_dimensions_and_the_convolution_in_three() -> None:
    """P(x) is ``F.unfold``'s layout in 2-D, and W P(x) is ``F.conv3d`` in 3-D (stride, padding, dilation)."""
    x = torch.randn(2, 3, 7, 6, generator=generator(1), dtype=torch.float64)
    geometry = ((2, 3), (2, 1), (1, 2), (2, 1))
    expected = F.unfold(x, geometry[0], dilation=geometry[3], padding=geometry[2], stride=geometry[1])
    torch.testing.assert_close(patches(x, *geometry, (4, 8)), expected, rtol=0, atol=0)
    volume = torch.randn(2, 3, 5, 6, 4, generator=generator(2), dtype=torch.float64)
    weight = torch.randn(4, 3, 2, 3, 2, generator=generator(3), dtype=torch.float64)
    z = F.conv3d(volume, weight, stride=(1, 2, 1), padding=(1, 0, 1), dilation=(2, 1, 1))
    found = weight.reshape(4, -1) @ patches(volume, (2, 3, 2), (1, 2, 1), (1, 0, 1), (2, 1, 1), tuple(z.shape[2:]))
    torch.testing.assert_close(found.reshape(z.shape), z)


def in_twos(count: int) -> list[slice]:
    return [slice(start, min(count, start + 2)) for start in range(0, count, 2)]


@pytest.mark.parametrize("way", [name for name in WAYS if name not in APPLIES] + ["factored"])
@pytest.mark.parametrize("limit", [1 << 25, 40], ids=["kept", "sliced"])
def test_every_way_to_the_kernels_gradients_clips_like_the_loop(
    monkeypatch: pytest.MonkeyPatch, way: str, limit: int
) -> None:
    """Each way that takes every call to a kernel's per-example gradients, 1-, 2- and 3-D, transposed or not
    (torch's grouped weight gradient, one per image, the patches; or the factored form where a ghost norm is
    cheaper), kept or (past the keep limit) formed a slice of two examples at a time with the clipped sum left to
    the weight gradient of the clip-weighted δ: the same numbers as the loop."""
    monkeypatch.setattr("dpml.train.keep_budget.KEEP_PER_EXAMPLE_LIMIT", limit)
    monkeypatch.setattr(combine, "heap_sized_slices", lambda count, each, device: in_twos(count))
    if way == "factored":
        monkeypatch.setattr(convolution_nd, "materialise", lambda *args: False)
    else:
        monkeypatch.setattr(convolution_nd, "fastest_way", lambda x, d, conv: way)
    torch.manual_seed(3)
    x = torch.randn(5, 3, 3, 3, generator=generator(4), dtype=torch.float64)
    for head_major in (False, True):
        decoder = Decoder(head_major)
        assert_exact_without_the_exact_path(decoder, per_example_cross_entropy, x, torch.randint(0, 3, (5,)))
    torch.manual_seed(3)
    volumes = torch.randn(5, 2, 4, 6, 6, generator=generator(5), dtype=torch.float64)
    assert_exact_without_the_exact_path(Volumes(), per_example_cross_entropy, volumes, torch.randint(0, 3, (5,)))
    torch.manual_seed(9)  # a 2-D and a 1-D kernel used by their layers and by functional calls (the 1-D/2-D rule)
    images = torch.randn(5, 2, 6, 6, generator=generator(12), dtype=torch.float64)
    assert_exact_without_the_exact_path(
        ConvolutionTwice(), per_example_cross_entropy, images, torch.randint(0, 3, (5,))
    )


class DepthClasses(nn.Module):
    """transformers' DPT depth estimator (its neck upsamples ViT features by transposed convolutions, factors 4 and 2),
    the predicted depth map's mean scored into three classes."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers", reason="transformers is not installed")
        config = transformers.DPTConfig(
            hidden_size=16,
            num_hidden_layers=4,
            num_attention_heads=2,
            intermediate_size=32,
            image_size=16,
            patch_size=4,
            backbone_out_indices=[0, 1, 2, 3],
            neck_hidden_sizes=[4, 4, 4, 4],
            fusion_hidden_size=4,
            reassemble_factors=[4, 2, 1, 0.5],
            head_in_index=-1,
        )
        self.model = transformers.DPTForDepthEstimation(config)
        self.out = nn.Linear(1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.model(pixel_values=x).predicted_depth.mean((1, 2))[:, None])


def test_a_library_model_that_upsamples_by_transposed_convolutions() -> None:
    torch.manual_seed(8)
    model = DepthClasses()
    assert sum(isinstance(m, nn.ConvTranspose2d) for m in model.modules()) == 2
    x = torch.randn(4, 3, 16, 16, generator=generator(13), dtype=torch.float64)
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, torch.randint(0, 3, (4,)), tolerance=1e-9)


class StandardisedFloat32(nn.Module):
    """Functional 2-D convolutions in float32, as weight-standardised networks write them: a standardised kernel over
    16 input channels (stride 1, padding 1), a grouped one (4 groups of 4 channels, as NFNet's and RegNet's), a
    strided and dilated one with a bias, and the first kernel used again raw (stride 2) where ``twice``: the rule's
    per-example kernel gradients, formed on demand (the grouped kernel's where they do not fit the keep limit)."""

    def __init__(self, twice: bool) -> None:
        super().__init__()
        self.twice = twice
        self.first = nn.Parameter(torch.randn(16, 16, 3, 3) * 0.3)
        self.grouped = nn.Parameter(torch.randn(16, 4, 3, 3) * 0.5)
        self.second = nn.Parameter(torch.randn(8, 16, 3, 2) * 0.3)
        self.bias = nn.Parameter(torch.randn(8) * 0.1)
        self.out = nn.Linear(8 * 2 * 2 + 16 * 2 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 16, 6, 6)
        w = self.first - self.first.mean((1, 2, 3), keepdim=True)
        w = w / (w.var((1, 2, 3), keepdim=True, unbiased=False) + 1e-5).sqrt()
        h = torch.tanh(F.conv2d(x, w, padding=1))  # (B, 16, 6, 6)
        h = torch.tanh(F.conv2d(h, self.grouped, padding=1, groups=4))
        g = torch.tanh(F.conv2d(h, self.second, self.bias, stride=2, dilation=(1, 2)))  # (B, 8, 2, 2)
        again = F.conv2d(h, self.first if self.twice else self.first.detach(), stride=2)  # (B, 16, 2, 2)
        return self.out(torch.cat([g.flatten(1), again.flatten(1)], 1))


@pytest.mark.parametrize("limit", [1 << 25, 40], ids=["kept", "sliced"])
def test_the_compiled_kernel_forms_functional_convolutions_gradients_in_float32(
    monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    """The compiled kernel as a way to a functional 2-D convolution's per-example kernel gradients (float32 on a CPU,
    one group, not transposed: there it is timed with torch's ways), for a standardised kernel, a strided and
    dilated one, kept (with the first kernel used twice) or formed two examples at a time (a kernel used twice has
    its uses' gradients kept, or takes the exact path): the float64 loop's clipped sums and norms within float32
    rounding, the kernel taken for every such call; float64 calls are left to torch's ways."""
    if kernels.c_compiler() is None:
        pytest.skip("no C compiler here: the compiled convolution kernel is not built (torch's ways are tested)")
    assert kernels.compiled_conv_norms() is not None, "the C compiler failed on _conv_norms.c, or it did not load"
    monkeypatch.setattr("dpml.train.keep_budget.KEEP_PER_EXAMPLE_LIMIT", limit)
    monkeypatch.setattr(combine, "heap_sized_slices", lambda count, each, device: in_twos(count))
    monkeypatch.setattr(convolution_nd, "materialise", lambda *args: True)  # formed on demand, never factored
    calls = {"compiled": 0, "float64": 0}
    kernel_way = WAYS["compiled kernel"]

    def compiled(x: torch.Tensor, d: torch.Tensor, conv: convolution_nd.Convolution) -> torch.Tensor:
        calls["compiled"] += 1
        return kernel_way(x, d, conv)

    def chosen(x: torch.Tensor, d: torch.Tensor, conv: convolution_nd.Convolution) -> str:
        if x.dtype == torch.float64:
            calls["float64"] += 1
            assert not APPLIES["compiled kernel"](x, d, conv)
            return "patches"
        assert APPLIES["compiled kernel"](x, d, conv)
        return "compiled kernel"

    monkeypatch.setitem(WAYS, "compiled kernel", compiled)
    monkeypatch.setattr(convolution_nd, "fastest_way", chosen)
    torch.manual_seed(5)
    model = StandardisedFloat32(twice=limit > 40)
    x, y = torch.randn(5, 16, 6, 6, generator=generator(6)), torch.randint(0, 3, (5,), generator=generator(7))
    reference, norms = loop_reference(copy.deepcopy(model).double(), per_example_cross_entropy, x.double(), y, 1.0, 0)
    clip = float(norms.median())
    reference, norms = loop_reference(copy.deepcopy(model).double(), per_example_cross_entropy, x.double(), y, clip, 0)
    found = engine_pass(model, per_example_cross_entropy, x, y)
    assert found.exact == {}, found.reasons
    sums, found_norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, clip)
    assert calls["compiled"] >= 4 and calls["float64"] == 0, calls  # (two kernels' uses or three, two passes)
    torch.testing.assert_close(found_norms.double(), norms, rtol=2e-5, atol=0)
    for name, expected in reference.items():
        error = float((sums[name].double() - expected).norm() / expected.norm())
        assert error < 2e-5, (name, error)
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x.double(), y)  # (float64: torch's ways)
    assert calls["float64"] > 0
