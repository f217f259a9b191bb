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

which for a conforming trainer is N(0, σ²C² I) plus C·e_{k_j} for each canary j in B_t. Three
checks follow, each with false-alarm rate ≤ α (``audit.conformance_false_alarm``, default 1e-6):

- **noise**: on the coordinates that carry no canary at that step, Σ o² / (σC)² ~ χ²_N exactly,
  pooled over the model and over each parameter tensor (a residual in one small layer). The test
  rejects when the (1 − α) interval of the std ratio ŝ/(σC) lies outside [1 − τ, 1 + τ]
  (τ = ``audit.conformance_tolerance``: room for float round-off, e.g. bf16 autocast). Reused noise: for stored pairs of steps the inner product of o_t and o_t' over K sketch
  coordinates must look like that of independent N(0, σ²C²) vectors; its p-value is the
  Chernoff bound P[Σ_k ξ_k η_k ≥ x] ≤ exp(−sup_λ (λx + (K/2)·ln(1 − λ²))) for independent
  standard normals (E e^{λξη} = (1 − λ²)^{−1/2}), Bonferroni-corrected over the pairs.
- **noise per coordinate**: noise missing on part of the model (one layer, the biases) hides in the
  pooled test, so each coordinate's Σ_t o_{t,k}²/(σC)² ~ χ²_{T_k} is tested for too little noise
  (exact lower tail, Bonferroni over the coordinates).
- **clipping**: each canary's observation at a step that sampled it is N(c, σ²C²) with
  c = 5C·min(1, C/(5C + 1e-6)) ≈ C; their mean is tested against [1 − τ, 1 + τ]·c. A trainer
  that does not clip shows 5C.
- **sampling**: batch sizes |B_t| ~ Binomial(n', q) i.i.d. (their sum: exact binomial test; their
  dispersion Σ (|B_t| − n'q)² / (n'q(1 − q)), two-sided) and every record's inclusion count over
  the T steps ~ Binomial(T, q) independently (dispersion over the n' records, two-sided). Fixed-
  size or shuffled batches have no dispersion; one batch reused has too much. The dispersion
  statistics' null law is approximated by a scaled χ² with the exact mean and variance
  (Satterthwaite); the other tests are exact.

The checks share α by Bonferroni over the tests they run; each is reported with its statistic in
``audit.json`` and a failed check fails the release gate with one line naming the check and figure.
The same observations score the canaries for the one-run ε lower bound (sum or per-step
likelihood ratio, :func:`canary_scores`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from scipy import stats
from torch import nn

from dpml.audit.recompute import reference_clipped_sum
from dpml.train.clipping import LossFn
from dpml.train.dpsgd import GradientCanaries

SKETCH_COORDINATES = 1024   # coordinates kept per stored step for the noise-reuse test
STORED_STEPS = 400          # steps stored for it (in consecutive pairs, spread over the run)


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
    recompute: bool = True   # False for a random forward pass: o_t = q·n'·ĝ_t, the records' sum left in
    # accumulated
    step: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    noise_sum_squares: float = 0.0
    noise_count: int = 0
    coordinate_sum_squares: np.ndarray = field(default_factory=lambda: np.zeros(0))   # per coordinate: Σ_t o_t,k²
    coordinate_count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # … over that many steps
    parameter_names: list[tuple[str, int]] = field(default_factory=list)  # (name, size) of each trainable tensor
    canary_sum: float = 0.0
    canary_count: int = 0
    observations: list[np.ndarray] = field(default_factory=list)   # per step: o_t at every canary coordinate
    sampled_canaries: list[np.ndarray] = field(default_factory=list)
    sketch: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

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
        return GradientCanaries(coordinates=self.coordinates, included=self.included,
                                norm_multiple=self.norm_multiple, observer=self.observe)

    def observe(self, batch: torch.Tensor, model: nn.Module) -> None:
        """One step: the batch (indices over the n' records) and the model whose ``.grad`` is the update."""
        batch_np = batch.detach().cpu().numpy().astype(np.int64)
        self.batch_sizes.append(int(batch_np.size))
        np.add.at(self.counts, batch_np[(batch_np >= 0) & (batch_np < self.n_total)], 1)
        records = torch.as_tensor(batch_np[batch_np < self.n], device=self.x.device)
        update = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device)
                            for p in model.parameters() if p.requires_grad]).double()
        reference = reference_clipped_sum(model, self.loss_fn, self.x[records], self.y[records], self.clip_norm) \
            if self.recompute else torch.zeros_like(update)
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
        self.canary_sum += float(observed[at_canary].sum())
        self.canary_count += int(at_canary.size)
        self.observations.append(observed[self.coordinates].astype(np.float32))
        self.sampled_canaries.append(sampled)
        if self.step in self.stored:
            if self._sketch_at is None:
                rng = np.random.default_rng([self.seed, 13])
                self._sketch_at = np.sort(rng.choice(observed.size, size=min(observed.size, SKETCH_COORDINATES),
                                                     replace=False))
            self.sketch[self.step] = (observed[self._sketch_at], eligible[self._sketch_at])
        self.step += 1


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
    if not probe.observations:
        return np.zeros(probe.coordinates.size)
    o = np.stack(probe.observations).astype(np.float64)  # (T, m)
    if scoring == "sum":
        return o.sum(0)
    c, s, q = probe.clip_norm, probe.sigma * probe.clip_norm, probe.sample_rate
    if q >= 1.0:
        return o.sum(0)
    exponent = (o * c - c * c / 2) / (s * s)
    return np.logaddexp(math.log1p(-q), math.log(q) + exponent).sum(0)


