"""Seed 001's comparison on Fashion-MNIST: NoisyCGD + convex gated model vs DP-SGD + the same model
vs DP-SGD + a one-hidden-layer ReLU network, at equal ε, σ, batch size and epochs.

    python benchmarks/hidden_state_fmnist.py [--epochs 100] [--levels 1.33 4.76] [--seeds 0 1 2]
                                             [--validate] [--audit] [--out benchmarks/results]

Uses ``configs/fashion-mnist-noisycgd.yaml`` through dpml's own stages and trainers. The paper's
protocol (§5–6): DP-SGD with σ, q = b/n and E epochs has a certified ε (replace-one, PLD); NoisyCGD
gets the same σ, b and E, and λ is calibrated so that its hidden-state ε equals DP-SGD's. Here σ
is calibrated so that DP-SGD's ε is each of ``--levels`` (the paper's base values 1.33 and 4.76,
which its σ = 15 and 5 give at 400 epochs); ``--epochs 400`` is the paper's length (≈ 2.5 h for
everything here), the committed table says which was run. The script also reports dpml's DP-SGD
ε at the paper's own setting next to the paper's 1.33 / 4.76.

Learning rates: ``--validate`` evaluates a grid per method on a validation split (5,000 training
images held out, the first level's σ, ``--validate-epochs``) and uses the best; the grid and its
scores are in the results. Never the test set. (At equal ε NoisyCGD needs many epochs: its last
visit of a record is not amplified, so μ ≥ 2/σ whatever λ, and a short run at DP-SGD's σ cannot
reach DP-SGD's ε — the validation therefore runs at the full length.) The "ε with tuning cost" column prices a private
search over that grid as dpml tune would (Papernot & Steinke's truncated negative binomial,
η = 1, E[K] = grid size, on NoisyCGD's exact GDP Rényi curve αμ²/2); for DP-SGD under replace-one
no RDP accountant here bounds Poisson subsampling, so its tuning cost is reported as not certified
(the paper's Gaussian approximation of the profile is not an upper bound). ``--audit`` also runs
the whole dpml pipeline (train, certify, audit with 2 reference models, gate) once per method at
the last level on ``--audit-max-train`` training images (every method calibrated to that ε there) and
reports the audit's numbers; ``--audit-only`` redoes just that part on the stored results.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import fashion_mnist_overrides  # noqa: E402
from dpml import stages  # noqa: E402
from dpml.config import Config, load, with_hyperparameters  # noqa: E402
from dpml.accounting.accountants import certify  # noqa: E402
from dpml.accounting.calibrate import calibrate_noise_multiplier  # noqa: E402
from dpml.accounting.gdp import gdp_epsilon  # noqa: E402
from dpml.accounting.mechanism import Selection  # noqa: E402
from dpml.accounting.tuning import ORDERS, rdp_to_epsilon, selection_rdp  # noqa: E402
from dpml.train.dpsgd import dpsgd_mechanism, number_of_steps  # noqa: E402
from dpml.train.fit import fit  # noqa: E402
from dpml.train.trainers.noisycgd import noisycgd_settings  # noqa: E402
from dpml.train.noisycgd import noisycgd_mechanism  # noqa: E402

METHODS = {
    "NoisyCGD + convex": {"train.algorithm": "noisycgd", "model.kind": "gated"},
    "DP-SGD + convex": {"train.algorithm": "dpsgd", "model.kind": "gated", "dp.target_epsilon": None},
    "DP-SGD + ReLU": {"train.algorithm": "dpsgd", "model.kind": "mlp", "dp.target_epsilon": None},
}
# Two candidates per method (a first, interrupted run of a 4-point grid at σ for ε = 1.33 scored, on the
# same validation split: NoisyCGD 0.01: 0.718, 0.02: 0.745, 0.04: 0.761, 0.06: 0.767; DP-SGD + convex
# 0.1: 0.771, 0.3: 0.736 — so the grid keeps the two best regions).
GRID = {
    "NoisyCGD + convex": [0.03, 0.06],  # must stay < 2/β = 0.0625
    "DP-SGD + convex": [0.03, 0.1],
    "DP-SGD + ReLU": [0.3, 1.0],
}
LEARNING_RATES = {"NoisyCGD + convex": 0.06, "DP-SGD + convex": 0.1, "DP-SGD + ReLU": 1.0}
TUNING_CANDIDATES = 2  # the grid's size


def method_config(base: Config, method: str, sigma: float, epochs: int, level: float | None) -> Config:
    choice = dict(METHODS[method]) | {
        "dp.noise_multiplier": sigma,
        "train.epochs": epochs,
        "train.learning_rate": LEARNING_RATES[method],
    }
    if method.startswith("NoisyCGD"):
        choice["dp.target_epsilon"] = level
    return with_hyperparameters(base, choice)


def tuning_cost_gdp(mu: float, delta: float) -> float:
    """ε of best-of-K, K ~ truncated negative binomial (η = 1, E[K] = candidates), on the μ-GDP curve αμ²/2."""
    base = np.array([order * mu * mu / 2 for order in ORDERS])
    curve = selection_rdp(ORDERS, base, Selection("truncated_negative_binomial", float(TUNING_CANDIDATES), 1.0))
    return rdp_to_epsilon(ORDERS, curve, delta)


def run_method(
    config: Config, x: np.ndarray, y: np.ndarray, x_eval: np.ndarray, y_eval: np.ndarray, n_classes: int, seed: int
) -> dict:
    start = time.perf_counter()
    result = fit(
        config,
        x,
        y,
        n_classes,
        private=True,
        noise_multiplier=config.dp.noise_multiplier,
        seed=seed,
        noise_seed=10_000 + seed,
    )
    return {
        "seed": seed,
        "accuracy": stages.accuracy(result.model, x_eval, y_eval),
        "seconds": time.perf_counter() - start,
    }


def validate(
    base: Config, x: np.ndarray, y: np.ndarray, n_classes: int, sigma: float, level: float, epochs: int
) -> dict:
    """The learning-rate grid per method on a validation split (5,000 held-out training images)."""
    held = np.zeros(y.size, dtype=bool)
    held[np.random.default_rng(123).choice(y.size, size=5000, replace=False)] = True
    n_fit = int((~held).sum())
    base = with_hyperparameters(base, {"train.sample_rate": base.noisycgd.batch_size / n_fit})
    out: dict = {}
    for method, rates in GRID.items():
        rows = []
        for rate in rates:
            config = with_hyperparameters(
                method_config(base, method, sigma, epochs, level), {"train.learning_rate": rate}
            )
            row = run_method(config, x[~held], y[~held], x[held], y[held], n_classes, seed=0)
            rows.append({"learning_rate": rate, "validation_accuracy": row["accuracy"], "seconds": row["seconds"]})
            print("validate", method, rows[-1], flush=True)
        out[method] = rows
    return out


def audit_method(
    base: Config, method: str, sigma: float, epochs: int, level: float, max_train: int, work: Path
) -> dict:
    """The whole pipeline for one method on ``max_train`` images: certificate and audit numbers."""
    config = method_config(base, method, sigma, epochs, level)
    slug = method.split()[0].lower() + ("-relu" if "ReLU" in method else "-convex")
    config = with_hyperparameters(
        config,
        {
            "split.max_train": max_train,
            "train.sample_rate": base.noisycgd.batch_size / max_train,
            "audit.references": 2,
            "audit.black_box_canaries": 500,
            "gate.epsilon_budget": 100.0,
            "paths.artifacts": str(work / f"audit-{slug}"),
            "paths.data": str(work / f"audit-data-{slug}"),
            "paths.cache": str(work / f"audit-cache-{slug}"),
            "ledger.path": str(work / f"audit-{slug}.db"),
            "ledger.epsilon_budget": 1000.0,
            "tracking.uri": f"sqlite:///{work / f'audit-{slug}-mlflow.db'}",
            "tracking.artifact_root": str(work / f"audit-{slug}-mlartifacts"),
        },
    )
    # The same ε for every method on the smaller set: NoisyCGD's λ and DP-SGD's σ calibrated to the level.
    config = with_hyperparameters(
        config,
        {"dp.target_epsilon": level}
        if method.startswith("NoisyCGD")
        else {"dp.target_epsilon": level, "dp.noise_multiplier": None},
    )
    start = time.perf_counter()
    results = stages.run_all(config, echo=lambda _: None)
    summary = results["audit"]
    attacks = summary["target"]["attacks"]
    return {
        "n_train": max_train,
        "certified_epsilon": results["certify"]["epsilon"],
        "test_accuracy": results["train"]["test_accuracy"],
        "max_auc": max(a["auc"] for a in attacks.values()),
        "max_tpr_at_1pct_fpr": max(a["tpr_at_1pct_fpr"] for a in attacks.values()),
        "max_epsilon_lower_bound": summary["max_lower_bound"],
        "one_run": [r["method"] for r in summary["one_run"]],
        "control_tpr_at_1pct_fpr": summary.get("control_power"),
        "gate_passed": results["gate"]["passed"],
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--levels", type=float, nargs="+", default=[1.33, 4.76])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--validate-epochs", type=int, default=None, help="default: --epochs")
    parser.add_argument("--audit", action="store_true")
    parser.add_argument("--audit-max-train", type=int, default=10_000)
    parser.add_argument("--audit-only", action="store_true", help="keep the stored accuracy results, redo the audit")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "dpml-hidden-state-bench"))
    args = parser.parse_args()
    work = Path(args.work)
    base = load(ROOT / "configs" / "fashion-mnist-noisycgd.yaml", fashion_mnist_overrides(work))
    for name in ("ingest", "split", "preprocess"):
        stages.STAGES[name](base)
    layout = stages.Layout(base)
    x, y = stages.load_part(layout, "train")
    x_test, y_test = stages.load_part(layout, "test")
    n, n_classes = int(y.size), len(json.loads(layout.prepared_meta.read_text())["classes"])
    b = base.noisycgd.batch_size
    base = with_hyperparameters(base, {"train.sample_rate": b / n})
    delta = base.dp.delta
    paper = {
        str(sigma): certify(dpsgd_mechanism(1 / 60, sigma, 400, "replace-one", 1.0, 60_000), delta)["epsilon"]
        for sigma in (15.0, 5.0)
    }  # the paper's own setting: q = 1/60, 24,000 steps, replace-one
    sigmas = [
        calibrate_noise_multiplier(level, b / n, number_of_steps(args.epochs, b / n), delta, "replace-one")
        for level in args.levels
    ]
    report: dict = {
        "n_train": n,
        "n_test": int(y_test.size),
        "batch_size": b,
        "epochs": args.epochs,
        "paper_dpsgd_epsilon": paper,
        "levels": [],
        "learning_rates": dict(LEARNING_RATES),
    }
    if args.audit_only:
        report = json.loads((Path(args.out) / "hidden_state_fmnist.json").read_text())
        LEARNING_RATES.update(report["learning_rates"])
        report["audit"] = {
            method: audit_method(
                base, method, sigmas[-1], args.epochs, args.levels[-1], args.audit_max_train, work / "audit-only"
            )
            for method in METHODS
        }
        write(report, Path(args.out))
        return
    if args.validate:
        report["validation"] = validate(
            base, x, y, n_classes, sigmas[0], args.levels[0], args.validate_epochs or args.epochs
        )
        report["learning_rates"] = {
            m: max(rows, key=lambda r: r["validation_accuracy"])["learning_rate"]
            for m, rows in report["validation"].items()
        }
        LEARNING_RATES.update(report["learning_rates"])
    for level_epsilon, sigma in zip(args.levels, sigmas, strict=True):
        dpsgd_epsilon = certify(dpsgd_mechanism(b / n, sigma, args.epochs, "replace-one", base.dp.clip_norm, n), delta)[
            "epsilon"
        ]
        level: dict = {"target": level_epsilon, "sigma": sigma, "epsilon": dpsgd_epsilon, "methods": {}}
        for method in METHODS:
            config = method_config(base, method, sigma, args.epochs, dpsgd_epsilon)
            runs = []
            for seed in args.seeds:
                row = run_method(config, x, y, x_test, y_test, n_classes, seed)
                runs.append({"seed": seed, "test_accuracy": row["accuracy"], "seconds": row["seconds"]})
                print(method, sigma, runs[-1], flush=True)
            accuracies = [r["test_accuracy"] for r in runs]
            entry = {
                "learning_rate": config.train.learning_rate,
                "runs": runs,
                "mean": statistics.mean(accuracies),
                "std": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
            }
            if method.startswith("NoisyCGD"):
                settings = noisycgd_settings(config, n)
                mu = noisycgd_mechanism(settings, n).events[0].mu  # type: ignore[union-attr]
                entry |= {
                    "l2": settings.l2,
                    "eta_lambda": settings.l2 * settings.learning_rate,
                    "mu": mu,
                    "epsilon": gdp_epsilon(mu, delta),
                    "epsilon_with_tuning": tuning_cost_gdp(mu, delta),
                }
            else:
                entry |= {"epsilon": dpsgd_epsilon, "epsilon_with_tuning": None}
            level["methods"][method] = entry
        report["levels"].append(level)
        write(report, Path(args.out))
    if args.audit:
        report["audit"] = {
            method: audit_method(base, method, sigmas[-1], args.epochs, args.levels[-1], args.audit_max_train, work)
            for method in METHODS
        }
        write(report, Path(args.out))


# Seed 001's published accuracies (after its tuning cost: ε = 2.88 / 8.91 from base 1.33 / 4.76), by method.
PAPER_TABLES = {
    "Table 1 (MNIST)": {
        "NoisyCGD + convex": (0.927, 0.944),
        "DP-SGD + convex": (0.929, 0.949),
        "DP-SGD + ReLU": (0.916, 0.944),
    },
    "Table 2 (CIFAR-10)": {
        "NoisyCGD + convex": (0.416, 0.455),
        "DP-SGD + convex": (0.417, 0.459),
        "DP-SGD + ReLU": (0.427, 0.471),
    },
}


def paper_comparison(report: dict) -> list[str]:
    """Seed 001 gives Fashion-MNIST only in figures; its tables are MNIST and CIFAR-10. What carries over
    is the gap between methods at each level, compared here number by number (percentage points)."""
    ours = (
        {
            method: [level["methods"][method]["mean"] for level in report["levels"]]
            for method in report["levels"][0]["methods"]
        }
        if report["levels"]
        else {}
    )
    rows = [
        ("ours (Fashion-MNIST, " + f"{report['epochs']} epochs)", {m: tuple(v) for m, v in ours.items()}),
        *PAPER_TABLES.items(),
    ]
    lines = [
        "",
        "Against seed 001's Tables 1–2 (its Fashion-MNIST results are only in figures, so the comparison is "
        "of the gaps between methods, in percentage points, at the low / high ε level; the paper's levels are "
        "ε = 2.88 / 8.91 after its tuning cost, ours the base 1.33 / 4.76):",
        "",
        "| source | NoisyCGD − DP-SGD, convex model | DP-SGD: convex − ReLU |",
        "|---|---|---|",
    ]
    for source, table in rows:
        if not {"NoisyCGD + convex", "DP-SGD + convex", "DP-SGD + ReLU"} <= set(table):
            continue
        gap = [100 * (a - b) for a, b in zip(table["NoisyCGD + convex"], table["DP-SGD + convex"], strict=True)]
        arch = [100 * (a - b) for a, b in zip(table["DP-SGD + convex"], table["DP-SGD + ReLU"], strict=True)]
        lines.append(f"| {source} | {' / '.join(f'{g:+.1f}' for g in gap)} | {' / '.join(f'{g:+.1f}' for g in arch)} |")
    return lines


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "hidden_state_fmnist.json").write_text(json.dumps(report, indent=2))
    paper = report["paper_dpsgd_epsilon"]
    lines = [
        "# Seed 001 on Fashion-MNIST: NoisyCGD (final model only) vs DP-SGD",
        "",
        f"Command: `python benchmarks/hidden_state_fmnist.py --epochs {report['epochs']}"
        f"{' --validate' if 'validation' in report else ''}{' --audit' if 'audit' in report else ''}` — "
        f"`configs/fashion-mnist-noisycgd.yaml`: {report['n_train']} training images on the unit sphere (X0 = 1), "
        f"{report['n_test']} test images, batch b = {report['batch_size']}, {report['epochs']} epochs, "
        "δ = 1e-5, replace-one. Convex model: 64 gates; ReLU network: one hidden layer of 200. NoisyCGD's clip "
        "norm is the cross-entropy's gradient bound √(2P)·X0 (clipping never acts: no assumption in the "
        "certificate); DP-SGD uses the same C. σ is calibrated so that DP-SGD's ε is each level; NoisyCGD's λ "
        "so that its ε equals DP-SGD's. "
        f"Machine: {platform.machine()}, torch {torch.__version__}.",
        "",
        f"dpml's DP-SGD ε at the paper's own setting (q = 1/60, 24,000 steps, replace-one): σ = 15 → "
        f"{paper['15.0']:.3f} (paper 1.33), σ = 5 → {paper['5.0']:.3f} (paper 4.76).",
        "",
        "| σ | method | η | test accuracy (mean ± std) | runs | certified ε | ε with tuning cost |",
        "|---|---|---|---|---|---|---|",
    ]
    for level in report["levels"]:
        for method, entry in level["methods"].items():
            tuned = (
                "not certified (replace-one)"
                if entry["epsilon_with_tuning"] is None
                else f"{entry['epsilon_with_tuning']:.3f}"
            )
            extra = f" (ηλ = {entry['eta_lambda']:.2e})" if "eta_lambda" in entry else ""
            runs = ", ".join(f"{r['test_accuracy']:.4f}" for r in entry["runs"])
            lines.append(
                f"| {level['sigma']:.3f} | {method}{extra} | {entry['learning_rate']:g} | "
                f"{entry['mean']:.4f} ± {entry['std']:.4f} | {runs} | {entry['epsilon']:.3f} | {tuned} |"
            )
    lines += paper_comparison(report)
    if "validation" in report:
        lines += [
            "",
            "Learning-rate grid on the validation split (one run each; the best is used above):",
            "",
            "| method | η: validation accuracy |",
            "|---|---|",
        ]
        lines += [
            f"| {m} | " + ", ".join(f"{r['learning_rate']:g}: {r['validation_accuracy']:.4f}" for r in rows) + " |"
            for m, rows in report["validation"].items()
        ]
    if "audit" in report:
        lines += [
            "",
            "Audit (whole dpml pipeline, last level, 2 reference models per subject):",
            "",
            "| method | train images | certified ε | test accuracy | max AUC | max TPR @ 1% FPR | "
            "largest empirical ε lower bound | one-run audits | gate |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {m} | {a['n_train']} | {a['certified_epsilon']:.3f} | {a['test_accuracy']:.4f} | {a['max_auc']:.3f} | "
            f"{a['max_tpr_at_1pct_fpr']:.3f} | {a['max_epsilon_lower_bound']:.3f} | {', '.join(a['one_run'])} | "
            f"{'passed' if a['gate_passed'] else 'failed'} |"
            for m, a in report["audit"].items()
        ]
    (out / "hidden_state_fmnist.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
