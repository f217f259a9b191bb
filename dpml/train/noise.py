"""DP's Gaussian noise, drawn in one place: N(0, σ²) by Box–Muller with a 53-bit radius (:func:`gaussian`),
from a run's secret-seeded ``torch.Generator``; for DP-SGD one flat buffer over every trainable parameter
(:func:`gaussian_noise`), on the CPU drawn a step ahead in a background thread where a core is idle
(:class:`PrefetchedNoise`), else in the step (:class:`SynchronousNoise`; :func:`cpu_noise_stream` picks).

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
generator, and NumPy's ``SeedSequence`` of them spawns ``STREAMS`` = 4 SFC64 streams, one per quarter
of the draw's pairs: the draw is still a function of the generator's state alone, and as secret as its
seed. (Four streams, so that compiled code can run them in lockstep, overlapping four independent
chains of dependent additions where one stream is one chain; ``SeedSequence.spawn`` is NumPy's way
to seed streams that are independent for all practical purposes. Where the kernel below is compiled, it
also computes the streams' seeded states from those bits, bit for bit NumPy's: NumPy's objects took 0.24 ms
of a 0.72 ms draw in the step of a 535k-parameter MLP.) The transcendental functions run in float32 for
float32 output: 1 − U is exact in float64 and keeps its 24 leading bits in float32 (float32 reaches 2⁻⁵³
with full precision), so the bound and the tail are those of the 53-bit uniform.

The CPU draw in float32 runs in compiled code (``_boxmuller.c``, compiled on first use where a C
compiler is found: :mod:`dpml.train.kernels`): the same uniforms bit for bit, the same float32
operations in the same order, with glibc's vector log / sin / cos (within a few ulp of NumPy's), in one
pass instead of a dozen NumPy passes (``benchmarks/results/speed_profile.md`` times both). Without it,
NumPy computes the same construction.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Sequence
from typing import Any
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

from dpml.train.kernels import compiled_draw, compiled_stream_states


def _uniform_pairs(
    half: int, generator: torch.Generator, angle_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``half`` pairs (U, V) on a GPU generator: U uniform on {0, 2⁻⁵³, …, 1 − 2⁻⁵³} (float64), V uniform on
    [0, 1) in ``angle_dtype``, both from the generator's own Philox stream."""
    u = torch.empty(half, dtype=torch.float64, device=generator.device).uniform_(generator=generator)
    return u, torch.empty(half, dtype=angle_dtype, device=generator.device).uniform_(generator=generator)


STREAMS = 4  # SFC64 streams per CPU draw, one per quarter of its pairs: part of the construction


def _draw_key(generator: torch.Generator) -> torch.Tensor:
    """A draw's key: 4 × 62 bits taken from the (secret-seeded) torch ``generator`` (int64)."""
    return torch.randint(0, 2**62, (4,), generator=generator)


def _sfc64_streams(key: torch.Tensor) -> list[np.random.SFC64]:
    """``STREAMS`` fresh SFC64 streams spawned by the ``SeedSequence`` of the draw's ``key``."""
    return [np.random.SFC64(child) for child in np.random.SeedSequence(key.tolist()).spawn(STREAMS)]


