"""Python's full garbage collections during DP training: the trainer's loop with the process's older objects frozen
(:func:`dpml.devices.older_objects_left_out_of_collections`, as :func:`dpml.train.dpsgd.run_dpsgd_steps` runs) against
the same loop without the freeze, in one process whose heap is a pipeline's (MLflow, Prefect, pandas and scikit-learn
imported, as ``dpml run`` has them).

An engine pass holds thousands of Python objects at once, so the collector's young generations overflow several
times a step, and every so often it runs a full collection, which visits every tracked object of the process. Those
pauses are rare (one in several steps), so a median step time hides them: this page reports the **mean** time per
step over blocks of ``--steps`` trainer steps, the two settings alternating block by block for ``--rounds`` rounds
(each first in every other round), and the full collections each setting ran (``gc.callbacks``) with their total
time.

    python benchmarks/collector_pauses.py [--models timm-xcit gpt2 bert vit] [--batch 64] [--length 128]
                                          [--steps 15] [--rounds 4] [--threads 2] [--out benchmarks/results]

Models: the ``tiny`` families of ``families.py`` (``benchmarks/requirements-families.txt``); a family whose library is
absent gets a row that says so.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import families  # noqa: E402
from bench_common import cpu_name, current_commit, without_paths  # noqa: E402
from dpml.devices import keep_freed_cpu_memory  # noqa: E402
from dpml.train import dpsgd  # noqa: E402
from dpml.train.steps import Step  # noqa: E402

PIPELINE_LIBRARIES = ("mlflow", "prefect", "pandas", "sklearn")
SETTINGS = ("frozen", "not frozen")


def pipeline_heap() -> list[str]:
    """Import what a pipeline process holds (those installed), and return their names."""
    found = []
    for name in PIPELINE_LIBRARIES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
            found.append(name)
    return found


class FullCollections:
    """The full collections (generation 2) the process runs while ``on``: how many, and their seconds."""

    def __init__(self) -> None:
        self.on, self.count, self.seconds, self._start = False, 0, 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if not self.on or info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._start


def trainer_steps(name: str, batch: int, length: int):  # noqa: ANN201
    """``run(count, frozen)``: ``count`` steps of the trainer's loop on one model (its freeze left in or taken out)."""
    torch.manual_seed(0)
    model, _ = families.build(name, "tiny", length)
    x, y = families.example_batch(name, batch, length, "cpu")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    noise = torch.Generator().manual_seed(1)
    loop_freeze = dpsgd.older_objects_left_out_of_collections

    def run(count: int, frozen: bool) -> None:
        dpsgd.older_objects_left_out_of_collections = loop_freeze if frozen else contextlib.nullcontext
        try:
            dpsgd.run_dpsgd_steps(
                model,
                (Step(torch.arange(batch), [(x, y)]) for _ in range(count)),
                count=count,
                clip_norm=1.0,
                noise_multiplier=1.0,
                expected_batch=float(batch),
                optimizer=optimizer,
                noise_source=noise,
                loss_fn=dpsgd.per_example_cross_entropy,
                exact=(),
            )
        finally:
            dpsgd.older_objects_left_out_of_collections = loop_freeze

    return run


def measure(name: str, batch: int, length: int, steps: int, rounds: int, collections: FullCollections) -> dict:
    run = trainer_steps(name, batch, length)
    run(2, True)  # warm-up: the clipping plan of the engine's first passes, the allocator
    per_step: dict[str, list[float]] = {s: [] for s in SETTINGS}
    pauses = {s: [0, 0.0] for s in SETTINGS}
    for round_ in range(rounds):
        for setting in SETTINGS if round_ % 2 == 0 else reversed(SETTINGS):  # (ABBA: no setting always first)
            collections.on, collections.count, collections.seconds = True, 0, 0.0
            start = time.perf_counter()
            run(steps, setting == "frozen")
            per_step[setting].append((time.perf_counter() - start) / steps * 1e3)
            collections.on = False
            pauses[setting][0] += collections.count
            pauses[setting][1] += collections.seconds
    row: dict = {"model": name, "batch": batch, "steps": steps * rounds}
    for setting in SETTINGS:
        key = setting.replace(" ", "_")
        row[f"{key}_mean_ms"] = statistics.mean(per_step[setting])
        row[f"{key}_full_collections"] = pauses[setting][0]
        row[f"{key}_full_collection_ms"] = pauses[setting][1] * 1e3
    row["speedup"] = row["not_frozen_mean_ms"] / row["frozen_mean_ms"]
    return row


def write(rows: list[dict], out: Path, meta: dict[str, str], stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# Full garbage collections during DP training",
        "",
        f"`{meta['command']}` at {meta['commit']}; {meta['machine']}. Heap: {meta['heap']}.",
        "",
        "The trainer's loop (`dpml.train.dpsgd.run_dpsgd_steps`, the whole step: clipped sums, noise, update, "
        "optimizer) with the process's older objects frozen for the loop, as the trainer runs it, against the same "
        "loop without the freeze, alternating in blocks in one process (each setting first in every other round). "
        "Mean ms per step (full collections included: a median would hide them), and the full collections "
        "(generation 2) each setting ran, with their total time.",
        "",
        "| model | batch | steps each | frozen ms/step | not frozen ms/step | not frozen ÷ frozen "
        "| full collections frozen (ms) | not frozen (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "not_importable" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['not_importable']} |  |  |  |  |  |")
            continue
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['steps']} | {r['frozen_mean_ms']:.1f} | "
            f"{r['not_frozen_mean_ms']:.1f} | {r['speedup']:.2f} | "
            f"{r['frozen_full_collections']} ({r['frozen_full_collection_ms']:.0f}) | "
            f"{r['not_frozen_full_collections']} ({r['not_frozen_full_collection_ms']:.0f}) |"
        )
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["timm-xcit", "gpt2", "bert", "vit"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=15, help="trainer steps per block")
    parser.add_argument("--rounds", type=int, default=4, help="blocks per setting, alternating")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--stem", default="collector_pauses", help="the page's file name, without .md and .json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_cpu_memory()  # as the trainer on the CPU
    heap = pipeline_heap()
    collections = FullCollections()
    rows = []
    for name in args.models:
        try:
            row = measure(name, args.batch, args.length, args.steps, args.rounds, collections)
        except families.NotImportable as error:
            print(f"{name}: {error}", flush=True)
            rows.append({"model": name, "batch": args.batch, "not_importable": str(error)})
            continue
        print(
            f"{name}: frozen {row['frozen_mean_ms']:.1f} ms/step ({row['frozen_full_collections']} full collections), "
            f"not frozen {row['not_frozen_mean_ms']:.1f} ({row['not_frozen_full_collections']}): {row['speedup']:.2f}",
            flush=True,
        )
        rows.append(row)
    gc.collect()
    meta = {
        "command": " ".join(["python benchmarks/collector_pauses.py", *without_paths(argv)]),
        "commit": current_commit(),
        "machine": f"{cpu_name()}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{args.threads} threads",
        "heap": f"{', '.join(heap) or 'no pipeline library'} imported, {len(gc.get_objects()):,} tracked objects "
        "at the end",
    }
    write(rows, args.out, meta, args.stem)


if __name__ == "__main__":
    main(sys.argv[1:])
