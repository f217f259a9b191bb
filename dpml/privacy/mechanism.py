"""What a trainer did, as data: the input of every accountant.

A trainer never computes its own ε. It returns a :class:`MechanismDescription` (sampling,
noise, sensitivity, number of steps, neighbouring relation, threat model) and the accountants in
:mod:`dpml.privacy.accountants` interpret it — the design of dp_accounting's ``DpEvent``. The
description is plain JSON, logged with every run, so a certificate can be recomputed later.

DP-SGD with Poisson sampling (Abadi et al. 2016), step t:
    B_t = {i : U_i < q},  g_t = (Σ_{i∈B_t} clip_C(∇ℓ_i) + N(0, σ²C² I)) / (q n).
Under add-or-remove-one neighbouring the clipped sum has L2 sensitivity C, so each step is the
Poisson-subsampled Gaussian mechanism with noise multiplier σ (= noise std / sensitivity); T
steps compose. Under replace-one the same mechanism is analysed with the replace-one dominating
pair (dp_accounting's PLD; Koskela's seed 001 uses this relation), whose worst case moves the
sum by up to 2C.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Neighbouring = Literal["add-remove", "replace-one"]
ThreatModel = Literal["all-iterates", "final-model"]


@dataclass(frozen=True)
class PoissonGaussianSteps:
    """``steps`` compositions of a Poisson-subsampled Gaussian with rate q and multiplier σ."""

    sample_rate: float
    noise_multiplier: float
    steps: int

    def __post_init__(self) -> None:
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate = {self.sample_rate}: must be in (0, 1]")
        if not self.noise_multiplier > 0:
            raise ValueError(f"noise_multiplier = {self.noise_multiplier}: must be > 0")
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"steps = {self.steps}: must be an integer ≥ 1")


@dataclass(frozen=True)
class MechanismDescription:
    """Everything an accountant needs, and everything a reviewer needs to check it."""

    trainer: str
    events: tuple[PoissonGaussianSteps, ...]
    neighbouring: Neighbouring
    clip_norm: float
    dataset_size: int
    threat_model: ThreatModel = "all-iterates"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of one step's clipped-gradient sum under the neighbouring relation."""
        return self.clip_norm if self.neighbouring == "add-remove" else 2.0 * self.clip_norm

    def to_dict(self) -> dict[str, Any]:
        payload = asdict(self)
        payload["events"] = [asdict(e) | {"kind": "poisson_gaussian"} for e in self.events]
        payload["notes"] = list(self.notes)
        payload["sensitivity"] = self.sensitivity
        return payload

    @classmethod
    def from_dict(cls, payload: dict[str, Any]) -> "MechanismDescription":
        events = []
        for event in payload["events"]:
            if event.get("kind", "poisson_gaussian") != "poisson_gaussian":
                raise ValueError(f"unknown mechanism event kind {event.get('kind')!r}")
            events.append(
                PoissonGaussianSteps(float(event["sample_rate"]), float(event["noise_multiplier"]), int(event["steps"]))
            )
        return cls(
            trainer=payload["trainer"],
            events=tuple(events),
            neighbouring=payload["neighbouring"],
            clip_norm=float(payload["clip_norm"]),
            dataset_size=int(payload["dataset_size"]),
            threat_model=payload.get("threat_model", "all-iterates"),
            notes=tuple(payload.get("notes", ())),
        )
