"""An example accountant: full-batch Gaussian steps priced exactly, as one Gaussian mechanism."""

import math

from dpml.accounting.accountants import Accountant, register_accountant
from dpml.accounting.gdp import gdp_epsilon
from dpml.accounting.mechanism import MechanismDescription, PoissonGaussianSteps


def supports(mechanism: MechanismDescription) -> bool:
    """Full-batch (q = 1) Gaussian steps only, composed: nothing subsampled, no other event, no random count."""
    if mechanism.selection is not None and mechanism.selection.random:
        return False
    events = mechanism.composed_events()
    return bool(events) and all(isinstance(e, PoissonGaussianSteps) and e.sample_rate == 1.0 for e in events)


def epsilon(mechanism: MechanismDescription, delta: float) -> float:
    """T steps at noise multiplier s (s/2 under replace-one, whose sensitivity is twice) compose into one Gaussian
    mechanism, μ-GDP with μ = sqrt(Σ T/s²), whose ε(δ) is exact (Dong, Roth & Su 2022, Cor. 2.13)."""
    scale = 2.0 if mechanism.neighbouring == "replace-one" else 1.0
    mu = math.sqrt(sum(e.steps * (scale / e.noise_multiplier) ** 2 for e in mechanism.composed_events()))
    return gdp_epsilon(mu, delta)


register_accountant(Accountant("gaussian.full_batch_exact", "scipy", epsilon, supports))
