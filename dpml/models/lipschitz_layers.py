"""Lipschitz layers and Algorithm 1's gradient bounds (seed 004, Béthune et al.): the dense layers,
activations, pooling, reshapes, the input bound and the residual block. Overview: :mod:`dpml.models.lipschitz`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

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

    def operator_norm_bound(self) -> float | None:
        """A certified upper bound on the norm of the layer's constrained linear operator (``None``: no
        constraint to verify). The trainer's soundness check requires it to be ≤ 1 after every epoch."""
        return None


# ---------------------------------------------------------------------------------------------------
# Dense layers
# ---------------------------------------------------------------------------------------------------


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
    approaches σ_max from below, so the trainer's soundness check verifies the exact norms
    (:meth:`operator_norm_bound`: σ_max by SVD in float64).
    """

    def __init__(
        self, in_features: int, out_features: int, bias_bound: float | None = None, power_iterations: int = 100
    ) -> None:
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
        self._project_bias()

    @torch.no_grad()
    def _project_bias(self) -> None:
        if self.bias is not None and self.bias_bound is not None:
            norm = float(self.bias.norm())
            if norm > self.bias_bound:
                self.bias.mul_(self.bias_bound / norm)

    @torch.no_grad()
    def operator_norm_bound(self) -> float:
        return float(torch.linalg.matrix_norm(self.weight.double(), ord=2))


def _small_gram(w: torch.Tensor) -> torch.Tensor:
    """The smaller of W Wᵀ and WᵀW (same non-zero eigenvalues σ_i² of W)."""
    return w @ w.t() if w.shape[0] <= w.shape[1] else w.t() @ w


def _gram_norm_bound(gram: torch.Tensor) -> float:
    """√(max_i Σ_j |G_ij|) ≥ √λ_max(G) = σ_max(W): the spectral radius of a symmetric matrix is at most
    any induced norm, here the ∞-norm (largest absolute row sum). Tight when G ≈ I (W near-orthogonal)."""
    return math.sqrt(float(gram.abs().sum(1).max()))


class BjorckLinear(SpectralLinear):
    """z = Wx + b with W orthogonalised by Björck iterations (a gradient-norm-preserving dense layer).

    Same bounds as :class:`SpectralLinear` (they only need ‖W‖₂ ≤ 1 and ‖b‖ ≤ B). :meth:`project`:

    1. scale W by the certified bound √‖G‖_∞ ≥ σ_max (G the smaller Gram matrix, :func:`_gram_norm_bound`),
       so every singular value lies in [0, 1];
    2. Björck iterations W ← W(1.5 I − 0.5 WᵀW) (written (1.5 I − 0.5 WWᵀ)W when W is wide): each maps
       every singular value σ to f(σ) = 1.5σ − 0.5σ³, and f([0, 1]) ⊆ [0, 1] (f' = 1.5(1 − σ²) ≥ 0,
       f(1) = 1), so the constraint is kept, while σ → 1 (quadratically near 1): W → UVᵀ, the nearest
       (semi-)orthogonal matrix (seed 004 §4 / App. B: "SpectralDense ... Björck orthogonalization").
       At most ``bjorck_iterations``, stopping once max|G − I| ≤ ``tolerance``;
    3. finish with the certified bound again, in float64: rounding in the iterations can leave σ_max a
       few ulps above 1, and then W is divided by it, so ‖W‖₂ ≤ 1 holds after every call (up to the
       rounding of that last division).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias_bound: float | None = None,
        bjorck_iterations: int = 25,
        tolerance: float = 1e-5,
    ) -> None:
        super().__init__(in_features, out_features, bias_bound=bias_bound)
        if bjorck_iterations < 1:
            raise ValueError(f"bjorck_iterations = {bjorck_iterations}: must be ≥ 1")
        self.bjorck_iterations = bjorck_iterations
        self.tolerance = tolerance

    @torch.no_grad()
    def project(self) -> None:
        w = self.weight.detach().clone()
        gram = _small_gram(w)
        scale = _gram_norm_bound(gram)
        if scale == 0.0:
            self._project_bias()
            return
        w, gram = w / scale, gram / scale**2
        identity = torch.eye(gram.shape[0], dtype=w.dtype, device=w.device)
        for _ in range(self.bjorck_iterations):
            if float((gram - identity).abs().max()) <= self.tolerance:
                break
            w = _bjorck_step(w, gram)
            gram = _small_gram(w)
        self.weight.copy_(w)
        bound = _gram_norm_bound(_small_gram(self.weight.double()))
        if bound > 1.0:
            self.weight.div_(bound)
        self._project_bias()


