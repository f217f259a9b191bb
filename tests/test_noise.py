"""DP noise (:mod:`dpml.train.noise`): Box–Muller with a 53-bit radius, in one place, so its tails reach 8.57σ.

torch's float32 sampler never draws beyond 5.77σ on the CPU (24-bit uniforms in Box–Muller), which
gives a neighbouring data set an impossible event the accountants' Gaussian does not have (module
docstring). These tests pin the construction, check the law, check that the tail radii are not on the
24-bit grid (and that the check sees that grid in torch's own sampler), and keep every trainer's noise
going through the module.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dpml.train import noise, kernels
from dpml.train.noise import BoxMullerBuffers, PrefetchedNoise, gaussian, gaussian_noise
from tests.noise_laws import BOUND_24, BOUND_53, box_muller, check_gaussian_draws, check_tail_resolution, grid_hits

ROOT = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine: the GPU noise checks did not run"
)


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
    for even in (8, 14, 300_000):  # ⌈count/2⌉ pairs, not (count + 2)/2: an even count has no spare pair
        drawn = gaussian((even,), 1.5, torch.Generator().manual_seed(even), torch.float32)
        torch.testing.assert_close(drawn, box_muller(even, 1.5, even), rtol=1e-6, atol=1e-6)
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
        reference = BoxMullerBuffers(count, torch.float32, compiled=False).draw(
            std, torch.Generator().manual_seed(seed)
        )
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


def numpy_stream_states(key: list[int]) -> np.ndarray:
    """The (a, b, c, counter) of NumPy's ``SFC64(child)`` for each child of ``SeedSequence(key).spawn(4)``."""
    children = np.random.SeedSequence(key).spawn(noise.STREAMS)
    return np.array([np.random.SFC64(child).state["state"]["state"] for child in children], dtype=np.uint64)


