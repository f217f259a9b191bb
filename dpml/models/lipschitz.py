"""Lipschitz layers and losses with gradient bounds: the parts of clipless DP-SGD (seed 004, Béthune et al.).

With every input of norm ≤ X0, layers whose Lipschitz constants are enforced by a projection after
each optimiser step (post-processing, not a reparametrisation), and a loss that is L-Lipschitz in
the logits, each layer's per-example parameter gradient is bounded analytically (Algorithm 1):

- forward over scalars: X_0 = X0, X_d = ``propagate_inputs(X_{d−1})`` bounds ‖f_d(x)‖;
- backward: G = L (bound on ‖∂ℓ/∂logits‖); for d = D..1: Δ_d = ``parameter_gradient_bound(X_{d−1}, G)``,
  G ← G · ``lipschitz`` (the layer's Lipschitz constant in its input).

Layers (module docstrings give each bound): :class:`SpectralLinear` (‖W‖₂ ≤ 1 by power iteration
with a cached vector, optional bias in a ball of radius B), :class:`GroupSort2` (sorts pairs:
1-Lipschitz, norm-preserving), :class:`LayerCentering` (x − mean(x): 1-Lipschitz, never increases
the norm), :class:`InputBound` (projects onto the ball of radius X0: the safety net for inputs).
Losses: :func:`tau_cross_entropy` (CE(τz)/τ, L = √2), :func:`multiclass_hinge` (L = √2) — each
with its constant in :data:`LOSS_LIPSCHITZ`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


class LipschitzLayer(nn.Module):
    """A layer that knows how it transforms input-norm and gradient bounds (Algorithm 1)."""

    lipschitz: float = 1.0

    def propagate_inputs(self, input_bound: float) -> float:
        return input_bound

    def parameter_gradient_bounds(self, input_bound: float, gradient_bound: float) -> dict[str, float]:
        """Per-example bound on ‖∂ℓ/∂p‖ for each own parameter p, given ‖input‖ ≤ X and ‖∂ℓ/∂output‖ ≤ G."""
        return {}

    def project(self) -> None:
        """Restore the layer's constraint in place (called under no_grad after each optimiser step)."""


class SpectralLinear(nn.Linear, LipschitzLayer):
    """z = Wx + b with ‖W‖₂ ≤ 1 and ‖b‖ ≤ B (``bias_bound``; ``None`` for no bias).

    Bounds: ‖z‖ ≤ ‖x‖ + B; ∂ℓ/∂W = g xᵀ so ‖∂ℓ/∂W‖_F = ‖g‖‖x‖ ≤ G·X; ‖∂ℓ/∂b‖ = ‖g‖ ≤ G; the input
    gradient Wᵀg has norm ≤ G (Lipschitz 1). :meth:`project` divides W by its largest singular value
    estimated by power iteration from a cached vector (warm-started, so usually a few iterations:
    the weights move little between steps; it stops when the estimate changes by < 1e-7 relative,
    at most ``power_iterations``) when it exceeds 1/(1 + 10⁻³) — aiming 0.1% inside the constraint,
    since power iteration approaches σ_max from below — and projects b onto its ball. Layers with
    min(d_in, d_out) ≤ 128 use the exact σ_max instead (a small SVD; power iteration with large
    steps was measured 0.2% above the constraint there and caught by the soundness check). Power iteration
    approaches σ_max from below, so the trainer's soundness check verifies the exact norms.
    """

    def __init__(self, in_features: int, out_features: int, bias_bound: float | None = None,
                 power_iterations: int = 100) -> None:
        nn.Linear.__init__(self, in_features, out_features, bias=bias_bound is not None)
        self.bias_bound = bias_bound
        self.power_iterations = power_iterations
        self.register_buffer("singular_vector", F.normalize(torch.randn(in_features), dim=0))
        with torch.no_grad():
            nn.init.orthogonal_(self.weight)
            if self.bias is not None:
                self.bias.zero_()

    def propagate_inputs(self, input_bound: float) -> float:
        return input_bound + (self.bias_bound or 0.0)

    def parameter_gradient_bounds(self, input_bound: float, gradient_bound: float) -> dict[str, float]:
        bounds = {"weight": gradient_bound * input_bound}
        if self.bias is not None:
            bounds["bias"] = gradient_bound
        return bounds

    @torch.no_grad()
    def spectral_norm_estimate(self, iterations: int | None = None) -> float:
        v, previous = self.singular_vector, 0.0
        for _ in range(iterations or self.power_iterations):
            u = self.weight @ v
            estimate = float(u.norm())
            v = F.normalize(self.weight.t() @ F.normalize(u, dim=0), dim=0)
            if abs(estimate - previous) <= 1e-7 * estimate:
                break
            previous = estimate
        if float(v.norm()) == 0.0:  # W v = 0 (e.g. W = 0): restart from a fresh direction next time
            v = F.normalize(torch.randn_like(v), dim=0)
        self.singular_vector.copy_(v)
        return float((self.weight @ v).norm())

    MARGIN = 1e-3  # power iteration approaches σ_max from below: aim at 1/(1 + MARGIN)
    EXACT_LIMIT = 128  # layers with min(d_in, d_out) ≤ this use the exact σ_max (a small SVD)

    @torch.no_grad()
    def project(self) -> None:
        if min(self.weight.shape) <= self.EXACT_LIMIT:
            sigma = float(torch.linalg.matrix_norm(self.weight, ord=2))
        else:
            sigma = self.spectral_norm_estimate() * (1 + self.MARGIN)
        if sigma > 1.0:
            self.weight.div_(sigma)
        if self.bias is not None and self.bias_bound is not None:
            norm = float(self.bias.norm())
            if norm > self.bias_bound:
                self.bias.mul_(self.bias_bound / norm)


