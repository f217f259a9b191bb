"""Audit benchmark on Fashion-MNIST: attack power and empirical ε lower bounds vs certified ε.

For a non-private model and DP-SGD models at ε ∈ {1, 4, 8} (δ = 1e-5), all trained with the
configuration in ``configs/fashion-mnist.yaml`` on a subset of the training set, report AUC and
TPR at 0.1% FPR of LOSS, LiRA (online, offline) and RMIA (online, offline) with 1, 2, 4 and 8
reference models, and every empirical ε lower bound next to the certified ε.

    python benchmarks/audit_fmnist.py [--max-train 10000] [--out benchmarks/results]

Needs ../shared/datasets/fashion-mnist. Writes ``audit_fmnist.md`` and ``audit_fmnist.json``.
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
from dpml.audit.canaries import black_box_audit, white_box_audit  # noqa: E402
from dpml.audit.run import Subject, audit_subject, control_config  # noqa: E402
from dpml.audit.references import train_reference  # noqa: E402
from dpml.config import load  # noqa: E402
from dpml.accounting.accountants import certify  # noqa: E402
from dpml.train.fit import fit  # noqa: E402
from dpml.train.registry import trainer_for  # noqa: E402

ATTACKS = ["loss", "lira-online", "lira-offline", "rmia-online", "rmia-offline"]
REFERENCES = [1, 2, 4, 8]
EPSILONS = [None, 1.0, 4.0, 8.0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-train", type=int, default=10000)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "dpml-audit-bench"))
    args = parser.parse_args()
    base = fashion_mnist_overrides(Path(args.work)) + [
        f"split.max_train={args.max_train}",
        f"audit.attacks={json.dumps(ATTACKS)}",
        "audit.max_records=2000",
    ]
    config = load(ROOT / "configs" / "fashion-mnist.yaml", base)
    stages.ingest(config), stages.split(config), stages.preprocess(config)
    rows, started = [], time.perf_counter()
    for target_epsilon in EPSILONS:
        private = target_epsilon is not None
        overrides = base + (
            [f"dp.target_epsilon={target_epsilon}", "train.algorithm=dpsgd"]
            if private
            else ["train.algorithm=nonprivate"]
        )
        cfg = load(ROOT / "configs" / "fashion-mnist.yaml", overrides)
        if not private:  # the non-private model is trained as the audit's positive control is
            cfg = control_config(cfg)
        context = stages.audit_context(cfg)
        x, y = context.train
        sigma = trainer_for(cfg).noise_multiplier(cfg) if private else None
        t0 = time.perf_counter()
        result = fit(cfg, x, y, context.n_classes, private=private, noise_multiplier=sigma, seed=cfg.train.seed)
        train_seconds = time.perf_counter() - t0
        certified = certify(result.mechanism, cfg.dp.delta)["epsilon"] if private else float("inf")
        x_test, y_test = stages.load_part(stages.Layout(cfg), "test")
        accuracy = stages.accuracy(result.model, x_test, y_test)
        for j in range(max(REFERENCES)):
            train_reference(
                cfg,
                context.records,
                context.n_classes,
                context.data_version,
                private=private,
                noise_multiplier=sigma,
                index=j,
            )
        one_run = [white_box_audit(cfg, x, y, context.n_classes, sigma, 0.95)] if private else []
        pop = context.records.population - context.records.n_train
        one_run.append(
            black_box_audit(
                cfg, x, y, context.audit[0][pop], context.audit[1][pop], context.n_classes, sigma, private, 0.95
            )
        )
        for k in REFERENCES:
            ref_cfg = cfg.model_copy(update={"audit": cfg.audit.model_copy(update={"references": k, "bootstrap": 0})})
            results, _ = audit_subject(
                ref_cfg,
                Subject("target", result.model, private, sigma, ref_cfg),
                context.records,
                context.data_version,
                0.95,
            )
            rows.append(
                {
                    "epsilon_target": target_epsilon,
                    "certified_epsilon": certified,
                    "sigma": sigma,
                    "test_accuracy": accuracy,
                    "train_seconds": train_seconds,
                    "references": k,
                    "attacks": {
                        n: {key: r[key] for key in ("auc", "tpr_at_1pct_fpr", "tpr_at_0.1pct_fpr")}
                        | {
                            "bound_test": next(b["epsilon"] for b in r["bounds"] if b["method"] == "hypothesis_test"),
                            "bound_gdp": next(b["epsilon"] for b in r["bounds"] if b["method"] == "gdp"),
                        }
                        for n, r in results.items()
                    },
                    "one_run": {b["method"]: b["epsilon"] for b in one_run},
                }
            )
        print(f"done ε={target_epsilon}: accuracy {accuracy:.4f}, certified {certified:.3f}", flush=True)
    write(rows, Path(args.out), time.perf_counter() - started, args.max_train)


def write(rows: list[dict], out: Path, seconds: float, max_train: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit_fmnist.json").write_text(json.dumps(rows, indent=2))
    lines = [
        "# Audit benchmark: Fashion-MNIST",
        "",
        f"Command: `python benchmarks/audit_fmnist.py --max-train {max_train}` ({seconds / 60:.1f} min). "
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
        f"Python {platform.python_version()}.",
        "",
        f"Model and training: `configs/fashion-mnist.yaml` (MLP 784-256-10, DP-SGD with Poisson sampling), "
        f"{max_train} training records; 2000 members vs 2000 non-members (audit population); δ = 1e-5. "
        "Reference models train on random halves of train ∪ audit population with the target's own "
        "configuration (same σ). Bounds at 95% confidence each; 'test' = Clopper–Pearson hypothesis-test "
        "bound (threshold chosen on one half, bounded on the other), 'GDP' = the same error rates read "
        "through a Gaussian trade-off curve (informational, not a valid bound for DP-SGD in general).",
        "",
        "| ε target | certified ε | test acc. | refs | attack | AUC | TPR@1%FPR | TPR@0.1%FPR | ε_LB test | ε_LB GDP |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        target = "∞ (non-private)" if row["epsilon_target"] is None else f"{row['epsilon_target']:g}"
        for name, r in row["attacks"].items():
            if name == "loss" and row["references"] != REFERENCES[0]:
                continue  # LOSS uses no reference models: one row per model
            refs = "—" if name == "loss" else str(row["references"])
            lines.append(
                f"| {target} | {row['certified_epsilon']:.3f} | {row['test_accuracy']:.4f} | {refs} | {name} | "
                f"{r['auc']:.3f} | {r['tpr_at_1pct_fpr']:.4f} | {r['tpr_at_0.1pct_fpr']:.4f} | "
                f"{r['bound_test']:.3f} | {r['bound_gdp']:.3f} |"
            )
    lines += [
        "",
        "LiRA vs RMIA at equal numbers of reference models (best online/offline variant of each, by AUC; "
        "TPR at 0.1% FPR in brackets):",
        "",
        "| ε target | refs | LiRA | RMIA |",
        "|---|---|---|---|",
    ]
    for row in rows:
        target = "∞ (non-private)" if row["epsilon_target"] is None else f"{row['epsilon_target']:g}"
        best = {}
        for family in ("lira", "rmia"):
            name = max((n for n in row["attacks"] if n.startswith(family)), key=lambda n: row["attacks"][n]["auc"])
            r = row["attacks"][name]
            best[family] = f"{r['auc']:.3f} ({r['tpr_at_0.1pct_fpr']:.4f}, {name})"
        lines.append(f"| {target} | {row['references']} | {best['lira']} | {best['rmia']} |")
    lines += [
        "",
        "One-run audits (Steinke, Nasr, Jagielski 2023), 95% confidence:",
        "",
        "| ε target | certified ε | white-box gradient canaries ε_LB | black-box canary records ε_LB |",
        "|---|---|---|---|",
    ]
    for row in rows:
        if row["references"] != REFERENCES[0]:
            continue
        target = "∞ (non-private)" if row["epsilon_target"] is None else f"{row['epsilon_target']:g}"
        wb = row["one_run"].get("one_run_white_box")
        lines.append(
            f"| {target} | {row['certified_epsilon']:.3f} | {'—' if wb is None else f'{wb:.3f}'} | "
            f"{row['one_run']['one_run_black_box']:.3f} |"
        )
    (out / "audit_fmnist.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
