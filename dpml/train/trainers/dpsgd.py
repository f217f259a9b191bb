"""DP-SGD (Poisson-sampled, every iterate released) and DP-GD (the same at q = 1, seed 002).

The algorithm is :func:`dpml.train.dpsgd.train_dpsgd`; this module is how the pipeline configures,
plans, audits and tunes it. Mechanism: T = round(epochs/q) Poisson-subsampled Gaussian steps with
noise multiplier σ on the sum of per-example gradients clipped to C (:func:`dpsgd_mechanism`).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Literal, TYPE_CHECKING

import numpy as np
import torch

from dpml.accounting.calibrate import calibrate_noise_multiplier
from dpml.accounting.mechanism import MechanismDescription
from dpml.sections import TrainSettings
from dpml.devices import pick_device
from dpml.train.clipping_check import check_autocast, plan_clipping
from dpml.train.distributed import Collective, check_world_size, process_device, spawn
from dpml.train.dpsgd import (
    AUTOCAST,
    GradientCanaries,
    TrainResult,
    dpsgd_mechanism,
    loss_function,
    make_optimizer,
    number_of_steps,
    train_dpsgd,
)
from dpml.train.protocol import SearchPlan, Trainer, make_tensors
from dpml.train.search_pricing import poisson_gaussian_search_plan, random_count_relation_problems

if TYPE_CHECKING:
    from dpml.config import Config


class DpSgdSettings(TrainSettings):
    """``tune_physical_batch``: clip each batch in the fastest chunk of at most ``physical_batch_size`` rows,
    measured on a synthetic probe before training (:mod:`dpml.train.chunking`); off, the chunks are
    ``physical_batch_size`` rows. The sums, and so the privacy, are the same either way."""

    algorithm: Literal["dpsgd"] = "dpsgd"
    tune_physical_batch: bool = True


class DpGdSettings(DpSgdSettings):
    algorithm: Literal["dpgd"]  # type: ignore[assignment]


def exactly_one_noise_setting(config: Config) -> list[str]:
    dp = config.dp
    if (dp.noise_multiplier is None) == (dp.target_epsilon is None):
        return [
            "give exactly one of dp.noise_multiplier and dp.target_epsilon "
            f"(got noise_multiplier={dp.noise_multiplier}, target_epsilon={dp.target_epsilon})"
        ]
    return []


def calibrated_sigma(config: Config) -> float:
    """σ from ``dp.noise_multiplier``, or the smallest σ whose certified ε meets ``dp.target_epsilon``."""
    if config.dp.noise_multiplier is not None:
        return config.dp.noise_multiplier
    assert config.dp.target_epsilon is not None  # checked when the configuration was validated
    steps = number_of_steps(config.train.epochs, config.train.sample_rate)
    return _calibrate(
        config.dp.target_epsilon, config.train.sample_rate, steps, config.dp.delta, config.dp.neighbouring
    )


@functools.lru_cache(maxsize=64)
def _calibrate(target: float, sample_rate: float, steps: int, delta: float, neighbouring: str) -> float:
    """Calibration is deterministic and takes about a second: the plan and the trainer share one answer."""
    return calibrate_noise_multiplier(target, sample_rate, steps, delta, neighbouring)  # type: ignore[arg-type]


class DpSgd(Trainer):
    """Poisson-sampled DP-SGD with per-example clipping (Abadi et al. 2016); all iterates released."""

    name = "dpsgd"
    settings: ClassVar[type[TrainSettings]] = DpSgdSettings
    gradient_canaries = True
    distributed = True
    summary = "Poisson-sampled DP-SGD, per-example clipping to dp.clip_norm, every iterate covered"

    def check(self, config: Config) -> list[str]:
        return exactly_one_noise_setting(config)

    def noise_multiplier(self, config: Config) -> float | None:
        return calibrated_sigma(config)

    def plan(self, config: Config, n: int, in_features: int, n_classes: int) -> MechanismDescription:
        return dpsgd_mechanism(
            config.train.sample_rate,
            calibrated_sigma(config),
            config.train.epochs,
            config.dp.neighbouring,
            config.dp.clip_norm,
            n,
        )

    def check_model(self, config: Config, in_features: int, n_classes: int) -> list[str]:
        """The clipping probe on the model as it will be built (:mod:`dpml.train.clipping_check`)."""
        train = config.train
        model = self.build_model(config, in_features, n_classes, train.seed)
        loss = loss_function(train.loss, train.loss_tau, train.loss_alpha)
        check_world_size(train.world_size, str(pick_device(train.device)))
        plan = plan_clipping(model, loss, (in_features,), neighbouring=config.dp.neighbouring)
        check_autocast(model, loss, (in_features,), torch.float32, pick_device(train.device), AUTOCAST[train.autocast])
        return plan.lines()

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
        if noise_multiplier is None:
            raise ValueError(f"{self.name}: a private run needs a noise multiplier")
        if config.train.world_size > 1 and canaries is None:
            state, mechanism, history = spawn(
                config.train.world_size,
                str(pick_device(config.train.device)),
                fit_one_process,
                self,
                config,
                x,
                y,
                n_classes,
                noise_multiplier,
                seed,
                noise_seed,
            )
            model = self.build_model(config, int(x.shape[1]), n_classes, seed)
            model.load_state_dict(state)
            return TrainResult(model, mechanism, history)
        return self.fit_here(config, x, y, n_classes, noise_multiplier, seed, noise_seed, canaries, progress)

    def fit_here(
        self,
        config: Config,
        x: np.ndarray,
        y: np.ndarray,
        n_classes: int,
        noise_multiplier: float,
        seed: int,
        noise_seed: int,
        canaries: GradientCanaries | None = None,
        progress: bool = False,
        collective: Collective | None = None,
    ) -> TrainResult:
        """Train in this process: the whole run, or one process's part of a distributed run (``collective``).
        The audit's canary runs are one process whatever ``train.world_size`` says: the mechanism is the same."""
        model = self.build_model(config, int(x.shape[1]), n_classes, seed)
        xt, yt = make_tensors(config, x, y)
        train = config.train
        return train_dpsgd(
            model,
            xt,
            yt,
            sample_rate=train.sample_rate,
            epochs=train.epochs,
            clip_norm=config.dp.clip_norm,
            noise_multiplier=noise_multiplier,
            neighbouring=config.dp.neighbouring,
            optimizer=make_optimizer(model, train.optimizer, train.learning_rate, train.momentum),
            seed=noise_seed,
            physical_batch_size=train.physical_batch_size,
            canaries=canaries,
            progress=progress,
            loss_fn=loss_function(train.loss, train.loss_tau, train.loss_alpha),
            collective=collective,
            autocast=AUTOCAST[train.autocast],
            tune_physical_batch=train.tune_physical_batch,
        )

    def audit_with_gradient_canaries(self, config: Config) -> bool:
        # The canary hook adds Dirac gradients to the clipped sum of the engine's layers; the random-features
        # model trains its θ only and has no such hook.
        return config.model.kind != "random_features"

    def search_problems(self, config: Config) -> list[str]:
        return random_count_relation_problems(config)

    def search_plan(self, config: Config, n_fit: int, n_total: int) -> SearchPlan:
        return poisson_gaussian_search_plan(self, config, n_fit, n_total)


