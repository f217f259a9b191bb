"""Microsoft's privacy random variable accountant (Gopi, Lee & Wutschitz 2021) as one of the accountants
:func:`dpml.accounting.accountants.certify` asks: its certified upper bound on ε, and the lower one the tests hold
dpml to never go below."""

from __future__ import annotations

from dpml.accounting.mechanism import MechanismDescription, PoissonGaussianSteps


def prv_bounds(mechanism: MechanismDescription, delta: float, eps_error: float = 0.01) -> tuple[float, float, float]:
    """(lower, estimate, upper) ε(δ) from Microsoft's PRV accountant (Gopi, Lee, Wutschitz 2021).

    The upper value is a certified upper bound; the lower one is what the tests hold dpml to
    never go below. Add/remove neighbouring only.
    """
    if mechanism.neighbouring != "add-remove":
        raise NotImplementedError("prv_accountant's Poisson-subsampled Gaussian is add/remove only")
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant  # lazy: when this accountant is asked

    gaussian = mechanism.gaussian_events()
    events = [e for e in gaussian if isinstance(e, PoissonGaussianSteps)]
    if len(events) != len(gaussian):
        raise NotImplementedError("priced by gdp.exact and dp_accounting (a μ-GDP event is not a PRV input here)")
    prvs = [
        PoissonSubsampledGaussianMechanism(noise_multiplier=e.noise_multiplier, sampling_probability=e.sample_rate)
        for e in events
    ]
    counts = [e.steps for e in events]
    accountant = PRVAccountant(prvs=prvs, max_self_compositions=counts, eps_error=eps_error, delta_error=delta / 1000)
    lower, estimate, upper = accountant.compute_epsilon(delta=delta, num_self_compositions=counts)
    return float(lower), float(estimate), float(upper)


def epsilon_prv_upper(mechanism: MechanismDescription, delta: float) -> float:
    return prv_bounds(mechanism, delta)[2]
