"""Per-head parameters met by activations whose examples are not along the first dimension: products written heads
first (``torch.baddbmm`` with a bias per head, as RecurrentGemma's gates; ``torch.bmm``, ``Tensor.baddbmm`` and
``torch.addbmm``, the parameter on either side, the examples' rows in one run along dimension 1), and a time-major
activation against per-head matrices (``i b h d, h d e → i b h e``), and parameters concatenated to time-major
activations along their time (``nn.MultiheadAttention``'s ``add_bias_kv``). Clipped sums and norms equal a float64
per-example loop, and nothing takes the exact path."""

from __future__ import annotations

import pytest
import torch
from test_op_rules import assert_exact_without_the_exact_path, generator
from torch import nn

from dpml.train.clipping import engine_pass
from dpml.train.dpsgd import per_example_cross_entropy


class HeadsFirst(nn.Module):
    """Block-diagonal gates written heads first: rows (B·T, H, w) permuted to (H, B·T, w), ``torch.baddbmm`` with a
    weight and a bias per head (β, α as given), ``Tensor.baddbmm`` with the weight on the left, ``torch.addbmm`` (the
    heads summed) and a plain ``torch.bmm``."""

    def __init__(self, beta: float, alpha: float, heads: int = 2, width: int = 3) -> None:
        super().__init__()
        self.beta, self.alpha, self.heads, self.width = beta, alpha, heads, width
        self.inp = nn.Linear(4, heads * width)
        self.gate = nn.Parameter(torch.randn(heads, width, width) * 0.5)
        self.gate_bias = nn.Parameter(torch.randn(heads, 1, width) * 0.1)
        self.left = nn.Parameter(torch.randn(heads, width, width) * 0.5)
        self.summed = nn.Parameter(torch.randn(heads, width, 2) * 0.5)
        self.summed_bias = nn.Parameter(torch.randn(1, 2) * 0.1)
        self.out = nn.Linear(heads * width + 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, 4)
        batch, length = x.shape[:2]
        rows = torch.tanh(self.inp(x)).reshape(batch * length, self.heads, self.width).permute(1, 0, 2)  # (H, B·T, w)
        gated = torch.baddbmm(self.gate_bias, rows, self.gate, beta=self.beta, alpha=self.alpha)
        columns = torch.tanh(gated).transpose(1, 2)  # (H, w, B·T)
        mixed = self.gate_bias.transpose(1, 2).expand(-1, -1, batch * length).baddbmm(self.left, columns)
        heads = torch.bmm(torch.tanh(mixed).transpose(1, 2), self.gate)  # (H, B·T, w)
        summed = torch.addbmm(self.summed_bias, torch.tanh(heads), self.summed)  # (B·T, 2), the heads added up
        per_row = torch.cat([heads.permute(1, 0, 2).reshape(batch * length, -1), summed], 1)
        return self.out(torch.tanh(per_row).reshape(batch, length, -1).mean(1))


@pytest.mark.parametrize(("beta", "alpha"), [(1.0, 1.0), (0.5, -1.5), (0.0, 2.0)])
def test_per_head_products_written_heads_first(beta: float, alpha: float) -> None:
    torch.manual_seed(2)
    x = torch.randn(5, 4, 4, generator=generator(7), dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    assert_exact_without_the_exact_path(HeadsFirst(beta, alpha), per_example_cross_entropy, x, y)


class TimeMajorHeads(nn.Module):
    """A time-major activation (T, B, H, d), from an einsum that moves the batch, against a weight per head; and a
    bias per head added to rows heads first in time-major order, (H, T·B, d) (each example's rows not in one run)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.w = nn.Parameter(torch.randn(2, 3, 5) * 0.5)
        self.bias = nn.Parameter(torch.randn(2, 1, 3) * 0.3)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, 4)
        batch, length = x.shape[:2]
        h = torch.tanh(self.inp(x)).reshape(batch, length, 2, 3)
        z = torch.einsum("ibhd,hde->ibhe", torch.einsum("bthd->tbhd", h), self.w)  # (T, B, 2, 5)
        rows = h.permute(2, 1, 0, 3).reshape(2, length * batch, 3) + self.bias  # (H, T·B, 3)
        biased = torch.tanh(rows).reshape(2, length, batch, 3).mean(1).permute(1, 0, 2).reshape(batch, -1)
        return self.out(torch.cat([torch.tanh(z).mean(0).reshape(batch, -1), biased], 1))


@pytest.mark.parametrize("length", [7, 5])
def test_time_major_activations_against_parameters_per_head(length: int) -> None:
    """(At 4ff277c the per-head slices of a time-major activation were read as if it were batch-first: wrong sums,
    which the probe caught, sending the weight to the exact path; and the bias had no rule. T = B = 5 too.)"""
    torch.manual_seed(4)
    x = torch.randn(5, length, 4, generator=generator(9), dtype=torch.float64)
    assert_exact_without_the_exact_path(TimeMajorHeads(), per_example_cross_entropy, x, torch.randint(0, 3, (5,)))


def test_a_sum_over_the_examples_batch_of_products_takes_the_exact_path_and_says_why() -> None:
    """``torch.addbmm`` over a batch-first activation sums the examples' products together: no rule applies."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3) * 0.5)
            self.out = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, 4)
            pooled = torch.addbmm(torch.zeros(x.shape[1], 3, dtype=x.dtype), x, self.w.expand(x.shape[0], 4, 3))
            return self.out(torch.tanh(x.mean(1) @ self.w + pooled.mean(0)))

    x = torch.randn(5, 2, 4, dtype=torch.float64)
    found = engine_pass(Mixed().double(), per_example_cross_entropy, x, torch.randint(0, 3, (5,)))
    assert set(found.exact) == {"w"} and "summed away" in found.reasons["w"]


class AttentionVariants(nn.Module):
    """``nn.MultiheadAttention`` with a learned key and value bias appended to the (time-major) keys and values and a
    zero attention slot, and one with keys and values of other widths (``kdim``, ``vdim``: three projection weights),
    padding masked; and a learned row concatenated to a time-major activation by hand."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.biased = nn.MultiheadAttention(width, 2, add_bias_kv=True, add_zero_attn=True, batch_first=True)
        self.cross = nn.MultiheadAttention(width, 2, kdim=5, vdim=3, batch_first=True)
        self.row = nn.Parameter(torch.randn(1, 1, width) * 0.5)
        self.out = nn.Linear(3 * width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, 8)
        batch = x.shape[0]
        padding = torch.zeros(batch, x.shape[1] - 1, dtype=torch.bool)
        padding[: batch // 2, -1] = True
        h, _ = self.biased(x, x, x, need_weights=False)
        g, _ = self.cross(x, x[:, 1:, :5], torch.tanh(x[:, 1:, 2:5]), key_padding_mask=padding, need_weights=False)
        rows = torch.cat([x.transpose(0, 1), self.row.expand(1, batch, -1)])  # (T + 1, B, 8), time-major
        return self.out(torch.cat([h.mean(1), g.mean(1), torch.tanh(rows).mean(0)], 1))


def test_attention_with_learned_key_and_value_biases_and_keys_of_other_widths() -> None:
    torch.manual_seed(6)
    x = torch.randn(5, 4, 8, generator=generator(11), dtype=torch.float64)
    assert_exact_without_the_exact_path(AttentionVariants(), per_example_cross_entropy, x, torch.randint(0, 3, (5,)))
