"""How many numbers of materialised per-example gradients one engine pass keeps, all its layers together.

A layer whose per-example gradients G_i are materialised may keep them until the clip factors are known,
so that its clipped sum is Σ_i c_i G_i rather than a second pass over its positions
(:func:`dpml.train.clipping_norms.materialise`). Each layer's share is bounded by :func:`keep_limit`;
:func:`pass_budget` bounds their total in one pass (:func:`pass_total`): without it a model of many wide
layers keeps B × (its dense parameters) numbers at once — BERT-base at batch 256 asked for ≈ 86 GB beside
its activations, and ran out of an 80 GB GPU where the non-private step needs 36 GB. The total is also at
most ``KEEP_SHARE`` of what the pass holds anyway (its layers' inputs and output gradients), so that the DP
step's peak memory follows the model's activations, not the device's size: a transformer's per-example
weight gradients (d_in·d_out numbers an example) outweigh its activations (T·(d_in + d_out)) at short
sequences, and keeping them all cost ViT-tiny 2.5× the non-private peak on this project's CPU for no speed
(``benchmarks/results/families.md``). A layer is charged net of what keeping lets go: its input and δ, which its
clipped sum would read otherwise (:func:`room`, :func:`spend`); a ruled parameter's use, net of its factors
(:func:`dpml.train.rules.combine.letting_go`). Past the pass's budget a layer takes the way that
keeps nothing (ghost norm, or its norm from slices that are dropped, and its clipped sum by a second pass): slower
for that layer, never more memory. Which way a layer takes changes only the floating-point order of its sums, never
the clipping (both are exact).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch

KEEP_PER_EXAMPLE_LIMIT = 1 << 25  # elements (128 MiB in float32) a layer keeps of its per-example gradients on a CPU
GPU_MEMORY_PER_KEEP_LIMIT = 4 << 30  # bytes: on a GPU, KEEP_PER_EXAMPLE_LIMIT elements per 4 GiB of its memory


@functools.cache
def _gpu_memory(index: int) -> int:
    return torch.cuda.get_device_properties(index).total_memory


def keep_limit(device: torch.device) -> int:
    """How many elements of materialised per-example gradients one layer may keep for its clipped sum
    (and, kept or not, what :func:`dpml.train.clipping_norms.materialise` weighs). On a CPU
    ``KEEP_PER_EXAMPLE_LIMIT``, sized for its caches; on a GPU the same per ``GPU_MEMORY_PER_KEEP_LIMIT`` bytes
    of the device's memory (1/32 of it in float32: ≈1.1e9 elements on an H200), where keeping them spares a
    ghost norm and a second weight-gradient pass (WRN-16-4 on an H200 at batch 4096: 280.5 → 199.6 ms a step,
    ``results/speed_cuda*.md``)."""
    if device.type != "cuda":
        return KEEP_PER_EXAMPLE_LIMIT
    index = device.index if device.index is not None else torch.cuda.current_device()
    return KEEP_PER_EXAMPLE_LIMIT * max(1, _gpu_memory(index) // GPU_MEMORY_PER_KEEP_LIMIT)


BEYOND_KEEP_LIMIT = "exceed the keep limit"
"""The words of every refusal that depends on the batch size: per-example gradients, B × |S| numbers, past the
keep limit (:func:`dpml.train.rules.registry.beyond_keep_limit`, :func:`dpml.train.rules.pull_backs.pull_back_all`)."""

PASS_KEEP_LAYERS = 4
"""A pass keeps at most this many layers' limits' worth (``PASS_KEEP_LAYERS`` × the device's keep limit)."""
KEEP_SHARE = 0.25
"""…and at most this share of the numbers the pass holds anyway for its shortcuts (the recorded inputs and the
output gradients): a peak memory in proportion to the model's own activations, whatever the device."""


class _Budget:
    def __init__(self, total: int) -> None:
        self.left = total


_CURRENT: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("dpml_keep_budget", default=None)


def pass_total(device: torch.device, held: int) -> int:
    """What one pass may keep in all: ``PASS_KEEP_LAYERS`` × :func:`keep_limit`, and at most ``KEEP_SHARE`` × the
    ``held`` numbers of its recorded inputs and output gradients."""
    return min(PASS_KEEP_LAYERS * keep_limit(device), int(KEEP_SHARE * held))


@contextlib.contextmanager
def pass_budget(device: torch.device, held: int) -> Iterator[None]:
    """Within the block, the layers' kept numbers together stay within :func:`pass_total`."""
    token = _CURRENT.set(_Budget(pass_total(device, held)))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def room(layer_limit: int, freed: int = 0) -> int:
    """How many numbers the next layer may keep: its own limit, or what the pass has left plus ``freed`` if that is
    less. ``freed``: what keeping lets go, the layer's input and δ, which its clipped sum would read otherwise
    (:mod:`dpml.train.streamed`): a layer whose per-example gradients are no more numbers than those keeps them
    whatever is left, so that which layers keep does not hang on the order the backward pass reaches them in."""
    budget = _CURRENT.get()
    return layer_limit if budget is None else max(0, min(layer_limit, budget.left + freed))


def spend(count: int, freed: int = 0) -> None:
    """Record that a layer kept ``count`` numbers and let ``freed`` go (outside a pass: nothing to record)."""
    budget = _CURRENT.get()
    if budget is not None:
        budget.left -= max(0, count - freed)


def left() -> int | None:
    """What the current pass has left to keep (None outside a pass)."""
    budget = _CURRENT.get()
    return None if budget is None else budget.left