class GroupSort2(LipschitzLayer):
    """Sorts consecutive pairs of features (MaxMin): a permutation per input, so 1-Lipschitz and ‖z‖ = ‖x‖."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"GroupSort2 needs an even number of features, got {x.shape[-1]}")
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((pairs.max(-1).values, pairs.min(-1).values), dim=-1).flatten(-2)


class LayerCentering(LipschitzLayer):
    """x − mean(x) over the features: an orthogonal projection, so 1-Lipschitz and ‖z‖ ≤ ‖x‖."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True)


class InputBound(LipschitzLayer):
    """Projects each input onto the ball of radius X0: guarantees the bound the others start from."""

    def __init__(self, radius: float) -> None:
        super().__init__()
        if radius <= 0:
            raise ValueError(f"input bound X0 = {radius}: must be > 0")
        self.radius = radius

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norms = x.flatten(1).norm(dim=1).clamp_min(1e-12)
        return x * (self.radius / norms).clamp(max=1.0).view(-1, *([1] * (x.dim() - 1)))

    def propagate_inputs(self, input_bound: float) -> float:
        return min(input_bound, self.radius)


def tau_cross_entropy(tau: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """ℓ(z, y) = CE(τ·z, y)/τ: ∂ℓ/∂z = softmax(τz) − e_y, of norm ≤ √2 for every τ (the convention fixed here)."""
    if tau <= 0:
        raise ValueError(f"tau = {tau}: must be > 0")

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(tau * logits, y, reduction="none") / tau

    return loss


def multiclass_hinge(margin: float = 1.0) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """ℓ(z, y) = Σ_{j≠y} max(0, m − (z_y − z_j)) / (k − 1): gradient e_j-terms averaged, norm ≤ √2."""

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        true = logits.gather(1, y[:, None])
        violations = F.relu(margin - (true - logits))
        violations = violations.scatter(1, y[:, None], 0.0)
        return violations.sum(1) / (logits.shape[1] - 1)

    return loss


LOSS_LIPSCHITZ = {"tau_cross_entropy": math.sqrt(2.0), "multiclass_hinge": math.sqrt(2.0)}


def gradient_bounds(model: nn.Sequential, input_bound: float, loss_lipschitz: float) -> dict[str, float]:
    """Algorithm 1: per-example gradient-norm bound of every parameter of a Sequential of Lipschitz layers."""
    layers = list(model)
    if not all(isinstance(layer, LipschitzLayer) for layer in layers):
        raise ValueError("every layer must be a LipschitzLayer: "
                         + ", ".join(type(m).__name__ for m in layers if not isinstance(m, LipschitzLayer)))
    inputs = [input_bound]
    for layer in layers:
        inputs.append(layer.propagate_inputs(inputs[-1]))
    bounds: dict[str, float] = {}
    gradient = loss_lipschitz
    for index in range(len(layers) - 1, -1, -1):
        layer = layers[index]
        for name, bound in layer.parameter_gradient_bounds(inputs[index], gradient).items():
            bounds[f"{index}.{name}"] = bound
        gradient *= layer.lipschitz
    return bounds


@torch.no_grad()
def project_all(model: nn.Module) -> None:
    """Apply every layer's projection in place (post-processing after an optimiser step)."""
    for module in model.modules():
        if isinstance(module, LipschitzLayer):
            module.project()


@dataclass(frozen=True)
class LipschitzSpec:
    """InputBound(X0) → [SpectralLinear → GroupSort2] × hidden → SpectralLinear (logits)."""

    in_features: int
    hidden: tuple[int, ...]
    n_classes: int
    input_bound: float
    bias_bound: float

    def to_dict(self) -> dict:
        return asdict(self) | {"kind": "lipschitz", "hidden": list(self.hidden)}

    @classmethod
    def from_dict(cls, payload: dict) -> "LipschitzSpec":
        return cls(int(payload["in_features"]), tuple(int(h) for h in payload["hidden"]), int(payload["n_classes"]),
                   float(payload["input_bound"]), float(payload["bias_bound"]))


def build_lipschitz(spec: LipschitzSpec) -> nn.Sequential:
    if any(width % 2 for width in spec.hidden):
        raise ValueError(f"hidden widths {list(spec.hidden)}: GroupSort2 needs even widths")
    layers: list[nn.Module] = [InputBound(spec.input_bound)]
    width = spec.in_features
    for hidden in spec.hidden:
        layers += [SpectralLinear(width, hidden, bias_bound=spec.bias_bound), GroupSort2()]
        width = hidden
    layers.append(SpectralLinear(width, spec.n_classes, bias_bound=spec.bias_bound))
    return nn.Sequential(*layers)
