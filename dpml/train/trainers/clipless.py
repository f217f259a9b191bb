"""Clipless DP-SGD with Lipschitz networks (seed 004): the pipeline's side of
:func:`dpml.train.clipless.train_clipless`.

The sensitivity is the analytic per-example gradient bound Δ of the Lipschitz model (Algorithm 1),
so the mechanism is DP-SGD's event with C = Δ; per-layer noise with σ on each of D layers costs like
one Gaussian with σ/√D, and loss-gradient clipping's private count shares the step:
σ_eff = (σ_g⁻² + σ_b⁻²)^(−1/2) (:mod:`dpml.train.clipless`). The certificate is voided when the
trainer's soundness check finds a bound violated.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import Field

from dpml.models import build_model
from dpml.models.lipschitz import loss_lipschitz, LipschitzSpec
from dpml.accounting.mechanism import MechanismDescription
from dpml.sections import TrainSettings
from dpml.train.clipless import (
    GradientBounds,
    LossClipping,
    clipless_bounds,
    clipless_mechanism,
    gradient_noise_for,
    train_clipless,
)
from dpml.train.dpsgd import GradientCanaries, TrainResult, loss_function, make_optimizer
from dpml.train.protocol import SearchPlan, Trainer, make_tensors, refuse_canaries
from dpml.train.search_pricing import poisson_gaussian_search_plan, random_count_relation_problems
from dpml.train.trainers.dpsgd import calibrated_sigma, exactly_one_noise_setting

if TYPE_CHECKING:
    from dpml.config import Config

LIPSCHITZ_LOSSES = ("tau_cross_entropy", "multiclass_hinge", "kantorovich_rubinstein", "hinge_kantorovich_rubinstein")


class CliplessSettings(TrainSettings):
    """``clipless_noise``: global noise (std σΔ on the sum) or per layer (σΔ_d on each layer's sum).
    ``loss_clip_quantile`` γ turns on loss-gradient clipping at a private γ-quantile threshold (start
    ``loss_clip_initial``, geometric rate ``loss_clip_rate``, noise std ``loss_clip_count_noise`` on
    each step's count, charged in the certificate)."""

    algorithm: Literal["clipless"]
    clipless_noise: Literal["global", "per_layer"] = "global"
    loss_clip_quantile: float | None = Field(None, gt=0, lt=1)
    loss_clip_initial: float = Field(1.0, gt=0)
    loss_clip_count_noise: float = Field(50.0, gt=0)
    loss_clip_rate: float = Field(0.2, gt=0)


def settings_of(config: Config) -> CliplessSettings:
    assert isinstance(config.train, CliplessSettings)
    return config.train


def loss_clipping_of(config: Config) -> LossClipping | None:
    """The loss-gradient clipping settings (``train.loss_clip_*``), or None when off."""
    train = settings_of(config)
    if train.loss_clip_quantile is None:
        return None
    return LossClipping(
        train.loss_clip_quantile, train.loss_clip_initial, train.loss_clip_count_noise, train.loss_clip_rate
    )


def layer_count(config: Config) -> int:
    """D: the parameterised layers of a lipschitz model (convolutions, hidden layers and the output layer)."""
    return len(config.model.conv) + len(config.model.hidden) + 1


def per_layer_noise(config: Config) -> bool:
    return settings_of(config).clipless_noise == "per_layer"


def model_gradient_bounds(config: Config, in_features: int, n_classes: int) -> GradientBounds:
    """The per-parameter bounds Δ_p of the configured Lipschitz model (data-independent)."""
    model = build_model(CLIPLESS.model_spec(config, in_features, n_classes))
    constant = loss_lipschitz(config.train.loss, n_classes, config.train.loss_alpha)
    return clipless_bounds(model, config.preprocess.clip_norm, constant)  # type: ignore[arg-type]


def lipschitz_spec_problems(config: Config) -> list[str]:
    """The Lipschitz network's own checks (even widths, conv shapes), reported with model.* keys."""
    model = config.model
    shape = None if model.input_shape is None else tuple(model.input_shape)
    if shape is not None and len(shape) != 3:
        return [f"model.input_shape = {model.input_shape}: give [channels, height, width]"]
    in_features = 1 if shape is None else shape[0] * shape[1] * shape[2]
    spec = LipschitzSpec(
        in_features,
        tuple(model.hidden),
        2,
        config.preprocess.clip_norm,
        model.bias_bound,
        conv=tuple(model.conv),
        input_shape=shape,
        dense_layer=model.dense_layer,
    )
    try:
        spec.validate()
    except ValueError as error:
        return [f"model: {error}"]
    return []


class Clipless(Trainer):
    """Seed 004's clipless DP-SGD: no clipping, sensitivity from the Lipschitz model's bounds."""

    name = "clipless"
    settings = CliplessSettings
    model_kinds = ("lipschitz",)
    model_kind_reason = "clipless DP-SGD bounds gradients through a Lipschitz network"
    summary = "Béthune et al.: Lipschitz network, no clipping, sensitivity from the analytic gradient bounds"

    def check(self, config: Config) -> list[str]:
        problems = []
        if config.train.loss not in LIPSCHITZ_LOSSES:
            problems.append(
                f"train.loss = {config.train.loss!r}: clipless DP-SGD needs a Lipschitz loss "
                f"({', '.join(LIPSCHITZ_LOSSES)})"
            )
        if config.model.kind == "lipschitz":
            problems += lipschitz_spec_problems(config)
        if settings_of(config).loss_clip_quantile is not None and config.dp.target_epsilon is None:
            problems.append(
                "train.loss_clip_quantile: loss clipping needs dp.target_epsilon (σ is then calibrated for "
                "the gradient and the quantile's count together)"
            )
        return problems + exactly_one_noise_setting(config)

    def noise_multiplier(self, config: Config) -> float:
        """σ of the gradient noise. A calibrated σ targets the step's whole cost: the quantile's count shares
        the step (σ_eff = (σ⁻² + σ_b⁻²)^(−1/2)), and per-layer noise σ acts like one Gaussian with σ/√D,
        so the calibrated σ_eff is converted back through both."""
        if config.dp.noise_multiplier is not None:
            return config.dp.noise_multiplier
        clipping = loss_clipping_of(config)
        sigma = gradient_noise_for(calibrated_sigma(config), None if clipping is None else clipping.count_noise)
        return sigma * math.sqrt(layer_count(config)) if per_layer_noise(config) else sigma

    def plan(self, config: Config, n: int, in_features: int, n_classes: int) -> MechanismDescription:
        return clipless_mechanism(
            model_gradient_bounds(config, in_features, n_classes),
            config.train.sample_rate,
            self.noise_multiplier(config),
            settings_of(config).clipless_noise,
            config.train.epochs,
            config.dp.neighbouring,
            n,
            loss_clipping_of(config),
        )

    def fit(
        self,
        config: Config,
        x: np.ndarray,
        y: np.ndarray,
        n_classes: int,
        *,
        noise_multiplier: float | None,
        seed: int,
        noise_seed: int,
        canaries: GradientCanaries | None = None,
        progress: bool = False,
        held_out: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> TrainResult:
        refuse_canaries(self.name, canaries, "need clipped steps; clipless DP-SGD has none")
        if noise_multiplier is None:
            raise ValueError("clipless DP-SGD needs a noise multiplier")
        model = self.build_model(config, int(x.shape[1]), n_classes, seed)
        xt, yt = make_tensors(config, x, y)
        train = settings_of(config)
        return train_clipless(
            model,  # type: ignore[arg-type]
            xt,
            yt,
            sample_rate=train.sample_rate,
            epochs=train.epochs,
            noise_multiplier=noise_multiplier,
            noise=train.clipless_noise,
            bounds=model_gradient_bounds(config, int(x.shape[1]), n_classes),
            neighbouring=config.dp.neighbouring,
            loss_fn=loss_function(train.loss, train.loss_tau, train.loss_alpha),
            optimizer=make_optimizer(model, train.optimizer, train.learning_rate, train.momentum),
            seed=noise_seed,
            physical_batch_size=train.physical_batch_size,
            progress=progress,
            loss_clipping=loss_clipping_of(config),
            loss_lipschitz=loss_lipschitz(train.loss, n_classes, train.loss_alpha),
        )

    def certify(self, mechanism: MechanismDescription, delta: float, train_metrics: dict[str, Any]) -> dict[str, Any]:
        """The accountants' certificate, void when the soundness check found the gradient bounds violated (a
        per-example gradient above its bound, or a layer with ‖W‖₂ > 1): the accountants assumed them."""
        certificate = super().certify(mechanism, delta, train_metrics)
        if train_metrics.get("train_soundness_passed", True):
            return certificate
        reason = (
            f"no guarantee: the soundness check found the gradient bounds violated "
            f"({train_metrics.get('train_soundness_violations')} per-example violations, worst ratio "
            f"{train_metrics.get('train_soundness_max_ratio', float('nan')):.4g}, largest spectral norm "
            f"{train_metrics.get('train_spectral_norm_max', float('nan')):.6g}); the accountants' answers "
            "assumed them"
        )
        return certificate | {"epsilon": float("inf"), "statement": reason, "void": True}

    def released_noise_multiplier(self, config: Config, mechanism: dict[str, Any]) -> float:
        """The gradient's σ: the event's σ_eff with the quantile's count taken out and per-layer noise undone."""
        sigma = float(mechanism["events"][0]["noise_multiplier"])
        if mechanism["trainer"] == "clipless" and (clipping := loss_clipping_of(config)) is not None:
            sigma = gradient_noise_for(sigma, clipping.count_noise)
        return sigma * math.sqrt(layer_count(config)) if per_layer_noise(config) else sigma

    def search_problems(self, config: Config) -> list[str]:
        problems = random_count_relation_problems(config)
        if per_layer_noise(config) or loss_clipping_of(config) is not None:
            problems.append(
                "train.clipless_noise / train.loss_clip_quantile: dpml tune prices clipless candidates as "
                "DP-SGD steps with one global noise multiplier; per-layer noise and loss clipping are not "
                "searchable (use clipless_noise: global without loss clipping)"
            )
        return problems

    def search_plan(self, config: Config, n_fit: int, n_total: int) -> SearchPlan:
        return poisson_gaussian_search_plan(self, config, n_fit, n_total)


CLIPLESS = Clipless()
