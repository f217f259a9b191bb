"""Test accuracy of the image models on Fashion-MNIST: DP-SGD at (ε = 3, δ = 1e-5) next to non-private.

    python benchmarks/vision_utility.py [--models cnn wrn] [--seeds 0 1] [--max-train N] [--device cpu|cuda]
                                        [--set KEY=VALUE ...] [--nonprivate-epochs E]

Each model runs from its configuration (`configs/cnn-fashion-mnist.yaml`: the GroupNorm CNN,
`configs/wrn-fashion-mnist.yaml`: WRN-16-4 with GroupNorm) through dpml's own stages (ingest →
split → preprocess) and trainer, so the numbers are what the pipeline produces:

- DP: the configured DP-SGD run (σ calibrated by dpml to the configuration's ε) with each noise seed;
  test accuracy mean ± std, and the certified ε.
- Non-private: the same model, data and Poisson sampling rate q trained without clipping or noise, with
  Adam (learning rate 1e-3) as a non-private model is usually trained, 15 epochs, one run per seed.

``--max-train`` caps the training records (the split's ``max_train``) and ``--set`` overrides other
configuration keys (e.g. ``train.epochs=5``) for both runs, for a CPU; ``--nonprivate-epochs`` sets the
non-private run's epochs. Each row of the page names its command, machine, device and settings.
Writes ``benchmarks/results/vision_utility.{md,json}``; a row measured earlier with other settings or
for another model stays on the page.
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
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_common import fashion_mnist_overrides, without_paths  # noqa: E402  (benchmarks/ is the script's folder)
from dpml import io, stages  # noqa: E402
from dpml.config import load  # noqa: E402
from dpml.accounting.accountants import certify  # noqa: E402

from dpml.train.fit import fit  # noqa: E402
from dpml.train.registry import trainer_for  # noqa: E402

CONFIGS = {"cnn": "cnn-fashion-mnist.yaml", "wrn": "wrn-fashion-mnist.yaml"}


def nonprivate_settings(epochs: float) -> list[str]:
    """The non-private run: Adam (1e-3) for ``epochs``; the sampling rate q stays the configuration's."""
    return ["train.optimizer=adam", "train.learning_rate=0.001", f"train.epochs={epochs:g}"]


def machine(device: str) -> str:
    where = (
        f"GPU {torch.cuda.get_device_name(0)}" if device == "cuda" else f"CPU, {torch.get_num_threads()} torch threads"
    )
    return f"{platform.machine()}, {where}, torch {torch.__version__}, Python {platform.python_version()}"


def run_model(
    name: str,
    seeds: list[int],
    max_train: int | None,
    device: str,
    work: Path,
    settings: list[str],
    nonprivate_epochs: float,
) -> dict[str, Any]:
    overrides = fashion_mnist_overrides(work / name) + [f"train.device={device}"] + settings
    if max_train:
        overrides.append(f"split.max_train={max_train}")
    config = load(ROOT / "configs" / CONFIGS[name], overrides)
    for stage in ("ingest", "split", "preprocess"):
        stages.STAGES[stage](config)
    layout = stages.Layout(config)
    n_classes = len(io.read_json(layout.prepared_meta)["classes"])
    x, y = stages.load_part(layout, "train")
    x_test, y_test = stages.load_part(layout, "test")
    sigma = trainer_for(config).noise_multiplier(config)
    private, seconds, epsilon = [], [], None
    for seed in seeds:
        start = time.perf_counter()
        result = fit(config, x, y, n_classes, private=True, noise_multiplier=sigma, seed=seed, noise_seed=10_000 + seed)
        seconds.append(time.perf_counter() - start)
        private.append(stages.accuracy(result.model, x_test, y_test))
        epsilon = certify(result.mechanism, config.dp.delta)["epsilon"]
        print(f"{name} DP seed {seed}: accuracy {private[-1]:.4f}, {seconds[-1]:.0f} s", flush=True)
    baseline_config = load(ROOT / "configs" / CONFIGS[name], overrides + nonprivate_settings(nonprivate_epochs))
    baseline, baseline_seconds = [], []
    for seed in seeds:
        start = time.perf_counter()
        result = fit(baseline_config, x, y, n_classes, private=False, noise_multiplier=None, seed=seed)
        baseline_seconds.append(time.perf_counter() - start)
        baseline.append(stages.accuracy(result.model, x_test, y_test))
        print(f"{name} non-private seed {seed}: accuracy {baseline[-1]:.4f}, {baseline_seconds[-1]:.0f} s", flush=True)
    return {
        "model": name,
        "config": f"configs/{CONFIGS[name]}",
        "settings": settings,
        "max_train": max_train,
        "machine": machine(device),
        "nonprivate_epochs": nonprivate_epochs,
        "train_records": int(x.shape[0]),
        "test_records": int(x_test.shape[0]),
        "epsilon": epsilon,
        "delta": config.dp.delta,
        "sigma": sigma,
        "epochs": config.train.epochs,
        "sample_rate": config.train.sample_rate,
        "dp_accuracy": private,
        "dp_seconds": seconds,
        "nonprivate_accuracy": baseline,
        "nonprivate_seconds": baseline_seconds,
    }


