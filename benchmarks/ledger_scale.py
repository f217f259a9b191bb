"""The per-unit ledger at scale: 10 million privacy units, 100 spends.

A lineage grows from 9 to 10 million units over 100 versions (10,101 new units a version); each
version's DP-SGD run (1,000 steps, expected batch 256, σ = 1.2) trains on its stable 60 % training part
(a unit's part never changes, :mod:`dpml.data.split`), so spend k touches ≈ 0.6 × the units present at
version k. Per spend we time the reservation (keyed ids, the per-unit budget check and the unit records,
one transaction) and the check alone (the same reservation refused: the budget set just below what it
needs), and record the ledger's size. Unit digests are drawn at random (a digest is a BLAKE2b output:
uniform bytes).

    python benchmarks/ledger_scale.py [--units 10000000] [--spends 100]

Writes ``benchmarks/results/ledger_scale.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from dpml.data.split import unit_uniforms
from dpml.ledger.ledger import BudgetExceeded, Ledger
from dpml.accounting.mechanism import MechanismDescription, PoissonGaussianSteps

DELTA = 1e-6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=10_000_000)
    parser.add_argument("--spends", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ledger_scale.md")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    digests = rng.integers(0, 256, size=(args.units, 16), dtype=np.uint8)
    in_train = unit_uniforms(digests, seed=0) >= 0.4
    first = int(args.units * 0.9)
    grow = (args.units - first) // max(args.spends - 1, 1)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "ledger.db"
        ledger = Ledger(path, DELTA)
        for k in range(args.spends):
            present = min(first + k * grow, args.units)
            units = digests[:present][in_train[:present]]
            n = int(units.shape[0])  # each version's DP-SGD run: 1,000 steps of expected batch 256, σ = 1.2
            mechanism = MechanismDescription("dpsgd", (PoissonGaussianSteps(256 / n, 1.2, 1000),), "add-remove", 1.0, n)  # type: ignore[arg-type]
            start = time.perf_counter()
            ledger.reserve(f"v{k}", mechanism, f"run {k}", 1e6, lineage="scale", units=units)
            reserve_s = time.perf_counter() - start
            check_s = None
            if k in (0, 9, 49, args.spends - 1):
                current = ledger.total("scale")
                start = time.perf_counter()
                try:
                    ledger.reserve(f"v{k}", mechanism, "refused", current * 1.000001, lineage="scale", units=units)
                except BudgetExceeded:
                    check_s = time.perf_counter() - start
                size = sum(p.stat().st_size for p in Path(scratch).iterdir()) / 2**20
                start = time.perf_counter()
                summary = ledger.summary("scale")[0]
                summary_s = time.perf_counter() - start
                rows.append(
                    (
                        k + 1,
                        present,
                        int(units.shape[0]),
                        reserve_s,
                        check_s,
                        summary_s,
                        size,
                        summary["epsilon_total"],
                        len(summary["unit_epsilon"]),
                    )
                )
                print(rows[-1], flush=True)
    lines = [
        "# Per-unit ledger at scale",
        "",
        f"`python benchmarks/ledger_scale.py --units {args.units} --spends {args.spends}` on {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}; δ = {DELTA:g}.",
        "",
        "| spends | units in lineage | units touched | reserve (check + record) s | check alone (refused) s "
        "| `dpml ledger` summary s | ledger + key + WAL MB | largest unit ε | distinct unit ε levels |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for spends, present, touched, reserve_s, check_s, summary_s, size, largest, levels in rows:
        lines.append(
            f"| {spends} | {present:,} | {touched:,} | {reserve_s:.2f} | {check_s:.2f} | {summary_s:.2f} | "
            f"{size:.0f} | {largest:.4g} | {levels} |"
        )
    lines += [
        "",
        "Timings on 2 cores with nothing else running. The issue asks for the pre-run check and the recording "
        "each under 10 s and a ledger of a few hundred MB at 10 million units and 100 spends. The largest unit ε "
        "jumps from the PLD value after one spend to an RDP bound once a unit's history holds more than "
        "`PLD_MAX_EVENTS` = 8 distinct events (every version here has its own sampling rate): at these tiny "
        "per-spend losses RDP's conversion term log(1/δ)/(α−1) dominates. It is a valid upper bound, looser "
        "than PLD, never an under-count.",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
