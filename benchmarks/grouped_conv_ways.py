"""Per-example weight gradients of grouped and depthwise convolutions, ∇_{W_j} ℓ_i = Σ_t δ_{i,j,t} a_{i,j,t}ᵀ, by
each of the engine's four ways, the one it picks, and the one way it had before.

    python benchmarks/grouped_conv_ways.py [--device cpu|cuda] [--threads 2] [--repeats 5]

For the grouped layers of models people bring (ConvNeXt's depthwise 7×7, MobileNet's and EfficientNet's 3×3 and
5×5, RegNet's and ResNeXt's groups of 8 to 32 channels, Mamba's and ConvBERT's depthwise Conv1d), at batch 64 on
32×32 images or sequences of 128 and 1,024, on random inputs and output gradients of the layer's shape:

- *grouped forward*: one convolution with B·g groups, each (example, group)'s δ its kernels, over the live taps only
  (:func:`dpml.train.clipping_conv_ways.per_example_by_grouped_forward`);
- *weight gradient*: the weight gradient of one convolution with B·g groups
  (:func:`dpml.train.clipping_conv_ways.per_example_by_weight_gradient`);
- *patches*: the live taps' patches and one batched product over the (example, group) pairs
  (:func:`dpml.train.clipping_conv_ways.per_example_by_patches`);
- *compiled kernel* (float32 on a CPU, where a C compiler built it; "—" elsewhere): each (example, group) pair's
  patches built in a cache-sized buffer and multiplied there
  (:func:`dpml.train.clipping_conv_ways.per_example_by_compiled_kernel`);
- *the engine's pick*: :func:`dpml.train.clipping_conv_ways.fastest_grouped_way`, which on a CPU times the ways
  once per shape (its own timing not counted here) and on a GPU takes the patches while they fit the keep limit,
  else the weight gradient (:func:`dpml.train.clipping_conv_ways.gpu_grouped_way`; this table, run there, is what
  would change that);
- *all taps' patches* (the only way before this page's commit): the whole kernel's patches and the same product;
- for scale, the batched weight gradient of the whole batch (what a non-private step computes; not per example).

Median milliseconds over the repeats (the ways in turn, round after round, after one warm-up; TF32 off, as in the
engine), and the largest difference of every way from the weight-gradient way, relative to its largest entry.
Writes ``benchmarks/results/grouped_conv_ways[_cuda].{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.grad

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_common import cpu_name, current_commit, median_ms_in_turn, ways_arguments, ways_command, ways_table  # noqa: E402  (benchmarks/ is the script's folder)

from dpml.train.clipping_conv import Geometry, compiled_kernel_takes, unfold_patches  # noqa: E402
from dpml.train.clipping_conv_ways import PER_EXAMPLE_WAYS, fastest_grouped_way, grouped_per_example_gradients  # noqa: E402

BATCH = 64
# name, C_in, C_out, groups, kernel (h, w), stride, padding (h, w), input (h, w)
SHAPES = [
    ("ConvNeXt-atto stage 1, depthwise 7×7", 40, 40, 40, (7, 7), 1, (3, 3), (8, 8)),
    ("ConvNeXt-atto stage 3, depthwise 7×7", 160, 160, 160, (7, 7), 1, (3, 3), (2, 2)),
    ("ConvNeXt-atto stage 4, depthwise 7×7", 320, 320, 320, (7, 7), 1, (3, 3), (1, 1)),
    ("ConvNeXt-T stage 1 at 128 px, depthwise 7×7", 96, 96, 96, (7, 7), 1, (3, 3), (32, 32)),
    ("MobileNet-V2 depthwise 3×3", 144, 144, 144, (3, 3), 1, (1, 1), (16, 16)),
    ("MobileNet-V2 depthwise 3×3, stride 2", 96, 96, 96, (3, 3), 2, (1, 1), (16, 16)),
    ("EfficientNet depthwise 5×5, stride 2", 144, 144, 144, (5, 5), 2, (2, 2), (16, 16)),
    ("RegNetX-200MF groups of 8, 3×3, stride 2", 152, 152, 19, (3, 3), 2, (1, 1), (4, 4)),
    ("RegNetX-200MF groups of 8, 3×3 on 1×1", 368, 368, 46, (3, 3), 1, (1, 1), (1, 1)),
    ("ResNeXt groups of 8 (32 groups), 3×3", 256, 256, 32, (3, 3), 1, (1, 1), (8, 8)),
    ("ResNeXt-50 stage 3 at 32 px, 32 groups of 16, 3×3", 512, 512, 32, (3, 3), 1, (1, 1), (2, 2)),
    ("ResNeXt-50 stage 1 at 32 px, 32 groups of 4, 3×3", 128, 128, 32, (3, 3), 1, (1, 1), (8, 8)),
    ("Mamba depthwise Conv1d, k = 4, 128 steps", 256, 256, 256, (1, 4), 1, (0, 3), (1, 128)),
    ("Mamba depthwise Conv1d, k = 4, 1,024 steps", 256, 256, 256, (1, 4), 1, (0, 3), (1, 1024)),
    ("ConvBERT depthwise Conv1d, k = 9, 128 steps", 128, 128, 128, (1, 9), 1, (0, 4), (1, 128)),
]
WAYS = ["grouped forward", "weight gradient", "patches", "compiled kernel"]


def all_taps_patches(x: torch.Tensor, d: torch.Tensor, geometry: Geometry, groups: int) -> torch.Tensor:
    """The way before: every tap's patches (:func:`unfold_patches` of the whole kernel) and one batched product."""
    patches = unfold_patches(x, *geometry)
    return grouped_per_example_gradients(d.reshape(d.shape[0], d.shape[1], -1), patches, groups)


