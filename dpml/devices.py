"""Where training runs: choosing the device, moving host tensors to it without waiting, keeping the CPU's
freed memory for the next step, and keeping the process's older objects out of the collector's way."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import platform
import random
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def pick_device(preference: str = "auto") -> torch.device:
    """``cuda`` when asked for or available (``auto``), else CPU."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device = 'cuda' but no CUDA device is available")
    if preference == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


RngState = tuple[torch.Tensor, "torch.Tensor | None"]


def rng_state(device: torch.device) -> RngState:
    """torch's random state for work on ``device`` (the CPU generator's, and the GPU's where it is one)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def rng_state_to_replay(device: torch.device) -> RngState | None:
    """:func:`rng_state`, or None while ``device``'s current stream is being captured into a CUDA graph, where the
    generator's state cannot be read (:mod:`dpml.train.captured` captures only passes that draw nothing)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    return rng_state(device)


@contextlib.contextmanager
def forked_generators(device: torch.device, seed: int | None = None) -> Iterator[None]:
    """Passes that are not training's own (the clipping check's, the chunk tuner's) run on forks of every global
    generator a model may draw from: torch's (the CPU's, and ``device``'s where it is a GPU), NumPy's and Python's
    (``transformers``' wav2vec2 masks its features with ``np.random``), each seeded with ``seed`` where one is given
    (every pass then draws the same masks), and all as they were afterwards."""
    host = host_generators_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if seed is not None:
            torch.manual_seed(seed)
            np.random.seed(seed)
            random.seed(seed)
        try:
            yield
        finally:
            set_host_generators_state(host)


HostGenerators = tuple[Any, Any]
"""NumPy's and Python's global generators' states."""


def host_generators_state() -> HostGenerators:
    """The states of NumPy's and Python's global generators, which some models draw from in their forward pass
    (``transformers``' wav2vec2 draws its feature masks from NumPy's). Reading them takes some 30 µs."""
    return np.random.get_state(), random.getstate()


def set_host_generators_state(state: HostGenerators) -> None:
    np.random.set_state(state[0])
    random.setstate(state[1])


def set_rng_state(state: RngState, device: torch.device) -> None:
    """Back to a state :func:`rng_state` returned: the next draws repeat (dropout masks of a pass run again)."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` without making the host wait for the GPU.

    A copy from ordinary (pageable) host memory to CUDA blocks the host until the GPU has drained its
    queue, which would synchronise every training step; from pinned memory with ``non_blocking`` the copy
    is queued on the stream like any kernel (torch keeps the pinned block alive until the copy has run)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)


_OVERRIDDEN: list[tuple[str, bool]] = []  # the settings each open full_float32 block replaced, innermost last


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """TF32 off for matrix products and cuDNN convolutions inside the block (restored after).

    On a GPU, TF32 (10-bit mantissas; torch's default for cuDNN convolutions, and for matrix products
    under ``torch.set_float32_matmul_precision("high")``) would let two computations of the same
    gradient differ by ~1e-3 relative: an example's norm and its clipped contribution to the sum would
    no longer come from the same numbers, and ‖c_i g_i‖ could exceed C by that much. The clipping
    engine forms norms and sums inside this block; the audit's recomputation does too."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    _OVERRIDDEN.append((matmul, cudnn))
    try:
        yield
    finally:
        _OVERRIDDEN.pop()
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


@contextlib.contextmanager
def convolution_weight_gradient_precision(device: torch.device) -> Iterator[None]:
    """Inside :func:`full_float32`, on a GPU: the block's float32 matrix products at the precision a
    convolution's own weight gradient gets outside it — TF32 where cuDNN's flag, as the enclosing block
    found it, allows TF32 (torch's default), else full float32. Elsewhere: no change.

    For the per-example gradients G_i of a convolution that the engine *keeps*: each example's norm
    ‖G_i‖ and its share c_i·G_i of the clipped sum are both formed in float32 from the same stored G_i,
    so ‖c_i G_i‖ ≤ C holds exactly whatever the precision of the product that made G_i; TF32 only
    changes which gradient G_i is, as it does in the non-private step's weight gradient."""
    if device.type != "cuda" or not _OVERRIDDEN:
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if _OVERRIDDEN[-1][1] else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
HEAP_BLOCKS_BELOW = 32 << 20  # bytes: glibc's ceiling for its dynamic mmap threshold on 64-bit systems
FREE_HEAP_KEPT = 1 << 30  # bytes of free memory at the top of the heap kept, not returned to the system
MALLOC_ENVIRONMENT = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


