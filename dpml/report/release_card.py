"""The release card: one self-contained HTML page per release, for a reviewer who decides from one page.

Verdict first (the three parts of :mod:`dpml.report.verdict`), then the guarantee in plain words, the
release's identity (model, version, run, commit, data version, date), the ROC of every attack against
the limit the certificate puts on *any* attack, the conformance checks, the audit's stated power and the
ledger's per-person spend across releases. No network: styles inline, plots as inline SVG, no script —
MLflow's artifact viewer and a browser opening the file from disk show the same page.

**The DP limit on an attack's ROC.** (ε, δ)-DP bounds every membership test's true-positive rate at
false-positive rate α (Kairouz, Oh & Viswanath 2015, Thm. 2.1; the trade-off function of Dong, Roth &
Su 2022, eq. 6):  TPR(α) ≤ min(1, e^ε·α + δ, 1 − e^{−ε}·(1 − δ − α)).  An attack curve above it
would refute the certificate (the audit's lower bounds test exactly that, with confidence).
"""

from __future__ import annotations

import html
import math
from typing import Any

import numpy as np

from dpml.audit.bounds import dp_limit_tpr
from dpml.formatting import format_epsilon
from dpml.report.verdict import PARTS, SCORES, bound_meaning

LOW_FPR = 1e-3  # the ROC plot's left edge (log axes)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
WORD_COLOURS = {1: "#1b7f3b", 0: "#8a6d00", -1: "#b00020"}


