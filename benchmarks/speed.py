"""Step time: non-private SGD vs dpml's DP-SGD vs Opacus (hooks, ghost), measured interleaved.

For each (model, batch size) every method gets its own copy of the model (same initialisation) and
the same fixed batch, all in this one process; after two warm-up steps each, the timed rounds
alternate the methods (round r: one non-private step, one dpml step, one step of each peer), so
that the load of a shared machine falls on all of them alike. Where torch's threads leave a core
idle, dpml's CPU step leaves the next step's noise drawing in a background thread (``PrefetchedNoise``;
with every core taken it draws in the step, ``SynchronousNoise``, as the trainer does); so that this work
neither escapes dpml's time nor lands in the next method's, each dpml turn is an untimed lead-in step
and a timed step (whose clipping overlaps the draw the lead-in started, as in a training loop), and the
timed step's own draw is waited for, untimed, before the next method runs. The table reports each method's
median step time and its ratio to the non-private median of the same model and batch. Opacus'
steps are timed in ``--peer-rounds`` evenly spaced rounds only (its hooks take seconds per step
at batch 4096). Fashion-MNIST shapes (1×28×28, 10 classes), random data, SGD, a fixed batch (the
sampling is not what is timed); the dpml step is the trainer's own (clipped sums and noise from
``clipped_sum_and_noise``, the noise from the trainer's CPU stream, added in place, divided by the batch),
clipping in the chunk the trainer would take (``train.tune_physical_batch``, with ``physical_batch_size``
at least the batch: :func:`dpml.train.chunking.fastest_chunk`, timed before the rounds on a synthetic
probe). Two rows separate what the chunk does from what DP costs: ``dpml-one-chunk`` clips the whole
batch at once (untuned), and ``nonprivate-chunked`` is the non-private step by gradient accumulation
over dpml's chunks (the same gradient; what a non-private user could do too). The "rows per chunk"
column says which chunk each row used. On the CPU the process runs, from its start, under the malloc
settings dpml's trainer sets there (:func:`dpml.devices.keep_freed_cpu_memory`: freed memory kept for
the next step), so every method, non-private included, steps without faulting its pages in anew.
Models: ``mlp``, ``cnn`` (the
Opacus MNIST example's), ``wrn`` (dpml's WRN-16-4 with GroupNorm, ``model.kind: wide_resnet``).

``--device cuda`` times on the GPU (each step ends with ``torch.cuda.synchronize()``; the peak memory
of each method's steps is ``torch.cuda.max_memory_allocated`` after a reset, plus for ``dpml`` what its CUDA graphs
hold, whose pool that does not count: :func:`dpml.train.captured.graph_memory`) and adds ``dpml-bf16``
(``train.autocast: bf16``) and ``dpml-eager`` (the ``dpml`` step with every chunk issued op by op, where ``dpml``
replays a launch-bound model's chunks from CUDA graphs: :mod:`dpml.train.captured`); it writes
``speed_cuda.{md,json}`` naming the GPU, beside the CPU page ``speed.{md,json}``. On the CPU the memory column is
the process's peak resident set size during the second (untimed) warm-up step above its resident set size before it
(after ``gc.collect()`` and ``malloc_trim(0)``: :class:`bench_common.CpuPeak`, as ``families.py``): the step's own
working memory, the other methods' models, resident throughout, not counted.

    pip install -r benchmarks/requirements.txt      # Opacus, for the comparison only
    python benchmarks/speed.py [--batches 512 4096] [--models mlp cnn wrn] [--rounds 40] [--device cpu|cuda]
                               [--skip nonprivate nonprivate-chunked dpml-one-chunk]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench_common import CpuPeak, cpu_name, current_commit  # benchmarks/ is the script's folder

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("mlp", "cnn", "wrn")
"""The models :func:`build` builds: an MLP, the Opacus MNIST example's CNN, dpml's WRN-16-4."""
METHODS = ["nonprivate", "nonprivate-chunked", "dpml", "dpml-one-chunk", "opacus-hooks", "opacus-ghost"]
PEERS = ("opacus-hooks", "opacus-ghost")


def build(model: str):  # noqa: ANN201
    from torch import nn

    if model not in MODELS:
        raise ValueError(f"model {model!r}: speed.py builds one of {', '.join(MODELS)}")
    if model == "wrn":
        sys.path.insert(0, str(ROOT))
        from dpml.models.vision import WideResNetSpec, build_wide_resnet

        return build_wide_resnet(WideResNetSpec(784, (1, 28, 28), 10))
    if model == "mlp":
        return nn.Sequential(
            nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
        )
    return nn.Sequential(  # the Opacus MNIST example's CNN
        nn.Conv2d(1, 16, 8, 2, padding=3),
        nn.ReLU(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, 2),
        nn.ReLU(),
        nn.MaxPool2d(2, 1),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


def example_batch(model: str, batch: int, device: str = "cpu"):  # noqa: ANN201
    """Random Fashion-MNIST-shaped records (seed 0) and labels: images, or flat rows for dpml's WRN (it takes
    the pipeline's prepared rows and reshapes them itself)."""
    import torch

    torch.manual_seed(0)
    shape = (784,) if model == "wrn" else (1, 28, 28)
    return torch.randn(batch, *shape, device=device), torch.randint(0, 10, (batch,), device=device)


