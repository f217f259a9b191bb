"""Noisy GD without clipping on the bias-free ReLU network (seed 000): KL privacy, not (ε, δ)-DP.

The algorithm is :func:`dpml.train.noisygd.train_noisy_gd`; the certificate is Cor. 4.2's KL bound
(:mod:`dpml.accounting.kl_certificate`), which exists only for the linearised network.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from pydantic import Field

from dpml.models import ModelSpec, spec_for
from dpml.models.init import build_bias_free_relu
from dpml.accounting.kl import calibrate_sigma_squared, gradient_norm_constant
from dpml.accounting.mechanism import MechanismDescription, NoisyGradientDescent
from dpml.sections import Section, TrainSettings
from dpml.train.dpsgd import GradientCanaries, TrainResult
from dpml.train.noisygd import KLPairs, train_noisy_gd
from dpml.train.protocol import Trainer, make_tensors, refuse_canaries

if TYPE_CHECKING:
    from dpml.config import Config


class NoisyGdTrainSettings(TrainSettings):
    algorithm: Literal["noisygd"]


class NoisyGdConfig(Section):
    """Noisy GD without clipping (``train.algorithm: noisygd``; seed 000, App. E).

    ``train.epochs`` (an integer) full-batch steps W ← W − η∇L + sqrt(2ησ²)·Z, η =
    ``train.learning_rate``. Give exactly one of ``sigma`` (σ) and ``kl_target`` (σ² = 2BT/(KL n²),
    Cor. 6.4). The guarantee is **KL privacy** (replace-one), certified by Cor. 4.2 only for the
    ``linearised`` network (first-order expansion at the random initialisation); with
    ``linearised: false`` training runs but there is no certificate (the gate fails), only the
    estimated KL. ``kl_probes``: records used for that estimate (training records for remove-one,
    audit-population records for add-one); 0 turns it off.
    """

    sigma: float | None = Field(None, gt=0)
    kl_target: float | None = Field(None, gt=0)
    linearised: bool = True
    kl_probes: int = Field(8, ge=0)


NOTES = (
    "KL privacy (Ye et al. Def. 2.3), not (ε, δ)-DP: KL of the joint release (initialisation W0 and every iterate) "
    "between replace-one neighbours; W0 is drawn from the initialisation scheme with secret randomness and has the "
    "same law under both data sets, so by the chain rule the KL is the average over W0 that Thm 4.1 bounds",
    "bound KL ≤ 2BKη/(n²σ²) (Cor. 4.2), B from Eq. 7 with the input norm bound X0² in place of d",
    "erratum handled: Thm 4.1's proof bounds ‖softmax − e_y‖ by 1 although it reaches √2, so for cross-entropy "
    "E‖∇L(D) − ∇L(D')‖² ≤ 8B/n² (not 4B/n²); the exact KL of one discrete step, η‖Δ‖²/(4σ²), is half the paper's "
    "η‖Δ‖²/(2σ²), and the two factors cancel: 2BKη/(n²σ²) holds for the discrete noisy GD run here",
    "no clipping: the clip norm above is not used; sensitivity enters only through B",
)


def noisygd_sigma(config: Config, n: int, widths: list[int]) -> float:
    """σ of noisy GD: ``noisygd.sigma``, or Cor. 6.4's σ² = 2BT/(KL n²) for ``noisygd.kl_target`` (T = Kη)."""
    if config.noisygd.sigma is not None:
        return float(config.noisygd.sigma)
    assert config.noisygd.kl_target is not None  # checked when the configuration was validated
    constant = gradient_norm_constant(config.model.init, widths, config.preprocess.clip_norm)
    time = int(config.train.epochs) * config.train.learning_rate
    return math.sqrt(calibrate_sigma_squared(constant, time, config.noisygd.kl_target, n))


def noisygd_mechanism(config: Config, n: int, in_features: int, n_classes: int) -> MechanismDescription:
    """What noisy GD will do on n records (known before it runs: the ledger needs it)."""
    widths = [in_features, *config.model.hidden, n_classes]
    event = NoisyGradientDescent(
        config.model.init,
        tuple(widths),
        config.preprocess.clip_norm,
        int(config.train.epochs),
        config.train.learning_rate,
        noisygd_sigma(config, n, widths),
        config.noisygd.linearised,
    )
    return MechanismDescription(
        trainer="noisygd",
        events=(event,),
        neighbouring="replace-one",
        clip_norm=0.0,
        dataset_size=n,
        threat_model="all-iterates",
        notes=NOTES,
    )


def summarise_kl_estimate(history: dict[str, Any]) -> dict[str, Any]:
    """The trainer's estimated-KL trajectories reduced to their final values (labelled estimates: not a bound)."""
    out = {k: v for k, v in history.items() if k not in ("kl_estimate", "loss_function", "seconds")}
    estimate = history.get("kl_estimate")
    if estimate:
        for relation, values in estimate.items():
            if isinstance(values, dict) and "cumulative_worst" in values:
                out[f"kl_estimate_{relation}_worst_probe"] = float(values["cumulative_worst"][-1])
                out[f"kl_estimate_{relation}_mean_probe"] = float(values["cumulative_mean"][-1])
    return out


