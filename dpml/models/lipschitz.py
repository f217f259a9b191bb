"""Lipschitz layers and losses with gradient bounds: the parts of clipless DP-SGD (seed 004, Béthune et al.).

With every input of norm ≤ X0, layers whose Lipschitz constants are enforced by a projection after
each optimiser step (post-processing, not a reparametrisation), and a loss that is L-Lipschitz in
the logits, each layer's per-example parameter gradient is bounded analytically (Algorithm 1):

- forward over scalars: X_0 = X0, X_d = ``propagate_inputs(X_{d−1})`` bounds ‖f_d(x)‖;
- backward: G = L (bound on ‖∂ℓ/∂logits‖); for d = D..1: Δ_d = ``parameter_gradient_bound(X_{d−1}, G)``,
  G ← G · ``lipschitz`` (the layer's Lipschitz constant in its input).

Layers (class docstrings give each bound): :class:`SpectralLinear` (‖W‖₂ ≤ 1 by power iteration
with a cached vector, optional bias in a ball of radius B), :class:`BjorckLinear` (the same bounds,
W orthogonalised by Björck iterations: gradient-norm preserving), :class:`SpectralConv2d` (a
convolution whose operator norm on its input shape is ≤ 1, certified by the FFT of the kernel),
:class:`GroupSort2` (sorts pairs: 1-Lipschitz, norm-preserving), :class:`LayerCentering` (x − mean(x):
1-Lipschitz, never increases the norm), :class:`L2NormPool2d` (the L2 norm of each non-overlapping
window), :class:`Flatten` / :class:`Unflatten` (reshapes: isometries), :class:`Residual`
(½(x + f(x)) around a Sequential of Lipschitz layers), :class:`InputBound` (projects onto the ball
of radius X0: the safety net for inputs).
Losses: :func:`tau_cross_entropy` (CE(τz)/τ, L = √2), :func:`multiclass_hinge` (L = √2),
:func:`kantorovich_rubinstein` (L = √(k/(k−1)) ≤ √2), :func:`hinge_kantorovich_rubinstein`
(L = (1 + α(k−1)/k)·√(k/(k−1))) — constants in :data:`LOSS_LIPSCHITZ` (where they depend on no
hyper-parameter) and :func:`loss_lipschitz` (all of them, the exact ones given k and α).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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

    def __init__(self, in_features: int, out_features: int, bias_bound: float | None = None,
                 bjorck_iterations: int = 25, tolerance: float = 1e-5) -> None:
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
        w, gram = w / scale, gram / scale ** 2
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
# Convolution
# ---------------------------------------------------------------------------------------------------


def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


class SpectralConv2d(nn.Conv2d, LipschitzLayer):
    """y = K ⋆ x + b (zero padding, stride 1) on inputs of shape ``input_shape`` = (C, H, W), with the
    operator norm of x ↦ K ⋆ x on that shape ≤ 1 and ‖b‖ ≤ B (``bias_bound``; ``None`` for no bias).

    **Bounds** (seed 004, App. C.2.2, Property 3; s = kh·kw taps, S = H_out·W_out output positions):

    - kernel: ∂ℓ/∂K[f, (c,a,b)] = Σ_p g[f,p] x_pad[c, p+(a,b)], i.e. ∂ℓ/∂K = Gmat·M with Gmat (F × S)
      the output gradient and M (S × C·s) the matrix of input patches (im2col). So
      ‖∂ℓ/∂K‖_F ≤ ‖Gmat‖_F ‖M‖₂ ≤ ‖g‖·‖M‖_F, and ‖M‖_F² = Σ_q x_q² · #{windows containing pixel q}
      ≤ s‖x‖² since with stride 1 each input pixel lies in at most s windows (exactly s inside the
      image; padding only removes windows). Hence Δ_K = √s · G · X. (Strides > 1 would put a pixel
      in at most ⌈kh/sh⌉⌈kw/sw⌉ ≤ s windows — the paper notes the bound is looser there; this class
      refuses strides other than 1.)
    - bias: ∂ℓ/∂b_f = Σ_p g[f,p], so by Cauchy–Schwarz ‖∂ℓ/∂b‖ ≤ √S · G; it adds the constant map
      b ⊗ 1_S of norm √S‖b‖ to the output: ‖y‖ ≤ ‖x‖ + √S·B.
    - input: the input gradient is Kᵀg, of norm ≤ ‖K‖_op · G ≤ G (Lipschitz 1).

    **Projection.** :meth:`project` divides K by :meth:`certified_spectral_norm` (when it exceeds 1),
    an upper bound on the operator norm computed exactly from the 2-D FFT of the zero-padded kernel
    (Sedghi, Gupta & Long 2019) — so the constraint is certified, not estimated. Set
    ``certified_projection=False`` to divide by the power-iteration estimate ×(1 + 10⁻³) instead
    (:meth:`spectral_norm_estimate`: ``conv2d`` / ``conv_transpose2d`` on the actual input shape from a
    cached vector; cheaper for very wide layers, but it approaches the norm from below — slowly, since
    a convolution's top singular values cluster (neighbouring frequencies): measured up to 1% above
    the constraint after SGD steps — and targets the zero-padded operator, so the trainer's certified
    check may then fail and void the run).
    """

    MARGIN = 1e-3

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
                 input_shape: tuple[int, int, int], padding: int | tuple[int, int] | None = None,
                 bias_bound: float | None = None, stride: int = 1, power_iterations: int = 100,
                 certified_projection: bool = True) -> None:
        kh, kw = _pair(kernel_size)
        pad = ((kh - 1) // 2, (kw - 1) // 2) if padding is None else _pair(padding)
        _check_conv_arguments(in_channels, (kh, kw), input_shape, pad, stride)
        nn.Conv2d.__init__(self, in_channels, out_channels, (kh, kw), stride=1, padding=pad,
                           bias=bias_bound is not None)
        self.input_shape = (int(input_shape[0]), int(input_shape[1]), int(input_shape[2]))
        self.bias_bound = bias_bound
        self.power_iterations = power_iterations
        self.certified_projection = certified_projection
        self.register_buffer("singular_vector", F.normalize(torch.randn(self.input_shape).flatten(), dim=0)
                             .view(self.input_shape))
        with torch.no_grad():
            nn.init.orthogonal_(self.weight)
            if self.bias is not None:
                self.bias.zero_()
        self.project()

    @property
    def taps(self) -> int:
        """s = kh·kw: the most windows one input pixel can lie in (stride 1)."""
        return self.kernel_size[0] * self.kernel_size[1]

    @property
    def output_shape(self) -> tuple[int, int, int]:
        _, h, w = self.input_shape
        return (self.out_channels, h + 2 * self.padding[0] - self.kernel_size[0] + 1,
                w + 2 * self.padding[1] - self.kernel_size[1] + 1)

    @property
    def fft_grid(self) -> tuple[int, int]:
        """(H + 2ph, W + 2pw): the padded input's size, on which the zero-padded map is a circular one."""
        _, h, w = self.input_shape
        return (h + 2 * self.padding[0], w + 2 * self.padding[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-3:]) != self.input_shape:
            raise ValueError(f"SpectralConv2d built for input_shape {self.input_shape} got an input of shape "
                             f"{tuple(x.shape)}: its projection and bounds hold for that shape only")
        return super().forward(x)

    def propagate_inputs(self, input_bound: float) -> float:
        _, h, w = self.output_shape
        return input_bound + math.sqrt(h * w) * (self.bias_bound or 0.0)

    def parameter_gradient_bounds(self, input_bound: float, gradient_bound: float) -> dict[str, float]:
        bounds = {"weight": math.sqrt(self.taps) * gradient_bound * input_bound}
        if self.bias is not None:
            _, h, w = self.output_shape
            bounds["bias"] = math.sqrt(h * w) * gradient_bound
        return bounds

    @torch.no_grad()
    def certified_spectral_norm(self) -> float:
        """An upper bound on ‖x ↦ K ⋆ x‖ (zero padding, the layer's input shape), exact up to float64
        rounding for the circular convolution it is computed from.

        Why it bounds the zero-padded operator A: let N = (H + 2ph, W + 2pw), E the isometry placing x
        (zero-filled) at offset (ph, pw) in an N-grid, C_N the circular cross-correlation with K on
        that grid, and R the restriction to output positions [0, H_out) × [0, W_out). Output (i, j)
        reads grid rows i..i+kh−1 ≤ H_out − 1 + kh − 1 = H + 2ph − 1 < N_h (and likewise columns), so
        no index wraps around and A = R ∘ C_N ∘ E exactly. ‖R‖ ≤ 1 (a coordinate projection) and E is
        an isometry, hence ‖A‖ ≤ ‖C_N‖. The 2-D DFT (unitary) block-diagonalises C_N: at frequency ω
        the output channels are conj(K̂(ω)) times the input channels, K̂(ω) ∈ ℂ^{F×C} the DFT of the
        zero-padded kernel, so ‖C_N‖ = max_ω σ_max(K̂(ω)) (Sedghi, Gupta & Long 2019, the multi-channel
        case). Real kernels have K̂(−ω) = conj K̂(ω), so ``rfft2`` (half the frequencies) suffices;
        σ_max² is the top eigenvalue of the smaller Gram matrix, computed with ``eigvalsh`` in float64.
        Cost: N_h·(N_w/2 + 1) eigenproblems of size min(C, F) — 0.05 s for 32→64 channels on 14×14,
        3.4 s for 128→128 on 32×32 (one CPU core).
        """
        kernel = self.weight.detach().to(torch.float64)
        spectrum = torch.fft.rfft2(kernel, s=self.fft_grid).permute(2, 3, 0, 1)  # (Nh, Nw//2+1, F, C)
        gram = spectrum.mH @ spectrum if spectrum.shape[-1] <= spectrum.shape[-2] else spectrum @ spectrum.mH
        top = torch.linalg.eigvalsh(gram)[..., -1]
        return math.sqrt(max(float(top.max()), 0.0))

    @torch.no_grad()
    def spectral_norm_estimate(self, iterations: int | None = None) -> float:
        """Power iteration on AᵀA (A = ``conv2d`` on the input shape, Aᵀ = ``conv_transpose2d``, its exact
        adjoint for stride 1) from the cached vector: a lower bound on ‖A‖ that converges to it."""
        v, previous = self.singular_vector.unsqueeze(0), 0.0
        for _ in range(iterations or self.power_iterations):
            u = F.conv2d(v, self.weight, padding=self.padding)
            estimate = float(u.norm())
            back = F.conv_transpose2d(u / max(estimate, 1e-30), self.weight, padding=self.padding)
            v = back / max(float(back.norm()), 1e-30)
            if abs(estimate - previous) <= 1e-7 * estimate:
                break
            previous = estimate
        if float(v.norm()) == 0.0:  # A v = 0: restart from a fresh direction next time
            v = F.normalize(torch.randn_like(v).flatten(), dim=0).view_as(v)
        self.singular_vector.copy_(v.squeeze(0))
        return float(F.conv2d(v, self.weight, padding=self.padding).norm())

    @torch.no_grad()
    def project(self) -> None:
        if self.certified_projection:
            sigma = self.certified_spectral_norm()
        else:
            sigma = self.spectral_norm_estimate() * (1 + self.MARGIN)
        if sigma > 1.0:
            self.weight.div_(sigma)
        if self.bias is not None and self.bias_bound is not None:
            norm = float(self.bias.norm())
            if norm > self.bias_bound:
                self.bias.mul_(self.bias_bound / norm)

    def operator_norm_bound(self) -> float:
        return self.certified_spectral_norm()


