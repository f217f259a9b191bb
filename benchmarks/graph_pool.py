"""Where a captured model's CUDA graph memory goes: a diagnosis for the next lent GPU session (CUDA only).

On an H200 (``results/families_cuda.md``, ``results/speed_cuda.md``) dpml's step replayed from CUDA graphs peaked at
2.7 times its eager step for ViT and 3.2 times for ResNet-18-GN (4.07 and 3.96 times non-private), and the CNN's at
1.40 times non-private against 1.02 eager. Their graphs, one per bucket from 8 rows up, were all captured at the
first chunk into one pool. Since then the engine (``dpml/train/captured.py``) captures a bucket's graph when a chunk
of its size first comes. This measures, per model and batch, in one process:

- the eager masked pass's peak on the largest bucket's rows (``torch.cuda.max_memory_allocated`` above what was
  allocated before it);
- the pool (its segments' total size, their count and the largest) after capturing the largest bucket's graph alone,
  then after 2, 4, 8, ... graphs and after all of them, largest first (as the engine did until the change): does the
  first graph alone cost more than its eager pass (capture-time allocation), or does the pool grow graph by graph
  (blocks of one graph's sizes that another's cannot reuse)?
- the pool of the graphs a run of 100 Poisson batches of mean ``--batch`` meets, captured in the order met (as the
  engine captures them now; the pool a training run holds).

Nothing here is timed.

    python benchmarks/graph_pool.py --device cuda --models cnn mlp resnet18-gn vit --batch 256
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import speed_profile  # noqa: E402
from dpml.train import captured  # noqa: E402
from dpml.train.dpsgd import per_example_cross_entropy  # noqa: E402
from dpml.train.steps import poisson_batches  # noqa: E402

MIB = 2**20


def pool_words(pool: tuple[int, int]) -> tuple[float, int, float]:
    """(total MiB, segments, largest segment MiB) of a graph pool."""
    sizes = captured._pool_segments(pool)
    return sum(sizes) / MIB, len(sizes), max(sizes, default=0) / MIB


def eager_peak_mib(run: captured._Pass, inputs: tuple[torch.Tensor, ...]) -> float:
    """The masked pass's peak above what was allocated before it, on these rows."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    sums, norms = run(*inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del sums, norms
    return peak / MIB


def poisson_buckets(batch: int, largest: int, steps: int = 100) -> list[int]:
    """The buckets ``steps`` Poisson samples of expected size ``batch`` meet (the trainer's sampler,
    :func:`dpml.train.steps.poisson_batches`, over 60,000 records), in the order met (a batch above ``largest``
    runs eagerly: no graph)."""
    records = 60_000
    met: list[int] = []
    for sample in poisson_batches(records, batch / records, steps, seed=0):
        rows = captured.bucket(max(1, sample.numel()))
        if rows <= largest and rows not in met:
            met.append(rows)
    return met


def pool_rows(name: str, batch: int, what: str, pool: tuple[int, int]) -> str:
    total, segments, biggest = pool_words(pool)
    return f"| {name} | {batch} | {what} | | {total:.0f} | {segments} | {biggest:.0f} |"


def measure(name: str, batch: int) -> Iterator[str]:
    """The table's rows for one model, each as it is measured: its eager peak, the pool as graphs are added largest
    first, and the pool of the buckets a Poisson run meets."""
    model, x, y = speed_profile.model_and_batch(name, batch, "cuda")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    run = captured._Pass(model, per_example_cross_entropy, 1.0, (), names)
    largest = captured.largest_bucket(batch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graphs = []
    with torch.cuda.stream(side):
        buffers = captured.warmed_buffers(run, x, y, largest)
        eager = eager_peak_mib(run, (buffers.x, buffers.y, buffers.mask))
        yield f"| {name} | {batch} | eager pass, {largest} rows | {eager:.0f} | | | |"
        every = list(reversed(captured.buckets_up_to(largest)))
        pool = torch.cuda.graph_pool_handle()
        for count, rows in enumerate(every, start=1):
            graphs.append(captured.capture_graph(run, buffers, pool, rows))
            if count in {1, 2, 4, 8, 16, 32, len(every)}:
                yield pool_rows(name, batch, f"{count} graph(s), largest first, down to {rows} rows", pool)
        graphs.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        met = poisson_buckets(batch, largest)
        pool = torch.cuda.graph_pool_handle()
        graphs = [captured.capture_graph(run, buffers, pool, rows) for rows in met]
        what = f"{len(met)} graph(s) met by 100 Poisson batches ({min(met)} to {max(met)} rows), in that order"
        yield pool_rows(name, batch, what, pool)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    del graphs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp", "resnet18-gn", "vit"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--size", default="base", help="a family's size (families.py)")
    parser.add_argument("--device", choices=["cuda"], default="cuda")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here (CUDA graphs exist only there)")
    speed_profile.SHAPES["size"] = args.size
    lines = [
        "# Where a captured model's CUDA graph memory goes",
        "",
        f"`python benchmarks/graph_pool.py --device cuda --models {' '.join(args.models)} --batch {args.batch} "
        f"--size {args.size}`; {torch.cuda.get_device_name(0)}, torch {torch.__version__}, Python "
        f"{platform.python_version()}. MiB; the pool after each count of graphs captured largest first, then a "
        "fresh pool holding the graphs a Poisson run meets.",
        "",
        "| model | batch | what | eager peak | pool | segments | largest segment |",
        "|---|---|---|---|---|---|---|",
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        try:
            for row in measure(name, args.batch):  # (the page rewritten at each row: a step cut short keeps its rows)
                lines.append(row)
                print(row, flush=True)
                (out / "graph_pool_cuda.md").write_text("\n".join(lines) + "\n")
        except Exception as error:  # noqa: BLE001 — one model's failure is a row, not the end of the table
            lines.append(
                f"| {name} | {args.batch} | fails: {type(error).__name__}: {str(error).splitlines()[0][:150]} |"
            )
            print(lines[-1], flush=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    (out / "graph_pool_cuda.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