def measure(shape: tuple, device: str, repeats: int) -> dict:
    name, c_in, c_out, groups, kernel, stride, padding, size = shape
    geometry: Geometry = (kernel, (stride, stride), padding, (1, 1))
    torch.manual_seed(0)
    x = torch.randn(BATCH, c_in, *size, device=device)
    out = [(n + 2 * p - k) // stride + 1 for n, p, k in zip(size, padding, kernel, strict=True)]
    d = torch.randn(BATCH, c_out, *out, device=device)
    pick = fastest_grouped_way(x, d, geometry, groups)
    functions: dict[str, Callable[[], torch.Tensor]] = {
        way: (lambda way=way: PER_EXAMPLE_WAYS[way](x, d, geometry, groups))
        for way in WAYS
        if way != "compiled kernel" or compiled_kernel_takes(x, d)
    }
    functions["all taps' patches (before)"] = lambda: all_taps_patches(x, d, geometry, groups)
    functions["batch weight gradient (non-private)"] = lambda: torch.nn.grad.conv2d_weight(
        x, (c_out, c_in // groups, *kernel), d, (stride, stride), padding, (1, 1), groups
    )
    results = {way: fn() for way, fn in functions.items()}  # warm-up, and the results compared
    first = results["weight gradient"]
    scale = float(first.abs().max())
    ms = median_ms_in_turn(functions, device, repeats)
    return {
        "shape": name,
        "c_in": c_in,
        "c_out": c_out,
        "groups": groups,
        "kernel": list(kernel),
        "stride": stride,
        "positions": int(d[0, 0].numel()),
        "device": device,
        "ms": ms,
        "pick": pick,
        "relative_difference": max(
            float((results[way].reshape(first.shape) - first).abs().max()) / scale
            for way in results
            if way != "batch weight gradient (non-private)"
        ),
    }


def page(rows: list[dict], args: argparse.Namespace) -> str:
    where = (
        f"GPU {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
        if args.device == "cuda"
        else f"{cpu_name()}, {os.cpu_count()} logical CPUs, {torch.get_num_threads()} torch threads"
    )
    command = ways_command("grouped_conv_ways.py", args)
    lines = [
        "# Per-example weight gradients of grouped and depthwise convolutions: the engine's ways",
        "",
        f"Command: `{command}`. Commit {current_commit()}. Machine: {where}, torch {torch.__version__}, Python "
        f"{platform.python_version()}. Batch {BATCH}; median ms of {args.repeats} rounds (the ways in turn); T = "
        "output positions per example; g = groups; the pick is the engine's (timed once per shape, its timing not "
        "counted); the differences are the largest of any way from the weight-gradient way, relative to its "
        "largest entry.",
        "",
        "| layer | C_in → C_out, g | kernel, stride | T | grouped forward | weight gradient | patches | "
        "compiled kernel | the engine's pick | all taps' patches (before) | pick's speed-up on before | batch "
        "weight gradient (non-private) | differences |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms, pick = r["ms"], r["pick"]
        before = ms["all taps' patches (before)"]
        kernel = "×".join(str(k) for k in r["kernel"])
        compiled = f"{ms['compiled kernel']:.2f}" if "compiled kernel" in ms else "—"
        lines.append(
            f"| {r['shape']} | {r['c_in']} → {r['c_out']}, {r['groups']} | {kernel}, {r['stride']} | "
            f"{r['positions']} | {ms['grouped forward']:.2f} | {ms['weight gradient']:.2f} | {ms['patches']:.2f} | "
            f"{compiled} | {pick} ({ms[pick]:.2f}) | {before:.2f} | {before / ms[pick]:.1f}× | "
            f"{ms['batch weight gradient (non-private)']:.2f} | {r['relative_difference']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    args = ways_arguments(__doc__.splitlines()[0])
    ways_table(args, "grouped_conv_ways", SHAPES, measure, page)


if __name__ == "__main__":
    main()
