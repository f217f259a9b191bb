"""What a trainer did, as data: the input of every accountant.

A trainer never computes its own ε. It returns a :class:`MechanismDescription` (sampling,
noise, sensitivity, number of steps, neighbouring relation, threat model) and the accountants in
:mod:`dpml.accounting.accountants` interpret it — the design of dp_accounting's ``DpEvent``. The
description is plain JSON, logged with every run, so a certificate can be recomputed later.

DP-SGD with Poisson sampling (Abadi et al. 2016), step t:
    B_t = {i : U_i < q},  g_t = (Σ_{i∈B_t} clip_C(∇ℓ_i) + N(0, σ²C² I)) / (q n).
Under add-or-remove-one neighbouring the clipped sum has L2 sensitivity C, so each step is the
Poisson-subsampled Gaussian mechanism with noise multiplier σ (= noise std / sensitivity); T
steps compose. Under replace-one the same mechanism is analysed with the replace-one dominating
pair (dp_accounting's PLD; Koskela's seed 001 uses this relation), whose worst case moves the
sum by up to 2C.

A trainer analysed in one piece — NoisyCGD's hidden-state bound (seed 001 Thm 2.8) — gives a
:class:`GaussianDP` event instead: its μ already includes the neighbouring relation's sensitivity,
and its privacy profile is exactly the Gaussian mechanism's with sensitivity 1 and std 1/μ.

A hyperparameter search adds a :class:`Selection`: the events then describe *one* candidate
(its training plus its noisy validation score) and the selection says how many candidates ran
and that only the best was released. A fixed count k is priced by composing k candidates; a
random count (Poisson or truncated negative binomial, Papernot & Steinke 2022) by their RDP
theorems in :mod:`dpml.accounting.tuning`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
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

    def with_noise_scaled(self, factor: float) -> PoissonGaussianSteps:
        """The same steps with noise multiplier factor·σ."""
        return replace(self, noise_multiplier=self.noise_multiplier * factor)


@dataclass(frozen=True)
class GaussianDP:
    """A μ-GDP mechanism (Dong, Roth & Su 2022), μ stated for the description's neighbouring relation."""

    mu: float

    def __post_init__(self) -> None:
        if not (self.mu > 0 and self.mu < float("inf")):
            raise ValueError(f"mu = {self.mu}: must be a finite number > 0")

    def with_noise_scaled(self, factor: float) -> GaussianDP:
        """The Gaussian mechanism with factor × its noise: μ/factor-GDP."""
        return replace(self, mu=self.mu / factor)


@dataclass(frozen=True)
class NoisyGradientDescent:
    """Seed 000's noisy GD without clipping: ``steps`` full-batch steps W ← W − η∇L + sqrt(2ησ²)·Z.

    Its guarantee is **KL privacy** (Ye et al. Def. 2.3), not (ε, δ)-DP: KL ≤ 2BKη/(n²σ²)
    (Cor. 4.2), proven only for the ``linearised`` network; B depends on the initialisation
    ``scheme``, the ``widths`` [d, m_1, …, o] and the input norm bound X0 = ``input_norm``
    (:mod:`dpml.accounting.kl`). Without linearisation there is no certificate, only an estimate.
    """

    scheme: str
    widths: tuple[int, ...]
    input_norm: float
    steps: int
    learning_rate: float
    sigma: float
    linearised: bool

    def __post_init__(self) -> None:
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"steps = {self.steps}: must be an integer ≥ 1")
        if not (self.learning_rate > 0 and self.sigma > 0 and self.input_norm > 0):
            raise ValueError(
                f"learning_rate = {self.learning_rate}, sigma = {self.sigma}, input_norm = "
                f"{self.input_norm}: all must be > 0"
            )
        if len(self.widths) < 2 or min(self.widths) < 1:
            raise ValueError(f"widths = {list(self.widths)}: need [d, …, o], all ≥ 1")


