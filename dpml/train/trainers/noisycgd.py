"""NoisyCGD on the gated convex model (seed 001): the pipeline's side of
:func:`dpml.train.noisycgd.train_noisycgd`.

Fixed disjoint batches visited cyclically, only the last iterate released; the certificate is
Theorem 2.8's μ-GDP under replace-one (:func:`dpml.train.noisycgd.noisycgd_mechanism`). σ is given;
``dp.target_epsilon`` calibrates λ (``noisycgd.l2``) instead.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import Field

from dpml.models.gated import lipschitz_bound, smoothness_bound
from dpml.accounting.gdp import calibrate_l2, calibrate_l2_for_mu
from dpml.accounting.mechanism import Event, GaussianDP, MechanismDescription
from dpml.sections import Section, TrainSettings
from dpml.train.dpsgd import GradientCanaries, TrainResult, loss_function
from dpml.train.noisycgd import NoisyCgdSettings, noisycgd_mechanism, train_noisycgd
from dpml.train.protocol import SearchPlan, Trainer, make_tensors, refuse_canaries
from dpml.train.search_pricing import calibrate_base_mu, check_candidates, noisycgd_search_mechanism

if TYPE_CHECKING:
    from dpml.config import Config


class NoisyCgdTrainSettings(TrainSettings):
    algorithm: Literal["noisycgd"]


class NoisyCgdConfig(Section):
    """NoisyCGD (``train.algorithm: noisycgd``; seed 001 Eq. 2.4, Theorem 2.8).

    ``batch_size`` b: the data are split once into ⌈n/b⌉ disjoint batches visited cyclically for
    ``train.epochs`` (an integer) epochs with step size ``train.learning_rate`` η. ``l2`` is λ;
    leave it ``null`` to calibrate it so that ε = ``dp.target_epsilon`` at the given
    ``dp.noise_multiplier``. The certificate is exact when ``dp.clip_norm`` ≥ the cross-entropy's
    gradient bound √(2P)·X0 (clipping never acts); a smaller clip norm relies on the paper's claim that
    clipping keeps the loss strongly convex and smooth, and needs
    ``assume_clipping_preserves_convexity: true`` (recorded in the certificate).
    """

    batch_size: int = Field(1000, gt=0)
    l2: float | None = Field(None, ge=0)
    assume_clipping_preserves_convexity: bool = False


def noisycgd_settings(config: Config, n: int) -> NoisyCgdSettings:
    """NoisyCGD's settings for n training records: λ from ``noisycgd.l2``, or calibrated to ``dp.target_epsilon``."""
    assert config.dp.noise_multiplier is not None  # checked when the configuration was validated
    epochs = int(config.train.epochs)
    l2 = config.noisycgd.l2
    if l2 is None:
        assert config.dp.target_epsilon is not None
        l2 = calibrate_l2(
            config.dp.target_epsilon,
            config.dp.delta,
            config.dp.noise_multiplier,
            config.train.learning_rate,
            smoothness_bound(config.model.gates, config.preprocess.clip_norm, config.train.loss),
            math.ceil(n / config.noisycgd.batch_size),
            epochs,
        )
    return NoisyCgdSettings(
        noise_multiplier=config.dp.noise_multiplier,
        clip_norm=config.dp.clip_norm,
        batch_size=config.noisycgd.batch_size,
        epochs=epochs,
        learning_rate=config.train.learning_rate,
        l2=l2,
        n_gates=config.model.gates,
        input_norm=config.preprocess.clip_norm,
        loss=config.train.loss,
        clipping_assumed_convex=config.noisycgd.assume_clipping_preserves_convexity,
    )


