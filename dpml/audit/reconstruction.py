"""Training-data reconstruction from a random-features model (Iurada, Bombari, Tommasi & Mondelli; seed 002).

Gradient descent from θ0 = 0 on the square loss keeps θ in span{φ(Vx_1), …, φ(Vx_n)}; its limit is
the min-norm interpolator θ* = Φᵀ(ΦΦᵀ)⁻¹y. If rows x̂_1..x̂_m satisfy
φ(Vx_i) ∈ span{φ(Vx̂_1), …, φ(Vx̂_m)} for every i, then (when p ≫ dn, φ0 = φ2 = 0, φ1 ≠ 0) every x̂_j
is within o(√d) of a training point — up to sign when φ is odd or even (lectures, "how many
parameters to reconstruct training data?"). The attacker, who sees θ* and the public features V
but not Φ, solves instead

    X̂* = argmin_{X̂ : ‖x̂_j‖ = √d}  ‖P⊥_{X̂} θ*‖² / ‖θ*‖²,      P⊥_{X̂} = I − A(AᵀA)⁻¹Aᵀ,  A = [φ(Vx̂_1) … φ(Vx̂_m)],

by projected gradient descent (Adam on unconstrained rows, each row rescaled back to the sphere
of radius √d after every step: the projection onto the constraint set), with torch autograd and
several random restarts, keeping the restart with the smallest residual. The projection uses the
ridge-regularised normal equations (AᵀA + λ·tr(AᵀA)/m·I)c = Aᵀθ with λ = 10⁻¹⁰ so that two
candidates collapsing onto one point do not break the solve. With k > 1 outputs every column of θ
lies in the same span, and the residuals of the columns are summed.

**Audit.** For each true training point x_i the overlap is max_j |⟨x_i, x̂_j⟩|/(‖x_i‖‖x̂_j‖) (the
absolute value because an odd or even φ cannot tell x from −x; ``signed=True`` drops it, for
φ with both parities such as ``tanh_even``). The report gives the overlaps, their mean, median
and the fraction above 0.9, and — for calibration — the same statistics for m random directions
(what "no information" looks like in dimension d: about sqrt(2 ln(m)/d) for m ≪ e^d). DP is the
defence: DP-GD's isotropic noise has almost all of its mass outside any m-dimensional span of
features, so the attack's objective no longer singles out the training points.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from dpml.models.random_features import RandomFeatures

RIDGE = 1e-10


def _check_positive_int(name: str, value: int) -> None:
    if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"{name} = {value!r}: must be an integer ≥ 1")


def project_to_sphere(rows: torch.Tensor, radius: float) -> torch.Tensor:
    """Each row rescaled to norm ``radius`` (the Euclidean projection onto the sphere; 0 rows get e_1)."""
    norms = rows.norm(dim=-1, keepdim=True)
    fallback = torch.zeros_like(rows)
    fallback[..., 0] = 1.0
    safe = torch.where(norms > 0, rows / norms.clamp_min(1e-300), fallback)
    return radius * safe


def residual_fraction(model: RandomFeatures, theta: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """‖P⊥_{X̂} θ‖²/‖θ‖² for candidates of shape (..., m, d) (leading dimensions: restarts); θ is (p, k).

    Differentiable in the candidates.
    """
    features = model.features.to(candidates.dtype)
    spans = model.activation(candidates @ features.t()).transpose(-1, -2)  # A: (..., p, m)
    gram = spans.transpose(-1, -2) @ spans  # AᵀA: (..., m, m)
    m = gram.shape[-1]
    scale = torch.diagonal(gram, dim1=-2, dim2=-1).sum(-1)[..., None, None] / m
    eye = torch.eye(m, dtype=gram.dtype, device=gram.device)
    coefficients = torch.linalg.solve(gram + RIDGE * scale * eye, spans.transpose(-1, -2) @ theta)
    residual = theta - spans @ coefficients
    return residual.pow(2).sum((-2, -1)) / theta.pow(2).sum()


def reconstruct(
    model: RandomFeatures,
    n_candidates: int,
    *,
    theta: torch.Tensor | None = None,
    restarts: int = 8,
    steps: int = 500,
    learning_rate: float = 0.2,
    radius: float | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Minimise ‖P⊥_{X̂} θ‖²/‖θ‖² over X̂ ∈ (sphere of radius √d)^m from ``restarts`` random starts.

    Adam's learning rate is cosine-annealed from ``learning_rate`` to 1/50 of it; after every step
    each row is projected back onto the sphere. All restarts run in one batch (Adam is
    per-coordinate and the restarts' losses are summed, so they do not interact). Returns
    ``{"candidates": (m, d) best X̂, "loss": its residual fraction, "restart_losses": [...]}``.
    """
    _check_positive_int("n_candidates", n_candidates)
    _check_positive_int("restarts", restarts)
    _check_positive_int("steps", steps)
    if not (math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"learning_rate = {learning_rate!r}: must be a finite number > 0")
    d = model.spec.in_features
    radius = math.sqrt(d) if radius is None else radius
    if not (math.isfinite(radius) and radius > 0):
        raise ValueError(f"radius = {radius!r}: must be a finite number > 0")
    target = (model.weight if theta is None else theta).detach().to(torch.float64).reshape(model.spec.n_features, -1)
    if not float(target.pow(2).sum()) > 0:
        raise ValueError("θ is zero: there is nothing to reconstruct from")
    generator = torch.Generator().manual_seed(seed)
    start_rows = project_to_sphere(
        torch.randn(restarts, n_candidates, d, generator=generator, dtype=torch.float64), radius
    )
    rows = start_rows.clone().requires_grad_(True)
    optimiser = torch.optim.Adam([rows], lr=learning_rate)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, T_max=steps, eta_min=learning_rate / 50)
    for _ in range(steps):
        optimiser.zero_grad()
        residual_fraction(model, target, rows).sum().backward()
        optimiser.step()
        schedule.step()
        with torch.no_grad():
            rows.copy_(project_to_sphere(rows, radius))
    with torch.no_grad():
        losses = residual_fraction(model, target, rows)
    best = int(torch.argmin(losses))
    return {
        "candidates": rows[best].detach().clone(),
        "loss": float(losses[best]),
        "restart_losses": [float(v) for v in losses],
    }


