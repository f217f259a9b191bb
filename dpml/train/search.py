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

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dpml.models.predict import logits_of
from dpml.accounting.tuning import sample_count
from dpml.train.fit import fit
from dpml.train.protocol import SearchPlan
from dpml.train.registry import trainer_for
from dpml.train.search_pricing import selection_of

if TYPE_CHECKING:
    from dpml.config import Config


@dataclass(frozen=True)
class SearchResult:
    model: torch.nn.Module
    chosen: dict[str, Any]
    noisy_validation_accuracy: float
    history: dict[str, Any]


def validation_rows(n: int, config: Config) -> np.ndarray:
    """Seeded, data-independent choice of the validation rows of the training part (sorted)."""
    n_val = int(round(config.tune.validation_fraction * n))
    if not 1 <= n_val < n:
        raise ValueError(
            f"tune.validation_fraction = {config.tune.validation_fraction} leaves {n_val} of {n} "
            "training records for validation: need at least one on each side"
        )
    return np.sort(np.random.default_rng([config.tune.seed, 31]).choice(n, size=n_val, replace=False))


def run_search(
    config: Config,
    x_fit: np.ndarray,
    y_fit: np.ndarray,
    x_val: np.ndarray,
    y_val: np.ndarray,
    n_classes: int,
    plan: SearchPlan,
    progress: bool = False,
) -> SearchResult | None:
    """Run the K candidates; return the best by noisy validation accuracy (None when K = 0)."""
    trainer = trainer_for(config)
    rng = np.random.default_rng(secrets.randbits(128))  # K, draws and score noise: secret
    best: SearchResult | None = None
    best_score = -np.inf
    for index in range(sample_count(selection_of(config), rng)):
        chosen = {key: values[int(rng.integers(len(values)))] for key, values in config.tune.space.items()}
        candidate = trainer.candidate_config(config, chosen, plan, y_fit.size)
        result = fit(
            candidate,
            x_fit,
            y_fit,
            n_classes,
            private=True,
            noise_multiplier=plan.noise_multiplier,
            seed=config.train.seed + index,
            progress=progress,
        )
        correct = int((logits_of(result.model, x_val).argmax(1) == y_val).sum())
        score = (correct + rng.normal(0.0, config.tune.score_noise)) / y_val.size
        if score > best_score:
            best_score = score
            best = SearchResult(result.model, chosen, float(score), result.history)
    return best