def _check_conv_arguments(in_channels: int, kernel: tuple[int, int], input_shape: tuple[int, int, int],
                          padding: tuple[int, int], stride: int) -> None:
    if stride != 1:
        raise ValueError(f"SpectralConv2d stride = {stride}: only stride 1 is supported (the √s gradient "
                         "bound and the adjoint used by power iteration are derived for stride 1)")
    if len(input_shape) != 3 or input_shape[0] != in_channels:
        raise ValueError(f"SpectralConv2d input_shape = {tuple(input_shape)}: expected (C, H, W) with "
                         f"C = in_channels = {in_channels}")
    if min(padding) < 0:
        raise ValueError(f"SpectralConv2d padding = {padding}: must be ≥ 0")
    for size, k, p, axis in zip(input_shape[1:], kernel, padding, ("height", "width")):
        if size + 2 * p < k:
            raise ValueError(f"SpectralConv2d input {axis} {size} with padding {p} is smaller than the kernel ({k})")


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
            raise ValueError(f"GroupSort2 needs an even number of features along dim {self.dim}, "
                             f"got {x.shape[self.dim]}")
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


def _backward_bounds(layers: list[LipschitzLayer], inputs: list[float],
                     gradient_bound: float) -> tuple[dict[str, float], float]:
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
            raise ValueError(f"Residual: the inner layers map shape {tuple(x.shape)} to {tuple(y.shape)}; "
                             "they must preserve it")
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