class BoxMullerBuffers:
    """The arrays of a CPU Box–Muller draw of ``count`` numbers in ``dtype`` (float64, else float32
    arithmetic), allocated once and reused by every :meth:`draw`: fresh megabyte arrays would be fresh
    pages, and on this virtual machine the page faults of a 536k-number draw cost more than its
    arithmetic (ad hoc: 4.8 against 1.7 ms, 1,800 faults per draw). With ``compiled`` the draw runs
    in the compiled kernel where there is one (float32 only: :func:`dpml.train.kernels.compiled_draw`), on
    as many of torch's OpenMP threads as :meth:`draw` is told (one by default), else in NumPy's SIMD code
    (single-threaded).

    The P = ``STREAMS``·q pairs (q = ⌈⌈count/2⌉ / STREAMS⌉) are split in quarters, stream k drawing all
    the U of pairs kq … kq + q − 1 and then all their V; ``out`` holds the P values R cos Θ and then
    the P values R sin Θ, and the draw is its first ``count`` numbers."""

    def __init__(self, count: int, dtype: torch.dtype, compiled: bool = True) -> None:
        self.dtype = dtype
        work = np.float64 if dtype == torch.float64 else np.float32
        self.compiled = compiled_draw() if compiled and work == np.float32 else None
        self.seeding = None if self.compiled is None else compiled_stream_states()
        self.states: np.ndarray[Any, Any] = np.empty((STREAMS, 4), dtype=np.uint64)  # the kernel's (a, b, c, counter)
        self.q = -(-((count + 1) // 2) // STREAMS)  # pairs per stream
        pairs = STREAMS * self.q
        scratch = pairs if self.compiled is None else 0  # NumPy's intermediate arrays (the kernel keeps its own)
        self.u: np.ndarray[Any, Any] = np.empty(scratch)  # U, then 1 − U, in float64
        self.radius: np.ndarray[Any, Any] = np.empty(scratch, dtype=work)
        self.angle: np.ndarray[Any, Any] = np.empty(scratch, dtype=work)
        self.out: np.ndarray[Any, Any] = np.empty(2 * pairs, dtype=work)
        self.flat = torch.from_numpy(self.out)[:count]  # shares the memory of ``out``

    def draw(self, std: float, generator: torch.Generator, threads: int = 1) -> torch.Tensor:
        """The flat draw of :func:`gaussian`, written into this object's output (valid until the next draw);
        the compiled kernel runs the streams on ``threads`` of torch's OpenMP threads (1, 2 or 4; the same
        numbers for any)."""
        key = _draw_key(generator)
        if self.compiled is None:
            self._draw_in_numpy(_sfc64_streams(key), std)
        else:
            if self.seeding is not None:  # the streams' states from the key in compiled code (the same numbers)
                self.seeding(key.data_ptr(), self.states.ctypes.data)
            else:
                self.states[:] = [stream.state["state"]["state"] for stream in _sfc64_streams(key)]
            self.compiled(self.states.ctypes.data, self.q, std, self.out.ctypes.data, threads)
        return self.flat if self.flat.dtype == self.dtype else self.flat.to(self.dtype)

    def _draw_in_numpy(self, streams: list[np.random.SFC64], std: float) -> None:
        q, u, radius, angle, out = self.q, self.u, self.radius, self.angle, self.out
        pairs = u.shape[0]
        for k, stream in enumerate(streams):
            numbers = np.random.Generator(stream)
            numbers.random(out=u[k * q : (k + 1) * q])
            numbers.random(dtype=angle.dtype, out=angle[k * q : (k + 1) * q])
        np.subtract(1.0, u, out=u)  # exact in float64: {2⁻⁵³, …, 1}
        np.copyto(radius, u, casting="same_kind")  # float32 keeps the 24 leading bits of 1 − U
        np.log(radius, out=radius)
        radius *= -2.0 * std * std
        np.sqrt(radius, out=radius)  # R = std·√(−2 ln(1 − U))
        angle *= 2 * math.pi
        np.cos(angle, out=out[:pairs])
        out[:pairs] *= radius
        np.sin(angle, out=angle)
        np.multiply(angle, radius, out=out[pairs:])


def gaussian(shape: Sequence[int], std: float, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """N(0, std²) i.i.d. of ``shape`` on ``generator``'s device, in ``dtype``, by Box–Muller:

        R = std·√(−2 ln(1 − U)),  Θ = 2π V,  Z₁ = R cos Θ,  Z₂ = R sin Θ  (independent N(0, std²);
        Box & Muller 1958),  U uniform on {0, 2⁻⁵³, …, 1 − 2⁻⁵³}, V uniform on [0, 1),

    one (U, V) per pair of outputs: the first half of the flat draw is R cos Θ, the second R sin Θ
    (on the CPU, of the pairs rounded up to a multiple of ``STREAMS``). 1 − U ≥ 2⁻⁵³ bounds |Z| by
    8.57·std (module docstring). The functions run in float64 for float64 output, else in float32; on
    the CPU in compiled code or NumPy (:class:`BoxMullerBuffers`: ``STREAMS`` SFC64 streams, each
    drawing all its U, then all its V), on a GPU in torch (the generator's Philox stream). A complex ``dtype`` is
    refused: cast to it, real noise would leave every imaginary part without noise."""
    if dtype.is_complex:
        raise ValueError(
            f"dtype: {dtype} noise is not drawn (real and imaginary parts each need their own); allowed: real"
        )
    count = math.prod(shape)
    if generator.device.type == "cpu":
        return BoxMullerBuffers(count, dtype).draw(std, generator, torch.get_num_threads()).reshape(tuple(shape))
    half = (count + 1) // 2
    work = torch.float64 if dtype == torch.float64 else torch.float32
    u, angle = _uniform_pairs(half, generator, work)
    radius = u.neg_().add_(1.0).to(work).log_().mul_(-2.0).sqrt_().mul_(std)
    angle.mul_(2 * math.pi)
    out = torch.empty(2 * half, dtype=work, device=generator.device)
    torch.mul(radius, torch.cos(angle), out=out[:half])
    torch.mul(radius, angle.sin_(), out=out[half:])
    return out[:count].reshape(tuple(shape)).to(dtype)


def _dtype_groups(params: dict[str, nn.Parameter]) -> dict[torch.dtype, list[tuple[str, nn.Parameter]]]:
    groups: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
    for name, p in params.items():
        groups.setdefault(p.dtype, []).append((name, p))
    return groups


def _split(flat: torch.Tensor, group: list[tuple[str, nn.Parameter]], into: dict[str, torch.Tensor]) -> None:
    offset = 0
    for name, p in group:
        into[name] = flat[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()


def gaussian_noise(params: dict[str, nn.Parameter], std: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """N(0, std²) i.i.d. for every coordinate of every parameter, on ``generator``'s device.

    One flat buffer per parameter dtype (one in any ordinary model) is one :func:`gaussian` draw from
    ``generator`` (53-bit radius), and each parameter gets a view of its slice, in
    ``named_parameters`` order. The draw depends on nothing but the generator's state and the
    parameters' shapes (never on the data), and a fresh buffer is drawn at every call, so successive
    steps' noises are independent."""
    noises: dict[str, torch.Tensor] = {}
    for dtype, group in _dtype_groups(params).items():
        _split(gaussian((sum(p.numel() for _, p in group),), std, generator, dtype), group, noises)
    return {name: noises[name] for name in params}


class _ReusedNoise:
    """:func:`gaussian_noise` on the CPU into buffers allocated once (:class:`BoxMullerBuffers`): the same
    numbers for the same generator state; each call overwrites the previous call's noise."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        self.names = list(params)
        self.groups: list[tuple[BoxMullerBuffers, list[tuple[str, nn.Parameter]], dict[str, torch.Tensor]]] = []
        for dtype, group in _dtype_groups(params).items():
            buffers = BoxMullerBuffers(sum(p.numel() for _, p in group), dtype)
            views: dict[str, torch.Tensor] = {}
            _split(buffers.flat, group, views)  # the parameters' views of a draw made in place (made once)
            self.groups.append((buffers, group, views))

    def __call__(self, std: float, generator: torch.Generator, threads: int = 1) -> dict[str, torch.Tensor]:
        noises: dict[str, torch.Tensor] = {}
        for buffers, group, views in self.groups:
            flat = buffers.draw(std, generator, threads)
            if flat is buffers.flat:
                noises.update(views)
            else:  # (drawn in float32 for another dtype: a fresh tensor)
                _split(flat, group, noises)
        return {name: noises[name] for name in self.names}


def _check_std(std: float, stream_std: float) -> None:
    if std != stream_std:
        raise ValueError(f"noise std = {std}: this noise stream draws std {stream_std} (σ·C of the run)")


def _check_cpu(generator: torch.Generator, kind: str) -> None:
    if generator.device.type != "cpu":
        raise ValueError(f"{kind} draws on the CPU; this generator is on {generator.device}")


class PrefetchedNoise:
    """A run's noise stream on the CPU with each step's :func:`gaussian_noise` drawn one step ahead, in a
    background thread, while the step's clipping runs on a core torch's threads leave idle
    (:func:`cpu_noise_stream` picks it only then: where torch's threads take every core, the draw
    competes with the step for them, :class:`SynchronousNoise`).

    The draws are the generator's k-th, k+1-th, … draws, made one at a time by the one worker thread
    (the generator is touched by no one else while a draw is pending), so step k gets exactly what a
    synchronous :func:`gaussian_noise` would have drawn at its k-th call: the draw order depends on the
    step count only, never on the data, and the noise is the same for a given secret seed. The draws
    alternate between two sets of buffers allocated once, so the noise :meth:`draw` returns is valid
    until the next call of :meth:`draw` (the trainer adds it to the step's sums at once). ``close`` waits
    for the pending draw and stops the thread."""

    def __init__(self, generator: torch.Generator, params: dict[str, nn.Parameter], std: float) -> None:
        _check_cpu(generator, "PrefetchedNoise")
        self.generator, self.params, self.std = generator, params, std
        self._buffers = (_ReusedNoise(params), _ReusedNoise(params))
        self._draws = 0
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpml-noise")
        self._next: Future[dict[str, torch.Tensor]] = self._submit()

    def _submit(self) -> Future[dict[str, torch.Tensor]]:
        buffers = self._buffers[self._draws % 2]
        self._draws += 1
        return self._worker.submit(buffers, self.std, self.generator)

    def draw(self, std: float) -> dict[str, torch.Tensor]:
        """This step's noise (drawn ahead; valid until the next call), and the next step's draw started."""
        _check_std(std, self.std)
        noises = self._next.result()
        self._next = self._submit()
        return noises

    def wait(self) -> None:
        """Block until the pending draw is done (the worker idle until the next :meth:`draw`)."""
        self._next.result()

    def close(self) -> None:
        self.wait()
        self._worker.shutdown(wait=True)


class SynchronousNoise:
    """A run's noise stream on the CPU with each step's :func:`gaussian_noise` drawn when the step asks for
    it, into buffers allocated once (valid until the next :meth:`draw`), on torch's intra-op threads
    (the compiled kernel's streams split over up to 4 of them): for a process whose cores torch's
    intra-op threads all take, where a background draw would stall them instead of using an idle core
    (``benchmarks/README.md``: the MLP at batch 512 on two threads). The same draws, in the
    same order, as :class:`PrefetchedNoise` and as synchronous :func:`gaussian_noise` calls."""

    def __init__(self, generator: torch.Generator, params: dict[str, nn.Parameter], std: float) -> None:
        _check_cpu(generator, "SynchronousNoise")
        self.generator, self.std = generator, std
        self._buffers = _ReusedNoise(params)

    def draw(self, std: float) -> dict[str, torch.Tensor]:
        """This step's noise (valid until the next call)."""
        _check_std(std, self.std)
        return self._buffers(self.std, self.generator, torch.get_num_threads())

    def wait(self) -> None:
        """Nothing is pending: a synchronous stream draws inside :meth:`draw`."""

    def close(self) -> None:
        """Nothing to stop."""


NoiseStream = PrefetchedNoise | SynchronousNoise


def idle_core() -> bool:
    """Whether torch's intra-op threads leave one of the cores this process may run on idle."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores > torch.get_num_threads()


def cpu_noise_stream(generator: torch.Generator, params: dict[str, nn.Parameter], std: float) -> NoiseStream:
    """The trainer's CPU noise stream: drawn a step ahead on the idle core where there is one
    (:class:`PrefetchedNoise`), else drawn in the step (:class:`SynchronousNoise`); the numbers are the same."""
    return (PrefetchedNoise if idle_core() else SynchronousNoise)(generator, params, std)


NOISE_SEED_VARIABLE = "DPML_NOISE_SEED"


def secret_noise_seed() -> int:
    """The seed of the Poisson sampling and Gaussian noise of a model that will be released.

    DP holds only if the adversary cannot predict the noise or the batches: a seed written in
    ``params.yaml`` or logged with the run would void the guarantee (the released model would be a
    deterministic function of the data). So the seed is fresh OS entropy — or the integer in the
    environment variable ``DPML_NOISE_SEED``, which an operator keeps secret to reproduce a release
    exactly (``dvc repro``). dpml never writes it anywhere.
    """
    text = os.environ.get(NOISE_SEED_VARIABLE)
    if text is None or not text.strip():
        return secrets.randbits(62)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{NOISE_SEED_VARIABLE} = {text!r}: must be an integer") from None