class NoisyCgd(Trainer):
    """Seed 001's noisy cyclic GD: final model only, μ-GDP by Theorem 2.8 (replace-one)."""

    name = "noisycgd"
    settings = NoisyCgdTrainSettings
    sections = {"noisycgd": NoisyCgdConfig}
    model_kinds = ("gated",)
    model_kind_reason = "NoisyCGD's hidden-state bound needs a strongly convex loss (or use train.algorithm: dpsgd)"
    summary = "Koskela: noisy cyclic GD on the gated convex model, final model only, μ-GDP"

    def check(self, config: Config) -> list[str]:
        """Everything Theorem 2.8 needs."""
        train, dp, cgd, model = config.train, config.dp, config.noisycgd, config.model
        problems = []
        if dp.neighbouring != "replace-one":
            problems.append(
                f"dp.neighbouring = {dp.neighbouring!r}: NoisyCGD's fixed partition is analysed under "
                "replace-one only; set dp.neighbouring: replace-one"
            )
        if dp.noise_multiplier is None:
            problems.append(
                "dp.noise_multiplier: required for NoisyCGD (dp.target_epsilon then calibrates noisycgd.l2)"
            )
        if (dp.target_epsilon is None) == (cgd.l2 is None):
            problems.append(
                f"give exactly one of dp.target_epsilon and noisycgd.l2 (got target_epsilon="
                f"{dp.target_epsilon}, l2={cgd.l2})"
            )
        if train.optimizer != "sgd" or train.momentum != 0:
            problems.append(
                f"train.optimizer = {train.optimizer!r}, train.momentum = {train.momentum:g}: NoisyCGD takes "
                "plain gradient steps (sgd, momentum 0); the bound does not cover other optimisers"
            )
        if train.epochs != int(train.epochs):
            problems.append(f"train.epochs = {train.epochs:g}: NoisyCGD runs whole epochs (an integer)")
        smoothness = smoothness_bound(model.gates, config.preprocess.clip_norm, train.loss, cgd.l2 or 0.0)
        if train.learning_rate >= 2.0 / smoothness:
            problems.append(
                f"train.learning_rate = {train.learning_rate:g}: must be < 2/β = {2.0 / smoothness:.6g} "
                f"(β = κ·P·X0² + λ = {smoothness:.6g} for {model.gates} gates, X0 = preprocess.clip_norm = "
                f"{config.preprocess.clip_norm:g}, {train.loss}); lower it, or lower X0 or the number of gates"
            )
        bound = lipschitz_bound(model.gates, config.preprocess.clip_norm, train.loss)
        if (bound is None or dp.clip_norm < bound) and not cgd.assume_clipping_preserves_convexity:
            limit = "the squared loss has no gradient bound" if bound is None else f"below √(2P)·X0 = {bound:.6g}"
            problems.append(
                f"dp.clip_norm = {dp.clip_norm:g}: {limit}, so clipping would act and Theorem 2.8's "
                "convexity hypotheses are not proven for the clipped multi-class update; raise dp.clip_norm "
                "to the bound, or set noisycgd.assume_clipping_preserves_convexity: true (recorded in the "
                "certificate)"
            )
        return problems

    def noise_multiplier(self, config: Config) -> float | None:
        return config.dp.noise_multiplier

    def plan(self, config: Config, n: int, in_features: int, n_classes: int) -> MechanismDescription:
        return noisycgd_mechanism(noisycgd_settings(config, n), n)

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
        refuse_canaries(self.name, canaries, "observe every iterate: not an audit of a final-model-only trainer")
        model = self.build_model(config, int(x.shape[1]), n_classes, seed)
        xt, yt = make_tensors(config, x, y)
        train = config.train
        return train_noisycgd(
            model,
            xt,
            yt,
            settings=noisycgd_settings(config, int(x.shape[0])),
            loss_fn=loss_function(train.loss, train.loss_tau, train.loss_alpha),
            partition_seed=seed,
            noise_seed=noise_seed,
            physical_batch_size=train.physical_batch_size,
            progress=progress,
        )

    def released_noise_multiplier(self, config: Config, mechanism: dict[str, Any]) -> float:
        assert config.dp.noise_multiplier is not None
        return float(config.dp.noise_multiplier)

    def release_config(self, config: Config, train_metrics: dict[str, Any]) -> Config:
        """With λ calibrated, the released model's λ (so the audit's reference models train with it, as
        DP-SGD's train with its σ)."""
        if config.noisycgd.l2 is not None or "train_l2" not in train_metrics:
            return config
        return config.with_hyperparameters({"noisycgd.l2": train_metrics["train_l2"], "dp.target_epsilon": None})

    # --- dpml tune (seed 001 §5) -----------------------------------------------------------------
    def search_problems(self, config: Config) -> list[str]:
        if config.dp.target_epsilon is None:
            return [
                "dp.target_epsilon: required for a NoisyCGD search (it fixes every candidate's μ, and so its λ; "
                "noisycgd.l2 must then be null)"
            ]
        return []  # both the GDP candidates and the (1/τ)-GDP score hold under replace-one: any count distribution

    def score_event(self, config: Config) -> Event:
        """The noisy validation count as (1/τ)-GDP (sensitivity 1 under either relation)."""
        return GaussianDP(1.0 / config.tune.score_noise)

    def search_plan(self, config: Config, n_fit: int, n_total: int) -> SearchPlan:
        """σ, b and E fixed; the largest μ_base meeting the target for the whole search; every candidate checked."""
        base_mu = calibrate_base_mu(self, config, n_fit, n_total)
        plan = SearchPlan(
            noisycgd_search_mechanism(self, config, n_fit, n_total, base_mu), config.dp.noise_multiplier, base_mu
        )
        check_candidates(self, config, plan, n_fit)
        return plan

    def candidate_config(self, config: Config, chosen: dict[str, Any], plan: SearchPlan, n_fit: int) -> Config:
        """The drawn hyperparameters, with λ calibrated so the candidate's Theorem 2.8 μ is μ_base."""
        assert plan.base_mu is not None
        drawn = config.with_hyperparameters(chosen)
        assert drawn.dp.noise_multiplier is not None
        l2 = calibrate_l2_for_mu(
            plan.base_mu,
            drawn.dp.noise_multiplier,
            drawn.train.learning_rate,
            smoothness_bound(drawn.model.gates, drawn.preprocess.clip_norm, drawn.train.loss),
            -(-n_fit // drawn.noisycgd.batch_size),
            int(drawn.train.epochs),
        )
        return drawn.with_hyperparameters({"noisycgd.l2": l2, "dp.target_epsilon": None})
