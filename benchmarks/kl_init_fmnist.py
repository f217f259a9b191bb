"""Seed 000 (Ye et al., *Initialization Matters*) §5 on Fashion-MNIST: the *estimated* KL privacy loss of
noisy GD without clipping versus epochs, depth and width, for LeCun, Xavier and He initialisation.

    python benchmarks/kl_init_fmnist.py [--n 1000] [--runs 3] [--steps 50] [--learning-rate 0.01]
        [--sigma 0.01] [--depths 2 4 6 8 10 12] [--depth-width 256] [--widths 32 64 128 256 512]
        [--width-depth 10] [--added 200] [--linearised-runs 2] [--long-steps 300] [--long-depths 4 8 12]
        [--long-width 128] [--long-runs 1] [--out benchmarks/results]

**Task.** T-shirt/top (class 0) vs Shirt (class 6): the pair of Fashion-MNIST classes that is hardest
to tell apart, a binary task of similar character to the paper's CIFAR-10 car vs plane; n training
images (half per class, a fixed public draw from the training file), softmax cross-entropy on o = 2
outputs (the loss of the paper's proofs). **Inputs**: pixels / 255, then every image rescaled to
‖x‖ = sqrt(d) = 28 (Assumption 2.4's ‖x‖ = sqrt d; per-record, so it does not depend on the data
set). **Network**: bias-free ReLU MLP, depth L = number of weight matrices, hidden width m (Eq. 2).

**Noisy GD** (App. E): full batch, no clipping, W ← W − η∇L + sqrt(2ησ²)Z, η = 0.01 (§5's text; the
figure captions say 0.001), σ = 0.01 (Fig. 2), 50 epochs. The paper does not say how many steps an
epoch has; noisy GD is full-batch, so one epoch = one step here (50 steps, training time T = 0.5).

**Estimated KL** (Thm E.1, Eq. 74, the paper's constant 1/(2σ²)): Σ_k η‖∇L(W_k; D) − ∇L(W_k; D')‖²/(2σ²)
along each trajectory trained on D, for every remove-one neighbour (all n records) and every add-one
neighbour with one of ``--added`` held-out test images (the paper's "add-or-remove-one" probes, its
test records subsampled). As in the paper's figures: per run the worst neighbour, then mean ± std over
runs (each run: its own initialisation and noise). Also reported: the run-averaged estimate per
neighbour, worst over neighbours (Eq. 74's expectation estimated by the mean over runs). These are
**estimates**, not certificates. For reference, the Cor. 4.2 value 2BKη/(n²σ²) with Table 1's B: a
certificate for the *linearised* network only. ``--linearised-runs`` also trains the linearised
network (Eq. 3) on the same data and compares its estimate with that certificate. ``--long-steps``
reruns a few depths for longer (same η, σ) for LeCun and Xavier, to see whether the depth trend changes
later in training (the paper's Fig. 2b claims it does); ``--long-runs 0`` skips it.

The noise generator is seeded from the operating system's secret source (never logged), as a private
run would be; initialisations use public seeds. Single-threaded (``torch.set_num_threads(1)``).
"""

from __future__ import annotations

import argparse
import json
import platform
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import FASHION_MNIST  # noqa: E402
from dpml.data.sources import load_idx  # noqa: E402
from dpml.models.init import bias_free_relu_mlp, initialise  # noqa: E402
from dpml.accounting.kl import gradient_norm_constant, kl_bound, kl_bound_for_relation  # noqa: E402
from dpml.train.noisygd import KLPairs, LinearisedNetwork, train_noisy_gd  # noqa: E402

SCHEMES = ("lecun", "xavier", "he")
LABELS = {"lecun": "LeCun", "xavier": "Xavier", "he": "He", "ntk": "NTK"}
CLASSES = (0, 6)  # T-shirt/top vs Shirt
DATA_SEED = 0  # public: which images are used


# ------------------------------------------------------------------------------------------------ data


