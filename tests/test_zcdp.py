"""Seed 002's one-pass DP-SGD schedules and their zCDP certificate."""

from __future__ import annotations

import numpy as np
import pytest

from dpml.accounting.gdp import gdp_epsilon
from dpml.accounting.zcdp import const_schedule, minimal_noise_schedule, out_schedule, schedule_rho, zcdp_to_dp


@pytest.mark.parametrize("make", [out_schedule, const_schedule])
@pytest.mark.parametrize("rho", [0.3, 1.0, 3.0])
def test_minimal_noise_schedule_reaches_rho_exactly_for_every_record(make, rho: float) -> None:
    etas = make(2.0, 500)
    sigmas = minimal_noise_schedule(etas, rho)
    remaining = np.sqrt(np.cumsum((sigmas**2)[::-1])[::-1])
    np.testing.assert_allclose(etas / remaining, rho, rtol=1e-9)  # η_k = ρ·sqrt(Σ_{j≥k} σ_j²) for every k
    assert schedule_rho(etas, sigmas) == pytest.approx(rho)
    assert schedule_rho(etas, 0.99 * sigmas) > rho  # less noise anywhere breaks it


def test_out_and_const_schedules_have_the_stated_shapes() -> None:
    rho, n = 0.5, 400
    out = minimal_noise_schedule(out_schedule(1.0, n), rho)
    assert np.all(out[:-1] == 0) and out[-1] == pytest.approx((1.0 / n) / rho)
    const = minimal_noise_schedule(const_schedule(1.0, n), rho)
    np.testing.assert_allclose(const[:-1], const[0], rtol=1e-9)  # constant noise until the last step
    assert const[-1] > const[0]
    with pytest.raises(ValueError, match="non-increasing"):
        minimal_noise_schedule(np.array([0.1, 0.2]), rho)
    assert schedule_rho(np.array([0.1, 0.1]), np.array([0.0, 1.0])) == pytest.approx(0.1)  # all noise at the end (OUT)
    assert schedule_rho(np.array([0.1, 0.1]), np.array([1.0, 0.0])) == float("inf")  # the last record is unprotected
    assert schedule_rho(np.array([0.1, 0.1]), np.array([0.0, 0.0])) == float("inf")


@pytest.mark.parametrize("rho", [0.1, 0.5, 2.0])
def test_zcdp_conversion_is_never_below_the_exact_gaussian(rho: float) -> None:
    """A Gaussian mechanism with μ = ρ is exactly (ρ²/2)-zCDP: the conversion must bound its exact ε."""
    assert zcdp_to_dp(rho, 1e-5) >= gdp_epsilon(rho, 1e-5)
    assert zcdp_to_dp(rho, 1e-5) == pytest.approx(rho**2 / 2 + rho * np.sqrt(2 * np.log(1e5)))
