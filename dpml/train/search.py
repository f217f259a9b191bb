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
from typing import Any

import numpy as np
import torch

from dpml.config import Config, with_hyperparameters
from dpml.models.gated import smoothness_bound
from dpml.privacy.gdp import calibrate_l2_for_mu
from dpml.privacy.mechanism import Event, GaussianDP, MechanismDescription, PoissonGaussianSteps, Selection
from dpml.privacy.tuning import sample_count
from dpml.train.dpsgd import dpsgd_mechanism
from dpml.train.fit import fit


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

    For NoisyCGD it is stated as (1/τ)-GDP, which every accountant reads with sensitivity 1 under
    either relation (a replaced record changes the count by at most 1); DP-SGD's search keeps the
    Poisson-Gaussian form, over-counted as sensitivity 2 under replace-one.
    """
    if config.train.algorithm == "noisycgd":
        return GaussianDP(1.0 / config.tune.score_noise)
    return PoissonGaussianSteps(1.0, config.tune.score_noise, 1)


def validation_rows(n: int, config: Config) -> np.ndarray:
    """Seeded, data-independent choice of the validation rows of the training part (sorted)."""
    n_val = int(round(config.tune.validation_fraction * n))
    if not 1 <= n_val < n:
        raise ValueError(f"tune.validation_fraction = {config.tune.validation_fraction} leaves {n_val} of {n} "
                         "training records for validation: need at least one on each side")
    return np.sort(np.random.default_rng([config.tune.seed, 31]).choice(n, size=n_val, replace=False))


def search_mechanism(config: Config, noise_multiplier: float, n_fit: int, n_total: int,
                     base_mu: float | None = None) -> MechanismDescription:
    """What the whole search does to the n_total training records (candidate events + selection).

    DP-SGD candidates: their Poisson-Gaussian steps at σ = ``noise_multiplier``. NoisyCGD candidates:
    one ``base_mu``-GDP event (every candidate's λ is calibrated to it).
    """
    if config.train.algorithm == "noisycgd":
        assert base_mu is not None
        events: tuple[Event, ...] = (GaussianDP(base_mu),)
        trainer, threat = "noisycgd-search", "final-model"
        notes: tuple[str, ...] = (
            f"NoisyCGD candidates (seed 001): σ = {noise_multiplier:g}, b = {config.noisycgd.batch_size}, "
            f"E = {int(config.train.epochs)}; each candidate's λ calibrated so that its Theorem 2.8 μ ≤ {base_mu:.6g}",
            "hidden state: only the released candidate's final iterate is released")
        score = "(1/τ)-GDP"
    else:
        candidate = dpsgd_mechanism(config.train.sample_rate, noise_multiplier, config.train.epochs,
                                    config.dp.neighbouring, config.dp.clip_norm, n_fit)
        events, trainer, threat, notes = candidate.events, "dpsgd-search", candidate.threat_model, candidate.notes
        score = "sensitivity 1, over-counted as 2 under replace-one"
    return MechanismDescription(
        trainer=trainer,
        events=(*events, score_event(config)),
        neighbouring=config.dp.neighbouring,
        clip_norm=config.dp.clip_norm,
        dataset_size=n_total,
        threat_model=threat,
        notes=(*notes,
               f"each candidate trains on the {n_fit} non-validation records and is scored by its validation "
               f"count of correct answers plus N(0, {config.tune.score_noise:g}²) (second event; {score})",
               "the number of candidates, the losing candidates and their scores are secret and never logged",
               f"search space {config.tune.space}"),
        selection=selection_of(config),
    )


def noisycgd_candidate(config: Config, chosen: dict[str, Any], base_mu: float, n_fit: int) -> Config:
    """A NoisyCGD candidate's configuration: the drawn hyperparameters, λ calibrated to μ_base for them."""
    drawn = with_hyperparameters(config, chosen)
    assert drawn.dp.noise_multiplier is not None
    l2 = calibrate_l2_for_mu(base_mu, drawn.dp.noise_multiplier, drawn.train.learning_rate,
                             smoothness_bound(drawn.model.gates, drawn.preprocess.clip_norm, drawn.train.loss),
                             -(-n_fit // drawn.noisycgd.batch_size), int(drawn.train.epochs))
    return with_hyperparameters(drawn, {"noisycgd.l2": l2, "dp.target_epsilon": None})


def run_search(config: Config, x_fit: np.ndarray, y_fit: np.ndarray, x_val: np.ndarray, y_val: np.ndarray,
               n_classes: int, noise_multiplier: float, progress: bool = False,
               base_mu: float | None = None) -> SearchResult | None:
    """Run the K candidates; return the best by noisy validation accuracy (None when K = 0)."""
    from dpml.audit.signals import logits_of

    rng = np.random.default_rng(secrets.randbits(128))  # K, draws and score noise: secret
    best: SearchResult | None = None
    best_score = -np.inf
    for index in range(sample_count(selection_of(config), rng)):
        chosen = {key: values[int(rng.integers(len(values)))] for key, values in config.tune.space.items()}
        candidate = (noisycgd_candidate(config, chosen, base_mu, y_fit.size) if base_mu is not None
                     else with_hyperparameters(config, chosen))
        result = fit(candidate, x_fit, y_fit, n_classes, private=True, noise_multiplier=noise_multiplier,
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
    target, sigma = config.dp.target_epsilon, config.dp.noise_multiplier

    def epsilon(mu: float) -> float:
        return tight_epsilon(search_mechanism(config, sigma, n_fit, n_total, base_mu=mu), config.dp.delta)

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


def check_noisycgd_candidates(config: Config, base_mu: float, n_fit: int) -> None:
    """Every hyperparameter combination of ``tune.space`` must reach μ_base: refuse the search before any work."""
    keys = list(config.tune.space)
    problems = []
    for values in itertools.product(*(config.tune.space[k] for k in keys)):
        chosen = dict(zip(keys, values))
        try:
            noisycgd_candidate(config, chosen, base_mu, n_fit)
        except ValueError as error:
            problems.append(f"  {chosen}: {str(error).splitlines()[-1].strip()}")
    if problems:
        raise ValueError(f"NoisyCGD search: these candidates cannot reach the per-candidate μ = {base_mu:.4g} that "
                         "dp.target_epsilon leaves after the search's cost:\n" + "\n".join(problems))
