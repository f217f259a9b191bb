"""``nn.Bilinear`` (``torch.bilinear``) at any size: its weight's per-example norms by three Gram matrices where
they are the cheaper (‖Σ_t δ_t ⊗ x₁_t ⊗ x₂_t‖² = Σ_{t,s} (δ_t·δ_s)(x₁_t·x₁_s)(x₂_t·x₂_s)), else its gradients formed on
demand, and its clipped sum one weight gradient of the clip-weighted rows. Exact against the float64 per-example loop
on vectors and on sequences, on each way the sum joins two of the three factors, with the per-example gradients kept
or not kept at all: a layer whose B × K·n₁·n₂ gradients pass the keep limit (``nn.Bilinear(128, 96, 192)`` at batch
64 did) no longer takes the exact path."""

from __future__ import annotations

import pytest
import torch
from test_op_rules import assert_exact_without_the_exact_path, generator
from torch import nn

from dpml import devices
from dpml.train import keep_budget
from dpml.train.dpsgd import per_example_cross_entropy
from dpml.train.rules import bilinear as rule


class Pairs(nn.Module):
    """x (B, T, n₁ + n₂) split into x₁ and tanh of x₂, or x (B, n₁ + n₂) for vectors, through ``nn.Bilinear`` (bias
    and weight) to a classifier."""

    def __init__(self, n1: int, n2: int, k: int) -> None:
        super().__init__()
        self.n1 = n1
        self.pair = nn.Bilinear(n1, n2, k)
        self.out = nn.Linear(k, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.pair(x[..., : self.n1], torch.tanh(x[..., self.n1 :]))
        return self.out(torch.tanh(z if z.dim() == 2 else z.mean(1)))


SHAPES = {  # (positions or None for vectors, n₁, n₂, K): which of the three pairs the sum joins, which way the norm
    "vectors": (None, 4, 5, 3),
    "joins δ⊗x₂ (n₁ widest)": (3, 9, 3, 2),
    "joins δ⊗x₁ (n₂ widest)": (3, 3, 9, 2),
    "joins x₁⊗x₂ (K widest)": (3, 2, 3, 9),
    "materialised (many positions)": (12, 2, 3, 2),
}


@pytest.mark.parametrize("kept", [True, False], ids=["keep-limit", "nothing-kept"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_a_bilinear_layer_of_any_shape_is_exact_without_the_exact_path(
    shape: str, kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    positions, n1, n2, k = SHAPES[shape]
    if not kept:  # (before: "its per-example gradients exceed the keep limit", the exact path)
        monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 0)
    ghost = rule._ghost_normed(6, positions or 1, (k, n1, n2), keep_budget.keep_limit(torch.device("cpu")))
    assert ghost == (shape != "materialised (many positions)")  # (the shapes reach the ways they are named for)
    torch.manual_seed(5)
    size = (6, n1 + n2) if positions is None else (6, positions, n1 + n2)
    x = torch.randn(*size, generator=generator(41), dtype=torch.float64)
    assert_exact_without_the_exact_path(Pairs(n1, n2, k), per_example_cross_entropy, x, torch.randint(0, 3, (6,)))


@pytest.mark.parametrize("one_row_a_slice", [False, True], ids=["heap-sized-slices", "one-row-a-slice"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_the_grams_the_gradients_and_the_weighted_sum_equal_the_formed_gradients(
    shape: str, one_row_a_slice: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against einsum's products, in whole slices or one row (and one example) a slice: the weighted sum's slices of
    rows cut examples apart, which a sum over rows allows."""
    if one_row_a_slice:
        monkeypatch.setattr(devices, "HEAP_BLOCKS_BELOW", devices.HEAP_BLOCK_MARGIN + 1)
    positions, n1, n2, k = SHAPES[shape]
    g = generator(42)
    d, left, right = (torch.randn(7, positions or 1, n, generator=g, dtype=torch.float64) for n in (k, n1, n2))
    factors = torch.rand(7, generator=g, dtype=torch.float64)
    grads = torch.einsum("btk,bti,btj->bkij", d, left, right)
    form = rule.weight_form(d, left, right)
    torch.testing.assert_close(form.gradients(slice(2, 6)), grads[2:6], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(rule._ghost_norms(d, left, right), grads.square().sum((1, 2, 3)), rtol=1e-12, atol=0)
    expected = torch.einsum("b,bkij->kij", factors, grads)
    torch.testing.assert_close(form.weighted_sum(factors), expected, rtol=1e-12, atol=1e-14)
