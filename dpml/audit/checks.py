"""The six conformance checks of :mod:`dpml.audit.conformance` — noise (pooled and per parameter
tensor), noise per coordinate, noise independence, clipped sum (pooled and per tensor), clipping
(pooled and per tensor) and sampling — each a test of "the trainer does what ``mechanism.json``
certifies" on what a :class:`ConformanceProbe` observed, with its statistic, p-value and one line.
The module docstring of :mod:`dpml.audit.conformance` states each test and its null law.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from scipy import stats

if TYPE_CHECKING:
    from dpml.audit.conformance import ConformanceProbe


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
        return {
            "check": self.name,
            "passed": self.passed,
            "p_value": self.p_value,
            "false_alarm": self.level,
            "figure": self.figure,
            "line": self.line(),
            "statistics": self.statistics,
        }


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


def tensor_totals(values: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Σ of a flat per-coordinate array (in ``named_parameters`` order) over each parameter tensor's slice."""
    ends = np.cumsum(sizes, dtype=np.int64)
    running = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
    return running[ends] - running[ends - np.asarray(sizes, dtype=np.int64)]


def _sizes(probe: ConformanceProbe) -> list[int]:
    return [size for _, size in probe.parameter_names]


def _bonferroni(p_values: list[float], level: float) -> tuple[float, int]:
    """The check's p-value (smallest of the J + 1 tests' times J + 1) and the test its line names: the
    pooled one (index 0) when it fails on its own, else the one with the smallest p."""
    count = len(p_values)
    worst = 0 if p_values[0] * count < level else int(np.argmin(p_values))
    return min(1.0, min(p_values) * count), worst


def tensor_noise(probe: ConformanceProbe) -> list[tuple[str, float, int]]:
    """(name, Σ o²/(σC)², count) of each trainable parameter tensor: its coordinates' no-canary observations."""
    s2 = (probe.sigma * probe.clip_norm) ** 2
    sums = tensor_totals(probe.coordinate_sum_squares, _sizes(probe))
    counts = tensor_totals(probe.coordinate_count, _sizes(probe))
    return [
        (name, float(total) / s2, int(count))
        for (name, _), total, count in zip(probe.parameter_names, sums, counts, strict=True)
        if count
    ]


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
    p, worst = _bonferroni(p_values, level)
    low, high = _ratio_interval(scaled, probe.noise_count, level)
    name, total, count = tests[worst]
    figure = (
        f"noise std {ratio:.2f} × certified σ·C"
        if worst == 0
        else (
            f"noise std {math.sqrt(total / count):.2f} × certified σ·C on {name} ({count} observations; all "
            f"coordinates: {ratio:.2f} ×)"
        )
    )
    tensors = {
        n: {"std_ratio": math.sqrt(t / c), "observations": c, "p_value": pv}
        for (n, t, c), pv in zip(tests[1:], p_values[1:], strict=True)
    }
    return Check(
        "noise",
        p >= level,
        p,
        level,
        figure,
        {
            "std_ratio": ratio,
            "interval": [low, high],
            "coordinates": probe.noise_count,
            "certified_sigma": probe.sigma,
            "certified_clip_norm": probe.clip_norm,
            "tolerance": tolerance,
            "worst": name,
            "tensors": tensors,
        },
    )


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
    return Check(
        "noise per coordinate",
        p >= level,
        p,
        level,
        f"noise std {ratio:.2f} × certified σ·C at {parameter_at(probe, worst)} over {int(counts[worst])} steps"
        + (f" ({flagged} coordinates below the certified noise)" if flagged > 1 else ""),
        {
            "worst_coordinate": parameter_at(probe, worst),
            "worst_std_ratio": ratio,
            "coordinates": int(observed.sum()),
            "coordinates_below": flagged,
        },
    )


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
    return Check(
        "noise independence",
        p >= level,
        p,
        level,
        f"noise of steps {steps[a]} and {steps[b]}: mean product {correlation[worst]:+.2f} × (σC)² "
        f"over {int(common[a, b])} coordinates (independent noise: 0 ± {1 / math.sqrt(max(int(common[a, b]), 1)):.2f})",
        {
            "pairs": int(pairs),
            "sketch_coordinates": int(values.shape[1]),
            "largest_correlation": float(correlation[worst]),
        },
    )