def step_function(model_name: str, method: str, x, y) -> Callable[[], None]:  # noqa: ANN001
    """One training step of ``method`` on the batch (x, y), with its own copy of the model (seed 0)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = build(model_name).to(x.device)
    batch = x.shape[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if method == "nonprivate":

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

        return step
    sys.path.insert(0, str(ROOT))
    from dpml.train.chunking import fastest_chunk
    from dpml.train.dpsgd import clipped_sum_and_noise, per_example_cross_entropy, trainable_parameters
    from dpml.train.noise import cpu_noise_stream

    from dpml.train.captured import capture_report, eager_passes, graph_memory

    autocast = torch.bfloat16 if method == "dpml-bf16" else None
    dp_model, flat = model, x
    if model_name == "mlp":
        dp_model, flat = model[1:], x.reshape(batch, -1)  # the Flatten done once here; the Linear layers take rows
    if method in ("nonprivate-chunked", "dpml", "dpml-bf16", "dpml-eager"):
        # the trainer's chunk (train.tune_physical_batch, physical_batch_size ≥ the batch), timed on a synthetic probe
        chunk = fastest_chunk(
            dp_model, per_example_cross_entropy, tuple(flat.shape[1:]), flat.dtype, batch, batch, autocast=autocast
        ).chunk
    else:
        chunk = batch  # dpml-one-chunk; the peers do not chunk
    if method == "nonprivate-chunked":  # the same step by gradient accumulation over dpml's chunks

        def accumulated() -> None:
            optimizer.zero_grad(set_to_none=True)
            for start in range(0, batch, chunk):
                (
                    F.cross_entropy(model(x[start : start + chunk]), y[start : start + chunk], reduction="sum") / batch
                ).backward()
            optimizer.step()

        accumulated.chunk = chunk  # type: ignore[attr-defined]
        return accumulated
    if method in ("dpml", "dpml-one-chunk", "dpml-bf16", "dpml-eager"):
        model = dp_model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        params = trainable_parameters(model)
        generator = torch.Generator(device=x.device).manual_seed(0)
        if x.device.type == "cpu":  # as run_dpsgd_steps: a step ahead where a core is idle, else in the step
            generator = cpu_noise_stream(generator, params, 1.0)

        def dp_step() -> None:  # as run_dpsgd_steps: the noise added to the step's own sums, in place
            with eager_passes() if method == "dpml-eager" else contextlib.nullcontext():
                sums, noises, _ = clipped_sum_and_noise(model, flat, y, 1.0, 1.0, chunk, generator, autocast=autocast)
            for name, p in params.items():
                p.grad = sums[name].add_(noises[name]).div_(batch)
            optimizer.step()

        dp_step.close = getattr(generator, "close", lambda: None)  # type: ignore[attr-defined]
        dp_step.settle = getattr(generator, "wait", None)  # type: ignore[attr-defined]
        dp_step.chunk = chunk  # type: ignore[attr-defined]
        dp_step.held = lambda: graph_memory(model)  # type: ignore[attr-defined]
        dp_step.report = lambda: capture_report(model)  # type: ignore[attr-defined]
        return dp_step
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(x, y), batch_size=batch)
    engine = PrivacyEngine(accountant="prv")
    mode = "ghost" if method == "opacus-ghost" else "hooks"
    criterion = torch.nn.CrossEntropyLoss()
    made = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        criterion=criterion,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        poisson_sampling=False,
        grad_sample_mode=mode,
    )
    if mode == "ghost":
        model, optimizer, criterion, _ = made
    else:
        model, optimizer, _ = made

    def peer_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        optimizer.step()

    return peer_step


def cpu_step_memory(step: Callable[[], None], cpu_peak: CpuPeak) -> float:
    """MiB of resident memory one (untimed, warm-up) step takes on the CPU above what was resident before it; its
    background noise draw, if any, waited for inside the measurement (module docstring)."""
    settle = getattr(step, "settle", lambda: None)
    return cpu_peak.during(lambda: (step(), settle())) / 2**20


def measure(
    model_name: str, batch: int, methods: list[str], rounds: int, peer_rounds: int, device: str = "cpu"
) -> list[dict]:
    """Median step time of each method over interleaved rounds (peers in ``peer_rounds`` of them)."""
    import torch

    x, y = example_batch(model_name, batch, device)
    cuda = device.startswith("cuda")
    steps, errors, chunks = {}, {}, {}
    cpu_peak = None if cuda else CpuPeak()
    cpu_memory = cpu_peak is not None and cpu_peak.error is None
    peaks: dict[str, float] = {}
    for method in methods:
        try:
            steps[method] = step_function(model_name, method, x, y)
            chunks[method] = getattr(steps[method], "chunk", None)
            steps[method]()  # two warm-up steps, the CPU's second measured
            if cpu_memory:
                peaks[method] = cpu_step_memory(steps[method], cpu_peak)
            else:
                steps[method]()
                peaks[method] = 0.0
        except Exception as error:  # noqa: BLE001 — a peer that cannot run is reported, not fatal
            errors[method] = f"{type(error).__name__}: {error}".splitlines()[0]
            steps.pop(method, None)
    every = max(1, rounds // max(1, peer_rounds))
    times: dict[str, list[float]] = {m: [] for m in steps}
    for r in range(rounds):
        for method, step in steps.items():
            if method in PEERS and (r % every or len(times[method]) >= peer_rounds):
                continue
            settle = getattr(step, "settle", None)
            if settle is not None:  # a lead-in step, so the timed one overlaps its own next draw, as in a loop
                step()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
                held = getattr(step, "held", lambda: 0)()  # (CUDA graphs' pool: allocated memory leaves it out)
                peaks[method] = max(peaks[method], (torch.cuda.max_memory_allocated() + held) / 2**20)
            times[method].append(time.perf_counter() - start)
            if settle is not None:  # its background draw done before the next method is timed
                settle()
    reports = {method: getattr(step, "report", lambda: None)() for method, step in steps.items()}
    for step in steps.values():  # the noise thread stopped, the models and Opacus' hooks freed before the next shape
        getattr(step, "close", lambda: None)()
    steps.clear()
    gc.collect()
    baseline = baseline_method(methods)
    if baseline not in times:  # the baseline itself failed: every ratio would be meaningless
        raise RuntimeError(f"{model_name}, batch {batch}: the non-private step failed: {errors[baseline]}")
    base = statistics.median(times[baseline])
    rows = []
    for method in methods:
        row = {"model": model_name, "method": method, "batch": batch, "device": device, "baseline": baseline}
        if method in errors:
            rows.append({**row, "error": errors[method]})
            continue
        ms = 1000 * statistics.median(times[method])
        rows.append(
            {
                **row,
                "ms_per_step": ms,
                "steps": len(times[method]),
                "time_ratio": ms / (1000 * base),
                "peak_mb": peaks[method] if cuda or cpu_memory else None,
                "chunk": chunks.get(method),
                **({"cuda_graphs": reports[method]} if reports.get(method) else {}),
            }
        )
    return rows


def baseline_method(methods: list[str]) -> str:
    """The step every ratio is taken against: the one-pass non-private step, or where it is skipped (a batch
    whose one pass does not fit in memory) the non-private step accumulated over dpml's chunks."""
    return "nonprivate" if "nonprivate" in methods else "nonprivate-chunked"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=MODELS)
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds (non-private and dpml: one step each)")
    parser.add_argument("--peer-rounds", type=int, default=10, help="rounds in which each Opacus mode is timed")
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS))
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["nonprivate", "nonprivate-chunked", "dpml-one-chunk"],
        help="leave out these comparison rows (e.g. the one-chunk DP step of a slow model; the "
        "one-pass non-private step where it does not fit in memory: the ratios are then "
        "against nonprivate-chunked)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="torch intra-op thread counts, each measured in turn (default: torch's own)",
    )
    parser.add_argument(
        "--keep-share",
        type=float,
        default=None,
        help="the share of what a pass holds anyway that its kept per-example gradients may add, for every dpml "
        "row (dpml.train.keep_budget.KEEP_SHARE; default: the engine's): what keeping costs and buys",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.keep_share is not None:
        if args.keep_share < 0:
            parser.error(f"--keep-share = {args.keep_share}: must be at least 0")
        sys.path.insert(0, str(ROOT))
        from dpml.train import keep_budget

        keep_budget.KEEP_SHARE = args.keep_share
    for name, value in (
        ("--rounds", args.rounds),
        ("--peer-rounds", args.peer_rounds),
        *(("--threads", t) for t in args.threads or ()),
    ):
        if value < 1:
            parser.error(f"{name} = {value}: must be a positive integer")
    if {"nonprivate", "nonprivate-chunked"} <= set(args.skip):
        parser.error("--skip: nonprivate and nonprivate-chunked cannot both be left out (no baseline for the ratios)")
    import torch

    threads = args.threads or [torch.get_num_threads()]
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    if args.device == "cpu":
        sys.path.insert(0, str(ROOT))
        from dpml.devices import keep_freed_cpu_memory

        keep_freed_cpu_memory()  # as the trainer on the CPU, for every method alike (module docstring)
    methods = (
        [m for m in METHODS[:4] if m not in args.skip]
        + (["dpml-bf16", "dpml-eager"] if args.device == "cuda" else [])
        + list(args.peers)
    )
    rows = []
    for count in threads:
        torch.set_num_threads(count)
        for model in args.models:
            for batch in args.batches:
                for row in measure(model, batch, methods, args.rounds, args.peer_rounds, args.device):
                    rows.append({**row, "threads": count})
                    print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "speed" if args.device == "cpu" else "speed_cuda"
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=2))
    (out / f"{stem}.md").write_text(page(rows, args, torch))
    print(page(rows, args, torch))


