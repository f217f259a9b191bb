"""Normalisation layers whose input is not batch-first but holds whole examples' slices along its first dimension:
a GroupNorm on tokens flattened to (B·N, C) (LeViT's ``LinearNorm`` with its BatchNorm1d made a GroupNorm, as a
user making a model private does), GroupNorm and InstanceNorm on each example's k maps merged into (B·k, C, H, W)
example-major or head-major, and RMSNorm on flattened and reordered rows. Each parameter's per-example gradient is
the sum over that example's slices; clipped sums and norms equal a float64 per-example loop, with nothing on the
exact path. Before, these layers' parameters took the exact path (LeViT-128S: 18 of them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_op_rules import assert_exact_without_the_exact_path, generator
from torch import nn

from dpml.train.dpsgd import per_example_cross_entropy


class TokenGroupNorm(nn.Module):
    """LeViT's ``LinearNorm`` (a linear layer, then a norm on the tokens flattened to (B·N, C), reshaped back), with a
    GroupNorm in two groups, then a functional group norm of its own weight and bias on the tokens reordered."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width, bias=False)
        self.norm = nn.GroupNorm(2, width)
        self.gamma = nn.Parameter(1 + 0.3 * torch.randn(width))
        self.beta = nn.Parameter(0.3 * torch.randn(width))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, N, C)
        h = self.linear(x)
        h = self.norm(h.flatten(0, 1)).reshape_as(h)
        tokens = torch.tanh(h).transpose(0, 1).reshape(-1, h.shape[-1])  # (N·B, C): token-major rows
        normed = F.group_norm(tokens, 3, self.gamma, self.beta)
        return self.out(normed.reshape(h.shape[1], h.shape[0], -1).transpose(0, 1).mean(1))


class MergedMapsNorm(nn.Module):
    """Each example's k maps merged into the first dimension ((B·k, C, H, W), example-major or head-major) through a
    GroupNorm or an affine InstanceNorm, then split back: each example's gradient of the norm's γ and β adds up over
    its k maps (maps of 32 positions or more, where a batch-first input would take the folded GroupNorm kernel)."""

    def __init__(self, kind: str, head_major: bool, channels: int = 4) -> None:
        super().__init__()
        self.head_major = head_major
        self.norm = nn.GroupNorm(2, channels) if kind == "group" else nn.InstanceNorm2d(channels, affine=True)
        with torch.no_grad():
            self.norm.weight.add_(0.3 * torch.randn(channels))
            self.norm.bias.add_(0.3 * torch.randn(channels))
        self.out = nn.Linear(channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, k, C, H, W)
        batch, k = x.shape[:2]
        merged = (x.transpose(0, 1) if self.head_major else x).reshape(batch * k, *x.shape[2:])
        h = torch.tanh(self.norm(merged * 1.5))
        h = h.reshape(k, batch, *x.shape[2:]).transpose(0, 1) if self.head_major else h.reshape(x.shape)
        return self.out((h * x).mean((1, 3, 4)))


class RowsRMSNorm(nn.Module):
    """``nn.RMSNorm`` on the batch's rows flattened to (B·T, d), then ``F.rms_norm`` of its own weight on the rows
    in an order that is not the batch's (a permutation of the tokens, as a mixture of experts sorts them)."""

    def __init__(self, width: int = 5) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(width)
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(width))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, d)
        rows = self.norm(x.reshape(-1, x.shape[-1]))
        order = torch.arange(rows.shape[0]).flip(0)
        moved = F.rms_norm(torch.tanh(rows).index_select(0, order), (x.shape[-1],), self.weight)
        back = moved.index_select(0, order).reshape(x.shape)
        return self.out(back.mean(1))


def test_group_norms_on_flattened_and_reordered_tokens() -> None:
    torch.manual_seed(41)
    x, y = torch.randn(5, 4, 6, generator=generator(41), dtype=torch.float64), torch.randint(0, 3, (5,))
    assert_exact_without_the_exact_path(TokenGroupNorm(), per_example_cross_entropy, x, y)


@pytest.mark.parametrize("kind", ["group", "instance"])
@pytest.mark.parametrize("head_major", [False, True], ids=["example-major", "head-major"])
def test_norms_on_each_examples_maps_merged_into_the_first_dimension(kind: str, head_major: bool) -> None:
    torch.manual_seed(42)
    x = torch.randn(4, 3, 4, 6, 6, generator=generator(42), dtype=torch.float64)  # 36 positions: ATen's folded kernel
    y = torch.randint(0, 3, (4,))
    assert_exact_without_the_exact_path(MergedMapsNorm(kind, head_major), per_example_cross_entropy, x, y)


def test_rms_norms_on_flattened_and_reordered_rows() -> None:
    torch.manual_seed(43)
    x, y = torch.randn(5, 4, 5, generator=generator(43), dtype=torch.float64), torch.randint(0, 3, (5,))
    assert_exact_without_the_exact_path(RowsRMSNorm(), per_example_cross_entropy, x, y)
