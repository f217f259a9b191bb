"""Reconstruction attack on random-features models (seed 002): overlap as p/(dn) grows, without and with DP.

Training points x_1..x_n uniform on the sphere of radius √d, labels ±1 at random; f(x) = φ(Vx)ᵀθ,
φ = tanh, θ0 = 0. Three ways to train θ on the same data and features:

- ``min-norm``: the gradient-descent-from-zero limit θ* = Φ⁺y (what the attack's theory assumes);
- ``GD (pff C, T)``: the lectures' DP-GD with the privacy-for-free C = √p·log²n and ηT = (d/p)·log²n
  but σ = 0 (early-stopped, clipped, noiseless GD);
- ``DP-GD ε``: the same with σ from the moments-accountant closed form at (ε, δ = 1e-5).

The attack (:func:`dpml.audit.reconstruction.reconstruction_audit`, 8 restarts × 500 projected Adam
steps) then reports, per training point, the best |cosine| with the n reconstructions. A second
table sweeps ε at the widest model; a third compares tanh (odd: sign lost) with tanh_even (both
parities: sign recovered) on the signed overlap.

    python benchmarks/reconstruction.py [--seeds 3] [--out benchmarks/results] [--from-json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpml.audit.reconstruction import reconstruction_audit
from dpml.models.random_features import RandomFeatures, RandomFeaturesSpec, fit_min_norm
from dpml.train.privacy_for_free import privacy_for_free_hyperparameters, sigma_for_epsilon, train_dpgd_random_features

D, N, DELTA = 10, 5, 1e-5
RATIOS = [0.2, 0.5, 1, 2, 5, 20, 100]  # p/(dn)
EPSILON = 10.0  # the DP arm of the first table
EPSILONS = [1.0, 10.0, 100.0, 1e3, 1e4, 1e5]  # the sweep at the widest model
GD_STEPS = 50  # η = (continuous time)/50


def sphere_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=generator, dtype=torch.float64)
    return x / x.norm(dim=1, keepdim=True) * math.sqrt(D), torch.sign(
        torch.randn(N, generator=generator, dtype=torch.float64)
    )


def trained_model(
    p: int, seed: int, arm: str, epsilon: float | None = None, activation: str = "tanh"
) -> tuple[RandomFeatures, torch.Tensor, float | None]:
    """The model of one arm, its training inputs, and the fraction of clipped gradients (None for min-norm)."""
    x, y = sphere_data(seed)
    model = RandomFeatures(RandomFeaturesSpec(D, p, activation=activation, feature_seed=seed)).double()
    if arm == "min-norm":
        fit_min_norm(model, x, y)
        return model, x, None
    hp = privacy_for_free_hyperparameters(N, D, p)
    sigma = 0.0 if epsilon is None else sigma_for_epsilon(epsilon, DELTA, hp.continuous_time)
    result = train_dpgd_random_features(
        model,
        x,
        y,
        learning_rate=hp.continuous_time / GD_STEPS,
        steps=GD_STEPS,
        clip_norm=hp.clip_norm,
        sigma=sigma,
        seed=10_000 + seed,
    )
    return model, x, result.clipped_fraction


def attack(model: RandomFeatures, x: torch.Tensor, seed: int, signed: bool = False) -> dict[str, Any]:
    report = reconstruction_audit(model, x, seed=seed, signed=signed)
    return {
        "mean": report["summary"]["mean"],
        "above_0.9": report["summary"]["fraction_above_0.9"],
        "chance": report["chance_summary"]["mean"],
        "residual": report["residual_fraction"],
        "seconds": report["seconds"],
    }


def mean_sd(values: list[float]) -> str:
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}"


def run(seeds: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    arms = [("min-norm", None), ("GD (pff C, T)", None), (f"DP-GD ε={EPSILON:g}", EPSILON)]
    for ratio in RATIOS:
        p = int(round(ratio * D * N))
        for arm, epsilon in arms:
            for seed in range(seeds):
                model, x, clipped = trained_model(p, seed, "min-norm" if arm == "min-norm" else "dpgd", epsilon)
                rows.append(
                    {
                        "table": "ratio",
                        "p": p,
                        "ratio": ratio,
                        "arm": arm,
                        "seed": seed,
                        "clipped_fraction": clipped,
                        **attack(model, x, seed),
                    }
                )
                print(rows[-1], flush=True)
    p_wide = int(RATIOS[-1] * D * N)
    for epsilon in EPSILONS:
        for seed in range(seeds):
            model, x, clipped = trained_model(p_wide, seed, "dpgd", epsilon)
            rows.append(
                {
                    "table": "epsilon",
                    "p": p_wide,
                    "epsilon": epsilon,
                    "seed": seed,
                    "clipped_fraction": clipped,
                    **attack(model, x, seed),
                }
            )
            print(rows[-1], flush=True)
    for activation in ("tanh", "tanh_even"):
        for seed in range(seeds):
            model, x, _ = trained_model(p_wide, seed, "min-norm", activation=activation)
            rows.append(
                {
                    "table": "sign",
                    "p": p_wide,
                    "activation": activation,
                    "seed": seed,
                    **attack(model, x, seed, signed=True),
                }
            )
            print(rows[-1], flush=True)
    return {"rows": rows}


def select(rows: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def reading(rows: list[dict[str, Any]]) -> str:
    """A few sentences computed from the numbers (so they stay true when the benchmark is re-run)."""

    def mean_of(**match: Any) -> float:
        return float(np.mean([r["mean"] for r in select(rows, **match)]))

    chance = float(np.mean([r["chance"] for r in rows if r["table"] == "ratio"]))
    first_high = next((ratio for ratio in RATIOS if mean_of(table="ratio", ratio=ratio, arm="min-norm") > 0.9), None)
    private = [mean_of(table="ratio", ratio=ratio, arm=f"DP-GD ε={EPSILON:g}") for ratio in RATIOS]
    leaking_eps = next((e for e in EPSILONS if mean_of(table="epsilon", epsilon=e) > 0.9), None)
    gd_clipped = [r["clipped_fraction"] for r in select(rows, table="ratio", arm="GD (pff C, T)")]
    tanh_signed, even_signed = mean_of(table="sign", activation="tanh"), mean_of(table="sign", activation="tanh_even")
    text = [
        f"- Without DP the attack's mean best-match overlap first exceeds 0.9 at p/(dn) = {first_high} "
        f"(chance level, m = n random directions in d = {D}: {chance:.2f}); below p = dn the n candidates can span "
        "θ whatever they are (residual ≈ 0 at random-looking points), so the objective carries no information — "
        "the p ≫ dn law of the lectures.",
        f"- Early-stopped noiseless GD with the privacy-for-free C and T leaks as much as the min-norm solution "
        f"(θ stays in span{{φ(Vx_i)}}; clipped fraction {max(gd_clipped):.2f} at most).",
        f"- DP-GD at ε = {EPSILON:g} stays at chance for every width (mean overlap "
        f"{min(private):.2f}–{max(private):.2f}). At p/(dn) = {RATIOS[-1]} the attack "
        + (
            f"recovers the points again only from ε = {leaking_eps:g} on"
            if leaking_eps is not None
            else f"stays near chance for every ε up to {EPSILONS[-1]:g}"
        )
        + "; clipped fraction of the DP runs by ε: "
        + ", ".join(
            f"{e:g}: {np.mean([r['clipped_fraction'] for r in select(rows, table='epsilon', epsilon=e)]):.2f}"
            for e in EPSILONS
        )
        + " (where clipping binds it is the accumulated noise, not the data, that makes the residuals large: "
        "the noiseless runs never clip). An ε where the attack works again is no privacy at all.",
        f"- Sign: with tanh (odd) the signed overlap is {tanh_signed:.2f} (each point is found as x or −x at "
        f"random), with tanh_even (non-zero Hermite coefficients of both parities, assumption B2) "
        f"{even_signed:.2f}.",
        "- Scale: n = 5 points in d = 10 is the lectures' toy regime; the privacy-for-free noise "
        "(C = √p·log²n) is far above the signal at this n, so 'DP defends' here says little about utility.",
    ]
    return "\n".join(text)


def markdown(results: dict[str, Any], seeds: int, seconds: float) -> str:
    rows = results["rows"]
    env = results["environment"]
    lines = [
        "# Reconstruction attack on random-features models (seed 002)",
        "",
        f"Environment: {json.dumps(env)}; {seeds} seeds; {seconds:.0f} s in all, one thread. "
        "Command: `python benchmarks/reconstruction.py" + (f" --seeds {seeds}" if seeds != 3 else "") + "`.",
        "",
        f"d = {D}, n = {N} points uniform on the sphere of radius √d, labels ±1 at random, φ = tanh, V ~ N(0, 1/d), "
        f"θ0 = 0. Attack: n candidates, 8 restarts × 500 projected Adam steps. Overlap of a training point = "
        "best |cos| with a reconstruction; numbers are mean ± sd over seeds of the per-model mean overlap. "
        f"DP-GD: C = √p·log²n, ηT = (d/p)·log²n, {GD_STEPS} steps, σ from ε = a + 2√(a·log(1/δ)), δ = {DELTA:g}.",
        "",
        "## Overlap as p/(dn) grows",
        "",
        "| p/(dn) | p | arm | mean overlap | fraction > 0.9 | chance overlap "
        "| attack residual ‖P⊥θ‖²/‖θ‖² | clipped fraction |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ratio in RATIOS:
        for arm in ("min-norm", "GD (pff C, T)", f"DP-GD ε={EPSILON:g}"):
            group = select(rows, table="ratio", ratio=ratio, arm=arm)
            clipped = [r["clipped_fraction"] for r in group if r["clipped_fraction"] is not None]
            lines.append(
                f"| {ratio:g} | {group[0]['p']} | {arm} | {mean_sd([r['mean'] for r in group])} | "
                f"{mean_sd([r['above_0.9'] for r in group])} | {np.mean([r['chance'] for r in group]):.3f} | "
                f"{np.median([r['residual'] for r in group]):.2e} | "
                f"{'—' if not clipped else f'{np.mean(clipped):.3f}'} |"
            )
    lines += [
        "",
        f"## DP-GD across ε at p/(dn) = {RATIOS[-1]:g}",
        "",
        "| ε | mean overlap | fraction > 0.9 | attack residual | clipped fraction |",
        "|---|---|---|---|---|",
    ]
    for epsilon in EPSILONS:
        group = select(rows, table="epsilon", epsilon=epsilon)
        lines.append(
            f"| {epsilon:g} | {mean_sd([r['mean'] for r in group])} | "
            f"{mean_sd([r['above_0.9'] for r in group])} | {np.median([r['residual'] for r in group]):.3f} | "
            f"{np.mean([r['clipped_fraction'] for r in group]):.3f} |"
        )
    lines += [
        "",
        f"## Sign recovery (min-norm, p/(dn) = {RATIOS[-1]:g}, signed overlap = best cos without |·|)",
        "",
        "| activation | mean signed overlap | fraction > 0.9 |",
        "|---|---|---|",
    ]
    for activation in ("tanh", "tanh_even"):
        group = select(rows, table="sign", activation=activation)
        lines.append(
            f"| {activation} | {mean_sd([r['mean'] for r in group])} | {mean_sd([r['above_0.9'] for r in group])} |"
        )
    lines += ["", "![overlap](reconstruction.png)", "", "## Reading", "", reading(rows), ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for arm in ("min-norm", "GD (pff C, T)", f"DP-GD ε={EPSILON:g}"):
        means = [np.mean([r["mean"] for r in select(rows, table="ratio", ratio=q, arm=arm)]) for q in RATIOS]
        left.plot(RATIOS, means, marker="o", label=arm)
    chance = np.mean([r["chance"] for r in rows if r["table"] == "ratio"])
    left.axhline(chance, color="grey", linestyle=":", label="chance")
    left.set(xscale="log", xlabel="p/(dn)", ylabel="mean best-match |cos|", ylim=(0, 1.05), title=f"d={D}, n={N}, tanh")
    left.legend()
    means = [np.mean([r["mean"] for r in select(rows, table="epsilon", epsilon=e)]) for e in EPSILONS]
    right.plot(EPSILONS, means, marker="o")
    right.axhline(chance, color="grey", linestyle=":")
    right.set(
        xscale="log",
        xlabel="ε (δ = 1e-5)",
        ylabel="mean best-match |cos|",
        ylim=(0, 1.05),
        title=f"DP-GD, p/(dn) = {RATIOS[-1]:g}",
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110, metadata={"Software": None})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--from-json", action="store_true", help="rewrite the .md and .png from the saved .json")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        results = json.loads((out / "reconstruction.json").read_text())
        seconds = results["seconds"]
    else:
        torch.set_num_threads(1)
        start = time.perf_counter()
        results = run(args.seeds)
        seconds = time.perf_counter() - start
        results["environment"] = {
            "machine": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        }
        results["seconds"] = seconds
        (out / "reconstruction.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "reconstruction.png")
    text = markdown(results, args.seeds, seconds)
    (out / "reconstruction.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
