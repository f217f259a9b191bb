"""The random-features model of seed 002 (Mondelli's lectures; Rahimi & Recht 2007), with its Hermite checks.

    f(x; θ) = φ(V x)ᵀ θ,        V ∈ R^{p×d}, V_ij ~ N(0, 1/d) i.i.d.,        θ ∈ R^{p×k}, θ0 = 0.

V is drawn once from a public ``feature_seed`` (data-independent, stored with the model as a buffer:
inference needs it); only θ is trained. With ‖x‖ = √d each pre-activation ⟨v_j, x⟩ is N(0, 1), so
what matters about φ is its expansion in the normalised (probabilists') Hermite basis under
G ~ N(0, 1):

    φ(t) = Σ_ℓ φ_ℓ · He_ℓ(t)/√(ℓ!),        φ_ℓ = E[φ(G) He_ℓ(G)] / √(ℓ!),

so that E_v[φ(⟨v, x⟩) φ(⟨v, x'⟩)] = Σ_ℓ φ_ℓ² (⟨x, x'⟩/d)^ℓ for ‖x‖ = ‖x'‖ = √d (the expansion the
lectures use for the NTK/RF kernel and in the reconstruction proof).

**Conditions of the lectures.** "Privacy for free" (Bombari & Mondelli 2025) and the reconstruction
law (Iurada, Bombari, Tommasi & Mondelli, assumption B2) both ask for a non-linear φ with
φ0 = φ2 = 0 and φ1 ≠ 0; B2 adds two non-zero coefficients of order ≥ 3 with different parity
(needed to recover the *sign* of the training points; an odd or even φ reconstructs them up to
sign only). :func:`check_activation` computes the coefficients numerically and refuses an
activation that violates the conditions (ReLU: φ0 = 1/√(2π) ≠ 0; a sigmoid: φ0 = 1/2; a linear φ
has no coefficient of order ≥ 3).

Activations offered (:data:`ACTIVATIONS`):

- ``tanh``: odd, so φ0 = φ2 = φ4 = … = 0; φ1 ≈ 0.6057, φ3 ≈ −0.1484. Reconstruction up to sign.
- ``tanh_even``: tanh(t) + 4·e(t) with the even, Lipschitz bump
  e(t) = exp(−t²/2) − (3√3/(4√2))·exp(−t²) − 1/(4√2), whose φ0 and φ2 vanish in closed form
  (E[e^{−aG²}] = (1+2a)^{−1/2}, E[G² e^{−aG²}] = (1+2a)^{−3/2}); e's φ4 ≈ −0.0361, so this φ has
  non-zero coefficients of orders 3 and 4 (different parity): assumption B2 in full.

**Clipping engine.** The layer has one parameter (``weight`` = θ) and declares
``ghost_clipping = True``: ∇_θ ℓ_i = φ(Vx_i) ⊗ δ_i (δ_i = ∂ℓ_i/∂f(x_i)), so ‖∇_θ ℓ_i‖² =
‖φ(Vx_i)‖²·‖δ_i‖² and Σ_i c_i ∇_θ ℓ_i = Φᵀ diag(c) Δ — the dpml clipping engine
(:mod:`dpml.train.clipping`) uses these and never forms per-example gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
from scipy.integrate import simpson
from torch import nn

TorchActivation = Callable[[torch.Tensor], torch.Tensor]

_EVEN_BUMP_B = 3.0 * math.sqrt(3.0) / (4.0 * math.sqrt(2.0))
_EVEN_BUMP_C = 1.0 / (4.0 * math.sqrt(2.0))
TANH_EVEN_WEIGHT = 4.0


def even_bump(t: torch.Tensor) -> torch.Tensor:
    """e(t) = exp(−t²/2) − (3√3/(4√2))·exp(−t²) − 1/(4√2): even, Lipschitz, with e0 = e2 = 0 (module docstring)."""
    return torch.exp(-0.5 * t * t) - _EVEN_BUMP_B * torch.exp(-t * t) - _EVEN_BUMP_C


def tanh_even(t: torch.Tensor) -> torch.Tensor:
    """tanh(t) + 4·e(t): φ0 = φ2 = 0, φ1 ≠ 0, non-zero φ3 (odd) and φ4 (even)."""
    return torch.tanh(t) + TANH_EVEN_WEIGHT * even_bump(t)


ACTIVATIONS: dict[str, TorchActivation] = {"tanh": torch.tanh, "tanh_even": tanh_even}


def normalised_hermite(t: np.ndarray, degree: int) -> np.ndarray:
    """He_ℓ(t)/√(ℓ!) for ℓ = 0..degree as rows, by the recurrence He_{ℓ+1} = t·He_ℓ − ℓ·He_{ℓ−1}."""
    rows = [np.ones_like(t), t.copy()]
    for ell in range(1, degree):
        rows.append(t * rows[ell] - ell * rows[ell - 1])
    raw = np.stack(rows[: degree + 1])
    norms = np.array([math.sqrt(math.factorial(ell)) for ell in range(degree + 1)])
    return raw / norms[:, None]


NumpyActivation = Callable[[np.ndarray], np.ndarray]


def _as_numpy_function(activation: TorchActivation | NumpyActivation) -> NumpyActivation:
    def evaluate(t: np.ndarray) -> np.ndarray:
        try:  # a numpy function (or one that works on both) first; torch functions refuse arrays
            value = activation(t)  # type: ignore[arg-type]
        except TypeError:
            value = activation(torch.as_tensor(t, dtype=torch.float64))  # type: ignore[arg-type]
        return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value, dtype=float)

    return evaluate


def hermite_coefficients(
    activation: TorchActivation | Callable[[np.ndarray], np.ndarray],
    max_degree: int = 6,
    half_width: float = 12.0,
    points: int = 240_001,
) -> np.ndarray:
    """φ_ℓ = E_{G~N(0,1)}[φ(G) He_ℓ(G)]/√(ℓ!) for ℓ = 0..max_degree (normalised Hermite coefficients).

    Composite Simpson on [−half_width, half_width] with ``points`` nodes (0 among them, so a kink
    at the origin such as ReLU's is integrated accurately; the Gaussian tail beyond 12 is < 1e-31).
    ``activation`` may take a torch tensor or a numpy array.
    """
    if not (isinstance(max_degree, int) and 0 <= max_degree <= 30):
        raise ValueError(f"max_degree = {max_degree}: must be an integer in [0, 30]")
    if not half_width > 0:
        raise ValueError(f"half_width = {half_width}: must be > 0")
    if not (isinstance(points, int) and points >= 101 and points % 2 == 1):
        raise ValueError(f"points = {points}: must be an odd integer ≥ 101 (so that 0 is a node)")
    t = np.linspace(-half_width, half_width, points)
    values = _as_numpy_function(activation)(t)
    if values.shape != t.shape or not np.all(np.isfinite(values)):
        raise ValueError("the activation must map a vector of reals to finite reals of the same shape")
    density = np.exp(-0.5 * t * t) / math.sqrt(2.0 * math.pi)
    basis = normalised_hermite(t, max_degree)
    return simpson(basis * (density * values)[None, :], x=t, axis=1)


def check_activation(
    activation: TorchActivation | Callable[[np.ndarray], np.ndarray],
    name: str = "activation",
    tolerance: float = 1e-6,
    require_sign_recovery: bool = False,
) -> np.ndarray:
    """Refuse φ unless φ0 = φ2 = 0, φ1 ≠ 0 and some φ_ℓ ≠ 0 with ℓ ≥ 3 (seed 002's conditions); returns φ_0..φ_6.

    "= 0" means |φ_ℓ| ≤ tolerance·‖φ‖_{L²(N(0,1))}. With ``require_sign_recovery`` the
    reconstruction theorem's full assumption B2 is checked: non-zero coefficients of order ≥ 3
    of both parities.
    """
    coefficients = hermite_coefficients(activation, max_degree=6)
    scale = math.sqrt(float(np.sum(coefficients**2))) or 1.0
    zero = tolerance * scale
    problems = []
    if abs(coefficients[0]) > zero:
        problems.append(f"φ0 = {coefficients[0]:.6g} (must be 0)")
    if abs(coefficients[2]) > zero:
        problems.append(f"φ2 = {coefficients[2]:.6g} (must be 0)")
    if abs(coefficients[1]) <= zero:
        problems.append(f"φ1 = {coefficients[1]:.6g} (must be ≠ 0)")
    high = np.abs(coefficients[3:]) > zero
    if not high.any():
        problems.append("φ3..φ6 are all 0 (φ must be non-linear)")
    elif require_sign_recovery and not (high[0::2].any() and high[1::2].any()):
        problems.append("no two non-zero coefficients of order ≥ 3 with different parity (sign recovery, B2)")
    if problems:
        raise ValueError(
            f"{name} violates the Hermite conditions of Mondelli's random-features analysis: "
            + "; ".join(problems)
            + f"; coefficients φ0..φ6 = {np.array2string(coefficients, precision=4)}"
        )
    return coefficients


@dataclass(frozen=True)
class RandomFeaturesSpec:
    """f(x) = φ(Vx)ᵀθ with V ∈ R^{p×d} (N(0, 1/d), from ``feature_seed``) and θ ∈ R^{p×k}."""

    in_features: int
    n_features: int
    n_outputs: int = 1
    activation: str = "tanh"
    feature_seed: int = 0

    def __post_init__(self) -> None:
        for field_name in ("in_features", "n_features", "n_outputs"):
            value = getattr(self, field_name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{field_name} = {value!r}: must be an integer ≥ 1")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation = {self.activation!r}: must be one of {', '.join(sorted(ACTIVATIONS))}")

    def to_dict(self) -> dict:
        return asdict(self) | {"kind": "random_features"}

    @classmethod
    def from_dict(cls, payload: dict) -> "RandomFeaturesSpec":
        return cls(
            int(payload["in_features"]),
            int(payload["n_features"]),
            int(payload.get("n_outputs", 1)),
            str(payload.get("activation", "tanh")),
            int(payload.get("feature_seed", 0)),
        )


def draw_features(in_features: int, n_features: int, seed: int) -> torch.Tensor:
    """V ∈ R^{p×d} with V_ij ~ N(0, 1/d), from a public seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n_features, in_features, generator=generator) / math.sqrt(in_features)


class RandomFeatures(nn.Module):
    """f(x) = φ(Vx)ᵀθ; buffer ``features`` = V (p, d), parameter ``weight`` = θ (p, k) initialised at 0."""

    ghost_clipping = True  # the clipping engine asks this layer for norms and clipped sums

    def __init__(self, spec: RandomFeaturesSpec) -> None:
        super().__init__()
        self.spec = spec
        self.activation = ACTIVATIONS[spec.activation]
        check_activation(self.activation, name=f"activation {spec.activation!r}")
        self.register_buffer("features", draw_features(spec.in_features, spec.n_features, spec.feature_seed))
        self.weight = nn.Parameter(torch.zeros(spec.n_features, spec.n_outputs))

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        """Φ = φ(X Vᵀ) ∈ R^{B×p}: row i is φ(V x_i)."""
        return self.activation(x @ self.features.t().to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, k) outputs Φθ (x is cast to θ's dtype)."""
        return self.feature_map(x.to(self.weight.dtype)) @ self.weight

    def per_example_norms_squared(self, x: torch.Tensor, output_grad: torch.Tensor) -> torch.Tensor:
        """‖∇_θ ℓ_i‖² = ‖φ(Vx_i)‖² · ‖δ_i‖² (∇_θ ℓ_i = φ(Vx_i) ⊗ δ_i)."""
        return self.feature_map(x).pow(2).sum(1) * output_grad.pow(2).sum(1)

    def clipped_weight_sum(self, x: torch.Tensor, output_grad: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
        """Σ_i c_i φ(Vx_i) δ_iᵀ = Φᵀ diag(c) Δ, θ's shape (p, k)."""
        return self.feature_map(x).t() @ (factors[:, None] * output_grad)


def build_random_features(spec: RandomFeaturesSpec) -> RandomFeatures:
    return RandomFeatures(spec)


def fit_min_norm(model: RandomFeatures, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Set θ to the min-norm interpolator θ* = Φᵀ(ΦΦᵀ)⁻¹y = Φ⁺y (gradient descent from θ0 = 0's limit).

    Solved in float64 through the n×n kernel K = ΦΦᵀ (p ≫ n). Returns θ*.
    """
    phi = model.feature_map(x.to(torch.float64)).to(torch.float64)
    targets = y.to(torch.float64).reshape(x.shape[0], -1)
    coefficients = torch.linalg.lstsq(phi @ phi.t(), targets, driver="gelsd").solution
    theta = phi.t() @ coefficients
    with torch.no_grad():
        model.weight.copy_(theta.to(model.weight.dtype))
    return theta
