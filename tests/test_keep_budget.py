"""One engine pass keeps at most ``PASS_KEEP_LAYERS`` × the device's keep limit of materialised per-example
gradients, all layers together (:mod:`dpml.train.keep_budget`), and its clipped sums stay exact past it."""

from __future__ import annotations

import pytest
import torch
from test_clipping_layers import assert_matches_naive_loop, labels
from torch import nn

from dpml.train import clipping_layers, keep_budget

BATCH, POSITIONS, WIDTH, LAYERS = 9, 6, 8, 8


class DeepSequenceMlp(nn.Module):
    """``LAYERS`` equal dense layers over ``POSITIONS`` positions: each one's per-example gradients are
    materialised (T²(d_in + d_out) > 4·d_in·d_out) and, alone, fit the keep limit the test sets."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.out = nn.Linear(POSITIONS * WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x.flatten(1))


def kept_layers(monkeypatch: pytest.MonkeyPatch, pass_layers: int) -> list[int]:
    """Runs the engine against the one-example-at-a-time loop; returns the numbers each layer's clipped sum
    read from kept per-example gradients (one entry per layer that kept them)."""
    layer_limit = BATCH * WIDTH * WIDTH  # one hidden layer's per-example weight gradients, exactly
    monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", layer_limit)
    monkeypatch.setattr(keep_budget, "PASS_KEEP_LAYERS", pass_layers)
    assert clipping_layers.materialise(BATCH, POSITIONS, WIDTH, WIDTH, layer_limit)
    kept: list[int] = []
    kept_sum = clipping_layers.kept_sum

    def spy(factors: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
        kept.append(sum(part.numel() for part in parts))
        return kept_sum(factors, parts)

    monkeypatch.setattr(clipping_layers, "kept_sum", spy)
    torch.manual_seed(5)
    model = DeepSequenceMlp().double()
    x = torch.randn(BATCH, POSITIONS, WIDTH, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    assert_matches_naive_loop(model, x, labels(BATCH), 0.05)
    return kept


def test_a_pass_keeps_no_more_than_its_budget_and_its_sums_stay_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    kept = kept_layers(monkeypatch, pass_layers=3)
    assert kept == [BATCH * WIDTH * WIDTH] * 3  # three layers' worth, then the rest by a second pass


def test_the_budget_is_what_stops_the_keeping(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kept_layers(monkeypatch, pass_layers=100) == [BATCH * WIDTH * WIDTH] * LAYERS


def test_outside_a_pass_a_layer_keeps_up_to_its_own_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 10)
    assert keep_budget.left() is None and keep_budget.room(123) == 123
    with keep_budget.pass_budget(torch.device("cpu")):
        assert keep_budget.room(100) == 10 * keep_budget.PASS_KEEP_LAYERS
        keep_budget.spend(10 * keep_budget.PASS_KEEP_LAYERS - 3)
        assert keep_budget.room(100) == 3 and keep_budget.left() == 3
        keep_budget.spend(5)
        assert keep_budget.room(100) == 0
    assert keep_budget.left() is None
