"""One of the engine's choices on and off, on the same engine: the DP step both ways and the non-private step,
interleaved in one process, the two DP steps in turn first (the median of each over the rounds), for the model
families it concerns. A switch is an attribute of one of the engine's modules and what stands for it when the choice
is off:

- ``keep-credit``: since bbc6271 a ruled use (GPT-2's ``Conv1D``, ``nn.TransformerEncoder``'s attention projections)
  that keeps its materialised per-example gradients is charged to the pass's keep budget net of its factors
  (``letting_go``), which the engine then lets go; off, in full (``letting_go`` returning 0), as before;
- ``silent-positions``: since 948747f a ruled product's norms and clipped sum run on a CPU over the positions where
  neither factor is zero for every example only (``without_silent_positions``: GPT-2's last block, read at one
  token); off, over every position (the factors returned as they are), as before;
- ``reached-rows``: a linear call on parameters alone (DeBERTa-v3's relative table through each layer's query and key
  projections) has each example's gradient of its output formed on a CPU on the rows its uses' factors reach only
  (``gradients_on_reached_rows``: the heads' products on the 2T − 1 relative positions their gathers read); off, formed
  on every row and the rows zero for every example found on it (``_reached`` returning None), as before;
- ``trusted-layers``: since 12bda05 the hooked layers whose shortcut a model's last pass took have their own calls
  recorded without rules (``dpml.train.clipping._TRUSTED_LAYERS``, :mod:`dpml.train.rules.recorder`); off, every
  call handed to its rule (a table that remembers no layer), as before.

    python benchmarks/engine_switches.py --switch keep-credit [--families gpt2 encoder] [--rounds 30] [--out DIR]
                                         [--batch 64] [--threads 2] [--stem NAME (the page's name: the switch's)]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import families  # noqa: E402  (benchmarks/ is the script's folder; it puts the project's root on the path)
from bench_common import cpu_name, current_commit  # noqa: E402

from dpml.devices import keep_freed_cpu_memory  # noqa: E402
from dpml.train import clipping  # noqa: E402
from dpml.train.rules import combine, linear_on_parameters  # noqa: E402


class _Forgetful(dict):  # type: ignore[type-arg]
    """A table that remembers nothing (``trusted-layers`` off: no layer is ever trusted)."""

    def __setitem__(self, key: object, value: object) -> None:
        pass


SWITCHES: dict[str, tuple[Any, str, Any, str, str]] = {  # module, attribute, its stand-in when off, on, off
    "keep-credit": (combine, "letting_go", lambda form: 0, "charged net", "charged in full"),
    "silent-positions": (
        combine,
        "without_silent_positions",
        lambda u, v: (u, v),
        "silent positions left out",
        "all positions",
    ),
    "reached-rows": (
        linear_on_parameters,
        "_reached",
        lambda uses, output, batch: None,
        "formed on the reached rows",
        "formed on every row",
    ),
    "trusted-layers": (clipping, "_TRUSTED_LAYERS", _Forgetful(), "trusted layers' calls unruled", "every call ruled"),
}


def measure(family: str, switch: str, args: argparse.Namespace) -> dict[str, float]:
    """Median ms of the non-private step and of the DP step with the switch on and off, interleaved over the rounds."""
    module, name, stand_in, _, _ = SWITCHES[switch]
    shape = argparse.Namespace(size=args.size, length=args.length, dpml_chunk="whole", device="cpu")
    x, y = families.example_batch(family, args.batch, args.length, "cpu")
    nonprivate = families.step_function(family, "nonprivate", shape, x, y)
    private = families.step_function(family, "dpml", shape, x, y)
    chosen = {"on": getattr(module, name), "off": stand_in}
    times: dict[str, list[float]] = {"nonprivate": [], "on": [], "off": []}
    try:
        for round_ in range(args.rounds + 2):  # (two rounds of warm-up)
            order = ["nonprivate", "on", "off"] if round_ % 2 else ["nonprivate", "off", "on"]  # (no side first)
            for which in order:
                setattr(module, name, chosen.get(which, chosen["on"]))
                step = nonprivate if which == "nonprivate" else private
                if getattr(step, "settle", None):  # (the next step's noise drawn, as families.py waits for it)
                    step.settle()  # type: ignore[attr-defined]
                start = time.perf_counter()
                step()
                if round_ >= 2:
                    times[which].append(time.perf_counter() - start)
    finally:
        setattr(module, name, chosen["on"])
        private.close()  # type: ignore[attr-defined]
    return {which: 1e3 * statistics.median(values) for which, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--switch", choices=list(SWITCHES), required=True)
    parser.add_argument("--families", nargs="+", default=["gpt2", "encoder"])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(families.ROOT / "benchmarks" / "results" / "engine_switches_cpu"))
    parser.add_argument("--stem", default=None, help="the page's file name without .md (default: the switch's name)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_cpu_memory()  # (as the trainer does)
    _, _, _, on, off = SWITCHES[args.switch]
    rows = []
    for family in args.families:
        found = measure(family, args.switch, args)
        base, yes, no = found["nonprivate"], found["on"], found["off"]
        rows.append(f"| {family} | {base:.1f} | {yes:.1f} | **{base / yes:.2f}** | {no:.1f} | {base / no:.2f} |")
        print(rows[-1], flush=True)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join(
        [
            f"# The engine's `{args.switch}` on and off",
            "",
            f"Command: `python benchmarks/engine_switches.py --switch {args.switch} --families "
            f"{' '.join(args.families)} --size {args.size} --batch {args.batch} --threads {args.threads} --rounds "
            f"{args.rounds}`. Commit {current_commit()}, {when}. "
            f"Machine: {cpu_name()}, {args.threads} torch threads; torch {torch.__version__}. Batch {args.batch}, "
            f"{args.length} tokens; the three steps interleaved in one process, {args.rounds} rounds (the DP steps in "
            "turn first), medians. "
            "Throughput = non-private ms / DP ms.",
            "",
            f"| family | non-private ms | DP ms, {on} | throughput | DP ms, {off} | throughput |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem or args.switch}.md").write_text(text)


if __name__ == "__main__":
    main()