def _bjorck_step(w: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """One Björck step 1.5 W − 0.5 W WᵀW, with the Gram matrix on the smaller side."""
    product = gram @ w if w.shape[0] <= w.shape[1] else w @ gram
    return 1.5 * w - 0.5 * product


# ---------------------------------------------------------------------------------------------------
# Activations, pooling, reshapes
# ---------------------------------------------------------------------------------------------------


class GroupSort2(LipschitzLayer):
    """Sorts consecutive pairs of features along ``dim`` (MaxMin): a permutation per input, so 1-Lipschitz
    and ‖z‖ = ‖x‖. ``dim = -1`` for dense features, ``dim = 1`` for the channels of a feature map."""

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[self.dim] % 2:
            raise ValueError(
                f"GroupSort2 needs an even number of features along dim {self.dim}, got {x.shape[self.dim]}"
            )
        moved = x.movedim(self.dim, -1)
        pairs = moved.unflatten(-1, (-1, 2))
        return torch.stack((pairs.max(-1).values, pairs.min(-1).values), dim=-1).flatten(-2).movedim(-1, self.dim)


class LayerCentering(LipschitzLayer):
    """x − mean(x) over the features: an orthogonal projection, so 1-Lipschitz and ‖z‖ ≤ ‖x‖."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True)


class L2NormPool2d(LipschitzLayer):
    """y[c, i, j] = ‖x[c, window(i, j)]‖₂ over non-overlapping k×k windows (deel-lip's
    ScaledL2NormPooling2D: √(k²)·√(avg(x²)); seed 004 App. B: "GNP since it performs x ↦ (‖x_m‖₂)_m").

    Norm: ‖y‖² = Σ_windows ‖x_w‖² ≤ ‖x‖² (equality when the windows tile the input; a remainder row or
    column that fits no window is dropped), so X is unchanged. Lipschitz 1: per window
    |‖a_w‖ − ‖b_w‖| ≤ ‖a_w − b_w‖ (reverse triangle inequality), and since the windows are disjoint,
    ‖y(a) − y(b)‖² ≤ Σ_w ‖a_w − b_w‖² ≤ ‖a − b‖². (Overlapping windows would count pixels several
    times: not 1-Lipschitz — hence stride = kernel only.) The gradient x_w/‖x_w‖ has norm 1 per window;
    at x_w = 0 it is set to 0 (a subgradient), so no NaN and no violation of the bound.
    """

    def __init__(self, kernel_size: int = 2) -> None:
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"L2NormPool2d kernel_size = {kernel_size}: must be ≥ 1")
        self.kernel_size = kernel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernel_size
        squares = F.avg_pool2d(x * x, k, stride=k) * (k * k)
        tiny = torch.finfo(x.dtype).tiny
        return torch.where(squares > 0, squares.clamp_min(tiny).sqrt(), torch.zeros_like(squares))


class Flatten(LipschitzLayer):
    """(N, ...) → (N, d): a reshape, an isometry (identity on every bound)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)