def spread(values: list[float]) -> str:
    mean = statistics.mean(values)
    return f"{mean:.4f} ± {statistics.stdev(values):.4f}" if len(values) > 1 else f"{mean:.4f}"


def merged(earlier: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The earlier rows not measured again (same model, cap and settings), then this run's rows."""

    def key(row: dict[str, Any]) -> tuple:
        return row["model"], row["max_train"], tuple(row["settings"])

    fresh = {key(row) for row in rows}
    return [row for row in earlier if key(row) not in fresh] + rows


def write(rows: list[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "vision_utility.json").write_text(json.dumps(rows, indent=2))
    lines = [
        "# Image models on Fashion-MNIST: DP-SGD next to non-private",
        "",
        "DP: the configuration's DP-SGD (σ calibrated by dpml to ε = 3), one run per noise seed. Non-private: "
        "the same model, records and sampling rate q, Adam (1e-3). Test accuracy on the split's test part "
        "(mean ± std over seeds). Each row's command and machine are listed below the table. A row with "
        "settings or fewer training records ran a reduced budget so that a CPU finishes it: it is not the "
        "configuration's result, which needs a GPU for the WRN.",
        "",
        "| # | model | training records | settings | certified ε (δ) | σ | epochs, q | seeds | DP accuracy | "
        "non-private accuracy (epochs) | DP s / run | non-private s / run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for number, r in enumerate(rows, 1):
        settings = ", ".join(f"`{s}`" for s in r["settings"]) or "as configured"
        lines.append(
            f"| {number} | {r['model']} (`{r['config']}`) | {r['train_records']} | {settings} | "
            f"{r['epsilon']:.3f} ({r['delta']:g}) | {r['sigma']:.3f} | {r['epochs']:g}, {r['sample_rate']:g} | "
            f"{len(r['dp_accuracy'])} | {spread(r['dp_accuracy'])} | {spread(r['nonprivate_accuracy'])} "
            f"({r['nonprivate_epochs']:g}) | {statistics.mean(r['dp_seconds']):.0f} | "
            f"{statistics.mean(r['nonprivate_seconds']):.0f} |"
        )
    lines += ["", "Rows:", ""]
    lines += [f"{number}. `{r['command']}` on {r['machine']}." for number, r in enumerate(rows, 1)]
    (out / "vision_utility.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def recorded_command(argv: list[str]) -> str:
    """The command that reproduces a row: the arguments as given, less ``--out``/``--work``."""
    return " ".join(["python", "benchmarks/vision_utility.py", *without_paths(argv)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(CONFIGS), default=["cnn", "wrn"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--max-train", type=int, default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--set",
        dest="settings",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="configuration overrides for both runs (recorded on the row)",
    )
    parser.add_argument("--nonprivate-epochs", type=float, default=15.0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "dpml-vision-utility"))
    args = parser.parse_args()
    command = recorded_command(sys.argv[1:])
    rows = [
        {
            **run_model(
                name, args.seeds, args.max_train, args.device, Path(args.work), args.settings, args.nonprivate_epochs
            ),
            "command": command,
        }
        for name in args.models
    ]
    saved = Path(args.out) / "vision_utility.json"
    earlier = json.loads(saved.read_text()) if saved.exists() else []
    write(merged(earlier, rows), Path(args.out))


if __name__ == "__main__":
    main()
