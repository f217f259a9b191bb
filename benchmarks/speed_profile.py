"""Where a dpml DP-SGD step spends its time, next to the non-private step (same model, batch, process).

    python benchmarks/speed_profile.py [--batch 512] [--models mlp cnn] [--threads N] [--device cpu|cuda]
                                       [--ops N] [--out benchmarks/results]

Times (the parts run in turn, round after round; medians after warm-up) of: the non-private step (forward, mean
loss, backward, SGD update); dpml's whole DP step; and its parts — the forward pass with the layer
hooks and the backward pass to the layer outputs, the per-example norms and clipped sums (the rest
of ``clipped_gradient_sum``), and the Gaussian noise for every parameter (one flat draw, as the
trainer's :func:`gaussian_noise`; the trainer on the CPU draws it into buffers allocated once, a step
ahead in a background thread where a core is idle, else in the step; the "DP step" here draws it in
line, into fresh buffers): in compiled code (``_boxmuller.c``, compiled on first use) and in NumPy (the
fallback where there is no C compiler, the same numbers), the same draw into fresh buffers, next to torch's own
float32 and float64 ``normal_`` over as many numbers (not used: the float32 one cuts the tails at
5.77σ, :mod:`dpml.train.noise`). Same models as ``speed.py``.

``--device cuda`` times the same parts on the GPU (each part ends with ``torch.cuda.synchronize()``; the
noise is the trainer's GPU draw, ``gaussian_noise`` on a CUDA generator; the CPU-only draws are left
out) and writes ``speed_profile_cuda.md``. ``--models`` also takes the model families of ``families.py`` (``bert``,
``gpt2``, ``encoder``, ``bert-lora``, ``vit``, ``resnet18-gn``; ``--size`` and ``--length`` as there; only their
trainable parameters are stepped), and ``--out-name`` names the page. ``--ops N`` adds, per model, the N
operators that took the most time in 5 DP steps (``torch.profiler``: self time on the device where it is a
GPU, else on the CPU).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import families  # noqa: E402
import speed  # noqa: E402
from dpml.devices import keep_freed_cpu_memory  # noqa: E402
from dpml.train.clipping import _record_forward, clipped_gradient_sum  # noqa: E402
from dpml.train.clipping_layers import is_fast  # noqa: E402
from dpml.train.dpsgd import clipped_sum_and_noise, per_example_cross_entropy  # noqa: E402
from dpml.train.noise import BoxMullerBuffers, SynchronousNoise, gaussian_noise  # noqa: E402
from dpml.train.kernels import compiled_draw  # noqa: E402


def _synchronise(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved_medians_ms(parts: dict[str, Callable[[], None]], repeats: int, device: str = "cpu") -> dict[str, float]:
    """Median time of each part, the parts run in turn, round after round (after 3 warm-up rounds), so
    that the load of a shared machine falls on all of them alike."""
    for _ in range(3):
        for fn in parts.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(repeats):
        for name, fn in parts.items():
            _synchronise(device)
            start = time.perf_counter()
            fn()
            _synchronise(device)
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


SHAPES = {"size": "tiny", "length": 128}  # a family's size and sequence length (``--size``, ``--length``)


def model_and_batch(name: str, batch: int, device: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """``speed.py``'s model (``mlp``, ``cnn``, ``wrn``) or a family of ``families.py``, seed 0, and its batch."""
    torch.manual_seed(0)
    if name in families.FAMILIES:
        model, _ = families.build(name, SHAPES["size"], SHAPES["length"])
        x, y = families.example_batch(name, batch, SHAPES["length"], device)
    else:
        model, (x, y) = speed.build(name), speed.example_batch(name, batch, device)
    return model.to(device).train(), x, y


