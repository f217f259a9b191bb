"""The physical chunk DP-SGD clips at a time: the fastest one this machine has, measured before training.

A step's clipped sum Σ_{i∈B_t} clip_C(∇ℓ_i) is the same whatever chunks B_t is cut into (it is a sum
over examples; only the floating-point order of the additions changes), so the chunk size is a matter
of speed and memory alone, never of privacy: the mechanism, its sensitivity C and its certificate do
not depend on it. ``physical_batch_size`` bounds the memory; below it the speed is not monotone. On a
CPU, the per-example gradients a convolution materialises, its unfolded patches and the recorded
activations of a large chunk overflow the caches, and a layer whose per-example gradients no longer fit
the engine's keep limit falls back to ghost norms and a second pass
(:func:`dpml.train.clipping_norms.materialise`): on this project's 2-core CPU, WRN-16-4's DP step at
batch 512 took 5.8 s in chunks of 64 rows against 14.6 s in one (``benchmarks/README.md``, WRN-16-4
on the CPU). On a GPU larger chunks are usually faster, up to the memory.

So, unless switched off, the trainer times the clipping engine on the synthetic public probe batch of
:mod:`dpml.train.clipping_check` (never a record: the choice carries nothing about the data) at
chunks of 16, 32, 64, … rows up to the bound, on a copy of the model (its buffers and the random state
untouched): a first pass in increasing size stops once the time per example has grown
``STOP_FACTOR``-fold past the best, then ``TIMED_RUNS`` rounds time the sizes it reached in turn, so a
passing load falls on all of them alike. The chunk with the least time per example is taken; the
largest one within ``PREFER_LARGER`` of it is preferred (fewer passes, steadier timing). A chunk the
model fails on (out of memory, or an error of its own) ends the search with what was measured; if
nothing could be measured the chunk is the bound, as without tuning, so tuning never fails a run that
would otherwise train. The choice is measured once per architecture, loss, input, device, bound and
thread count in a process. On the CPU it is timed under the malloc settings the training loop runs
under (:func:`dpml.devices.keep_freed_cpu_memory`): under glibc's dynamic defaults a probe chunk and a
training step could page-fault differently, and the CNN at batch 512 on two threads was given chunks
of 128 rows that were slower in the loop than the whole batch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpml.devices import forked_generators, keep_freed_cpu_memory
from dpml.train.clipping import LossFn, clipped_gradient_sum
from dpml.train.clipping_check import architecture_key, probe_batch, probe_labels, working_copy

SMALLEST = 16
PREFER_LARGER = 0.05  # a smaller chunk must be more than 5 % faster per example to be taken
STOP_FACTOR = 1.3  # stop timing larger chunks once the time per example is 1.3× the best
TIMED_RUNS = 2  # rounds over the sizes after the first pass; each size's fastest pass counts (the least disturbed)
LOG = logging.getLogger("dpml.chunking")


@dataclass(frozen=True)
class ChunkChoice:
    """The chunk taken and the measurements behind it: (chunk, seconds per example) in the order timed."""

    chunk: int
    timings: tuple[tuple[int, float], ...]
    ran_out: int | None = None  # the smallest chunk that ran out of the device's memory (None: none did)

    def line(self) -> str:
        timed = ", ".join(f"{size}: {1e6 * seconds:.0f} µs" for size, seconds in self.timings)
        short = "" if self.ran_out is None else f"; a chunk of {self.ran_out} rows ran out of the device's memory"
        return f"physical chunk {self.chunk} (time per example by chunk — {timed or 'not timed'}{short})"


def candidate_chunks(bound: int, expected_batch: float) -> list[int]:
    """16, 32, 64, … below the largest useful chunk, then that chunk: ``bound`` (the memory limit), or the
    expected batch q·n rounded up when it is smaller (a larger chunk than a batch is never filled)."""
    largest = max(1, min(int(bound), math.ceil(expected_batch)))
    sizes, size = [], SMALLEST
    while size < largest:
        sizes.append(size)
        size *= 2
    return sizes + [largest]


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    exact: Collection[str],
    autocast: torch.dtype | None,
) -> float:
    """Wall time of one engine pass over the chunk (x, y)."""
    _synchronise(x.device)
    start = time.perf_counter()
    clipped_gradient_sum(model, loss_fn, x, y, 1.0, exact=exact, autocast=autocast)
    _synchronise(x.device)
    return time.perf_counter() - start


def _probe_chunk(
    model: nn.Module, input_shape: tuple[int, ...], input_dtype: torch.dtype, size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` synthetic inputs of the records' shape and dtype, with uniform labels over the model's outputs."""
    x = probe_batch(model, input_shape, input_dtype, size)[:size]
    x = (x.to(input_dtype) if x.is_floating_point() else x).to(device)
    with torch.no_grad():
        outputs = model(x)
    return x, probe_labels(outputs, size).to(device)


