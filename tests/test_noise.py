"""DP noise (:mod:`dpml.train.noise`): Box–Muller with a 53-bit radius, in one place, so its tails reach 8.57σ.

torch's float32 sampler never draws beyond 5.77σ on the CPU (24-bit uniforms in Box–Muller), which
gives a neighbouring data set an impossible event the accountants' Gaussian does not have (module
docstring). These tests pin the construction, check the law, check that the tail radii are not on the
24-bit grid (and that the check sees that grid in torch's own sampler), and keep every trainer's noise
going through the module.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

from dpml.train import noise, kernels
from dpml.train.noise import BoxMullerBuffers, PrefetchedNoise, gaussian, gaussian_noise

ROOT = Path(__file__).resolve().parents[1]


def box_muller(count: int, std: float, seed: int) -> torch.Tensor:
    """The construction written out: 4 × 62 bits from the torch generator seed a SeedSequence that spawns
    4 SFC64 streams; ⌈count/2⌉ pairs rounded up to 4q, stream k draws the q U of pairs kq … in float64,
    then their q V in float32; R = std·√(−2 ln(1 − U)) in float32; all the R cos 2πV, then all the R sin 2πV."""
    generator, half = torch.Generator().manual_seed(seed), (count + 1) // 2
    q = -(-half // 4)
    key = torch.randint(0, 2 ** 62, (4,), generator=generator).tolist()
    streams = [np.random.Generator(np.random.SFC64(child)) for child in np.random.SeedSequence(key).spawn(4)]
    uniforms = [(stream.random(q), stream.random(q, dtype=np.float32)) for stream in streams]
    u = torch.from_numpy(np.concatenate([pair[0] for pair in uniforms]))
    v = torch.from_numpy(np.concatenate([pair[1] for pair in uniforms]))
    radius = std * torch.sqrt(-2.0 * torch.log((1.0 - u).float()))
    theta = v * (2 * math.pi)
    return torch.cat([radius * torch.cos(theta), radius * torch.sin(theta)])[:count]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_float32_parameters_get_the_53_bit_box_muller_draw(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if compiled and kernels.compiled_draw() is None:
        pytest.skip("no C compiler here (or it failed: test_the_compiled_draw_is_the_numpy_draw says): NumPy draws")
    if not compiled:
        monkeypatch.setattr(noise, "compiled_draw", lambda: None)
    assert (BoxMullerBuffers(10, torch.float32).compiled is not None) == compiled  # the path under test
    params = dict(nn.Sequential(nn.Linear(30, 20), nn.Linear(20, 3)).named_parameters())
    drawn = gaussian_noise(params, 0.8, torch.Generator().manual_seed(5))
    flat = torch.cat([drawn[name].reshape(-1) for name in params])
    assert flat.dtype == torch.float32 and all(drawn[n].shape == p.shape for n, p in params.items())
    torch.testing.assert_close(flat, box_muller(flat.numel(), 0.8, 5), rtol=1e-6, atol=1e-6)
    odd = gaussian((300_001,), 1.5, torch.Generator().manual_seed(6), torch.float32)
    torch.testing.assert_close(odd, box_muller(300_001, 1.5, 6), rtol=1e-6, atol=1e-6)
    assert gaussian((4, 5), 1.0, torch.Generator(), torch.float64).shape == (4, 5)
    assert gaussian((), 1.0, torch.Generator(), torch.float32).shape == ()


def test_the_compiled_draw_is_the_numpy_draw(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_boxmuller.c``, compiled here into an empty cache (so a broken C file fails this test wherever a
    compiler exists, although the trainer would quietly fall back to NumPy), draws the same numbers as the
    NumPy path: the same uniforms bit for bit, float32 functions a few ulp apart. A second use loads the
    cached library instead of compiling again, and a changed source compiles anew."""
    if kernels.c_compiler() is None:
        pytest.skip("no C compiler here: the noise is drawn in NumPy (the compiled path cannot be built)")
    library = kernels.compile_kernel(tmp_path)
    assert library is not None and library.parent == tmp_path, "the C compiler failed on _boxmuller.c"
    built = kernels.load_kernel(library)
    assert built is not None
    for count, std, seed in [(1, 1.0, 0), (2, 0.3, 1), (9, 2.0, 2), (8193, 1.0, 3), (300_001, 4.0, 4)]:
        reference = BoxMullerBuffers(count, torch.float32, compiled=False).draw(std, torch.Generator().manual_seed(seed))
        drawn = BoxMullerBuffers(count, torch.float32, compiled=False)
        drawn.compiled = built
        fast = drawn.draw(std, torch.Generator().manual_seed(seed))
        torch.testing.assert_close(fast, reference, rtol=2e-6, atol=2e-6 * std)
        assert fast.abs().max() <= 8.58 * std  # the 53-bit bound
    modified = library.stat().st_mtime_ns
    assert kernels.compile_kernel(tmp_path) == library and library.stat().st_mtime_ns == modified  # cached
    changed = tmp_path / "another" / "_boxmuller.c"
    changed.parent.mkdir()
    changed.write_text(kernels.SOURCE.read_text() + "\n/* another version */\n")
    monkeypatch.setattr(kernels, "SOURCE", changed)
    again = kernels.compile_kernel(tmp_path)
    assert again is not None and again != library and len(list(tmp_path.glob("_boxmuller-*.so"))) == 2
    assert not list(tmp_path.glob(".*.part"))  # no half-written library left behind


