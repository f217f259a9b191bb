"""The convex gated-ReLU model of seed 001 (Koskela, Eqs. 3.6–3.8), and its curvature bounds.

P gate vectors u_1..u_P ~ N(0, I_d) are drawn once from ``gate_seed`` (data-independent, public,
stored with the model as a buffer: inference needs them). A record x gets the gate pattern
g_p(x) = 1(u_pᵀx ≥ 0) and the gated features φ(x) = [g_1(x)·x; …; g_P(x)·x] ∈ R^{dP}; the model
is a k-class linear map on φ without bias,

    z(x) = Σ_p g_p(x) · V_pᵀ x,        V ∈ R^{P×d×k},

the convex counterpart of a one-hidden-layer ReLU network with P units. φ(x) is never formed: the
forward pass is one (B×d)·(d×Pk) product masked by the gates, and the per-example gradient
∇_V ℓ_i = φ(x_i) ⊗ δ_i (δ_i = ∂ℓ_i/∂z_i) has the closed-form squared norm
‖δ_i‖² · a_i · ‖x_i‖², a_i = Σ_p g_p(x_i) the number of open gates, so the clipping engine needs
neither per-example gradients nor the d×P×k blow-up (:meth:`GatedLinear.per_example_norms_squared`,
:meth:`GatedLinear.clipped_weight_sum`).

**Smoothness (the digest's check on Lemma 3.2).** The data term's Hessian in V is
(I_k-curvature of the loss) ⊗ φφᵀ, whose norm is ‖∇²_z ℓ‖ · a · ‖x‖² ≤ κ · P · X0² for records
of norm ≤ X0, with κ = 1/2 for cross-entropy (λ_max(diag(p) − ppᵀ) ≤ 1/2) and κ = 1 for the
squared loss ½‖z − e_y‖². Lemma 3.2's ‖x‖² + λ misses the factor a ≤ P. dpml certifies with the
conservative β = κ P X0² + λ; the input norm clipping of preprocessing is what makes X0 a bound.

**Lipschitz bound.** For cross-entropy ‖∇_V ℓ‖ = ‖p − e_y‖ · ‖φ(x)‖ ≤ √2 · √P · X0, so a clip norm
C at or above it never clips; the squared loss has no such bound (its gradient grows with V).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

LOSS_CURVATURE = {"cross_entropy": 0.5, "squared": 1.0}


@dataclass(frozen=True)
class GatedSpec:
    in_features: int
    n_gates: int
    n_classes: int
    gate_seed: int

    def to_dict(self) -> dict:
        return asdict(self) | {"kind": "gated"}

    @classmethod
    def from_dict(cls, payload: dict) -> "GatedSpec":
        return cls(
            int(payload["in_features"]), int(payload["n_gates"]), int(payload["n_classes"]), int(payload["gate_seed"])
        )


def draw_gates(in_features: int, n_gates: int, seed: int) -> torch.Tensor:
    """u_1..u_P ~ N(0, I_d) as the columns of a (d, P) matrix, from a public seed."""
    return torch.randn(in_features, n_gates, generator=torch.Generator().manual_seed(seed))


class GatedLinear(nn.Module):
    """z(x) = Σ_p 1(u_pᵀx ≥ 0) · V_pᵀ x; parameters V (P, d, k), initialised at zero (convex problem)."""

    ghost_clipping = True  # the clipping engine asks this layer for norms and clipped sums

    def __init__(self, spec: GatedSpec) -> None:
        super().__init__()
        self.spec = spec
        self.register_buffer("gates", draw_gates(spec.in_features, spec.n_gates, spec.gate_seed))
        self.weight = nn.Parameter(torch.zeros(spec.n_gates, spec.in_features, spec.n_classes))

    def gate_pattern(self, x: torch.Tensor) -> torch.Tensor:
        """(B, P) 0/1 matrix g_p(x) = 1(u_pᵀx ≥ 0)."""
        return (x @ self.gates >= 0).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n_gates, d, k = self.weight.shape
        projected = (x @ self.weight.permute(1, 0, 2).reshape(d, n_gates * k)).view(-1, n_gates, k)
        return torch.einsum("bp,bpk->bk", self.gate_pattern(x), projected)

    def per_example_norms_squared(self, x: torch.Tensor, output_grad: torch.Tensor) -> torch.Tensor:
        """‖∇_V ℓ_i‖² = ‖δ_i‖² · a_i · ‖x_i‖² (φ(x_i) ⊗ δ_i has norm ‖φ(x_i)‖‖δ_i‖)."""
        return output_grad.pow(2).sum(1) * self.gate_pattern(x).sum(1) * x.pow(2).sum(1)

    def clipped_weight_sum(self, x: torch.Tensor, output_grad: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
        """Σ_i c_i φ(x_i) ⊗ δ_i as V's shape (P, d, k): one (d×B)·(B×Pk) product."""
        n_gates, d, k = self.weight.shape
        weighted = (factors[:, None] * self.gate_pattern(x))[:, :, None] * output_grad[:, None, :]  # (B, P, k)
        return (x.t() @ weighted.reshape(x.shape[0], n_gates * k)).view(d, n_gates, k).permute(1, 0, 2)


def build_gated(spec: GatedSpec) -> GatedLinear:
    return GatedLinear(spec)


def smoothness_bound(n_gates: int, input_norm: float, loss: str, l2: float = 0.0) -> float:
    """β = κ · P · X0² + λ ≥ the largest Hessian eigenvalue of any record's loss (module docstring)."""
    return LOSS_CURVATURE[loss] * n_gates * input_norm**2 + l2


def lipschitz_bound(n_gates: int, input_norm: float, loss: str) -> float | None:
    """A bound on ‖∇_V ℓ‖ over all records of norm ≤ X0 and all V: √(2P)·X0 for cross-entropy, none for squared."""
    return math.sqrt(2.0 * n_gates) * input_norm if loss == "cross_entropy" else None
