"""Private hyperparameter search: best of K DP-SGD candidates, K random (Papernot & Steinke 2022).

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
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dpml.config import Config, with_hyperparameters
from dpml.privacy.mechanism import MechanismDescription, PoissonGaussianSteps, Selection
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


def score_event(config: Config) -> PoissonGaussianSteps:
    """The noisy validation count as an event: a Gaussian with noise multiplier τ / sensitivity 1."""
    return PoissonGaussianSteps(1.0, config.tune.score_noise, 1)


def validation_rows(n: int, config: Config) -> np.ndarray:
    """Seeded, data-independent choice of the validation rows of the training part (sorted)."""
    n_val = int(round(config.tune.validation_fraction * n))
    if not 1 <= n_val < n:
        raise ValueError(f"tune.validation_fraction = {config.tune.validation_fraction} leaves {n_val} of {n} "
                         "training records for validation: need at least one on each side")
    return np.sort(np.random.default_rng([config.tune.seed, 31]).choice(n, size=n_val, replace=False))


def search_mechanism(config: Config, noise_multiplier: float, n_fit: int, n_total: int) -> MechanismDescription:
    """What the whole search does to the n_total training records (candidate events + selection)."""
    candidate = dpsgd_mechanism(config.train.sample_rate, noise_multiplier, config.train.epochs,
                                config.dp.neighbouring, config.dp.clip_norm, n_fit)
    return MechanismDescription(
        trainer="dpsgd-search",
        events=(*candidate.events, score_event(config)),
        neighbouring=config.dp.neighbouring,
        clip_norm=config.dp.clip_norm,
        dataset_size=n_total,
        threat_model=candidate.threat_model,
        notes=(*candidate.notes,
               f"each candidate trains on the {n_fit} non-validation records and is scored by its validation "
               f"count of correct answers plus N(0, {config.tune.score_noise:g}²) (second event; sensitivity 1, "
               "over-counted as 2 under replace-one)",
               "the number of candidates, the losing candidates and their scores are secret and never logged",
               f"search space {config.tune.space}"),
        selection=selection_of(config),
    )


def run_search(config: Config, x_fit: np.ndarray, y_fit: np.ndarray, x_val: np.ndarray, y_val: np.ndarray,
               n_classes: int, noise_multiplier: float, progress: bool = False) -> SearchResult | None:
    """Run the K candidates; return the best by noisy validation accuracy (None when K = 0)."""
    from dpml.audit.signals import logits_of

    rng = np.random.default_rng(secrets.randbits(128))  # K, draws and score noise: secret
    best: SearchResult | None = None
    best_score = -np.inf
    for index in range(sample_count(selection_of(config), rng)):
        chosen = {key: values[int(rng.integers(len(values)))] for key, values in config.tune.space.items()}
        candidate = with_hyperparameters(config, chosen)
        result = fit(candidate, x_fit, y_fit, n_classes, private=True, noise_multiplier=noise_multiplier,
                     seed=config.train.seed + index, progress=progress)
        correct = int((logits_of(result.model, x_val).argmax(1) == y_val).sum())
        score = (correct + rng.normal(0.0, config.tune.score_noise)) / y_val.size
        if score > best_score:
            best_score = score
            best = SearchResult(result.model, chosen, float(score), result.history)
    return best