class NoisyGd(Trainer):
    """Seed 000's noisy GD: KL-private (replace-one), every iterate and W0 released."""

    name = "noisygd"
    settings = NoisyGdTrainSettings
    sections = {"noisygd": NoisyGdConfig}
    model_kinds = ("bias_free_relu",)
    model_kind_reason = "Ye et al.'s bound (Initialization Matters) is for the bias-free ReLU network (with model.init)"
    guarantee = "kl"
    summary = "Ye et al. (Initialization Matters): noisy GD without clipping, KL privacy (not (ε, δ)-DP)"

    def check(self, config: Config) -> list[str]:
        """What Cor. 4.2's certificate assumes."""
        train, dp, gd = config.train, config.dp, config.noisygd
        problems = []
        if dp.neighbouring != "replace-one":
            problems.append(
                f"dp.neighbouring = {dp.neighbouring!r}: the KL bound is stated for replace-one neighbours; "
                "set dp.neighbouring: replace-one"
            )
        if train.loss != "cross_entropy":
            problems.append(f"train.loss = {train.loss!r}: the bound uses the cross-entropy's ‖softmax − e_y‖² ≤ 2")
        if train.sample_rate != 1.0:
            problems.append(
                f"train.sample_rate = {train.sample_rate:g}: noisy GD uses the full batch; set train.sample_rate: 1"
            )
        if train.optimizer != "sgd" or train.momentum != 0:
            problems.append(
                f"train.optimizer = {train.optimizer!r}, train.momentum = {train.momentum:g}: noisy GD takes "
                "plain gradient steps (sgd, momentum 0)"
            )
        if train.epochs != int(train.epochs):
            problems.append(
                f"train.epochs = {train.epochs:g}: noisy GD takes one full-batch step per epoch (an integer)"
            )
        if (gd.sigma is None) == (gd.kl_target is None):
            problems.append(
                f"give exactly one of noisygd.sigma and noisygd.kl_target (got sigma={gd.sigma}, "
                f"kl_target={gd.kl_target})"
            )
        if dp.noise_multiplier is not None or dp.target_epsilon is not None:
            problems.append(
                "dp.noise_multiplier / dp.target_epsilon: not used by noisy GD (its noise is noisygd.sigma "
                "or noisygd.kl_target); remove them"
            )
        return problems

    def model_spec(self, config: Config, in_features: int, n_classes: int) -> ModelSpec:
        return spec_for(
            config.model, config.preprocess.clip_norm, in_features, n_classes, linearised=config.noisygd.linearised
        )

    def plan(self, config: Config, n: int, in_features: int, n_classes: int) -> MechanismDescription:
        return noisygd_mechanism(config, n, in_features, n_classes)

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
        """W0 drawn from the scheme with *secret* randomness (the certificate averages over W0); ``held_out``
        records are add-one probes of the *estimated* KL only (never trained on)."""
        refuse_canaries(self.name, canaries, "are an audit of DP-SGD's clipped steps: noisy GD has none")
        torch.manual_seed(seed)
        xt, yt = make_tensors(config, x, y)
        mechanism = noisygd_mechanism(config, int(x.shape[0]), int(x.shape[1]), n_classes)
        event = mechanism.events[0]
        assert isinstance(event, NoisyGradientDescent)
        spec = self.model_spec(config, int(x.shape[1]), n_classes)
        model = build_bias_free_relu(spec, torch.Generator().manual_seed(noise_seed)).to(xt.device)  # type: ignore[arg-type]
        probes = None
        if config.noisygd.kl_probes:
            rows = torch.randperm(int(x.shape[0]), generator=torch.Generator().manual_seed(config.train.seed))
            probes = KLPairs(removed=rows[: config.noisygd.kl_probes].to(xt.device), relations=("remove_one",))
            if held_out is not None and len(held_out[1]):
                count = min(config.noisygd.kl_probes, len(held_out[1]))
                probes = KLPairs(
                    removed=probes.removed,
                    added_x=torch.as_tensor(held_out[0][:count], dtype=xt.dtype, device=xt.device),
                    added_y=torch.as_tensor(held_out[1][:count], device=xt.device),
                    relations=("remove_one", "add_one", "replace_one"),
                )
        run = train_noisy_gd(
            model,
            xt,
            yt,
            learning_rate=event.learning_rate,
            sigma=event.sigma,
            steps=event.steps,
            loss="cross_entropy",
            generator=torch.Generator(device=xt.device).manual_seed(noise_seed + 1),
            kl_pairs=probes,
            progress=progress,
        )
        return TrainResult(run.model, mechanism, summarise_kl_estimate(run.history))

    def released_noise_multiplier(self, config: Config, mechanism: dict[str, Any]) -> float:
        return float(mechanism["events"][0]["sigma"])

    def search_problems(self, config: Config) -> list[str]:
        return [
            f"train.algorithm = {self.name!r}: dpml tune searches (ε, δ)-DP runs only; a search over KL-private "
            "runs has no selection theorem here"
        ]
