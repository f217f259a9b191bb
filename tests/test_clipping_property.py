"""Property test of the clipping engine on many generated modules.

Each seed builds a small random network from one of five families (vectors, images, volumes, sequences, tokens)
out of the layers a user might bring: Linear, Conv1d/Conv2d/Conv3d and the transposed ones (strides, padding,
dilation, output padding, groups),
Embedding (with padding), LayerNorm/GroupNorm (with and without affine), GRU/LSTM/RNN, attention,
weight_norm / spectral_norm / orthogonal parametrizations, a layer applied twice, a weight reused
through ``F.linear`` or tied to the output, frozen layers, a custom module with a raw parameter,
dropout and in-place activations. After the pre-flight probe plans the engine, its clipped sums and
norms on a fresh batch must equal a float64 per-example autograd loop, and with a batch of one the
contribution's norm never exceeds C (the sensitivity the accountant assumes)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from test_clipping_check import loop_clipped_sum
from torch import nn
from torch.nn.utils import parametrizations

from dpml.train.clipping import clipped_gradient_sum
from dpml.train.clipping_check import plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy

CLASSES = 4


class Scale(nn.Module):
    """A custom module: a raw per-feature parameter the engine has no shortcut for."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale


class Block(nn.Module):
    """One hidden step on (B, …, width) features, picked by ``kind``."""

    def __init__(self, kind: str, width: int, rng: random.Random) -> None:
        super().__init__()
        self.kind = kind
        self.inplace = rng.random() < 0.5
        if kind in ("linear", "twice", "functional_reuse", "frozen"):
            self.layer = nn.Linear(width, width, bias=rng.random() < 0.7)
            if kind == "frozen":
                self.layer.weight.requires_grad_(False)
        elif kind in ("weight_norm", "spectral_norm", "orthogonal"):
            self.layer = getattr(parametrizations, kind)(nn.Linear(width, width))
        elif kind == "layer_norm":
            self.layer = nn.LayerNorm(width, elementwise_affine=rng.random() < 0.8, bias=rng.random() < 0.7)
        elif kind == "scale":
            self.layer = Scale(width)
        elif kind == "dropout":
            self.layer = nn.Dropout(0.2)
        else:
            raise ValueError(kind)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.kind == "twice":
            return torch.tanh(self.layer(torch.tanh(self.layer(h))))
        if self.kind == "functional_reuse":
            return torch.tanh(self.layer(h)) + 0.5 * F.linear(h, self.layer.weight)
        out = self.layer(h)
        return F.relu(out, inplace=True) if self.kind == "linear" and self.inplace else torch.tanh(out)


BLOCKS = [
    "linear",
    "twice",
    "functional_reuse",
    "frozen",
    "weight_norm",
    "spectral_norm",
    "orthogonal",
    "layer_norm",
    "scale",
    "dropout",
]


class VectorNet(nn.Module):
    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.width = rng.choice([3, 5, 8])
        self.inp = nn.Linear(6, self.width)
        self.blocks = nn.Sequential(*[Block(rng.choice(BLOCKS), self.width, rng) for _ in range(rng.randint(1, 4))])
        self.tie_head = rng.random() < 0.3
        self.head = nn.Linear(self.width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(torch.tanh(self.inp(x)))
        if self.tie_head:  # the output also reads the input layer's weight (no module call)
            return self.head(h) + (h @ self.inp.weight)[:, :CLASSES].sum(1, keepdim=True)
        return self.head(h)


class ImageNet(nn.Module):
    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        channels = rng.choice([2, 4])
        groups = rng.choice([1, 2])
        self.conv = nn.Conv2d(
            2,
            channels,
            kernel_size=rng.choice([1, 2, 3]),
            stride=rng.choice([1, 2]),
            padding=rng.choice([0, 1]),
            dilation=rng.choice([1, 2]),
            bias=rng.random() < 0.7,
        )
        self.norm = nn.GroupNorm(groups, channels, affine=rng.random() < 0.8)
        self.grouped = nn.Conv2d(channels, channels, 3, padding=1, groups=rng.choice([1, 2]))
        self.repeat = rng.random() < 0.4
        self.head = nn.Linear(channels, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm(self.conv(x)), inplace=True)
        h = torch.tanh(self.grouped(h))
        if self.repeat:
            h = torch.tanh(self.grouped(h))
        return self.head(h.mean((2, 3)))


class SequenceNet(nn.Module):
    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        cell = rng.choice([nn.GRU, nn.LSTM, nn.RNN])
        self.bidirectional = rng.random() < 0.5
        self.rnn = cell(5, 4, num_layers=rng.choice([1, 2]), batch_first=True, bidirectional=self.bidirectional)
        width = 8 if self.bidirectional else 4
        self.conv = nn.Conv1d(5, 5, 3, padding=1) if rng.random() < 0.5 else None
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True) if rng.random() < 0.4 else None
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv is not None:
            x = torch.tanh(self.conv(x.transpose(1, 2))).transpose(1, 2)
        h = self.rnn(x)[0]
        if self.attention is not None:
            h = h + self.attention(h, h, h, need_weights=False)[0]
        return self.head(self.norm(h).mean(1))


