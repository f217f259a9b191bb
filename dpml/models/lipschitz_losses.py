"""Losses that are L-Lipschitz in the logits, with their constants (seed 004, Béthune et al.).
Overview: :mod:`dpml.models.lipschitz`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------------


def tau_cross_entropy(tau: float) -> LossFn:
    """ℓ(z, y) = CE(τ·z, y)/τ: ∂ℓ/∂z = softmax(τz) − e_y, of norm ≤ √2 for every τ (the convention fixed here)."""
    if tau <= 0:
        raise ValueError(f"tau = {tau}: must be > 0")

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(tau * logits, y, reduction="none") / tau

    return loss


def multiclass_hinge(margin: float = 1.0) -> LossFn:
    """ℓ(z, y) = Σ_{j≠y} max(0, m − (z_y − z_j)) / (k − 1): gradient e_j-terms averaged, norm ≤ √2."""

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        true = logits.gather(1, y[:, None])
        violations = F.relu(margin - (true - logits))
        violations = violations.scatter(1, y[:, None], 0.0)
        return violations.sum(1) / (logits.shape[1] - 1)

    return loss


def _check_classes(logits: torch.Tensor) -> int:
    k = logits.shape[1]
    if k < 2:
        raise ValueError(f"multiclass Kantorovich–Rubinstein losses need ≥ 2 logits, got {k}")
    return k


def _kr_term(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """z_y − mean_{j≠y} z_j: the per-example one-vs-all KR potential gap."""
    k = _check_classes(logits)
    true = logits.gather(1, y[:, None]).squeeze(1)
    return true - (logits.sum(1) - true) / (k - 1)


def kantorovich_rubinstein() -> LossFn:
    """ℓ_KR(z, y) = −(z_y − (1/(k−1)) Σ_{j≠y} z_j): multiclass one-vs-all Kantorovich–Rubinstein, per example.

    Convention: deel-lip's MulticlassKR averages over the k classes the one-vs-all KR term
    E_{class j}[z_j] − E_{not j}[z_j], normalising by the batch's class counts — which makes one
    example's loss depend on the others, so it is not a per-example loss and DP's sensitivity
    argument does not apply to it. Here the counts are replaced by their balanced expectations
    (n_j = b/k, n_{¬j} = b(k−1)/k), which turns the average into exactly the expression above
    (seed 004 §3.1 Eq. 8: the binary case ℓ = −y·ŷ).

    Lipschitz constant in the logits (L2): ∇_z ℓ = −e_y + (1/(k−1)) Σ_{j≠y} e_j for every z, of norm
    √(1 + 1/(k−1)) = √(k/(k−1)) — attained everywhere, √2 at most (k = 2), → 1 for many classes.
    (Table 4 lists L = 1 for its form; with this per-example form L = 1 would be too small.)
    """

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -_kr_term(logits, y)

    return loss


def _one_vs_all_hinge(logits: torch.Tensor, y: torch.Tensor, margin: float) -> torch.Tensor:
    """deel-lip's MulticlassHinge: (1/k) Σ_{j≠y} [(m/2 − z_y)_+ + (m/2 + z_j)_+]."""
    k = _check_classes(logits)
    true = logits.gather(1, y[:, None])
    terms = F.relu(margin / 2 - true) + F.relu(margin / 2 + logits)
    return terms.scatter(1, y[:, None], 0.0).sum(1) / k


def hinge_kantorovich_rubinstein(alpha: float, margin: float = 1.0) -> LossFn:
    """ℓ = α·H(z, y) + ℓ_KR(z, y), with H deel-lip's one-vs-all multiclass hinge
    (1/k) Σ_{j≠y} [(m/2 − z_y)_+ + (m/2 + z_j)_+] and ℓ_KR of :func:`kantorovich_rubinstein`.

    Lipschitz constant (L2, in the logits): with a_j ∈ {0, 1} the active hinge terms,
    ∂ℓ/∂z_y = −1 − α(k−1)a_y/k and ∂ℓ/∂z_j = 1/(k−1) + α a_j/k (j ≠ y): both terms push the same way,
    so the norm is largest with every term active (e.g. z = 0), where it equals
    √((1 + α(k−1)/k)² + (k−1)(1/(k−1) + α/k)²) = (1 + α(k−1)/k)·√(k/(k−1)). This is the constant
    :func:`loss_lipschitz` returns; Table 4's 1 + α (App. C.1) is smaller than it for small α (e.g.
    k = 2, α = 0.5: 1.77 > 1.5), so it is not used.
    """
    if alpha < 0:
        raise ValueError(f"alpha = {alpha}: must be ≥ 0")
    if margin <= 0:
        raise ValueError(f"margin = {margin}: must be > 0")

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return alpha * _one_vs_all_hinge(logits, y, margin) - _kr_term(logits, y)

    return loss


def hinge_kr_lipschitz(alpha: float, n_classes: int | None = None) -> float:
    """(1 + α(k−1)/k)·√(k/(k−1)) for k classes; for unknown k its supremum over k ≥ 2,
    max(√2·(1 + α/2), 1 + α) (the expression is convex-then-increasing in t = (k−1)/k ∈ [½, 1))."""
    if n_classes is None:
        return max(math.sqrt(2.0) * (1 + alpha / 2), 1 + alpha)
    k = _require_classes(n_classes)
    return (1 + alpha * (k - 1) / k) * math.sqrt(k / (k - 1))


def _require_classes(n_classes: int) -> int:
    if n_classes < 2:
        raise ValueError(f"n_classes = {n_classes}: the multiclass losses need ≥ 2")
    return n_classes


LOSS_LIPSCHITZ = {
    "tau_cross_entropy": math.sqrt(2.0),
    "multiclass_hinge": math.sqrt(2.0),
    "kantorovich_rubinstein": math.sqrt(2.0),
}
"""Lipschitz constants (L2, in the logits) valid for every number of classes k ≥ 2. The hinge-KR
constant depends on α: use :func:`loss_lipschitz` (or :func:`hinge_kr_lipschitz`)."""


def loss_lipschitz(name: str, n_classes: int | None = None, alpha: float | None = None) -> float:
    """The proven Lipschitz constant of loss ``name`` in the logits; exact (tighter) given ``n_classes``.

    tau_cross_entropy: √2 (supremum, approached for confident mistakes, for every k); multiclass_hinge:
    √(1 + (k−1)/(k−1)²) = √(k/(k−1)); kantorovich_rubinstein: √(k/(k−1)); hinge_kantorovich_rubinstein
    (needs ``alpha``): :func:`hinge_kr_lipschitz`."""
    if name == "hinge_kantorovich_rubinstein":
        if alpha is None:
            raise ValueError("loss 'hinge_kantorovich_rubinstein' needs alpha to give its Lipschitz constant")
        return hinge_kr_lipschitz(alpha, n_classes)
    if name not in LOSS_LIPSCHITZ:
        raise ValueError(
            f"loss {name!r} has no known Lipschitz constant: expected one of "
            f"{sorted([*LOSS_LIPSCHITZ, 'hinge_kantorovich_rubinstein'])}"
        )
    if n_classes is None or name == "tau_cross_entropy":
        return LOSS_LIPSCHITZ[name]
    k = _require_classes(n_classes)
    return math.sqrt(k / (k - 1))
