"""ROC pictures (PNG) for the audit."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpml.io import atomic_path  # noqa: E402


def plot_roc(curves: dict[str, tuple[np.ndarray, np.ndarray]], target: str | Path, title: str) -> None:
    """Linear and log-log ROC side by side; the diagonal is chance."""
    figure, (linear, logarithmic) = plt.subplots(1, 2, figsize=(10, 4.5))
    for name, (fpr, tpr) in curves.items():
        linear.plot(fpr, tpr, label=name)
        logarithmic.plot(np.maximum(fpr, 1e-5), np.maximum(tpr, 1e-5), label=name)
    for axis in (linear, logarithmic):
        axis.plot([1e-5, 1], [1e-5, 1], "k--", linewidth=0.8, label="chance")
        axis.set_xlabel("false positive rate")
        axis.set_ylabel("true positive rate")
        axis.legend(loc="lower right")
    logarithmic.set_xscale("log")
    logarithmic.set_yscale("log")
    logarithmic.set_xlim(1e-4, 1)
    logarithmic.set_ylim(1e-4, 1)
    figure.suptitle(title)
    figure.tight_layout()
    with atomic_path(target) as temp:
        figure.savefig(temp, format="png", dpi=100)
    plt.close(figure)


def plot_histograms(scores: dict[str, tuple[np.ndarray, np.ndarray]], target: str | Path, title: str) -> None:
    """Score histograms of members vs non-members, one panel per attack."""
    count = len(scores)
    figure, axes = plt.subplots(1, count, figsize=(4 * count, 3.5), squeeze=False)
    for axis, (name, (member, nonmember)) in zip(axes[0], scores.items(), strict=True):
        finite = np.r_[member, nonmember]
        finite = finite[np.isfinite(finite)]
        bins = np.linspace(finite.min(), finite.max(), 40) if finite.size and finite.min() < finite.max() else 20
        axis.hist(nonmember[np.isfinite(nonmember)], bins=bins, alpha=0.6, label="non-members", density=True)
        axis.hist(member[np.isfinite(member)], bins=bins, alpha=0.6, label="members", density=True)
        axis.set_title(name)
        axis.set_xlabel("score (higher = member)")
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    with atomic_path(target) as temp:
        figure.savefig(temp, format="png", dpi=90)
    plt.close(figure)
