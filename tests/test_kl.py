"""Seed 000's initialisation schemes and KL-privacy arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from dpml.init_schemes import SCHEMES, init_variances
from dpml.models.init import bias_free_relu_mlp, initialise
from dpml.accounting.kl import (
    calibrate_sigma_squared,
    expected_jacobian_norm_sq,
    gradient_gap_bound,
    gradient_norm_constant,
    kl_bound,
    kl_bound_for_relation,
    pinsker_delta,
    table_1_constant,
)


def test_variances_are_eq_5() -> None:
    widths = [10, 30, 30, 4]
    assert init_variances("lecun", widths) == pytest.approx([1 / 10, 1 / 30, 1 / 30])
    assert init_variances("he", widths) == pytest.approx([2 / 10, 2 / 30, 2 / 30])
    assert init_variances("ntk", widths) == pytest.approx([2 / 30, 2 / 30, 1 / 4])
    assert init_variances("xavier", widths) == pytest.approx([2 / 40, 2 / 60, 2 / 34])
    with pytest.raises(ValueError, match="scheme 'orthogonal'"):
        init_variances("orthogonal", widths)  # type: ignore[arg-type]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("depth", [2, 3, 5])
def test_eq_7_equals_table_1(scheme: str, depth: int) -> None:
    d, m, o = 12, 40, 3
    widths = [d] + [m] * (depth - 1) + [o]
    assert gradient_norm_constant(scheme, widths, math.sqrt(d)) == pytest.approx(
        table_1_constant(scheme, d, m, o, depth), rel=1e-12
    )


@pytest.mark.parametrize("scheme", SCHEMES)
def test_eq_33_gradient_norm_identity_by_monte_carlo(scheme: str) -> None:
    """E_W ‖∂f(x)/∂W‖_F² over random initialisations, within 4% (≈4 standard errors here)."""
    widths = [6, 48, 48, 2]
    torch.manual_seed(0)
    x = torch.randn(6, dtype=torch.float64)
    generator = torch.Generator().manual_seed(1)
    model = bias_free_relu_mlp(widths).double()
    samples = []
    for _ in range(3000):
        initialise(model, scheme, generator)
        output = model(x)
        total = 0.0
        for k in range(widths[-1]):
            grads = torch.autograd.grad(output[k], list(model.parameters()), retain_graph=True)
            total += sum(float(g.pow(2).sum()) for g in grads)
        samples.append(total)
    mean = sum(samples) / len(samples)
    stderr = (sum((s - mean) ** 2 for s in samples) / (len(samples) - 1)) ** 0.5 / len(samples) ** 0.5
    expected = expected_jacobian_norm_sq(float(x.pow(2).sum()), scheme, widths)
    assert stderr < 0.012 * expected  # the check below is sharp enough to catch a factor-2 error
    assert mean == pytest.approx(expected, rel=0.04)


def test_kl_certificate_arithmetic_and_calibration() -> None:
    constant = table_1_constant("lecun", 784, 256, 2, 4)
    kl = kl_bound(constant, steps=500, learning_rate=0.01, n=10_000, sigma=0.1)
    assert kl == pytest.approx(2 * constant * 500 * 0.01 / (10_000**2 * 0.01))
    assert pinsker_delta(kl) == pytest.approx(math.sqrt(kl / 2))
    sigma_sq = calibrate_sigma_squared(constant, time=500 * 0.01, kl_target=kl, n=10_000)
    assert sigma_sq == pytest.approx(0.01)
    # More depth helps under LeCun (Table 1: the 2^{L−1} wins once L is large), hurts under He.
    assert table_1_constant("lecun", 784, 256, 2, 12) < table_1_constant("lecun", 784, 256, 2, 4)
    assert table_1_constant("he", 784, 256, 2, 12) > table_1_constant("he", 784, 256, 2, 4)


def test_relation_bounds_follow_the_neighbour_denominator() -> None:
    constant = table_1_constant("he", 20, 16, 1, 3)
    assert gradient_gap_bound(constant, 100) == pytest.approx(4 * constant / 100**2)
    assert gradient_gap_bound(constant, 100, "remove_one") == pytest.approx(4 * constant / 99**2)
    assert gradient_gap_bound(constant, 100, "add_one") == pytest.approx(4 * constant / 101**2)
    # KL = (1/(2σ²)) Σ_k η·(4B/n'²): the discrete Cor. 4.2 for every relation.
    for relation, records in (("replace_one", 100), ("remove_one", 99), ("add_one", 101)):
        expected = 30 * 0.05 * gradient_gap_bound(constant, 100, relation) / (2 * 0.2**2)
        assert kl_bound_for_relation(constant, 30, 0.05, 100, 0.2, relation) == pytest.approx(expected)
        assert kl_bound_for_relation(constant, 30, 0.05, 100, 0.2, relation) == pytest.approx(
            kl_bound(constant, 30, 0.05, records, 0.2)
        )
    with pytest.raises(ValueError, match="relation = 'swap'"):
        gradient_gap_bound(constant, 100, "swap")
    with pytest.raises(ValueError, match="n = 1"):
        gradient_gap_bound(constant, 1, "remove_one")
