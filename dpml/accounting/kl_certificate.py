"""The certificate of a KL-private trainer (seed 000's noisy GD): what it guarantees, and what it does not.

A :class:`~dpml.accounting.mechanism.NoisyGradientDescent` event is priced in KL divergence, not in
(ε, δ). For the linearised network Cor. 4.2 of Ye et al. gives, for replace-one neighbours and the
whole trajectory W_[0:K],

    KL(W_[0:K] ‖ W'_[0:K]) ≤ 2·B·K·η / (n²σ²),
    B = X0² · o · Π_{i=1}^{L−1} (β_i m_i / 2) · Σ_{l=1}^{L} β_L / β_l            (Eq. 7 / Eq. 33),

with the initialisation variances β_l of the scheme (Eq. 5). Two independent computations of B are
asked, like the (ε, δ) accountants: ``kl.eq7`` (the product formula over the actual widths) and
``kl.table1`` (Table 1's closed form, valid for equal hidden widths; B is linear in the input norm
bound, so the table's d in the leading factor becomes X0² by scaling with X0²/d). They must agree.

The only conversion the paper gives is Pinsker's: total variation ≤ sqrt(KL/2), i.e. a
(0, δ = sqrt(KL/2)) statement. No (ε, δ)-DP with finite ε at a small δ follows, so the certificate
states ε = ∞ for every (ε, δ) use (gate, ledger, tags) and carries the KL and the Pinsker δ.
Without linearisation the paper proves nothing: the certificate is void (the trainer's estimated KL
is reported as an estimate only).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from dpml.accounting.kl import gradient_norm_constant, kl_bound, pinsker_delta, table_1_constant
from dpml.accounting.mechanism import MechanismDescription, NoisyGradientDescent


@dataclass(frozen=True)
class KlAnswer:
    name: str
    kl: float | None
    constant: float | None
    error: str | None
    seconds: float
    used_for_certificate: bool


def _eq7_constant(event: NoisyGradientDescent) -> float:
    return gradient_norm_constant(event.scheme, list(event.widths), event.input_norm)  # type: ignore[arg-type]


def _table1_constant(event: NoisyGradientDescent) -> float:
    d, hidden, o = event.widths[0], event.widths[1:-1], event.widths[-1]
    if not hidden or len(set(hidden)) != 1:
        raise NotImplementedError(f"Table 1 assumes equal hidden widths and depth ≥ 2 (widths {list(event.widths)})")
    depth = len(event.widths) - 1
    return table_1_constant(event.scheme, d, hidden[0], o, depth) * event.input_norm**2 / d  # type: ignore[arg-type]


KL_ACCOUNTANTS = {"kl.eq7": (_eq7_constant, True), "kl.table1": (_table1_constant, False)}


def _the_event(mechanism: MechanismDescription) -> NoisyGradientDescent:
    events = [e for e in mechanism.events if isinstance(e, NoisyGradientDescent)]
    if len(events) != 1 or len(mechanism.events) != 1 or mechanism.selection is not None:
        raise ValueError("a KL certificate covers exactly one noisy-GD run (no composition, no search)")
    if mechanism.neighbouring != "replace-one":
        raise ValueError(f"neighbouring = {mechanism.neighbouring!r}: Ye et al.'s KL bound is for replace-one")
    return events[0]


def ask_kl_accountants(mechanism: MechanismDescription) -> list[KlAnswer]:
    event = _the_event(mechanism)
    answers = []
    for name, (constant_of, certifying) in KL_ACCOUNTANTS.items():
        start = time.perf_counter()
        try:
            constant = constant_of(event)
            kl, error = kl_bound(constant, event.steps, event.learning_rate, mechanism.dataset_size, event.sigma), None
        except Exception as exc:  # recorded, never hidden
            constant, kl, error = None, None, f"{type(exc).__name__}: {exc}"
        answers.append(KlAnswer(name, kl, constant, error, time.perf_counter() - start, certifying))
    return answers


def certified_kl(mechanism: MechanismDescription) -> float:
    """The certified KL bound of a noisy-GD mechanism (∞ when it is not linearised: nothing is proven)."""
    event = _the_event(mechanism)
    if not event.linearised:
        return float("inf")
    constant_of = next(constant_of for constant_of, certifying in KL_ACCOUNTANTS.values() if certifying)
    return kl_bound(constant_of(event), event.steps, event.learning_rate, mechanism.dataset_size, event.sigma)


def certify_kl(mechanism: MechanismDescription, delta: float) -> dict[str, Any]:
    """The KL certificate: KL bound, its Pinsker δ, and ε = ∞ for every (ε, δ) use."""
    event = _the_event(mechanism)
    base = {
        "kind": "kl",
        "epsilon": float("inf"),
        "delta": delta,
        "neighbouring": mechanism.neighbouring,
        "threat_model": "all-iterates",
        "mechanism": mechanism.to_dict(),
        "accountant_version": "dpml",
    }
    if not event.linearised:
        return base | {
            "kl": float("inf"),
            "pinsker_delta": 1.0,
            "accountant": "none",
            "answers": [],
            "void": True,
            "statement": (
                "no guarantee: noisy GD on the real (non-linearised) network — Ye et al. prove their KL bound "
                "(Cor. 4.2) only for the linearised network; the estimated KL in the training metrics is an "
                "estimate, not a bound"
            ),
        }
    answers = ask_kl_accountants(mechanism)
    certified = next(a for a in answers if a.used_for_certificate)
    if certified.kl is None:
        raise RuntimeError(f"the KL bound could not be computed: {certified.error}")
    check = next(a for a in answers if not a.used_for_certificate)
    if check.kl is not None and not math.isclose(check.kl, certified.kl, rel_tol=1e-9):
        raise RuntimeError(
            f"the two computations of Ye et al.'s B disagree: Eq. 7 gives KL {certified.kl!r}, "
            f"Table 1 gives {check.kl!r}"
        )
    delta_tv = pinsker_delta(certified.kl)
    return base | {
        "kl": certified.kl,
        "pinsker_delta": delta_tv,
        "accountant": certified.name,
        "constant_B": certified.constant,
        "answers": [asdict(a) for a in answers],
        "statement": (
            f"KL privacy (not (ε, δ)-DP): KL(A(D) ‖ A(D')) ≤ {certified.kl:.4g} under replace-one "
            f"neighbouring for the whole trajectory of {event.steps} noisy GD steps on the linearised network "
            f"(Ye et al. Cor. 4.2, B = {certified.constant:.6g}); by Pinsker, total variation ≤ "
            f"{delta_tv:.4g}, i.e. (0, {delta_tv:.4g})-DP; no finite ε holds at δ = {delta:g}"
        ),
    }
