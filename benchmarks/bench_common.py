"""What the Fashion-MNIST benchmarks share: the data location and scratch-folder overrides."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FASHION_MNIST = ROOT.parent / "shared" / "datasets" / "fashion-mnist"


def fashion_mnist_overrides(work: Path) -> list[str]:
    """``--set`` overrides pointing a configuration at Fashion-MNIST and every output at ``work``.

    Exits with a clear message when the data set is absent.
    """
    if not FASHION_MNIST.is_dir():
        sys.exit(f"skipped: {FASHION_MNIST} is absent")
    return [f"data.source=idx:{FASHION_MNIST}", f"paths.data={work / 'data'}", f"paths.artifacts={work / 'artifacts'}",
            f"paths.cache={work / 'cache'}", f"ledger.path={work / 'ledger.db'}",
            f"tracking.uri=sqlite:///{work / 'mlflow.db'}", f"tracking.artifact_root={work / 'mlartifacts'}"]
