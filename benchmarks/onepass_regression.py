"""One-pass DP-SGD with aggressive clipping (seed 002): excess risk of the OUT and CONST schedules across n.

Synthetic linear regression: x ~ N(0, I_d), y = xᵀθ* + N(0, τ²), ‖θ*‖ = 1, d = 50, τ = 0.5; one pass
over n records (γ = d/n) with C = c√d, c = 1, inputs clipped to X = √d + 4 (β = X², η_k ≤ 2/β
enforced), noise from the minimal schedule at (ε, δ) = (1, 1e-5) (ρ = 0.204, certified by
:func:`dpml.train.onepass.train_onepass_dpsgd`). The learning rate follows the lectures' scaling
η̃(0) = κ·log(1/γ)/c (capped at the stability/privacy limit 2n/X²) over a grid of κ; the table
shows the best κ per (schedule, n) — an oracle choice on the population risk, so it measures the
rate of the best-tuned schedule (the quantity the theorem's bounds are about), not a private
procedure. Excess risk R(θ) − R(θ*) = ½‖θ − θ*‖², mean over seeds.

Theory (Bombari, Seroussi & Mondelli, as stated in the lectures): minimax O(γ + γ²/ρ²); OUT
O(γ log(1/γ) + γ² log²(1/γ)/ρ²); CONST O(γ log^{2/3}(1/γ) + γ² log^{4/3}(1/γ)/ρ²). Each curve is
compared with the measurements up to one constant, fitted by least squares on the log scale.

    python benchmarks/onepass_regression.py [--seeds 4] [--out benchmarks/results]
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

from bench_common import selection_epsilon
from dpml.train.onepass import excess_risk, rho_for_epsilon, theory_rate, train_onepass_dpsgd

D, TAU, EPSILON, DELTA, CLIP_CONSTANT = 50, 0.5, 1.0, 1e-5, 1.0
INPUT_BOUND = math.sqrt(D) + 4.0
NS = [250, 500, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000]
KAPPAS = [0.25, 0.5, 1.0, 2.0]
SCHEDULES = ("out", "const")


def regression(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, n])
    theta_star = rng.standard_normal(D)
    theta_star /= np.linalg.norm(theta_star)
    x = rng.standard_normal((n, D))
    return x, x @ theta_star + TAU * rng.standard_normal(n), theta_star


def learning_rate(kappa: float, n: int) -> tuple[float, bool]:
    """η̃(0) = κ·log(1/γ)/c, capped at 2n/X² (η_k ≤ 2/β); returns it and whether the cap bound."""
    wanted = kappa * math.log(n / D) / CLIP_CONSTANT
    cap = 2.0 * n / INPUT_BOUND**2
    return min(wanted, cap), wanted > cap


def schedule_rates(gamma: np.ndarray, rho: float) -> dict[str, np.ndarray]:
    log = np.log(1 / gamma)
    return {
        "minimax γ + γ²/ρ²": theory_rate(gamma, rho),
        "OUT γ·log + γ²·log²/ρ²": gamma * log + gamma**2 * log**2 / rho**2,
        "CONST γ·log^(2/3) + γ²·log^(4/3)/ρ²": gamma * log ** (2 / 3) + gamma**2 * log ** (4 / 3) / rho**2,
    }


def fitted_constant(measured: np.ndarray, rate: np.ndarray) -> float:
    """A minimising Σ(log measured − log(A·rate))²: the geometric mean of measured/rate."""
    return float(np.exp(np.mean(np.log(measured) - np.log(rate))))


def two_term_fit(measured: np.ndarray, gamma: np.ndarray, rho: float) -> tuple[float, float]:
    """a, b ≥ 0 minimising Σ((aγ + bγ²/ρ²)/R − 1)² (relative error): one constant per term of γ + γ²/ρ²."""
    from scipy.optimize import nnls

    design = np.column_stack([gamma / measured, gamma**2 / rho**2 / measured])
    (a, b), _ = nnls(design, np.ones_like(measured))
    return float(a), float(b)


def run(seeds: int) -> dict[str, Any]:
    rows = []
    for n in NS:
        for schedule in SCHEDULES:
            for kappa in KAPPAS:
                eta0, capped = learning_rate(kappa, n)
                risks, clipped, epsilons = [], [], []
                for seed in range(seeds):
                    x, y, theta_star = regression(n, seed)
                    result = train_onepass_dpsgd(
                        x,
                        y,
                        epsilon=EPSILON,
                        delta=DELTA,
                        schedule=schedule,
                        eta0=eta0,  # type: ignore[arg-type]
                        clip_constant=CLIP_CONSTANT,
                        input_norm_bound=INPUT_BOUND,
                        seed=1_000_000 + seed,
                    )
                    risks.append(excess_risk(result.theta, theta_star))
                    clipped.append(result.clipped_fraction)
                    epsilons.append(result.epsilon)
                rows.append(
                    {
                        "n": n,
                        "gamma": D / n,
                        "schedule": schedule,
                        "kappa": kappa,
                        "eta0": eta0,
                        "capped": capped,
                        "risk_mean": float(np.mean(risks)),
                        "risk_sd": float(np.std(risks)),
                        "risks": risks,
                        "clipped_fraction": float(np.mean(clipped)),
                        "certified_epsilon_max": max(epsilons),
                    }
                )
                print({k: v for k, v in rows[-1].items() if k != "risks"}, flush=True)
    return {"rows": rows}


def best_rows(rows: list[dict[str, Any]], schedule: str) -> list[dict[str, Any]]:
    return [
        min((r for r in rows if r["n"] == n and r["schedule"] == schedule), key=lambda r: r["risk_mean"]) for n in NS
    ]


def analysis(rows: list[dict[str, Any]], rho: float) -> dict[str, Any]:
    """Fitted constants, and log-log slopes of measured and theoretical curves over the informative range."""
    gamma = np.array([D / n for n in NS])
    rates = schedule_rates(gamma, rho)
    informative = gamma <= 0.05  # below this the trivial θ = 0 (risk 0.5) is not yet beaten by the rate
    out: dict[str, Any] = {"informative_gamma_max": 0.05}
    for schedule in SCHEDULES:
        measured = np.array([r["risk_mean"] for r in best_rows(rows, schedule)])
        own = "OUT γ·log + γ²·log²/ρ²" if schedule == "out" else "CONST γ·log^(2/3) + γ²·log^(4/3)/ρ²"
        entry: dict[str, Any] = {}
        for name in ("minimax γ + γ²/ρ²", own):
            constant = fitted_constant(measured[informative], rates[name][informative])
            ratio = measured / (constant * rates[name])
            entry[name] = {
                "constant": constant,
                "ratio_min": float(ratio[informative].min()),
                "ratio_max": float(ratio[informative].max()),
            }
        a, b = two_term_fit(measured[informative], gamma[informative], rho)
        ratio = measured / (a * gamma + b * gamma**2 / rho**2)
        entry["two_term"] = {
            "a": a,
            "b": b,
            "ratio_min": float(ratio[informative].min()),
            "ratio_max": float(ratio[informative].max()),
        }
        slope = np.polyfit(np.log(gamma[informative]), np.log(measured[informative]), 1)[0]
        slope_theory = np.polyfit(np.log(gamma[informative]), np.log(rates[own][informative]), 1)[0]
        slope_minimax = np.polyfit(np.log(gamma[informative]), np.log(rates["minimax γ + γ²/ρ²"][informative]), 1)[0]
        entry["slope_measured"], entry["slope_own_rate"], entry["slope_minimax"] = slope, slope_theory, slope_minimax
        out[schedule] = entry
    return out


def reading(rows: list[dict[str, Any]], facts: dict[str, Any]) -> str:
    lines = []
    for schedule in SCHEDULES:
        f = facts[schedule]
        own = "OUT γ·log + γ²·log²/ρ²" if schedule == "out" else "CONST γ·log^(2/3) + γ²·log^(4/3)/ρ²"
        mm, ow = f["minimax γ + γ²/ρ²"], f[own]
        lines.append(
            f"- {schedule.upper()}: over γ ≤ 0.05 the measured log-log slope is {f['slope_measured']:.2f} against "
            f"{f['slope_own_rate']:.2f} for its own rate and {f['slope_minimax']:.2f} for γ + γ²/ρ². With one fitted "
            f"constant the measurements stay within a factor {ow['ratio_min']:.2f}–{ow['ratio_max']:.2f} of its own "
            f"rate (A = {ow['constant']:.3g}) and {mm['ratio_min']:.2f}–{mm['ratio_max']:.2f} of γ + γ²/ρ² "
            f"(A = {mm['constant']:.3g}); with one constant per term, a·γ + b·γ²/ρ² (a = {f['two_term']['a']:.3g}, "
            f"b = {f['two_term']['b']:.3g}), within {f['two_term']['ratio_min']:.2f}–{f['two_term']['ratio_max']:.2f}. "
            + (
                "Verdict: the trend holds (a single-constant band narrower than a factor 4 end to end)."
                if ow["ratio_max"] / ow["ratio_min"] < 4
                else "Verdict: the measured curve is steeper than the rate over this range — it does not track one "
                "constant times the rate (at the small-n end it sits above, at the large-n end below), so the "
                "asymptotic rate is not visible yet for this schedule at these n (or the κ grid is too coarse)."
            )
        )
    best_out = {r["n"]: r["risk_mean"] for r in best_rows(rows, "out")}
    best_const = {r["n"]: r["risk_mean"] for r in best_rows(rows, "const")}
    wins = sum(best_out[n] < best_const[n] for n in NS)
    clipped = [r["clipped_fraction"] for r in rows]
    capped = sorted({r["n"] for r in rows if r["capped"]})
    largest = [r["clipped_fraction"] for r in best_rows(rows, "out") + best_rows(rows, "const") if r["n"] == NS[-1]]
    out_wins = [n for n in NS if best_out[n] < best_const[n]]
    lines.append(
        f"- OUT beats CONST at {wins} of {len(NS)} sample sizes (best κ each): n ∈ {out_wins}. "
        "Clipping at c = 1 is aggressive: over all runs "
        f"{min(clipped):.2f}–{max(clipped):.2f} of the per-example gradients were clipped, still "
        f"{'–'.join(sorted({f'{v:.2f}' for v in largest}))} at n = {NS[-1]} (label noise alone has P(|z| > 2τ) ≈ 0.05)."
    )
    lines.append(
        "- A constant-factor band that stays narrow over two and a half decades of γ is what 'the trend "
        "holds' means here; the rates are asymptotic (γ → 0) with unspecified constants, so neither the "
        "constants nor the log factors are checked, and at γ ≥ 0.1 the private estimator does not beat "
        "θ = 0 (risk 0.5) — the γ²/ρ² term with ρ = 0.2 is ≥ 0.25 there."
    )
    if capped:
        lines.append(f"- The learning-rate cap η_k ≤ 2/X² bound for some κ at n ∈ {capped}.")
    return "\n".join(lines)


def best_of_kappas_epsilon(rho: float, candidates: int = len(KAPPAS)) -> float:
    """ε at δ = DELTA of releasing the best of ``candidates`` runs on the same records, each (ρ²/2)-zCDP."""
    from dpml.accounting.mechanism import ConcentratedDP

    return selection_epsilon(
        [ConcentratedDP(rho * rho / 2)] * candidates,
        "replace-one",
        DELTA,
        CLIP_CONSTANT * math.sqrt(D),
        NS[0],
        threat_model="final-model",
    )


def markdown(results: dict[str, Any], seeds: int) -> str:
    rows, rho = results["rows"], results["rho"]
    gamma = np.array([D / n for n in NS])
    rates = schedule_rates(gamma, rho)
    facts = results["analysis"]
    lines = [
        "# One-pass DP-SGD with aggressive clipping: excess risk vs n (seed 002)",
        "",
        f"Environment: {json.dumps(results['environment'])}; {seeds} seeds; {results['seconds']:.0f} s in all, "
        "one thread. Command: `python benchmarks/onepass_regression.py"
        + (f" --seeds {seeds}" if seeds != 4 else "")
        + "`.",
        "",
        f"x ~ N(0, I_d), d = {D}, y = xᵀθ* + N(0, {TAU}²), ‖θ*‖ = 1; C = c√d with c = {CLIP_CONSTANT:g}; inputs "
        f"clipped to X = √d + 4; (ε, δ) = ({EPSILON:g}, {DELTA:g}) ⇒ ρ = {rho:.4f} ((ρ²/2)-zCDP, certified per run: "
        f"largest certified ε {max(r['certified_epsilon_max'] for r in rows):.6f}). η̃(0) = κ·log(1/γ)/c, "
        f"κ ∈ {KAPPAS}, best κ per cell (oracle); excess risk ½‖θ − θ*‖², mean ± sd over seeds.",
        "",
        f"**Each risk below is the best of {len(KAPPAS)} runs picked on the reported metric** (the population "
        f"risk, which needs θ*): it measures the best-tuned schedule, not a private procedure. Releasing the best "
        f"of the {len(KAPPAS)} κ on one data set costs ε = {best_of_kappas_epsilon(rho):.2f} at δ = {DELTA:g} "
        f"(the composition of the {len(KAPPAS)} runs), not {EPSILON:g}.",
        "",
        "| n | γ = d/n | OUT risk (best κ) | κ | CONST risk (best κ) | κ | γ + γ²/ρ² | A·(γ + γ²/ρ²), OUT's A "
        "| OUT rate × A | CONST rate × A | clipped (OUT, CONST) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    out_best, const_best = best_rows(rows, "out"), best_rows(rows, "const")
    a_minimax = facts["out"]["minimax γ + γ²/ρ²"]["constant"]
    a_out = facts["out"]["OUT γ·log + γ²·log²/ρ²"]["constant"]
    a_const = facts["const"]["CONST γ·log^(2/3) + γ²·log^(4/3)/ρ²"]["constant"]
    for i, n in enumerate(NS):
        o, c = out_best[i], const_best[i]
        lines.append(
            f"| {n} | {D / n:.4g} | {o['risk_mean']:.4g} ± {o['risk_sd']:.2g} | {o['kappa']:g} | "
            f"{c['risk_mean']:.4g} ± {c['risk_sd']:.2g} | {c['kappa']:g} | {rates['minimax γ + γ²/ρ²'][i]:.4g} | "
            f"{a_minimax * rates['minimax γ + γ²/ρ²'][i]:.4g} | {a_out * rates['OUT γ·log + γ²·log²/ρ²'][i]:.4g} | "
            f"{a_const * rates['CONST γ·log^(2/3) + γ²·log^(4/3)/ρ²'][i]:.4g} | "
            f"{o['clipped_fraction']:.3f}, {c['clipped_fraction']:.3f} |"
        )
    lines += [
        "",
        "Every κ (mean excess risk):",
        "",
        "| n | "
        + " | ".join(f"OUT κ={k:g}" for k in KAPPAS)
        + " | "
        + " | ".join(f"CONST κ={k:g}" for k in KAPPAS)
        + " |",
        "|---" * (1 + 2 * len(KAPPAS)) + "|",
    ]
    for n in NS:
        cells = [
            next(r for r in rows if r["n"] == n and r["schedule"] == s and r["kappa"] == k)
            for s in SCHEDULES
            for k in KAPPAS
        ]
        lines.append(
            f"| {n} | " + " | ".join(f"{r['risk_mean']:.4g}" + ("*" if r["capped"] else "") for r in cells) + " |"
        )
    lines += [
        "",
        "(* η̃(0) capped at 2n/X².)",
        "",
        "![rates](onepass_regression.png)",
        "",
        "## Reading",
        "",
        reading(rows, facts),
        "",
    ]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, rho, facts = results["rows"], results["rho"], results["analysis"]
    gamma = np.array([D / n for n in NS])
    fine = np.geomspace(gamma.min(), gamma.max(), 200)
    rates = schedule_rates(fine, rho)
    figure, axis = plt.subplots(figsize=(6.5, 4.5))
    for schedule, colour in (("out", "C0"), ("const", "C1")):
        best = best_rows(rows, schedule)
        axis.errorbar(
            gamma,
            [r["risk_mean"] for r in best],
            yerr=[r["risk_sd"] for r in best],
            marker="o",
            linestyle="none",
            color=colour,
            label=f"{schedule.upper()} measured (best κ)",
        )
        own = "OUT γ·log + γ²·log²/ρ²" if schedule == "out" else "CONST γ·log^(2/3) + γ²·log^(4/3)/ρ²"
        axis.plot(
            fine,
            facts[schedule][own]["constant"] * rates[own],
            color=colour,
            linestyle="--",
            label=f"A·({own.split(' ', 1)[1]})",
        )
        axis.plot(
            fine,
            facts[schedule]["minimax γ + γ²/ρ²"]["constant"] * rates["minimax γ + γ²/ρ²"],
            color=colour,
            linestyle=":",
            label=f"A·(γ + γ²/ρ²), {schedule.upper()}'s A",
        )
    axis.axhline(0.5, color="grey", linewidth=0.8, label="θ = 0")
    axis.set(
        xscale="log",
        yscale="log",
        xlabel="γ = d/n",
        ylabel="excess risk ½‖θ − θ*‖²",
        title=f"one-pass DP-SGD, d={D}, ε={EPSILON:g} (ρ={rho:.3f}), c={CLIP_CONSTANT:g}",
    )
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110, metadata={"Software": None})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--from-json", action="store_true", help="rewrite the .md and .png from the saved .json")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        results = json.loads((out / "onepass_regression.json").read_text())
    else:
        start = time.perf_counter()
        results = run(args.seeds)
        results["seconds"] = time.perf_counter() - start
        results["seeds"] = args.seeds
        results["rho"] = rho_for_epsilon(EPSILON, DELTA)
        results["environment"] = {
            "machine": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "numpy": np.__version__,
        }
    results["analysis"] = analysis(results["rows"], results["rho"])
    (out / "onepass_regression.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "onepass_regression.png")
    text = markdown(results, results["seeds"])
    (out / "onepass_regression.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