@functools.cache
def keep_freed_cpu_memory() -> bool:
    """Have glibc's malloc keep the memory a training step frees for the next step (once per process);
    True where it was set, False where it does not apply (not glibc on Linux) or the environment
    already sets malloc's thresholds (the operator's choice stands).

    A CPU training step allocates and frees the same megabytes every step (activations, their
    gradients, per-example gradients). glibc returns the top of its heap to the system whenever more
    than twice its (dynamic) mmap threshold is free there, so a step could fault all its pages in anew:
    on this project's 2-core virtual machine ≈ 7,700 page faults per step of the Opacus example CNN at
    batch 512, non-private and private alike, a quarter of its time (``benchmarks/README.md``), and a
    chunk size timed by :mod:`dpml.train.chunking` in one allocation history could be slower in the
    training loop's. Here blocks below 32 MiB (the ceiling glibc's dynamic threshold reaches anyway) come
    from the heap, and up to 1 GiB of free heap is kept for the next step, as torch's caching allocator
    keeps freed memory on a GPU; larger blocks are mapped and unmapped as before, so a transient
    gigabyte does not stay. Process-wide, for the rest of the process (glibc cannot return to its
    dynamic thresholds)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(os.environ.get(name) for name in MALLOC_ENVIRONMENT) or "glibc.malloc." in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_BLOCKS_BELOW)) and bool(mallopt(M_TRIM_THRESHOLD, FREE_HEAP_KEPT))


HEAP_BLOCK_MARGIN = 4096  # bytes below HEAP_BLOCKS_BELOW left for malloc's header and torch's alignment


def heap_sized_slices(count: int, bytes_each: int, device: torch.device) -> list[slice]:
    """Consecutive slices of ``count`` items (a batch's examples), each at least one item, such that a
    block of ``bytes_each`` bytes per item allocated for a slice stays below ``HEAP_BLOCKS_BELOW`` on a
    CPU: it then comes from the heap :func:`keep_freed_cpu_memory` keeps, where one block for the whole
    batch would be mapped afresh at every step, its pages zeroed and faulted in by the kernel (a
    WRN-16-4 convolution's kept per-example gradients, 75 MB for 128 examples, ≈17 of the 65 ms that
    made them, ad hoc). One slice on a GPU, whose caching allocator keeps blocks of any size; one
    empty slice for no items."""
    if device.type != "cpu" or count == 0:
        return [slice(0, count)]
    step = max(1, (HEAP_BLOCKS_BELOW - HEAP_BLOCK_MARGIN) // max(1, bytes_each))
    return [slice(start, min(count, start + step)) for start in range(0, count, step)]


class _Freeze:
    """Who holds :func:`older_objects_left_out_of_collections`'s freeze: how many loops, and whether the freeze is
    this module's (False while the process's own freeze or its disabled collector is left alone)."""

    lock = threading.Lock()
    holders = 0
    ours = False


@contextlib.contextmanager
def older_objects_left_out_of_collections() -> Iterator[None]:
    """Within the block (a training loop), the objects the process held before it are left out of Python's cyclic
    garbage collections (``gc.freeze``) and put back after it (``gc.unfreeze``), however the block ends.

    An engine pass holds thousands of Python objects at once (the recorder's records, the layers' calls and
    pieces, the backward pass's hooks), so the collector's young generations overflow several times a step and
    every so often it runs a full collection, which visits every tracked object of the process: the whole heap
    of the user's process, ≈ 440 k objects and ≈ 0.28 s a full collection in a pipeline process with MLflow,
    Prefect and pandas loaded on this project's CPU (XCiT at batch 64 ran one every 15 steps there:
    ``benchmarks/results/collector_pauses.md``). Frozen, a full collection visits only what the loop made.
    Garbage cycles older than the loop are freed after it, not during it (the young generations are collected
    on entry, ``gc.collect(1)``); the cycles the loop makes are collected as before, and objects are freed by
    their reference counts as always.

    Left alone where the process froze objects itself (``gc.get_freeze_count()`` > 0 on entry: a server that
    freezes before forking keeps its freeze) or turned the collector off. Loops in several threads share one
    freeze: the first in freezes, the last out unfreezes."""
    with _Freeze.lock:
        if _Freeze.holders == 0:
            _Freeze.ours = gc.isenabled() and gc.get_freeze_count() == 0
            if _Freeze.ours:
                gc.collect(1)
                gc.freeze()
        _Freeze.holders += 1
    try:
        yield
    finally:
        with _Freeze.lock:
            _Freeze.holders -= 1
            if _Freeze.holders == 0 and _Freeze.ours:
                gc.unfreeze()
                _Freeze.ours = False
