"""One entry point that builds and trains the configured model: used for the released model,
the audit's reference models, its non-private positive control and its canary runs, so all of
them share exactly the same training code and configuration."""

from __future__ import annotations

import math

import numpy as np
import torch

from dpml.config import Config
from dpml.models import ModelSpec, build_model
from dpml.models.gated import GatedSpec, smoothness_bound
from dpml.models.lipschitz import LOSS_LIPSCHITZ, LipschitzSpec
from dpml.models.mlp import MlpSpec, pick_device
from dpml.privacy.gdp import calibrate_l2
from dpml.train.clipless import GradientBounds, clipless_bounds, train_clipless
from dpml.train.dpsgd import (GradientCanaries, TrainResult, loss_function, make_optimizer, secret_noise_seed,
                              train_dpsgd, train_nonprivate)
from dpml.train.noisycgd import NoisyCgdSettings, train_noisycgd


def model_spec(config: Config, in_features: int, n_classes: int) -> ModelSpec:
    if config.model.kind == "gated":
        return GatedSpec(in_features, config.model.gates, n_classes, config.model.gate_seed)
    if config.model.kind == "lipschitz":
        return LipschitzSpec(in_features, tuple(config.model.hidden), n_classes, config.preprocess.clip_norm,
                             config.model.bias_bound)
    return MlpSpec(in_features, tuple(config.model.hidden), n_classes, config.model.activation)


def noisycgd_settings(config: Config, n: int) -> NoisyCgdSettings:
    """NoisyCGD's settings for n training records: λ from ``noisycgd.l2``, or calibrated to ``dp.target_epsilon``."""
    assert config.dp.noise_multiplier is not None  # checked by the config schema
    epochs = int(config.train.epochs)
    l2 = config.noisycgd.l2
    if l2 is None:
        assert config.dp.target_epsilon is not None
        l2 = calibrate_l2(config.dp.target_epsilon, config.dp.delta, config.dp.noise_multiplier,
                          config.train.learning_rate,
                          smoothness_bound(config.model.gates, config.preprocess.clip_norm, config.train.loss),
                          math.ceil(n / config.noisycgd.batch_size), epochs)
    return NoisyCgdSettings(
        noise_multiplier=config.dp.noise_multiplier, clip_norm=config.dp.clip_norm,
        batch_size=config.noisycgd.batch_size, epochs=epochs, learning_rate=config.train.learning_rate, l2=l2,
        n_gates=config.model.gates, input_norm=config.preprocess.clip_norm, loss=config.train.loss,
        clipping_assumed_convex=config.noisycgd.assume_clipping_preserves_convexity)


def model_gradient_bounds(config: Config, in_features: int, n_classes: int) -> GradientBounds:
    """Clipless DP-SGD's per-parameter bounds for the configured Lipschitz model (data-independent)."""
    model = build_model(model_spec(config, in_features, n_classes))
    return clipless_bounds(model, config.preprocess.clip_norm, LOSS_LIPSCHITZ[config.train.loss])  # type: ignore[arg-type]


def fit(config: Config, x: np.ndarray, y: np.ndarray, n_classes: int, *, private: bool,
        noise_multiplier: float | None, seed: int, noise_seed: int | None = None,
        canaries: GradientCanaries | None = None, progress: bool = False) -> TrainResult:
    """Train a fresh model on (x, y): the configured private trainer when ``private``.

    ``seed`` fixes the initialisation (public). The private trainers' batches and noise come from
    ``noise_seed`` — a model that will be released must leave it ``None`` (a secret seed, see
    :func:`secret_noise_seed`); the audit's own simulations pass fixed seeds to be reproducible.
    """
    device = pick_device(config.train.device)
    torch.manual_seed(seed)
    model = build_model(model_spec(config, int(x.shape[1]), n_classes)).to(device)
    loss_fn = loss_function(config.train.loss, config.train.loss_tau)
    xt, yt = torch.as_tensor(x, dtype=torch.float32, device=device), torch.as_tensor(y, device=device)
    secret = secret_noise_seed() if noise_seed is None else noise_seed
    if private and config.train.algorithm == "noisycgd":
        if canaries is not None:
            raise ValueError("white-box gradient canaries observe every iterate: not an audit of a final-model-only "
                             "trainer")
        result = train_noisycgd(model, xt, yt, settings=noisycgd_settings(config, int(x.shape[0])), loss_fn=loss_fn,
                                partition_seed=seed, noise_seed=secret,
                                physical_batch_size=config.train.physical_batch_size, progress=progress)
    elif private and config.train.algorithm == "clipless":
        if noise_multiplier is None or canaries is not None:
            raise ValueError("clipless DP-SGD needs a noise multiplier and takes no gradient canaries")
        optimizer = make_optimizer(model, config.train.optimizer, config.train.learning_rate, config.train.momentum)
        result = train_clipless(model, xt, yt, sample_rate=config.train.sample_rate, epochs=config.train.epochs,  # type: ignore[arg-type]
                                noise_multiplier=noise_multiplier, noise=config.train.clipless_noise,
                                bounds=model_gradient_bounds(config, int(x.shape[1]), n_classes),
                                neighbouring=config.dp.neighbouring, loss_fn=loss_fn, optimizer=optimizer,
                                seed=secret, physical_batch_size=config.train.physical_batch_size, progress=progress)
    elif private:  # dpsgd, or dpgd (the same trainer at q = 1, enforced by the config)
        if noise_multiplier is None:
            raise ValueError("a private run needs a noise multiplier")
        optimizer = make_optimizer(model, config.train.optimizer, config.train.learning_rate, config.train.momentum)
        result = train_dpsgd(model, xt, yt, sample_rate=config.train.sample_rate, epochs=config.train.epochs,
                             clip_norm=config.dp.clip_norm, noise_multiplier=noise_multiplier,
                             neighbouring=config.dp.neighbouring, optimizer=optimizer, seed=secret,
                             physical_batch_size=config.train.physical_batch_size, canaries=canaries,
                             progress=progress, loss_fn=loss_fn)
    else:
        optimizer = make_optimizer(model, config.train.optimizer, config.train.learning_rate, config.train.momentum)
        result = train_nonprivate(model, xt, yt, sample_rate=config.train.sample_rate, epochs=config.train.epochs,
                                  optimizer=optimizer, seed=seed, progress=progress, loss_fn=loss_fn)
    result.model.to("cpu").eval()
    return result
