"""Pointwise convolutions (a kernel of one tap, no padding, one group: a Linear at each position, the 1×1 layers of
ResNet-50's bottlenecks, MobileNet's and EfficientNet's expansions, ConvNeXt's MLP) take a Linear's piece on their
rows where that is the faster way, the convolution's own piece elsewhere; both match the float64 naive loop."""

from __future__ import annotations

import copy

import pytest
import torch
from test_clipping_layers import compiled_kernel, labels, laid_out
from test_dpsgd import naive_clipped_sum_and_norms
from torch import nn

from dpml.train import clipping_conv, clipping_conv_ways, clipping_layers, keep_budget
from dpml.train.clipping import clipped_gradient_sum
from dpml.train.dpsgd import per_example_cross_entropy


class Pointwise(nn.Module):
    """1×1 layers of every kind the rows take: stride 1, stride 2 (a ResNet shortcut), a dilation (no effect at one
    tap), a Conv1d of kernel 1 over the flattened map, one called twice, and a 3×3 and a padded 1×1 (not pointwise)."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.expand = nn.Conv2d(channels, 24, 1)
        self.shrink = nn.Conv2d(24, channels, 1, stride=2, dilation=3)
        self.padded = nn.Conv2d(channels, channels, 1, padding=1)
        self.twice = nn.Conv2d(channels, channels, 1, bias=False)
        self.line = nn.Conv1d(channels, 5, 1)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.stem(x))
        x = self.shrink(torch.tanh(self.expand(x)))
        x = self.twice(torch.tanh(self.twice(torch.tanh(self.padded(x)))))
        return self.head(self.line(x.flatten(2)).mean(2))


def test_which_layers_are_pointwise() -> None:
    model = Pointwise()
    pointwise = {name for name, m in model.named_modules() if clipping_conv_ways.is_pointwise(m)}
    assert pointwise == {"expand", "shrink", "twice", "line"}
    assert not clipping_conv_ways.is_pointwise(nn.Conv2d(4, 4, 1, groups=2))
    assert clipping_conv_ways.is_pointwise(nn.Conv2d(4, 4, 1, padding="same"))


def test_a_pointwise_layers_rows_are_its_input_at_the_strided_positions() -> None:
    """The rows of a strided 1×1 layer are the input at its output positions, and δ's: Σ_t δ_t a_tᵀ over them is
    autograd's weight gradient of each example."""
    layer = nn.Conv2d(6, 4, 1, stride=(2, 3)).double()
    x = torch.randn(3, 6, 7, 8, dtype=torch.float64)
    delta = torch.randn(layer(x).shape, dtype=torch.float64)
    a, d = clipping_conv_ways.pointwise_rows(layer, x, delta)
    assert a.shape == (3, 4 * 3, 6) and d.shape == (3, 4 * 3, 4)
    expected = torch.stack(
        [torch.autograd.grad((layer(x[i : i + 1]) * delta[i : i + 1]).sum(), layer.weight)[0] for i in range(3)]
    )
    torch.testing.assert_close(torch.bmm(d.transpose(1, 2), a), expected.flatten(1).reshape(3, 4, 6))


@pytest.mark.parametrize("layout", ["contiguous", "channels last"])
@pytest.mark.parametrize("keep", [True, False])
def test_a_network_of_pointwise_layers_matches_the_naive_loop(
    keep: bool, layout: str, monkeypatch: pytest.MonkeyPatch, vmapped: list
) -> None:
    """Every piece in float64 (the rows for the pointwise layers, the convolution's own for the others), with the
    per-example gradients kept and with nothing kept (ghost norms on the rows), NCHW and channels last."""
    if not keep:
        monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 0)
    rows: list[str] = []
    piece = clipping_layers._dense_piece

    def spy(module: nn.Module, a: torch.Tensor, d: torch.Tensor):  # type: ignore[no-untyped-def]
        rows.append(type(module).__name__ + str(tuple(module.weight.shape)))
        return piece(module, a, d)  # type: ignore[arg-type]

    monkeypatch.setattr(clipping_layers, "_dense_piece", spy)
    torch.manual_seed(3)
    model = Pointwise().double()
    x = torch.randn(5, 3, 6, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    if layout == "channels last":
        model, x = model.to(memory_format=torch.channels_last), laid_out(x, "channels last")
    sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, labels(5), 0.05)
    pointwise = ["Conv2d(24, 16, 1, 1)", "Conv2d(16, 24, 1, 1)", "Conv2d(16, 16, 1, 1)", "Conv1d(5, 16, 1)"]
    assert sorted(rows) == sorted([*pointwise, "Linear(3, 5)"])
    reference, reference_norms = naive_clipped_sum_and_norms(model, x, labels(5), 0.05)
    torch.testing.assert_close(norms, reference_norms, rtol=1e-10, atol=1e-12)
    for name, expected in reference.items():
        torch.testing.assert_close(sums[name], expected, rtol=1e-10, atol=1e-12, msg=name)
    assert float((reference_norms > 0.05).double().mean()) > 0.75
    assert vmapped == []