LOSS_LIPSCHITZ = {"tau_cross_entropy": math.sqrt(2.0), "multiclass_hinge": math.sqrt(2.0),
                  "kantorovich_rubinstein": math.sqrt(2.0)}
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
        raise ValueError(f"loss {name!r} has no known Lipschitz constant: expected one of "
                         f"{sorted([*LOSS_LIPSCHITZ, 'hinge_kantorovich_rubinstein'])}")
    if n_classes is None or name == "tau_cross_entropy":
        return LOSS_LIPSCHITZ[name]
    k = _require_classes(n_classes)
    return math.sqrt(k / (k - 1))


# ---------------------------------------------------------------------------------------------------
# The model spec
# ---------------------------------------------------------------------------------------------------

DENSE_LAYERS = ("spectral", "bjorck")


@dataclass(frozen=True)
class LipschitzSpec:
    """InputBound(X0) → [conv part] → [dense layer → GroupSort2] × hidden → dense layer (logits).

    Conv part (when ``conv`` is non-empty; ``input_shape`` = (C, H, W) with C·H·W = ``in_features``):
    Unflatten(input_shape) → [SpectralConv2d(3×3, stride 1, padding 1) → GroupSort2 over channels →
    L2NormPool2d(2)] per entry of ``conv`` (its output channels) → Flatten. ``dense_layer`` picks
    :class:`SpectralLinear` or :class:`BjorckLinear`; ``bias_bound`` = ``None`` means no biases
    anywhere (else every layer has a bias in the ball of that radius). Seed 004's MNIST configuration
    (App. B.2): ``LipschitzSpec(784, (512,), 10, 20.0, None, conv=(32, 64), input_shape=(1, 28, 28))``.
    """

    in_features: int
    hidden: tuple[int, ...]
    n_classes: int
    input_bound: float
    bias_bound: float | None
    conv: tuple[int, ...] = ()
    input_shape: tuple[int, int, int] | None = None
    dense_layer: str = "spectral"

    def to_dict(self) -> dict:
        return asdict(self) | {"kind": "lipschitz", "hidden": list(self.hidden), "conv": list(self.conv),
                               "input_shape": None if self.input_shape is None else list(self.input_shape)}

    @classmethod
    def from_dict(cls, payload: dict) -> "LipschitzSpec":
        bias = payload["bias_bound"]
        shape = payload.get("input_shape")
        return cls(int(payload["in_features"]), tuple(int(h) for h in payload["hidden"]), int(payload["n_classes"]),
                   float(payload["input_bound"]), None if bias is None else float(bias),
                   conv=tuple(int(c) for c in payload.get("conv") or ()),
                   input_shape=None if shape is None else (int(shape[0]), int(shape[1]), int(shape[2])),
                   dense_layer=str(payload.get("dense_layer", "spectral")))

    def validate(self) -> None:
        """Raise ValueError naming the field, its value and what is allowed."""
        if any(width % 2 for width in self.hidden):
            raise ValueError(f"hidden widths {list(self.hidden)}: GroupSort2 needs even widths")
        if self.dense_layer not in DENSE_LAYERS:
            raise ValueError(f"dense_layer = {self.dense_layer!r}: expected one of {list(DENSE_LAYERS)}")
        if self.bias_bound is not None and self.bias_bound < 0:
            raise ValueError(f"bias_bound = {self.bias_bound}: must be ≥ 0 (or None for no biases)")
        if not self.conv:
            if self.input_shape is not None:
                raise ValueError(f"input_shape = {self.input_shape} is only used with conv layers: conv is empty")
            return
        if any(c <= 0 or c % 2 for c in self.conv):
            raise ValueError(f"conv channels {list(self.conv)}: GroupSort2 over channels needs even, positive counts")
        if self.input_shape is None or len(self.input_shape) != 3 or min(self.input_shape) <= 0:
            raise ValueError(f"input_shape = {self.input_shape}: conv layers need (C, H, W) with positive entries")
        if math.prod(self.input_shape) != self.in_features:
            raise ValueError(f"input_shape = {self.input_shape} has {math.prod(self.input_shape)} entries, "
                             f"in_features = {self.in_features}: they must agree")
        _, h, w = self.input_shape
        if min(h, w) < 2 ** len(self.conv):
            raise ValueError(f"input_shape = {self.input_shape}: {len(self.conv)} pooling layers (2×2) need "
                             f"height and width ≥ {2 ** len(self.conv)}")


