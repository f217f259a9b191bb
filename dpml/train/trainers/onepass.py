"""One-pass DP-SGD with aggressive clipping on a linear model (seed 002): the pipeline's side of
:func:`dpml.train.onepass.onepass_linear_classifier`.

Each record once in a secret order; only the last iterate is released, which is (ρ²/2)-zCDP by
privacy amplification by iteration for the minimal noise schedule; ρ is the largest whose certified
ε meets ``dp.target_epsilon``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import Field

from dpml.accounting.closed_forms import epsilon_zcdp_rdp
from dpml.accounting.mechanism import ConcentratedDP, MechanismDescription
from dpml.sections import Section, TrainSettings
from dpml.train.dpsgd import GradientCanaries, TrainResult
from dpml.train.onepass import rho_for_epsilon, check_step_sizes, learning_rate_schedule, onepass_linear_classifier
from dpml.train.protocol import Trainer, refuse_canaries

if TYPE_CHECKING:
    from dpml.config import Config


class OnePassTrainSettings(TrainSettings):
    algorithm: Literal["onepass"]


class OnePassConfig(Section):
    """One-pass DP-SGD with aggressive clipping (``train.algorithm: onepass``; seed 002).

    Each training record is used once, in a secret random order, by a linear model (``model.kind:
    mlp`` with ``hidden: []``) with the squared loss on one-hot targets; per-example gradients are
    clipped to C = ``clip_constant``·√d; learning rates η_k = η̃(k/n)/n with η̃(0) = ``eta0`` and
    ``schedule`` ``out`` (constant: all the noise on the last step) or ``const`` (η̃(t) = η̃(0)·√(1 − t):
    constant noise); the noise schedule is the least that makes the last iterate meet
    ``dp.target_epsilon`` (only the final model is released). Requires η_k ≤ 2/(X0² + 1).
    """

    schedule: Literal["out", "const"] = "out"
    eta0: float = Field(1.0, gt=0)
    clip_constant: float = Field(1.0, gt=0)


def onepass_rho(config: Config) -> float:
    """The lectures' ρ (release (ρ²/2)-zCDP): the largest whose certified ε (the zCDP → (ε, δ)
    conversion of Canonne, Kamath & Steinke) meets ``dp.target_epsilon``, found by bisection."""
    assert config.dp.target_epsilon is not None  # checked when the configuration was validated
    target, delta = config.dp.target_epsilon, config.dp.delta

    def epsilon(rho: float) -> float:
        return epsilon_zcdp_rdp(
            MechanismDescription("onepass", (ConcentratedDP(rho * rho / 2),), "replace-one", 1.0, 1), delta
        )

    low = rho_for_epsilon(target, delta)  # Bun–Steinke's conversion: never tighter, so ε(low) ≤ target
    high = 2 * low
    while epsilon(high) <= target:
        low, high = high, 2 * high
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if epsilon(middle) <= target else (low, middle)
    return low


def onepass_mechanism(config: Config, n: int, in_features: int) -> MechanismDescription:
    """What one-pass DP-SGD will do on n records; refuses step sizes above 2/β before any work."""
    x0 = config.preprocess.clip_norm
    try:
        check_step_sizes(learning_rate_schedule(config.onepass.schedule, config.onepass.eta0, n), x0 * x0 + 1.0)
    except ValueError as error:
        raise ValueError(
            f"onepass.eta0 = {config.onepass.eta0:g} with n = {n} and X0 = preprocess.clip_norm = {x0:g}: "
            f"{error} (η_k = η̃/n ≤ 2/(X0² + 1) needs eta0 ≤ {2 * n / (x0 * x0 + 1):.6g})"
        ) from None
    rho = onepass_rho(config)
    clip = config.onepass.clip_constant * math.sqrt(in_features)
    return MechanismDescription(
        trainer="onepass",
        events=(ConcentratedDP(rho * rho / 2),),
        neighbouring="replace-one",
        clip_norm=clip,
        dataset_size=n,
        threat_model="final-model",
        notes=(
            "one-pass DP-SGD (Bombari, Seroussi & Mondelli 2025): each record once in a secret random order, "
            f"{config.onepass.schedule.upper()} "
            f"schedule with η̃(0) = {config.onepass.eta0:g}, per-example gradients clipped to C = c·√d = {clip:.6g}",
            f"privacy amplification by iteration: the last iterate is (ρ²/2)-zCDP with ρ = max_k η_k / "
            f"sqrt(Σ_(j≥k) σ_j²) = {rho:.6g} for the minimal noise schedule ρ²σ_k² = η_k² − η_(k+1)²; needs a "
            "convex smooth loss (the clipped squared loss is a Huber loss) and η_k ≤ 2/β, β = X0² + 1",
            "only the final model is released: intermediate iterates are never logged",
        ),
    )


class OnePass(Trainer):
    """Seed 002's one-pass DP-SGD: linear model, squared loss, final model only, zCDP."""

    name = "onepass"
    settings = OnePassTrainSettings
    sections = {"onepass": OnePassConfig}
    model_kinds = ("mlp",)
    model_kind_reason = (
        "one-pass DP-SGD trains a linear model (its loss must be convex): model.kind: mlp with hidden: []"
    )
    summary = "Bombari, Seroussi & Mondelli: one-pass DP-SGD on a linear model, final model only, (ρ²/2)-zCDP"

    def check(self, config: Config) -> list[str]:
        """What privacy amplification by iteration needs."""
        train, dp, model = config.train, config.dp, config.model
        problems = []
        if model.kind == "mlp" and model.hidden:
            problems.append(
                f"model.kind = {model.kind!r}, model.hidden = {model.hidden}: one-pass DP-SGD trains a "
                "linear model (its loss must be convex); use model.kind: mlp with hidden: []"
            )
        if train.loss != "squared":
            problems.append(
                f"train.loss = {train.loss!r}: one-pass DP-SGD is analysed for the squared loss (clipped: Huber)"
            )
        if dp.neighbouring != "replace-one":
            problems.append(f"dp.neighbouring = {dp.neighbouring!r}: the analysis replaces one record; set replace-one")
        if dp.target_epsilon is None or dp.noise_multiplier is not None:
            problems.append(
                "dp.target_epsilon: required (it fixes ρ and so the noise schedule); dp.noise_multiplier must be null"
            )
        if train.epochs != 1:
            problems.append(
                f"train.epochs = {train.epochs:g}: one-pass DP-SGD uses each record once; set train.epochs: 1"
            )
        return problems

    def plan(self, config: Config, n: int, in_features: int, n_classes: int) -> MechanismDescription:
        return onepass_mechanism(config, n, in_features)

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
        mechanism = onepass_mechanism(config, int(x.shape[0]), int(x.shape[1]))
        event = mechanism.events[0]
        assert isinstance(event, ConcentratedDP)
        history = onepass_linear_classifier(
            model[0],  # type: ignore[index]
            x,
            y,
            rho=math.sqrt(2 * event.rho),
            schedule=config.onepass.schedule,
            eta0=config.onepass.eta0,
            clip_norm=mechanism.clip_norm,
            input_norm_bound=config.preprocess.clip_norm,
            seed=noise_seed,
        )
        return TrainResult(model, mechanism, history)

    def released_noise_multiplier(self, config: Config, mechanism: dict[str, Any]) -> float:
        """The Gaussian with the same zCDP: ρ_event = ρ²/2 and σ = 1/ρ_s = 1/sqrt(2ρ_event)."""
        return 1.0 / math.sqrt(2 * float(mechanism["events"][0]["rho"]))

    def search_problems(self, config: Config) -> list[str]:
        return [
            f"train.algorithm = {self.name!r}: dpml tune cannot search one-pass DP-SGD (its ρ is calibrated to the "
            "whole target; no selection cost is priced)"
        ]
