"""Per-example signals of a classifier that membership-inference attacks score.

All are computed from logits z with log-sum-exp, so nothing overflows or takes log(0):
- loss            ℓ = −log softmax(z)_y = logsumexp(z) − z_y
- true-label prob p_y = exp(−ℓ)
- logit-scaled confidence (Carlini et al. 2022, LiRA)
      φ = log(p_y / (1 − p_y)) = log p_y − log Σ_{y'≠y} p_{y'} = z_y − logsumexp_{y'≠y} z_{y'}
  which stays finite and exact as p_y → 1 (where 1 − p_y would round to 0).
"""

from __future__ import annotations

import numpy as np
from scipy.special import logsumexp

from dpml.models.predict import logits_of

__all__ = ["cross_entropy_losses", "logit_scaled_confidence", "logits_of", "true_label_probability"]


def _label_index(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Labels shaped for take/put_along_axis on (n, k) or (N, n, k) logits."""
    return np.broadcast_to(np.asarray(y)[..., None], logits.shape[:-1] + (1,))


def cross_entropy_losses(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """ℓ_i = logsumexp(z_i) − z_{i, y_i} (on (n, k) or (N, n, k) logits)."""
    logits = np.asarray(logits, dtype=np.float64)
    return logsumexp(logits, axis=-1) - np.take_along_axis(logits, _label_index(logits, y), axis=-1)[..., 0]


def true_label_probability(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.exp(-cross_entropy_losses(logits, y))


def logit_scaled_confidence(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """φ = z_y − logsumexp_{y'≠y} z_{y'} (works on (n, k) or (N, n, k) logits)."""
    logits = np.asarray(logits, dtype=np.float64)
    mask = np.zeros_like(logits, dtype=bool)
    np.put_along_axis(mask, _label_index(logits, y), True, axis=-1)
    own = np.where(mask, logits, -np.inf).max(axis=-1)
    others = logsumexp(np.where(mask, -np.inf, logits), axis=-1)
    return own - others