def best_match_overlaps(x_train: torch.Tensor, candidates: torch.Tensor, signed: bool = False) -> np.ndarray:
    """For each training point, max_j cos(x_i, x̂_j) (|cos| unless ``signed``): shape (n,)."""
    a = torch.nn.functional.normalize(x_train.to(torch.float64), dim=1)
    b = torch.nn.functional.normalize(candidates.to(torch.float64), dim=1)
    cosines = a @ b.t()
    return (cosines if signed else cosines.abs()).max(dim=1).values.numpy()


def overlap_summary(overlaps: np.ndarray, threshold: float = 0.9) -> dict[str, float]:
    return {
        "mean": float(np.mean(overlaps)),
        "median": float(np.median(overlaps)),
        f"fraction_above_{threshold:g}": float(np.mean(overlaps > threshold)),
    }


def chance_overlaps(x_train: torch.Tensor, n_candidates: int, seed: int = 0, signed: bool = False) -> np.ndarray:
    """The overlaps that ``n_candidates`` uniformly random directions get: the no-information baseline."""
    generator = torch.Generator().manual_seed(seed + 7919)
    random_rows = torch.randn(n_candidates, x_train.shape[1], generator=generator, dtype=torch.float64)
    return best_match_overlaps(x_train, random_rows, signed)


def reconstruction_audit(
    model: RandomFeatures,
    x_train: torch.Tensor,
    *,
    n_candidates: int | None = None,
    restarts: int = 8,
    steps: int = 500,
    learning_rate: float = 0.2,
    seed: int = 0,
    signed: bool = False,
    threshold: float = 0.9,
) -> dict[str, Any]:
    """Run the reconstruction attack on ``model``'s θ and score it against the true training inputs.

    ``n_candidates`` defaults to n (the number of training points, which the auditor knows).
    Returns a JSON-able dict: per-point overlaps, their summary, the chance baseline's summary,
    the attack's residual fraction ‖P⊥θ‖²/‖θ‖², p/(dn) and the wall-clock seconds.
    """
    if x_train.ndim != 2 or x_train.shape[1] != model.spec.in_features or x_train.shape[0] < 1:
        raise ValueError(f"x_train has shape {tuple(x_train.shape)}: expected (n ≥ 1, {model.spec.in_features})")
    if not 0 < threshold < 1:
        raise ValueError(f"threshold = {threshold}: must be in (0, 1)")
    n, d = x_train.shape
    m = n if n_candidates is None else n_candidates
    start = time.perf_counter()
    attack = reconstruct(model, m, restarts=restarts, steps=steps, learning_rate=learning_rate, seed=seed)
    overlaps = best_match_overlaps(x_train, attack["candidates"], signed)
    chance = chance_overlaps(x_train, m, seed, signed)
    return {
        "n_train": n,
        "in_features": d,
        "n_features": model.spec.n_features,
        "n_candidates": m,
        "p_over_dn": model.spec.n_features / (d * n),
        "signed": signed,
        "overlaps": [float(v) for v in overlaps],
        "summary": overlap_summary(overlaps, threshold),
        "chance_summary": overlap_summary(chance, threshold),
        "residual_fraction": attack["loss"],
        "restart_residuals": attack["restart_losses"],
        "restarts": restarts,
        "steps": steps,
        "seconds": time.perf_counter() - start,
    }
