"""Attack metrics: ROC, AUC, TPR at fixed FPR (members are the positive class), with bootstrap CIs."""

from __future__ import annotations

import numpy as np
from sklearn.metrics import roc_auc_score, roc_curve

FPR_LEVELS = {"tpr_at_1pct_fpr": 0.01, "tpr_at_0.1pct_fpr": 0.001, "tpr_at_0pct_fpr": 0.0}


def roc(member_scores: np.ndarray, nonmember_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(FPR, TPR) over all thresholds; higher score means "member"."""
    labels = np.r_[np.ones(member_scores.size), np.zeros(nonmember_scores.size)]
    fpr, tpr, _ = roc_curve(labels, np.r_[member_scores, nonmember_scores], drop_intermediate=False)
    return fpr, tpr


def auc(member_scores: np.ndarray, nonmember_scores: np.ndarray) -> float:
    labels = np.r_[np.ones(member_scores.size), np.zeros(nonmember_scores.size)]
    return float(roc_auc_score(labels, np.r_[member_scores, nonmember_scores]))


def tpr_at_fpr(fpr: np.ndarray, tpr: np.ndarray, max_fpr: float) -> float:
    """The largest TPR among thresholds whose FPR ≤ ``max_fpr`` (no interpolation: achievable)."""
    allowed = fpr <= max_fpr + 1e-12
    return float(tpr[allowed].max()) if allowed.any() else 0.0


def point_metrics(member_scores: np.ndarray, nonmember_scores: np.ndarray) -> dict[str, float]:
    fpr, tpr = roc(member_scores, nonmember_scores)
    out = {"auc": auc(member_scores, nonmember_scores), "advantage": float(np.max(tpr - fpr))}
    out |= {name: tpr_at_fpr(fpr, tpr, level) for name, level in FPR_LEVELS.items()}
    return out


def summarize(
    member_scores: np.ndarray, nonmember_scores: np.ndarray, bootstrap: int = 0, seed: int = 0, level: float = 0.95
) -> dict[str, float]:
    """Point metrics, plus percentile-bootstrap intervals (``name_ci_low``/``_high``) when asked.

    Each bootstrap replicate resamples members and non-members separately with replacement.
    """
    result: dict[str, float] = point_metrics(member_scores, nonmember_scores)
    result |= {"members": int(member_scores.size), "nonmembers": int(nonmember_scores.size)}
    if bootstrap > 0:
        rng = np.random.default_rng(seed)
        draws = [
            point_metrics(
                rng.choice(member_scores, member_scores.size), rng.choice(nonmember_scores, nonmember_scores.size)
            )
            for _ in range(bootstrap)
        ]
        tail = (1 - level) / 2 * 100
        for name in ("auc", *FPR_LEVELS):
            values = np.array([d[name] for d in draws])
            result[f"{name}_ci_low"] = float(np.percentile(values, tail))
            result[f"{name}_ci_high"] = float(np.percentile(values, 100 - tail))
    return result
