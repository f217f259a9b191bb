"""Per-example weight gradients of a convolution, ∇_W ℓ_i = Σ_t δ_t a_tᵀ, by each of the engine's ways.

    python benchmarks/conv_per_example.py [--device cpu|cuda] [--threads 2] [--repeats 5]

For each layer shape (the Opacus example CNN's two convolutions, WRN-16-4's, and a sweep of input
channel counts), on random inputs and output gradients of the layer's shape:

- *grouped forward*: one convolution with the input's channels as its batch, the examples as groups
  and each example's δ as a kernel (:func:`dpml.train.clipping_conv_ways.per_example_by_grouped_forward`);
- *grouped weight gradient*: the weight gradient of one convolution with B groups, the examples
  folded into the channels (:func:`dpml.train.clipping_conv_ways.per_example_by_weight_gradient`);
- *patches × δ*: the unfolded patches and one batched matrix product (``unfold_patches`` and ``bmm``);
- *compiled, patches* (CPU, float32): ``_conv_norms.c``, each example's patches built in a cache-sized buffer
  and multiplied there, on torch's OpenMP threads (:func:`dpml.train.clipping_conv.compiled_norms`, gradients
  kept; "n/a" where no C compiler is found), timed at every T although the engine takes it only up to
  ``COMPILED_MAX_POSITIONS`` (this table is where that limit comes from);
- *compiled, direct* (where C_in is a multiple of 16, the engine's choice there at any T): the same kernel
  reading each patch's vectors from a channels-last copy of the example (no patch buffer);
- for scale, the batched weight gradient of the whole batch (what a non-private step computes; not
  per example).

Median milliseconds over the repeats (the ways run in turn, round after round, after one warm-up; TF32
off, as in the engine), and the largest difference of every other per-example way from the first relative to its
largest entry. Which way the engine takes for which shape (``dpml.train.clipping_conv_ways.per_example_conv_way``)
follows this table.
Writes ``benchmarks/results/conv_per_example[_cuda].{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_common import median_ms_in_turn, ways_arguments, ways_command, ways_table  # noqa: E402

from dpml.train import clipping_conv  # noqa: E402
from dpml.train.clipping_conv import (  # noqa: E402
    compiled_norms,
    conv_geometry,
    unfold_patches,
)
from dpml.train.clipping_conv_ways import per_example_by_grouped_forward, per_example_by_weight_gradient  # noqa: E402

# name, batch, C_in, C_out, kernel, stride, padding, input height = width
SHAPES = [
    ("CNN conv1 (Opacus example)", 512, 1, 16, 8, 2, 3, 28),
    ("CNN conv2 (Opacus example)", 512, 16, 32, 4, 2, 0, 13),
    ("RGB 3×3", 256, 3, 16, 3, 1, 1, 32),
    ("C_in 4", 256, 4, 16, 3, 1, 1, 28),
    ("C_in 6", 256, 6, 16, 3, 1, 1, 28),
    ("C_in 8", 256, 8, 32, 3, 1, 1, 28),
    ("C_in 12", 256, 12, 24, 3, 1, 1, 28),
    ("C_in 24", 256, 24, 40, 3, 1, 1, 28),
    ("WRN stem block 16→64", 256, 16, 64, 3, 1, 1, 28),
    ("WRN 64→64 at 28×28", 256, 64, 64, 3, 1, 1, 28),
    ("WRN 64→128, stride 2", 256, 64, 128, 3, 2, 1, 28),
    ("WRN 128→128 at 14×14", 256, 128, 128, 3, 1, 1, 14),
    ("WRN 256→256 at 7×7", 256, 256, 256, 3, 1, 1, 7),
]


def ways(module: nn.Conv2d, x: torch.Tensor, d: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    def patches_times_delta() -> torch.Tensor:
        a = unfold_patches(x, *conv_geometry(module))  # type: ignore[misc]
        return torch.bmm(d.reshape(d.shape[0], d.shape[1], -1), a.transpose(1, 2))

    geometry = conv_geometry(module)
    _, stride, padding, dilation = geometry  # type: ignore[misc]
    found = {
        "grouped forward": lambda: per_example_by_grouped_forward(x, d, geometry),  # type: ignore[arg-type]
        "grouped weight gradient": lambda: per_example_by_weight_gradient(x, d, geometry),  # type: ignore[arg-type]
        "patches × δ": patches_times_delta,
        "batch weight gradient (non-private)": lambda: torch.nn.grad.conv2d_weight(
            x, module.weight.shape, d, stride, padding, dilation
        ),
    }
    if compiled_norms(x[:1], d[:1], geometry, keep=True) is not None:  # type: ignore[arg-type]
        found["compiled, patches"] = compiled_way(x, d, geometry, direct=False)  # type: ignore[arg-type]
        if clipping_conv.direct_way(x.shape[1]):
            found["compiled, direct"] = compiled_way(x, d, geometry, direct=True)  # type: ignore[arg-type]
    return found


def compiled_way(
    x: torch.Tensor, d: torch.Tensor, geometry: clipping_conv.Geometry, direct: bool
) -> Callable[[], list[torch.Tensor]]:
    """The compiled kernel's kept per-example gradients by its patch way or its direct way (whichever the
    engine would pick for this C_in: :func:`dpml.train.clipping_conv.direct_way`)."""

    def run() -> list[torch.Tensor]:
        engine_choice = clipping_conv.direct_way
        clipping_conv.direct_way = lambda in_channels: direct
        try:
            return compiled_norms(x, d, geometry, keep=True)[1]  # type: ignore[index, return-value]
        finally:
            clipping_conv.direct_way = engine_choice

    return run


def _joined(found: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """A way's per-example gradients as one tensor (the compiled kernel's come in slices of examples)."""
    return torch.cat(found) if isinstance(found, list) else found


def measure(shape: tuple, device: str, repeats: int) -> dict:
    name, batch, c_in, c_out, kernel, stride, padding, size = shape
    torch.manual_seed(0)
    module = nn.Conv2d(c_in, c_out, kernel, stride, padding).to(device)
    x = torch.randn(batch, c_in, size, size, device=device)
    d = torch.randn_like(module(x))
    functions = ways(module, x, d)
    results = {way: _joined(fn()) for way, fn in functions.items()}  # warm-up, and the results compared
    if "compiled, direct" in results:  # its columns in (u, v, c) order: to the weight's (c, u, v)
        results["compiled, direct"] = (
            results["compiled, direct"]
            .reshape(batch, c_out, kernel, kernel, c_in)
            .permute(0, 1, 4, 2, 3)
            .reshape(batch, c_out, -1)
        )
    first = results["grouped forward"]
    scale = float(first.abs().max())
    ms = median_ms_in_turn(functions, device, repeats)
    return {
        "shape": name,
        "batch": batch,
        "c_in": c_in,
        "c_out": c_out,
        "kernel": kernel,
        "stride": stride,
        "positions": int(d[0, 0].numel()),
        "device": device,
        "ms": ms,
        "relative_difference": {
            way: float((results[way].reshape(first.shape) - first).abs().max()) / scale
            for way in results
            if way not in ("grouped forward", "batch weight gradient (non-private)")
        },
    }


def page(rows: list[dict], args: argparse.Namespace) -> str:
    where = (
        f"GPU {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
        if args.device == "cuda"
        else f"CPU, {torch.get_num_threads()} torch threads"
    )
    command = ways_command("conv_per_example.py", args)
    lines = [
        "# Per-example weight gradients of a convolution: the engine's ways",
        "",
        f"Command: `{command}`. Machine: {platform.machine()}, {os.cpu_count()} logical CPUs, {where}, torch "
        f"{torch.__version__}, Python {platform.python_version()}. Median ms of {args.repeats} rounds (the ways "
        "in turn); T = output positions per example; the differences are relative to the largest entry"
        + ("; freed memory kept for the next call, as the trainer keeps it" if args.device == "cpu" else "")
        + "; the compiled kernel's patch way timed at every T (the engine takes it up to T = 256), its direct "
        "way (any T) where C_in is a multiple of 16 (n/a elsewhere: the engine takes it there).",
        "",
        "| layer | B | C_in → C_out | k, stride | T | grouped forward | grouped weight gradient | patches × δ | "
        "compiled, patches | compiled, direct | batch weight gradient (non-private) | fastest per-example way | "
        "differences |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r["ms"]
        fastest = min((way for way in ms if way != "batch weight gradient (non-private)"), key=lambda way: ms[way])
        compiled = f"{ms['compiled, patches']:.1f}" if "compiled, patches" in ms else "n/a"
        direct = f"{ms['compiled, direct']:.1f}" if "compiled, direct" in ms else "n/a"
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['c_in']} → {r['c_out']} | {r['kernel']}, {r['stride']} | "
            f"{r['positions']} | {ms['grouped forward']:.1f} | {ms['grouped weight gradient']:.1f} | "
            f"{ms['patches × δ']:.1f} | {compiled} | {direct} | {ms['batch weight gradient (non-private)']:.1f} | "
            f"{fastest} | "
            f"{max(r['relative_difference'].values()):.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    args = ways_arguments(__doc__.splitlines()[0])
    clipping_conv.COMPILED_MAX_POSITIONS = 1 << 30  # every layer timed (module docstring)
    torch.backends.cudnn.benchmark = False
    ways_table(args, "conv_per_example", SHAPES, measure, page)


if __name__ == "__main__":
    main()
