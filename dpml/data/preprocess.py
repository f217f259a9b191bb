"""Preprocessing with public constants only, and per-record L2 input norm clipping.

x' = (clip(x, lower, upper) − lower) / (upper − lower) uses bounds declared in the config
(never statistics of the private data), then each record is mapped into the L2 ball of radius
X0 = ``clip_norm``:
- ``project``: x ← x · min(1, X0 / ‖x‖)  (the Euclidean projection onto the ball);
- ``sphere``:  x ← x · X0 / ‖x‖ (records with x = 0 stay 0).
Afterwards ‖x‖ ≤ X0 for every record: this input bound is what Lipschitz/clipless trainers
and the smoothness constants of the convex trainers rely on. Each record is transformed on its
own, so the transformation is the same function on neighbouring data sets (no privacy cost).
Optionally, between scaling and clipping, a data-independent feature extractor (ScatterNet,
:mod:`dpml.data.features`) replaces the pixels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpml.config import PreprocessConfig


@dataclass(frozen=True)
class Prepared:
    x: np.ndarray
    clipped_fraction: float


def scale_features(x: np.ndarray, config: PreprocessConfig) -> np.ndarray:
    clipped = np.clip(x, config.lower, config.upper)
    return (clipped - config.lower) / (config.upper - config.lower)


def clip_input_norms(x: np.ndarray, radius: float, mode: str = "project") -> Prepared:
    """Map each row into the L2 ball of ``radius``; report the fraction of rows changed."""
    norms = np.linalg.norm(x, axis=1)
    if mode == "sphere":
        factor = np.where(norms > 0, radius / np.maximum(norms, 1e-300), 1.0)
        changed = norms > 0
    else:
        factor = np.minimum(1.0, radius / np.maximum(norms, 1e-300))
        changed = norms > radius
    out = x * factor[:, None]
    # Guard against rounding: the bound must hold exactly, as later certificates rely on it.
    over = np.linalg.norm(out, axis=1) > radius
    if over.any():
        out[over] *= np.nextafter(radius, 0) / np.linalg.norm(out[over], axis=1)[:, None]
    fraction = float(changed.mean()) if x.shape[0] else 0.0
    return Prepared(x=out, clipped_fraction=fraction)


def preprocess(x: np.ndarray, config: PreprocessConfig) -> Prepared:
    scaled = scale_features(x, config)
    if config.features == "scatternet":
        from dpml.data.features import scatter_features

        assert config.image_shape is not None
        scaled = scatter_features(scaled, (config.image_shape[0], config.image_shape[1]), config.scatter_groups)
    return clip_input_norms(scaled, config.clip_norm, config.clip_mode)
