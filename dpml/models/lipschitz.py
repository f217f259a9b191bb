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

The layers are in :mod:`dpml.models.lipschitz_layers`, the convolution in
:mod:`dpml.models.lipschitz_conv`, the losses in :mod:`dpml.models.lipschitz_losses`; this module
re-exports them and builds a model from its :class:`LipschitzSpec`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from torch import nn

from dpml.models.lipschitz_conv import SpectralConv2d
from dpml.models.lipschitz_layers import (
    BjorckLinear,
    Flatten,
    GroupSort2,
    InputBound,
    L2NormPool2d,
    LayerCentering,
    LipschitzLayer,
    Residual,
    SpectralLinear,
    Unflatten,
    gradient_bounds,
    project_all,
)
from dpml.models.lipschitz_losses import (
    LOSS_LIPSCHITZ,
    LossFn,
    hinge_kantorovich_rubinstein,
    hinge_kr_lipschitz,
    kantorovich_rubinstein,
    loss_lipschitz,
    multiclass_hinge,
    tau_cross_entropy,
)

__all__ = [
    "DENSE_LAYERS",
    "LOSS_LIPSCHITZ",
    "BjorckLinear",
    "Flatten",
    "GroupSort2",
    "InputBound",
    "L2NormPool2d",
    "LayerCentering",
    "LipschitzLayer",
    "LipschitzSpec",
    "LossFn",
    "Residual",
    "SpectralConv2d",
    "SpectralLinear",
    "Unflatten",
    "build_lipschitz",
    "gradient_bounds",
    "hinge_kantorovich_rubinstein",
    "hinge_kr_lipschitz",
    "kantorovich_rubinstein",
    "loss_lipschitz",
    "multiclass_hinge",
    "project_all",
    "tau_cross_entropy",
]


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
        return asdict(self) | {
            "kind": "lipschitz",
            "hidden": list(self.hidden),
            "conv": list(self.conv),
            "input_shape": None if self.input_shape is None else list(self.input_shape),
        }

    @classmethod
    def from_dict(cls, payload: dict) -> "LipschitzSpec":
        bias = payload["bias_bound"]
        shape = payload.get("input_shape")
        return cls(
            int(payload["in_features"]),
            tuple(int(h) for h in payload["hidden"]),
            int(payload["n_classes"]),
            float(payload["input_bound"]),
            None if bias is None else float(bias),
            conv=tuple(int(c) for c in payload.get("conv") or ()),
            input_shape=None if shape is None else (int(shape[0]), int(shape[1]), int(shape[2])),
            dense_layer=str(payload.get("dense_layer", "spectral")),
        )

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
            raise ValueError(
                f"input_shape = {self.input_shape} has {math.prod(self.input_shape)} entries, "
                f"in_features = {self.in_features}: they must agree"
            )
        _, h, w = self.input_shape
        if min(h, w) < 2 ** len(self.conv):
            raise ValueError(
                f"input_shape = {self.input_shape}: {len(self.conv)} pooling layers (2×2) need "
                f"height and width ≥ {2 ** len(self.conv)}"
            )


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
        layers += [
            SpectralConv2d(shape[0], channels, 3, shape, padding=1, bias_bound=spec.bias_bound),
            GroupSort2(dim=1),
            L2NormPool2d(2),
        ]
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
