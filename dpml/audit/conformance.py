"""Conformance: does the trainer do what its certificate prices? Checked white-box on one audit run.

The certificate of DP-SGD prices T steps of the Poisson-subsampled Gaussian mechanism: at step t
every record joins the batch B_t independently with probability q, each gradient is clipped to
norm C, and N(0, σ²C² I) is added to the clipped sum (``mechanism.json``). An ε lower bound from
one run cannot see a trainer that adds half the noise, skips clipping, or draws shuffled batches
(the audit's ceiling is far below the ε those bugs really cost), so the audit also *checks the
mechanism*: it runs the trainer once more, with Dirac gradient canaries
(:class:`dpml.train.dpsgd.GradientCanaries`) that enter the trainer's own sampler and clipping
with norm 5C, and observes every step's update ĝ_t right before the optimizer uses it.

At each step the auditor recomputes, **with its own code**
(:func:`dpml.audit.recompute.reference_clipped_sum`: norms of exact per-example gradients by
``torch.func``, the clipped sum by a backward pass of the reweighted loss), the clipped sum R_t of
the records in B_t at θ_t, and forms the observation

    o_t = q·n'·ĝ_t − R_t      (n' = n + included canaries; the trainer divides by q·n'),

which for a conforming trainer is N(0, σ²C² I) plus C·e_{k_j} for each canary j in B_t. Six
checks follow (:mod:`dpml.audit.checks`), sharing the false-alarm rate α
(``audit.conformance_false_alarm``, default 1e-6) by Bonferroni:

- **noise**: on the coordinates that carry no canary at that step, Σ o² / (σC)² ~ χ²_N exactly,
  pooled over the model and over each parameter tensor (a residual in one small layer). The test
  rejects when the (1 − α) interval of the std ratio ŝ/(σC) lies outside [1 − τ, 1 + τ]
  (τ = ``audit.conformance_tolerance``: room for float round-off, e.g. bf16 autocast).
- **noise independence**: for stored pairs of steps the inner product of o_t and o_t' over K sketch
  coordinates must look like that of independent N(0, σ²C²) vectors; its p-value is the
  Chernoff bound P[Σ_k ξ_k η_k ≥ x] ≤ exp(−sup_λ (λx + (K/2)·ln(1 − λ²))) for independent
  standard normals (E e^{λξη} = (1 − λ²)^{−1/2}), Bonferroni-corrected over the pairs.
- **clipped sum**: the update carries the clipped sum exactly once. R_t depends on θ_t and B_t
  only, and the step's noise is independent of both, so z_t = ⟨o_t, R_t⟩/(σC‖R_t‖) ~ N(0, 1)
  independently across steps; a sum (1 + β)·R_t (a tensor's sum counted twice, per-layer clipping,
  a layer left unclipped) shifts it by β‖R_t‖/(σC): first order, where the noise check sees second
  order. Band β ∈ [−τ, τ], pooled and per tensor.
- **noise per coordinate**: noise missing on part of the model (one layer, the biases) hides in the
  pooled test, so each coordinate's Σ_t o_{t,k}²/(σC)² ~ χ²_{T_k} is tested for too little noise
  (exact lower tail, Bonferroni over the coordinates).
- **clipping**: each canary's observation at a step that sampled it is N(c, σ²C²) with
  c = 5C·min(1, C/(5C + 1e-6)) ≈ C; their mean, over all canaries and over each parameter tensor's,
  is tested against [1 − τ, 1 + τ]·c. A trainer that does not clip shows 5C.
- **sampling**: batch sizes |B_t| ~ Binomial(n', q) i.i.d. (their sum: exact binomial test; their
  dispersion Σ (|B_t| − n'q)² / (n'q(1 − q)), two-sided) and every record's inclusion count over
  the T steps ~ Binomial(T, q) independently (dispersion over the n' records, two-sided). Fixed-
  size or shuffled batches have no dispersion; one batch reused has too much. The dispersion
  statistics' null law is approximated by a scaled χ² with the exact mean and variance
  (Satterthwaite); the other tests are exact.

Each check splits its share of α by Bonferroni over the tests it runs and is reported with its
statistic in ``audit.json``; a failed check fails the release gate with one line naming the check
and figure.
The same observations score the canaries for the one-run ε lower bound (sum or per-step
likelihood ratio, :func:`canary_scores`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn

from dpml.audit.checks import (
    Check,
    clipped_sum_check,
    clipping_check,
    coordinate_noise_check,
    independence_check,
    noise_check,
    sampling_check,
    tensor_totals,
)
from dpml.audit.recompute import reference_clipped_sum
from dpml.train.clipping import LossFn
from dpml.train.dpsgd import GradientCanaries

SKETCH_COORDINATES = 1024  # coordinates kept per stored step for the noise-reuse test
STORED_STEPS = 400  # steps stored for it (in consecutive pairs, spread over the run)


@dataclass
class ConformanceProbe:
    """Observes one DP-SGD run through :class:`GradientCanaries` and accumulates what the checks need.

    ``sigma``, ``clip_norm`` and ``sample_rate`` are the *certified* values (``mechanism.json``);
    ``x``, ``y`` the records the run trains on (the canaries are records n, n+1, … after them)."""

    x: torch.Tensor
    y: torch.Tensor
    loss_fn: LossFn
    sigma: float
    clip_norm: float
    sample_rate: float
    steps: int
    coordinates: np.ndarray
    included: np.ndarray
    norm_multiple: float = 5.0
    seed: int = 0
    recompute: bool = True  # False for a random forward pass: o_t = q·n'·ĝ_t, the records' sum left in
    # accumulated
    step: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    noise_sum_squares: float = 0.0
    noise_count: int = 0
    coordinate_sum_squares: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per coordinate: Σ_t o_t,k²
    coordinate_count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # … over that many steps
    parameter_names: list[tuple[str, int]] = field(default_factory=list)  # (name, size) of each trainable tensor
    canary_sum: float = 0.0
    canary_count: int = 0
    observations: list[np.ndarray] = field(default_factory=list)  # per step: o_t at every canary coordinate
    sampled_canaries: list[np.ndarray] = field(default_factory=list)
    sketch: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    projections: list[np.ndarray] = field(
        default_factory=list
    )  # per step: ⟨o_t, R_t⟩, all coordinates then each tensor
    reference_norms: list[np.ndarray] = field(default_factory=list)  # per step: ‖R_t‖ over the same coordinates

    def __post_init__(self) -> None:
        self.n = int(self.x.shape[0])
        self.slots = np.flatnonzero(self.included)
        self.n_total = self.n + int(self.slots.size)
        self.counts = np.zeros(self.n_total, np.int64)
        self.scale = self.sample_rate * self.n_total
        self.stored = stored_steps(self.steps)
        self._sketch_at: np.ndarray | None = None

    def canaries(self) -> GradientCanaries:
        """The instrument handed to the trainer."""
        return GradientCanaries(
            coordinates=self.coordinates,
            included=self.included,
            norm_multiple=self.norm_multiple,
            observer=self.observe,
        )

    def observe(self, batch: torch.Tensor, model: nn.Module) -> None:
        """One step: the batch (indices over the n' records) and the model whose ``.grad`` is the update."""
        batch_np = batch.detach().cpu().numpy().astype(np.int64)
        self.batch_sizes.append(int(batch_np.size))
        np.add.at(self.counts, batch_np[(batch_np >= 0) & (batch_np < self.n_total)], 1)
        records = torch.as_tensor(batch_np[batch_np < self.n], device=self.x.device)
        update = torch.cat(
            [
                p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device)
                for p in model.parameters()
                if p.requires_grad
            ]
        ).double()
        reference = (
            reference_clipped_sum(model, self.loss_fn, self.x[records], self.y[records], self.clip_norm)
            if self.recompute
            else torch.zeros_like(update)
        )
        observed = (update * self.scale - reference).cpu().numpy()
        sampled = self.slots[batch_np[batch_np >= self.n] - self.n]
        at_canary = self.coordinates[sampled]
        eligible = np.ones(observed.size, bool)
        eligible[at_canary] = False
        squares = np.where(eligible, observed * observed, 0.0)
        if self.coordinate_count.size != observed.size:
            self.coordinate_sum_squares = np.zeros(observed.size)
            self.coordinate_count = np.zeros(observed.size, np.int64)
            self.parameter_names = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
        self.coordinate_sum_squares += squares
        self.coordinate_count += eligible
        self.noise_sum_squares += float(squares.sum())
        self.noise_count += int(eligible.sum())
        if self.recompute:
            self._project(observed, reference.cpu().numpy(), eligible)
        self.canary_sum += float(observed[at_canary].sum())
        self.canary_count += int(at_canary.size)
        self.observations.append(observed[self.coordinates].astype(np.float32))
        self.sampled_canaries.append(sampled)
        if self.step in self.stored:
            if self._sketch_at is None:
                rng = np.random.default_rng([self.seed, 13])
                self._sketch_at = np.sort(
                    rng.choice(observed.size, size=min(observed.size, SKETCH_COORDINATES), replace=False)
                )
            self.sketch[self.step] = (observed[self._sketch_at], eligible[self._sketch_at])
        self.step += 1

    def _project(self, observed: np.ndarray, reference: np.ndarray, eligible: np.ndarray) -> None:
        """⟨o_t, R_t⟩ and ‖R_t‖ over the no-canary coordinates, for the model and for each parameter tensor."""
        sizes = [size for _, size in self.parameter_names]
        products = np.where(eligible, observed * reference, 0.0)
        squares = np.where(eligible, reference * reference, 0.0)
        self.projections.append(np.concatenate([[products.sum()], tensor_totals(products, sizes)]))
        self.reference_norms.append(
            np.sqrt(np.maximum(np.concatenate([[squares.sum()], tensor_totals(squares, sizes)]), 0.0))
        )