def page(rows: list[dict], args: argparse.Namespace, torch) -> str:  # noqa: ANN001
    """The results page: the machine, the command, and one row per (model, batch, method)."""
    cuda = args.device == "cuda"
    memory = not cuda and any(r.get("peak_mb") is not None for r in rows)
    where = f"GPU: {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}" if cuda else "CPU only"
    command = (
        f"python benchmarks/speed.py --batches {' '.join(map(str, args.batches))} --models "
        f"{' '.join(args.models)} --rounds {args.rounds} --peer-rounds {args.peer_rounds}"
        + (f" --peers {' '.join(args.peers)}" if list(args.peers) != list(PEERS) else "")
        + (f" --skip {' '.join(args.skip)}" if args.skip else "")
        + (f" --threads {' '.join(map(str, args.threads))}" if args.threads else "")
        + (f" --keep-share {args.keep_share:g}" if args.keep_share is not None else "")
        + f" --device {args.device}"
    )
    lines = [
        "# Step time: non-private vs dpml DP-SGD vs Opacus",
        "",
        f"Command: `{command}`. Commit {current_commit()}. Machine: {cpu_name()}, {os.cpu_count()} logical CPUs, "
        f"torch {torch.__version__}, Python {platform.python_version()}; {where}. One process; per (model, "
        f"batch) the methods' steps alternate, round after round ({args.rounds} rounds; Opacus in "
        f"{args.peer_rounds} of them); median step time per method."
        + (
            ""
            if "nonprivate" not in args.skip
            else " The one-pass non-private step is left out (its activations "
            "for the whole batch do not fit in this machine's memory): the ratio columns are against "
            "`nonprivate-chunked`, the non-private step accumulated over the same chunks as dpml's."
        ),
        "",
        "| torch threads | model | batch | method | rows per chunk | ms / step | steps timed | × non-private time | "
        "throughput vs non-private |" + (" peak MB |" if cuda else " step MB above resident |" if memory else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if cuda or memory else ""),
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['threads']} | {r['model']} | {r['batch']} | {r['method']} | | failed: {r['error'][:80]} | | | |"
                + (" |" if cuda or memory else "")
            )
            continue
        chunk = r.get("chunk") or r["batch"]
        lines.append(
            f"| {r['threads']} | {r['model']} | {r['batch']} | {r['method']} | {chunk} | "
            f"{r['ms_per_step']:.1f} | {r['steps']} | "
            f"{r['time_ratio']:.2f} | {1 / r['time_ratio']:.2f} |"
            + (f" {r['peak_mb']:.0f} |" if cuda or memory else "")
        )
    graphs = [r for r in rows if r.get("cuda_graphs")]
    if graphs:
        lines += ["", "How dpml's chunks ran on the GPU (`dpml.train.captured.capture_report`):", ""]
        lines += [f"- {r['model']}, batch {r['batch']}, {r['method']}: {r['cuda_graphs']}" for r in graphs]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