Chunk = tuple[torch.Tensor, torch.Tensor]


def _first_pass(
    model: nn.Module,
    loss_fn: LossFn,
    input_shape: tuple[int, ...],
    input_dtype: torch.dtype,
    sizes: list[int],
    exact: Collection[str],
    autocast: torch.dtype | None,
) -> tuple[dict[int, tuple[Chunk, float]], int | None]:
    """Each size in turn, a warm-up pass then a timed one (per example), until one is ``STOP_FACTOR`` times
    slower per example than the best so far or fails (out of memory, or an error of the model's own); what was
    measured, and the size that ran out of memory (None: none did)."""
    device = next(model.parameters()).device
    found: dict[int, tuple[Chunk, float]] = {}
    for size in sizes:
        try:
            chunk = _probe_chunk(model, input_shape, input_dtype, size, device)
            _seconds(model, loss_fn, *chunk, exact, autocast)
            seconds = _seconds(model, loss_fn, *chunk, exact, autocast) / size
        except torch.OutOfMemoryError:  # larger chunks will not fit either
            _release(device)
            return found, size
        except Exception:  # noqa: BLE001 — a chunk the model cannot take: keep what was measured
            break
        found[size] = (chunk, seconds)
        if seconds > STOP_FACTOR * min(s for _, s in found.values()):
            break
    return found, None


def _release(device: torch.device) -> None:
    """Hand the blocks a failed pass left in the caching allocator back, so that a smaller pass can use them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _largest_that_fits(
    model: nn.Module,
    loss_fn: LossFn,
    input_shape: tuple[int, ...],
    input_dtype: torch.dtype,
    size: int,
    exact: Collection[str],
    autocast: torch.dtype | None,
) -> tuple[int, int | None]:
    """``size``, halved until one engine pass over that many probe rows runs without running out of the device's
    memory, and the smallest size that ran out (None: none did); a device that cannot hold one row is refused with
    what it could not hold."""
    device, ran_out = next(model.parameters()).device, None
    while True:
        try:
            _seconds(model, loss_fn, *_probe_chunk(model, input_shape, input_dtype, size, device), exact, autocast)
            return size, ran_out
        except torch.OutOfMemoryError as error:
            _release(device)
            if size == 1:
                raise torch.OutOfMemoryError(
                    f"one record's clipping pass does not fit in {device}'s memory (input shape {list(input_shape)}): "
                    f"{error}"
                ) from error
            size, ran_out = size // 2, size


def _measure(
    model: nn.Module,
    loss_fn: LossFn,
    input_shape: tuple[int, ...],
    input_dtype: torch.dtype,
    sizes: list[int],
    exact: Collection[str],
    autocast: torch.dtype | None,
) -> ChunkChoice:
    """The first pass, then ``TIMED_RUNS`` more rounds over the sizes it kept, in turn (so that a passing
    load on the machine falls on all of them alike); each size's time is its fastest pass. Where even the smallest
    size ran out of memory, the largest smaller one that fits, untimed."""
    found, ran_out = _first_pass(model, loss_fn, input_shape, input_dtype, sizes, exact, autocast)
    if not found and ran_out is not None:
        fits, smaller = _largest_that_fits(model, loss_fn, input_shape, input_dtype, ran_out // 2 or 1, exact, autocast)
        return ChunkChoice(fits, (), smaller or ran_out)
    if not found:  # nothing could be timed: the chunks are ``physical_batch_size`` rows, as untuned
        return ChunkChoice(sizes[-1], ())
    best = {size: seconds for size, (_, seconds) in found.items()}
    for _ in range(TIMED_RUNS):
        for size, (chunk, _) in found.items():
            best[size] = min(best[size], _seconds(model, loss_fn, *chunk, exact, autocast) / size)
    fastest = min(best.values())
    chosen = max(size for size, seconds in best.items() if seconds <= fastest * (1 + PREFER_LARGER))
    return ChunkChoice(chosen, tuple(best.items()), ran_out)


def _untuned(
    model: nn.Module,
    loss_fn: LossFn,
    input_shape: tuple[int, ...],
    input_dtype: torch.dtype,
    bound: int,
    exact: Collection[str],
    autocast: torch.dtype | None,
) -> ChunkChoice:
    """``bound`` rows, or the largest of ``bound`` halved that one engine pass fits in the device's memory."""
    fits, ran_out = _largest_that_fits(model, loss_fn, input_shape, input_dtype, bound, exact, autocast)
    return ChunkChoice(fits, (), ran_out)


