"""Step time and peak memory: non-private SGD vs dpml's DP-SGD vs Opacus (hooks, ghost), side by side.

Every (model, batch size, method) runs in its own fresh process (so peak RSS is its own), one after
another in this one run; the table reports the median step time over the timed steps and the ratio
to the non-private step of the same model and batch. Fashion-MNIST shapes (1×28×28, 10 classes),
random data, SGD, a fixed batch (the sampling is not what is timed).

    pip install -r benchmarks/requirements.txt      # Opacus, for the comparison only
    python benchmarks/speed.py [--batches 64 512 4096] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["nonprivate", "dpml", "opacus-hooks", "opacus-ghost"]


def build(model: str):  # noqa: ANN201
    from torch import nn

    if model == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                             nn.Linear(256, 10))
    return nn.Sequential(  # the Opacus MNIST example's CNN
        nn.Conv2d(1, 16, 8, 2, padding=3), nn.ReLU(), nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, 2), nn.ReLU(), nn.MaxPool2d(2, 1), nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))


def measure(model_name: str, method: str, batch: int, steps: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = build(model_name)
    x = torch.randn(batch, 1, 28, 28)
    y = torch.randint(0, 10, (batch,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if method == "nonprivate":
        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    elif method == "dpml":
        sys.path.insert(0, str(ROOT))
        from dpml.train.dpsgd import clipped_sum_and_noise

        generator = torch.Generator().manual_seed(0)
        params = dict(model.named_parameters())
        flat = x.reshape(batch, -1) if model_name == "mlp" else x
        if model_name == "mlp":
            model = model[1:]  # the Flatten is done once above; Linear layers then take 2-D inputs
            params = dict(model.named_parameters())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> None:
            sums, noises, _ = clipped_sum_and_noise(model, flat, y, 1.0, 1.0, 1 << 30, generator)
            for name, p in params.items():
                p.grad = (sums[name] + noises[name]) / batch
            optimizer.step()
    else:
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        loader = DataLoader(TensorDataset(x, y), batch_size=batch)
        engine = PrivacyEngine(accountant="prv")
        mode = "ghost" if method == "opacus-ghost" else "hooks"
        criterion = torch.nn.CrossEntropyLoss()
        made = engine.make_private(module=model, optimizer=optimizer, data_loader=loader, criterion=criterion,
                                   noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
                                   grad_sample_mode=mode)
        if mode == "ghost":
            model, optimizer, criterion, _ = made
        else:
            model, optimizer, _ = made

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"model": model_name, "method": method, "batch": batch, "ms_per_step": 1000 * statistics.median(times),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 512, 4096])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "METHOD", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, method, batch = args.child
        batch = int(batch)
        steps = max(9, min(40, 40_000 // batch))
        print(json.dumps(measure(model, method, batch, steps)))
        return
    import torch

    rows = []
    for model in args.models:
        for batch in args.batches:
            for method in METHODS:
                done = subprocess.run([sys.executable, __file__, "--child", model, method, str(batch)],
                                      capture_output=True, text=True, timeout=1800)
                if done.returncode != 0:
                    rows.append({"model": model, "method": method, "batch": batch, "error": done.stderr.strip().splitlines()[-1]})
                else:
                    rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speed.json").write_text(json.dumps(rows, indent=2))
    base = {(r["model"], r["batch"]): r["ms_per_step"] for r in rows if r["method"] == "nonprivate" and "error" not in r}
    lines = ["# Step time: non-private vs dpml DP-SGD vs Opacus", "",
             f"Command: `python benchmarks/speed.py --batches {' '.join(map(str, args.batches))}`. "
             f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
             f"Python {platform.python_version()}; CPU only. Each cell is its own process, all from one run; "
             "median over the timed steps; peak RSS of that process (includes the interpreter and torch, ≈ 300 MB).", "",
             "| model | batch | method | ms / step | × non-private time | throughput vs non-private | peak RSS MB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['method']} | failed: {r['error'][:80]} | | | |")
            continue
        ratio = r["ms_per_step"] / base[(r["model"], r["batch"])]
        lines.append(f"| {r['model']} | {r['batch']} | {r['method']} | {r['ms_per_step']:.1f} | {ratio:.2f} | "
                     f"{1 / ratio:.2f} | {r['peak_rss_mb']:.0f} |")
    (out / "speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