def fit_one_process(
    collective: Collective,
    trainer: DpSgd,
    config: Config,
    x: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    noise_multiplier: float,
    seed: int,
    noise_seed: int,
) -> tuple[dict[str, torch.Tensor], MechanismDescription | None, dict[str, Any]]:
    """One process of a distributed run started by :func:`dpml.train.distributed.spawn` (rank 0's answer
    is kept): its GPU, its share of every step, the model's weights on the CPU."""
    device = process_device(str(pick_device(config.train.device)), collective.rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    result = trainer.fit_here(config, x, y, n_classes, noise_multiplier, seed, noise_seed, collective=collective)
    state = {name: value.detach().cpu() for name, value in result.model.state_dict().items()}
    return state, result.mechanism, {**result.history, "world_size": collective.world_size}


class DpGd(DpSgd):
    """Full-batch DP-GD (seed 002): DP-SGD at sample rate 1, one step per epoch."""

    name = "dpgd"
    settings = DpGdSettings
    summary = "full-batch DP-GD (Mondelli's lectures): DP-SGD with train.sample_rate = 1"

    def check(self, config: Config) -> list[str]:
        if config.train.sample_rate != 1.0:
            return [
                f"train.sample_rate = {config.train.sample_rate:g}: DP-GD (train.algorithm = 'dpgd') uses the "
                "full batch at every step; set train.sample_rate: 1"
            ]
        return exactly_one_noise_setting(config)
