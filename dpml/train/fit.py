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
from dpml.models.init import BiasFreeReluSpec, build_bias_free_relu
from dpml.models.lipschitz import LipschitzSpec, loss_lipschitz
from dpml.models.mlp import MlpSpec, pick_device
from dpml.models.random_features import RandomFeaturesSpec
from dpml.privacy.gdp import calibrate_l2
from dpml.privacy.kl import calibrate_sigma_squared, gradient_norm_constant
from dpml.privacy.mechanism import ConcentratedDP, MechanismDescription, NoisyGradientDescent
from dpml.train.clipless import GradientBounds, LossClipping, clipless_bounds, train_clipless
from dpml.train.dpsgd import (GradientCanaries, TrainResult, loss_function, make_optimizer, secret_noise_seed,
                              train_dpsgd, train_nonprivate)
from dpml.train.noisycgd import NoisyCgdSettings, train_noisycgd


def model_spec(config: Config, in_features: int, n_classes: int) -> ModelSpec:
    if config.model.kind == "gated":
        return GatedSpec(in_features, config.model.gates, n_classes, config.model.gate_seed)
    if config.model.kind == "lipschitz":
        shape = config.model.input_shape
        return LipschitzSpec(in_features, tuple(config.model.hidden), n_classes, config.preprocess.clip_norm,
                             config.model.bias_bound, conv=tuple(config.model.conv),
                             input_shape=None if shape is None else (shape[0], shape[1], shape[2]),
                             dense_layer=config.model.dense_layer)
    if config.model.kind == "random_features":
        return RandomFeaturesSpec(in_features, config.model.features, n_classes, config.model.feature_activation,
                                  config.model.feature_seed)
    if config.model.kind == "bias_free_relu":
        linearised = config.train.algorithm == "noisygd" and config.noisygd.linearised
        return BiasFreeReluSpec(in_features, tuple(config.model.hidden), n_classes, config.model.init, linearised)
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


def noisygd_sigma(config: Config, n: int, widths: list[int]) -> float:
    """σ of noisy GD: ``noisygd.sigma``, or Cor. 6.4's σ² = 2BT/(KL n²) for ``noisygd.kl_target`` (T = Kη)."""
    if config.noisygd.sigma is not None:
        return config.noisygd.sigma
    assert config.noisygd.kl_target is not None  # checked by the config schema
    constant = gradient_norm_constant(config.model.init, widths, config.preprocess.clip_norm)
    time = int(config.train.epochs) * config.train.learning_rate
    return math.sqrt(calibrate_sigma_squared(constant, time, config.noisygd.kl_target, n))


NOISYGD_NOTES = (
    "KL privacy (Ye et al. Def. 2.3), not (ε, δ)-DP: KL of the joint release (initialisation W0 and every iterate) "
    "between replace-one neighbours; W0 is drawn from the initialisation scheme with secret randomness and has the "
    "same law under both data sets, so by the chain rule the KL is the average over W0 that Thm 4.1 bounds",
    "bound KL ≤ 2BKη/(n²σ²) (Cor. 4.2), B from Eq. 7 with the input norm bound X0² in place of d",
    "erratum handled: Thm 4.1's proof bounds ‖softmax − e_y‖ by 1 although it reaches √2, so for cross-entropy "
    "E‖∇L(D) − ∇L(D')‖² ≤ 8B/n² (not 4B/n²); the exact KL of one discrete step, η‖Δ‖²/(4σ²), is half the paper's "
    "η‖Δ‖²/(2σ²), and the two factors cancel: 2BKη/(n²σ²) holds for the discrete noisy GD run here",
    "no clipping: the clip norm above is not used; sensitivity enters only through B",
)


def noisygd_mechanism(config: Config, n: int, in_features: int, n_classes: int) -> MechanismDescription:
    """What noisy GD will do on n records (known before it runs: the ledger needs it)."""
    widths = [in_features, *config.model.hidden, n_classes]
    event = NoisyGradientDescent(config.model.init, tuple(widths), config.preprocess.clip_norm,
                                 int(config.train.epochs), config.train.learning_rate,
                                 noisygd_sigma(config, n, widths), config.noisygd.linearised)
    return MechanismDescription(trainer="noisygd", events=(event,), neighbouring="replace-one", clip_norm=0.0,
                                dataset_size=n, threat_model="all-iterates", notes=NOISYGD_NOTES)


