"""The non-private baseline (and the audit's positive control): ordinary minibatch training."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from dpml.sections import TrainSettings
from dpml.train.dpsgd import GradientCanaries, TrainResult, loss_function, make_optimizer, train_nonprivate
from dpml.train.protocol import Trainer, make_tensors, refuse_canaries

if TYPE_CHECKING:
    from dpml.config import Config


class NonPrivateSettings(TrainSettings):
    algorithm: Literal["nonprivate"]


class NonPrivate(Trainer):
    """No privacy: shuffled minibatches of expected size q·n, no clipping, no noise; no certificate."""

    name = "nonprivate"
    settings = NonPrivateSettings
    private = False
    guarantee = "none"
    summary = "the non-private baseline (no certificate; the gate fails)"

    def plan(self, config: Config, n: int, in_features: int, n_classes: int) -> None:
        return None

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
        refuse_canaries(self.name, canaries, "need a private trainer")
        model = self.build_model(config, int(x.shape[1]), n_classes, seed)
        xt, yt = make_tensors(config, x, y)
        train = config.train
        return train_nonprivate(
            model,
            xt,
            yt,
            sample_rate=train.sample_rate,
            epochs=train.epochs,
            optimizer=make_optimizer(model, train.optimizer, train.learning_rate, train.momentum),
            seed=seed,
            progress=progress,
            loss_fn=loss_function(train.loss, train.loss_tau, train.loss_alpha),
        )

    def released_noise_multiplier(self, config: Config, mechanism: dict[str, Any]) -> None:
        return None

    def search_problems(self, config: Config) -> list[str]:
        return [
            f"train.algorithm = {self.name!r}: dpml tune searches (ε, δ)-DP runs only; a search over KL-private "
            "runs has no selection theorem here"
        ]