def _dense(kind: str, in_features: int, out_features: int, bias_bound: float | None) -> SpectralLinear:
    if kind == "bjorck":
        return BjorckLinear(in_features, out_features, bias_bound=bias_bound)
    return SpectralLinear(in_features, out_features, bias_bound=bias_bound)


def _conv_part(spec: LipschitzSpec) -> tuple[list[nn.Module], int]:
    """The convolutional layers of ``spec`` and the number of features they hand to the dense part."""
    assert spec.input_shape is not None
    shape = spec.input_shape
    layers: list[nn.Module] = [Unflatten(shape)]
    for channels in spec.conv:
        layers += [SpectralConv2d(shape[0], channels, 3, shape, padding=1, bias_bound=spec.bias_bound),
                   GroupSort2(dim=1), L2NormPool2d(2)]
        shape = (channels, shape[1] // 2, shape[2] // 2)
    layers.append(Flatten())
    return layers, math.prod(shape)


def build_lipschitz(spec: LipschitzSpec) -> nn.Sequential:
    spec.validate()
    layers: list[nn.Module] = [InputBound(spec.input_bound)]
    width = spec.in_features
    if spec.conv:
        conv_layers, width = _conv_part(spec)
        layers += conv_layers
    for hidden in spec.hidden:
        layers += [_dense(spec.dense_layer, width, hidden, spec.bias_bound), GroupSort2()]
        width = hidden
    layers.append(_dense(spec.dense_layer, width, spec.n_classes, spec.bias_bound))
    return nn.Sequential(*layers)
