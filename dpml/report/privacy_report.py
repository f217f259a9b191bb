"""The privacy report: what was guaranteed, how it was computed, and what the audit found."""

from __future__ import annotations

from typing import Any

from dpml.audit.robustness import robustness_units
from dpml.formatting import format_epsilon
from dpml.accounting.mechanism import Selection
from dpml.report.verdict import bound_meaning, verdict_lines


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


def _kl_certificate(certificate: dict[str, Any]) -> list[str]:
    """Seed 000's KL certificate: what it bounds, both computations of B, and what it is not."""
    lines = [f"**Guarantee.** {certificate['statement']}.", ""]
    if certificate["answers"]:
        lines += ["| KL accountant | B | KL bound | used for certificate | error |", "|---|---|---|---|---|"]
        for answer in certificate["answers"]:
            lines.append(
                f"| {answer['name']} | {_fmt(answer['constant'])} | {_fmt(answer['kl'])} | "
                f"{'yes' if answer['used_for_certificate'] else 'cross-check'} | {answer['error'] or ''} |"
            )
    mech = certificate["mechanism"]
    event = mech["events"][0]
    lines += [
        "",
        "**Mechanism.**",
        "",
        f"- noisy gradient descent without clipping: {event['steps']} full-batch steps, η = "
        f"{_fmt(event['learning_rate'])}, noise sqrt(2ησ²)·N(0, I) with σ = {_fmt(event['sigma'])}; "
        f"bias-free ReLU network {'-'.join(map(str, event['widths']))}, {event['scheme']} initialisation, "
        f"{'linearised at W0' if event['linearised'] else 'not linearised'}; inputs ‖x‖ ≤ "
        f"{_fmt(event['input_norm'])}; n = {mech['dataset_size']} training records, {mech['neighbouring']}",
    ]
    lines += [f"- {note}" for note in mech.get("notes", [])]
    return lines


def lineage_lines(ledger: dict[str, Any], budget: float | None, excluded: int = 0) -> list[str]:
    """The lineage paragraph: what every release of this data set together has cost its people."""
    levels = ", ".join(f"{count:,} at ε = {format_epsilon(eps)}" for eps, count in ledger["unit_epsilon"][:8])
    more = len(ledger["unit_epsilon"]) - 8
    lines = [
        f"**Lineage {ledger['lineage']!r}: every release together.** The ε above is what this model alone costs "
        "each person whose record trained it. Across all "
        f"{ledger['private_spends']} DP releases of this data set ({len(ledger['dataset_versions'])} version(s)), "
        f"the most exposed person has ε = {format_epsilon(ledger['epsilon_total'])} at δ = {ledger['delta']:g} "
        f"(budget {_fmt(budget)} per person): each person's loss is the composition of the releases that "
        "used their record.",
    ]
    if levels:
        lines.append(f"People by ε: {levels}" + (f", and {more} more levels" if more > 0 else "") + ".")
    if ledger["unknown_unit_spends"]:
        lines.append(
            f"{len(ledger['unknown_unit_spends'])} release(s) recorded before units were tracked are "
            "charged to every person of the lineage."
        )
    if excluded:
        lines.append(
            f"{excluded:,} people whose budget was spent were left out of this model's training data "
            "(ledger.on_exhausted: exclude; an individual Rényi filter, Feldman & Zrnic 2021)."
        )
    if ledger["nonprivate_runs"]:
        lines.append(
            f"{ledger['nonprivate_runs']} non-private baseline run(s) also used this data; their models "
            "carry no guarantee and must not leave this registry."
        )
    if ledger.get("kl_total") is not None:
        lines.append(
            f"KL-private releases sum to KL = {ledger['kl_total']:.4g} for the most exposed person (the "
            "(ε, δ) loss is unbounded once a KL-only release used a record)."
        )
    return lines


