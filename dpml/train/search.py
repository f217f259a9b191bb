"""Private hyperparameter search: best of K candidates, K random (Papernot & Steinke 2022).

One candidate (the base algorithm Q of the analysis) is: draw hyperparameters uniformly from
``tune.space``; train with DP-SGD on the training part minus the validation rows; score it by

    s = (#{validation records classified correctly} + N(0, τ²)) / n_val,

a Gaussian mechanism on a count (L2 sensitivity 1 under add/remove: one record changes the count
by at most 1), τ = ``tune.score_noise``. Q's privacy is the composition of its DP-SGD run and the
noisy count — both events are in the mechanism description, so the accountants price the count
too. Every candidate has the same σ, q and steps (only privacy-neutral keys may be searched), so
Q's RDP curve does not depend on the hyperparameters drawn.

The search draws K from the configured distribution and releases only the candidate with the
largest noisy score, with that score and its hyperparameters. K, the losing candidates and their
scores are never released or logged: revealing K voids the random-count analysis. K, the draws
and the noise come from an unseeded generator (OS entropy). If K = 0 (possible only for Poisson)
nothing is released, and the spend stays recorded.

**NoisyCGD candidates** (seed 001 §5): σ, b and E are fixed, and every candidate's λ is calibrated
to the same μ_base for its own η (and number of gates), so Q is μ_base-GDP whatever is drawn
(the paper's "a grid of learning rates determines the λ's"). μ_base is the largest μ for which the
whole search — Papernot & Steinke on the GDP Rényi curve αμ²/2, plus the noisy count as a
(1/τ)-GDP event (sensitivity 1 under either relation) — meets ``dp.target_epsilon``. Both curves
hold under replace-one, so a random count is certified for NoisyCGD's relation too.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dpml.privacy.calibrate import calibrate_noise_multiplier
from dpml.privacy.mechanism import Event, GaussianDP, MechanismDescription, Selection
from dpml.privacy.tuning import sample_count
from dpml.train.dpsgd import dpsgd_mechanism, number_of_steps
from dpml.train.protocol import SearchPlan, Trainer
from dpml.train.registry import trainer_for

if TYPE_CHECKING:
    from dpml.config import Config


@dataclass(frozen=True)
class SearchResult:
    model: torch.nn.Module
    chosen: dict[str, Any]
    noisy_validation_accuracy: float
    history: dict[str, Any]


def selection_of(config: Config) -> Selection:
    return Selection(config.tune.distribution, config.tune.mean, config.tune.shape)


def score_event(config: Config) -> Event:
    """The noisy validation count as an event: a Gaussian with noise multiplier τ / sensitivity 1.

    A trainer may state it otherwise (NoisyCGD: (1/τ)-GDP, read with sensitivity 1 under either
    relation); the default keeps the Poisson-Gaussian form, over-counted as sensitivity 2 under
    replace-one.
    """
    return trainer_for(config).score_event(config)


def random_count_relation_problems(config: Config) -> list[str]:
    """Papernot & Steinke's random-count theorem is certified here for add-remove only."""
    if config.tune.distribution != "fixed" and config.dp.neighbouring != "add-remove":
        return [f"dp.neighbouring = {config.dp.neighbouring!r}: a random-count search "
                f"(tune.distribution = {config.tune.distribution}) is certified for add-remove only; "
                "use add-remove or tune.distribution: fixed"]
    return []


def validation_rows(n: int, config: Config) -> np.ndarray:
    """Seeded, data-independent choice of the validation rows of the training part (sorted)."""
    n_val = int(round(config.tune.validation_fraction * n))
    if not 1 <= n_val < n:
        raise ValueError(f"tune.validation_fraction = {config.tune.validation_fraction} leaves {n_val} of {n} "
                         "training records for validation: need at least one on each side")
    return np.sort(np.random.default_rng([config.tune.seed, 31]).choice(n, size=n_val, replace=False))


def _search_notes(config: Config, n_fit: int, score: str) -> tuple[str, ...]:
    return (f"each candidate trains on the {n_fit} non-validation records and is scored by its validation "
            f"count of correct answers plus N(0, {config.tune.score_noise:g}²) (second event; {score})",
            "the number of candidates, the losing candidates and their scores are secret and never logged",
            f"search space {config.tune.space}")


def poisson_gaussian_search_mechanism(config: Config, noise_multiplier: float, n_fit: int,
                                      n_total: int) -> MechanismDescription:
    """What a search over DP-SGD candidates does to the n_total training records: the candidates'
    Poisson-Gaussian steps at σ = ``noise_multiplier``, the noisy score, the random count."""
    candidate = dpsgd_mechanism(config.train.sample_rate, noise_multiplier, config.train.epochs,
                                config.dp.neighbouring, config.dp.clip_norm, n_fit)
    return MechanismDescription(
        trainer="dpsgd-search", events=(*candidate.events, score_event(config)), neighbouring=config.dp.neighbouring,
        clip_norm=config.dp.clip_norm, dataset_size=n_total, threat_model=candidate.threat_model,
        notes=(*candidate.notes, *_search_notes(config, n_fit, "sensitivity 1, over-counted as 2 under replace-one")),
        selection=selection_of(config),
    )


