"""Which mechanism descriptions each built-in accountant models (its ``supports``, :class:`dpml.accounting.accountants.
Accountant`): it is asked about those only, so that none answers for what it does not model, and a certificate
records no error from an accountant asked outside its model. Predicates on the description alone.
"""

from __future__ import annotations

from dpml.accounting.closed_forms import has_zcdp
from dpml.accounting.mechanism import GaussianDP, MechanismDescription, PoissonGaussianSteps


def random_selection(mechanism: MechanismDescription) -> bool:
    """A best-of-K search with a random K (priced by the Papernot–Steinke bound, not as a composition)."""
    return mechanism.selection is not None and mechanism.selection.random


def without_zcdp(mechanism: MechanismDescription) -> bool:
    """No ρ-zCDP event: a zCDP event has an RDP curve and nothing else, so it is the zCDP accountants' alone."""
    return not has_zcdp(mechanism)


def composed_without_zcdp(mechanism: MechanismDescription) -> bool:
    """A plain composition (no random-count search, whose release is not one) without a zCDP event: what the
    accountants of composed events price."""
    return without_zcdp(mechanism) and not random_selection(mechanism)


def gdp_only(mechanism: MechanismDescription) -> bool:
    """Composed μ-GDP events only (NoisyCGD's): the exact GDP profile's mechanisms."""
    return composed_without_zcdp(mechanism) and all(isinstance(e, GaussianDP) for e in mechanism.events)


def add_remove_or_gdp_only(mechanism: MechanismDescription) -> bool:
    """Add/remove neighbours, or μ-GDP events only: the RDP of Poisson subsampling in autodp and dp_accounting is
    for add/remove (a μ-GDP event's curve αμ²/2 holds under either relation)."""
    return mechanism.neighbouring == "add-remove" or all(isinstance(e, GaussianDP) for e in mechanism.events)


def subsampled_gaussian_add_remove(mechanism: MechanismDescription) -> bool:
    """Composed Poisson-subsampled Gaussian steps under add/remove, nothing else: prv_accountant's mechanism."""
    return (
        composed_without_zcdp(mechanism)
        and mechanism.neighbouring == "add-remove"
        and all(isinstance(e, PoissonGaussianSteps) for e in mechanism.events)
    )


def autodp_composition(mechanism: MechanismDescription) -> bool:
    """A composition autodp's RDP prices: no random count, no zCDP, add/remove unless μ-GDP only."""
    return composed_without_zcdp(mechanism) and add_remove_or_gdp_only(mechanism)


def dp_accounting_rdp(mechanism: MechanismDescription) -> bool:
    """What dp_accounting's RDP accountant prices: no zCDP event, add/remove unless μ-GDP only (a random-count
    search included, as its repeat-and-select event)."""
    return without_zcdp(mechanism) and add_remove_or_gdp_only(mechanism)


def random_count_without_zcdp(mechanism: MechanismDescription) -> bool:
    """A best-of-K search with a random K and no zCDP event: the Papernot–Steinke accountants' mechanisms."""
    return without_zcdp(mechanism) and random_selection(mechanism)


def zcdp_composed(mechanism: MechanismDescription) -> bool:
    """A ρ-zCDP event (seed 002's one-pass DP-SGD) with μ-GDP events, composed (no random count)."""
    return has_zcdp(mechanism) and not random_selection(mechanism)


def full_batch_gaussian(mechanism: MechanismDescription) -> bool:
    """Full-batch (q = 1) Gaussian steps, with μ-GDP events beside them, composed (no random count): what the
    moments accountant's closed form prices (seed 002's DP-GD certificate)."""
    if random_selection(mechanism) or has_zcdp(mechanism):
        return False
    events = mechanism.composed_events()
    steps = [e for e in events if isinstance(e, PoissonGaussianSteps)]
    return (
        bool(steps)
        and all(e.sample_rate == 1.0 for e in steps)
        and all(isinstance(e, (PoissonGaussianSteps, GaussianDP)) for e in events)
    )