def roc_points(member: np.ndarray, nonmember: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The attack's empirical ROC (higher score = member), every threshold: (FPR, TPR), both from 0 to 1."""
    scores = np.concatenate([member, nonmember])
    labels = np.concatenate([np.ones(member.size), np.zeros(nonmember.size)])
    order = np.argsort(-scores, kind="stable")
    tpr = np.concatenate([[0.0], np.cumsum(labels[order]) / max(member.size, 1)])
    fpr = np.concatenate([[0.0], np.cumsum(1 - labels[order]) / max(nonmember.size, 1)])
    return fpr, tpr


def plain_words(certificate: dict[str, Any] | None) -> str:
    """What the certificate promises one person, and what it does not (HTML paragraph text)."""
    if certificate is None:
        return (
            "<strong>No privacy guarantee.</strong> This model was trained without differential privacy: "
            "nothing limits what it reveals about any person whose record trained it."
        )
    if certificate.get("kind") == "kl":
        return (
            f"<strong>KL privacy, not (ε, δ)-DP.</strong> The certified KL divergence is {certificate['kl']:.4g}: "
            f"any test of whether one person's record was used has TPR − FPR ≤ {certificate['pinsker_delta']:.4g} "
            "(Pinsker), but no finite ε holds."
        )
    epsilon, delta = float(certificate["epsilon"]), float(certificate["delta"])
    if math.isinf(epsilon):
        return "<strong>No finite guarantee.</strong> The certificate does not bound ε."
    ratio = math.exp(min(epsilon, 700.0))
    catch = float(dp_limit_tpr(np.array([0.01]), epsilon, delta)[0])
    return (
        f"<strong>ε = {format_epsilon(epsilon)} at δ = {delta:g}.</strong> Whether or not one person's record was "
        f"used to train this model, any outcome of the training is at most {ratio:.3g} times as likely "
        f"(e<sup>ε</sup>), except with probability δ = {delta:g}. So an attacker who knows everything else — "
        f"every other record, the code, the model — and tests whether a given person was in the training data "
        f"can, if it wrongly accuses only 1% of people who were not, catch at most {100 * catch:.3g}% of those "
        "who were. The guarantee covers each person's whole contribution under the neighbouring relation "
        "below; it does not cover what other releases of the same people reveal (the ledger adds them up), nor "
        "facts true of the population as a whole."
    )


def _e(value: Any) -> str:
    return html.escape(str(value))


def _svg_roc(curves: dict[str, tuple[np.ndarray, np.ndarray]], epsilon: float | None, delta: float | None) -> str:
    """Log–log ROC (FPR from 1e-3 to 1) of every attack, the DP limit curve and the chance line, as inline SVG."""
    width, height, pad = 520, 400, 48

    def x(f: np.ndarray) -> np.ndarray:
        return pad + (np.log10(np.clip(f, LOW_FPR, 1)) - math.log10(LOW_FPR)) / -math.log10(LOW_FPR) * (width - 2 * pad)

    def y(t: np.ndarray) -> np.ndarray:
        return (
            height
            - pad
            - (np.log10(np.clip(t, LOW_FPR, 1)) - math.log10(LOW_FPR)) / -math.log10(LOW_FPR) * (height - 2 * pad)
        )

    def path(f: np.ndarray, t: np.ndarray) -> str:
        keep = f >= LOW_FPR
        xs, ys = x(f[keep]), y(t[keep])
        return " ".join(f"{'M' if i == 0 else 'L'}{a:.1f},{b:.1f}" for i, (a, b) in enumerate(zip(xs, ys, strict=True)))

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        'aria-label="ROC of every attack against the DP limit">',
        f'<rect x="{pad}" y="{pad}" width="{width - 2 * pad}" height="{height - 2 * pad}" fill="none" stroke="#999"/>',
    ]
    for tick in (1e-3, 1e-2, 1e-1, 1.0):
        tx, ty = float(x(np.array([tick]))[0]), float(y(np.array([tick]))[0])
        parts.append(f'<text x="{tx:.1f}" y="{height - pad + 16}" font-size="11" text-anchor="middle">{tick:g}</text>')
        parts.append(f'<text x="{pad - 6}" y="{ty + 4:.1f}" font-size="11" text-anchor="end">{tick:g}</text>')
    parts.append(
        f'<text x="{width / 2}" y="{height - 8}" font-size="12" text-anchor="middle">false-positive rate</text>'
    )
    parts.append(
        f'<text x="14" y="{height / 2}" font-size="12" text-anchor="middle" '
        f'transform="rotate(-90 14 {height / 2})">true-positive rate</text>'
    )
    grid = np.logspace(math.log10(LOW_FPR), 0, 200)
    parts.append(f'<path d="{path(grid, grid)}" fill="none" stroke="#888" stroke-dasharray="4 4"/>')
    legend = [("chance", "#888", "4 4")]
    if epsilon is not None and not math.isinf(epsilon):
        parts.append(
            f'<path d="{path(grid, dp_limit_tpr(grid, epsilon, delta or 0.0))}" fill="none" stroke="#b00020" '
            'stroke-width="2.5"/>'
        )
        legend.append((f"DP limit (ε = {format_epsilon(epsilon)})", "#b00020", ""))
    for i, (name, (f, t)) in enumerate(curves.items()):  # past the palette, its colours again with a dash
        colour, dash = PALETTE[i % len(PALETTE)], "" if i < len(PALETTE) else "6 2"
        parts.append(
            f'<path d="{path(f, t)}" fill="none" stroke="{colour}" stroke-width="1.5" stroke-dasharray="{dash}"/>'
        )
        legend.append((name, colour, dash))
    for i, (label, colour, dash) in enumerate(legend):
        ly = pad + 14 + 16 * i
        parts.append(
            f'<line x1="{pad + 10}" y1="{ly}" x2="{pad + 34}" y2="{ly}" stroke="{colour}" stroke-width="2" '
            f'stroke-dasharray="{dash}"/><text x="{pad + 40}" y="{ly + 4}" font-size="11">{_e(label)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _table(head: list[str], rows: list[list[Any]]) -> str:
    cells = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"


def _verdict_block(verdict: dict[str, Any]) -> str:
    rows = "".join(
        f'<tr><th>{name}</th><td class="word" style="color:{WORD_COLOURS[SCORES[verdict[name]["word"]]]}">'
        f"{_e(verdict[name]['word'])}</td><td>{_e(verdict[name]['detail'])}</td></tr>"
        for name in PARTS
    )
    colour = WORD_COLOURS[1 if verdict["title"] == "PASSED" else 0 if verdict["title"].startswith("PASSED") else -1]
    return (
        f'<h1 id="verdict" style="color:{colour}">Release gate: {_e(verdict["title"])}</h1>'
        f'<table class="verdict">{rows}</table>'
    )


STYLE = """body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;max-width:980px;margin:24px auto;
padding:0 16px;color:#222;line-height:1.45}h1{font-size:1.6em;margin-bottom:.3em}h2{font-size:1.2em;margin-top:1.6em;
border-bottom:1px solid #ddd}table{border-collapse:collapse;margin:.6em 0}th,td{border:1px solid #ddd;padding:4px 8px;
text-align:left;vertical-align:top;font-size:.92em}table.verdict td.word{font-weight:700;white-space:nowrap}
.muted{color:#666;font-size:.9em}"""


def render_card(
    *,
    identity: dict[str, str],
    verdict: dict[str, Any],
    certificate: dict[str, Any] | None,
    audit: dict[str, Any],
    scores: dict[str, Any] | None,
    ledger: dict[str, Any] | None,
    budget: float | None,
    reasons: list[str],
) -> str:
    """The whole page (HTML). ``identity``: model, version, run, commit, data version, date, lineage …
    (shown in that order); ``scores``: ``scores.json`` (raw attack scores of the target and the control)."""
    epsilon = None if certificate is None or certificate.get("kind") == "kl" else float(certificate["epsilon"])
    delta = None if certificate is None else certificate.get("delta")
    curves = {
        name: roc_points(np.asarray(s["member"], float), np.asarray(s["nonmember"], float))
        for name, s in ((scores or {}).get("target") or {}).items()
    }
    sections = [
        _verdict_block(verdict),
        f"<p>{plain_words(certificate)}</p>",
        "<h2>Release</h2>",
        _table(["", ""], [[k, v] for k, v in identity.items()]),
    ]
    if certificate is not None and "mechanism" in certificate:
        mechanism = certificate["mechanism"]
        sections.append(
            f'<p class="muted">Neighbouring relation: {_e(mechanism.get("neighbouring", "—"))}; '
            f"n = {_e(mechanism.get('dataset_size', '—'))} training records; accountant "
            f"{_e(certificate.get('accountant', '—'))} {_e(certificate.get('accountant_version', ''))}.</p>"
        )
    sections += [
        "<h2>Attacks against the limit the certificate allows</h2>",
        _svg_roc(curves, epsilon, delta) if curves else "<p>No attack scores were recorded.</p>",
        '<p class="muted">Each curve is one membership-inference attack on the released model (members: '
        "training records; non-members: never trained on). Above the red DP limit no attack can go without "
        "refuting the certificate. These figures, and the audit's below, are computed from the training "
        "records themselves, without noise: the certificate covers the model, not this card's numbers; keep "
        "the card with the data's custodians where whether a person took part is itself sensitive.</p>",
        _table(
            ["attack", "AUC", "TPR at 1% FPR", "TPR at 0.1% FPR"],
            [
                [n, f"{r['auc']:.3f}", f"{r['tpr_at_1pct_fpr']:.3g}", f"{r['tpr_at_0.1pct_fpr']:.3g}"]
                for n, r in audit["target"]["attacks"].items()
            ],
        ),
    ]
    sections += ["<h2>The audit's stated power</h2>", _power_html(audit)]
    sections += ["<h2>Implementation checks (conformance)</h2>", _conformance_html(audit)]
    sections += ["<h2>Every release of these people (ledger)</h2>", _ledger_html(ledger, budget)]
    sections += ["<h2>The gate's reasons</h2>", "<ul>" + "".join(f"<li>{_e(r)}</li>" for r in reasons) + "</ul>"]
    title = f"{identity.get('model', 'model')} — {verdict['title']}"
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
        f"<style>{STYLE}</style></head><body>{''.join(sections)}</body></html>\n"
    )


