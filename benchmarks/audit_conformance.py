"""Does the audit catch a broken trainer? The default pipeline run with DP-SGD broken five ways.

For digits at ε = 2 (``params.yaml``) and Fashion-MNIST at ε = 3 (``configs/fashion-mnist.yaml``),
train → certify → audit → gate run once with the intact trainer and once under each bug of
:mod:`dpml.audit.broken` (the bug is active in every training the audit does too, as it would be
in a real broken install; the reference-model cache is emptied between cases). Reported per case:
the ε the bug really costs where an accountant can say, the largest gating ε lower bound, the
white-box bound under both canary scorings, which conformance checks failed, the gate's verdict,
and the audit stage's time — with the white-box run (conformance + canary bound) and without it.

    python benchmarks/audit_conformance.py [--dataset digits|fashion-mnist|both] [--max-train N] [--mode tight]
        [--bugs [NAME ...]] [--render]

Writes ``benchmarks/results/audit_conformance.{md,json}`` (``audit_conformance_tight.{md,json}`` with ``--mode
tight``: the one-run audits read through the certified mechanism's own trade-off curve, and gating on it). A data
set not measured by this run keeps its section from the previous results, which states the commit, date and
machine it was measured at.
``--bugs`` runs the intact trainer and only the named bugs (none: the intact trainer alone; default: every bug).
``--render`` only rewrites the page from the stored JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_common import current_commit, fashion_mnist_overrides, without_paths  # noqa: E402  (benchmarks/ is the script's folder)
from dpml import io, stages  # noqa: E402
from dpml.audit import broken  # noqa: E402
from dpml.config import load  # noqa: E402
from dpml.accounting.accountants import certify  # noqa: E402
from dpml.accounting.mechanism import MechanismDescription  # noqa: E402
from dpml.sections import AuditConfig  # noqa: E402
from dpml.stages.layout import Layout  # noqa: E402

CASES: dict[str, Any] = {"intact": contextlib.nullcontext, **broken.BUGS}
AUDIT_DEFAULTS = AuditConfig()  # the white-box canary counts the page names


def true_epsilon(case: str, mechanism: dict[str, Any], delta: float) -> str:
    """What the broken run really costs, where an accountant can price it."""
    if case == "intact":
        return f"{certify(MechanismDescription.from_dict(mechanism), delta)['epsilon']:.3g}"
    if case in ("noise × ½", "last sum counted twice"):  # σ/2; or sensitivity up to 2C, the same worst case
        halved = json.loads(json.dumps(mechanism))
        for event in halved["events"]:
            event["noise_multiplier"] /= 2
        value = f"{certify(MechanismDescription.from_dict(halved), delta)['epsilon']:.3g}"
        return f"≈ {value}" if case == "noise × ½" else f"up to ≈ {value}³"
    return {
        "noise × 0": "∞",
        "clipping removed": "unbounded",
        "shuffled fixed-size batches": "not what was priced¹",
        "noise reused across steps": "not what was priced²",
        "no noise on the last parameter": "∞",
    }[case]


def run_case(config_path: Path, overrides: list[str], case: str, work: Path) -> dict[str, Any]:
    config = load(config_path, overrides)
    layout = Layout(config)
    shutil.rmtree(config.paths.cache, ignore_errors=True)
    with CASES[case]():
        for name in ("train", "certify"):
            stages.run_stage(name, config)
        started = time.perf_counter()
        stages.run_stage("audit", config)
        audit_seconds = time.perf_counter() - started
        decision = stages.run_stage("gate", config)
    audit = io.read_json(layout.audit)
    mechanism = io.read_json(layout.mechanism)
    certificate = io.read_json(layout.certificate)
    white = next((b for b in audit["one_run"] if b["method"] == "one_run_white_box"), None)
    return {
        "case": case,
        "certified_epsilon": certificate["epsilon"],
        "true_epsilon": true_epsilon(case, mechanism, config.dp.delta),
        "max_gating_bound": audit["max_lower_bound"],
        "white_box": None if white is None else {white["scoring"]: white["epsilon"]} | white.get("other_scoring", {}),
        "failed_checks": [c["check"] for c in audit["conformance"]["checks"] if not c["passed"]],
        "check_lines": [c["line"] for c in audit["conformance"]["checks"]],
        "gate_passed": decision["passed"],
        "gate_reasons": decision["reasons"],
        "audit_seconds": audit_seconds,
        "white_box_seconds": audit.get("white_box_seconds", 0.0),
        "power": audit["power"],
        "one_run": [
            {
                k: b.get(k)
                for k in ("method", "epsilon", "inputs", "fdp", "power", "gating", "reading", "noise_scale", "steinke")
            }
            for b in audit["one_run"]
        ],
    }


def audit_without_white_box(config_path: Path, overrides: list[str]) -> float:
    """The audit stage's time with the white-box run switched off (the intact trainer)."""
    config = load(config_path, overrides + ["audit.white_box_canaries=0", "audit.conformance=false"])
    shutil.rmtree(config.paths.cache, ignore_errors=True)
    for name in ("train", "certify"):
        stages.run_stage(name, config)
    started = time.perf_counter()
    stages.run_stage("audit", config)
    return time.perf_counter() - started


