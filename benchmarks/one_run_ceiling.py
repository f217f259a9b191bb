"""How close can one white-box run come to the certificate? The audit's ceiling, by simulation.

The white-box audit observes, at every step t and canary coordinate j, o_{t,j} = C·b_{t,j} + N(0, σ²C²) once the
recomputed clipped sum of the real records is subtracted (:mod:`dpml.audit.conformance`), with b_{t,j} = 1 when
canary j is included (probability ½) and drawn by the Poisson sampler (probability q) — exactly, when the trainer
is the certified mechanism. This script draws those observations directly from the certified mechanism (no
training, no model) and runs the audit's own scoring (:func:`dpml.audit.conformance.canary_scores`, per-step
likelihood ratio, the Neyman–Pearson score for one canary), its own guesses (top and bottom
k = ⌈guess_fraction·m/2⌉) and its own bounds at each ``--confidence``: Steinke–Nasr–Jagielski, the f-DP
reading under a Gaussian curve, and (``--tight``) the certified mechanism's own curve. What it reports is what
the audit, with its scoring and its number of guesses, can expect of a trainer that is exactly the certified
mechanism: a gap between these numbers and the certified ε is the one-run analysis' (the number of canaries, the
confidence), not the attack's; a gap between these numbers and a real audit's is the attack's.

    python benchmarks/one_run_ceiling.py [--epsilon 2] [--delta 1e-5] [--sample-rate 0.1] [--epochs 20]
        [--canaries 650] [--guess-fraction 0.2] [--confidence 0.95 0.99167] [--draws 20] [--tight] [--name digits]

The defaults are the default pipeline's (``params.yaml``: ε = 2 at δ = 1e-5, q = 0.1, 20 epochs, 650 canaries:
one per trainable coordinate of the digits model). Writes ``benchmarks/results/one_run_ceiling_<name>.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_common import cpu_name, current_commit  # noqa: E402
from dpml.accounting.calibrate import calibrate_noise_multiplier  # noqa: E402
from dpml.accounting.mechanism import MechanismDescription  # noqa: E402
from dpml.audit.bounds import one_run_bound, one_run_guesses  # noqa: E402
from dpml.audit.canaries import guess_count  # noqa: E402
from dpml.audit.conformance import canary_scores  # noqa: E402
from dpml.audit.one_run_fdp import one_run_gdp_bound, one_run_mechanism_bound  # noqa: E402
from dpml.train.dpsgd import dpsgd_mechanism, number_of_steps  # noqa: E402


def observations(
    rng: np.random.Generator, included: np.ndarray, steps: int, q: float, sigma: float
) -> list[np.ndarray]:
    """o_{t,j} = C·1[j included and drawn at step t] + N(0, σ²C²) at C = 1 (the bounds do not depend on C), one
    array of m per step."""
    return [(included & (rng.random(included.size) < q)) + rng.normal(0.0, sigma, included.size) for _ in range(steps)]


def one_draw(args: argparse.Namespace, sigma: float, steps: int, seed: int, mechanism: MechanismDescription) -> dict:
    rng = np.random.default_rng([args.seed, seed])
    m = args.canaries
    included = rng.random(m) < 0.5
    probe = SimpleNamespace(
        observations=observations(rng, included, steps, args.sample_rate, sigma),
        coordinates=np.arange(m),
        clip_norm=1.0,
        sigma=sigma,
        sample_rate=args.sample_rate,
    )
    k = guess_count(args.guess_fraction, m)
    guesses, correct = one_run_guesses(canary_scores(probe, "likelihood_ratio"), included, k, k)  # type: ignore[arg-type]
    row: dict[str, Any] = {"correct": correct, "guesses": guesses}
    for confidence in args.confidence:
        row[f"steinke@{confidence:g}"] = one_run_bound(m, guesses, correct, args.delta, confidence).epsilon
        row[f"fdp_gdp@{confidence:g}"] = one_run_gdp_bound(m, guesses, correct, args.delta, confidence).epsilon
        if args.tight:
            row[f"mechanism_curve@{confidence:g}"] = one_run_mechanism_bound(
                mechanism, m, guesses, correct, args.delta, confidence
            ).epsilon
    return row


def summary(values: list[float], epsilon: float) -> dict[str, float]:
    """Mean, median, 10th and 90th percentiles, and the share of draws at or above half the certified ε."""
    array = np.asarray(values, dtype=float)
    return {
        "mean": float(array.mean()),
        "median": float(np.median(array)),
        "p10": float(np.quantile(array, 0.1)),
        "p90": float(np.quantile(array, 0.9)),
        "fraction_at_least_half_epsilon": float(np.mean(array >= epsilon / 2)),
    }


def render(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"# The white-box one-run audit's ceiling: {result['name']}",
        "",
        f"Command: `{result['command']}` — commit {result['commit']}, {result['date']}, {result['machine']}.",
        "",
        f"Certified mechanism: ε = {s['epsilon']} at δ = {s['delta']} ({s['neighbouring']}), q = {s['sample_rate']}, "
        f"T = {s['steps']} steps, σ = {s['noise_multiplier']:.4f}; m = {s['canaries']} canaries, "
        f"{s['guesses']} guesses ({s['guess_fraction']} of m); {s['draws']} draws.",
        "",
        "Observations drawn from the certified mechanism itself and scored as the audit scores them (per-step "
        "likelihood ratio), guessed and bounded as it does: what the white-box one-run audit can expect of a "
        "trainer that is exactly its certificate.",
        "",
        "| reading | confidence | mean | median | 10th–90th percentile | draws ≥ ε/2 |",
        "|---|---|---|---|---|---|",
    ]
    labels = {
        "correct": "right guesses",
        "steinke": "Steinke–Nasr–Jagielski ε",
        "fdp_gdp": "f-DP ε (Gaussian curve, reported)",
        "mechanism_curve": "mechanism's curve ε (tight mode, gating)",
    }
    for key, row in result["summary"].items():
        reading, _, confidence = key.partition("@")
        share = "" if reading == "correct" else f"{row['fraction_at_least_half_epsilon']:.0%}"
        lines.append(
            f"| {labels[reading]} | {confidence} | {row['mean']:.3g} | {row['median']:.3g} | "
            f"{row['p10']:.3g}–{row['p90']:.3g} | {share} |"
        )
    lines += ["", f"Seconds: {result['seconds']:.0f}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epsilon", type=float, default=2.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--sample-rate", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--neighbouring", default="add-remove", choices=["add-remove", "replace-one"])
    parser.add_argument("--canaries", type=int, default=650)
    parser.add_argument("--guess-fraction", type=float, default=0.2)
    parser.add_argument(
        "--confidence",
        type=float,
        nargs="+",
        default=[0.95, 1 - 0.05 / 6],
        help="each bound's confidence (default: a lone bound's 0.95, and 1 − 0.05/6, the share each of the default "
        "pipeline's six gating bounds gets of its joint 0.95)",
    )
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tight", action="store_true", help="also read each draw through the mechanism's curve")
    parser.add_argument("--name", default="digits")
    args = parser.parse_args()
    started = time.perf_counter()
    steps = number_of_steps(args.epochs, args.sample_rate)
    sigma = calibrate_noise_multiplier(args.epsilon, args.sample_rate, steps, args.delta, args.neighbouring)
    mechanism = dpsgd_mechanism(args.sample_rate, sigma, args.epochs, args.neighbouring, 1.0, 0)
    rows = [one_draw(args, sigma, steps, draw, mechanism) for draw in range(args.draws)]
    table = {key: summary([r[key] for r in rows], args.epsilon) for key in rows[0] if key != "guesses"}
    result = {
        "name": args.name,
        "command": "python benchmarks/one_run_ceiling.py " + " ".join(sys.argv[1:]),
        "commit": current_commit(),
        "date": datetime.date.today().isoformat(),
        "machine": f"{cpu_name()}, {platform.python_implementation()} {platform.python_version()}",
        "settings": {
            "epsilon": args.epsilon,
            "delta": args.delta,
            "neighbouring": args.neighbouring,
            "sample_rate": args.sample_rate,
            "steps": steps,
            "noise_multiplier": sigma,
            "canaries": args.canaries,
            "guesses": rows[0]["guesses"],
            "guess_fraction": args.guess_fraction,
            "draws": args.draws,
        },
        "summary": table,
        "draws": rows,
        "seconds": time.perf_counter() - started,
    }
    out = ROOT / "benchmarks" / "results" / f"one_run_ceiling_{args.name}"
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
