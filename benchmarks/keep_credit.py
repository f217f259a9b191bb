"""A ruled parameter's keep charge, net of its factors or in full: the DP step of the model families whose weights the
operation rules take (GPT-2's ``Conv1D``, ``nn.TransformerEncoder``'s attention projections), both ways and the
non-private step, interleaved in one process.

Since bbc6271 a ruled use that keeps its materialised per-example gradients is charged to the pass's keep budget net
of its factors (:func:`dpml.train.rules.combine.letting_go`), which the engine then lets go; before, in full. The
other way is the same engine with ``letting_go`` returning 0, so both run the same code but for that charge, one step
after the other (the median of each over the rounds)::

    python benchmarks/keep_credit.py [--families gpt2 encoder] [--rounds 16] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import families  # noqa: E402  (benchmarks/ is the script's folder; it puts the project's root on the path)
from bench_common import cpu_name, current_commit  # noqa: E402

from dpml.devices import keep_freed_cpu_memory  # noqa: E402
from dpml.train.rules import combine  # noqa: E402


def measure(family: str, args: argparse.Namespace) -> dict[str, float]:
    """Median ms of the non-private step and of the DP step with either charge, interleaved over the rounds."""
    shape = argparse.Namespace(size=args.size, length=args.length, dpml_chunk="whole", device="cpu")
    x, y = families.example_batch(family, args.batch, args.length, "cpu")
    steps = {
        "nonprivate": families.step_function(family, "nonprivate", shape, x, y),
        "net": families.step_function(family, "dpml", shape, x, y),
    }
    net, in_full = combine.letting_go, lambda form: 0
    charges = {"net": net, "in full": in_full}
    times: dict[str, list[float]] = {"nonprivate": [], "net": [], "in full": []}
    try:
        for round_ in range(args.rounds + 2):  # (two rounds of warm-up)
            for name in times:
                combine.letting_go = charges.get(name, net)  # type: ignore[assignment]
                step = steps["net" if name == "in full" else name]
                if getattr(step, "settle", None):  # (the next step's noise drawn, as families.py waits for it)
                    step.settle()  # type: ignore[attr-defined]
                start = time.perf_counter()
                step()
                if round_ >= 2:
                    times[name].append(time.perf_counter() - start)
    finally:
        combine.letting_go = net
        steps["net"].close()  # type: ignore[attr-defined]
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["gpt2", "encoder"])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(families.ROOT / "benchmarks" / "results" / "ruled_keeping_cpu"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_cpu_memory()  # (as the trainer does)
    rows = []
    for family in args.families:
        found = measure(family, args)
        base, net, full = found["nonprivate"], found["net"], found["in full"]
        rows.append(f"| {family} | {base:.1f} | {net:.1f} | **{base / net:.2f}** | {full:.1f} | {base / full:.2f} |")
        print(rows[-1], flush=True)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join(
        [
            "# A ruled use's keep charge: net of its factors, or in full",
            "",
            f"Command: `python benchmarks/keep_credit.py --families {' '.join(args.families)} --rounds {args.rounds}`. "
            f"Commit {current_commit()}, {when}. Machine: {cpu_name()}, {args.threads} torch threads; torch "
            f"{torch.__version__}. Size `{args.size}`, batch {args.batch}, {args.length} tokens; the three steps "
            f"interleaved in one process, {args.rounds} rounds, medians. Throughput = non-private ms / DP ms.",
            "",
            "| family | non-private ms | DP ms, charged net | throughput | DP ms, charged in full | throughput |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "keep_credit.md").write_text(text)


if __name__ == "__main__":
    main()