def bench(dataset: str, max_train: int | None, work: Path, mode: str, bugs: list[str]) -> dict[str, Any]:
    work = work / dataset
    if dataset == "digits":
        config_path = ROOT / "params.yaml"
        overrides = [
            f"paths.data={work / 'data'}",
            f"paths.artifacts={work / 'artifacts'}",
            f"paths.cache={work / 'cache'}",
            f"ledger.path={work / 'ledger.db'}",
            f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
            f"tracking.artifact_root={work / 'mlartifacts'}",
        ]
    else:
        config_path = ROOT / "configs" / "fashion-mnist.yaml"
        overrides = fashion_mnist_overrides(work)
    overrides += ["ledger.epsilon_budget=100000", "gate.epsilon_budget=100", f"audit.mode={mode}"]
    if max_train:
        overrides.append(f"split.max_train={max_train}")
    config = load(config_path, overrides)
    for name in ("ingest", "split", "preprocess"):
        stages.run_stage(name, config)
    rows = []
    for case in ["intact", *bugs]:
        rows.append(run_case(config_path, overrides, case, work))
        print(
            f"{dataset}: {case}: gate {'passes' if rows[-1]['gate_passed'] else 'fails'}, failed checks "
            f"{rows[-1]['failed_checks']}, audit {rows[-1]['audit_seconds']:.1f} s",
            flush=True,
        )
    baseline = audit_without_white_box(config_path, overrides)
    return {
        "dataset": dataset,
        "max_train": max_train,
        "epsilon": config.dp.target_epsilon,
        "mode": mode,
        "rows": rows,
        "audit_seconds_without_white_box": baseline,
        "commit": current_commit(),
        "measured": datetime.date.today().isoformat(),
        "machine": machine_line(),
    }


def machine_line() -> str:
    """Where and under what load this section was measured (the 15-minute load average at its end)."""
    load = os.getloadavg()[2]
    return (
        f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, Python "
        f"{platform.python_version()}; load average over the last 15 minutes {load:.1f} on {os.cpu_count()} cores"
        + (" (other jobs shared the machine: the times are inflated)" if load > (os.cpu_count() or 1) else "")
    )


def with_earlier_sections(results: list[dict[str, Any]], out: Path, stem: str) -> list[dict[str, Any]]:
    """This run's data sets, and the previous results' sections for the data sets it did not measure."""
    previous = out / f"{stem}.json"
    if not previous.exists():
        return results
    measured = {r["dataset"] for r in results}
    kept = [r for r in json.loads(previous.read_text()) if r["dataset"] not in measured]
    order = ["digits", "fashion-mnist"]
    return sorted(results + kept, key=lambda r: order.index(r["dataset"]) if r["dataset"] in order else len(order))