def poisson_gaussian_search_plan(config: Config, n_fit: int, n_total: int) -> SearchPlan:
    """σ from the config, or calibrated so that the whole search (candidates, score, selection) meets the target."""
    sigma = config.dp.noise_multiplier
    if sigma is None:
        assert config.dp.target_epsilon is not None
        steps = number_of_steps(config.train.epochs, config.train.sample_rate)
        sigma = calibrate_noise_multiplier(config.dp.target_epsilon, config.train.sample_rate, steps, config.dp.delta,
                                           config.dp.neighbouring, extra=(score_event(config),),
                                           selection=selection_of(config))
    return SearchPlan(poisson_gaussian_search_mechanism(config, sigma, n_fit, n_total), sigma)


def noisycgd_search_mechanism(config: Config, n_fit: int, n_total: int, base_mu: float) -> MechanismDescription:
    """What a search over NoisyCGD candidates does: one ``base_mu``-GDP event (every candidate's λ is
    calibrated to it), the (1/τ)-GDP score, the random count."""
    notes = (f"NoisyCGD candidates (seed 001): σ = {config.dp.noise_multiplier:g}, b = {config.noisycgd.batch_size}, "
             f"E = {int(config.train.epochs)}; each candidate's λ calibrated so that its Theorem 2.8 μ ≤ {base_mu:.6g}",
             "hidden state: only the released candidate's final iterate is released")
    return MechanismDescription(
        trainer="noisycgd-search", events=(GaussianDP(base_mu), score_event(config)),
        neighbouring=config.dp.neighbouring, clip_norm=config.dp.clip_norm, dataset_size=n_total,
        threat_model="final-model", notes=(*notes, *_search_notes(config, n_fit, "(1/τ)-GDP")),
        selection=selection_of(config),
    )


def run_search(config: Config, x_fit: np.ndarray, y_fit: np.ndarray, x_val: np.ndarray, y_val: np.ndarray,
               n_classes: int, plan: SearchPlan, progress: bool = False) -> SearchResult | None:
    """Run the K candidates; return the best by noisy validation accuracy (None when K = 0)."""
    from dpml.audit.signals import logits_of
    from dpml.train.fit import fit

    trainer = trainer_for(config)
    rng = np.random.default_rng(secrets.randbits(128))  # K, draws and score noise: secret
    best: SearchResult | None = None
    best_score = -np.inf
    for index in range(sample_count(selection_of(config), rng)):
        chosen = {key: values[int(rng.integers(len(values)))] for key, values in config.tune.space.items()}
        candidate = trainer.candidate_config(config, chosen, plan, y_fit.size)
        result = fit(candidate, x_fit, y_fit, n_classes, private=True, noise_multiplier=plan.noise_multiplier,
                     seed=config.train.seed + index, progress=progress)
        correct = int((logits_of(result.model, x_val).argmax(1) == y_val).sum())
        score = (correct + rng.normal(0.0, config.tune.score_noise)) / y_val.size
        if score > best_score:
            best_score = score
            best = SearchResult(result.model, chosen, float(score), result.history)
    return best


def calibrate_base_mu(config: Config, n_fit: int, n_total: int) -> float:
    """The largest μ_base for which the whole NoisyCGD search meets ``dp.target_epsilon`` (bisection on the
    certificate's own ε, which grows with μ; the lower end is returned, so the target always holds)."""
    from dpml.privacy.accountants import tight_epsilon

    assert config.dp.noise_multiplier is not None and config.dp.target_epsilon is not None
    target = config.dp.target_epsilon

    def epsilon(mu: float) -> float:
        return tight_epsilon(noisycgd_search_mechanism(config, n_fit, n_total, mu), config.dp.delta)

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
        raise ValueError(f"dp.target_epsilon = {target:g}: the search's noisy validation score alone "
                         f"(tune.score_noise = {config.tune.score_noise:g}) spends it; raise the target or the score noise")
    return low


def check_candidates(trainer: Trainer, config: Config, plan: SearchPlan, n_fit: int) -> None:
    """Every hyperparameter combination of ``tune.space`` must make a valid candidate: refuse the search
    before any work otherwise (NoisyCGD: a candidate that cannot reach the per-candidate μ)."""
    keys = list(config.tune.space)
    problems = []
    for values in itertools.product(*(config.tune.space[k] for k in keys)):
        chosen = dict(zip(keys, values))
        try:
            trainer.candidate_config(config, chosen, plan, n_fit)
        except ValueError as error:
            problems.append(f"  {chosen}: {str(error).splitlines()[-1].strip()}")
    if problems:
        raise ValueError(f"NoisyCGD search: these candidates cannot reach the per-candidate μ = {plan.base_mu:.4g} that "
                         "dp.target_epsilon leaves after the search's cost:\n" + "\n".join(problems))
