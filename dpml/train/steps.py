"""A run's steps as the DP-SGD loop reads them: the Poisson samples B_t (each record in with probability q, from one
generator seeded with the run's secret seed), and each step's records in physical chunks on the model's device."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from dpml.train.diracs import DiracGradients
from dpml.train.distributed import Collective

Chunks = Iterable[tuple[torch.Tensor, torch.Tensor]]
"""A batch's records in physical chunks (inputs, labels), on the model's device."""


def tensor_chunks(x: torch.Tensor, y: torch.Tensor, physical_batch_size: int, at_least_one: bool = False) -> Chunks:
    """(x, y) in chunks of at most ``physical_batch_size`` rows; ``at_least_one``: an empty batch is one empty
    chunk (the audit's Dirac canaries join the first chunk, even of an empty batch)."""
    starts = list(range(0, x.shape[0], physical_batch_size)) or ([0] if at_least_one else [])
    return [(x[s : s + physical_batch_size], y[s : s + physical_batch_size]) for s in starts]


def poisson_batch(generator: torch.Generator, n: int, sample_rate: float) -> torch.Tensor:
    """Indices of a Poisson sample: each of the n records independently with probability q."""
    return torch.nonzero(torch.rand(n, generator=generator) < sample_rate).flatten()


def poisson_batches(n: int, sample_rate: float, steps: int, seed: int) -> Iterator[torch.Tensor]:
    """The T Poisson samples of a run, from one generator seeded with the run's (secret) seed: every
    process of a distributed run draws the same global samples."""
    sampler = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield poisson_batch(sampler, n, sample_rate)


@dataclass(frozen=True)
class Step:
    """One step's data: its Poisson sample (global record indices, on the CPU) and this process's share of
    the sample's records, in physical chunks on the model's device (:func:`share_of_batch`)."""

    batch: torch.Tensor
    chunks: Chunks
    diracs: DiracGradients | None = None
    most_rows: int | None = None
    """The physical batch size: no chunk of the step has more rows (CUDA graphs are captured no larger)."""


def share_of_batch(batch: torch.Tensor, collective: Collective | None) -> torch.Tensor:
    """The records of the global sample that this process clips: every ``world_size``-th from its rank."""
    return batch if collective is None else batch[collective.rank :: collective.world_size]
