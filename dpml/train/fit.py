"""One entry point that trains the configured model: used for the released model, the audit's
reference models, its non-private positive control and its canary runs, so all of them share
exactly the same training code and configuration. Which trainer runs is the registry's answer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dpml.models import ModelSpec
from dpml.train.dpsgd import GradientCanaries, TrainResult
from dpml.train.noise import secret_noise_seed
from dpml.train.registry import NONPRIVATE, trainer_for

if TYPE_CHECKING:
    from dpml.config import Config


def model_spec(config: Config, in_features: int, n_classes: int) -> ModelSpec:
    """The spec of the model the configured trainer trains."""
    return trainer_for(config).model_spec(config, in_features, n_classes)


def fit(
    config: Config,
    x: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    *,
    private: bool,
    noise_multiplier: float | None,
    seed: int,
    noise_seed: int | None = None,
    canaries: GradientCanaries | None = None,
    progress: bool = False,
    held_out: tuple[np.ndarray, np.ndarray] | None = None,
) -> TrainResult:
    """Train a fresh model on (x, y): the configured trainer when ``private``, else the non-private one.

    ``held_out``: records outside the training set, used only as noisy GD's add-one probes for its
    *estimated* KL (never trained on).

    ``seed`` fixes the initialisation (public). The private trainers' batches and noise come from
    ``noise_seed`` — a model that will be released must leave it ``None`` (a secret seed, see
    :func:`secret_noise_seed`); the audit's own simulations pass fixed seeds to be reproducible.
    """
    trainer = trainer_for(config) if private else NONPRIVATE
    if not trainer.private and canaries is not None:
        raise ValueError("white-box gradient canaries need a private trainer")
    secret = secret_noise_seed() if noise_seed is None and trainer.private else (noise_seed or 0)
    result = trainer.fit(
        config,
        x,
        y,
        n_classes,
        noise_multiplier=noise_multiplier,
        seed=seed,
        noise_seed=secret,
        canaries=canaries,
        progress=progress,
        held_out=held_out,
    )
    result.model.to("cpu").eval()
    return result
