"""One entry point that builds and trains the configured model: used for the released model,
the audit's reference models, its non-private positive control and its canary runs, so all of
them share exactly the same training code and configuration."""

from __future__ import annotations

import numpy as np
import torch

from dpml.config import Config
from dpml.models.mlp import MlpSpec, build_mlp, pick_device
from dpml.train.dpsgd import (GradientCanaries, TrainResult, make_optimizer, secret_noise_seed, train_dpsgd,
                              train_nonprivate)


def model_spec(config: Config, in_features: int, n_classes: int) -> MlpSpec:
    return MlpSpec(in_features, tuple(config.model.hidden), n_classes, config.model.activation)


def fit(config: Config, x: np.ndarray, y: np.ndarray, n_classes: int, *, private: bool,
        noise_multiplier: float | None, seed: int, noise_seed: int | None = None,
        canaries: GradientCanaries | None = None, progress: bool = False) -> TrainResult:
    """Train a fresh model on (x, y); DP-SGD with ``noise_multiplier`` when ``private``.

    ``seed`` fixes the initialisation (public). DP-SGD's batches and noise come from ``noise_seed``
    — a model that will be released must leave it ``None`` (a secret seed, see
    :func:`secret_noise_seed`); the audit's own simulations pass fixed seeds to be reproducible.
    """
    device = pick_device(config.train.device)
    torch.manual_seed(seed)
    model = build_mlp(model_spec(config, int(x.shape[1]), n_classes)).to(device)
    optimizer = make_optimizer(model, config.train.optimizer, config.train.learning_rate, config.train.momentum)
    xt, yt = torch.as_tensor(x, dtype=torch.float32, device=device), torch.as_tensor(y, device=device)
    if private:
        if noise_multiplier is None:
            raise ValueError("a private run needs a noise multiplier")
        result = train_dpsgd(model, xt, yt, sample_rate=config.train.sample_rate, epochs=config.train.epochs,
                             clip_norm=config.dp.clip_norm, noise_multiplier=noise_multiplier,
                             neighbouring=config.dp.neighbouring, optimizer=optimizer,
                             seed=secret_noise_seed() if noise_seed is None else noise_seed,
                             physical_batch_size=config.train.physical_batch_size, canaries=canaries,
                             progress=progress)
    else:
        result = train_nonprivate(model, xt, yt, sample_rate=config.train.sample_rate, epochs=config.train.epochs,
                                  optimizer=optimizer, seed=seed, progress=progress)
    result.model.to("cpu").eval()
    return result
