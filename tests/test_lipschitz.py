"""Seed 004's Lipschitz layers: their bounds hold, are not vacuous, and the projections keep ‖W‖₂ ≤ 1."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpml.models.lipschitz import (
    LOSS_LIPSCHITZ,
    GroupSort2,
    InputBound,
    LayerCentering,
    SpectralLinear,
    gradient_bounds,
    multiclass_hinge,
    project_all,
    tau_cross_entropy,
)

LOSSES = {"tau_cross_entropy": tau_cross_entropy(4.0), "multiclass_hinge": multiclass_hinge(1.0)}


def lipschitz_net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        InputBound(2.0),
        SpectralLinear(12, 16, bias_bound=0.5),
        GroupSort2(),
        LayerCentering(),
        SpectralLinear(16, 16, bias_bound=0.5),
        GroupSort2(),
        SpectralLinear(16, 4),
    ).double()


def randomise(model: nn.Sequential, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 3)
        for layer in model:
            if isinstance(layer, SpectralLinear):
                layer.spectral_norm_estimate(200)  # converge the cached vector, then project
    project_all(model)


@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_per_example_gradients_never_exceed_the_bounds(loss_name: str) -> None:
    loss = LOSSES[loss_name]
    worst: dict[str, float] = {}
    for seed in range(5):
        model = lipschitz_net(seed)
        randomise(model, seed)
        bounds = gradient_bounds(model, 2.0, LOSS_LIPSCHITZ[loss_name])
        generator = torch.Generator().manual_seed(100 + seed)
        x = torch.randn(40, 12, generator=generator, dtype=torch.float64) * 3  # many above X0: InputBound acts
        y = torch.randint(0, 4, (40,), generator=generator)
        for i in range(40):
            grads = torch.autograd.grad(loss(model(x[i : i + 1]), y[i : i + 1]).sum(), list(model.parameters()))
            for (name, _), g in zip(model.named_parameters(), grads, strict=True):
                ratio = float(g.norm()) / bounds[name]
                assert ratio <= 1 + 1e-9, (name, ratio)
                worst[name] = max(worst.get(name, 0.0), ratio)
    assert set(worst) == set(bounds)
    assert worst["6.weight"] > 0.2  # the last layer's bound is within 5x of what random data reach: not vacuous
    print({name: round(r, 3) for name, r in worst.items()})  # tightness per layer (pytest -s)


def test_projection_keeps_the_spectral_norm_at_most_one() -> None:
    layer = SpectralLinear(30, 20, bias_bound=0.1).double()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    for step in range(50):
        optimizer.zero_grad()
        (layer(torch.randn(8, 30, dtype=torch.float64)) ** 2).sum().backward()
        optimizer.step()
        layer.project()
        if step >= 5:  # the cached vector has warmed up
            assert float(torch.linalg.matrix_norm(layer.weight.detach(), ord=2)) <= 1 + 1e-3
        assert float(layer.bias.detach().norm()) <= 0.1 + 1e-12


def test_losses_are_root_two_lipschitz_and_the_constant_is_attained() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(500, 5, generator=generator, dtype=torch.float64) * 20
    y = torch.randint(0, 5, (500,), generator=generator)
    for name, loss in LOSSES.items():
        z = logits.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(loss(z, y).sum(), z)
        assert float(g.norm(dim=1).max()) <= LOSS_LIPSCHITZ[name] + 1e-12
    z = torch.tensor([[-50.0, 50.0, 0.0]], dtype=torch.float64, requires_grad=True)  # confidently wrong
    (g,) = torch.autograd.grad(tau_cross_entropy(1.0)(z, torch.tensor([0])).sum(), z)
    assert float(g.norm()) == pytest.approx(math.sqrt(2), rel=1e-6)


def test_activations_are_one_lipschitz_and_do_not_grow_norms() -> None:
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 200, 10, generator=generator, dtype=torch.float64)
    for layer in (GroupSort2(), LayerCentering()):
        assert bool(((layer(a) - layer(b)).norm(dim=1) <= (a - b).norm(dim=1) + 1e-12).all())
        assert bool((layer(a).norm(dim=1) <= a.norm(dim=1) + 1e-12).all())
    torch.testing.assert_close(GroupSort2()(a).norm(dim=1), a.norm(dim=1))
    assert float(InputBound(1.5)(a * 10).norm(dim=1).max()) <= 1.5 + 1e-12
    with pytest.raises(ValueError, match="every layer must be a LipschitzLayer"):
        gradient_bounds(nn.Sequential(nn.Linear(3, 3)), 1.0, 1.0)