def write(results: list[dict[str, Any]], out: Path, command: str, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    tight = stem.endswith("_tight")
    lines = [
        "# Does the audit catch a broken trainer?" + (" (`audit.mode: tight`)" if tight else ""),
        "",
        "Command: `python benchmarks/audit_conformance.py [--dataset digits|fashion-mnist]`; each data set's "
        "section says when, at which commit and on what machine it was measured (the verdicts do not depend "
        "on the machine's load; the times do).",
        "",
        "Each row: train → certify → audit → gate with the configuration's defaults (5 attacks with 4 reference "
        "models, a non-private control, 500 black-box and up to "
        + (
            f"{AUDIT_DEFAULTS.tight_white_box_canaries:,} white-box canaries (at most "
            f"{AUDIT_DEFAULTS.tight_guesses} of them guessed)"
            if tight
            else f"{AUDIT_DEFAULTS.white_box_canaries} white-box canaries"
        )
        + ", conformance checks at a joint false-alarm rate of 1e-6), under one bug of `dpml/audit/broken.py` that "
        "the trainer does not report to the accountant. 'Largest bound' is the largest *gating* ε lower bound; the "
        "white-box bound is shown under both scorings (per-step likelihood ratio, the default, and the plain sum).",
        "",
    ]
    for result in results:
        rows = result["rows"]
        lines += [
            f"## {result['dataset']} (ε = {result['epsilon']:g}"
            + (f", {result['max_train']} training records" if result["max_train"] else "")
            + ")",
            "",
            f"Measured at commit {result['commit']} on {result['measured']}"
            + (
                f" (trainers measured: {', '.join(row['case'] for row in rows)}; the others are not in this section)"
                if len(rows) < len(CASES)
                else ""
            )
            + f". `{result.get('command', command)}`"
            + (f" ({result['minutes']:.1f} min)" if "minutes" in result else "")
            + f". Machine: {result.get('machine', 'not recorded')}.",
            "",
            "| trainer | true ε | largest gating bound | white-box bound (LR / sum) "
            "| failed conformance checks | gate | audit s |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            white = row["white_box"] or {}
            wb = f"{white.get('likelihood_ratio', float('nan')):.2f} / {white.get('sum', float('nan')):.2f}"
            failed = ", ".join(row["failed_checks"]) or "none"
            lines.append(
                f"| {row['case']} | {row['true_epsilon']} | {row['max_gating_bound']:.2f} | {wb} | {failed} | "
                f"{'passes' if row['gate_passed'] else '**fails**'} | {row['audit_seconds']:.1f} |"
            )
        intact = rows[0]
        lines += [
            "",
            f"Audit time of the intact run: {intact['audit_seconds']:.1f} s, of which the white-box run "
            f"(conformance checks and canary bound) {intact['white_box_seconds']:.1f} s; the same audit "
            f"without it: {result['audit_seconds_without_white_box']:.1f} s.",
            "",
            "Power of each ε lower-bound method (the largest bound it can report) and whether the gate counts it:",
            "",
            "| method | power | counted |",
            "|---|---|---|",
        ]
        for name, entry in intact["power"].items():
            lines.append(f"| {name} | {entry['power']:.2f} | {'yes' if entry['gating'] else 'no'} |")
        lines += one_run_table(intact, result["epsilon"])
        lines += ["", "The failing check's line, for each bug:", ""] if rows[1:] else []
        for row in rows[1:]:
            failed = [line for line in row["check_lines"] if any(f"'{c}'" in line for c in row["failed_checks"])]
            lines.append(f"- {row['case']}: " + ("; ".join(failed) if failed else "no check failed"))
        lines.append("")
    lines += [
        "¹ The certificate prices Poisson sampling; fixed-size shuffled batches can cost more ε than that "
        "account (Chua et al. 2024, *How private are DP-SGD implementations?*).",
        "² Noise reused across steps cancels in differences of iterates: the all-iterates guarantee is void.",
        "³ One tensor's clipped sum counted twice: an example whose gradient lies in that tensor moves the sum by "
        "up to 2C, the ε of σ/2 at sensitivity C.",
        "",
    ]
    if tight:
        lines += [
            "In `audit.mode: tight` the one-run audits' gating bound is their guesses read through the certified "
            "mechanism's own trade-off curve (`dpml/audit/one_run_fdp.py`); the white-box column shows that "
            "reading under both scorings.",
            "",
        ]
    (out / f"{stem}.md").write_text("\n".join(lines))


def one_run_table(intact: dict[str, Any], epsilon: float) -> list[str]:
    """The intact run's one-run audits: Steinke et al.'s bound beside its f-DP reading through a Gaussian
    curve (Mahloujifar et al. 2025; informational, never gating), each with its power, against the certified ε."""
    runs = [b for b in intact.get("one_run", []) if b.get("fdp")]
    if not runs:
        return []
    lines = [
        "",
        f"One-run audits of the intact run (certified ε = {epsilon:g}): the Steinke–Nasr–Jagielski bound and its "
        "f-DP reading (largest μ-GDP rejected, and that μ's ε at the run's δ; it assumes a Gaussian trade-off "
        "curve and never gates), each with its power (every guess right):",
        "",
        "| method | right / guesses / canaries | Steinke ε | f-DP μ (power) | f-DP ε (power) | mechanism curve ε "
        "(noise scale rejected) | gating ε (power) |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in runs:
        i, f = b["inputs"], b["fdp"]
        tight = b.get("reading") == "mechanism_curve"
        steinke = b["steinke"]["epsilon"] if tight else b["epsilon"]
        curve = f"{b['epsilon']:.2f} ({b['noise_scale']:.3g})" if tight else "—"
        lines.append(
            f"| {b['method']} | {i['correct']} / {i['guesses']} / {i['canaries']} | {steinke:.2f} | {f['mu']:.3f} "
            f"({f['power_mu']:.3f}) | {f['epsilon']:.2f} ({f['power']:.2f}) | {curve} | {b['epsilon']:.2f} "
            f"({b.get('power', float('nan')):.2f}) |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=["digits", "fashion-mnist", "both"], default="both")
    parser.add_argument("--max-train", type=int, default=10000, help="Fashion-MNIST training records")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "dpml-conformance-bench"))
    parser.add_argument("--render", action="store_true", help="only rewrite the page from the stored JSON")
    parser.add_argument("--mode", choices=["standard", "tight"], default="standard", help="audit.mode")
    parser.add_argument(
        "--bugs",
        nargs="*",
        choices=list(broken.BUGS),
        default=list(broken.BUGS),
        help="the bugs to run (none: only intact)",
    )
    args = parser.parse_args()
    stem = "audit_conformance" + ("_tight" if args.mode == "tight" else "")
    datasets = ["digits", "fashion-mnist"] if args.dataset == "both" else [args.dataset]
    command = "python " + " ".join(["benchmarks/audit_conformance.py", *without_paths(sys.argv[1:])])
    if args.render:
        write(json.loads((Path(args.out) / f"{stem}.json").read_text()), Path(args.out), command, stem)
        return
    results = []
    for dataset in datasets:
        started = time.perf_counter()
        max_train = args.max_train if dataset == "fashion-mnist" else None
        result = bench(dataset, max_train, Path(args.work), args.mode, args.bugs)
        results.append(result | {"command": command, "minutes": (time.perf_counter() - started) / 60})
    write(with_earlier_sections(results, Path(args.out), stem), Path(args.out), command, stem)


if __name__ == "__main__":
    main()
