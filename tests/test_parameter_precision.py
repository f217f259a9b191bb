"""Trainable parameters in bfloat16 or float16 are refused before any ε is spent
(:func:`dpml.train.probe_checks.reject_low_precision_parameters`).

The engine forms each parameter's norms and clipped sum in the parameter's dtype. In bfloat16 the rounding lets one
example's clipped gradient, and the difference between two neighbouring sums, exceed the clip norm C (the first test
measures it on the engine itself), so the sensitivity the accountant certifies would not hold. Frozen parameters in
any dtype pass (no gradient of theirs is released), and float32 parameters with a bf16 forward pass (``autocast``)
keep every contribution within C (``tests/test_devices.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import refused_before_any_charge, trains_charged_once
from torch import nn
from torch.utils.data import TensorDataset

from dpml.train.clipping import clipped_gradient_sum
from dpml.train.clipping_check import ClippingUnsupported, plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy


def mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).to(dtype)


def batch(count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (3 * torch.randn(count, 32, generator=g)).to(dtype), torch.randint(0, 10, (count,), generator=g)


def flat(sums: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([s.double().reshape(-1) for s in sums.values()])


@pytest.mark.parametrize(("dtype", "beyond"), [(torch.bfloat16, 1.002), (torch.float32, None)])
def test_in_bfloat16_the_engine_s_clipped_gradient_of_one_example_exceeds_c(
    dtype: torch.dtype, beyond: float | None
) -> None:
    """Why the refusal: C = 0.01 clips every example; each one's clipped sum, measured in float64, is ‖c_i g_i‖."""
    model, (x, y) = mlp(dtype), batch(20, dtype)
    worst = max(
        float(flat(clipped_gradient_sum(model, per_example_cross_entropy, x[i : i + 1], y[i : i + 1], 0.01)[0]).norm())
        / 0.01
        for i in range(20)
    )
    if beyond is None:
        assert 0.99 < worst <= 1 + 1e-6
    else:
        assert worst > beyond  # (1.010 at this seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_trainable_low_precision_parameter_is_refused_by_the_plan_naming_it(dtype: torch.dtype) -> None:
    model = mlp(torch.float32)
    model[2].to(dtype)
    with pytest.raises(ClippingUnsupported, match=rf"model parameter '2.weight' is trainable in {dtype}: .*autocast"):
        plan_clipping(model, per_example_cross_entropy, (32,))


def test_train_private_refuses_a_bfloat16_model_before_anything_is_charged(tmp_path: Path) -> None:
    x, y = batch(60, torch.bfloat16)
    refused_before_any_charge(
        tmp_path / "ledger.db", mlp(torch.bfloat16), TensorDataset(x, y), "'0.weight' is trainable in torch.bfloat16"
    )


class FrozenHalfBody(nn.Module):
    """A frozen bfloat16 body and a trainable float32 head (an adapter on a low-precision base)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(32, 16).to(torch.bfloat16).requires_grad_(False)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x.to(torch.bfloat16))).float())


def test_frozen_low_precision_parameters_pass_and_the_model_trains(tmp_path: Path) -> None:
    x, y = batch(60, torch.float32)
    trains_charged_once(tmp_path / "ledger.db", FrozenHalfBody(), TensorDataset(x, y))


def test_beside_a_frozen_bfloat16_body_the_norms_and_clip_factors_are_float32() -> None:
    """The engine's norms take the trainable parameters' dtype, not the first parameter's (the frozen body's): each
    example's clipped gradient stays within C as in float32."""
    model, (x, y) = FrozenHalfBody(), batch(20, torch.float32)
    worst = 0.0
    for i in range(20):
        sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x[i : i + 1], y[i : i + 1], 0.01)
        assert norms.dtype == torch.float32
        worst = max(worst, float(flat(sums).norm()) / 0.01)
    assert 0.99 < worst <= 1 + 1e-6