def stored_steps(steps: int) -> set[int]:
    """Steps kept for the noise-reuse test: all when few, else consecutive pairs spread over the run."""
    if steps <= STORED_STEPS:
        return set(range(steps))
    starts = np.unique(np.linspace(0, steps - 2, STORED_STEPS // 2).round().astype(int))
    return set(starts.tolist()) | set((starts + 1).tolist())


def canary_scores(probe: ConformanceProbe, scoring: Literal["likelihood_ratio", "sum"]) -> np.ndarray:
    """Each canary's score from its coordinate's observations o_{t,j} over all T steps.

    ``sum``: Σ_t o_{t,j}. ``likelihood_ratio``: Σ_t log[(1 − q) + q·exp((o_{t,j}·c − c²/2)/s²)], the log
    likelihood ratio of "included" (each step: N(c, s²) with probability q, else N(0, s²)) against
    "excluded" (N(0, s²)), c = C, s = σC: the Neyman–Pearson score for one canary under Poisson
    sampling (at q = 1 it is the sum, rescaled)."""
    scores = np.zeros(probe.coordinates.size)
    c, s, q = probe.clip_norm, probe.sigma * probe.clip_norm, probe.sample_rate
    for observed in probe.observations:  # step by step: (T, m) at once would be T times the memory
        o = observed.astype(np.float64)
        if scoring == "sum" or q >= 1.0:
            scores += o
        else:
            scores += np.logaddexp(math.log1p(-q), math.log(q) + (o * c - c * c / 2) / (s * s))
    return scores


def conformance_checks(probe: ConformanceProbe, false_alarm: float, tolerance: float) -> list[Check]:
    """Every check, each at level false_alarm / 6 (Bonferroni: the run's false-alarm rate ≤ false_alarm)."""
    level = false_alarm / 6
    return [
        noise_check(probe, level, tolerance),
        coordinate_noise_check(probe, level),
        independence_check(probe, level),
        clipped_sum_check(probe, level, tolerance),
        clipping_check(probe, level, tolerance),
        sampling_check(probe, level),
    ]