THREADS_CHECK = """
import sys, torch
from dpml.train.noise import BoxMullerBuffers
draws = [BoxMullerBuffers(300_001, torch.float32).draw(1.0, torch.Generator().manual_seed(7), threads).clone()
         for threads in (1, 2, 3, 4, 8)]
assert all(torch.equal(draw, draws[0]) for draw in draws[1:])
print("same", float(draws[0].abs().max()))
"""


@pytest.mark.parametrize("thread_limit", [None, "3", "1"])
def test_the_compiled_draw_is_the_same_on_any_number_of_threads(thread_limit: str | None) -> None:
    """The kernel splits its 4 streams over 1, 2 or 4 OpenMP threads (each stream writes its own pairs),
    so every thread count gives the same numbers bit for bit; so does a team the OpenMP runtime makes
    smaller than asked (``OMP_THREAD_LIMIT``: its first thread then draws every stream). In a fresh
    process, so that the limit applies from the start."""
    if kernels.compiled_draw() is None:
        pytest.skip("no C compiler here: the noise is drawn in NumPy (single-threaded)")
    env = {key: value for key, value in os.environ.items() if key != "OMP_THREAD_LIMIT"}
    if thread_limit is not None:
        env["OMP_THREAD_LIMIT"] = thread_limit
    done = subprocess.run([sys.executable, "-c", THREADS_CHECK], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("same") and 3.0 < float(done.stdout.split()[1]) <= 8.58


def test_without_a_working_compiler_the_draw_falls_back_to_numpy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that fails, a missing compiler or a missing C source: no library, nothing half-written
    left behind, and the draw is NumPy's (the same numbers as the reference construction)."""
    monkeypatch.setenv("CC", "false")  # a command that fails like a broken compiler
    assert kernels.compile_kernel(tmp_path) is None and not list(tmp_path.iterdir())
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert kernels.compile_kernel(tmp_path) is None
    monkeypatch.delenv("CC")
    monkeypatch.setattr(kernels, "SOURCE", tmp_path / "missing.c")
    assert kernels.compile_kernel(tmp_path) is None
    monkeypatch.setattr(noise, "compiled_draw", lambda: None)
    assert BoxMullerBuffers(11, torch.float32).compiled is None
    drawn = gaussian((11,), 1.0, torch.Generator().manual_seed(3), torch.float32)
    torch.testing.assert_close(drawn, box_muller(11, 1.0, 3), rtol=1e-6, atol=1e-6)


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