def onepass_rho(config: Config) -> float:
    """The lectures' ρ (release (ρ²/2)-zCDP): the largest whose certified ε (the zCDP → (ε, δ)
    conversion of Canonne, Kamath & Steinke) meets ``dp.target_epsilon``, found by bisection."""
    from dpml.privacy.accountants import epsilon_zcdp_rdp
    from dpml.train.onepass import rho_for_epsilon

    assert config.dp.target_epsilon is not None  # checked by the config schema
    target, delta = config.dp.target_epsilon, config.dp.delta

    def epsilon(rho: float) -> float:
        return epsilon_zcdp_rdp(MechanismDescription("onepass", (ConcentratedDP(rho * rho / 2),), "replace-one",
                                                     1.0, 1), delta)

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
    from dpml.train.onepass import check_step_sizes, learning_rate_schedule

    x0 = config.preprocess.clip_norm
    try:
        check_step_sizes(learning_rate_schedule(config.onepass.schedule, config.onepass.eta0, n), x0 * x0 + 1.0)
    except ValueError as error:
        raise ValueError(f"onepass.eta0 = {config.onepass.eta0:g} with n = {n} and X0 = preprocess.clip_norm = {x0:g}: "
                         f"{error} (η_k = η̃/n ≤ 2/(X0² + 1) needs eta0 ≤ {2 * n / (x0 * x0 + 1):.6g})") from None
    rho = onepass_rho(config)
    clip = config.onepass.clip_constant * math.sqrt(in_features)
    return MechanismDescription(
        trainer="onepass", events=(ConcentratedDP(rho * rho / 2),), neighbouring="replace-one", clip_norm=clip,
        dataset_size=n, threat_model="final-model",
        notes=(f"one-pass DP-SGD (seed 002): each record once in a secret random order, {config.onepass.schedule.upper()} "
               f"schedule with η̃(0) = {config.onepass.eta0:g}, per-example gradients clipped to C = c·√d = {clip:.6g}",
               f"privacy amplification by iteration: the last iterate is (ρ²/2)-zCDP with ρ = max_k η_k / "
               f"sqrt(Σ_(j≥k) σ_j²) = {rho:.6g} for the minimal noise schedule ρ²σ_k² = η_k² − η_(k+1)²; needs a "
               "convex smooth loss (the clipped squared loss is a Huber loss) and η_k ≤ 2/β, β = X0² + 1",
               "only the final model is released: intermediate iterates are never logged"))


def loss_clipping_of(config: Config) -> LossClipping | None:
    """Clipless DP-SGD's loss-gradient clipping settings (``train.loss_clip_*``), or None when off."""
    train = config.train
    if train.loss_clip_quantile is None:
        return None
    return LossClipping(train.loss_clip_quantile, train.loss_clip_initial, train.loss_clip_count_noise,
                        train.loss_clip_rate)


def model_gradient_bounds(config: Config, in_features: int, n_classes: int) -> GradientBounds:
    """Clipless DP-SGD's per-parameter bounds for the configured Lipschitz model (data-independent)."""
    model = build_model(model_spec(config, in_features, n_classes))
    constant = loss_lipschitz(config.train.loss, n_classes, config.train.loss_alpha)
    return clipless_bounds(model, config.preprocess.clip_norm, constant)  # type: ignore[arg-type]