def _power_html(audit: dict[str, Any]) -> str:
    control = audit.get("control_power")
    lines = [
        f"<p>Positive control (the same attacks against the same model trained without DP): best TPR at 1% FPR "
        f"{'—' if control is None else f'{control:.3g}'}. An audit whose attacks cannot beat the non-private "
        "model demonstrates nothing about the private one.</p>"
    ]
    power = audit.get("power") or {}
    if power:
        lines.append(
            _table(
                ["ε lower-bound method", "power (largest bound it could report)", "counted"],
                [
                    [n, f"{e['power']:.3f}", "yes" if e["gating"] else "no — " + e.get("note", "")]
                    for n, e in power.items()
                ],
            )
        )
    lines.append(f"<p>Largest counted empirical lower bound: {html.escape(bound_meaning(audit))}</p>")
    return "".join(lines)


def _conformance_html(audit: dict[str, Any]) -> str:
    conformance = audit.get("conformance")
    if not conformance or not conformance.get("ran"):
        return f"<p>Not checked: {_e((conformance or {}).get('reason', 'no record'))}.</p>"
    return _table(
        ["check", "result", "figure", "p-value"],
        [
            [c["check"], "passed" if c["passed"] else "FAILED", c.get("figure", ""), f"{c['p_value']:.2g}"]
            for c in conformance["checks"]
        ],
    )


def _ledger_html(ledger: dict[str, Any] | None, budget: float | None) -> str:
    if ledger is None:
        return "<p>No ledger record for this lineage.</p>"
    head = (
        f"<p>Lineage <strong>{_e(ledger['lineage'])}</strong>: {ledger['private_spends']} DP release(s) over "
        f"{len(ledger['dataset_versions'])} data version(s). The most exposed person has ε = "
        f"{format_epsilon(ledger['epsilon_total'])} at δ = {ledger['delta']:g} over all of them (budget "
        f"{'—' if budget is None else f'{budget:g}'} per person).</p>"
    )
    rows = [[format_epsilon(eps), f"{count:,}"] for eps, count in ledger["unit_epsilon"][:12]]
    return head + (_table(["ε per person (all releases)", "people"], rows) if rows else "")
