"""An example trainer: DP-SGD whose learning rate drops by ``decay`` in each of ``phases`` phases."""

from dataclasses import replace
from typing import Literal

from pydantic import Field

from dpml.sections import TrainSettings
from dpml.train.dpsgd import TrainResult, dpsgd_mechanism, loss_function, make_optimizer, train_dpsgd
from dpml.train.protocol import make_tensors
from dpml.train.registry import register
from dpml.train.trainers.dpsgd import DpSgd, calibrated_sigma


class StepDecaySettings(TrainSettings):
    algorithm: Literal["dpsgd_step_decay"]
    phases: int = Field(2, ge=1)
    decay: float = Field(0.5, gt=0, le=1)


class StepDecayDpSgd(DpSgd):
    """The schedule is post-processing: each phase is DP-SGD's event for epochs/phases."""

    name, settings, gradient_canaries = "dpsgd_step_decay", StepDecaySettings, False

    def plan(self, config, n, in_features, n_classes):
        t = config.train
        one = dpsgd_mechanism(
            t.sample_rate, calibrated_sigma(config), t.epochs / t.phases, config.dp.neighbouring, config.dp.clip_norm, n
        )
        return replace(one, trainer=self.name, events=one.events * t.phases)

    def fit(self, config, x, y, n_classes, *, noise_multiplier, seed, noise_seed, **unused):
        t, model = config.train, self.build_model(config, x.shape[1], n_classes, seed)
        (xt, yt), history = make_tensors(config, x, y), {}
        for k in range(t.phases):
            step = train_dpsgd(
                model,
                xt,
                yt,
                sample_rate=t.sample_rate,
                epochs=t.epochs / t.phases,
                clip_norm=config.dp.clip_norm,
                noise_multiplier=noise_multiplier,
                neighbouring=config.dp.neighbouring,
                seed=noise_seed + 3 * k,
                optimizer=make_optimizer(model, t.optimizer, t.learning_rate * t.decay**k, t.momentum),
                loss_fn=loss_function(t.loss, t.loss_tau, t.loss_alpha),
            )
            history |= {f"phase{k}_{key}": v for key, v in step.history.items() if key != "seconds"}
        return TrainResult(model, self.plan(config, len(y), x.shape[1], n_classes), history)


register(StepDecayDpSgd())
