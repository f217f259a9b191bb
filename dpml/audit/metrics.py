"""Attack metrics: ROC, AUC and TPR at fixed FPR, with members as the positive class."""

from __future__ import annotations

import numpy as np
from sklearn.metrics import roc_auc_score, roc_curve


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


def summarize(member_scores: np.ndarray, nonmember_scores: np.ndarray) -> dict[str, float]:
    fpr, tpr = roc(member_scores, nonmember_scores)
    return {
        "auc": auc(member_scores, nonmember_scores),
        "tpr_at_1pct_fpr": tpr_at_fpr(fpr, tpr, 0.01),
        "tpr_at_0.1pct_fpr": tpr_at_fpr(fpr, tpr, 0.001),
        "advantage": float(np.max(tpr - fpr)),
        "members": int(member_scores.size),
        "nonmembers": int(nonmember_scores.size),
    }
