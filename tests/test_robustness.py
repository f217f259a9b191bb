"""Certified robustness of Lipschitz classifiers (seed 004 App. A.3): no attack inside the certified
radius flips a prediction."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpml.audit.robustness import certified_accuracy, certified_radii, network_lipschitz
from dpml.models.lipschitz import LipschitzSpec, build_lipschitz, project_all


def random_lipschitz_model(
    seed: int, hidden: tuple[int, ...] = (16, 16), input_bound: float = 3.0
) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    model = build_lipschitz(LipschitzSpec(12, hidden, 4, input_bound=input_bound, bias_bound=0.5))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    project_all(model)
    return model.eval()


def smallest_flip_found(
    model: torch.nn.Sequential, x: torch.Tensor, label: int, radius: float, steps: int = 60
) -> bool:
    """Projected gradient ascent on the runner-up margin inside the ball of ``radius``: True if the class flips."""
    delta = torch.zeros_like(x, requires_grad=True)
    for _ in range(steps):
        logits = model((x + delta)[None])[0]
        others = logits.clone()
        others[label] = -math.inf
        gap = logits[label] - others.max()
        if gap < 0:
            return True
        (grad,) = torch.autograd.grad(gap, delta)
        with torch.no_grad():
            delta -= radius / 10 * grad / grad.norm().clamp_min(1e-12)
            delta *= min(1.0, radius / float(delta.norm().clamp_min(1e-12)))
    return bool(model((x + delta)[None])[0].argmax() != label)


@pytest.mark.parametrize("hidden", [(16, 16), ()])
def test_attacks_never_flip_inside_the_certified_radius(hidden: tuple[int, ...]) -> None:
    model = random_lipschitz_model(0, hidden)
    x = torch.randn(60, 12)
    y = model(x).argmax(1).numpy()  # labels = predictions: every record is correct
    lipschitz = network_lipschitz(model)
    assert lipschitz <= 1.0 + 1e-9  # projected layers, 1-Lipschitz activations
    radii = certified_radii(model, x.numpy(), y, lipschitz)
    assert (radii >= 0).all()
    for i in range(x.shape[0]):
        assert not smallest_flip_found(model, x[i], int(y[i]), 0.999 * radii[i]), (
            f"record {i} flipped inside its radius"
        )


def test_the_radius_is_tight_for_an_orthogonal_linear_model() -> None:
    """f = Wx + b with orthonormal rows: f_i − f_j is exactly √2-Lipschitz, so the runner-up is reached at 1.02×
    the radius."""
    model = random_lipschitz_model(3, hidden=(), input_bound=100.0)
    with torch.no_grad():
        torch.nn.init.orthogonal_(model[1].weight)
    x = torch.randn(40, 12)
    y = model(x).argmax(1).numpy()
    radii = certified_radii(model, x.numpy(), y, network_lipschitz(model))
    flipped = sum(smallest_flip_found(model, x[i], int(y[i]), 1.02 * radii[i], steps=100) for i in range(40))
    assert flipped >= 36


def test_certified_accuracy_starts_at_accuracy_and_decreases_with_the_radius() -> None:
    model = random_lipschitz_model(1)
    x = np.random.default_rng(0).normal(size=(300, 12)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 4, size=300)
    out = certified_accuracy(model, x, y, levels=(0, 1, 4, 16, 64), unit=0.01)
    accuracy = float((model(torch.as_tensor(x)).argmax(1).numpy() == y).mean())
    assert out["certified_accuracy_r0"] == pytest.approx(accuracy)
    values = [out[f"certified_accuracy_r{k}"] for k in (0, 1, 4, 16, 64)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False)) and values[-1] < values[0]


def test_the_measured_norm_of_a_layer_enters_the_constant() -> None:
    model = random_lipschitz_model(2)
    with torch.no_grad():
        model[1].weight.mul_(2.0)  # a layer at ‖W‖₂ = 2: the constant must say so, not the nominal 1
    assert network_lipschitz(model) == pytest.approx(2.0 * network_lipschitz(random_lipschitz_model(2)), rel=1e-6)
