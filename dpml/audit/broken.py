"""Deliberately broken DP-SGD trainers: the audit's positive controls for its conformance checks.

Each context manager breaks the running process's DP-SGD in one classic way for as long as it is
open, *without* changing what the trainer reports to the accountant (``mechanism.json`` still says
Poisson sampling at rate q, noise σ, clipping to C). An audit that passes the release under one of
them has no evidence to offer; ``tests/test_conformance.py`` and ``benchmarks/audit_conformance.py``
run the whole train → certify → audit → gate chain under each.

- :func:`noise_scaled` (½: a σ/2 bug; 0: no noise at all)
- :func:`clipping_removed` (the clip factor is 1: per-example sensitivity unbounded)
- :func:`shuffled_batches` (fixed-size batches from a shuffle per epoch, not Poisson sampling:
  not what was priced, Chua et al. 2024)
- :func:`noise_reused` (the first step's noise added again at every step)
- :func:`noise_skipped_on_last_parameter` (one parameter tensor, the model's last — usually the output
  layer's bias — gets no noise: its clipped sum is released in the clear)
- :func:`last_sum_doubled` (the last parameter tensor's clipped sum counted twice, as by a gradient hook
  registered twice: sensitivity 2C there)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

import dpml.train.captured as captured
import dpml.train.clipping as clipping
import dpml.train.dpsgd as dpsgd
import dpml.train.steps as steps


@contextlib.contextmanager
def _patched(module: Any, name: str, replacement: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def noise_scaled(factor: float) -> contextlib.AbstractContextManager[None]:
    """Every step's noise multiplied by ``factor``."""
    original = dpsgd.clipped_chunks_and_noise

    def scaled(*args: Any, **kwargs: Any) -> Any:
        sums, noises, clipped = original(*args, **kwargs)
        return sums, {name: noise * factor for name, noise in noises.items()}, clipped

    return _patched(dpsgd, "clipped_chunks_and_noise", scaled)


def clipping_removed() -> contextlib.AbstractContextManager[None]:
    """Per-example gradients summed unclipped in the training steps (the clip factor is always 1, eager or replayed
    from a CUDA graph). The plan's check before the first step runs the honest engine: patched there too, it refused
    the model before any step (its probe against autograd differs), and the test of this bug passed only where an
    earlier test had planned the same model."""
    original = dpsgd.clipped_chunks_and_noise

    def ones(norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
        return torch.ones_like(norms)

    def unclipped(*args: Any, **kwargs: Any) -> Any:
        with _patched(clipping, "clip_factors", ones), _patched(captured, "clip_factors", ones):
            return original(*args, **kwargs)

    return _patched(dpsgd, "clipped_chunks_and_noise", unclipped)


def shuffled_batches() -> contextlib.AbstractContextManager[None]:
    """Batches of exactly round(q·n) records, a fresh shuffle each epoch (the sampler of most tutorials)."""
    queues: dict[int, tuple[torch.Generator, list[torch.Tensor]]] = {}  # the generator is kept: its id stays its own

    def sampler(generator: torch.Generator, n: int, sample_rate: float) -> torch.Tensor:
        queue = queues.setdefault(id(generator), (generator, []))[1]
        if not queue:
            size = max(1, round(sample_rate * n))
            queue.extend(torch.split(torch.randperm(n, generator=generator), size))
        return queue.pop(0)

    return _patched(steps, "poisson_batch", sampler)


def noise_reused() -> contextlib.AbstractContextManager[None]:
    """The noise of a run's first step added again at every later step (a seed reset per step)."""
    original = dpsgd.clipped_chunks_and_noise
    first: dict[int, tuple[Any, dict[str, torch.Tensor]]] = {}  # the generator is kept: its id stays its own

    def reused(*args: Any, **kwargs: Any) -> Any:
        sums, noises, clipped = original(*args, **kwargs)
        generator = kwargs.get("generator", args[4] if len(args) > 4 else None)
        if id(generator) not in first:  # a copy: a CPU noise stream reuses its buffers at the next draw
            first[id(generator)] = (generator, {name: value.clone() for name, value in noises.items()})
        return sums, dict(first[id(generator)][1]), clipped

    return _patched(dpsgd, "clipped_chunks_and_noise", reused)


def noise_skipped_on_last_parameter() -> contextlib.AbstractContextManager[None]:
    """The noise of the last trainable parameter tensor left out (a layer forgotten by the noise loop)."""
    original = dpsgd.clipped_chunks_and_noise

    def skipped(*args: Any, **kwargs: Any) -> Any:
        sums, noises, clipped = original(*args, **kwargs)
        last = list(noises)[-1]
        return sums, {name: noise * 0 if name == last else noise for name, noise in noises.items()}, clipped

    return _patched(dpsgd, "clipped_chunks_and_noise", skipped)


def last_sum_doubled() -> contextlib.AbstractContextManager[None]:
    """The last trainable parameter tensor's clipped sum counted twice (a gradient hook registered twice):
    the sum's sensitivity there is 2C, while the certificate prices C."""
    original = dpsgd.clipped_chunks_and_noise

    def doubled(*args: Any, **kwargs: Any) -> Any:
        sums, noises, clipped = original(*args, **kwargs)
        last = list(sums)[-1]
        return {name: total * 2 if name == last else total for name, total in sums.items()}, noises, clipped

    return _patched(dpsgd, "clipped_chunks_and_noise", doubled)


BUGS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "noise × ½": lambda: noise_scaled(0.5),
    "noise × 0": lambda: noise_scaled(0.0),
    "clipping removed": clipping_removed,
    "shuffled fixed-size batches": shuffled_batches,
    "noise reused across steps": noise_reused,
    "no noise on the last parameter": noise_skipped_on_last_parameter,
    "last sum counted twice": last_sum_doubled,
}
"""Each bug by name, as the results page and the tests name them."""
