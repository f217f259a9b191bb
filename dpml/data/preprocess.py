"""Preprocessing with public constants only, and per-record L2 input norm clipping.

x' = (clip(x, lower, upper) − lower) / (upper − lower) uses bounds declared in the config (one pair
``preprocess.lower``/``upper`` for every feature, or each column's own from the table schema,
:mod:`dpml.data.encoding`), never statistics of the private data; then each record is mapped into
the L2 ball of radius X0 = ``clip_norm``:
- ``project``: x ← x · min(1, X0 / ‖x‖)  (the Euclidean projection onto the ball);
- ``sphere``:  x ← x · X0 / ‖x‖ (records with x = 0 stay 0).
Afterwards ‖x‖ ≤ X0 for every record: this input bound is what Lipschitz/clipless trainers
and the smoothness constants of the convex trainers rely on. Each record is transformed on its
own, so the transformation is the same function on neighbouring data sets (no privacy cost).
Optionally, between scaling and clipping, a data-independent feature extractor (ScatterNet,
:mod:`dpml.data.features`) replaces the pixels.

:class:`PublicTransform` holds these constants and nothing else: the preprocess stage applies it to
every part, and the registered model applies the same object to raw records (:mod:`dpml.tracking.serving`).
This module imports nothing from dpml at load (the registered model carries it by value).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from dpml.sections import PreprocessConfig


@dataclass(frozen=True)
class Prepared:
    x: np.ndarray
    clipped_fraction: float


def scale_features(x: np.ndarray, lower: np.ndarray | float, upper: np.ndarray | float) -> np.ndarray:
    """(clip(x, lower, upper) − lower) / (upper − lower), per feature (or one pair for all)."""
    return (np.clip(x, lower, upper) - lower) / (np.asarray(upper) - np.asarray(lower))


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


@dataclass(frozen=True)
class PublicTransform:
    """Scaling by public bounds, an optional feature extractor, input norm clipping: record by record.

    ``lower``/``upper`` hold one value per raw feature, or a single value for all of them. ``unchanged``:
    the records are token ids and their mask (a table's ``tokens`` column), which pass as they are."""

    lower: tuple[float, ...]
    upper: tuple[float, ...]
    clip_norm: float
    clip_mode: str = "project"
    features: str = "none"
    image_shape: tuple[int, int] | None = None
    scatter_groups: int = 27
    unchanged: bool = False

    def apply(self, x: np.ndarray) -> Prepared:
        if self.unchanged:
            return Prepared(x=np.array(x, dtype=np.float64), clipped_fraction=0.0)
        lower, upper = np.asarray(self.lower), np.asarray(self.upper)
        if lower.size > 1 and x.shape[1] != lower.size:
            raise ValueError(f"records have {x.shape[1]} features, the public bounds cover {lower.size}")
        scaled = scale_features(
            x, lower if lower.size > 1 else float(lower[0]), upper if upper.size > 1 else float(upper[0])
        )
        if self.features == "scatternet":
            from dpml.data.features import scatter_features  # lazy: the served model pickles this module by value

            assert self.image_shape is not None
            scaled = scatter_features(scaled, (self.image_shape[0], self.image_shape[1]), self.scatter_groups)
        return clip_input_norms(scaled, self.clip_norm, self.clip_mode)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PublicTransform":
        shape = data.get("image_shape")
        return cls(
            lower=tuple(data["lower"]),
            upper=tuple(data["upper"]),
            clip_norm=float(data["clip_norm"]),
            clip_mode=data["clip_mode"],
            features=data["features"],
            image_shape=None if shape is None else (int(shape[0]), int(shape[1])),
            scatter_groups=int(data["scatter_groups"]),
            unchanged=bool(data.get("unchanged", False)),
        )


def public_transform(
    config: PreprocessConfig, lower: np.ndarray | None = None, upper: np.ndarray | None = None, unchanged: bool = False
) -> PublicTransform:
    """The transform of ``config``; per-feature ``lower``/``upper`` (a table schema's) replace its scalar pair;
    ``unchanged``: token inputs, left as they are."""
    shape = None if config.image_shape is None else (int(config.image_shape[0]), int(config.image_shape[1]))
    return PublicTransform(
        lower=tuple(float(v) for v in lower) if lower is not None else (float(config.lower),),
        upper=tuple(float(v) for v in upper) if upper is not None else (float(config.upper),),
        clip_norm=float(config.clip_norm),
        clip_mode=config.clip_mode,
        features=config.features,
        image_shape=shape,
        scatter_groups=int(config.scatter_groups),
        unchanged=unchanged,
    )


def preprocess(x: np.ndarray, config: PreprocessConfig) -> Prepared:
    """:func:`public_transform` of ``config`` (its scalar bounds) applied to ``x``."""
    return public_transform(config).apply(x)