@dataclass(frozen=True)
class Check:
    """One conformance check: its name, verdict, p-value against "the trainer conforms", and its figure."""

    name: str
    passed: bool
    p_value: float
    level: float
    figure: str
    statistics: dict[str, Any]

    def line(self) -> str:
        p = "p < 1e-12" if self.p_value < 1e-12 else f"p = {self.p_value:.2g}"
        return f"conformance check '{self.name}': {self.figure}, {p} (false-alarm rate {self.level:.1e})"

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.name, "passed": self.passed, "p_value": self.p_value, "false_alarm": self.level,
                "figure": self.figure, "line": self.line(), "statistics": self.statistics}


def _ratio_interval(sum_squares: float, count: int, level: float) -> tuple[float, float]:
    """(1 − level) interval of the std ratio ŝ/s from Σ o²/s² ~ χ²_count."""
    low = stats.chi2.ppf(level / 2, count)
    high = stats.chi2.isf(level / 2, count)
    return math.sqrt(sum_squares / high), math.sqrt(sum_squares / low)


def _ratio_p_value(sum_squares: float, count: int, tolerance: float) -> float:
    """p-value of "the std ratio lies in [1 − τ, 1 + τ]": the larger of the two one-sided tail
    probabilities at the nearest edge of the band (a composite null; the edge is the least favourable)."""
    if sum_squares <= 0:
        return 0.0
    ratio = math.sqrt(sum_squares / count)
    if ratio < 1 - tolerance:
        return float(min(1.0, 2 * stats.chi2.cdf(sum_squares / (1 - tolerance) ** 2, count)))
    if ratio > 1 + tolerance:
        return float(min(1.0, 2 * stats.chi2.sf(sum_squares / (1 + tolerance) ** 2, count)))
    return 1.0


def tensor_noise(probe: ConformanceProbe) -> list[tuple[str, float, int]]:
    """(name, Σ o²/(σC)², count) of each trainable parameter tensor: its coordinates' no-canary observations."""
    s2 = (probe.sigma * probe.clip_norm) ** 2
    out, offset = [], 0
    for name, size in probe.parameter_names:
        count = int(probe.coordinate_count[offset:offset + size].sum())
        if count:
            out.append((name, float(probe.coordinate_sum_squares[offset:offset + size].sum()) / s2, count))
        offset += size
    return out


def noise_check(probe: ConformanceProbe, level: float, tolerance: float) -> Check:
    """The noise's std against the certified σ·C, pooled over every coordinate and over each parameter tensor.

    Pooled: Σ o²/(σC)² ~ χ²_N; the band test of :func:`_ratio_p_value`. A wrong clipped sum in one layer
    (its examples left unclipped, a slice summed twice) leaves a residual there that the pooled sum dilutes
    when the layer is a small part of the model, so each tensor's own Σ o²/(σC)² ~ χ²_{N_j} is band-tested
    too; the check's p-value is the smallest of the J + 1 tests' times J + 1 (Bonferroni)."""
    s = probe.sigma * probe.clip_norm
    if probe.noise_count == 0 or s <= 0:
        return Check("noise", False, 0.0, level, "no step was observed", {"steps_observed": probe.step})
    scaled = probe.noise_sum_squares / (s * s)
    ratio = math.sqrt(scaled / probe.noise_count)
    tests = [("all", scaled, probe.noise_count)] + tensor_noise(probe)
    p_values = [_ratio_p_value(total, count, tolerance) for _, total, count in tests]
    p = min(1.0, min(p_values) * len(tests))
    low, high = _ratio_interval(scaled, probe.noise_count, level)
    worst = 0 if p_values[0] * len(tests) < level else int(np.argmin(p_values))
    name, total, count = tests[worst]
    figure = f"noise std {ratio:.2f} × certified σ·C" if worst == 0 else (
        f"noise std {math.sqrt(total / count):.2f} × certified σ·C on {name} ({count} observations; all "
        f"coordinates: {ratio:.2f} ×)")
    tensors = {n: {"std_ratio": math.sqrt(t / c), "observations": c, "p_value": pv}
               for (n, t, c), pv in zip(tests[1:], p_values[1:])}
    return Check("noise", p >= level, p, level, figure,
                 {"std_ratio": ratio, "interval": [low, high], "coordinates": probe.noise_count,
                  "certified_sigma": probe.sigma, "certified_clip_norm": probe.clip_norm, "tolerance": tolerance,
                  "worst": name, "tensors": tensors})