def fit(config: Config, x: np.ndarray, y: np.ndarray, n_classes: int, *, private: bool,
        noise_multiplier: float | None, seed: int, noise_seed: int | None = None,
        canaries: GradientCanaries | None = None, progress: bool = False,
        held_out: tuple[np.ndarray, np.ndarray] | None = None) -> TrainResult:
    """Train a fresh model on (x, y): the configured private trainer when ``private``.

    ``held_out``: records outside the training set, used only as noisy GD's add-one probes for its
    *estimated* KL (never trained on).

    ``seed`` fixes the initialisation (public). The private trainers' batches and noise come from
    ``noise_seed`` — a model that will be released must leave it ``None`` (a secret seed, see
    :func:`secret_noise_seed`); the audit's own simulations pass fixed seeds to be reproducible.
    """
    device = pick_device(config.train.device)
    torch.manual_seed(seed)
    model = build_model(model_spec(config, int(x.shape[1]), n_classes)).to(device)
    loss_fn = loss_function(config.train.loss, config.train.loss_tau, config.train.loss_alpha)
    xt, yt = torch.as_tensor(x, dtype=torch.float32, device=device), torch.as_tensor(y, device=device)
    secret = secret_noise_seed() if noise_seed is None else noise_seed
    if private and config.train.algorithm == "noisycgd":
        if canaries is not None:
            raise ValueError("white-box gradient canaries observe every iterate: not an audit of a final-model-only "
                             "trainer")
        result = train_noisycgd(model, xt, yt, settings=noisycgd_settings(config, int(x.shape[0])), loss_fn=loss_fn,
                                partition_seed=seed, noise_seed=secret,
                                physical_batch_size=config.train.physical_batch_size, progress=progress)
    elif private and config.train.algorithm == "noisygd":
        if canaries is not None:
            raise ValueError("white-box gradient canaries are an audit of DP-SGD's clipped steps: noisy GD has none")
        result = _fit_noisygd(config, xt, yt, n_classes, secret, progress, held_out)
    elif private and config.train.algorithm == "onepass":
        if canaries is not None:
            raise ValueError("white-box gradient canaries observe every iterate: not an audit of a final-model-only trainer")
        from dpml.train.onepass import onepass_linear_classifier

        mechanism = onepass_mechanism(config, int(x.shape[0]), int(x.shape[1]))
        event = mechanism.events[0]
        assert isinstance(event, ConcentratedDP)
        history = onepass_linear_classifier(model[0], x, y, rho=math.sqrt(2 * event.rho),  # type: ignore[index]
                                            schedule=config.onepass.schedule, eta0=config.onepass.eta0,
                                            clip_norm=mechanism.clip_norm, input_norm_bound=config.preprocess.clip_norm,
                                            seed=secret)
        result = TrainResult(model, mechanism, history)
    elif private and config.train.algorithm == "clipless":
        if noise_multiplier is None or canaries is not None:
            raise ValueError("clipless DP-SGD needs a noise multiplier and takes no gradient canaries")
        optimizer = make_optimizer(model, config.train.optimizer, config.train.learning_rate, config.train.momentum)
        result = train_clipless(model, xt, yt, sample_rate=config.train.sample_rate, epochs=config.train.epochs,  # type: ignore[arg-type]
                                noise_multiplier=noise_multiplier, noise=config.train.clipless_noise,
                                bounds=model_gradient_bounds(config, int(x.shape[1]), n_classes),
                                neighbouring=config.dp.neighbouring, loss_fn=loss_fn, optimizer=optimizer,
                                seed=secret, physical_batch_size=config.train.physical_batch_size, progress=progress,
                                loss_clipping=loss_clipping_of(config),
                                loss_lipschitz=loss_lipschitz(config.train.loss, n_classes, config.train.loss_alpha))
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


def _fit_noisygd(config: Config, x: torch.Tensor, y: torch.Tensor, n_classes: int, secret: int,
                 progress: bool, held_out: tuple[np.ndarray, np.ndarray] | None = None) -> TrainResult:
    """Seed 000's noisy GD: W0 drawn from the scheme with *secret* randomness (the certificate averages over W0)."""
    from dpml.train.noisygd import KLPairs, train_noisy_gd

    mechanism = noisygd_mechanism(config, int(x.shape[0]), int(x.shape[1]), n_classes)
    event = mechanism.events[0]
    assert isinstance(event, NoisyGradientDescent)
    spec = model_spec(config, int(x.shape[1]), n_classes)
    model = build_bias_free_relu(spec, torch.Generator().manual_seed(secret)).to(x.device)  # type: ignore[arg-type]
    probes = None
    if config.noisygd.kl_probes:
        rows = torch.randperm(int(x.shape[0]), generator=torch.Generator().manual_seed(config.train.seed))
        probes = KLPairs(removed=rows[:config.noisygd.kl_probes].to(x.device), relations=("remove_one",))
        if held_out is not None and len(held_out[1]):
            count = min(config.noisygd.kl_probes, len(held_out[1]))
            probes = KLPairs(removed=probes.removed,
                             added_x=torch.as_tensor(held_out[0][:count], dtype=x.dtype, device=x.device),
                             added_y=torch.as_tensor(held_out[1][:count], device=x.device),
                             relations=("remove_one", "add_one", "replace_one"))
    run = train_noisy_gd(model, x, y, learning_rate=event.learning_rate, sigma=event.sigma, steps=event.steps,
                         loss="cross_entropy", generator=torch.Generator(device=x.device).manual_seed(secret + 1),
                         kl_pairs=probes, progress=progress)
    return TrainResult(run.model, mechanism, summarise_kl_estimate(run.history))


def summarise_kl_estimate(history: dict) -> dict:
    """The trainer's estimated-KL trajectories reduced to their final values (labelled estimates: not a bound)."""
    out = {k: v for k, v in history.items() if k not in ("kl_estimate", "loss_function", "seconds")}
    estimate = history.get("kl_estimate")
    if estimate:
        for relation, values in estimate.items():
            if isinstance(values, dict) and "cumulative_worst" in values:
                out[f"kl_estimate_{relation}_worst_probe"] = float(values["cumulative_worst"][-1])
                out[f"kl_estimate_{relation}_mean_probe"] = float(values["cumulative_mean"][-1])
    return out
