"""What the benchmarks share: the Fashion-MNIST location, scratch-folder overrides, the privacy cost of a
selection made on private records, and the machine and commit a table was measured on."""

from __future__ import annotations

import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FASHION_MNIST = ROOT.parent / "shared" / "datasets" / "fashion-mnist"


def fashion_mnist_overrides(work: Path) -> list[str]:
    """``--set`` overrides pointing a configuration at Fashion-MNIST and every output at ``work``.

    Exits with a clear message when the data set is absent.
    """
    if not FASHION_MNIST.is_dir():
        sys.exit(f"skipped: {FASHION_MNIST} is absent")
    return [
        f"data.source=idx:{FASHION_MNIST}",
        f"paths.data={work / 'data'}",
        f"paths.artifacts={work / 'artifacts'}",
        f"paths.cache={work / 'cache'}",
        f"ledger.path={work / 'ledger.db'}",
        f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
        f"tracking.artifact_root={work / 'mlartifacts'}",
    ]


def selection_epsilon(
    events: Sequence[Any],
    neighbouring: str,
    delta: float,
    clip_norm: float,
    dataset_size: int,
    threat_model: str = "all-iterates",
) -> float:
    """ε at δ of releasing the best of several candidates trained on the same private records: the
    release is covered by the composition of every candidate's ``events``, priced by dpml's accountants."""
    from dpml.accounting.accountants import certify
    from dpml.accounting.mechanism import MechanismDescription

    mechanism = MechanismDescription(
        trainer="selection",
        events=tuple(events),
        neighbouring=neighbouring,  # type: ignore[arg-type]
        clip_norm=clip_norm,
        dataset_size=dataset_size,
        threat_model=threat_model,
    )  # type: ignore[arg-type]
    return float(certify(mechanism, delta)["epsilon"])


def current_commit() -> str:
    """The checked-out commit (``+dirty`` with uncommitted changes to tracked files), or ``unknown`` outside git."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def cpu_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def without_paths(argv: Sequence[str]) -> list[str]:
    """A benchmark's arguments less ``--out`` and ``--work`` and their values: where this machine kept the files
    changes no number, and would write a path of the measuring machine onto the results page."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--out", "--work"):
            skip = True
        elif not arg.startswith(("--out=", "--work=")):
            kept.append(arg)
    return kept