_CHOICES: dict[tuple[Any, ...], ChunkChoice] = {}


def fastest_chunk(
    model: nn.Module,
    loss_fn: LossFn,
    input_shape: tuple[int, ...],
    input_dtype: torch.dtype,
    bound: int,
    expected_batch: float,
    exact: Collection[str] = (),
    autocast: torch.dtype | None = None,
    tune: bool = True,
) -> ChunkChoice:
    """The physical chunk for DP-SGD on ``model`` (module docstring): at most ``bound`` rows, measured on
    a copy of the model on its device, with the random state restored afterwards. Untuned (``tune`` False): ``bound``
    rows, unless one pass of that many runs out of the device's memory (checked on a device that says so: not the
    CPU, whose failed allocations torch does not raise as such); then the largest of ``bound`` halved that fits."""
    sizes = candidate_chunks(bound, expected_batch) if tune else [bound]
    tune = len(sizes) > 1  # (one size: nothing to time, only whether it fits)
    device = next(model.parameters()).device
    if device.type == "cpu":
        if not tune:
            return ChunkChoice(sizes[0], ())
        keep_freed_cpu_memory()  # timed under the allocator settings the training steps run under
    key = (
        architecture_key(model, loss_fn, input_shape, input_dtype),
        str(device),
        tuple(sizes),
        tuple(sorted(exact)),
        autocast,
        torch.get_num_threads(),
        tune,
    )
    if key not in _CHOICES:
        with forked_generators(device):
            twin = working_copy(model)
            twin.train()
            _CHOICES[key] = (
                _measure(twin, loss_fn, input_shape, input_dtype, sizes, exact, autocast)
                if tune
                else _untuned(twin, loss_fn, input_shape, input_dtype, sizes[0], exact, autocast)
            )
            del twin
        choice = _CHOICES[key]
        if choice.ran_out is not None and choice.chunk < bound:
            LOG.warning(
                "physical_batch_size %d: a chunk of %d rows ran out of %s's memory; clipping in chunks of %d — %s",
                bound,
                choice.ran_out,
                device,
                choice.chunk,
                choice.line(),
            )
        else:
            LOG.info("%s", choice.line())
        while len(_CHOICES) > 64:
            _CHOICES.pop(next(iter(_CHOICES)))
    return _CHOICES[key]


def physical_chunk(
    tune: bool,
    model: nn.Module,
    loss_fn: LossFn,
    input_shape: tuple[int, ...],
    input_dtype: torch.dtype,
    bound: int,
    expected_batch: float,
    exact: Collection[str] = (),
    autocast: torch.dtype | None = None,
) -> int:
    """The chunk a trainer clips in: :func:`fastest_chunk` when ``tune``, else ``bound`` (``physical_batch_size``) —
    reduced where one pass of it runs out of the device's memory, with a warning, rather than failing the run."""
    return fastest_chunk(model, loss_fn, input_shape, input_dtype, bound, expected_batch, exact, autocast, tune).chunk
