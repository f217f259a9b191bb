"""Hooked layers trusted from the last pass (:mod:`dpml.train.rules.recorder`): their own calls run without rules,
every pass stays exact, and a layer whose shortcut stops applying gets its pass recorded again with every rule."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from test_clipping_layers import assert_matches_naive_loop, labels, randomise_affine
from test_dpsgd import naive_clipped_sum_and_norms
from torch import nn

from dpml.train import clipping
from dpml.train.clipping import clipped_gradient_sum
from dpml.train.dpsgd import per_example_cross_entropy
from dpml.train.rules.registry import RULES, function_name


class SometimesReadOutside(nn.Module):
    """A convolution, a GroupNorm and two Linear layers; with ``outside``, the first Linear's weight is read a second
    time outside its own call (a product with the hidden rows), where its shortcut cannot see it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(2, 3, 3, padding=1), nn.GroupNorm(1, 3)
        self.fc, self.head = nn.Linear(48, 6), nn.Linear(6, 3)
        self.outside = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.conv(x))).flatten(1)
        z = self.fc(h)
        if self.outside:
            z = z + torch.tanh(h @ self.fc.weight.t())
        return self.head(torch.tanh(z))


@pytest.fixture
def rules_asked(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often each operation's rule is asked (every registered rule wrapped)."""
    asked: Counter[str] = Counter()

    def counted(func: Any, rule: Any) -> Any:
        def wrapper(call: Any) -> Any:
            asked[function_name(func)] += 1
            return rule(call)

        return wrapper

    for func, rule in list(RULES.items()):
        monkeypatch.setitem(RULES, func, counted(func, rule))
    return asked


def _forward_passes(model: nn.Module) -> list[int]:
    passes: list[int] = []
    model.register_forward_pre_hook(lambda module, inputs: passes.append(1))
    return passes


def _passes_and_match(model: nn.Module, passes: list[int], x: torch.Tensor, y: torch.Tensor, step: int) -> int:
    """One pass of the engine: the forward passes it ran, its sums and norms checked against the per-example loop."""
    passes.clear()
    sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.05)
    count = len(passes)
    passes.clear()
    reference, reference_norms = naive_clipped_sum_and_norms(model, x, y, 0.05)
    for name in reference:
        torch.testing.assert_close(sums[name], reference[name], rtol=1e-10, atol=1e-12, msg=(step, name))
    torch.testing.assert_close(norms, reference_norms, rtol=1e-10, atol=1e-12)
    return count


def test_layers_whose_shortcut_the_last_pass_took_are_recorded_without_their_rules(rules_asked: Counter[str]) -> None:
    torch.manual_seed(31)
    model = randomise_affine(SometimesReadOutside()).double()
    x = torch.randn(9, 2, 4, 4, generator=torch.Generator().manual_seed(31), dtype=torch.float64)
    y = labels(9)
    clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.05)  # a first pass: nothing trusted yet
    first = sum(rules_asked.values())
    assert first >= 4, rules_asked  # the convolution's, the norm's and the two Linear layers' calls
    assert set(clipping._TRUSTED_LAYERS[model]) == {model.conv, model.norm, model.fc, model.head}
    for _ in range(2):
        rules_asked.clear()
        assert_matches_naive_loop(model, x, y, 0.05, most_clipped=False)
        assert not rules_asked  # every parameter is a trusted layer's, read inside its call


def test_a_trusted_layer_whose_weight_is_read_outside_its_call_gets_the_pass_recorded_again() -> None:
    torch.manual_seed(32)
    model = randomise_affine(SometimesReadOutside()).double()
    passes = _forward_passes(model)
    x = torch.randn(9, 2, 4, 4, generator=torch.Generator().manual_seed(32), dtype=torch.float64)
    y = labels(9)
    expected = [(False, 1), (True, 2), (True, 1), (False, 1), (False, 1)]  # (outside, forward passes)
    for step, (outside, count) in enumerate(expected):
        model.outside = outside
        assert _passes_and_match(model, passes, x, y, step) == count, step
        assert (model.fc in clipping._TRUSTED_LAYERS[model]) is not outside, step


class LayerThenOverwrittenView(nn.Module):
    """A hooked Linear before a ruled product whose output, a view, is rewritten in place (``relu_``): trusting
    the Linear leaves its call out of the rules, and the product must still be the call passed on as a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 5)
        self.w = nn.Parameter(torch.randn(3, 5))
        self.out = nn.Linear(3 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 4, 4)
        h = torch.tanh(self.first(x))
        g = torch.relu_(torch.einsum("bto,po->btp", h, self.w))
        return self.out(g.flatten(1))


def test_the_outputs_passed_on_as_copies_are_the_same_calls_whichever_layers_are_trusted() -> None:
    """The first pass learns which view is rewritten and runs again with copies; every later pass, the hooked
    layers before the view now trusted, copies that same call from the start: one forward pass each."""
    torch.manual_seed(33)
    model = LayerThenOverwrittenView().double()
    passes = _forward_passes(model)
    x = torch.randn(10, 4, 4, generator=torch.Generator().manual_seed(33), dtype=torch.float64)
    y = labels(10)
    for step, count in enumerate([2, 1, 1]):
        assert _passes_and_match(model, passes, x, y, step) == count, step
    assert model.first in clipping._TRUSTED_LAYERS[model]
    assert clipping._OVERWRITTEN_OUTPUTS[model] == {("rule", 1)}  # the product: the second call handed to a rule
