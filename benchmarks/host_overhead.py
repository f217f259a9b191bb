"""The DP step's fixed cost on the host: what a launch-bound GPU step waits for, measured on the CPU.

On a GPU the small models' DP steps are host-bound (issue 48: the MLP's 5 DP steps at batch 512 on an H100
took 25.1 ms of host time against 1.2 ms of GPU time): the step takes as long as Python and torch's dispatcher
take to issue its operations, whatever the batch. That cost does not depend on the device, so it can be
measured here: the same models at a batch of ``--batch`` rows (4 by default), where the arithmetic is
negligible, one thread, the trainer's whole step (:func:`dpml.train.dpsgd.run_dpsgd_steps`: clipped sums,
the noise from the trainer's CPU stream, the update, the optimizer) against the non-private step
(zero_grad, mean loss, backward, SGD), interleaved round after round in one process. Per model it reports
the median µs per step of both, their ratio, and the operators each step dispatches (torch's dispatcher,
counted with a ``TorchDispatchMode`` over one step): all of them, and those that are not views or
metadata (on a GPU, each of these is a kernel launch at most).

    python benchmarks/host_overhead.py [--models mlp cnn wrn encoder bert gpt2] [--batch 4] [--rounds 7]
                                       [--steps 100] [--out benchmarks/results] [--stem host_overhead]

Models: ``mlp``, ``cnn`` and ``wrn`` of ``speed.py`` (Fashion-MNIST shapes), and the ``tiny`` families of
``families.py`` (32 tokens; images 3×32×32): ``encoder``, ``bert`` and ``gpt2`` with ``transformers``, ``vit``
and ``resnet18-gn`` with ``timm`` and ``torchvision`` (``benchmarks/requirements-families.txt``), or any other
family ``families.py`` builds (peft's adapters on BERT: ``bert-hra``, ``bert-oft``, …); a family whose library is
absent gets a row that says so.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import families  # noqa: E402
import speed  # noqa: E402
from bench_common import cpu_name, current_commit, without_paths  # noqa: E402
from dpml.train.dpsgd import per_example_cross_entropy, run_dpsgd_steps  # noqa: E402
from dpml.train.steps import Step  # noqa: E402

VIEWS = {
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "permute",
    "detach",
    "select",
    "slice",
    "unsqueeze",
    "squeeze",
    "squeeze_",
    "unsqueeze_",
    "expand",
    "as_strided",
    "alias",
    "lift_fresh",
    "reshape",
    "_reshape_alias",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "profiler._record_function_enter_new",
    "profiler._record_function_exit",
}
"""Operators that launch no kernel on a GPU (views, metadata, the profiler's markers)."""
HOST_READS = {"_local_scalar_dense", "equal", "nonzero", "_unique2", "is_nonzero"}
"""Operators whose result the host reads (on a GPU they wait for the device), counted apart from the kernels."""


SPEED_MODELS = ("mlp", "cnn", "wrn")


class OperatorCount(TorchDispatchMode):
    """How many operators a piece of code dispatches, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.counts[str(func.overloadpacket).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))


def model_and_batch(name: str, batch: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if name in SPEED_MODELS:
        x, y = speed.example_batch(name, batch)
        return speed.build(name), x, y
    args = argparse.Namespace(size="tiny", length=32)
    model, _ = families.build(name, args.size, args.length)
    x, y = families.example_batch(name, batch, args.length, "cpu")
    return model, x, y


def steppers(name: str, batch: int, steps: int) -> tuple[Callable[..., None], Callable[..., None]]:
    """(DP steps, non-private steps), ``steps`` of them unless told how many, each method on its own copy of the
    model."""
    dp_model, x, y = model_and_batch(name, batch)
    plain_model, _, _ = model_and_batch(name, batch)
    dp_optimizer = torch.optim.SGD([p for p in dp_model.parameters() if p.requires_grad], lr=0.01)
    plain_optimizer = torch.optim.SGD([p for p in plain_model.parameters() if p.requires_grad], lr=0.01)
    noise = torch.Generator().manual_seed(1)

    def dp(count: int = steps) -> None:
        run_dpsgd_steps(
            dp_model,
            (Step(torch.arange(batch), [(x, y)]) for _ in range(count)),
            count=count,
            clip_norm=1.0,
            noise_multiplier=1.0,
            expected_batch=float(batch),
            optimizer=dp_optimizer,
            noise_source=noise,
            loss_fn=per_example_cross_entropy,
            exact=(),
        )

    def plain(count: int = steps) -> None:
        plain_model.train()
        for _ in range(count):
            plain_optimizer.zero_grad(set_to_none=True)
            per_example_cross_entropy(_logits(plain_model(x)), y).mean().backward()
            plain_optimizer.step()

    return dp, plain


def _logits(out: object) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits  # type: ignore[attr-defined]


def measure(name: str, batch: int, steps: int, rounds: int) -> dict:
    dp, plain = steppers(name, batch, steps)
    dp(), plain()  # warm-up (the clipping plan of the engine's first passes, the allocator)
    times: dict[str, list[float]] = {"dpml": [], "nonprivate": []}
    for _ in range(rounds):
        for method, run in (("dpml", dp), ("nonprivate", plain)):
            start = time.perf_counter()
            run()
            times[method].append((time.perf_counter() - start) / steps * 1e6)
    counted: dict[str, collections.Counter[str]] = {}
    for method, run in (("dpml", dp), ("nonprivate", plain)):
        counter = OperatorCount()
        with counter:
            run(1)
        counted[method] = counter.counts
    dp_us, plain_us = statistics.median(times["dpml"]), statistics.median(times["nonprivate"])
    return {
        "model": name,
        "batch": batch,
        "dpml_us": dp_us,
        "nonprivate_us": plain_us,
        "throughput_ratio": plain_us / dp_us,
        **{f"{m}_operators": sum(c.values()) for m, c in counted.items()},
        **{
            f"{m}_kernels": sum(n for op, n in c.items() if op not in VIEWS and op not in HOST_READS)
            for m, c in counted.items()
        },
        **{f"{m}_syncs": sum(c.get(op, 0) for op in HOST_READS) for m, c in counted.items()},
        "dpml_by_operator": dict(counted["dpml"].most_common()),
    }


def write(rows: list[dict], out: Path, meta: dict[str, str], name: str = "host_overhead") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# The DP step's host cost (CPU, tiny batches)",
        "",
        f"`{meta['command']}` at {meta['commit']}; {meta['machine']}.",
        "",
        "The trainer's whole DP step against the non-private step at a batch where the arithmetic is negligible, "
        "interleaved; µs per step (medians), and the operators one step dispatches. Kernels: not views or "
        "metadata, nor host reads; on a GPU each is at most one launch. Host reads: a tensor's value read by the "
        "host (`.item()`, `bool(t.any())`, `torch.equal`), on a GPU a wait for the device where the tensor is "
        "there. Here everything is on the CPU, so this column counts every read, also of the tensors that stay "
        "on the CPU whatever the device (the recorder's example maps, since cdd731f); which reads would reach "
        "the batch's device is what `tests/test_devices.py` checks on the meta device (none for an MLP, GroupNorm, "
        "GPT-2's addmm or a ViT-shaped encoder, since 81afc09). What a launch-bound GPU step waits for. "
        "Convolutions take CPU-only ways here (the compiled norms kernel, one call that no operator count sees, and "
        "cache-sized slices of examples: `dpml/train/clipping_conv.py`); a GPU takes torch's batched products, so "
        "the CNN's, WRN's and ResNet's counts are the CPU's, not a GPU's launches.",
        "",
        "| model | batch | non-private µs | dpml µs | ratio | operators (non-private / dpml) | kernels | host reads |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "not_importable" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['not_importable']} |  |  |  |  |  |")
            continue
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['nonprivate_us']:.0f} | {r['dpml_us']:.0f} | "
            f"{r['throughput_ratio']:.2f} | {r['nonprivate_operators']} / {r['dpml_operators']} | "
            f"{r['nonprivate_kernels']} / {r['dpml_kernels']} | {r['nonprivate_syncs']} / {r['dpml_syncs']} |"
        )
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=[*SPEED_MODELS, "encoder", "bert", "gpt2", "vit", "resnet18-gn"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--stem", default="host_overhead", help="the page's file name, without .md and .json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        try:
            row = measure(name, args.batch, args.steps, args.rounds)
        except families.NotImportable as error:  # a family whose library is absent here: the page says why
            print(f"{name}: {error}", flush=True)
            rows.append({"model": name, "batch": args.batch, "not_importable": str(error)})
            continue
        print(
            f"{name}: non-private {row['nonprivate_us']:.0f} µs, dpml {row['dpml_us']:.0f} µs "
            f"({row['throughput_ratio']:.2f}); kernels {row['nonprivate_kernels']} / {row['dpml_kernels']}",
            flush=True,
        )
        rows.append(row)
    meta = {
        "command": " ".join(["python benchmarks/host_overhead.py", *without_paths(argv)]),
        "commit": current_commit(),
        "machine": f"{cpu_name()}, torch {torch.__version__}, Python {platform.python_version()}, 1 thread",
    }
    write(rows, args.out, meta, args.stem)


if __name__ == "__main__":
    main(sys.argv[1:])
