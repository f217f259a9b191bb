"""Calibration: the smallest noise multiplier σ whose certified ε meets a target.

ε(σ) is decreasing in σ for the Poisson-subsampled Gaussian, so bisection applies. The search
keeps the invariant ε(σ_hi) ≤ target with ε from a *pessimistic* (upper-bounding) accountant,
and returns σ_hi: calibration never lands on the unsafe side. The bracket comes from autodp's
RDP bound (fast, and ≥ the PLD's ε, so σ_RDP is always safe), then the PLD accountant with a
coarse pessimistic discretisation narrows it to 1%, and a false-position search at the
certificate's own discretisation (its error grows with the number of steps, so the coarse answer
alone can be several % loose over 10⁵ steps) finishes to a relative tolerance: every point it
returns was evaluated and found ≤ target.

For a hyperparameter search the mechanism also has fixed extra events (the noisy validation
score) and a :class:`Selection`; ε(σ) is then the search's total (composition for a fixed count,
Papernot–Steinke for a random one), still decreasing in σ, still an upper bound at every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dpml.accounting.accountants import PLD_DISCRETIZATION, epsilon_autodp_rdp, epsilon_pld, tight_epsilon
from dpml.accounting.mechanism import Event, MechanismDescription, Neighbouring, PoissonGaussianSteps, Selection

SEARCH_DISCRETIZATION = 1e-3


def _mechanism(
    sigma: float,
    sample_rate: float,
    steps: int,
    neighbouring: Neighbouring,
    extra: tuple[Event, ...] = (),
    selection: Selection | None = None,
) -> MechanismDescription:
    return MechanismDescription(
        trainer="calibration",
        events=(PoissonGaussianSteps(sample_rate, sigma, steps), *extra),
        neighbouring=neighbouring,
        clip_norm=1.0,
        dataset_size=0,
        selection=selection,
    )


def _epsilon(
    sigma: float,
    sample_rate: float,
    steps: int,
    delta: float,
    neighbouring: Neighbouring,
    extra: tuple[Event, ...] = (),
    selection: Selection | None = None,
    discretization: float = SEARCH_DISCRETIZATION,
) -> float:
    mechanism = _mechanism(sigma, sample_rate, steps, neighbouring, extra, selection)
    if selection is not None or extra:
        return tight_epsilon(mechanism, delta, discretization)
    return epsilon_pld(mechanism, delta, discretization)


def _illinois(
    g: Callable[[float], float],
    good: float,
    bad: float,
    g_good: float,
    g_bad: float,
    done: Callable[[float, float], bool],
    integer: bool = False,
) -> float:
    """Shrink a bracket of a monotone g (g(good) ≤ 0 < g(bad)) by the Illinois false-position method.

    Returns the last ``good`` point: g(good) ≤ 0 was *evaluated*, so the answer is never on the
    unsafe side. ``done(good, bad)`` says when the bracket is tight enough.
    """
    side = 0
    while not done(good, bad):
        guess = good - g_good * (bad - good) / (g_bad - g_good)
        margin = 0.02 * (bad - good)
        guess = min(max(guess, min(good, bad) + margin), max(good, bad) - margin)
        if integer:
            guess = float(min(max(round(guess), min(good, bad) + 1), max(good, bad) - 1))
        value = g(guess)
        if value <= 0:
            good, g_good = guess, value
            if side == -1:
                g_bad /= 2.0
            side = -1
        else:
            bad, g_bad = guess, value
            if side == 1:
                g_good /= 2.0
            side = 1
    return good


def calibrate_noise_multiplier(
    target_epsilon: float,
    sample_rate: float,
    steps: int,
    delta: float,
    neighbouring: Neighbouring = "add-remove",
    rel_tol: float = 1e-3,
    extra: tuple[Event, ...] = (),
    selection: Selection | None = None,
) -> float:
    """Smallest σ (to ``rel_tol``) with ε(σ; q, T, δ) ≤ ``target_epsilon``; always on the safe side.

    ε is the PLD's for plain DP-SGD; with ``extra`` events or a ``selection`` it is the whole
    search's (see the module docstring).
    """
    if target_epsilon <= 0:
        raise ValueError(f"target_epsilon = {target_epsilon}: must be > 0")
    if not 0 < delta < 1:
        raise ValueError(f"delta = {delta}: must be in (0, 1)")

    def eps(sigma: float) -> float:
        return _epsilon(sigma, sample_rate, steps, delta, neighbouring, extra, selection)

    if extra or selection is not None:
        if eps(1e4) > target_epsilon:
            raise ValueError(
                f"target_epsilon = {target_epsilon}: unreachable even with σ = 1e4 (the search's "
                "other costs alone exceed it)"
            )
        hi = 0.5
        while eps(hi) > target_epsilon:
            hi *= 2.0
    elif neighbouring == "add-remove":
        hi = 0.5
        while epsilon_autodp_rdp(_mechanism(hi, sample_rate, steps, neighbouring), delta) > target_epsilon:
            hi *= 1.5
            if hi > 1e4:
                raise ValueError(
                    f"target_epsilon = {target_epsilon}: unreachable with σ ≤ 1e4 (q={sample_rate}, T={steps})"
                )
    else:
        hi = 0.5
        while _epsilon(hi, sample_rate, steps, delta, neighbouring) > target_epsilon:
            hi *= 2.0
            if hi > 1e4:
                raise ValueError(
                    f"target_epsilon = {target_epsilon}: unreachable with σ ≤ 1e4 (q={sample_rate}, T={steps})"
                )
    lo = hi / 2.0
    while lo > 1e-3 and eps(lo) <= target_epsilon:
        hi, lo = lo, lo / 2.0
    while hi - lo > 1e-2 * hi:  # coarse bracket: fast, pessimistic, so hi is safe
        mid = 0.5 * (lo + hi)
        if eps(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return _refine_sigma(hi, target_epsilon, rel_tol, sample_rate, steps, delta, neighbouring, extra, selection)


def _refine_sigma(
    hi: float,
    target: float,
    rel_tol: float,
    sample_rate: float,
    steps: int,
    delta: float,
    neighbouring: Neighbouring,
    extra: tuple[Event, ...],
    selection: Selection | None,
) -> float:
    """Second phase at the certificate's own discretisation (the coarse one over-states ε over many
    steps, which made σ loose): false position on log ε(σ) − log target from the coarse answer."""

    def g(sigma: float) -> float:
        return math.log(
            _epsilon(sigma, sample_rate, steps, delta, neighbouring, extra, selection, PLD_DISCRETIZATION) / target
        )

    g_hi = g(hi)
    while g_hi > 0:  # the coarse answer is safe for the coarse accountant; make sure for the fine one
        hi *= 1.01
        g_hi = g(hi)
    lo = hi * 0.97
    g_lo = g(lo)
    while g_lo <= 0:
        hi, g_hi, lo = lo, g_lo, lo * 0.9
        g_lo = g(lo)
    return _illinois(g, hi, lo, g_hi, g_lo, lambda good, bad: good - bad <= rel_tol * good)


def calibrate_steps(
    target_epsilon: float,
    sample_rate: float,
    noise_multiplier: float,
    delta: float,
    neighbouring: Neighbouring = "add-remove",
    max_steps: int = 10_000_000,
) -> int:
    """The largest number of steps T with ε_PLD(σ; q, T, δ) ≤ ``target_epsilon`` (0 if even one step is over).

    ε is increasing in T; doubling finds a bracket, bisection the exact integer, every comparison
    with the pessimistic (upper-bounding) PLD, so the answer is never on the unsafe side.
    """
    if target_epsilon <= 0:
        raise ValueError(f"target_epsilon = {target_epsilon}: must be > 0")

    def fits(steps: int) -> bool:
        return _epsilon(noise_multiplier, sample_rate, steps, delta, neighbouring) <= target_epsilon

    if not fits(1):
        return 0
    good, bad = 1, 2
    while fits(bad):
        good, bad = bad, bad * 2
        if bad > max_steps:
            return max_steps
    while bad - good > max(1, good // 100):  # coarse bracket (pessimistic: good is safe)
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)

    def g(steps: float) -> float:  # at the certificate's discretisation
        return math.log(
            _epsilon(noise_multiplier, sample_rate, int(steps), delta, neighbouring, discretization=PLD_DISCRETIZATION)
            / target_epsilon
        )

    g_good = g(good)
    while g_good > 0 and good > 1:
        good = max(1, int(good * 0.99))
        g_good = g(good)
    if g_good > 0:
        return 0
    bad = max(bad, good + 1)
    g_bad = g(bad)
    while g_bad <= 0:
        good, g_good, bad = bad, g_bad, min(int(bad * 1.05) + 1, max_steps + 1)
        if good >= max_steps:
            return max_steps
        g_bad = g(bad)
    return int(_illinois(g, good, bad, g_good, g_bad, lambda a, b: b - a <= 1, integer=True))