class TokenNet(nn.Module):
    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 5, padding_idx=rng.choice([None, 0]))
        self.hidden = nn.Linear(5, 5)
        self.tied = rng.random() < 0.5
        self.head = nn.Linear(5, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.emb(tokens).mean(1)))
        if self.tied:  # output scores against the embedding table, first CLASSES rows
            return (h @ self.emb.weight.T)[:, :CLASSES] + self.head(h)
        return self.head(h)


class VolumeNet(nn.Module):
    """A 3-D convolution and a transposed one (3-D or 2-D over the depth's mean) of random geometry: kernel, stride,
    padding, dilation, output padding (below the stride or the dilation), groups, bias; the transposed one applied
    twice at random."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        channels = rng.choice([2, 4])
        self.conv = nn.Conv3d(
            2,
            channels,
            kernel_size=rng.choice([1, 2, (1, 3, 2)]),
            stride=rng.choice([1, 2, (1, 2, 1)]),
            padding=rng.choice([0, 1]),
            dilation=rng.choice([1, 2]),
            bias=rng.random() < 0.7,
        )
        self.flat = rng.random() < 0.4
        stride, dilation, kernel = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([1, 2, 3])
        transposed = nn.ConvTranspose2d if self.flat else nn.ConvTranspose3d
        self.up = transposed(
            channels,
            2,
            kernel_size=kernel,
            stride=stride,
            padding=rng.choice([0, 1]) if dilation * (kernel - 1) >= 2 else 0,  # (the output no smaller than the input)
            output_padding=rng.randrange(max(stride, dilation)),
            dilation=dilation,
            groups=rng.choice([1, 2]),
            bias=rng.random() < 0.7,
        )
        self.repeat = rng.random() < 0.4
        self.head = nn.Linear(2, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        h = h.mean(2) if self.flat else h
        out = torch.tanh(self.up(h))
        pooled = out.flatten(2).mean(2)
        if self.repeat:  # the kernel again, on its own output's first channels repeated
            again = torch.tanh(self.up(out.repeat(1, h.shape[1] // 2, *(1,) * (out.dim() - 2))))
            pooled = pooled + again.flatten(2).mean(2)
        return self.head(pooled)


FAMILIES = {
    "vector": (VectorNet, (6,), torch.float64),
    "volume": (VolumeNet, (2, 4, 5, 5), torch.float64),
    "image": (ImageNet, (2, 6, 6), torch.float64),
    "sequence": (SequenceNet, (4, 5), torch.float64),
    "tokens": (TokenNet, (6,), torch.long),
}


def batch(family: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, shape, dtype = FAMILIES[family]
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.long:
        x = torch.randint(0, 7, (n, *shape), generator=generator)
    else:
        x = 2 * torch.randn((n, *shape), generator=generator, dtype=dtype)
    return x, torch.randint(0, CLASSES, (n,), generator=generator)


def generated(family: str, name: str, seed: int) -> tuple[nn.Module, frozenset[str], dict[str, torch.Tensor]]:
    """The network of ``family`` drawn from ``name``, the probe's exact set and its starting buffers."""
    torch.manual_seed(seed)
    cls, shape, dtype = FAMILIES[family]
    model = cls(random.Random(name)).double().train()
    buffers = {key: b.clone() for key, b in model.named_buffers()}
    return model, plan_clipping(model, per_example_cross_entropy, shape, dtype).exact, buffers


