"""One-run audits (Steinke, Nasr, Jagielski 2023): m canaries, each included with probability ½.

Both modes train one extra model with the target's exact configuration and σ:

- **white box**: Dirac gradient canaries (see :class:`dpml.train.dpsgd.GradientCanaries`), scored
  by their coordinate of the observed updates over all iterates. Audits the noise and the
  accounting of the all-iterates threat model; with σ as certified it cannot exceed ε.
- **black box**: canary *records* from the audit population (never in the training set) with
  their labels replaced by a different, seeded random class (mislabelled records are the
  usual strong canaries), scored by −loss of the final model. Audits clipping, sampling and
  noise end to end.

Guesses: IN for the k highest scores and OUT for the k lowest, k = ⌈guess_fraction·m/2⌉.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dpml.audit.bounds import one_run_bound, one_run_guesses
from dpml.audit.signals import cross_entropy_losses, logits_of
from dpml.config import Config
from dpml.train.dpsgd import GradientCanaries
from dpml.train.fit import fit


def _bound(scores: np.ndarray, included: np.ndarray, config: Config, confidence: float, mode: str) -> dict[str, Any]:
    k = max(1, math.ceil(config.audit.one_run_guess_fraction * scores.size / 2))
    guesses, correct = one_run_guesses(scores, included, k, k)
    bound = one_run_bound(scores.size, guesses, correct, config.dp.delta, confidence)
    return bound.to_dict() | {"method": f"one_run_{mode}"}


def white_box_audit(config: Config, x: np.ndarray, y: np.ndarray, n_classes: int, noise_multiplier: float,
                    confidence: float) -> dict[str, Any]:
    """Train once with Dirac gradient canaries inserted; bound ε from how well they are found."""
    from dpml.models import build_model
    from dpml.train.fit import model_spec

    n_params = sum(p.numel() for p in build_model(model_spec(config, x.shape[1], n_classes)).parameters())
    m = min(config.audit.white_box_canaries, n_params)
    rng = np.random.default_rng([config.audit.seed, 7])
    canaries = GradientCanaries(coordinates=rng.choice(n_params, size=m, replace=False),
                                included=rng.random(m) < 0.5)
    result = fit(config, x, y, n_classes, private=True, noise_multiplier=noise_multiplier,
                 seed=config.train.seed + 5_000, noise_seed=config.audit.seed + 5_000, canaries=canaries)
    assert result.canary_scores is not None
    return _bound(result.canary_scores, canaries.included, config, confidence, "white_box")


def black_box_audit(config: Config, x: np.ndarray, y: np.ndarray, canary_x: np.ndarray, canary_y: np.ndarray,
                    n_classes: int, noise_multiplier: float | None, private: bool, confidence: float) -> dict[str, Any]:
    """Train once on the training set plus the included mislabelled canaries; score by −loss."""
    rng = np.random.default_rng([config.audit.seed, 11])
    m = min(config.audit.black_box_canaries, canary_x.shape[0])
    chosen = rng.choice(canary_x.shape[0], size=m, replace=False)
    cx = canary_x[chosen]
    cy = (canary_y[chosen] + rng.integers(1, n_classes, size=m)) % n_classes  # a different class
    included = rng.random(m) < 0.5
    result = fit(config, np.concatenate([x, cx[included]]), np.concatenate([y, cy[included]]), n_classes,
                 private=private, noise_multiplier=noise_multiplier, seed=config.train.seed + 6_000,
                 noise_seed=config.audit.seed + 6_000)
    scores = -cross_entropy_losses(logits_of(result.model, cx), cy)
    return _bound(scores, included, config, confidence, "black_box")