@dataclass(frozen=True)
class ConcentratedDP:
    """A ρ-zCDP mechanism (Bun & Steinke 2016): D_α(M(D) ‖ M(D')) ≤ ρα for every α > 1, ρ stated for
    the description's neighbouring relation. Seed 002's one-pass DP-SGD is (ρ_s²/2)-zCDP by privacy
    amplification by iteration, i.e. ρ = ρ_s²/2 here."""

    rho: float

    def __post_init__(self) -> None:
        if not (self.rho > 0 and self.rho < float("inf")):
            raise ValueError(f"rho = {self.rho}: must be a finite number > 0")


Event = PoissonGaussianSteps | GaussianDP | NoisyGradientDescent | ConcentratedDP
GaussianEvent = PoissonGaussianSteps | GaussianDP


def gaussian_only(events: tuple[Event, ...]) -> tuple[GaussianEvent, ...]:
    """``events``, each (subsampled) Gaussian steps or a μ-GDP event; NotImplementedError for any other."""
    gaussian = tuple(e for e in events if isinstance(e, (PoissonGaussianSteps, GaussianDP)))
    if len(gaussian) != len(events):
        other = next(e for e in events if not isinstance(e, (PoissonGaussianSteps, GaussianDP)))
        raise NotImplementedError(f"a {type(other).__name__} event is neither Gaussian steps nor a μ-GDP event")
    return gaussian


EVENT_KINDS: dict[str, type] = {
    "poisson_gaussian": PoissonGaussianSteps,
    "gdp": GaussianDP,
    "noisy_gd": NoisyGradientDescent,
    "zcdp": ConcentratedDP,
}


def event_to_dict(event: Event) -> dict[str, Any]:
    kind = next(name for name, cls in EVENT_KINDS.items() if isinstance(event, cls))
    payload = asdict(event) | {"kind": kind}
    if isinstance(event, NoisyGradientDescent):
        payload["widths"] = list(event.widths)
    return payload


def event_from_dict(payload: dict[str, Any]) -> Event:
    kind = payload.get("kind", "poisson_gaussian")
    if kind == "gdp":
        return GaussianDP(float(payload["mu"]))
    if kind == "zcdp":
        return ConcentratedDP(float(payload["rho"]))
    if kind == "noisy_gd":
        return NoisyGradientDescent(
            str(payload["scheme"]),
            tuple(int(w) for w in payload["widths"]),
            float(payload["input_norm"]),
            int(payload["steps"]),
            float(payload["learning_rate"]),
            float(payload["sigma"]),
            bool(payload["linearised"]),
        )
    if kind == "poisson_gaussian":
        return PoissonGaussianSteps(
            float(payload["sample_rate"]), float(payload["noise_multiplier"]), int(payload["steps"])
        )
    raise ValueError(f"unknown mechanism event kind {kind!r}: expected one of {', '.join(EVENT_KINDS)}")


SelectionDistribution = Literal["poisson", "truncated_negative_binomial", "fixed"]


@dataclass(frozen=True)
class Selection:
    """Best-of-K release: K candidates run, only the one with the best (noisy) score is released.

    ``mean`` is E[K]; for ``fixed`` it is K itself. ``shape`` is η of the truncated negative
    binomial (0: logarithmic, 1: geometric). The realised K is never recorded: it is part of the
    mechanism's secret randomness (revealing it voids the random-count analysis).
    """

    distribution: SelectionDistribution
    mean: float
    shape: float = 0.0

    def __post_init__(self) -> None:
        if self.distribution not in ("poisson", "truncated_negative_binomial", "fixed"):
            raise ValueError(
                f"selection distribution {self.distribution!r}: must be poisson, truncated_negative_binomial or fixed"
            )
        if not self.mean >= 1:
            raise ValueError(f"selection mean = {self.mean}: must be ≥ 1")
        if self.distribution == "fixed" and self.mean != int(self.mean):
            raise ValueError(f"selection mean = {self.mean}: a fixed number of candidates must be an integer")
        if self.distribution == "truncated_negative_binomial" and not self.shape >= 0:
            raise ValueError(f"selection shape = {self.shape}: must be ≥ 0")
        if self.distribution == "truncated_negative_binomial" and not self.mean > 1:
            raise ValueError(f"selection mean = {self.mean}: a truncated negative binomial needs E[K] > 1")

    @property
    def random(self) -> bool:
        return self.distribution != "fixed"

    def describe(self) -> str:
        if self.distribution == "fixed":
            return f"best of K = {int(self.mean)} candidates"
        if self.distribution == "poisson":
            return f"best of K ~ Poisson({self.mean:g}) candidates"
        return f"best of K ~ truncated negative binomial(η = {self.shape:g}, E[K] = {self.mean:g}) candidates"


