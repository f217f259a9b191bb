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
