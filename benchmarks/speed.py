"""Step time and peak memory: non-private SGD vs dpml's DP-SGD vs Opacus (hooks, ghost), side by side.

Every (model, batch size, method) runs in its own fresh process (so peak RSS is its own), one after
another in this one run; the table reports the median step time over the timed steps and the ratio
to the non-private step of the same model and batch. Fashion-MNIST shapes (1×28×28, 10 classes),
random data, SGD, a fixed batch (the sampling is not what is timed). Models: ``mlp``, ``cnn`` (the
Opacus MNIST example's), ``wrn`` (dpml's WRN-16-4 with GroupNorm, ``model.kind: wide_resnet``).

``--device cuda`` times on the GPU (each step ends with ``torch.cuda.synchronize()``; peak memory is
``torch.cuda.max_memory_allocated``) and adds ``dpml-bf16`` (``train.autocast: bf16``); it writes
``speed_cuda.{md,json}`` naming the GPU, beside the CPU page ``speed.{md,json}``.

    pip install -r benchmarks/requirements.txt      # Opacus, for the comparison only
    python benchmarks/speed.py [--batches 64 512 4096] [--models mlp cnn wrn] [--device cpu|cuda]
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

    if model == "wrn":
        sys.path.insert(0, str(ROOT))
        from dpml.models.vision import WideResNetSpec, build_wide_resnet

        return build_wide_resnet(WideResNetSpec(784, (1, 28, 28), 10))
    if model == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                             nn.Linear(256, 10))
    return nn.Sequential(  # the Opacus MNIST example's CNN
        nn.Conv2d(1, 16, 8, 2, padding=3), nn.ReLU(), nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, 2), nn.ReLU(), nn.MaxPool2d(2, 1), nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))


def measure(model_name: str, method: str, batch: int, steps: int, device: str = "cpu") -> dict:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = build(model_name).to(device)
    x = torch.randn(batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if method == "nonprivate":
        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    elif method in ("dpml", "dpml-bf16"):
        sys.path.insert(0, str(ROOT))
        from dpml.train.dpsgd import clipped_sum_and_noise

        generator = torch.Generator(device=device).manual_seed(0)
        autocast = torch.bfloat16 if method == "dpml-bf16" else None
        params = dict(model.named_parameters())
        flat = x.reshape(batch, -1) if model_name == "mlp" else x
        if model_name == "mlp":
            model = model[1:]  # the Flatten is done once above; Linear layers then take 2-D inputs
            params = dict(model.named_parameters())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> None:
            sums, noises, _ = clipped_sum_and_noise(model, flat, y, 1.0, 1.0, 1 << 30, generator, autocast=autocast)
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
    cuda = device.startswith("cuda")

    def synchronise() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(2):
        step()
    synchronise()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        synchronise()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"model": model_name, "method": method, "batch": batch, "ms_per_step": 1000 * statistics.median(times),
            "peak_mb": peak, "steps": steps, "device": device}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 512, 4096])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "METHOD", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, method, batch = args.child
        batch = int(batch)
        steps = max(9, min(40, 40_000 // batch))
        print(json.dumps(measure(model, method, batch, steps, args.device)))
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    methods = METHODS + (["dpml-bf16"] if args.device == "cuda" else [])
    rows = []
    for model in args.models:
        for batch in args.batches:
            for method in methods:
                done = subprocess.run([sys.executable, __file__, "--child", model, method, str(batch),
                                       "--device", args.device],
                                      capture_output=True, text=True, timeout=1800)
                if done.returncode != 0:
                    rows.append({"model": model, "method": method, "batch": batch, "error": done.stderr.strip().splitlines()[-1]})
                else:
                    rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "speed" if args.device == "cpu" else "speed_cuda"
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=2))
    base = {(r["model"], r["batch"]): r["ms_per_step"] for r in rows if r["method"] == "nonprivate" and "error" not in r}
    if args.device == "cuda":
        where = f"GPU: {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
        memory = "peak GPU memory allocated by torch in that process"
    else:
        where = "CPU only"
        memory = "peak RSS of that process (includes the interpreter and torch, ≈ 300 MB)"
    lines = ["# Step time: non-private vs dpml DP-SGD vs Opacus", "",
             f"Command: `python benchmarks/speed.py --batches {' '.join(map(str, args.batches))} "
             f"--models {' '.join(args.models)} --device {args.device}`. "
             f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
             f"Python {platform.python_version()}; {where}. Each cell is its own process, all from one run; "
             f"median over the timed steps; {memory}.", "",
             "| model | batch | method | ms / step | × non-private time | throughput vs non-private | peak MB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['method']} | failed: {r['error'][:80]} | | | |")
            continue
        ratio = r["ms_per_step"] / base[(r["model"], r["batch"])]
        lines.append(f"| {r['model']} | {r['batch']} | {r['method']} | {r['ms_per_step']:.1f} | {ratio:.2f} | "
                     f"{1 / ratio:.2f} | {r['peak_mb']:.0f} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
