"""What a private hyperparameter search costs, before it runs: its mechanism description (the candidates'
events, the noisy validation score as a trainer states it, the random count of candidates) and the noise
that makes the whole search meet ``dp.target_epsilon``. The trainers' ``search_plan`` methods call these;
the search itself (:mod:`dpml.train.search`, whose docstring has the analysis) runs above the registry.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from dpml.accounting.accountants import tight_epsilon
from dpml.accounting.calibrate import calibrate_noise_multiplier
from dpml.accounting.mechanism import GaussianDP, MechanismDescription, Selection
from dpml.train.dpsgd import dpsgd_mechanism, number_of_steps
from dpml.train.protocol import SearchPlan, Trainer

if TYPE_CHECKING:
    from dpml.config import Config


def selection_of(config: Config) -> Selection:
    return Selection(config.tune.distribution, config.tune.mean, config.tune.shape)


def random_count_relation_problems(config: Config) -> list[str]:
    """Papernot & Steinke's random-count theorem is certified here for add-remove only."""
    if config.tune.distribution != "fixed" and config.dp.neighbouring != "add-remove":
        return [
            f"dp.neighbouring = {config.dp.neighbouring!r}: a random-count search "
            f"(tune.distribution = {config.tune.distribution}) is certified for add-remove only; "
            "use add-remove or tune.distribution: fixed"
        ]
    return []


def _search_notes(config: Config, n_fit: int, score: str) -> tuple[str, ...]:
    return (
        f"each candidate trains on the {n_fit} non-validation records and is scored by its validation "
        f"count of correct answers plus N(0, {config.tune.score_noise:g}²) (second event; {score})",
        "the number of candidates, the losing candidates and their scores are secret and never logged",
        f"search space {config.tune.space}",
    )


def poisson_gaussian_search_mechanism(
    trainer: Trainer, config: Config, noise_multiplier: float, n_fit: int, n_total: int
) -> MechanismDescription:
    """What a search over DP-SGD candidates does to the n_total training records: the candidates'
    Poisson-Gaussian steps at σ = ``noise_multiplier``, the noisy score, the random count."""
    candidate = dpsgd_mechanism(
        config.train.sample_rate,
        noise_multiplier,
        config.train.epochs,
        config.dp.neighbouring,
        config.dp.clip_norm,
        n_fit,
    )
    return MechanismDescription(
        trainer="dpsgd-search",
        events=(*candidate.events, trainer.score_event(config)),
        neighbouring=config.dp.neighbouring,
        clip_norm=config.dp.clip_norm,
        dataset_size=n_total,
        threat_model=candidate.threat_model,
        notes=(*candidate.notes, *_search_notes(config, n_fit, "sensitivity 1, over-counted as 2 under replace-one")),
        selection=selection_of(config),
    )


def poisson_gaussian_search_plan(trainer: Trainer, config: Config, n_fit: int, n_total: int) -> SearchPlan:
    """σ from the config, or calibrated so that the whole search (candidates, score, selection) meets the target."""
    sigma = config.dp.noise_multiplier
    if sigma is None:
        assert config.dp.target_epsilon is not None
        steps = number_of_steps(config.train.epochs, config.train.sample_rate)
        sigma = calibrate_noise_multiplier(
            config.dp.target_epsilon,
            config.train.sample_rate,
            steps,
            config.dp.delta,
            config.dp.neighbouring,
            extra=(trainer.score_event(config),),
            selection=selection_of(config),
        )
    return SearchPlan(poisson_gaussian_search_mechanism(trainer, config, sigma, n_fit, n_total), sigma)


def noisycgd_search_mechanism(
    trainer: Trainer, config: Config, n_fit: int, n_total: int, base_mu: float
) -> MechanismDescription:
    """What a search over NoisyCGD candidates does: one ``base_mu``-GDP event (every candidate's λ is
    calibrated to it), the (1/τ)-GDP score, the random count."""
    notes = (
        f"NoisyCGD candidates (Koskela): σ = {config.dp.noise_multiplier:g}, b = {config.noisycgd.batch_size}, "
        f"E = {int(config.train.epochs)}; each candidate's λ calibrated so that its Theorem 2.8 μ ≤ {base_mu:.6g}",
        "hidden state: only the released candidate's final iterate is released",
    )
    return MechanismDescription(
        trainer="noisycgd-search",
        events=(GaussianDP(base_mu), trainer.score_event(config)),
        neighbouring=config.dp.neighbouring,
        clip_norm=config.dp.clip_norm,
        dataset_size=n_total,
        threat_model="final-model",
        notes=(*notes, *_search_notes(config, n_fit, "(1/τ)-GDP")),
        selection=selection_of(config),
    )


def calibrate_base_mu(trainer: Trainer, config: Config, n_fit: int, n_total: int) -> float:
    """The largest μ_base for which the whole NoisyCGD search meets ``dp.target_epsilon`` (bisection on the
    certificate's own ε, which grows with μ; the lower end is returned, so the target always holds)."""
    assert config.dp.noise_multiplier is not None and config.dp.target_epsilon is not None
    target = config.dp.target_epsilon

    def epsilon(mu: float) -> float:
        return tight_epsilon(noisycgd_search_mechanism(trainer, config, n_fit, n_total, mu), config.dp.delta)

    low, high = 0.0, 1.0
    while epsilon(high) <= target:
        low, high = high, 2 * high
    while high - low > 1e-6 * high:
        middle = (low + high) / 2
        if epsilon(middle) <= target:
            low = middle
        else:
            high = middle
    if low == 0.0:
        raise ValueError(
            f"dp.target_epsilon = {target:g}: the search's noisy validation score alone "
            f"(tune.score_noise = {config.tune.score_noise:g}) spends it; raise the target or the score noise"
        )
    return low


def check_candidates(trainer: Trainer, config: Config, plan: SearchPlan, n_fit: int) -> None:
    """Every hyperparameter combination of ``tune.space`` must make a valid candidate: refuse the search
    before any work otherwise (NoisyCGD: a candidate that cannot reach the per-candidate μ)."""
    keys = list(config.tune.space)
    problems = []
    for values in itertools.product(*(config.tune.space[k] for k in keys)):
        chosen = dict(zip(keys, values, strict=True))
        try:
            trainer.candidate_config(config, chosen, plan, n_fit)
        except ValueError as error:
            problems.append(f"  {chosen}: {str(error).splitlines()[-1].strip()}")
    if problems:
        raise ValueError(
            f"NoisyCGD search: these candidates cannot reach the per-candidate μ = {plan.base_mu:.4g} that "
            "dp.target_epsilon leaves after the search's cost:\n" + "\n".join(problems)
        )