def one_run_lines(bound: dict[str, Any]) -> list[str]:
    """A one-run audit: its Steinke–Nasr–Jagielski bound with the guesses behind it, and beneath it the f-DP
    reading of the same guesses through a Gaussian curve (informational: it assumes that curve)."""
    i = bound["inputs"]
    lines = [
        f"- {bound['method']}: ε ≥ {bound['epsilon']:.4g} at confidence {bound['confidence']:.4g} "
        f"({i['correct']}/{i['guesses']} guesses right among {i['canaries']} canaries)"
    ]
    if bound.get("reading") == "mechanism_curve":
        lines.append(
            "  - read through the certified mechanism's own trade-off curve (audit.mode: tight): the guesses reject "
            f"it with its noise scaled by {bound['noise_scale']:.3g}"
            + (" — at or below 1: the release is less private than certified" if bound["noise_scale"] <= 1 else "")
            + f"; the (ε, δ) reading of the same guesses (Steinke et al.) gives ε ≥ {bound['steinke']['epsilon']:.4g}"
        )
    elif bound.get("reading_note"):
        lines.append(f"  - audit.mode: tight could not be used: {bound['reading_note']}")
    fdp = bound.get("fdp")
    if fdp:
        lines.append(
            f"  - f-DP reading (Gaussian curve, informational): μ ≥ {fdp['mu']:.3g}, i.e. ε ≥ {fdp['epsilon']:.4g} at "
            f"δ = {i['delta']:g} (power: μ {fdp['power_mu']:.3g}, ε {fdp['power']:.4g}); it assumes "
            f"{fdp['assumption']} and never gates"
        )
    return lines


def _power_lines(audit: dict[str, Any]) -> list[str]:
    """Each ε lower-bound method's power: the largest bound it could report, computed before training."""
    if not audit.get("power"):
        return []
    lines = [
        "",
        "**Power of each ε lower bound** (its value if every guess were right, computed before training). "
        "A method whose power is below the certified ε could not show a violation of it, so it is not "
        "counted as evidence and takes no share of the confidence budget:",
        "",
        "| method | power | counted |",
        "|---|---|---|",
    ]
    for name, entry in audit["power"].items():
        lines.append(
            f"| {name} | {entry['power']:.3f} | {'yes' if entry['gating'] else 'no — ' + entry.get('note', '')} |"
        )
    return lines


def _conformance_lines(audit: dict[str, Any]) -> list[str]:
    """The trainer checked against its certificate: noise, clipping, sampling (``dpml.audit.conformance``)."""
    conformance = audit.get("conformance")
    if not conformance:
        return []
    if not conformance["ran"]:
        return ["", f"**Conformance** not checked: {conformance['reason']}."]
    lines = [
        "",
        "**Conformance of the trainer to its certificate** (one extra training run with gradient canaries "
        "of norm 5C through the trainer's own sampler and clipping; every update recomputed by the auditor; "
        f"joint false-alarm rate {conformance['false_alarm']:g}):",
        "",
    ]
    lines += [f"- {'passed' if c['passed'] else '**FAILED**'}: {c['line']}" for c in conformance["checks"]]
    return lines