def test_the_compiled_seeding_is_numpys(tmp_path: Path) -> None:
    """``dpml_sfc64_stream_states`` (``_boxmuller.c``, compiled here into an empty cache) gives the draw's four SFC64
    states from its key bit for bit as NumPy's ``SeedSequence(key).spawn(4)`` and ``SFC64(child)`` do: keys whose
    integers take one 32-bit word (0, small) or two, and keys the torch generator draws; and the draw that seeds
    in compiled code draws the same numbers as one that seeds through NumPy's objects."""
    if kernels.c_compiler() is None:
        pytest.skip("no C compiler here: the streams are seeded by NumPy's objects")
    library = kernels.compile_kernel(tmp_path)
    assert library is not None
    seeding = kernels.load_stream_states(library)
    assert seeding is not None
    edges = [0, 1, 2**31, 2**32 - 1, 2**32, 2**33 + 5, 2**62 - 1]
    keys = [[edges[(i + j) % len(edges)] for j in range(4)] for i in range(len(edges))] + [[0, 0, 0, 0]]
    generator = torch.Generator().manual_seed(11)
    keys += [noise._draw_key(generator).tolist() for _ in range(300)]
    states = np.empty((noise.STREAMS, 4), dtype=np.uint64)
    for key in keys:
        held = torch.tensor(key, dtype=torch.int64)  # (held while the kernel reads it)
        seeding(held.data_ptr(), states.ctypes.data)
        assert np.array_equal(states, numpy_stream_states(key)), key
    if kernels.compiled_draw() is None:
        return
    seeded_in_c = BoxMullerBuffers(40_001, torch.float32)
    through_numpy = BoxMullerBuffers(40_001, torch.float32)
    through_numpy.seeding = None
    assert seeded_in_c.seeding is not None
    for seed in range(3):
        fast = seeded_in_c.draw(1.3, torch.Generator().manual_seed(seed)).clone()
        assert torch.equal(fast, through_numpy.draw(1.3, torch.Generator().manual_seed(seed)))


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
    done = subprocess.run(
        [sys.executable, "-c", THREADS_CHECK], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("same") and 3.0 < float(done.stdout.split()[1]) <= 8.58


def test_without_a_working_compiler_the_draw_falls_back_to_numpy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
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
    """The CPU draw (SFC64 streams, compiled or NumPy): mean, second moment, shape, pair independence, the
    frequency beyond 4σ, the 8.57σ bound and the 53-bit tail, each at a false-alarm rate of 1e-6
    (:mod:`tests.noise_laws`). Catches a draw whose std is off by 10 % (second moment 0.81)."""
    check_gaussian_draws("cpu")


@needs_cuda
def test_the_gpu_draw_follows_the_same_laws() -> None:
    """The GPU branch of :func:`gaussian` (the generator's Philox uniforms, torch's functions) checked by the
    same laws as the CPU draw above, tails included: not only its standard deviation."""
    check_gaussian_draws("cuda")


def test_the_tail_radii_come_from_53_bit_uniforms_not_24_bit_ones() -> None:
    """The tail's resolution is what bounds the draw (5.77σ with 24 bits). torch's float32 sampler pairs
    coordinates j and j + 8 of each block of 16 and puts every tail pair on the 24-bit grid (so the
    check can see it); dpml's pairs (k, k + n/2) must not be on it (at most the 1e-6 quantile of the
    hits 53-bit uniforms make by chance)."""
    assert BOUND_24 < 5.77 and BOUND_53 > 8.57
    n = 2_000_000  # ≈ 340 pairs beyond radius 4
    torch_float32 = torch.empty(n).normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0)).reshape(-1, 16)
    hits, pairs = grid_hits(torch_float32[:, :8], torch_float32[:, 8:])
    assert pairs > 100 and hits == pairs
    ours = gaussian_noise({"w": nn.Parameter(torch.zeros(n))}, 1.0, torch.Generator().manual_seed(0))["w"]
    assert ours.dtype == torch.float32
    check_tail_resolution(ours[: n // 2], ours[n // 2 :])


def test_the_draw_is_returned_in_the_parameters_dtype() -> None:
    """float64 parameters get the float64 construction; bfloat16 and float16 ones the float32 draw rounded to
    their dtype (the arithmetic stays float32), both through :func:`gaussian` and :func:`gaussian_noise`."""
    wide = gaussian_noise(
        {"w": nn.Parameter(torch.zeros(64, dtype=torch.float64))}, 1.0, torch.Generator().manual_seed(2)
    )
    assert wide["w"].dtype == torch.float64
    torch.testing.assert_close(wide["w"], box_muller(64, 1.0, 2, torch.float64), rtol=1e-12, atol=1e-12)
    for narrow in (torch.bfloat16, torch.float16):
        drawn = gaussian_noise(
            {"w": nn.Parameter(torch.zeros(64, dtype=narrow))}, 1.0, torch.Generator().manual_seed(2)
        )
        assert drawn["w"].dtype == narrow
        assert torch.equal(drawn["w"], box_muller(64, 1.0, 2).to(narrow))
        assert gaussian((5,), 1.0, torch.Generator(), narrow).dtype == narrow


def test_cpu_noise_streams_refuse_a_gpu_generator_by_name() -> None:
    """Only the device of the generator is read, so a stand-in with a CUDA device shows the refusal here."""
    from types import SimpleNamespace

    from dpml.train.noise import SynchronousNoise

    params = dict(nn.Linear(3, 2).named_parameters())
    elsewhere = SimpleNamespace(device=torch.device("cuda", 0))
    for stream in (PrefetchedNoise, SynchronousNoise):
        with pytest.raises(ValueError, match=rf"^{stream.__name__} draws on the CPU; this generator is on cuda:0$"):
            stream(elsewhere, params, 1.0)  # type: ignore[arg-type]


def test_prefetched_noise_keeps_the_noise_it_returned_while_it_draws_the_next() -> None:
    """The draws alternate between two sets of buffers: the noise :meth:`draw` returned stays intact while the
    next step's is drawn in the background (a stream that reused one set would overwrite it)."""
    params = dict(nn.Linear(40, 10).named_parameters())
    expected = [
        gaussian_noise(params, 0.5, generator) for generator in [torch.Generator().manual_seed(3)] for _ in range(3)
    ]
    stream = PrefetchedNoise(torch.Generator().manual_seed(3), params, 0.5)
    try:
        for step in range(3):
            drawn = stream.draw(0.5)
            stream.wait()  # the next draw is done: had it gone into these buffers, they would hold it now
            assert all(torch.equal(drawn[n], expected[step][n]) for n in params), step
    finally:
        stream.close()


def test_idle_core_counts_the_cores_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cores are the process's CPU affinity where the system has one, else the CPU count (1 if unknown);
    a core is idle when torch's intra-op threads are fewer."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(noise.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
        monkeypatch.setattr(noise.os, "cpu_count", lambda: 1)
        assert noise.idle_core()  # 3 cores in the affinity, whatever the machine's count
        monkeypatch.setattr(noise.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
        monkeypatch.setattr(noise.os, "cpu_count", lambda: 8)
        assert not noise.idle_core()
        monkeypatch.delattr(noise.os, "sched_getaffinity", raising=False)
        assert noise.idle_core()  # no affinity: 8 CPUs
        monkeypatch.setattr(noise.os, "cpu_count", lambda: None)
        torch.set_num_threads(1)
        assert not noise.idle_core()  # unknown: one core
    finally:
        torch.set_num_threads(threads)


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
    offenders = [
        (str(path.relative_to(ROOT)), line.strip())
        for path in sorted((ROOT / "dpml" / "train").rglob("*.py"))
        if path.name != "noise.py"
        for line in path.read_text().splitlines()
        if direct.search(line)
    ]
    # the sanctioned uses draw public numbers, not noise: the clipping probe's synthetic inputs, and the directions
    # along which a computed weight's Jacobian is checked (from the weight alone, a generator of their own)
    assert offenders == [
        ("dpml/train/clipping_check.py", "return torch.randn(shape, generator=generator, dtype=torch.float64)"),
        (
            "dpml/train/rules/row_jacobian.py",
            "scales = torch.randn(k, count, 1, generator=generator, device=like.device, dtype=torch.float64)",
        ),
        (
            "dpml/train/rules/row_jacobian.py",
            "directions = torch.randn(k, 1, n, generator=generator, device=like.device, dtype=torch.float64)",
        ),
    ], offenders
