"""DP's Gaussian noise, drawn in one place: N(0, σ²) by Box–Muller with a 53-bit radius (:func:`gaussian`),
from a run's secret-seeded ``torch.Generator``; for DP-SGD one flat buffer over every trainable parameter
(:func:`gaussian_noise`), on the CPU drawn a step ahead in a background thread (:class:`PrefetchedNoise`).

Why not torch's own ``normal_``: the tails. torch's float32 Box–Muller takes its radius √(−2 ln u)
from a uniform u of 24 bits on the CPU (32 on CUDA), so it never draws beyond 5.77σ (6.66σ). A
released coordinate beyond that bound plus the sensitivity C is then impossible without an example
and possible with it: an event of probability ≈ q·P(Z > 5.77 − 1/σ) per step (≈ q·1e-6 at σ = 1;
over 20 epochs 2e-5, more than a typical δ) that the accountants' Gaussian mechanism does not have.
Here 1 − U has 53 bits, so the bound is √(−2 ln 2⁻⁵³) = 8.57σ, and the event's probability is below
3e-11 per step for σ ≥ 0.5. torch's float64 ``normal_`` has 53-bit uniforms too, but it is scalar
code, ≈ 5× slower than its float32 sampler on a CPU (``benchmarks/results/speed_profile.md``).

The uniforms. On a GPU: the generator's own (Philox). On the CPU, torch's Mersenne Twister filled
uniforms at about half the speed of NumPy's SFC64 in an ad hoc measurement (Doty-Humphrey's small
fast chaotic generator, 256-bit state, reported to pass PractRand and TestU01's BigCrush, whose
linear-complexity tests MT19937 fails), so each call takes 4 × 62 bits from the secret-seeded torch
generator and seeds a fresh SFC64 stream with them (through NumPy's ``SeedSequence``): the draw is
still a function of the generator's state alone, and as secret as its seed. The transcendental
functions run in float32 for float32 output: 1 − U is exact in float64 and keeps its 24 leading bits
in float32 (float32 reaches 2⁻⁵³ with full precision), so the bound and the tail are those of the
53-bit uniform.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from torch import nn


def _uniform_pairs(half: int, generator: torch.Generator, angle_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``half`` pairs (U, V): U uniform on {0, 2⁻⁵³, …, 1 − 2⁻⁵³} (float64), V uniform on [0, 1) in ``angle_dtype``."""
    if generator.device.type != "cpu":
        u = torch.empty(half, dtype=torch.float64, device=generator.device).uniform_(generator=generator)
        return u, torch.empty(half, dtype=angle_dtype, device=generator.device).uniform_(generator=generator)
    key = torch.randint(0, 2 ** 62, (4,), generator=generator).tolist()
    stream = np.random.Generator(np.random.SFC64(np.random.SeedSequence(key)))
    u = torch.from_numpy(stream.random(half))
    v = torch.from_numpy(stream.random(half, dtype=np.float64 if angle_dtype == torch.float64 else np.float32))
    return u, v


def gaussian(shape: Sequence[int], std: float, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """N(0, std²) i.i.d. of ``shape`` on ``generator``'s device, in ``dtype``, by Box–Muller:

        R = std·√(−2 ln(1 − U)),  Θ = 2π V,  Z₁ = R cos Θ,  Z₂ = R sin Θ  (independent N(0, std²);
        Box & Muller 1958),  U, V from :func:`_uniform_pairs`,

    one (U, V) per pair of outputs: the first half of the flat draw is R cos Θ, the second R sin Θ.
    1 − U ≥ 2⁻⁵³ bounds |Z| by 8.57·std (module docstring). The functions run in float64 for float64
    output, else in float32."""
    count = math.prod(shape)
    half = (count + 1) // 2
    work = torch.float64 if dtype == torch.float64 else torch.float32
    u, angle = _uniform_pairs(half, generator, work)
    radius = u.neg_().add_(1.0).to(work).log_().mul_(-2.0).sqrt_().mul_(std)
    angle.mul_(2 * math.pi)
    out = torch.empty(2 * half, dtype=work, device=generator.device)
    torch.mul(radius, torch.cos(angle), out=out[:half])
    torch.mul(radius, angle.sin_(), out=out[half:])
    return out[:count].reshape(tuple(shape)).to(dtype)


def gaussian_noise(params: dict[str, nn.Parameter], std: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """N(0, std²) i.i.d. for every coordinate of every parameter, on ``generator``'s device.

    One flat buffer per parameter dtype (one in any ordinary model) is one :func:`gaussian` draw from
    ``generator`` (53-bit radius), and each parameter gets a view of its slice, in
    ``named_parameters`` order. The draw depends on nothing but the generator's state and the
    parameters' shapes (never on the data), and a fresh buffer is drawn at every call, so successive
    steps' noises are independent."""
    by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
    for name, p in params.items():
        by_dtype.setdefault(p.dtype, []).append((name, p))
    noises: dict[str, torch.Tensor] = {}
    for dtype, group in by_dtype.items():
        flat = gaussian((sum(p.numel() for _, p in group),), std, generator, dtype)
        offset = 0
        for name, p in group:
            noises[name] = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
    return {name: noises[name] for name in params}


class PrefetchedNoise:
    """A run's noise stream with each step's :func:`gaussian_noise` drawn one step ahead, in a background
    thread, while the step's clipping runs (on the CPU the draw is serial work that would otherwise
    hold up the step).

    The draws are the generator's k-th, k+1-th, … ``normal_`` calls, made one at a time by the one
    worker thread (the generator is touched by no one else while a draw is pending), so step k gets
    exactly what a synchronous :func:`gaussian_noise` would have drawn at its k-th call: the draw
    order depends on the step count only, never on the data, and the noise is the same for a given
    secret seed. ``close`` waits for the pending draw and stops the thread."""

    def __init__(self, generator: torch.Generator, params: dict[str, nn.Parameter], std: float) -> None:
        self.generator, self.params, self.std = generator, params, std
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpml-noise")
        self._next: Future[dict[str, torch.Tensor]] = self._submit()

    def _submit(self) -> Future[dict[str, torch.Tensor]]:
        return self._worker.submit(gaussian_noise, self.params, self.std, self.generator)

    def draw(self, std: float) -> dict[str, torch.Tensor]:
        """This step's noise (drawn ahead), and the next step's draw started."""
        if std != self.std:
            raise ValueError(f"noise std = {std}: this prefetched noise stream draws std {self.std} (σ·C of the run)")
        noises = self._next.result()
        self._next = self._submit()
        return noises

    def wait(self) -> None:
        """Block until the pending draw is done (the worker idle until the next :meth:`draw`)."""
        self._next.result()

    def close(self) -> None:
        self.wait()
        self._worker.shutdown(wait=True)