def restore(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generated_modules_match_a_per_example_loop(family: str, seed: int) -> None:
    model, exact, buffers = generated(family, f"{family}-{seed}", seed)
    x, y = batch(family, 9, 100 + seed)
    restore(model, buffers)
    clip = float(loop_clipped_sum(model, x, y, 1.0, seed)[1].median())
    restore(model, buffers)
    reference, norms = loop_clipped_sum(model, x, y, clip, seed)
    restore(model, buffers)
    torch.manual_seed(seed)
    sums, found_norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, clip, exact=exact)
    assert set(sums) == set(reference)
    for name in reference:
        torch.testing.assert_close(sums[name], reference[name], rtol=1e-8, atol=1e-12, msg=f"{family} {seed} {name}")
    torch.testing.assert_close(found_norms, norms, rtol=1e-8, atol=1e-12)
    assert float((norms > clip).double().mean()) > 0.3  # clipping is exercised


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_example_contributes_at_most_c(family: str, seed: int) -> None:
    model, exact, _ = generated(family, f"one-{family}-{seed}", seed)
    x, y = batch(family, 4, 200 + seed)
    clip = 0.05
    for i in range(x.shape[0]):
        sums, norms = clipped_gradient_sum(
            model, per_example_cross_entropy, x[i : i + 1], y[i : i + 1], clip, exact=exact
        )
        contribution = torch.sqrt(sum(s.pow(2).sum() for s in sums.values()))
        assert float(contribution) <= clip
        norm = float(norms[0])
        if norm > clip:  # clipped to C·‖g‖/(‖g‖ + 1e-6)
            assert float(contribution) == pytest.approx(clip * norm / (norm + 1e-6), rel=1e-9)


class LastStage(nn.Module):
    """A residual network's last convolutions on small images: outputs of 1×1 or 2×2 positions (at one position
    the clipped sum comes, on a CPU, from one product over the kernel taps that read the input, not from the
    weight-gradient convolution: ``clipping_conv.clip_weighted_conv_weight``; 1×1 maps under a 3×3 kernel,
    dilated or not, leave most taps on padding)."""

    def __init__(self, stride: int, dilation: int, bias: bool) -> None:
        super().__init__()
        self.down = nn.Conv2d(3, 6, 3, stride=stride, padding=1, dilation=dilation, bias=bias)
        self.conv = nn.Conv2d(6, 6, 3, padding=1, bias=bias)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.down(x))
        return self.head(torch.tanh(self.conv(h) + h).mean((2, 3)))


@pytest.mark.parametrize(
    ("size", "stride", "dilation", "bias"),
    [(1, 1, 1, True), (2, 1, 1, False), (2, 2, 1, True), (4, 2, 1, True), (3, 2, 2, False), (5, 1, 1, True)],
)
def test_convolutions_with_few_output_positions_match_a_per_example_loop(
    size: int, stride: int, dilation: int, bias: bool
) -> None:
    torch.manual_seed(size * 10 + stride)
    model = LastStage(stride, dilation, bias).double().train()
    exact = plan_clipping(model, per_example_cross_entropy, (3, size, size), torch.float64).exact
    assert not exact
    generator = torch.Generator().manual_seed(size)
    x = 2 * torch.randn((9, 3, size, size), generator=generator, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (9,), generator=generator)
    clip = float(loop_clipped_sum(model, x, y, 1.0, 0)[1].median())
    reference, norms = loop_clipped_sum(model, x, y, clip, 0)
    sums, found_norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, clip, exact=exact)
    assert set(sums) == set(reference)
    for name in reference:
        torch.testing.assert_close(sums[name], reference[name], rtol=1e-8, atol=1e-12, msg=name)
    torch.testing.assert_close(found_norms, norms, rtol=1e-8, atol=1e-12)
    assert float((norms > clip).double().mean()) > 0.3  # clipping is exercised
