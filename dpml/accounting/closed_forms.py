"""Closed-form and zCDP conversions: mechanisms whose ε needs no numerical accountant.

μ-GDP events by their exact profile, full-batch Gaussian steps by the moments accountant's closed
form (seed 002's DP-GD certificate), and ρ-zCDP (seed 002's one-pass DP-SGD) by three conversions.
Each is one of the accountants :func:`dpml.accounting.accountants.certify` asks.
"""

from __future__ import annotations

import math
import warnings

from dpml.accounting import gdp, tuning
from dpml.accounting.mechanism import ConcentratedDP, GaussianDP, MechanismDescription


def epsilon_gdp_exact(mechanism: MechanismDescription, delta: float) -> float:
    """ε(δ) of a GDP-only mechanism by the exact μ-GDP profile (Dong et al. 2022 Cor. 2.13)."""
    events = mechanism.composed_events()
    if not all(isinstance(e, GaussianDP) for e in events):
        raise NotImplementedError("the exact GDP conversion needs a mechanism of μ-GDP events only")
    return gdp.gdp_epsilon(math.sqrt(sum(e.mu**2 for e in events if isinstance(e, GaussianDP))), delta)


def epsilon_moments_closed_form(mechanism: MechanismDescription, delta: float) -> float:
    """ε = a + 2·sqrt(a·log(1/δ)) for full-batch Gaussian steps and μ-GDP events (seed 002's DP-GD certificate).

    Each full-batch step with noise multiplier s relative to the sensitivity (s = σ under
    add/remove, σ/2 under replace-one) is (α, α/(2s²))-RDP, a μ-GDP event (α, αμ²/2)-RDP; with
    a = Σ 1/(2s²) + Σ μ²/2 the composition is (α, αa)-RDP, and ε = min_α αa + log(1/δ)/(α − 1)
    = a + 2·sqrt(a·log(1/δ)) at α = 1 + sqrt(log(1/δ)/a) (Abadi et al.'s moments accountant).
    """
    a = 0.0
    for e in mechanism.gaussian_events():
        if isinstance(e, GaussianDP):
            a += e.mu**2 / 2
        elif e.sample_rate == 1.0:
            s = e.noise_multiplier / (2.0 if mechanism.neighbouring == "replace-one" else 1.0)
            a += e.steps / (2 * s * s)
        else:
            raise NotImplementedError("the closed form covers full-batch (q = 1) Gaussian steps and GDP events only")
    return a + 2 * math.sqrt(a * math.log(1 / delta))


def _total_zcdp_rho(mechanism: MechanismDescription) -> float:
    """ρ of the composition when every event is zCDP (a μ-GDP event is (μ²/2)-zCDP): ρ's add up."""
    total = 0.0
    for e in mechanism.composed_events():
        if isinstance(e, ConcentratedDP):
            total += e.rho
        elif isinstance(e, GaussianDP):
            total += e.mu**2 / 2
        else:
            raise NotImplementedError("the zCDP accountants take zCDP and GDP events only")
    return total


def epsilon_zcdp_closed_form(mechanism: MechanismDescription, delta: float) -> float:
    """ρ-zCDP ⇒ (ρ + 2·sqrt(ρ·log(1/δ)), δ)-DP (Bun & Steinke 2016, Prop. 1.3)."""
    rho = _total_zcdp_rho(mechanism)
    return rho + 2 * math.sqrt(rho * math.log(1 / delta))


def epsilon_zcdp_rdp(mechanism: MechanismDescription, delta: float) -> float:
    """ρ-zCDP is (α, ρα)-RDP for every α; converted by Canonne, Kamath & Steinke (2020) (dp_accounting)."""
    rho = _total_zcdp_rho(mechanism)
    return tuning.rdp_to_epsilon(tuning.ORDERS, [rho * order for order in tuning.ORDERS], delta)


def epsilon_autodp_zcdp(mechanism: MechanismDescription, delta: float) -> float:
    """autodp's zCDP mechanism (its own RDP → (ε, δ) conversion): an independent implementation."""
    from autodp.mechanism_zoo import zCDP_Mechanism  # lazy: when this accountant is asked

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(zCDP_Mechanism(_total_zcdp_rho(mechanism), 0.0).get_approxDP(delta))


def has_zcdp(mechanism: MechanismDescription) -> bool:
    return any(isinstance(e, ConcentratedDP) for e in mechanism.events)