def parameter_at(probe: ConformanceProbe, coordinate: int) -> str:
    """``name[index]`` of a flat trainable-parameter coordinate."""
    offset = 0
    for name, size in probe.parameter_names:
        if coordinate < offset + size:
            return f"{name}[{coordinate - offset}]"
        offset += size
    return f"coordinate {coordinate}"


def coordinate_noise_check(probe: ConformanceProbe, level: float) -> Check:
    """Noise missing on part of the model (a layer, the biases, a slice): a pooled test barely moves when a
    few coordinates go without noise, so every coordinate is tested on its own.

    Coordinate k's observations over the T_k steps it carries no canary are i.i.d. N(0, σ²C²), so
    S_k/(σC)² ~ χ²_{T_k} and its lower tail P[χ²_{T_k} ≤ S_k/(σC)²] is an exact p-value for "k gets the
    certified noise"; the smallest over the D coordinates, times D (Bonferroni), is the check's p-value.
    Only too *little* noise is tested here: float round-off can only add variance."""
    s2 = (probe.sigma * probe.clip_norm) ** 2
    counts = probe.coordinate_count
    if counts.size == 0 or s2 <= 0:
        return Check("noise per coordinate", False, 0.0, level, "no step was observed", {"steps_observed": probe.step})
    observed = counts > 0
    lower = np.ones(counts.size)
    lower[observed] = stats.chi2.cdf(probe.coordinate_sum_squares[observed] / s2, counts[observed])
    worst = int(np.argmin(lower))
    p = float(min(1.0, lower[worst] * int(observed.sum())))
    ratio = math.sqrt(probe.coordinate_sum_squares[worst] / s2 / max(int(counts[worst]), 1))
    flagged = int(np.sum(lower * int(observed.sum()) < level))
    return Check("noise per coordinate", p >= level, p, level,
                 f"noise std {ratio:.2f} × certified σ·C at {parameter_at(probe, worst)} over {int(counts[worst])} steps"
                 + (f" ({flagged} coordinates below the certified noise)" if flagged > 1 else ""),
                 {"worst_coordinate": parameter_at(probe, worst), "worst_std_ratio": ratio, "coordinates": int(observed.sum()),
                  "coordinates_below": flagged})


def chernoff_product_p_value(inner: float, count: int) -> float:
    """P[|Σ_{k≤K} ξ_k η_k| ≥ |inner|] ≤ 2·exp(−(λx + (K/2)·ln(1 − λ²))) at the optimal λ, ξ, η i.i.d. N(0, 1)."""
    x = abs(inner)
    if count <= 0 or x == 0:
        return 1.0
    lam = (-count + math.sqrt(count * count + 4 * x * x)) / (2 * x)
    exponent = lam * x + 0.5 * count * math.log1p(-lam * lam)
    return float(min(1.0, 2.0 * math.exp(-exponent)))


def independence_check(probe: ConformanceProbe, level: float) -> Check:
    """Noise reused across steps: the largest standardised inner product between stored steps' observations."""
    s2 = (probe.sigma * probe.clip_norm) ** 2
    steps = sorted(probe.sketch)
    if len(steps) < 2 or s2 <= 0:
        return Check("noise independence", True, 1.0, level, "fewer than two steps stored", {"pairs": 0})
    values = np.stack([probe.sketch[t][0] for t in steps]) / math.sqrt(s2)
    masks = np.stack([probe.sketch[t][1] for t in steps]).astype(np.float64)
    masked = values * masks
    inner = masked @ masked.T
    common = masks @ masks.T
    upper = np.triu_indices(len(steps), 1)
    pairs = upper[0].size
    correlation = inner[upper] / np.maximum(common[upper], 1)
    worst = int(np.argmax(np.abs(correlation)))
    a, b = upper[0][worst], upper[1][worst]
    p_single = chernoff_product_p_value(float(inner[a, b]), int(common[a, b]))
    p = min(1.0, p_single * pairs)
    return Check("noise independence", p >= level, p, level,
                 f"noise of steps {steps[a]} and {steps[b]}: mean product {correlation[worst]:+.2f} × (σC)² "
                 f"over {int(common[a, b])} coordinates (independent noise: 0 ± {1 / math.sqrt(max(int(common[a, b]), 1)):.2f})",
                 {"pairs": int(pairs), "sketch_coordinates": int(values.shape[1]),
                  "largest_correlation": float(correlation[worst])})


