"""Membership-inference attacks: scores for candidate records, higher = "member".

Every attack reads an :class:`AttackInputs`: the target model's logits on the candidates (and on
population records z), and optionally the logits of N reference models trained on random halves
of a reference pool that contains the candidates, with the IN/OUT mask saying which reference
model trained on which record.

- LOSS (Yeom et al. 2018): score = −ℓ(θ; x).
- LiRA (Carlini et al. 2022): φ = logit-scaled confidence; per example fit N(μ_in, σ_in²) to the
  IN reference models' φ and N(μ_out, σ_out²) to the OUT ones. Online score = log N(φ; μ_in,
  σ_in²) − log N(φ; μ_out, σ_out²); offline (OUT models only) score = (φ − μ_out)/σ_out (the
  one-sided test's z-value, same ranking as its p-value). ``global`` variance pools one σ over
  all examples (Carlini et al. recommend it with few reference models); ``per-example`` fits
  each example's own. An example with no IN (OUT) model gets μ_out (μ_in) shifted by the mean
  IN–OUT difference over the examples that have both.
- RMIA (Zarifzadeh, Liu, Shokri 2024): Pr(x|θ) = softmax probability of the true label;
  online Pr(x) = mean over all reference models; offline Pr(x) = ½[(1+a)·P_OUT(x) + (1−a)]
  (Eq. of their offline approximation, P_OUT = mean over OUT models). LR(x, z) =
  [Pr(x|θ)/Pr(x)] / [Pr(z|θ)/Pr(z)] over population records z; score(x) = Pr_z[LR(x, z) ≥ γ].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpml.audit.signals import cross_entropy_losses, logit_scaled_confidence, true_label_probability
from dpml.definitions import same_definition


@dataclass(frozen=True)
class AttackInputs:
    logits: np.ndarray  # (n, k) target on candidates
    labels: np.ndarray  # (n,)
    population_logits: np.ndarray  # (nz, k) target on population records z
    population_labels: np.ndarray  # (nz,)
    reference_logits: np.ndarray | None = None  # (N, n, k)
    reference_in: np.ndarray | None = None  # (N, n) bool: reference j trained on candidate i
    population_reference_logits: np.ndarray | None = None  # (N, nz, k)
    population_reference_in: np.ndarray | None = None  # (N, nz)

    @property
    def references(self) -> int:
        return 0 if self.reference_logits is None else int(self.reference_logits.shape[0])


def loss_attack(inputs: AttackInputs) -> np.ndarray:
    return -cross_entropy_losses(inputs.logits, inputs.labels)


def _masked_mean(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    count = mask.sum(0)
    total = np.where(mask, values, 0.0).sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _fill_missing(mu_in: np.ndarray, mu_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    both = ~np.isnan(mu_in) & ~np.isnan(mu_out)
    shift = float(np.mean(mu_in[both] - mu_out[both])) if both.any() else 0.0
    mu_in = np.where(np.isnan(mu_in), mu_out + shift, mu_in)
    mu_out = np.where(np.isnan(mu_out), mu_in - shift, mu_out)
    return mu_in, mu_out


def lira_attack(inputs: AttackInputs, online: bool = True, variance: str = "global") -> np.ndarray:
    if inputs.reference_logits is None or inputs.reference_in is None:
        raise ValueError("LiRA needs reference models")
    phi = logit_scaled_confidence(inputs.logits, inputs.labels)
    ref_phi = logit_scaled_confidence(inputs.reference_logits, inputs.labels)  # (N, n)
    inside, outside = inputs.reference_in, ~inputs.reference_in
    mu_in, mu_out = _fill_missing(_masked_mean(ref_phi, inside), _masked_mean(ref_phi, outside))
    if not online and np.isnan(mu_out).all():
        raise ValueError("offline LiRA needs OUT reference models")
    residual_in = np.where(inside, ref_phi - mu_in, 0.0)
    residual_out = np.where(outside, ref_phi - mu_out, 0.0)
    if variance == "global":
        sd_in = np.sqrt((residual_in**2).sum() / max(inside.sum() - 1, 1))
        sd_out = np.sqrt((residual_out**2).sum() / max(outside.sum() - 1, 1))
        sd_in, sd_out = np.full_like(phi, max(sd_in, 1e-6)), np.full_like(phi, max(sd_out, 1e-6))
    else:
        sd_in = np.sqrt((residual_in**2).sum(0) / np.maximum(inside.sum(0) - 1, 1))
        sd_out = np.sqrt((residual_out**2).sum(0) / np.maximum(outside.sum(0) - 1, 1))
        sd_in, sd_out = np.maximum(sd_in, 1e-6), np.maximum(sd_out, 1e-6)
    if online:
        return _normal_log_density(phi, mu_in, sd_in) - _normal_log_density(phi, mu_out, sd_out)
    return (phi - mu_out) / sd_out


def _normal_log_density(x: np.ndarray, mean: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """log N(x; mean, sd²) = −½((x − mean)/sd)² − log sd − ½ log 2π (written out: scipy.stats costs a second to
    import, and this module is loaded by every command that reads a configuration)."""
    return -0.5 * ((x - mean) / sd) ** 2 - np.log(sd) - 0.5 * math.log(2 * math.pi)


def _reference_probability(probs: np.ndarray, inside: np.ndarray, online: bool, a: float) -> np.ndarray:
    if online:
        return probs.mean(0)
    p_out = _masked_mean(probs, ~inside)
    p_out = np.where(np.isnan(p_out), probs.mean(0), p_out)
    return 0.5 * ((1.0 + a) * p_out + (1.0 - a))


def rmia_attack(inputs: AttackInputs, online: bool = True, a: float = 0.3, gamma: float = 1.0) -> np.ndarray:
    if (
        inputs.reference_logits is None
        or inputs.reference_in is None
        or inputs.population_reference_logits is None
        or inputs.population_reference_in is None
    ):
        raise ValueError("RMIA needs reference models evaluated on the candidates and the population")
    p_x = true_label_probability(inputs.logits, inputs.labels)
    p_z = true_label_probability(inputs.population_logits, inputs.population_labels)
    ref_x = true_label_probability(inputs.reference_logits, inputs.labels)
    ref_z = true_label_probability(inputs.population_reference_logits, inputs.population_labels)
    prior_x = _reference_probability(ref_x, inputs.reference_in, online, a)
    prior_z = _reference_probability(ref_z, inputs.population_reference_in, online, a)
    ratio_x = p_x / np.maximum(prior_x, 1e-300)
    ratio_z = np.sort(p_z / np.maximum(prior_z, 1e-300))
    # LR(x, z) ≥ γ  ⇔  ratio_z ≤ ratio_x / γ
    return np.searchsorted(ratio_z, ratio_x / gamma, side="right") / ratio_z.size


Attack = Callable[[AttackInputs], np.ndarray]


@dataclass(frozen=True)
class AttackKind:
    """One membership-inference attack as the audit runs it: its name in ``audit.attacks``, whether it needs
    reference models (the audit then trains ``audit.references`` of them per target; a configuration that
    names it with ``references: 0`` is refused) and its scores, higher = "member", from the inputs and the
    ``audit`` section (for settings of its own, such as RMIA's ``rmia_a``)."""

    name: str
    needs_references: bool
    scores: Callable[[AttackInputs, Any], np.ndarray]


ATTACKS: dict[str, AttackKind] = {}


def register_attack(kind: AttackKind) -> AttackKind:
    """Add an attack under its name (a plugin module listed under ``plugins:`` calls this before the
    configuration is validated); a second attack of the same name is refused."""
    registered = ATTACKS.get(kind.name)
    if registered is not None and registered != kind and not same_definition(registered.scores, kind.scores):
        raise ValueError(f"an attack named {kind.name!r} is already registered")
    ATTACKS[kind.name] = kind
    return kind


def _loss(inputs: AttackInputs, audit: Any) -> np.ndarray:
    return loss_attack(inputs)


def _lira(online: bool, variance: str) -> Callable[[AttackInputs, Any], np.ndarray]:
    def scores(inputs: AttackInputs, audit: Any) -> np.ndarray:
        return lira_attack(inputs, online=online, variance=variance)

    return scores


def _rmia(online: bool) -> Callable[[AttackInputs, Any], np.ndarray]:
    def scores(inputs: AttackInputs, audit: Any) -> np.ndarray:
        return rmia_attack(inputs, online=online, a=audit.rmia_a, gamma=audit.rmia_gamma)

    return scores


for _kind in (
    AttackKind("loss", False, _loss),
    AttackKind("lira-online", True, _lira(True, "global")),
    AttackKind("lira-offline", True, _lira(False, "global")),
    AttackKind("lira-online-per-example", True, _lira(True, "per-example")),
    AttackKind("rmia-online", True, _rmia(True)),
    AttackKind("rmia-offline", True, _rmia(False)),
):
    register_attack(_kind)
