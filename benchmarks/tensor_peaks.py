"""Peak tensor memory of one DP step against one non-private step, and what the DP step holds at its peak.

The resident set size (``families.py``'s memory column) moves by about ±10 % between runs on a CPU and says nothing
of who holds what. This script counts tensors instead: under a ``TorchDispatchMode`` every storage an operation
makes during the step is counted from its making until it is freed (a weak finaliser on the storage), so the peak is
the most bytes of tensors alive at once during the step, the same every run; storages alive before the step (the
parameters, the batch, the optimiser's state) are not counted. At the DP step's peak the live storages are grouped
by the operation that made them and the innermost engine (or model) functions on the stack then, the largest
groups listed. A GPU's allocator peak (``torch.cuda.max_memory_allocated``) counts the same storages plus the
allocator's rounding.

    python benchmarks/tensor_peaks.py [--families bit-gn nf-resnet26 ...] [--size tiny] [--batch 64] [--top 6]
        [--out benchmarks/results/tensor_peaks_cpu] [--stem peaks]

Each family is the model, batch and steps of ``benchmarks/families.py`` (dpml in one chunk of the whole batch),
each step run twice untimed before the counted one. Run from a worktree of another commit to measure that commit's
engine (the script puts its own repository's root first on the path, as ``families.py`` does).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import traceback
import weakref
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import families  # noqa: E402  (benchmarks/ is the script's folder; it puts the project's root on the path)
from bench_common import cpu_name, current_commit  # noqa: E402

MIB = 2**20
PLACES = ("/dpml/", "/transformers/", "/timm/", "/torchvision/", "/torch/nn/")  # the frames a holder is named by


class LiveTensors(TorchDispatchMode):
    """The bytes of the storages made under the mode and still alive, their peak, and who was alive at the peak."""

    def __init__(self, before: list[torch.Tensor]) -> None:
        super().__init__()
        self.known: dict[int, int | None] = {}  # id(storage) -> its entry (None: alive before the step)
        self.before = before  # (held through the step: a storage freed then would leave its id to a new one)
        for t in before:
            self.known[id(t.untyped_storage())] = None
        self.alive: dict[int, tuple[int, str]] = {}  # entry -> (bytes, what made it)
        self.now = self.peak = self.made = 0
        self.at_peak: list[tuple[int, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        label = None
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(o, torch.Tensor) or o.is_meta:
                continue
            storage = o.untyped_storage()
            if id(storage) in self.known or storage.nbytes() == 0:
                continue
            label = label or _made_by(func)
            self.made += 1
            self.known[id(storage)], self.alive[self.made] = self.made, (storage.nbytes(), label)
            self.now += storage.nbytes()
            weakref.finalize(storage, self._freed, self.made, id(storage))
            if self.now > self.peak:
                self.peak, self.at_peak = self.now, list(self.alive.values())
        return out

    def _freed(self, entry: int, key: int) -> None:
        self.now -= self.alive.pop(entry)[0]
        if self.known.get(key) == entry:
            del self.known[key]


def _made_by(func: Any) -> str:
    """The operation and the three innermost frames of the engine or the model's library that called it."""
    frames = [
        f"{Path(frame.filename).stem}.{frame.name}"
        for frame in reversed(traceback.extract_stack(limit=48))
        if any(place in frame.filename for place in PLACES) and "_python_dispatch" not in frame.filename
    ]
    return f"{func.__name__} ← " + " ← ".join(frames[:3])


def counted(step: Callable[[], Any]) -> LiveTensors:
    """One ``step`` under the count (storages alive before it not counted)."""
    gc.collect()
    before = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not o.is_meta]
    mode = LiveTensors(before)
    del before
    with mode:
        step()
    mode.before = []
    return mode


def holders(mode: LiveTensors, top: int) -> list[tuple[float, int, str]]:
    """The ``top`` largest groups alive at the peak: (MiB, storages, what made them)."""
    size: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for nbytes, label in mode.at_peak:
        size[label] += nbytes
        count[label] += 1
    return [(round(b / MIB, 1), count[label], label) for label, b in size.most_common(top)]


def measure(family: str, args: argparse.Namespace) -> dict[str, Any]:
    shape = argparse.Namespace(size=args.size, length=args.length, dpml_chunk="whole", device="cpu")
    x, y = families.example_batch(family, args.batch, args.length, "cpu")
    steps = {method: families.step_function(family, method, shape, x, y) for method in ("nonprivate", "dpml")}
    for _ in range(2):
        for step in steps.values():
            step()
    modes = {method: counted(step) for method, step in steps.items()}
    nonprivate, private = modes["nonprivate"].peak, modes["dpml"].peak
    return {
        "family": family,
        "nonprivate_mib": round(nonprivate / MIB, 1),
        "dpml_mib": round(private / MIB, 1),
        "ratio": round(private / nonprivate, 3),
        "holders": holders(modes["dpml"], args.top),
    }


def page(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "python benchmarks/tensor_peaks.py " + " ".join(sys.argv[1:])
    lines = [
        f"# Peak tensor memory, DP step against non-private{(' — ' + args.label) if args.label else ''}",
        "",
        f"Command: `{command}`. Commit {current_commit()}, {when}. Machine: {cpu_name()}, "
        f"{os.cpu_count()} logical CPUs; torch {torch.__version__}.",
        "",
        f"Size `{args.size}`, batch {args.batch} (token families: {args.length} tokens). The peak: the most bytes of "
        "tensors made during one step and alive at once (storages alive before the step not counted; the same every "
        "run). Holders: the largest groups alive at the DP step's peak, by the operation that made them and the "
        "innermost engine or model frames.",
        "",
        "| family | non-private peak MiB | DP peak MiB | DP / non-private |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['family']} | {r['nonprivate_mib']} | {r['dpml_mib']} | **{r['ratio']:.2f}** |" for r in rows]
    lines += ["", "At the DP step's peak:", ""]
    for r in rows:
        held = "; ".join(f"{mib} MiB in {n}: `{what}`" for mib, n, what in r["holders"])
        lines.append(f"- **{r['family']}**: {held}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["bit-gn", "nf-resnet26", "resnext50-gn", "resnet18-gn"])
    parser.add_argument("--size", choices=list(families.SIZES), default="tiny")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=str(families.ROOT / "benchmarks" / "results" / "tensor_peaks_cpu"))
    parser.add_argument("--stem", default="peaks")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for family in args.families:
        rows.append(measure(family, args))
        print(f"{family}: {rows[-1]['nonprivate_mib']} → {rows[-1]['dpml_mib']} MiB ({rows[-1]['ratio']:.2f})")
        gc.collect()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.json").write_text(json.dumps({"commit": current_commit(), "rows": rows}, indent=1) + "\n")
    (out / f"{args.stem}.md").write_text(page(rows, args))


if __name__ == "__main__":
    main()