def _event_summary(event: Event) -> str:
    if isinstance(event, GaussianDP):
        return f"gdp mu={event.mu:.6g}"
    if isinstance(event, ConcentratedDP):
        return f"zcdp rho={event.rho:.6g}"
    if isinstance(event, NoisyGradientDescent):
        return (
            f"noisy-gd (KL privacy) steps={event.steps} eta={event.learning_rate:.6g} sigma={event.sigma:.6g} "
            f"init={event.scheme} widths={'-'.join(map(str, event.widths))} X0={event.input_norm:g}"
            + (" linearised" if event.linearised else " (not linearised: no certificate)")
        )
    return f"poisson-gaussian q={event.sample_rate:.6g} sigma={event.noise_multiplier:.6g} steps={event.steps}"


@dataclass(frozen=True)
class MechanismDescription:
    """Everything an accountant needs, and everything a reviewer needs to check it."""

    trainer: str
    events: tuple[Event, ...]
    neighbouring: Neighbouring
    clip_norm: float
    dataset_size: int
    threat_model: ThreatModel = "all-iterates"
    notes: tuple[str, ...] = field(default_factory=tuple)
    selection: Selection | None = None

    def composed_events(self) -> tuple[Event, ...]:
        """Every event that touched the data, when that is a plain composition.

        A fixed best-of-k search composes k candidates (the k-fold composition bounds the release
        of all k, hence of the best). A random-count selection is not a composition: it raises.
        """
        if self.selection is None:
            return self.events
        if self.selection.random:
            raise NotImplementedError(
                f"{self.selection.describe()}: not a composition of events; priced by the Papernot–Steinke RDP bound"
            )
        return self.events * int(self.selection.mean)

    def gaussian_events(self) -> tuple[GaussianEvent, ...]:
        """:meth:`composed_events` when each is (subsampled) Gaussian steps or a μ-GDP event, what the Gaussian
        accountants price; NotImplementedError for a KL or zCDP event (their accountants' ``supports`` keep such
        mechanisms away: this says so if one comes all the same)."""
        return gaussian_only(self.composed_events())

    def summary(self) -> str:
        """One line for tags and listings: trainer, events, clip norm, relation, threat model."""
        parts = [_event_summary(e) for e in self.events]
        text = f"{self.trainer}: {' + '.join(parts)} C={self.clip_norm:g} {self.neighbouring} {self.threat_model}"
        return text + (f"; hyperparameter search: {self.selection.describe()}" if self.selection else "")

    @property
    def guarantee(self) -> Literal["dp", "kl"]:
        """``kl`` when the trainer's guarantee is KL privacy (seed 000), else ``dp`` ((ε, δ)-DP)."""
        return "kl" if any(isinstance(e, NoisyGradientDescent) for e in self.events) else "dp"

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of one step's clipped-gradient sum under the neighbouring relation."""
        return self.clip_norm if self.neighbouring == "add-remove" else 2.0 * self.clip_norm

    def to_dict(self) -> dict[str, Any]:
        payload = asdict(self)
        payload["events"] = [event_to_dict(e) for e in self.events]
        payload["notes"] = list(self.notes)
        payload["sensitivity"] = self.sensitivity
        payload["selection"] = None if self.selection is None else asdict(self.selection)
        return payload

    @classmethod
    def from_dict(cls, payload: dict[str, Any]) -> "MechanismDescription":
        events = [event_from_dict(event) for event in payload["events"]]
        return cls(
            trainer=payload["trainer"],
            events=tuple(events),
            neighbouring=payload["neighbouring"],
            clip_norm=float(payload["clip_norm"]),
            dataset_size=int(payload["dataset_size"]),
            threat_model=payload.get("threat_model", "all-iterates"),
            notes=tuple(payload.get("notes", ())),
            selection=None if payload.get("selection") is None else Selection(**payload["selection"]),
        )
