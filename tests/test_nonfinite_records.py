"""A record whose gradient is not finite is left out of the clipped sum (a share of 0), instead of putting nan into
every coordinate of the sum and of the model: a nan model would say that the record was sampled, and the training
would be lost. The engine's sums on a batch with such records equal a float64 per-example loop over the others, by
each of the engine's three ways (a layer's shortcut, an operation's rule, the exact path) and with the audit's Dirac
canaries; through ``dpml.train_private`` the model stays finite, equal to a run in which the record's share is a
true 0, and the log says so once."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from test_op_rules import loop_reference
from torch import nn
from torch.utils.data import TensorDataset

import dpml
from dpml.train.clipping import clip_factors, clipped_gradient_sum
from dpml.train.diracs import DiracGradients
from dpml.train.dpsgd import per_example_cross_entropy

FEATURES, CLASSES = 5, 3


class ThreeWays(nn.Module):
    """log(x₀ + 10) (nan below −10) beside the other features, through a hooked ``nn.Linear`` (its shortcut), a weight
    used by ``F.linear`` twice (the rules) and a learned scale (sent to the exact path by the tests); the logits are
    multiplied by the last feature, so that a record whose last feature is 0 has a gradient of exactly 0."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(FEATURES - 1, 8)
        self.shared = nn.Parameter(torch.randn(8, 8) / 3)
        self.scale = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.cat([torch.log(x[:, :1] + 10), x[:, 1:-1]], 1)
        h = torch.tanh(self.first(features))
        h = torch.tanh(F.linear(F.linear(h, self.shared), self.shared)) * self.scale
        return self.head(h) * x[:, -1:]


def records(count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, FEATURES, generator=g, dtype=torch.float64)
    x[:, -1] = 1.0
    return x, torch.randint(0, CLASSES, (count,), generator=g)


def poisoned(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``x`` with record 1's log going nan (x₀ = −20) and record 4 holding an infinite value: their gradients are not
    finite; the others' are."""
    x = x.clone()
    x[1, 0] = -20.0
    x[4, 2] = math.inf
    return x, [0, 2, 3, 5, 6]


@pytest.mark.parametrize("exact", [(), ("scale",)], ids=["rules-and-shortcut", "with-the-exact-path"])
def test_records_with_non_finite_gradients_are_left_out_of_the_clipped_sum(
    exact: tuple[str, ...], caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = ThreeWays().double()
    x, y = records(7)
    x, finite = poisoned(x)
    reference, reference_norms = loop_reference(model, per_example_cross_entropy, x[finite], y[finite], 0.5, 0)
    with caplog.at_level(logging.WARNING, logger="dpml.clipping"):
        sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.5, exact=exact)
        clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.5, exact=exact)
    assert set(sums) == set(reference)
    for name, expected in reference.items():
        assert bool(torch.isfinite(sums[name]).all()), name
        torch.testing.assert_close(sums[name], expected, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(norms[finite], reference_norms, rtol=1e-10, atol=0)
    assert not bool(torch.isfinite(norms[[1, 4]]).any())
    said = [r.getMessage() for r in caplog.records if "not finite" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("per-example clipping: a record's gradient is not finite"), said


def test_the_dirac_canaries_keep_their_share_when_records_are_left_out() -> None:
    torch.manual_seed(0)
    model = ThreeWays().double()
    x, y = records(6, seed=1)
    x[2, 0] = -30.0
    keep = [0, 1, 3, 4, 5]
    size = sum(p.numel() for p in model.parameters())
    canaries = DiracGradients(torch.tensor([0, size - 1, 17]), 4.0)
    reference, _ = loop_reference(model, per_example_cross_entropy, x[keep], y[keep], 0.5, 0)
    sums, _ = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.5, canaries)
    share = float(clip_factors(torch.tensor([4.0], dtype=torch.float64), 0.5)) * 4.0
    flat = torch.cat([reference[n].reshape(-1) for n, _ in model.named_parameters()])
    flat[[0, size - 1, 17]] += share
    found = torch.cat([sums[n].reshape(-1) for n, _ in model.named_parameters()])
    torch.testing.assert_close(found, flat, rtol=1e-10, atol=1e-12)


def test_a_batch_whose_every_record_is_non_finite_sums_to_zero() -> None:
    torch.manual_seed(0)
    model = ThreeWays().double()
    x, y = records(3)
    x[:, 0] = -50.0
    sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 1.0)
    assert not bool(torch.isfinite(norms).any())
    for name, p in model.named_parameters():
        assert torch.equal(sums[name], torch.zeros_like(p)), name


def _trained(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    model = ThreeWays()
    result = dpml.train_private(
        model,
        TensorDataset(x, y),
        noise_multiplier=0.8,
        delta=1e-5,
        epochs=3,
        sample_rate=0.25,
        learning_rate=0.5,
        physical_batch_size=16,
        seed=11,
    )
    assert result.history["steps"] == 12
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_train_private_leaves_a_record_out_as_a_true_zero_share(caplog: pytest.LogCaptureFixture) -> None:
    x, y = records(48, seed=2)
    x = x.float()
    silent = x.clone()
    silent[5, -1] = 0.0  # the record's logits are 0 whatever the parameters: its gradient is exactly 0
    poisoned_x = x.clone()
    poisoned_x[5, 0] = -25.0  # its log is nan: its gradient too
    expected = _trained(silent, y)
    with caplog.at_level(logging.WARNING, logger="dpml.clipping"):
        found = _trained(poisoned_x, y)
    for name, value in expected.items():
        assert bool(torch.isfinite(found[name]).all()), name
        torch.testing.assert_close(found[name], value, rtol=1e-5, atol=1e-6, msg=name)
    said = [r.getMessage() for r in caplog.records if "not finite" in r.getMessage()]
    assert len(said) == 1, said


def test_a_model_whose_parameters_are_not_finite_is_refused_instead_of_left_out_record_by_record() -> None:
    torch.manual_seed(0)
    model = ThreeWays().double()
    with torch.no_grad():
        model.shared[2, 3] = math.nan
    x, y = records(4)
    with pytest.raises(FloatingPointError, match=r"parameters are not finite \(nan or inf: shared\).*diverged"):
        clipped_gradient_sum(model, per_example_cross_entropy, x, y, 1.0)