@pytest.mark.parametrize("way", ["rows", "compiled kernel"])
def test_float32_pointwise_layers_by_either_way_match_the_float64_loop(
    way: str, tmp_path, monkeypatch: pytest.MonkeyPatch, vmapped: list
) -> None:  # type: ignore[no-untyped-def]
    """In float32 on a CPU the faster of the rows and the compiled kernel forms a pointwise layer's per-example
    gradients: with either picked, the norms and sums equal the float64 naive loop's to float32 rounding, and the
    layers the pick covers (the materialised 1×1 Conv2d layers called once) take the way picked."""
    kernel = compiled_kernel(tmp_path)
    monkeypatch.setattr(clipping_conv, "compiled_conv_norms", lambda: kernel)
    picked: list[str] = []

    def pick(inputs: torch.Tensor, output_grad: torch.Tensor, geometry) -> str:  # type: ignore[no-untyped-def]
        picked.append(way)
        return way

    monkeypatch.setattr(clipping_conv_ways, "fastest_pointwise_way", pick)
    conv_pieces: list[tuple[int, ...]] = []
    conv_piece = clipping_layers._conv_piece

    def spy(module: nn.Conv2d, inputs: torch.Tensor, output_grad: torch.Tensor):  # type: ignore[no-untyped-def]
        conv_pieces.append(tuple(module.weight.shape))
        return conv_piece(module, inputs, output_grad)

    monkeypatch.setattr(clipping_layers, "_conv_piece", spy)
    torch.manual_seed(5)
    model = Pointwise()
    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(6))
    reference, reference_norms = naive_clipped_sum_and_norms(copy.deepcopy(model).double(), x.double(), labels(6), 0.05)
    sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, labels(6), 0.05)
    assert picked == [way, way]  # expand and shrink; twice is called twice (rows), padded is no pointwise layer
    pointwise = {(24, 16, 1, 1), (16, 24, 1, 1)}
    assert pointwise.isdisjoint(conv_pieces) if way == "rows" else pointwise <= set(conv_pieces)
    torch.testing.assert_close(norms.double(), reference_norms, rtol=1e-5, atol=0.0)
    for name, expected in reference.items():
        assert float((sums[name].double() - expected).norm() / expected.norm()) < 1e-5, name
    assert vmapped == []


def test_the_faster_pointwise_way_is_timed_once_per_shape_and_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pick is one of the two ways, timed on a shape's first call only, again for another layout or batch size
    class, and the same for a batch size of the same class."""
    if clipping_conv.compiled_conv_norms() is None:
        pytest.skip("no C compiler here: the pointwise layers take their rows (tested above)")
    monkeypatch.setattr(clipping_conv_ways, "_FASTEST_POINTWISE", {})
    timed: list[int] = []
    bmm = torch.bmm

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        timed.append(1)
        return bmm(*args, **kwargs)

    monkeypatch.setattr(torch, "bmm", counted)
    geometry = ((1, 1), (1, 1), (0, 0), (1, 1))
    x, d = torch.randn(6, 16, 5, 5), torch.randn(6, 8, 5, 5)
    first = clipping_conv_ways.fastest_pointwise_way(x, d, geometry)
    assert first in {"rows", "compiled kernel"} and timed
    runs = len(timed)
    assert clipping_conv_ways.fastest_pointwise_way(x[:5], d[:5], geometry) == first and len(timed) == runs
    clipping_conv_ways.fastest_pointwise_way(laid_out(x, "channels last"), laid_out(d, "channels last"), geometry)
    clipping_conv_ways.fastest_pointwise_way(x[:3], d[:3], geometry)
    assert len(timed) == 3 * runs


def test_where_a_float32_pointwise_layer_takes_its_rows_on_a_cpu(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Float32 on a CPU: the rows at one position; the convolution's own piece where it is ghost-normed at several
    positions; the timed pick where its gradients are materialised. Float64 (no compiled kernel): the rows."""
    kernel = compiled_kernel(tmp_path)
    monkeypatch.setattr(clipping_conv, "compiled_conv_norms", lambda: kernel)
    picks: list[str] = []
    monkeypatch.setattr(clipping_conv_ways, "fastest_pointwise_way", lambda *args: picks[-1])
    layer, limit = nn.Conv2d(64, 256, 1), 1 << 25

    def by_rows(size: int, dtype: torch.dtype = torch.float32) -> bool:
        x, d = torch.zeros(8, 64, size, size, dtype=dtype), torch.zeros(8, 256, size, size, dtype=dtype)
        return clipping_conv_ways.pointwise_by_rows(layer, x, d, limit)

    assert clipping_conv_ways.materialise(8, 64, 64, 256, limit) and not clipping_conv_ways.materialise(
        8, 4, 64, 256, limit
    )
    assert by_rows(1) and not by_rows(2)
    for pick in ("rows", "compiled kernel"):
        picks.append(pick)
        assert by_rows(8) == (pick == "rows")
    assert by_rows(2, torch.float64) and by_rows(8, torch.float64)
    assert not clipping_conv_ways.pointwise_by_rows(
        nn.Conv2d(64, 256, 3), torch.zeros(8, 64, 8, 8), torch.zeros(8, 256, 6, 6), limit
    )
