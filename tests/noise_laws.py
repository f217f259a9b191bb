"""The laws dpml's Gaussian noise must follow, checked the same way on every device.

Shared by the CPU tests (``tests/test_noise.py``, run everywhere) and the CUDA ones (the same file and
``tests/test_devices.py``, skipped without a GPU), so that a lent GPU session verifies the promises the
CPU tests verify, not only a standard deviation:

- the reference construction (:func:`box_muller`), written out in NumPy and torch apart from
  :mod:`dpml.train.noise`, so a test that compares with it does not take its reference from the code
  under test;
- the normal law (:func:`check_standard_normal`): mean, second moment, Kolmogorov–Smirnov, the
  independence of a Box–Muller pair's two halves, the frequency beyond 4σ, and the 53-bit bound
  8.57σ that no draw may pass;
- the 53-bit tail (:func:`check_tail_resolution`): tail radii are not on the 24-bit grid of torch's
  float32 sampler (which never draws beyond 5.77σ).

Every statistical bound below is derived from ``FALSE_ALARM``, the chance that it fails a correct
sampler, by the exact or asymptotic law of its statistic (said at each); the seeds are fixed, so CI is
deterministic, and the rate says how far a bug must move a statistic to be seen.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy import stats

FALSE_ALARM = 1e-6  # per check: the chance a correct sampler fails it
Z = float(stats.norm.isf(FALSE_ALARM / 2))  # two-sided normal quantile, ≈ 4.89
BOUND_53 = math.sqrt(-2 * math.log(2.0**-53))  # 8.5716…: the largest radius 1 − U ≥ 2⁻⁵³ allows
BOUND_24 = math.sqrt(-2 * math.log(2.0**-24))  # 5.7678…: torch's float32 CPU sampler's


def box_muller(count: int, std: float, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The CPU construction written out: 4 × 62 bits from the torch generator seed a SeedSequence that spawns
    4 SFC64 streams; ⌈count/2⌉ pairs rounded up to 4q, stream k draws the q U of pairs kq … in float64,
    then their q V (float32 for float32 output, else float64); R = std·√(−2 ln(1 − U)) in the output's
    precision; all the R cos 2πV, then all the R sin 2πV."""
    generator, half = torch.Generator().manual_seed(seed), (count + 1) // 2
    q = -(-half // 4)
    key = torch.randint(0, 2**62, (4,), generator=generator).tolist()
    streams = [np.random.Generator(np.random.SFC64(child)) for child in np.random.SeedSequence(key).spawn(4)]
    angle_dtype = np.float64 if dtype == torch.float64 else np.float32
    uniforms = [(stream.random(q), stream.random(q, dtype=angle_dtype)) for stream in streams]
    u = torch.from_numpy(np.concatenate([pair[0] for pair in uniforms]))
    v = torch.from_numpy(np.concatenate([pair[1] for pair in uniforms]))
    one_minus_u = (1.0 - u) if dtype == torch.float64 else (1.0 - u).float()
    radius = std * torch.sqrt(-2.0 * torch.log(one_minus_u))
    theta = v * (2 * math.pi)
    return torch.cat([radius * torch.cos(theta), radius * torch.sin(theta)])[:count]


def _two_sided_binomial(trials: int, p: float) -> tuple[float, float]:
    """The central (1 − FALSE_ALARM) range of Bin(trials, p)."""
    law = stats.binom(trials, p)
    return float(law.ppf(FALSE_ALARM / 2)), float(law.isf(FALSE_ALARM / 2))


def check_standard_normal(z: torch.Tensor | np.ndarray, pairs: bool = True) -> None:
    """``z`` (flat, standardised: draw / std) is i.i.d. N(0, 1): each statement fails a true N(0, 1) sample
    with probability ≤ FALSE_ALARM.

    - mean: √n·z̄ ~ N(0, 1), so |z̄| ≤ Z/√n;
    - second moment: Σz² ~ χ²_n exactly (the mean is known to be 0), so Σz²/n lies in the χ² range
      (a draw 0.9× too small has Σz²/n ≈ 0.81: outside it for n ≳ 10⁴);
    - shape: the Kolmogorov–Smirnov p-value exceeds FALSE_ALARM;
    - pairs (``pairs``: an even-length draw whose Box–Muller pairs are (k, k + n/2), as on every device
      when n/2 is a multiple of 4): the cos and sin of one (U, V) are uncorrelated; their sample
      correlation r has √(n/2)·r → N(0, 1), so |r| ≤ Z/√(n/2) (one angle used twice shows r ≈ 1);
    - tails: #{|z| > 4} ~ Bin(n, 2Φ(−4)) within its central range (a sampler with a short tail has
      too few);
    - the 53-bit bound: no |z| beyond 8.5716 (plus float32 rounding), whatever the sample.
    """
    values = torch.as_tensor(z).double().reshape(-1).cpu().numpy()
    n = values.size
    assert abs(values.mean()) <= Z / math.sqrt(n), ("mean", values.mean(), n)
    second = float(np.dot(values, values)) / n
    low, high = stats.chi2.ppf(FALSE_ALARM / 2, n) / n, stats.chi2.isf(FALSE_ALARM / 2, n) / n
    assert low <= second <= high, ("second moment", second, (low, high))
    assert stats.kstest(values, "norm").pvalue > FALSE_ALARM
    if pairs:
        assert n % 8 == 0, n
        half = n // 2
        r = float(np.corrcoef(values[:half], values[half:])[0, 1])
        assert abs(r) <= Z / math.sqrt(half), ("pair correlation", r, half)
    beyond = int((np.abs(values) > 4).sum())
    low_count, high_count = _two_sided_binomial(n, 2 * stats.norm.sf(4))
    assert low_count <= beyond <= high_count, ("beyond 4σ", beyond, (low_count, high_count))
    assert np.abs(values).max() <= BOUND_53 * (1 + 2**-22), np.abs(values).max()


def grid_hits(first: torch.Tensor, second: torch.Tensor) -> tuple[int, int]:
    """Among Box–Muller pairs (first_k, second_k) of radius > 4, how many have a uniform u = exp(−r²/2)
    within 0.01 of a step of the 2⁻²⁴ grid, and how many there are: all of them for a sampler whose
    radius comes from 24-bit uniforms; for 53-bit uniforms u·2²⁴ has a uniform fractional part, so each
    is a hit with probability 0.02."""
    r2 = first.double().cpu() ** 2 + second.double().cpu() ** 2
    steps = torch.exp(-r2[r2 > 16] / 2) * 2**24
    return int(((steps - steps.round()).abs() < 0.01).sum()), int(steps.numel())


def check_tail_resolution(first: torch.Tensor, second: torch.Tensor) -> None:
    """The tail pairs (first_k, second_k) of a standard draw come from 53-bit uniforms: the hits on the
    24-bit grid are at most the (1 − FALSE_ALARM) quantile of Bin(pairs, 0.02) (a 24-bit sampler hits
    every time), and there are enough tail pairs for that to mean something."""
    hits, pairs = grid_hits(first, second)
    assert pairs > 100, pairs
    assert hits <= stats.binom.isf(FALSE_ALARM, pairs, 0.02), (hits, pairs)


def check_gaussian_draws(device: str) -> None:
    """:func:`dpml.train.noise.gaussian` and :func:`dpml.train.noise.gaussian_noise` on ``device``'s generator
    (the CPU's SFC64 streams, a GPU's Philox): the normal law in float32 and float64 at σ = 2.5, and the
    53-bit tail of a 2M-coordinate float32 noise buffer whose pairs are (k, k + n/2) on every device."""
    from torch import nn

    from dpml.train.noise import gaussian, gaussian_noise

    for dtype in (torch.float32, torch.float64):
        generator = torch.Generator(device=device).manual_seed(11)
        drawn = gaussian((300_000,), 2.5, generator, dtype)
        assert drawn.dtype == dtype and drawn.device.type == device
        check_standard_normal(drawn.double() / 2.5)
    n = 2_000_000  # ≈ 340 pairs beyond radius 4; n/2 a multiple of 4, so the CPU's pairs are (k, k + n/2) too
    noise = gaussian_noise(
        {"w": nn.Parameter(torch.zeros(n, device=device))}, 1.0, torch.Generator(device=device).manual_seed(0)
    )["w"]
    assert noise.dtype == torch.float32 and noise.device.type == device
    check_standard_normal(noise)
    check_tail_resolution(noise[: n // 2], noise[n // 2 :])