class Unflatten(LipschitzLayer):
    """(N, d) or (N, *shape) → (N, *shape): a reshape, an isometry (identity on every bound)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = tuple(int(s) for s in shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], *self.shape)


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


# ---------------------------------------------------------------------------------------------------
# Algorithm 1 and the residual block
# ---------------------------------------------------------------------------------------------------


def _check_layers(layers: Iterable[nn.Module]) -> list[LipschitzLayer]:
    layers = list(layers)
    wrong = [type(m).__name__ for m in layers if not isinstance(m, LipschitzLayer)]
    if wrong:
        raise ValueError("every layer must be a LipschitzLayer: " + ", ".join(wrong))
    return layers  # type: ignore[return-value]


def _input_bounds(layers: list[LipschitzLayer], input_bound: float) -> list[float]:
    """Algorithm 1, forward: X_0 = X, X_d = layer_d.propagate_inputs(X_{d−1}) (D + 1 values)."""
    bounds = [input_bound]
    for layer in layers:
        bounds.append(layer.propagate_inputs(bounds[-1]))
    return bounds


def _backward_bounds(
    layers: list[LipschitzLayer], inputs: list[float], gradient_bound: float
) -> tuple[dict[str, float], float]:
    """Algorithm 1, backward: Δ for every parameter (named ``{index}.{name}`` as in ``named_parameters``)
    and the bound on ‖∂ℓ/∂input‖ of the whole sequence."""
    bounds: dict[str, float] = {}
    gradient = gradient_bound
    for index in range(len(layers) - 1, -1, -1):
        layer = layers[index]
        for name, bound in layer.parameter_gradient_bounds(inputs[index], gradient).items():
            bounds[f"{index}.{name}"] = bound
        gradient *= layer.lipschitz
    return bounds, gradient


class Residual(LipschitzLayer):
    """out = ½(x + f(x)), f = ``inner`` (an nn.Sequential of Lipschitz layers, shape-preserving): the
    1-Lipschitz merge of seed 004 App. C.2 ("residual: 2, or 1 with a 0.5 merge").

    Bounds: ‖out‖ ≤ ½(X + X_f) with X_f the inner sequence's output bound; the inner output receives
    the gradient ½g, so the inner layers' parameter bounds are Algorithm 1 run inside f from
    G_f = G/2; the input gradient is ½(g + J_fᵀg), so lipschitz = ½(1 + Π_d l_d). The inner
    parameters are named ``inner.{j}.{name}`` (prefixed by the block's index in the outer Sequential),
    exactly as ``named_parameters`` names them, so they belong to the block's top-level layer group.
    """

    def __init__(self, inner: nn.Sequential | Iterable[nn.Module]) -> None:
        super().__init__()
        sequence = inner if isinstance(inner, nn.Sequential) else nn.Sequential(*inner)
        _check_layers(sequence)
        self.inner = sequence

    @property
    def lipschitz(self) -> float:  # type: ignore[override]
        return 0.5 * (1.0 + math.prod(layer.lipschitz for layer in self.inner))  # type: ignore[misc]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if y.shape != x.shape:
            raise ValueError(
                f"Residual: the inner layers map shape {tuple(x.shape)} to {tuple(y.shape)}; they must preserve it"
            )
        return 0.5 * (x + y)

    def propagate_inputs(self, input_bound: float) -> float:
        return 0.5 * (input_bound + _input_bounds(list(self.inner), input_bound)[-1])  # type: ignore[arg-type]

    def parameter_gradient_bounds(self, input_bound: float, gradient_bound: float) -> dict[str, float]:
        layers: list[LipschitzLayer] = list(self.inner)  # type: ignore[arg-type]
        bounds, _ = _backward_bounds(layers, _input_bounds(layers, input_bound), 0.5 * gradient_bound)
        return {f"inner.{name}": bound for name, bound in bounds.items()}


def gradient_bounds(model: nn.Sequential, input_bound: float, loss_lipschitz: float) -> dict[str, float]:
    """Algorithm 1: per-example gradient-norm bound of every parameter of a Sequential of Lipschitz layers.

    Keys are the names of ``model.named_parameters()`` (nested ones, e.g. ``3.inner.0.weight`` for a
    :class:`Residual` at index 3, included); their prefix before the first dot is the top-level layer."""
    layers = _check_layers(model)
    bounds, _ = _backward_bounds(layers, _input_bounds(layers, input_bound), loss_lipschitz)
    return bounds


@torch.no_grad()
def project_all(model: nn.Module) -> None:
    """Apply every layer's projection in place (post-processing after an optimiser step)."""
    for module in model.modules():
        if isinstance(module, LipschitzLayer):
            module.project()