def render(
    *,
    data: dict[str, Any],
    train: dict[str, Any],
    certificate: dict[str, Any] | None,
    audit: dict[str, Any],
    gate: dict[str, Any],
    ledger: dict[str, Any] | None = None,
    budget: float | None = None,
) -> str:
    """Markdown for MLflow and the Prefect UI; every number comes from the stage outputs."""
    lines = ["# dpml privacy report", "", f"**Release gate: {gate['verdict']['title']}.**", ""]
    lines += [f"- {line.strip()}" for line in verdict_lines(gate["verdict"])] + [""]
    if certificate is None:
        lines += ["**No privacy guarantee**: this model was trained without differential privacy.", ""]
    elif certificate.get("kind") == "kl":
        lines += _kl_certificate(certificate)
    else:
        lines += [f"**Guarantee.** {certificate['statement']}.", ""]
        lines += ["| accountant | version | ε | used for certificate | error |", "|---|---|---|---|---|"]
        for answer in certificate["answers"]:
            lines.append(
                f"| {answer['name']} | {answer['version']} | {format_epsilon(answer['epsilon'])} | "
                f"{'yes' if answer['used_for_certificate'] else 'cross-check'} | {answer['error'] or ''} |"
            )
        mech = certificate["mechanism"]
        lines += ["", "**Mechanism.**", ""]
        for event in mech["events"]:
            if event.get("kind") == "gdp":
                lines.append(
                    f"- μ-GDP with μ = {_fmt(event['mu'])} (the whole training run, final model only; "
                    "exact conversion to (ε, δ) by the Gaussian trade-off function)"
                )
            elif event.get("kind") == "zcdp":
                lines.append(
                    f"- ρ-zCDP with ρ = {_fmt(event['rho'])} (the whole training run, final model only; "
                    "converted to (ε, δ) through its Rényi curve ρα)"
                )
            elif event["sample_rate"] == 1.0:
                lines.append(
                    f"- Gaussian mechanism (no subsampling): noise multiplier "
                    f"σ = {_fmt(event['noise_multiplier'])}, {event['steps']} release(s)"
                )
            else:
                lines.append(
                    f"- Poisson-subsampled Gaussian: rate q = {_fmt(event['sample_rate'])}, noise multiplier "
                    f"σ = {_fmt(event['noise_multiplier'])}, {event['steps']} steps"
                )
        if mech.get("selection"):
            lines.append(
                f"- hyperparameter search: {Selection(**mech['selection']).describe()}; the events above are "
                "one candidate; only the best candidate is released, and the certificate charges the search"
            )
        lines.append(
            f"- clip norm C = {_fmt(mech['clip_norm'])}, L2 sensitivity {_fmt(mech['sensitivity'])} "
            f"under {mech['neighbouring']}; n = {mech['dataset_size']} training records"
        )
        lines += [f"- {note}" for note in mech.get("notes", [])]
    if ledger is not None:
        lines += ["", *lineage_lines(ledger, budget, train.get("units_excluded", 0))]
    robust = sorted(
        (int(k.rsplit("_r", 1)[1]), v) for k, v in train.items() if k.startswith("robust_certified_accuracy_r")
    )
    if robust:
        lines += [
            "",
            f"**Certified robustness** (Lipschitz constant ℓ = {train['robust_lipschitz']:.4g}; "
            f"{robustness_units(data['clip_mode'], data.get('features', 'none'))}; radius margin/(ℓ√2)).",
            "",
            "| radius (×1/255) | " + " | ".join(str(k) for k, _ in robust) + " |",
            "|---" * (len(robust) + 1) + "|",
            "| certified test accuracy | " + " | ".join(f"{v:.4f}" for _, v in robust) + " |",
        ]
    lines += ["", "**Data.**", ""]
    lines.append(f"- source `{data['origin']}`, version (content SHA-256) `{data['version']}`")
    lines.append(f"- train / test / audit population: {data['n_train']} / {data['n_test']} / {data['n_audit']}")
    if data.get("schema"):
        kinds = list(data["schema"].values())
        scaling = (
            f"the declared public schema: {kinds.count('numeric')} numeric column(s) clipped and scaled to "
            f"[0, 1] by their own bounds, {kinds.count('categorical')} categorical column(s) one-hot with "
            "<missing>/<other> slots (nothing computed from the records)"
        )
    else:
        scaling = f"public scaling to [0, 1] with bounds [{_fmt(data['lower'])}, {_fmt(data['upper'])}]"
    lines.append(
        f"- {scaling}; input norm clipping to X0 = {_fmt(data['clip_norm'])} ({data['clip_mode']}): "
        f"{100 * data['clipped_fraction_train']:.1f}% of training records changed"
    )
    lines += ["", "**Utility.**", ""]
    lines.append(f"- test accuracy {_fmt(train['test_accuracy'])}, train accuracy {_fmt(train['train_accuracy'])}")
    lines.append(
        "- measured on the records themselves without noise (as the clipped fraction above and the audit below): "
        "the guarantee covers the model, not this report's figures"
    )
    if "noisy_validation_accuracy" in train:
        chosen = {k.removeprefix("chosen."): v for k, v in train.items() if k.startswith("chosen.")}
        lines.append(
            f"- chosen by the private search: {chosen} (noisy validation accuracy "
            f"{_fmt(train['noisy_validation_accuracy'])})"
        )
    lines += _audit_section(audit)
    lines += ["", "**The gate's reasons.**", ""]
    lines += [f"- {reason}" for reason in gate["reasons"]]
    return "\n".join(lines) + "\n"


