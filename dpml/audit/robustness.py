"""Certified robust accuracy of Lipschitz classifiers (seed 004, Béthune et al., App. A.3).

If every logit map is ℓ-Lipschitz in L2 as a vector function (‖f(x) − f(x')‖ ≤ ℓ‖x − x'‖), the
difference of two logits f_i − f_j is √2·ℓ-Lipschitz, so the predicted class cannot change under
any perturbation of norm < (f_top(x) − f_second(x)) / (ℓ·√2). The certified accuracy at radius r
is the fraction of test records that are classified correctly *and* have that radius > r; at r = 0
it is the plain accuracy (ties excluded).

ℓ is the product of the layers' Lipschitz constants, each taken as the *measured* operator norm
of the constrained layers when a layer can report one (exact for dense layers, a certified upper
bound for convolutions) and the layer's analytic constant otherwise — never the nominal 1 of a
layer whose projection fell short.

Radii are in the units of the [0, 1]-scaled features (r/255 = r grey levels of an 8-bit image).
Preprocessing maps those features to the model's input by a 1-Lipschitz map when inputs are
*projected* onto the X0 ball (clipping each feature, projecting onto a ball: both 1-Lipschitz),
so the certificate transfers to the scaled features. Scaling onto the sphere and ScatterNet
features are not 1-Lipschitz: the radii are then stated in model-input units.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn
from dpml.models.lipschitz import LipschitzLayer, Residual

RADII_255 = (0, 1, 2, 4, 8, 16)


@torch.no_grad()
def layer_lipschitz(layer: nn.Module) -> float:
    """The layer's Lipschitz constant: its certified operator-norm bound when it has a constraint
    (exact σ_max for dense layers, the FFT bound for convolutions), a residual block's
    ½(1 + Π inner) from its own layers' measured constants, the analytic ``lipschitz`` otherwise."""
    if isinstance(layer, Residual):
        return 0.5 * (1.0 + math.prod(layer_lipschitz(inner) for inner in layer.inner))
    if not isinstance(layer, LipschitzLayer):
        raise ValueError(f"{type(layer).__name__}: not a Lipschitz layer; no robustness certificate")
    bound = layer.operator_norm_bound()
    return float(layer.lipschitz) if bound is None else float(bound)


def network_lipschitz(model: nn.Sequential) -> float:
    """ℓ = Π_d ℓ_d over the top-level layers of a Sequential of Lipschitz layers."""
    return math.prod(layer_lipschitz(layer) for layer in model)


@torch.no_grad()
def certified_radii(model: nn.Sequential, x: np.ndarray, y: np.ndarray, lipschitz: float) -> np.ndarray:
    """Per record: margin / (ℓ√2) when correctly classified with a positive margin, else 0 (or −1 if wrong)."""
    logits = model(torch.as_tensor(x, dtype=torch.float32)).double()
    top2 = logits.topk(2, dim=1)
    margin = (top2.values[:, 0] - top2.values[:, 1]).numpy()
    correct = top2.indices[:, 0].numpy() == y
    radius = margin / (lipschitz * math.sqrt(2.0))
    return np.where(correct, radius, -1.0)


def certified_accuracy(
    model: nn.Sequential, x: np.ndarray, y: np.ndarray, levels: tuple[int, ...] = RADII_255, unit: float = 1 / 255
) -> dict[str, Any]:
    """Certified accuracy at radius k·``unit`` for each k in ``levels`` (key ``certified_accuracy_r{k}``),
    strictly inside the certified ball, with ℓ and the median certified radius of correct records."""
    model.eval()
    lipschitz = network_lipschitz(model)
    radius = certified_radii(model, x, y, lipschitz)
    out: dict[str, Any] = {"lipschitz": lipschitz, "records": int(len(y))}
    for k in levels:
        out[f"certified_accuracy_r{k}"] = float(np.mean(radius > k * unit)) if len(y) else 0.0
    correct = radius[radius >= 0]
    out["median_certified_radius_correct"] = float(np.median(correct)) if correct.size else 0.0
    return out


def robustness_units(clip_mode: str, features: str) -> str:
    """What the radii measure, given the preprocessing (module docstring)."""
    if clip_mode == "project" and features == "none":
        return "L2 radius in the [0, 1]-scaled features (r/255 = r grey levels)"
    return "L2 radius at the model's input (the preprocessing is not 1-Lipschitz, so not in feature units)"
