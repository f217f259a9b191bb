"""Accountants: interpret a :class:`MechanismDescription` and return ε at a given δ.

The one entry point is :func:`certify`. It asks every applicable accountant, records each
answer (or its failure), and certifies the smallest ε among the answers that are valid upper
bounds:

- ``dp_accounting.pld`` — privacy loss distribution of the Poisson-subsampled Gaussian
  (Koskela et al. 2020; Doroshenko et al. 2022), composed by FFT. dp_accounting discretises
  *pessimistically* (connect-the-dots / rounding up), so its ε is an upper bound on the true ε
  of the mechanism; it is tight to ≈ the discretisation interval. Supports both relations.
- ``autodp.rdp`` — Rényi DP of the Poisson-subsampled Gaussian (Zhu & Wang 2019, Thm 8 with
  ``improved_bound_flag``), composed additively over orders α and converted with the optimal
  RDP→(ε, δ) conversion. An upper bound, typically 10–20% above the PLD's. Add/remove only:
  autodp's Poisson amplification is undefined for replace-one, and that is recorded.
- ``prv_accountant.prv`` — Microsoft's privacy random variable accountant (Gopi et al. 2021);
  its *upper* bound (estimate + error) is the value used. Add/remove only; it fails on some
  large-ε settings, which is recorded, never hidden.
- ``dp_accounting.rdp`` — Mironov et al. 2019's RDP of the same mechanism: an independent
  cross-check, not used for the certificate (it never beats autodp's improved bound by much).

A hyperparameter search with a *fixed* number of candidates is priced by every accountant above
as the composition of the candidates. One with a *random* number of candidates is priced by
Papernot & Steinke's RDP theorems (:mod:`dpml.accounting.tuning`) on the base algorithm's RDP curve:
``papernot_steinke.rdp[dp_accounting]`` (curve from dp_accounting, Poisson δ̂ from the PLD) and
``papernot_steinke.rdp[autodp]`` (curve from autodp) certify; ``dp_accounting.rdp`` then answers
with dp_accounting's own implementation of the same theorems (``RepeatAndSelectDpEvent``), the
cross-check. PLD, PRV and plain autodp decline (recorded), having no analysis for it.

A μ-GDP event (NoisyCGD's hidden-state bound) is exactly a Gaussian mechanism with sensitivity 1
and std 1/μ: ``gdp.exact`` converts it with the closed-form profile (:mod:`dpml.accounting.gdp`) when
the mechanism is GDP only (μ's compose as sqrt(Σμ²)); dp_accounting (PLD and RDP) and autodp price
it as that Gaussian mechanism — the independent checks, and the way it composes with DP-SGD spends
in the ledger. (dp_accounting's PLD gives a plain Gaussian event sensitivity 2 under replace-one
but its RDP accountant keeps 1; the translation below compensates for each.)

The smallest valid upper bound is itself a valid upper bound, hence the certified ε.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version
from collections.abc import Iterator
from typing import Any, Callable

import numpy as np

from dpml.formatting import format_epsilon
from dpml.accounting.kl_certificate import certify_kl
from dpml.accounting.mechanism import (
    ConcentratedDP,
    Event,
    GaussianDP,
    GaussianEvent,
    MechanismDescription,
    gaussian_only,
)
from dpml.accounting import tuning
from dpml.accounting.prv import epsilon_prv_upper
from dpml.accounting.closed_forms import (
    epsilon_autodp_zcdp,
    epsilon_gdp_exact,
    epsilon_moments_closed_form,
    epsilon_zcdp_closed_form,
    epsilon_zcdp_rdp,
    has_zcdp,
)
from dpml.accounting.supports import (
    autodp_composition,
    composed_without_zcdp,
    dp_accounting_rdp,
    full_batch_gaussian,
    gdp_only,
    random_count_without_zcdp,
    subsampled_gaussian_add_remove,
    zcdp_composed,
)

PLD_DISCRETIZATION = 1e-4


@dataclass(frozen=True)
class AccountantAnswer:
    name: str
    version: str
    epsilon: float | None
    error: str | None
    seconds: float
    used_for_certificate: bool


def _dp_events(mechanism: MechanismDescription, with_selection: bool = False, for_pld: bool = True) -> Any:
    """dp_accounting's DpEvent for the mechanism (the random-count selection only on request).

    A μ-GDP event becomes ``GaussianDpEvent(1/μ)``; for the PLD accountant under replace-one, which
    gives a plain Gaussian sensitivity 2, ``GaussianDpEvent(2/μ)`` (μ already covers the relation).
    """
    import dp_accounting  # lazy: when this accountant is asked

    gaussian_scale = 2.0 if for_pld and mechanism.neighbouring == "replace-one" else 1.0

    def one(e: GaussianEvent) -> Any:
        if isinstance(e, GaussianDP):
            return dp_accounting.GaussianDpEvent(gaussian_scale / e.mu)
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(e.sample_rate, dp_accounting.GaussianDpEvent(e.noise_multiplier)),
            e.steps,
        )

    def event(events: tuple[Event, ...]) -> Any:
        parts = [one(e) for e in gaussian_only(events)]
        return parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts)

    selection = mechanism.selection
    if with_selection and selection is not None and selection.random:
        shape = math.inf if selection.distribution == "poisson" else selection.shape
        return dp_accounting.dp_event.RepeatAndSelectDpEvent(event(mechanism.events), selection.mean, shape)
    return event(mechanism.composed_events())


def _relation(mechanism: MechanismDescription) -> Any:
    import dp_accounting  # lazy: when this accountant is asked

    return {
        "add-remove": dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        "replace-one": dp_accounting.NeighboringRelation.REPLACE_ONE,
    }[mechanism.neighbouring]


def epsilon_pld(mechanism: MechanismDescription, delta: float, discretization: float = PLD_DISCRETIZATION) -> float:
    """ε(δ) from dp_accounting's PLD accountant (pessimistic discretisation: an upper bound).

    A pure function of the events, the neighbouring relation, the selection, δ and the discretisation,
    so it is computed once per process for each (the train stage's reservation, the certificate and the
    ledger's composition of one spend price the same mechanism; each PLD takes seconds)."""
    try:
        return _epsilon_pld_once(
            mechanism.events, mechanism.neighbouring, mechanism.selection, float(delta), float(discretization)
        )
    except TypeError:  # an event that cannot be hashed: priced without the memo
        return _pld_epsilon(mechanism, delta, discretization)


@functools.lru_cache(maxsize=512)
def _epsilon_pld_once(
    events: tuple[Event, ...], neighbouring: str, selection: Any, delta: float, discretization: float
) -> float:
    mechanism = MechanismDescription(
        trainer="",
        events=events,
        neighbouring=neighbouring,  # type: ignore[arg-type]
        clip_norm=1.0,
        dataset_size=1,
        selection=selection,
    )
    return _pld_epsilon(mechanism, delta, discretization)


def _pld_epsilon(mechanism: MechanismDescription, delta: float, discretization: float) -> float:
    from dp_accounting.pld import pld_privacy_accountant  # lazy: when this accountant is asked

    accountant = pld_privacy_accountant.PLDAccountant(
        _relation(mechanism), value_discretization_interval=discretization
    )
    accountant.compose(_dp_events(mechanism))
    return float(accountant.get_epsilon(delta))


def epsilon_autodp_rdp(mechanism: MechanismDescription, delta: float) -> float:
    """ε(δ) from autodp: RDP of each Poisson-subsampled Gaussian, composed, then converted."""
    events = mechanism.gaussian_events()
    with warnings.catch_warnings():  # autodp's order search divides by zero on flat stretches; harmless
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(_autodp_mechanism(mechanism.neighbouring, events).get_approxDP(delta))


def _autodp_mechanism(neighbouring: str, events: tuple[GaussianEvent, ...]) -> Any:
    """autodp's composition; a μ-GDP event is its Gaussian mechanism with σ = 1/μ (any relation)."""
    if neighbouring != "add-remove" and not all(isinstance(e, GaussianDP) for e in events):
        raise NotImplementedError("autodp's Poisson-sampling RDP bound holds for add/remove neighbouring only")
    from autodp.mechanism_zoo import GaussianMechanism  # lazy: when this accountant is asked
    from autodp.transformer_zoo import AmplificationBySampling, Composition  # lazy: when this accountant is asked

    amplify = AmplificationBySampling(PoissonSampling=True)
    steps = [
        GaussianMechanism(sigma=1.0 / e.mu)
        if isinstance(e, GaussianDP)
        else GaussianMechanism(sigma=e.noise_multiplier)
        if e.sample_rate == 1.0
        else amplify(GaussianMechanism(sigma=e.noise_multiplier), e.sample_rate, improved_bound_flag=True)
        for e in events
    ]
    return Composition()(steps, [1 if isinstance(e, GaussianDP) else e.steps for e in events])


NOT_CONVERGED = "_compute_log_a_frac failed to converge"


class _NonConvergingOrders(logging.Filter):
    """Drops dp_accounting's one warning that an RDP order's series did not converge, and counts them. The order is
    then excluded from the minimum over orders (its RDP is taken as ∞), so ε can only come out larger: safe, and
    no reason to print seven lines a call. Every other record passes."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(NOT_CONVERGED):
            self.dropped += 1
            return False
        return True


@contextlib.contextmanager
def non_converging_orders_unlogged() -> Iterator[_NonConvergingOrders]:
    """Inside the block, absl's logger drops only :class:`_NonConvergingOrders`' warning (no level changed)."""
    absl, dropped = logging.getLogger("absl"), _NonConvergingOrders()
    absl.addFilter(dropped)
    try:
        yield dropped
    finally:
        absl.removeFilter(dropped)


def epsilon_dp_accounting_rdp(mechanism: MechanismDescription, delta: float) -> float:
    """ε(δ) from dp_accounting's RDP accountant (cross-check; add/remove only for Poisson)."""
    from dp_accounting.rdp import rdp_privacy_accountant  # lazy: when this accountant is asked

    accountant = rdp_privacy_accountant.RdpAccountant(neighboring_relation=_relation(mechanism))
    with non_converging_orders_unlogged():
        accountant.compose(_dp_events(mechanism, with_selection=True, for_pld=False))
    return float(accountant.get_epsilon(delta))


def _random_selection(mechanism: MechanismDescription) -> Any:
    selection = mechanism.selection
    if selection is None or not selection.random:
        raise NotImplementedError("not a random-count selection (the other accountants price this mechanism)")
    if mechanism.neighbouring != "add-remove" and not all(isinstance(e, GaussianDP) for e in mechanism.events):
        raise NotImplementedError(
            "the RDP of Poisson subsampling used for random-count selection is add/remove only "
            "(a mechanism of μ-GDP events has the exact curve αμ²/2 under either relation)"
        )
    return selection


def base_rdp_dp_accounting(mechanism: MechanismDescription, orders: tuple[float, ...] = tuning.ORDERS) -> np.ndarray:
    """RDP curve of the events (one candidate, no selection), from dp_accounting (Mironov et al. 2019)."""
    from dp_accounting.rdp import rdp_privacy_accountant  # lazy: when this accountant is asked

    base = replace(mechanism, selection=None)  # one candidate
    accountant = rdp_privacy_accountant.RdpAccountant(list(orders), _relation(base))
    with non_converging_orders_unlogged():  # orders near 1 that fail to converge are set to ∞ (safe)
        accountant.compose(_dp_events(base, for_pld=False))
    return np.asarray(accountant._rdp, dtype=float)  # the composed curve (dp_accounting keeps it here)


def mechanism_rdp_curve(mechanism: MechanismDescription) -> np.ndarray:
    """RDP curve (on :data:`tuning.ORDERS`) of any (ε, δ) mechanism: a search's Papernot–Steinke curve,
    zCDP events' ρα plus dp_accounting's curve of the other events, or dp_accounting's curve."""
    if mechanism.selection is not None:
        return selection_rdp_curve(mechanism)
    zcdp = sum(e.rho for e in mechanism.events if isinstance(e, ConcentratedDP))
    others = tuple(e for e in mechanism.events if not isinstance(e, ConcentratedDP))
    curve = zcdp * np.asarray(tuning.ORDERS, dtype=float)
    return curve + base_rdp_dp_accounting(replace(mechanism, events=others)) if others else curve


def base_rdp_autodp(mechanism: MechanismDescription, orders: tuple[float, ...] = tuning.ORDERS) -> np.ndarray:
    """RDP curve of the events (one candidate, no selection), from autodp (Zhu & Wang 2019)."""
    composed = _autodp_mechanism(mechanism.neighbouring, gaussian_only(mechanism.events))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.array([float(composed.get_RDP(order)) for order in orders])


def base_delta_profile(
    mechanism: MechanismDescription, discretization: float = PLD_DISCRETIZATION
) -> Callable[[np.ndarray], np.ndarray]:
    """δ(ε) of one candidate from the PLD (pessimistic: upper bounds), vectorised over ε."""
    from dp_accounting.pld import pld_privacy_accountant  # lazy: when this accountant is asked

    base = replace(mechanism, selection=None)  # one candidate
    accountant = pld_privacy_accountant.PLDAccountant(_relation(base), value_discretization_interval=discretization)
    accountant.compose(_dp_events(base))
    pld = accountant._pld  # the composed PLD (dp_accounting keeps it here); vectorised δ(ε)

    def profile(epsilons: np.ndarray) -> np.ndarray:
        epsilons = np.asarray(epsilons, dtype=float)
        order = np.argsort(epsilons)  # dp_accounting wants them ascending
        out = np.empty_like(epsilons)
        out[order] = pld.get_delta_for_epsilon(epsilons[order].tolist())
        return out

    return profile


def selection_rdp_curve(
    mechanism: MechanismDescription, curve: str = "dp_accounting", discretization: float = PLD_DISCRETIZATION
) -> np.ndarray:
    """RDP curve (on :data:`tuning.ORDERS`) of the whole mechanism, selection included."""
    base = base_rdp_dp_accounting(mechanism) if curve == "dp_accounting" else base_rdp_autodp(mechanism)
    if mechanism.selection is None:
        return base
    poisson = mechanism.selection.distribution == "poisson"
    delta_hat = base_delta_profile(mechanism, discretization) if poisson else None
    return tuning.selection_rdp(tuning.ORDERS, base, mechanism.selection, delta_hat)


def epsilon_selection_dp_accounting(mechanism: MechanismDescription, delta: float) -> float:
    """Papernot–Steinke on dp_accounting's base RDP curve, Poisson δ̂ from the PLD."""
    _random_selection(mechanism)
    return tuning.rdp_to_epsilon(tuning.ORDERS, selection_rdp_curve(mechanism, "dp_accounting"), delta)


def epsilon_selection_autodp(mechanism: MechanismDescription, delta: float) -> float:
    """Papernot–Steinke on autodp's base RDP curve, Poisson δ̂ from the PLD."""
    _random_selection(mechanism)
    return tuning.rdp_to_epsilon(tuning.ORDERS, selection_rdp_curve(mechanism, "autodp"), delta)


def tight_epsilon(mechanism: MechanismDescription, delta: float, discretization: float = PLD_DISCRETIZATION) -> float:
    """The tightest valid upper bound cheap enough for the ledger and calibration.

    PLD when the mechanism is a composition; Papernot–Steinke on dp_accounting's RDP otherwise.
    A coarser ``discretization`` is faster and still an upper bound (pessimistic PLD).
    """
    if mechanism.guarantee == "kl":
        return float("inf")  # KL privacy gives no finite ε (seed 000): dpml.accounting.kl_certificate
    if has_zcdp(mechanism):
        return epsilon_zcdp_rdp(mechanism, delta)
    if mechanism.selection is not None and mechanism.selection.random:
        _random_selection(mechanism)
        curve = selection_rdp_curve(mechanism, "dp_accounting", discretization)
        return tuning.rdp_to_epsilon(tuning.ORDERS, curve, delta)
    if all(isinstance(e, GaussianDP) for e in mechanism.events):
        return epsilon_gdp_exact(mechanism, delta)
    return epsilon_pld(mechanism, delta, discretization)


@dataclass(frozen=True)
class Accountant:
    """One accountant the certificate asks, shaped like dp_accounting's (an interpreter of mechanism
    descriptions that says which it supports): ``epsilon(mechanism, δ)``; ``supports(mechanism)``, the
    descriptions it models (it is asked about those only, so that none answers for what it does not model: a
    random-count search, a zCDP event); ``certifying``, whether its answer may be the certificate (else a
    cross-check, recorded beside it); ``distribution``, the package whose version is recorded with its answer."""

    name: str
    distribution: str
    epsilon: Callable[[MechanismDescription, float], float]
    supports: Callable[[MechanismDescription], bool]
    certifying: bool = True


ACCOUNTANTS: dict[str, Accountant] = {}


def register_accountant(accountant: Accountant) -> Accountant:
    """Add an accountant under its name (a plugin module listed under ``plugins:`` calls this); a second one of
    the same name is refused. Every registered accountant that supports a mechanism is asked about it."""
    if accountant.name in ACCOUNTANTS and ACCOUNTANTS[accountant.name] != accountant:
        raise ValueError(f"an accountant named {accountant.name!r} is already registered")
    ACCOUNTANTS[accountant.name] = accountant
    return accountant


for _accountant in (
    Accountant("gdp.exact", "scipy", epsilon_gdp_exact, gdp_only),
    Accountant("moments_accountant.closed_form", "scipy", epsilon_moments_closed_form, full_batch_gaussian),
    Accountant("zcdp.rdp[dp_accounting]", "dp-accounting", epsilon_zcdp_rdp, zcdp_composed),
    Accountant("zcdp.bun_steinke", "scipy", epsilon_zcdp_closed_form, zcdp_composed),
    Accountant("autodp.zcdp", "autodp", epsilon_autodp_zcdp, zcdp_composed),
    Accountant("dp_accounting.pld", "dp-accounting", epsilon_pld, composed_without_zcdp),
    Accountant("prv_accountant.prv", "prv-accountant", epsilon_prv_upper, subsampled_gaussian_add_remove),
    Accountant("autodp.rdp", "autodp", epsilon_autodp_rdp, autodp_composition),
    Accountant("dp_accounting.rdp", "dp-accounting", epsilon_dp_accounting_rdp, dp_accounting_rdp, certifying=False),
    Accountant(
        "papernot_steinke.rdp[dp_accounting]",
        "dp-accounting",
        epsilon_selection_dp_accounting,
        random_count_without_zcdp,
    ),
    Accountant("papernot_steinke.rdp[autodp]", "autodp", epsilon_selection_autodp, random_count_without_zcdp),
):
    register_accountant(_accountant)


def ask_accountants(mechanism: MechanismDescription, delta: float) -> list[AccountantAnswer]:
    """The answer of every registered accountant that supports the mechanism; a failure is recorded with its
    message, never hidden."""
    answers = []
    epsilon: float | None
    for accountant in ACCOUNTANTS.values():
        if not accountant.supports(mechanism):
            continue
        start = time.perf_counter()
        try:
            epsilon, error = accountant.epsilon(mechanism, delta), None
            if not math.isfinite(epsilon) or epsilon < 0:
                epsilon, error = None, f"returned a non-finite or negative ε ({epsilon})"
        except Exception as exc:  # each accountant's own failure modes; recorded, not raised
            epsilon, error = None, f"{type(exc).__name__}: {exc}"
        answers.append(
            AccountantAnswer(
                accountant.name,
                version(accountant.distribution),
                epsilon,
                error,
                time.perf_counter() - start,
                accountant.certifying,
            )
        )
    return answers


def certify(mechanism: MechanismDescription, delta: float) -> dict[str, Any]:
    """The certificate: the smallest ε among certifying accountants, with every input and answer."""
    if not 0 < delta < 1:
        raise ValueError(f"delta = {delta}: must be in (0, 1)")
    if mechanism.guarantee == "kl":  # seed 000's noisy GD: a KL certificate, ε = ∞
        return certify_kl(mechanism, delta)
    answers = ask_accountants(mechanism, delta)
    valid = [a for a in answers if a.used_for_certificate and a.epsilon is not None]
    if not valid:
        details = "; ".join(f"{a.name}: {a.error}" for a in answers)
        raise RuntimeError(f"no accountant could certify this mechanism ({details})")
    best = min(valid, key=lambda a: a.epsilon)  # type: ignore[arg-type, return-value]
    relation = "add-or-remove-one" if mechanism.neighbouring == "add-remove" else "replace-one"
    iterates = "every intermediate model" if mechanism.threat_model == "all-iterates" else "the final model only"
    if mechanism.selection is not None:
        iterates += f", including the hyperparameter search ({mechanism.selection.describe()}, the best released)"
    return {
        "epsilon": best.epsilon,
        "delta": delta,
        "accountant": best.name,
        "accountant_version": best.version,
        "neighbouring": mechanism.neighbouring,
        "threat_model": mechanism.threat_model,
        "statement": (
            f"({format_epsilon(best.epsilon)}, {delta:g})-DP under {relation} neighbouring, for {iterates}, "
            f"accountant {best.name} {best.version}"
        ),
        "answers": [asdict(a) for a in answers],
        "mechanism": mechanism.to_dict(),
    }