def _attack_table(attacks: dict[str, Any]) -> list[str]:
    lines = [
        "| attack | AUC [95% CI] | TPR @ 1% FPR | TPR @ 0.1% FPR | TPR @ 0% FPR "
        "| ε lower bound (test) | ε (GDP, informational) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in attacks.items():
        ci = f" [{r['auc_ci_low']:.3f}, {r['auc_ci_high']:.3f}]" if "auc_ci_low" in r else ""
        test, gdp = (next(b["epsilon"] for b in r["bounds"] if b["method"] == m) for m in ("hypothesis_test", "gdp"))
        lines.append(
            f"| {name} | {r['auc']:.3f}{ci} | {_fmt(r['tpr_at_1pct_fpr'])} | {_fmt(r['tpr_at_0.1pct_fpr'])} | "
            f"{_fmt(r['tpr_at_0pct_fpr'])} | {_fmt(test)} | {_fmt(gdp)} |"
        )
    return lines


def _audit_section(audit: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "**Membership-inference audit.** Members: training records; non-members: audit population "
        f"(never trained on); {audit['records_per_side']} of each, {audit['population']} population records "
        f"for RMIA; {audit['references']['per_subject']} reference models per audited model "
        f"({audit['references']['models']} models, {audit['references']['training_seconds']:.1f} s of training).",
        "",
    ]
    lines += ["Released model:", ""] + _attack_table(audit["target"]["attacks"])
    if "control" in audit:
        lines += ["", "Positive control (same split, same model, trained without DP):", ""]
        lines += _attack_table(audit["control"]["attacks"])
    if audit["one_run"]:
        lines += [
            "",
            "One-run audits (Steinke, Nasr, Jagielski 2023; f-DP reading: Mahloujifar, Melis, Chaudhuri 2025):",
            "",
        ]
        for b in audit["one_run"]:
            lines += one_run_lines(b)
    lines += [
        "",
        f"Bounds are computed at confidence {audit['per_bound_confidence']:.4g} each so that all "
        f"{audit['gating_bounds']} bounds the gate uses hold jointly with confidence {audit['confidence']:g}. "
        "Hypothesis-test bounds from one model treat records as independent trials; GDP-converted bounds "
        "assume a Gaussian trade-off curve and never gate. The audit's own training runs (reference models, "
        "control, canary runs) use the private data; their outputs are published only as these aggregates "
        "and their privacy cost is not charged to the release.",
        f"Largest gating lower bound: **{bound_meaning(audit)}**",
    ]
    lines += _power_lines(audit) + _conformance_lines(audit)
    if "reconstruction" in audit:
        lines += [
            "",
            "**Reconstruction attack** (Iurada, Bombari, Tommasi & Mondelli: training inputs recovered from a "
            "random-features model's weights alone; best-match |cosine| overlap per training record, chance = "
            "random directions):",
            "",
        ]
        for subject, r in audit["reconstruction"].items():
            if "skipped" in r:
                lines.append(f"- {subject}: skipped — {r['skipped']}")
                continue
            s, c = r["summary"], r["chance_summary"]
            lines.append(
                f"- {subject}: mean overlap {s['mean']:.3f} (chance {c['mean']:.3f}), "
                f"{s['fraction_above_0.9']:.1%} of {r['n_train']} records above 0.9; "
                f"p/(d·n) = {r['p_over_dn']:.3g}"
            )
    return lines
