"""Calibration: the smallest noise multiplier σ whose certified ε meets a target.

ε(σ) is decreasing in σ for the Poisson-subsampled Gaussian, so bisection applies. The search
keeps the invariant ε(σ_hi) ≤ target with ε from a *pessimistic* (upper-bounding) accountant,
and returns σ_hi: calibration never lands on the unsafe side. The bracket comes from autodp's
RDP bound (fast, and ≥ the PLD's ε, so σ_RDP is always safe), then the PLD accountant with a
coarse pessimistic discretisation narrows it to a relative tolerance.

For a hyperparameter search the mechanism also has fixed extra events (the noisy validation
score) and a :class:`Selection`; ε(σ) is then the search's total (composition for a fixed count,
Papernot–Steinke for a random one), still decreasing in σ, still an upper bound at every step.
"""

from __future__ import annotations

from dpml.privacy.accountants import epsilon_autodp_rdp, epsilon_pld, tight_epsilon
from dpml.privacy.mechanism import MechanismDescription, Neighbouring, PoissonGaussianSteps, Selection

SEARCH_DISCRETIZATION = 1e-3


def _mechanism(sigma: float, sample_rate: float, steps: int, neighbouring: Neighbouring,
               extra: tuple[PoissonGaussianSteps, ...] = (), selection: Selection | None = None) -> MechanismDescription:
    return MechanismDescription(
        trainer="calibration", events=(PoissonGaussianSteps(sample_rate, sigma, steps), *extra),
        neighbouring=neighbouring, clip_norm=1.0, dataset_size=0, selection=selection,
    )


def _epsilon(sigma: float, sample_rate: float, steps: int, delta: float, neighbouring: Neighbouring,
             extra: tuple[PoissonGaussianSteps, ...] = (), selection: Selection | None = None) -> float:
    mechanism = _mechanism(sigma, sample_rate, steps, neighbouring, extra, selection)
    if selection is not None or extra:
        return tight_epsilon(mechanism, delta, SEARCH_DISCRETIZATION)
    return epsilon_pld(mechanism, delta, SEARCH_DISCRETIZATION)


def calibrate_noise_multiplier(target_epsilon: float, sample_rate: float, steps: int, delta: float,
                               neighbouring: Neighbouring = "add-remove", rel_tol: float = 1e-3,
                               extra: tuple[PoissonGaussianSteps, ...] = (),
                               selection: Selection | None = None) -> float:
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
            raise ValueError(f"target_epsilon = {target_epsilon}: unreachable even with σ = 1e4 (the search's "
                             "other costs alone exceed it)")
        hi = 0.5
        while eps(hi) > target_epsilon:
            hi *= 2.0
    elif neighbouring == "add-remove":
        hi = 0.5
        while epsilon_autodp_rdp(_mechanism(hi, sample_rate, steps, neighbouring), delta) > target_epsilon:
            hi *= 1.5
            if hi > 1e4:
                raise ValueError(f"target_epsilon = {target_epsilon}: unreachable with σ ≤ 1e4 (q={sample_rate}, T={steps})")
    else:
        hi = 0.5
        while _epsilon(hi, sample_rate, steps, delta, neighbouring) > target_epsilon:
            hi *= 2.0
            if hi > 1e4:
                raise ValueError(f"target_epsilon = {target_epsilon}: unreachable with σ ≤ 1e4 (q={sample_rate}, T={steps})")
    lo = hi / 2.0
    while lo > 1e-3 and eps(lo) <= target_epsilon:
        hi, lo = lo, lo / 2.0
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        if eps(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def calibrate_steps(target_epsilon: float, sample_rate: float, noise_multiplier: float, delta: float,
                    neighbouring: Neighbouring = "add-remove", max_steps: int = 10_000_000) -> int:
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
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good