def dp_step_function(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator
) -> Callable[[], None]:
    """dpml's DP step on the batch (x, y), clipped in one chunk, its noise drawn in line (SGD, C = σ = 1)."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer, batch = torch.optim.SGD(trainable.values(), lr=0.01), x.shape[0]

    def dp_step() -> None:
        sums, noises, _ = clipped_sum_and_noise(model, x, y, 1.0, 1.0, batch, generator)
        for name, p in trainable.items():
            p.grad = sums[name].add_(noises[name]).div_(batch)
        optimizer.step()

    return dp_step


def profile(model_name: str, batch: int, repeats: int, device: str = "cpu") -> list[tuple[str, float]]:
    model, x, y = model_and_batch(model_name, batch, device)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    generator = torch.Generator(device=device).manual_seed(0)
    params = [p for p in model.parameters() if p.requires_grad]

    def nonprivate() -> None:
        optimizer.zero_grad(set_to_none=True)
        per_example_cross_entropy(model(x), y).mean().backward()
        optimizer.step()

    dp_step = dp_step_function(model, x, y, generator)
    fast = [m for m in model.modules() if is_fast(m) and any(p.requires_grad for p in m.parameters(recurse=False))]

    def forward_backward_to_outputs() -> None:
        recording = _record_forward(model, per_example_cross_entropy, x, y, fast, [], frozenset())
        outputs = [recording.gradient_target(output) for m in fast for _, output in recording.calls.get(m, ())]
        torch.autograd.grad(recording.losses.sum(), outputs, allow_unused=True)

    def clipping() -> None:
        clipped_gradient_sum(model, per_example_cross_entropy, x, y, 1.0)

    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = sum(p.numel() for p in params)
    parts = {
        "non-private step": nonprivate,
        "dpml DP step": dp_step,
        "  forward + backward to layer outputs": forward_backward_to_outputs,
        "  clipped_gradient_sum (all of the above + norms + clipped sums)": clipping,
    }
    if device == "cuda":
        parts[f"  Gaussian noise as the trainer draws it on the GPU ({total:,} parameters)"] = lambda: gaussian_noise(
            named, 1.0, generator
        )
        return list(interleaved_medians_ms(parts, repeats, device).items())
    compiled, in_numpy = BoxMullerBuffers(total, torch.float32), BoxMullerBuffers(total, torch.float32, compiled=False)
    if compiled_draw() is None:
        raise SystemExit("dpml/train/_boxmuller.c did not compile here (no C compiler?): the profile times both draws")

    def noise_in_fresh_buffers() -> None:
        gaussian_noise(named, 1.0, generator)

    float32_buffer, float64_buffer = torch.empty(total), torch.empty(total, dtype=torch.float64)
    in_the_step = SynchronousNoise(generator, named, 1.0)
    threads = torch.get_num_threads()
    parts |= {
        f"  Gaussian noise as the trainer draws it in the step where no core is idle (`SynchronousNoise`): dpml's "
        f"Box–Muller with a 53-bit radius, compiled, on {threads} thread(s), into buffers allocated once "
        f"({total:,} parameters; with an idle core it is drawn a step ahead, beside the step)": lambda: (
            in_the_step.draw(1.0)
        ),
        "  the same draw on one thread": lambda: compiled.draw(1.0, generator),
        "  the same draw in NumPy (the fallback where no C compiler is found)": lambda: in_numpy.draw(1.0, generator),
        "  the compiled draw into fresh buffers (`gaussian_noise`: new pages every draw)": noise_in_fresh_buffers,
        "  (not used) torch's float32 normal_, tails cut at 5.77σ": lambda: float32_buffer.normal_(generator=generator),
        "  (not used) torch's float64 normal_": lambda: float64_buffer.normal_(generator=generator),
    }
    return list(interleaved_medians_ms(parts, repeats).items())


def top_operators(model_name: str, batch: int, device: str, count: int) -> str:
    """``torch.profiler``'s table of the ``count`` operators with the most self time over 5 DP steps (after 3
    untimed ones), on the device where it is a GPU, else on the CPU."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model, x, y = model_and_batch(model_name, batch, device)
    dp_step = dp_step_function(model, x, y, torch.Generator(device=device).manual_seed(0))
    for _ in range(3):
        dp_step()
    _synchronise(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities) as trace:
        for _ in range(5):
            dp_step()
        _synchronise(device)
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return trace.key_averages().table(sort_by=key, row_limit=count, max_name_column_width=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=[*speed.MODELS, *families.FAMILIES])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ops", type=int, default=0, help="also the N operators with the most self time in a DP step")
    parser.add_argument("--size", choices=list(families.SIZES), default="tiny", help="a family's size")
    parser.add_argument("--length", type=int, default=128, help="a token family's sequence length")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--out-name", default=None, help="the page's file name (default speed_profile[_cuda].md)")
    args = parser.parse_args()
    SHAPES.update(size=args.size, length=args.length)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads = {args.threads}: must be a positive integer")
        torch.set_num_threads(args.threads)
    keep_freed_cpu_memory()  # as dpml's trainer on the CPU, for the non-private step too
    lines = [
        "# Where the DP-SGD step's time goes",
        "",
        f"Command: `python benchmarks/speed_profile.py --batch {args.batch} --models {' '.join(args.models)}"
        + (f" --size {args.size} --length {args.length}" if set(args.models) & set(families.FAMILIES) else "")
        + (f" --threads {args.threads}" if args.threads is not None else "")
        + (" --device cuda" if args.device == "cuda" else "")
        + (f" --ops {args.ops}" if args.ops else "")
        + f"`. Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
        + (f", GPU: {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}" if args.device == "cuda" else "")
        + "; one process, the parts run in turn, median of "
        f"{args.repeats} rounds after 3 warm-up ones; freed memory kept for the next step, as the trainer "
        "keeps it (`dpml.devices.keep_freed_cpu_memory`).",
        "",
        "| model | part | ms | × non-private step |",
        "|---|---|---|---|",
    ]
    operators = []
    for model_name in args.models:
        rows = profile(model_name, args.batch, args.repeats, args.device)
        base = rows[0][1]
        lines += [f"| {model_name} | {name} | {ms:.2f} | {ms / base:.2f} |" for name, ms in rows]
        if args.ops:
            operators += [
                "",
                f"## {model_name}: the {args.ops} operators with the most self time in 5 DP steps",
                "",
                "```",
                top_operators(model_name, args.batch, args.device, args.ops),
                "```",
            ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.out_name or ("speed_profile_cuda.md" if args.device == "cuda" else "speed_profile.md")
    lines += operators
    (out / name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
