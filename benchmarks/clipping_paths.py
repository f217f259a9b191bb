"""Time of dpml's clipped gradient sum for convolutions users write: layer shortcut vs the exact path.

    python benchmarks/clipping_paths.py [--batch 256] [--repeats 3] [--threads 2]

For each model, ``clipped_gradient_sum`` (Σ_i clip_C(∇ℓ_i) and the norms, C = 1) runs twice on the same
batch (Fashion-MNIST shapes, random data): with the convolutions' shortcuts
(:mod:`dpml.train.clipping_layers`), and with those layers' parameters forced onto the exact path (a
batched backward pass over the rows of the identity), which is what they took before they had a
shortcut. The table gives the median time of each (after one warm-up call), their ratio, and the
largest difference between the two results (clipped sums and norms, float32) — the shortcut must be
the same computation, only faster. Both run in this one process, alternating.
Writes ``benchmarks/results/clipping_paths.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dpml.train.clipping import clipped_gradient_sum  # noqa: E402  (benchmarks/ is the script's folder)
from dpml.train.dpsgd import per_example_cross_entropy  # noqa: E402


def models() -> dict[str, tuple[Callable[[], nn.Module], list[str]]]:
    """name -> (builder, the modules whose parameters the exact variant takes exactly)."""
    return {
        "Conv1d ×2 (rows of the image as a sequence)": (
            lambda: nn.Sequential(
                nn.Flatten(1, 2),
                nn.Conv1d(28, 32, 5, padding=2),
                nn.ReLU(),
                nn.Conv1d(32, 32, 5, padding=2),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(32 * 28, 10),
            ),
            ["1", "3"],
        ),
        'Conv2d padding="same" + depthwise': (
            lambda: nn.Sequential(
                nn.Conv2d(1, 16, 3, padding="same"),
                nn.GroupNorm(4, 16),
                nn.ReLU(),
                nn.Conv2d(16, 16, 3, padding="same", groups=16),
                nn.Conv2d(16, 32, 1),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(32, 10),
            ),
            ["0", "3"],
        ),
        "Conv2d groups = 4": (
            lambda: nn.Sequential(
                nn.Conv2d(1, 16, 3, stride=2),
                nn.ReLU(),
                nn.Conv2d(16, 32, 3, stride=2, groups=4),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(32 * 6 * 6, 10),
            ),
            ["2"],
        ),
    }


def timed(step: Callable[[], object], repeats: int) -> tuple[float, object]:
    result = step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times), result


def measure(name: str, build: Callable[[], nn.Module], layers: list[str], batch: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = build()
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    exact = [n for n, _ in model.named_parameters() if n.split(".")[0] in layers]
    fast_ms, (fast_sums, fast_norms) = timed(
        lambda: clipped_gradient_sum(model, per_example_cross_entropy, x, y, 1.0), repeats
    )
    exact_ms, (exact_sums, exact_norms) = timed(
        lambda: clipped_gradient_sum(model, per_example_cross_entropy, x, y, 1.0, exact=exact), repeats
    )
    difference = max(
        [float((fast_sums[k] - exact_sums[k]).abs().max()) for k in fast_sums]
        + [float((fast_norms - exact_norms).abs().max())]
    )
    print(f"{name}: shortcut {fast_ms:.1f} ms, exact {exact_ms:.1f} ms", flush=True)
    return {
        "model": name,
        "batch": batch,
        "exact_parameters": exact,
        "shortcut_ms": fast_ms,
        "exact_ms": exact_ms,
        "speed_up": exact_ms / fast_ms,
        "max_difference": difference,
    }


def write(rows: list[dict], command: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "clipping_paths.json").write_text(json.dumps(rows, indent=2))
    lines = [
        "# Clipped gradient sum: convolution shortcuts vs the exact path",
        "",
        f"Command: `{command}`. Machine: {platform.machine()}, CPU, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, Python {platform.python_version()}. Median of the timed calls after one "
        "warm-up; the largest difference is over every clipped sum and norm (float32).",
        "",
        "| model | batch | shortcut ms | exact path ms | exact / shortcut | largest difference |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['batch']} | {r['shortcut_ms']:.1f} | {r['exact_ms']:.1f} | {r['speed_up']:.0f} | "
        f"{r['max_difference']:.1e} |"
        for r in rows
    ]
    (out / "clipping_paths.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(name, build, layers, args.batch, args.repeats) for name, (build, layers) in models().items()]
    write(rows, "python " + " ".join(["benchmarks/clipping_paths.py", *sys.argv[1:]]), Path(args.out))


if __name__ == "__main__":
    main()
