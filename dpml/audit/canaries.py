"""One-run audits (Steinke, Nasr, Jagielski 2023): m canaries, each included with probability ½.

Both modes train one extra model with the target's exact configuration and σ:

- **white box**: Dirac gradient canaries of norm 5C (see :class:`dpml.train.dpsgd.GradientCanaries`)
  that go through the trainer's own Poisson sampler and clipping, scored from their coordinate of
  every observed update (per-step likelihood ratio by default, ``audit.white_box_scoring``). The
  same run carries the conformance checks of :mod:`dpml.audit.conformance` (noise, clipping,
  sampling against ``mechanism.json``): those, not this bound, are what catch half noise, missing
  clipping or shuffled batches — the bound's power (its value when every guess is right) is only a
  little above typical certified ε.
- **black box**: canary *records* from the audit population (never in the training set) with
  their labels replaced by a different, seeded random class (mislabelled records are the
  usual strong canaries), scored by −loss of the final model. With a few hundred canaries its
  power is below ε ≈ 2 (see the audit's ``power``), so at such ε it is reported, not counted.

Guesses: IN for the k highest scores and OUT for the k lowest, k = ⌈guess_fraction·m/2⌉ (``audit.mode: tight``
observes more white-box canaries and makes at most ``audit.tight_guesses`` guesses on them:
``audit.tight_white_box_canaries``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dpml.accounting.mechanism import MechanismDescription
from dpml.audit.bounds import LowerBound, one_run_bound, one_run_guesses
from dpml.audit.conformance import ConformanceProbe, canary_scores, conformance_checks
from dpml.audit.one_run_fdp import one_run_gdp_bound, one_run_gdp_power, one_run_mechanism_bound
from dpml.audit.recompute import forward_is_random, trainable_size
from dpml.audit.signals import cross_entropy_losses, logits_of
from dpml.config import Config
from dpml.devices import full_float32
from dpml.models import build_model
from dpml.train.dpsgd import loss_function, number_of_steps
from dpml.train.fit import fit, model_spec
from dpml.train.protocol import make_tensors

if TYPE_CHECKING:
    from dpml.audit.checks import Check


def _bound(
    scores: np.ndarray,
    included: np.ndarray,
    config: Config,
    confidence: float,
    mode: str,
    k: int,
    curve: MechanismDescription | str | None = None,
) -> dict[str, Any]:
    """The Steinke–Nasr–Jagielski bound of the guesses (IN for the k highest scores, OUT for the k lowest), and
    beside it (``fdp``) their f-DP reading through a Gaussian curve (:mod:`dpml.audit.one_run_fdp`) with its
    power; the latter rests on an assumption and never gates. With a certified mechanism as ``curve``
    (``audit.mode: tight``) the gating ε is the guesses read through that mechanism's own trade-off curve, and the
    Steinke bound is kept as ``steinke``; a string ``curve`` is why the tight reading could not be used."""
    guesses, correct = one_run_guesses(scores, included, k, k)
    delta = config.dp.delta
    bound = one_run_bound(scores.size, guesses, correct, delta, confidence)
    fdp = one_run_gdp_bound(scores.size, guesses, correct, delta, confidence)
    power = one_run_gdp_power(scores.size, guesses, delta, confidence)
    return (
        bound.to_dict()
        | tight_reading(curve, scores.size, guesses, correct, delta, confidence, bound)
        | {
            "method": f"one_run_{mode}",
            "fdp": {
                "method": fdp.method,
                "mu": fdp.inputs["mu"],
                "epsilon": fdp.epsilon,
                "power_mu": power.inputs["mu"],
                "power": power.epsilon,
                "confidence": confidence,
                "assumption": fdp.assumption,
                "gating": False,
            },
        }
    )


def tight_reading(
    curve: MechanismDescription | str | None,
    canaries: int,
    guesses: int,
    correct: int,
    delta: float,
    confidence: float,
    steinke: LowerBound,
) -> dict[str, Any]:
    """The entries ``audit.mode: tight`` changes: the gating ε from the mechanism's own curve, what it rests on,
    the noise scale it rejects, and the Steinke bound it replaces; or the reason it could not be used."""
    if curve is None:
        return {}
    if isinstance(curve, str):
        return {"reading": "epsilon_delta", "reading_note": curve}
    tight = one_run_mechanism_bound(curve, canaries, guesses, correct, delta, confidence)
    return {
        "reading": "mechanism_curve",
        "epsilon": tight.epsilon,
        "assumption": tight.assumption,
        "noise_scale": tight.inputs["noise_scale"],
        "steinke": {"epsilon": steinke.epsilon, "assumption": steinke.assumption},
    }


def white_box_canary_count(config: Config, n_params: int) -> int:
    """m: ``audit.white_box_canaries`` (``audit.tight_white_box_canaries`` in ``audit.mode: tight``), at most one
    per trainable coordinate (and at least 64 for the conformance checks when the one-run bound is switched off)."""
    audit = config.audit
    asked = audit.tight_white_box_canaries if audit.mode == "tight" else audit.white_box_canaries
    return min(max(asked, 64), n_params)


def guess_count(guess_fraction: float, canaries: int) -> int:
    """k = ⌈guess_fraction·m/2⌉ IN guesses and as many OUT: at least one of each."""
    return max(1, math.ceil(guess_fraction * canaries / 2))


def white_box_guess_count(config: Config, canaries: int) -> int:
    """k IN guesses and k OUT of the white-box canaries: :func:`guess_count` of ``audit.one_run_guess_fraction``, and
    in ``audit.mode: tight`` at most ``audit.tight_guesses`` in all (hundreds of confident guesses bound closer
    than thousands of weaker ones: ``benchmarks/one_run_ceiling.py``)."""
    k = guess_count(config.audit.one_run_guess_fraction, canaries)
    return min(k, config.audit.tight_guesses // 2) if config.audit.mode == "tight" else k


def white_box_guesses(config: Config, n_params: int) -> tuple[int, int]:
    m = white_box_canary_count(config, n_params)
    return m, 2 * white_box_guess_count(config, m)


def black_box_guesses(config: Config, pool: int) -> tuple[int, int]:
    m = min(config.audit.black_box_canaries, pool)
    return m, 2 * guess_count(config.audit.one_run_guess_fraction, m)


def white_box_audit(
    config: Config,
    x: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    noise_multiplier: float,
    confidence: float,
    certified: dict[str, Any] | None = None,
    curve: MechanismDescription | str | None = None,
) -> tuple[dict[str, Any], list[Check] | str]:
    """Train once with Dirac gradient canaries through the trainer's sampler and clipping, observing every
    step: the conformance checks against the certified mechanism, and an ε bound from the canaries.

    For a model whose forward pass is random (dropout) the checks cannot recompute the trainer's clipped
    sums: instead of the checks, the reason is returned. The canary bound stays valid (it rests on the
    canaries' random inclusion, whatever the score), only less tight.

    ``certified``: the released model's ``mechanism.json`` (σ, C, q the checks test against); without it
    the configuration's values are used."""
    model = build_model(model_spec(config, x.shape[1], n_classes))
    n_params = trainable_size(model)
    random_forward = forward_is_random(model, torch.as_tensor(x[:16], dtype=torch.float32))
    m = white_box_canary_count(config, n_params)
    rng = np.random.default_rng([config.audit.seed, 7])
    coordinates = rng.choice(n_params, size=m, replace=False)
    included = rng.random(m) < 0.5
    event = (certified or {}).get("events", [{}])[0]
    sigma = float(event.get("noise_multiplier", noise_multiplier))
    q = float(event.get("sample_rate", config.train.sample_rate))
    clip = float((certified or {}).get("clip_norm", config.dp.clip_norm))
    xt, yt = make_tensors(config, x, y)
    train = config.train
    probe = ConformanceProbe(
        xt,
        yt,
        loss_function(train.loss, train.loss_tau, train.loss_alpha),
        sigma,
        clip,
        q,
        number_of_steps(train.epochs, train.sample_rate),
        coordinates,
        included,
        config.audit.canary_gradient_norm,
        config.audit.seed,
        recompute=not random_forward,
    )
    with full_float32():
        fit(
            config,
            x,
            y,
            n_classes,
            private=True,
            noise_multiplier=noise_multiplier,
            seed=config.train.seed + 5_000,
            noise_seed=config.audit.seed + 5_000,
            canaries=probe.canaries(),
        )
    checks: list[Check] | str = (
        "the model's forward pass is random (dropout or another random layer): the auditor cannot recompute the "
        "trainer's clipped sums, so its noise, clipping and sampling are not checked"
        if random_forward
        else conformance_checks(probe, config.audit.conformance_false_alarm, config.audit.conformance_tolerance)
    )
    scoring = config.audit.white_box_scoring
    other = "sum" if scoring == "likelihood_ratio" else "likelihood_ratio"
    k = white_box_guess_count(config, m)
    bound = _bound(canary_scores(probe, scoring), included, config, confidence, "white_box", k, curve)
    bound["scoring"] = scoring
    # the other scoring, for the record (never gates: choosing the larger would need its own correction)
    bound["other_scoring"] = {
        other: _bound(canary_scores(probe, other), included, config, confidence, "white_box", k, curve)["epsilon"]
    }
    return bound, checks


def black_box_audit(
    config: Config,
    x: np.ndarray,
    y: np.ndarray,
    canary_x: np.ndarray,
    canary_y: np.ndarray,
    n_classes: int,
    noise_multiplier: float | None,
    private: bool,
    confidence: float,
    curve: MechanismDescription | str | None = None,
) -> dict[str, Any]:
    """Train once on the training set plus the included mislabelled canaries; score by −loss."""
    rng = np.random.default_rng([config.audit.seed, 11])
    m = min(config.audit.black_box_canaries, canary_x.shape[0])
    chosen = rng.choice(canary_x.shape[0], size=m, replace=False)
    cx = canary_x[chosen]
    cy = (canary_y[chosen] + rng.integers(1, n_classes, size=m)) % n_classes  # a different class
    included = rng.random(m) < 0.5
    result = fit(
        config,
        np.concatenate([x, cx[included]]),
        np.concatenate([y, cy[included]]),
        n_classes,
        private=private,
        noise_multiplier=noise_multiplier,
        seed=config.train.seed + 6_000,
        noise_seed=config.audit.seed + 6_000,
    )
    scores = -cross_entropy_losses(logits_of(result.model, cx), cy)
    k = guess_count(config.audit.one_run_guess_fraction, scores.size)
    return _bound(scores, included, config, confidence, "black_box", k, curve)