def clipping_check(probe: ConformanceProbe, level: float, tolerance: float) -> Check:
    s = probe.sigma * probe.clip_norm
    big = probe.norm_multiple * probe.clip_norm
    expected = big * min(1.0, probe.clip_norm / (big + 1e-6))
    if probe.canary_count == 0:
        return Check("clipping", False, 0.0, level, "no canary was ever sampled: clipping unobserved",
                     {"canary_observations": 0})
    mean = probe.canary_sum / probe.canary_count
    se = s / math.sqrt(probe.canary_count)
    ratio = mean / expected
    edge = expected * (1 - tolerance) if ratio < 1 else expected * (1 + tolerance)
    inside = abs(ratio - 1) <= tolerance
    p = 1.0 if inside else float(min(1.0, 2 * stats.norm.sf(abs(mean - edge) / se)))
    return Check("clipping", p >= level, p, level,
                 f"canary gradients of norm {probe.norm_multiple:g}·C contribute {mean / probe.clip_norm:.2f} × C",
                 {"contribution_ratio": ratio, "canary_observations": probe.canary_count, "mean": mean,
                  "expected": expected, "standard_error": se, "tolerance": tolerance})


def _dispersion_p_value(statistic: float, df: int, variance_each: float) -> float:
    """Two-sided p of a dispersion statistic with mean df and variance df·variance_each, by the scaled χ²
    a·χ²_ν matching both moments (a = variance_each/2, ν = 2·df/variance_each)."""
    if df <= 0:
        return 1.0
    a, nu = variance_each / 2, 2 * df / variance_each
    low, high = stats.chi2.cdf(statistic / a, nu), stats.chi2.sf(statistic / a, nu)
    return float(min(1.0, 2 * min(low, high)))


def _binomial_dispersion(counts: np.ndarray, trials: int, q: float) -> tuple[float, float]:
    """(Σ (c − tq)²/(tq(1 − q)), the variance of one term): (c − μ)²/v has variance 2 + (1 − 6pq)/(tpq)."""
    v = trials * q * (1 - q)
    statistic = float(np.sum((counts - trials * q) ** 2) / v)
    return statistic, 2.0 + (1 - 6 * q * (1 - q)) / v


def sampling_check(probe: ConformanceProbe, level: float) -> Check:
    sizes, q, n, steps = np.asarray(probe.batch_sizes), probe.sample_rate, probe.n_total, probe.step
    stats_out: dict[str, Any] = {"steps_observed": steps, "steps_certified": probe.steps, "records": n,
                                 "mean_batch": float(sizes.mean()) if sizes.size else 0.0, "expected_batch": q * n}
    if steps != probe.steps:
        return Check("sampling", False, 0.0, level, f"{steps} steps observed, {probe.steps} certified", stats_out)
    if q >= 1.0:
        full = bool((sizes == n).all())
        return Check("sampling", full, 1.0 if full else 0.0, level,
                     "every step used the full batch" if full else "a full-batch trainer left records out", stats_out)
    total = int(sizes.sum())
    p_total = float(stats.binomtest(total, n * steps, q).pvalue)
    size_stat, size_var = _binomial_dispersion(sizes, n, q)
    p_sizes = _dispersion_p_value(size_stat, steps, size_var)
    count_stat, count_var = _binomial_dispersion(probe.counts, steps, q)
    p_counts = _dispersion_p_value(count_stat, n, count_var)
    parts = {"batch sizes' total": p_total, "batch sizes' spread": p_sizes, "inclusion counts' spread": p_counts}
    stats_out |= {"p_values": parts, "batch_size_dispersion": size_stat / max(steps, 1),
                  "inclusion_count_dispersion": count_stat / max(n, 1)}
    worst = min(parts, key=parts.__getitem__)
    p = min(1.0, 3 * parts[worst])
    figures = {"batch sizes' total": f"mean batch size {stats_out['mean_batch']:.1f}, certified q·n = {q * n:.1f}",
               "batch sizes' spread": f"batch sizes' variance {size_stat / max(steps, 1):.2f} × Binomial(n, q)'s",
               "inclusion counts' spread": f"records' inclusion counts' variance {count_stat / max(n, 1):.2f} × "
                                           "Binomial(T, q)'s"}
    return Check("sampling", p >= level, p, level, figures[worst], stats_out)


def conformance_checks(probe: ConformanceProbe, false_alarm: float, tolerance: float) -> list[Check]:
    """Every check, each at level false_alarm / 5 (Bonferroni: the run's false-alarm rate ≤ false_alarm)."""
    level = false_alarm / 5
    return [noise_check(probe, level, tolerance), coordinate_noise_check(probe, level),
            independence_check(probe, level), clipping_check(probe, level, tolerance), sampling_check(probe, level)]
