"""Rules for torch's own layers that no hook covers: ``nn.Bilinear``, ``nn.PReLU`` (a slope per channel or one for
all), ``nn.RMSNorm`` and ``nn.InstanceNorm1d(affine=True)``: clipped sums and norms equal a float64 per-example
autograd loop, and none of their parameters takes the exact path."""

from __future__ import annotations

import torch
from test_op_rules import assert_exact_without_the_exact_path, generator
from torch import nn

from dpml.train.dpsgd import per_example_cross_entropy


class TorchLayers(nn.Module):
    """x (B, T, 6): a bilinear form of the sequence and its tanh, PReLU per channel (on (B, C, T)) and shared, an
    RMSNorm, and an affine instance norm over the positions, each feeding the classifier directly (an instance norm's
    x̂ has mean 0 over the positions, so it is pooled after a nonlinearity)."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.bilinear = nn.Bilinear(width, width, 4)
        self.channel_slopes = nn.PReLU(width, init=0.3)
        self.one_slope = nn.PReLU(init=0.2)
        self.rms = nn.RMSNorm(width)
        self.instance = nn.InstanceNorm1d(width, affine=True)
        self.out = nn.Linear(4 + 3 * width, 3)
        with torch.no_grad():  # away from the initial 1 and 0, so that a wrong x̂ or slope would show
            for p in (self.rms.weight, self.instance.weight, self.instance.bias):
                p.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.transpose(1, 2)  # (B, C, T)
        parts = [
            self.bilinear(x, torch.tanh(x)).mean(1),
            self.one_slope(self.channel_slopes(channels - 0.2)).mean(2),
            self.rms(x * 3.0).mean(1),
            torch.tanh(self.instance(channels)).mean(2),
        ]
        return self.out(torch.tanh(torch.cat(parts, 1)))


def test_torch_layers_without_a_hook_are_exact_without_the_exact_path() -> None:
    torch.manual_seed(12)
    x = torch.randn(6, 5, 6, generator=generator(27), dtype=torch.float64)
    assert_exact_without_the_exact_path(TorchLayers(), per_example_cross_entropy, x, torch.randint(0, 3, (6,)))
