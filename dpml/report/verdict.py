"""The release verdict in three parts, worded once and shown the same everywhere (the terminal summary,
the model version's description and tags, ``metrics/summary.json``, the privacy report).

A release rests on three different kinds of evidence, and a reviewer must see which one holds:

1. **certificate** — what the accountant proves: the certified (ε, δ) within ``gate.epsilon_budget`` and
   the lineage's most exposed person within ``ledger.epsilon_budget``. Words: *within budget*,
   *over budget*, *none* (trained without DP), *void* (the certificate was voided).
2. **implementation** — whether the trainer does what the certificate prices (the conformance checks of
   :mod:`dpml.audit.conformance`: noise, clipping, sampling). Words: *conforms*, *does not conform*,
   *not checked*; the number is the smallest p-value against "the trainer conforms".
3. **attacks** — what membership inference shows about the released model. Words: *violation* (an
   empirical lower bound above the certified ε: the trainer or the accountant is wrong), *evidence*
   (the attacks demonstrably have power — the non-private control is attackable — and stay within the
   certificate), *no demonstrated power* (the attacks cannot tell members from non-members even without
   DP, so their silence says nothing). The number is the largest gating lower bound, or the control's
   TPR at 1% FPR when the attacks have no power.

The headline says first what a pass rests on: ``PASSED without demonstrated attack power`` when the gate
was configured to pass without it (``audit.require_control_power: false``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dpml.formatting import format_epsilon, format_lower_bound

CERTIFICATE, IMPLEMENTATION, ATTACKS = "certificate", "implementation", "attacks"
PARTS = (CERTIFICATE, IMPLEMENTATION, ATTACKS)
# Each word's sortable score (a metric on the run): 1 holds, 0 says nothing, -1 fails.
SCORES = {
    "within budget": 1,
    "over budget": -1,
    "none": -1,
    "void": -1,
    "conforms": 1,
    "not checked": 0,
    "does not conform": -1,
    "evidence": 1,
    "no demonstrated power": 0,
    "violation": -1,
}


@dataclass(frozen=True)
class Part:
    """One part of the verdict: its word, its number (or None) and a short phrase saying what the number is."""

    word: str
    number: float | None
    detail: str

    def text(self) -> str:
        return f"{self.word} ({self.detail})" if self.detail else self.word


def certificate_part(certificate: dict[str, Any] | None, budget: float, ledger_ok: bool) -> Part:
    """The certified ε against ``gate.epsilon_budget`` (a KL certificate against its own budget is *within
    budget* only when the gate accepted it; the ledger's standing joins the certificate's)."""
    if certificate is None:
        return Part("none", None, "trained without differential privacy")
    if certificate.get("void"):
        return Part("void", None, "the certificate was voided")
    if certificate.get("kind") == "kl":
        kl = float(certificate["kl"])
        return Part("within budget" if ledger_ok else "over budget", kl, f"KL = {kl:.4g}, not (ε, δ)-DP")
    epsilon = float(certificate["epsilon"])
    within = epsilon <= budget and ledger_ok
    where = f"ε = {format_epsilon(epsilon)} at δ = {certificate['delta']:g}, budget {budget:g}"
    if epsilon <= budget and not ledger_ok:
        where += "; the ledger is over its budget"
    return Part("within budget" if within else "over budget", epsilon, where)


def implementation_part(audit: dict[str, Any]) -> Part:
    """The conformance checks: *conforms* when every check passed, with the smallest p-value."""
    conformance = audit.get("conformance")
    if not conformance or not conformance.get("ran"):
        return Part("not checked", None, conformance["reason"] if conformance else "no conformance record")
    checks = conformance["checks"]
    smallest = min(float(c["p_value"]) for c in checks)
    failed = [c["check"] for c in checks if not c["passed"]]
    if failed:
        return Part("does not conform", smallest, f"failed: {', '.join(failed)}; smallest p = {smallest:.2g}")
    return Part("conforms", smallest, f"{len(checks)} checks, smallest p = {smallest:.2g}")


def attacks_part(audit: dict[str, Any], violations: int, has_power: bool, min_power: float) -> Part:
    """What the membership attacks show: a violation of the certificate, evidence within it, or nothing."""
    largest = float(audit["max_lower_bound"])
    if violations:
        return Part(
            "violation",
            largest,
            f"{violations} empirical lower bound(s) above the certified ε, largest {format_lower_bound(largest)}",
        )
    if has_power:
        return Part(
            "evidence",
            largest,
            f"largest empirical lower bound ε ≥ {format_lower_bound(largest)}; the attacks reach TPR "
            f"{audit['control_power']:.3g} at 1% FPR on the non-private control",
        )
    control = audit.get("control_power")
    if control is None:
        return Part("no demonstrated power", None, "no non-private control was audited")
    return Part(
        "no demonstrated power",
        float(control),
        f"control TPR at 1% FPR {control:.3g} < {min_power:g}: the attacks cannot tell members from "
        "non-members even without DP",
    )


def title(passed: bool, parts: dict[str, Part]) -> str:
    """``PASSED``/``FAILED``, then what a pass does not rest on: the verdict's first words."""
    caveats = []
    if passed and parts[ATTACKS].word == "no demonstrated power":
        caveats.append("without demonstrated attack power")
    if passed and parts[IMPLEMENTATION].word == "not checked":
        caveats.append("without implementation checks")
    return ("PASSED" if passed else "FAILED") + (" " + " and ".join(caveats) if caveats else "")