def _band_p_value(z: np.ndarray, r: np.ndarray, tolerance: float) -> float:
    """Two-sided p of "β ∈ [−τ, τ]" from z_t = β·r_t + ξ_t, ξ_t i.i.d. N(0, 1): at either edge b = ±τ,
    Σ_t (z_t − b·r_t)/√T is exactly N(0, 1); the nearer edge's tail, doubled."""
    if z.size == 0:
        return 1.0
    high = float((z - tolerance * r).sum() / math.sqrt(z.size))
    low = float((z + tolerance * r).sum() / math.sqrt(z.size))
    if high > 0:
        return float(min(1.0, 2 * stats.norm.sf(high)))
    if low < 0:
        return float(min(1.0, 2 * stats.norm.cdf(low)))
    return 1.0


def clipped_sum_check(probe: ConformanceProbe, level: float, tolerance: float) -> Check:
    """The update carries the clipped sum once: o_t = q·n'·ĝ_t − R_t has no component along R_t.

    A trainer whose sum is (1 + β)·R_t in some tensor (a sum counted twice: β = 1; a layer left unclipped
    or clipped on its own: β > 0 there) leaves β·R_t in o_t. Its projection is first-order in R_t, where
    the noise check's energy only sees ‖β·R_t‖² against D·σ²C². At step t, R_t depends on θ_t and B_t
    only and the step's noise ξ_t ~ N(0, σ²C² I) is independent of both, so
    z_t = ⟨o_t, R_t⟩/(σC‖R_t‖) = β‖R_t‖/(σC) + N(0, 1) exactly and independently of earlier steps,
    and each edge of the band β ∈ [−τ, τ] has an exact N(0, 1) statistic (:func:`_band_p_value`).
    Tested over all no-canary coordinates and over each parameter tensor's; the check's p-value is the
    smallest of the J + 1 times J + 1."""
    s = probe.sigma * probe.clip_norm
    if not probe.projections or s <= 0:
        return Check("clipped sum", True, 1.0, level, "no clipped sum was recomputed", {"steps": 0})
    projections, norms = np.stack(probe.projections), np.stack(probe.reference_norms)  # (T, J + 1)
    names = ["all"] + [name for name, _ in probe.parameter_names]
    p_values, betas = [], []
    for j in range(len(names)):
        seen = norms[:, j] > 0
        z = projections[seen, j] / (s * norms[seen, j])
        p_values.append(_band_p_value(z, norms[seen, j] / s, tolerance))
        betas.append(float(projections[seen, j].sum() / max((norms[seen, j] ** 2).sum(), 1e-300)))
    p, worst = _bonferroni(p_values, level)
    figure = f"the update carries {1 + betas[0]:.2f} × the recomputed clipped sum"
    if worst:
        figure = (
            f"the update carries {1 + betas[worst]:.2f} × the recomputed clipped sum on {names[worst]} "
            f"(all coordinates: {1 + betas[0]:.2f} ×)"
        )
    return Check(
        "clipped sum",
        p >= level,
        p,
        level,
        figure,
        {
            "multiple": 1 + betas[0],
            "worst": names[worst],
            "steps": int(projections.shape[0]),
            "tolerance": tolerance,
            "tensors": {
                n: {"multiple": 1 + b, "p_value": pv}
                for n, b, pv in zip(names[1:], betas[1:], p_values[1:], strict=True)
            },
        },
    )


def canary_tensor_sums(probe: ConformanceProbe) -> list[tuple[str, float, int]]:
    """(name, Σ o, count) of the canary observations at the steps that sampled them, per parameter tensor."""
    dimension = sum(_sizes(probe))
    sums, counts = np.zeros(dimension), np.zeros(dimension)
    for observed, sampled in zip(probe.observations, probe.sampled_canaries, strict=True):
        np.add.at(sums, probe.coordinates[sampled], observed[sampled].astype(np.float64))
        np.add.at(counts, probe.coordinates[sampled], 1)
    totals, seen = tensor_totals(sums, _sizes(probe)), tensor_totals(counts, _sizes(probe))
    return [
        (name, float(total), int(count))
        for (name, _), total, count in zip(probe.parameter_names, totals, seen, strict=True)
        if count
    ]


def _mean_band_p_value(mean: float, standard_error: float, expected: float, tolerance: float) -> float:
    """Two-sided p of "the mean lies in [1 − τ, 1 + τ]·expected" at the band's nearest edge (normal observations)."""
    ratio = mean / expected
    if abs(ratio - 1) <= tolerance:
        return 1.0
    edge = expected * (1 - tolerance) if ratio < 1 else expected * (1 + tolerance)
    return float(min(1.0, 2 * stats.norm.sf(abs(mean - edge) / standard_error)))