def balanced_rows(y: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` row indices, half from each of CLASSES, in a random (public-seed) order."""
    rows = [rng.choice(np.flatnonzero(y == c), size=count // 2, replace=False) for c in CLASSES]
    return rng.permutation(np.concatenate(rows))


def to_sphere(images: np.ndarray) -> torch.Tensor:
    """pixels/255, each record rescaled to ‖x‖ = sqrt(d) (Assumption 2.4)."""
    x = torch.as_tensor(images, dtype=torch.float32) / 255.0
    return x * (x.shape[1] ** 0.5) / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def binary_task(n: int, added: int) -> dict[str, torch.Tensor]:
    """Training set (n records) and held-out add-one probes (``added`` test records), labels 0/1."""
    if not FASHION_MNIST.is_dir():
        sys.exit(f"skipped: {FASHION_MNIST} is absent")
    raw = load_idx(FASHION_MNIST)
    assert raw.x_test is not None and raw.y_test is not None
    rng = np.random.default_rng(DATA_SEED)
    train_rows = balanced_rows(raw.y, n, rng)
    test_rows = balanced_rows(raw.y_test, added, rng)
    return {
        "x": to_sphere(raw.x[train_rows]),
        "y": torch.as_tensor(raw.y[train_rows] == CLASSES[1]).long(),
        "added_x": to_sphere(raw.x_test[test_rows]),
        "added_y": torch.as_tensor(raw.y_test[test_rows] == CLASSES[1]).long(),
    }


# --------------------------------------------------------------------------------------------- one run


def run_once(
    data: dict[str, torch.Tensor],
    scheme: str,
    depth: int,
    width: int,
    run: int,
    args: argparse.Namespace,
    linearised: bool = False,
) -> dict[str, Any]:
    """One noisy GD run with the estimated KL at every remove-one and add-one probe."""
    d = data["x"].shape[1]
    widths = [d] + [width] * (depth - 1) + [2]
    init_seed = 1_000_003 * run + 1009 * depth + width + (7 if linearised else 0)  # public
    model = initialise(bias_free_relu_mlp(widths), scheme, torch.Generator().manual_seed(init_seed))
    if linearised:
        model = LinearisedNetwork(model)
    n = data["x"].shape[0]
    removed = torch.arange(n) if not linearised else torch.arange(args.linearised_probes)
    added = slice(None) if not linearised else slice(0, args.linearised_probes)
    pairs = KLPairs(
        removed=removed,
        added_x=data["added_x"][added],
        added_y=data["added_y"][added],
        relations=("remove_one", "add_one"),
    )
    noise = torch.Generator().manual_seed(secrets.randbits(63))
    history = train_noisy_gd(
        model,
        data["x"],
        data["y"],
        learning_rate=args.learning_rate,
        sigma=args.sigma,
        steps=args.steps,
        loss="cross_entropy",
        generator=noise,
        kl_pairs=pairs,
    ).history
    kl = history["kl_estimate"]
    worst = [
        max(a, b) for a, b in zip(kl["remove_one"]["cumulative_worst"], kl["add_one"]["cumulative_worst"], strict=True)
    ]
    return {
        "scheme": scheme,
        "depth": depth,
        "width": width,
        "run": run,
        "seconds": history["seconds"],
        "initial_loss": history["initial_loss"],
        "final_loss": history["final_loss"],
        "worst_by_epoch": worst,
        "remove_worst_by_epoch": kl["remove_one"]["cumulative_worst"],
        "add_worst_by_epoch": kl["add_one"]["cumulative_worst"],
        "per_probe": {"remove_one": kl["remove_one"]["final_per_probe"], "add_one": kl["add_one"]["final_per_probe"]},
        "certificate_linearised": kl_bound(
            gradient_norm_constant(scheme, widths, d**0.5), args.steps, args.learning_rate, n, args.sigma
        ),
    }


def rounded(values: list[float]) -> list[float]:
    """4 significant digits: enough for the curves, keeps the JSON small."""
    return [float(f"{v:.4g}") for v in values]


def summarise(runs: list[dict[str, Any]], epochs: list[int]) -> dict[str, Any]:
    """Mean ± std over runs of the per-run worst neighbour at each epoch in ``epochs``, and the run-averaged worst."""
    out: dict[str, Any] = {
        "runs": len(runs),
        "seconds": sum(r["seconds"] for r in runs),
        "final_loss": statistics.mean(r["final_loss"] for r in runs),
        "initial_loss": statistics.mean(r["initial_loss"] for r in runs),
        "certificate_linearised": runs[0]["certificate_linearised"],
    }
    for epoch in epochs:
        values = [r["worst_by_epoch"][epoch - 1] for r in runs]
        out[f"kl_{epoch}"] = statistics.mean(values)
        out[f"kl_{epoch}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
    averaged = {rel: np.mean([r["per_probe"][rel] for r in runs], axis=0) for rel in ("remove_one", "add_one")}
    out["kl_run_averaged_worst"] = float(max(v.max() for v in averaged.values()))
    out["worst_relation"] = max(averaged, key=lambda rel: averaged[rel].max())
    return out


# ------------------------------------------------------------------------------------------- sweeps


def sweep(data: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, Any]:
    configs = sorted(
        {(depth, args.depth_width) for depth in args.depths} | {(args.width_depth, width) for width in args.widths}
    )
    results: dict[str, Any] = {}
    for scheme in SCHEMES:
        for depth, width in configs:
            runs = []
            for run in range(args.runs):
                runs.append(run_once(data, scheme, depth, width, run, args))
                print(
                    f"{scheme:6s} L={depth:2d} m={width:4d} run {run}: worst KL {runs[-1]['worst_by_epoch'][-1]:.4g} "
                    f"({runs[-1]['seconds']:.1f} s)",
                    flush=True,
                )
            results[f"{scheme}/{depth}/{width}"] = {
                "scheme": scheme,
                "depth": depth,
                "width": width,
                "summary": summarise(runs, [20, args.steps]),
                "by_epoch": [rounded(r["worst_by_epoch"]) for r in runs],
                "remove_by_epoch": [rounded(r["remove_worst_by_epoch"]) for r in runs],
                "add_by_epoch": [rounded(r["add_worst_by_epoch"]) for r in runs],
                "losses": [(r["initial_loss"], r["final_loss"]) for r in runs],
            }
    return results


def long_sweep(data: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, Any]:
    """LeCun and Xavier at a few depths, trained ``--long-steps`` steps: the depth trend later in training."""
    long_args = argparse.Namespace(**(vars(args) | {"steps": args.long_steps}))
    results: dict[str, Any] = {}
    for scheme in ("lecun", "xavier"):
        for depth in args.long_depths:
            runs = [run_once(data, scheme, depth, args.long_width, run, long_args) for run in range(args.long_runs)]
            print(f"long {scheme:6s} L={depth:2d}: worst KL {runs[-1]['worst_by_epoch'][-1]:.4g}", flush=True)
            results[f"{scheme}/{depth}/{args.long_width}"] = {
                "scheme": scheme,
                "depth": depth,
                "width": args.long_width,
                "summary": summarise(runs, sorted({20, args.steps, args.long_steps})),
                "by_epoch": [rounded(r["worst_by_epoch"]) for r in runs],
            }
    return results


def linearised_check(data: dict[str, torch.Tensor], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The linearised network (Eq. 3): estimate (run-averaged, worst probe) vs the Cor. 4.2 certificate."""
    rows = []
    depth, width = args.linearised_depth, args.linearised_width
    n, d = data["x"].shape
    for scheme in ("lecun", "xavier", "he", "ntk"):
        runs = [run_once(data, scheme, depth, width, run, args, linearised=True) for run in range(args.linearised_runs)]
        widths = [d] + [width] * (depth - 1) + [2]
        constant = gradient_norm_constant(scheme, widths, d**0.5)
        row: dict[str, Any] = {
            "scheme": scheme,
            "depth": depth,
            "width": width,
            "runs": len(runs),
            "seconds": sum(r["seconds"] for r in runs),
        }
        for relation in ("remove_one", "add_one"):
            averaged = np.mean([r["per_probe"][relation] for r in runs], axis=0)
            row[relation] = {
                "estimate": float(averaged.max()),
                "certificate": kl_bound_for_relation(constant, args.steps, args.learning_rate, n, args.sigma, relation),
            }
        rows.append(row)
        print("linearised", scheme, {k: row[k] for k in ("remove_one", "add_one")}, flush=True)
    return rows


# ----------------------------------------------------------------------------------------- readings


def trend(xs: list[int], values: list[float]) -> str:
    """A few words on how ``values`` move along ``xs`` (means only; the tables give the spread)."""
    steps = [b - a for a, b in zip(values, values[1:], strict=False)]
    if all(step > 0 for step in steps):
        return f"increases throughout ({values[0]:.3g} → {values[-1]:.3g})"
    if all(step < 0 for step in steps):
        return f"decreases throughout ({values[0]:.3g} → {values[-1]:.3g})"
    peak, low = int(np.argmax(values)), int(np.argmin(values))
    if 0 < peak < len(values) - 1 and all(s > 0 for s in steps[:peak]) and all(s < 0 for s in steps[peak:]):
        return f"rises to a peak at {xs[peak]} ({values[peak]:.3g}) and then falls ({values[-1]:.3g} at {xs[-1]})"
    if 0 < low < len(values) - 1 and all(s < 0 for s in steps[:low]) and all(s > 0 for s in steps[low:]):
        return f"falls to a minimum at {xs[low]} ({values[low]:.3g}) and then rises ({values[-1]:.3g} at {xs[-1]})"
    return (
        "is not monotone: "
        + ", ".join(f"{x}: {v:.3g}" for x, v in zip(xs, values, strict=True))
        + f" (largest at {xs[peak]}, smallest at {xs[low]})"
    )


def readings(report: dict[str, Any]) -> list[str]:
    """Sentences comparing each measured trend with the paper's claim (computed from the numbers)."""
    s, results, steps = report["settings"], report["results"], report["settings"]["steps"]
    base = {scheme: results[f"{scheme}/{s['width_depth']}/{s['depth_width']}"] for scheme in SCHEMES}
    curves = {scheme: np.array(entry["by_epoch"]).mean(0) for scheme, entry in base.items()}
    ratios = {scheme: c[-1] / (steps / 10 * c[9]) for scheme, c in curves.items()}
    out = [
        "Epochs (paper Fig. 1: KL grows with epochs for every initialisation, about linearly before 10 epochs and "
        "faster than linearly after; LeCun and Xavier close to zero early on). Here the cumulative estimate grows "
        "with epochs by construction; growth ratio KL@"
        + str(steps)
        + " / ("
        + str(steps // 10)
        + " × KL@10): "
        + ", ".join(f"{LABELS[k]} {v:.2f}" for k, v in ratios.items())
        + (
            " — faster than linear for every initialisation."
            if all(v > 1.05 for v in ratios.values())
            else " — close to linear where the ratio is within a few % of 1, i.e. no clear superlinear phase for those."
        ),
        "Initialisation at depth "
        + str(s["width_depth"])
        + ", width "
        + str(s["depth_width"])
        + ", "
        + str(steps)
        + " epochs: "
        + ", ".join(f"{LABELS[k]} {c[-1]:.3g}" for k, c in curves.items())
        + f" (He / LeCun = {curves['he'][-1] / curves['lecun'][-1]:.3g}; at epoch 10 LeCun is "
        f"{curves['lecun'][9] / curves['he'][9]:.2g} × He's, "
        f"Xavier {curves['xavier'][9] / curves['he'][9]:.2g} × He's).",
    ]
    for epoch, claim in (
        (
            20,
            "paper Fig. 2a at 20 epochs: He worsens with depth; LeCun and Xavier worsen up to depth "
            "≈ 8 and improve beyond",
        ),
        (steps, "paper Fig. 2b at 50 epochs: all initialisations worsen with depth"),
    ):
        parts = []
        for scheme in SCHEMES:
            values = [
                results[f"{scheme}/{depth}/{s['depth_width']}"]["summary"][f"kl_{epoch}"] for depth in s["depths"]
            ]
            parts.append(f"{LABELS[scheme]} {trend(s['depths'], values)}")
        out.append(f"Depth at {epoch} epochs, width {s['depth_width']} ({claim}): " + "; ".join(parts) + ".")
    parts = []
    for scheme in SCHEMES:
        values = [results[f"{scheme}/{s['width_depth']}/{w}"]["summary"][f"kl_{steps}"] for w in s["widths"]]
        parts.append(f"{LABELS[scheme]} {trend(s['widths'], values)}")
    out.append(
        f"Width at {steps} epochs, depth {s['width_depth']} (paper Fig. 2c: KL grows with width for every "
        "initialisation): " + "; ".join(parts) + "."
    )
    parts = []
    for scheme in SCHEMES:
        values = [
            results[f"{scheme}/{depth}/{s['depth_width']}"]["summary"]["certificate_linearised"]
            for depth in s["depths"]
        ]
        parts.append(f"{LABELS[scheme]} {trend(s['depths'], values)}")
    out.append("For comparison, Table 1's B (the linearised certificate) along depth: " + "; ".join(parts) + ".")
    if report.get("long"):
        long, depths, width, long_steps = report["long"], s["long_depths"], s["long_width"], s["long_steps"]
        parts = []
        for scheme in ("lecun", "xavier"):
            early = [long[f"{scheme}/{d}/{width}"]["summary"][f"kl_{steps}"] for d in depths]
            late = [long[f"{scheme}/{d}/{width}"]["summary"][f"kl_{long_steps}"] for d in depths]
            parts.append(
                f"{LABELS[scheme]} at {steps} epochs {trend(depths, early)}, at {long_steps} epochs "
                f"{trend(depths, late)} (depth {depths[0]} / depth {depths[-1]}: {early[0] / early[-1]:.3g} → "
                f"{late[0] / late[-1]:.3g})"
            )
        out.append(f"Longer training (width {width}, {s['long_runs']} run(s)): " + "; ".join(parts) + ".")
    return out


# ------------------------------------------------------------------------------------------- output


def figures(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args = report["settings"]
    results = report["results"]
    colours = {"lecun": "tab:blue", "xavier": "tab:orange", "he": "tab:green"}
    epochs = np.arange(1, args["steps"] + 1)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for scheme in SCHEMES:
        curves = np.array(results[f"{scheme}/{args['width_depth']}/{args['depth_width']}"]["by_epoch"])
        mean, std = curves.mean(0), curves.std(0, ddof=1) if len(curves) > 1 else np.zeros(len(epochs))
        axes[0].plot(epochs, mean, label=LABELS[scheme], color=colours[scheme])
        axes[0].fill_between(epochs, np.maximum(mean - std, 1e-12), mean + std, alpha=0.2, color=colours[scheme])
        axes[1].plot(epochs, mean / mean[-1], label=LABELS[scheme], color=colours[scheme])
    axes[1].plot(epochs, epochs / epochs[-1], "k:", label="linear in epochs")
    axes[0].set(
        yscale="log",
        xlabel="epochs (= full-batch steps)",
        ylabel="estimated KL (worst neighbour)",
        title=f"depth {args['width_depth']}, width {args['depth_width']}",
    )
    axes[1].set(xlabel="epochs", ylabel="KL / KL at the last epoch", title="shape of the growth")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "kl_init_fmnist_epochs.png", dpi=120)
    plt.close(fig)

    for name, key, values, fixed in (
        ("depth", "depth", args["depths"], f"width {args['depth_width']}"),
        ("width", "width", args["widths"], f"depth {args['width_depth']}"),
    ):
        long = report.get("long") if key == "depth" else None
        fig, axes = plt.subplots(1, 3 if long else 2, figsize=(15 if long else 10, 4))
        if long:
            ax = axes[2]
            for scheme in ("lecun", "xavier"):
                for epoch, style in ((args["steps"], ":"), (args["long_steps"], "-")):
                    entries = [
                        long[f"{scheme}/{depth}/{args['long_width']}"]["summary"] for depth in args["long_depths"]
                    ]
                    ax.plot(
                        args["long_depths"],
                        [e[f"kl_{epoch}"] for e in entries],
                        style,
                        marker="o",
                        color=colours[scheme],
                        label=f"{LABELS[scheme]}, {epoch} epochs",
                    )
            ax.set(
                yscale="log",
                xlabel="depth",
                ylabel="estimated KL (worst neighbour)",
                title=f"longer training, width {args['long_width']}",
            )
            ax.legend()
        # the first two panels; a third, when there is one, is the longer training drawn above (strict=False)
        for ax, epoch in zip(axes, (20, args["steps"]), strict=False):
            for scheme in SCHEMES:
                entries = [
                    results[
                        f"{scheme}/{v if key == 'depth' else args['width_depth']}/"
                        f"{args['depth_width'] if key == 'depth' else v}"
                    ]["summary"]
                    for v in values
                ]
                ax.errorbar(
                    values,
                    [e[f"kl_{epoch}"] for e in entries],
                    yerr=[e[f"kl_{epoch}_std"] for e in entries],
                    marker="o",
                    capsize=3,
                    label=LABELS[scheme],
                    color=colours[scheme],
                )
            ax.set(yscale="log", xlabel=name, ylabel="estimated KL (worst neighbour)", title=f"{epoch} epochs, {fixed}")
            if key == "width":
                ax.set_xscale("log", base=2)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"kl_init_fmnist_{name}.png", dpi=120)
        plt.close(fig)


def command(settings: dict[str, Any]) -> str:
    parts = [
        "python benchmarks/kl_init_fmnist.py",
        f"--n {settings['n']}",
        f"--runs {settings['runs']}",
        f"--steps {settings['steps']}",
        f"--learning-rate {settings['learning_rate']:g}",
        f"--sigma {settings['sigma']:g}",
        "--depths " + " ".join(map(str, settings["depths"])),
        f"--depth-width {settings['depth_width']}",
        "--widths " + " ".join(map(str, settings["widths"])),
        f"--width-depth {settings['width_depth']}",
        f"--added {settings['added']}",
        f"--linearised-runs {settings['linearised_runs']}",
        f"--long-steps {settings['long_steps']}",
        "--long-depths " + " ".join(map(str, settings["long_depths"])),
        f"--long-width {settings['long_width']}",
        f"--long-runs {settings['long_runs']}",
    ]
    return " ".join(parts)


def fmt(summary: dict[str, Any], epoch: int) -> str:
    return f"{summary[f'kl_{epoch}']:.3g} ± {summary[f'kl_{epoch}_std']:.2g}"


def write(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report["command"] = command(report["settings"])
    (out / "kl_init_fmnist.json").write_text(json.dumps(report, indent=1))
    s = report["settings"]
    results = report["results"]
    steps = s["steps"]
    lines = [
        "# Seed 000 on Fashion-MNIST: estimated KL privacy loss vs epochs, depth, width and initialisation",
        "",
        f"Command: `{command(s)}` — {report['seconds']:.0f} s in all, one CPU thread. Machine: "
        f"{platform.machine()}, torch {torch.__version__}.",
        "",
        f"T-shirt/top vs Shirt, n = {s['n']} training images (balanced), inputs pixels/255 rescaled to ‖x‖ = √d = 28, "
        f"bias-free ReLU MLP with 2 outputs, softmax cross-entropy; noisy GD without clipping, full batch, "
        f"η = {s['learning_rate']:g}, σ = {s['sigma']:g}, {steps} epochs = {steps} steps. "
        f"**Estimated** KL (Eq. 74, constant 1/(2σ²)) along the trajectory trained on D, worst over all {s['n']} "
        f"remove-one neighbours and {s['added']} add-one neighbours (held-out test images); mean ± std over "
        f"{s['runs']} runs of each run's worst (as in the paper's figures); \"run-avg worst\" = the worst neighbour "
        'of the per-neighbour mean over runs. Not certificates. "Cor. 4.2 (lin.)" = 2BKη/(n²σ²) with Table 1\'s B '
        "(‖x‖² = d): a certificate for the *linearised* network only, shown for its trend.",
        "",
    ]
    lines += [
        "## KL vs epochs (`kl_init_fmnist_epochs.png`)",
        "",
        f"Depth {s['width_depth']}, width {s['depth_width']}. Growth ratio = KL at epoch {steps} / "
        f"({steps}/10 × KL at epoch 10): 1 for linear growth, > 1 faster than linear.",
        "",
        "| init | KL @ 1 | KL @ 10 | KL @ 20 | KL @ " + str(steps) + " | growth ratio | loss start → end |",
        "|---|---|---|---|---|---|---|",
    ]
    for scheme in SCHEMES:
        entry = results[f"{scheme}/{s['width_depth']}/{s['depth_width']}"]
        curve = np.array(entry["by_epoch"]).mean(0)
        losses = np.array(entry["losses"]).mean(0)
        lines.append(
            f"| {LABELS[scheme]} | {curve[0]:.3g} | {curve[9]:.3g} | {curve[19]:.3g} | {curve[-1]:.3g} | "
            f"{curve[-1] / (steps / 10 * curve[9]):.3f} | {losses[0]:.4f} → {losses[1]:.4f} |"
        )
    for name, key, values in (("depth", "depth", s["depths"]), ("width", "width", s["widths"])):
        fixed = f"width {s['depth_width']}" if key == "depth" else f"depth {s['width_depth']}"
        lines += [
            "",
            f"## KL vs {name} (`kl_init_fmnist_{name}.png`), {fixed}",
            "",
            f"| init | {name} | KL @ 20 epochs | KL @ {steps} epochs | run-avg worst @ {steps} | worst relation | "
            f"Cor. 4.2 (lin.) | loss start → end | seconds |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for scheme in SCHEMES:
            for v in values:
                depth, width = (v, s["depth_width"]) if key == "depth" else (s["width_depth"], v)
                e = results[f"{scheme}/{depth}/{width}"]["summary"]
                lines.append(
                    f"| {LABELS[scheme]} | {v} | {fmt(e, 20)} | {fmt(e, steps)} | {e['kl_run_averaged_worst']:.3g} | "
                    f"{e['worst_relation']} | {e['certificate_linearised']:.3g} | "
                    f"{e['initial_loss']:.4f} → {e['final_loss']:.4f} | {e['seconds']:.0f} |"
                )
    if report.get("long"):
        long_steps = s["long_steps"]
        lines += [
            "",
            f"## Longer training: depth trend after {long_steps} epochs (third panel of `kl_init_fmnist_depth.png`)",
            "",
            f"Width {s['long_width']}, same η and σ, {s['long_runs']} run(s) per row (mean of the per-run worst).",
            "",
            f"| init | depth | KL @ {steps} epochs | KL @ {long_steps} epochs | loss start → end |",
            "|---|---|---|---|---|",
        ]
        for key, entry in report["long"].items():
            e = entry["summary"]
            lines.append(
                f"| {LABELS[entry['scheme']]} | {entry['depth']} | {e[f'kl_{steps}']:.3g} | "
                f"{e[f'kl_{long_steps}']:.3g} | {e['initial_loss']:.4f} → {e['final_loss']:.4f} |"
            )
    if report.get("linearised"):
        row0 = report["linearised"][0]
        lines += [
            "",
            "## Linearised network (Eq. 3): estimate vs the Cor. 4.2 certificate",
            "",
            f"Depth {row0['depth']}, width {row0['width']}, same data and noisy GD, {row0['runs']} runs; estimate = "
            f"worst over {s['linearised_probes']} remove-one and {s['linearised_probes']} add-one neighbours of "
            "the run-averaged Eq. 74 sum; certificate = 2BKη/(n'²σ²), n' = n − 1 (remove) or n + 1 (add).",
            "",
            "| init | remove-one estimate | certificate | ratio | add-one estimate | certificate | ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in report["linearised"]:
            r, a = row["remove_one"], row["add_one"]
            lines.append(
                f"| {LABELS[row['scheme']]} | {r['estimate']:.3g} | {r['certificate']:.3g} | "
                f"{r['estimate'] / r['certificate']:.3f} | {a['estimate']:.3g} | {a['certificate']:.3g} | "
                f"{a['estimate'] / a['certificate']:.3f} |"
            )
    if report.get("readings"):
        lines += ["", "## Readings against the paper", ""] + [f"- {text}" for text in report["readings"]]
    (out / "kl_init_fmnist.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--sigma", type=float, default=0.01)
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 6, 8, 10, 12])
    parser.add_argument("--depth-width", type=int, default=256)
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    parser.add_argument("--width-depth", type=int, default=10)
    parser.add_argument("--added", type=int, default=200)
    parser.add_argument("--linearised-runs", type=int, default=2)
    parser.add_argument("--linearised-depth", type=int, default=4)
    parser.add_argument("--linearised-width", type=int, default=64)
    parser.add_argument("--linearised-probes", type=int, default=32)
    parser.add_argument("--long-steps", type=int, default=300)
    parser.add_argument("--long-depths", type=int, nargs="+", default=[4, 8, 12])
    parser.add_argument("--long-width", type=int, default=128)
    parser.add_argument("--long-runs", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.steps < 20 or args.width_depth not in args.depths or args.depth_width not in args.widths:
        parser.error("need --steps ≥ 20, --width-depth among --depths and --depth-width among --widths")
    if args.long_runs > 0 and args.long_steps <= args.steps:
        parser.error(f"--long-steps {args.long_steps}: must exceed --steps {args.steps} (or --long-runs 0)")
    torch.set_num_threads(1)
    start = time.perf_counter()
    data = binary_task(args.n, args.added)
    report: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "results": sweep(data, args),
    }
    if args.long_runs > 0:
        report["long"] = long_sweep(data, args)
    if args.linearised_runs > 0:
        report["linearised"] = linearised_check(data, args)
    report["seconds"] = time.perf_counter() - start
    report["readings"] = readings(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    figures(report, out)
    write(report, out)


if __name__ == "__main__":
    main()
