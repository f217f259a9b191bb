"""DP noise (:mod:`dpml.train.noise`): Box–Muller with a 53-bit radius, in one place, so its tails reach 8.57σ.

torch's float32 sampler never draws beyond 5.77σ on the CPU (24-bit uniforms in Box–Muller), which
gives a neighbouring data set an impossible event the accountants' Gaussian does not have (module
docstring). These tests pin the construction, check the law, check that the tail radii are not on the
24-bit grid (and that the check sees that grid in torch's own sampler), and keep every trainer's noise
going through the module.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch
from scipy import stats
from torch import nn

from dpml.train.noise import PrefetchedNoise, gaussian, gaussian_noise

ROOT = Path(__file__).resolve().parents[1]


def box_muller(count: int, std: float, seed: int) -> torch.Tensor:
    """The construction written out: 4 × 62 bits from the torch generator seed an SFC64 stream; all the U
    in float64, then all the V in float32 from it; R = std·√(−2 ln(1 − U)) in float32; (R cos 2πV, R sin 2πV)."""
    generator, half = torch.Generator().manual_seed(seed), (count + 1) // 2
    key = torch.randint(0, 2 ** 62, (4,), generator=generator).tolist()
    stream = np.random.Generator(np.random.SFC64(np.random.SeedSequence(key)))
    u = torch.from_numpy(stream.random(half))
    v = torch.from_numpy(stream.random(half, dtype=np.float32))
    radius = std * torch.sqrt(-2.0 * torch.log((1.0 - u).float()))
    theta = v * (2 * math.pi)
    return torch.cat([radius * torch.cos(theta), radius * torch.sin(theta)])[:count]


def test_float32_parameters_get_the_53_bit_box_muller_draw() -> None:
    params = dict(nn.Sequential(nn.Linear(30, 20), nn.Linear(20, 3)).named_parameters())
    noise = gaussian_noise(params, 0.8, torch.Generator().manual_seed(5))
    flat = torch.cat([noise[name].reshape(-1) for name in params])
    assert flat.dtype == torch.float32 and all(noise[n].shape == p.shape for n, p in params.items())
    torch.testing.assert_close(flat, box_muller(flat.numel(), 0.8, 5), rtol=1e-6, atol=1e-6)
    odd = gaussian((300_001,), 1.5, torch.Generator().manual_seed(6), torch.float32)
    torch.testing.assert_close(odd, box_muller(300_001, 1.5, 6), rtol=1e-6, atol=1e-6)
    assert gaussian((4, 5), 1.0, torch.Generator(), torch.float64).shape == (4, 5)
    assert gaussian((), 1.0, torch.Generator(), torch.float32).shape == ()


def test_the_draws_follow_the_normal_law() -> None:
    for dtype in (torch.float32, torch.float64):
        z = gaussian((300_001,), 2.5, torch.Generator().manual_seed(11), dtype).double() / 2.5
        assert z.dtype == torch.float64 and abs(float(z.mean())) < 0.01 and abs(float(z.var()) - 1) < 0.01
        assert stats.kstest(z.numpy(), "norm").pvalue > 1e-4
        half = z.numel() // 2  # the pair (R cos Θ, R sin Θ) of one (U, V): uncorrelated
        assert abs(float(torch.corrcoef(torch.stack([z[:half], z[half + 1:]]))[0, 1])) < 0.01


def on_the_24_bit_grid(first: torch.Tensor, second: torch.Tensor) -> float:
    """Among Box–Muller pairs (first_k, second_k) of radius > 4, the fraction whose uniform
    u = exp(−r²/2) is a multiple of 2⁻²⁴ (to 0.01 of a step): 1 for a sampler whose radius comes from
    24-bit uniforms, about 0.02 for one with 53-bit uniforms."""
    r2 = first.double() ** 2 + second.double() ** 2
    steps = torch.exp(-r2[r2 > 16] / 2) * 2 ** 24
    assert steps.numel() > 100
    return float(((steps - steps.round()).abs() < 0.01).double().mean())


def test_the_tail_radii_come_from_53_bit_uniforms_not_24_bit_ones() -> None:
    """The tail's resolution is what bounds the draw (5.77σ with 24 bits). torch's float32 sampler pairs
    coordinates j and j + 8 of each block of 16 and puts every tail pair on the 24-bit grid (so the
    check can see it); dpml's pairs (k, k + n/2) must not be on it."""
    assert math.sqrt(-2 * math.log(2.0 ** -24)) < 5.77 and math.sqrt(-2 * math.log(2.0 ** -53)) > 8.57
    n = 2_000_000  # ≈ 340 pairs beyond radius 4
    torch_float32 = torch.empty(n).normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0)).reshape(-1, 16)
    assert on_the_24_bit_grid(torch_float32[:, :8], torch_float32[:, 8:]) == 1.0
    ours = gaussian_noise({"w": nn.Parameter(torch.zeros(n))}, 1.0, torch.Generator().manual_seed(0))["w"]
    assert ours.dtype == torch.float32 and on_the_24_bit_grid(ours[:n // 2], ours[n // 2:]) < 0.1


def test_prefetched_noise_is_the_same_stream() -> None:
    params = dict(nn.Linear(40, 10).named_parameters())
    stream = PrefetchedNoise(torch.Generator().manual_seed(3), params, 0.5)
    try:
        first = stream.draw(0.5)
    finally:
        stream.close()
    expected = gaussian_noise(params, 0.5, torch.Generator().manual_seed(3))
    assert all(torch.equal(first[n], expected[n]) for n in params)


def test_no_trainer_draws_noise_outside_the_noise_module() -> None:
    """Every Gaussian a trainer adds for privacy goes through dpml.train.noise, none through torch's
    samplers directly."""
    direct = re.compile(r"torch\.normal\(|torch\.randn\(|\.normal_\(|randn_like\(")
    offenders = [f"{path.relative_to(ROOT)}:{number}" for path in sorted((ROOT / "dpml" / "train").rglob("*.py"))
                 if path.name != "noise.py"
                 for number, line in enumerate(path.read_text().splitlines(), 1) if direct.search(line)]
    # the clipping probe's synthetic inputs are the one sanctioned use (public inputs, not noise)
    assert offenders == ["dpml/train/clipping_check.py:82"], offenders