def clipping_check(probe: ConformanceProbe, level: float, tolerance: float) -> Check:
    """Each canary observation at a step that sampled it is N(c, σ²C²), c = 5C·min(1, C/(5C + 1e-6)) ≈ C.

    Their mean over all canaries, and over the canaries of each parameter tensor (a layer that skips the
    clip factors, or counts its sum twice, shows there and is diluted in the pooled mean), is tested
    against [1 − τ, 1 + τ]·c; the check's p-value is the smallest of the J + 1 tests' times J + 1."""
    s = probe.sigma * probe.clip_norm
    big = probe.norm_multiple * probe.clip_norm
    expected = big * min(1.0, probe.clip_norm / (big + 1e-6))
    if probe.canary_count == 0:
        return Check(
            "clipping", False, 0.0, level, "no canary was ever sampled: clipping unobserved", {"canary_observations": 0}
        )
    tests = [("all", probe.canary_sum, probe.canary_count)] + (
        canary_tensor_sums(probe) if probe.parameter_names else []
    )
    p_values = [
        _mean_band_p_value(total / count, s / math.sqrt(count), expected, tolerance) for _, total, count in tests
    ]
    p, worst = _bonferroni(p_values, level)
    mean = probe.canary_sum / probe.canary_count
    name, total, count = tests[worst]
    figure = f"canary gradients of norm {probe.norm_multiple:g}·C contribute {mean / probe.clip_norm:.2f} × C"
    if worst:
        figure += f" overall, {total / count / probe.clip_norm:.2f} × C on {name} ({count} observations)"
    tensors = {
        n: {"contribution_ratio": t / c / expected, "canary_observations": c, "p_value": pv}
        for (n, t, c), pv in zip(tests[1:], p_values[1:], strict=True)
    }
    return Check(
        "clipping",
        p >= level,
        p,
        level,
        figure,
        {
            "contribution_ratio": mean / expected,
            "canary_observations": probe.canary_count,
            "mean": mean,
            "expected": expected,
            "standard_error": s / math.sqrt(probe.canary_count),
            "tolerance": tolerance,
            "worst": name,
            "tensors": tensors,
        },
    )


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
    stats_out: dict[str, Any] = {
        "steps_observed": steps,
        "steps_certified": probe.steps,
        "records": n,
        "mean_batch": float(sizes.mean()) if sizes.size else 0.0,
        "expected_batch": q * n,
    }
    if steps != probe.steps:
        return Check("sampling", False, 0.0, level, f"{steps} steps observed, {probe.steps} certified", stats_out)
    if q >= 1.0:
        full = bool((sizes == n).all())
        return Check(
            "sampling",
            full,
            1.0 if full else 0.0,
            level,
            "every step used the full batch" if full else "a full-batch trainer left records out",
            stats_out,
        )
    total = int(sizes.sum())
    p_total = float(stats.binomtest(total, n * steps, q).pvalue)
    size_stat, size_var = _binomial_dispersion(sizes, n, q)
    p_sizes = _dispersion_p_value(size_stat, steps, size_var)
    count_stat, count_var = _binomial_dispersion(probe.counts, steps, q)
    p_counts = _dispersion_p_value(count_stat, n, count_var)
    parts = {"batch sizes' total": p_total, "batch sizes' spread": p_sizes, "inclusion counts' spread": p_counts}
    stats_out |= {
        "p_values": parts,
        "batch_size_dispersion": size_stat / max(steps, 1),
        "inclusion_count_dispersion": count_stat / max(n, 1),
    }
    worst = min(parts, key=parts.__getitem__)
    p = min(1.0, 3 * parts[worst])
    figures = {
        "batch sizes' total": f"mean batch size {stats_out['mean_batch']:.1f}, certified q·n = {q * n:.1f}",
        "batch sizes' spread": f"batch sizes' variance {size_stat / max(steps, 1):.2f} × Binomial(n, q)'s",
        "inclusion counts' spread": f"records' inclusion counts' variance {count_stat / max(n, 1):.2f} × "
        "Binomial(T, q)'s",
    }
    return Check("sampling", p >= level, p, level, figures[worst], stats_out)