def headline(passed: bool, parts: dict[str, Part]) -> str:
    """The title, then the three parts in one line."""
    return f"{title(passed, parts)}: " + "; ".join(f"{name} {part.text()}" for name, part in parts.items())


def verdict_record(passed: bool, parts: dict[str, Part]) -> dict[str, Any]:
    """``gate.json``'s ``verdict``: the title, the headline and each part's word, number and detail."""
    return {
        "title": title(passed, parts),
        "headline": headline(passed, parts),
        **{name: asdict(part) for name, part in parts.items()},
    }


def verdict_tags(verdict: dict[str, Any]) -> dict[str, str]:
    """The version's and run's tags: ``verdict`` (the headline) and one word per part."""
    return {"verdict": verdict["headline"][:5000], **{f"verdict.{name}": verdict[name]["word"] for name in PARTS}}


def verdict_metrics(verdict: dict[str, Any]) -> dict[str, float]:
    """Sortable metrics: each part's score (1 holds, 0 says nothing, -1 fails)."""
    return {f"verdict.{name}": float(SCORES[verdict[name]["word"]]) for name in PARTS}


def verdict_lines(verdict: dict[str, Any], indent: str = "", width: int = 15) -> list[str]:
    """One line per part, for the terminal and Markdown lists (the part's name padded to ``width``)."""
    return [
        f"{indent}{name:<{width}}{verdict[name]['word']}"
        + (f" — {verdict[name]['detail']}" if verdict[name]["detail"] else "")
        for name in PARTS
    ]


def counted_power(audit: dict[str, Any]) -> float | None:
    """The largest power among the bound methods the gate counts: the most the audit could have shown."""
    counted = [e["power"] for e in (audit.get("power") or {}).values() if e.get("gating")]
    return max(counted) if counted else None


def bound_meaning(audit: dict[str, Any]) -> str:
    """The largest counted lower bound on one line with what it could have shown (the largest power among the
    counted methods) and the certified ε, and what a lower bound means."""
    power = counted_power(audit)
    reach = f"the most its methods could show: {power:.3g}; " if power is not None else ""
    certified = audit.get("certified_epsilon")
    against = f"certified ε = {format_epsilon(certified)}" if certified is not None else "no certificate"
    return (
        f"ε ≥ {format_lower_bound(audit['max_lower_bound'])} ({reach}{against}). A lower bound holds with the stated "
        "confidence; its gap to the certified ε is the attack's weakness or the analysis' slack, not evidence that "
        "the certificate is loose."
    )
