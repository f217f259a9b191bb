"""Whole-pipeline wall time on Fashion-MNIST, stage by stage (in-process stages, no Prefect).

    python benchmarks/pipeline_fmnist.py [--out benchmarks/results]

Runs `configs/fashion-mnist.yaml` unchanged except for output locations (a scratch folder, its own
MLflow store and ledger), so it measures exactly what `dpml run --engine local --params
configs/fashion-mnist.yaml` does. Writes ``pipeline_fmnist.md`` and ``pipeline_fmnist.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_common import fashion_mnist_overrides  # noqa: E402  (benchmarks/ is the script's folder)
from dpml import stages  # noqa: E402
from dpml.config import load  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "dpml-pipeline-bench"))
    args = parser.parse_args()
    config = load(ROOT / "configs" / "fashion-mnist.yaml", fashion_mnist_overrides(Path(args.work)))
    timings, results = {}, {}
    for name, stage in stages.STAGES.items():
        start = time.perf_counter()
        results[name] = stage(config)
        timings[name] = time.perf_counter() - start
        print(f"{name}: {timings[name]:.1f} s", flush=True)
    audit = results["audit"]
    summary = {
        "seconds": timings,
        "total_seconds": sum(timings.values()),
        "test_accuracy": results["train"]["test_accuracy"],
        "epsilon": results["certify"]["epsilon"],
        "references": audit["references"],
        "max_lower_bound": audit["max_lower_bound"],
        "control_power": audit["control_power"],
        "gate": results["gate"],
        "attacks": {
            n: {k: r[k] for k in ("auc", "tpr_at_1pct_fpr", "tpr_at_0.1pct_fpr")}
            for n, r in audit["target"]["attacks"].items()
        },
        "control": {
            n: {k: r[k] for k in ("auc", "tpr_at_1pct_fpr", "tpr_at_0.1pct_fpr")}
            for n, r in audit["control"]["attacks"].items()
        },
        "one_run": {b["method"]: b["epsilon"] for b in audit["one_run"]},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline_fmnist.json").write_text(json.dumps(summary, indent=2, default=str))
    lines = [
        "# Whole pipeline on Fashion-MNIST, stage by stage",
        "",
        f"Command: `python benchmarks/pipeline_fmnist.py` — `configs/fashion-mnist.yaml` (48,000 training "
        f"records, MLP 784-256-10, DP-SGD at ε = 3, audit with {config.audit.references} reference models per "
        f"audited model). Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch "
        f"{torch.__version__}. In-process stages (the Prefect flow trains reference models in parallel).",
        "",
        "| stage | seconds |",
        "|---|---|",
    ]
    lines += [f"| {n} | {t:.1f} |" for n, t in timings.items()]
    lines += [
        f"| **total** | **{summary['total_seconds']:.1f}** |",
        "",
        f"Test accuracy {summary['test_accuracy']:.4f}; certified ε = {summary['epsilon']:.3f} (δ = 1e-5); "
        f"{audit['references']['models']} reference models ({audit['references']['training_seconds']:.0f} s of "
        f"training); largest gating empirical lower bound ε ≥ {summary['max_lower_bound']:.3f}; "
        f"release gate {'passed' if results['gate']['passed'] else 'failed'}.",
        "",
        "| attack | AUC (DP model) | TPR@1%FPR | TPR@0.1%FPR | AUC (non-private control) | TPR@1%FPR | TPR@0.1%FPR |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in summary["attacks"].items():
        c = summary["control"][name]
        lines.append(
            f"| {name} | {r['auc']:.3f} | {r['tpr_at_1pct_fpr']:.4f} | {r['tpr_at_0.1pct_fpr']:.4f} | "
            f"{c['auc']:.3f} | {c['tpr_at_1pct_fpr']:.4f} | {c['tpr_at_0.1pct_fpr']:.4f} |"
        )
    lines += ["", "One-run audits: " + ", ".join(f"{k} ε ≥ {v:.3f}" for k, v in summary["one_run"].items())]
    (out / "pipeline_fmnist.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
