"""The steps of a DP-SGD run over a map-style ``torch.utils.data.Dataset`` (records not in memory).

Step t's Poisson sample B_t (:func:`dpml.train.steps.poisson_batches`) is read as physical chunks of
at most ``physical_batch_size`` records, so memory is bounded by the chunk, never by |B_t|; the
clipped sums of the chunks add up to the step's sum (:func:`dpml.train.dpsgd.clipped_chunks_and_noise`).
Reading happens in this process (``num_workers = 0``) or in a ``DataLoader``'s worker processes fed
by :class:`PoissonChunkSampler`, which runs ahead of the training loop by at most the loader's
prefetch; either way the records read at step t are exactly B_t's (this process's share of it, in a
distributed run). The workers start from a fork server (Python 3.14's default on Linux), not as forks
of this process: a fork of a process that holds threads (a Prefect flow's, Dask's, MLflow's) can die
silently, so the dataset goes to them pickled.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from dpml.devices import host_to_device
from dpml.train.distributed import Collective
from dpml.train.steps import Step, share_of_batch

WORKER_START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else None


LABEL_KEYS = ("labels", "label")
"""Where a mapping record (a Hugging Face ``datasets`` set in torch format) holds its label."""


class MappingRecords(Dataset[tuple[Any, Any]]):
    """``dataset``'s mapping records as pairs (input, label) (:func:`mapping_pair`)."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return mapping_pair(self.dataset[index], index)


def mapping_pair(item: Mapping[Any, Any], index: int) -> tuple[Any, Any]:
    """(input, label) of a mapping record, as a Hugging Face ``datasets`` set in torch format gives them
    (``{"pixel_values": x, "label": y}``): the label under ``labels`` or ``label``, the input the one other key;
    another form is refused, naming the keys."""
    labels = [key for key in LABEL_KEYS if key in item]
    inputs = [key for key in item if key not in LABEL_KEYS]
    if len(labels) != 1 or len(inputs) != 1:
        raise ValueError(
            f"dataset[{index}]: a mapping record holds one input and one of labels / label; got keys "
            f"{sorted(map(str, item))}"
        )
    return item[inputs[0]], item[labels[0]]


def check_record(item: Any, index: int) -> None:
    """A record is a pair (input, integer label) (the labels' range is checked chunk by chunk, :func:`check_labels`)."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ValueError(
            f"dataset[{index}]: a record must be a pair (input, label), got {type(item).__name__}"
            + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else "")
            + (
                " (records (input_ids, attention_mask, label) are read for a model whose forward names input_ids and "
                "attention_mask keyword arguments)"
                if isinstance(item, (tuple, list)) and len(item) == 3
                else ""
            )
        )
    label = item[1]
    if isinstance(label, torch.Tensor):
        if label.numel() != 1 or label.dtype.is_floating_point:
            raise ValueError(
                f"dataset[{index}]: the label must be one integer class, got a {label.dtype} tensor "
                f"of shape {tuple(label.shape)}"
            )
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool):
        raise ValueError(f"dataset[{index}]: the label must be one integer class, got {label!r}")


def check_labels(labels: torch.Tensor, indices: torch.Tensor, n_classes: int) -> None:
    """Every label of a chunk in [0, n_classes); a bad one is named by its record index."""
    bad = torch.nonzero((labels < 0) | (labels >= n_classes)).flatten()
    if bad.numel():
        first = int(bad[0])
        raise ValueError(
            f"dataset[{int(indices[first])}]: label {int(labels[first])} is outside the {n_classes} "
            f"classes [0, {n_classes})"
        )


def check_every_record(
    dataset: Dataset[Any], n: int, n_classes: int, shape: tuple[int, ...], labels: torch.Tensor | None = None
) -> None:
    """Every record a pair (input of the first record's ``shape``, one integer class in [0, ``n_classes``)), checked
    before any work: a label outside the classes, met by the chunk check (:func:`check_labels`) in the middle of
    training, or an input of another shape, met when a chunk is stacked, would end a run whose budget is already
    spent. ``labels``: the n labels at once where the caller holds them (a ``TensorDataset``'s last tensor, whose
    inputs share one shape); else each record is read once (as one epoch reads them)."""
    if labels is None or labels.shape != (n,) or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        found = []
        for index in range(n):
            item = dataset[index]
            check_record(item, index)
            _check_shape(item[0], index, shape)
            found.append(int(torch.as_tensor(item[1])))
        labels = torch.tensor(found, dtype=torch.long)
    check_labels(labels, torch.arange(n), n_classes)


def _check_shape(x: Any, index: int, shape: tuple[int, ...]) -> None:  # noqa: ANN401 (a record's input)
    found = tuple(torch.as_tensor(x).shape)
    if found != shape:
        raise ValueError(
            f"dataset[{index}]: an input of shape {list(found)}, where dataset[0]'s is {list(shape)}; every record's "
            "input has one shape (a chunk of records is stacked into one tensor: pad, crop or resize them alike)"
        )


def index_chunks(indices: torch.Tensor, size: int) -> list[torch.Tensor]:
    """``indices`` in consecutive chunks of at most ``size``; none for an empty sample."""
    return [chunk for chunk in indices.split(size) if chunk.numel()]


def _load(dataset: Dataset[Any], indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The records at ``indices``, collated into one (inputs, labels) pair."""
    x, y = default_collate([dataset[i] for i in indices])
    return torch.as_tensor(x), torch.as_tensor(y)


class PoissonChunkSampler(Sampler[list[int]]):
    """A ``DataLoader`` batch sampler yielding each step's share of B_t in physical chunks, and
    recording, per step, the sample and how many chunks it became (for :func:`dataset_steps`)."""

    def __init__(
        self, batches: Iterable[torch.Tensor], physical_batch_size: int, collective: Collective | None
    ) -> None:
        self.batches, self.physical_batch_size, self.collective = batches, physical_batch_size, collective
        self.plan: deque[tuple[torch.Tensor, int]] = deque()

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches:
            chunks = index_chunks(share_of_batch(batch, self.collective), self.physical_batch_size)
            self.plan.append((batch, len(chunks)))
            for chunk in chunks:
                yield chunk.tolist()


def _on_device(
    chunk: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = chunk
    x = x.to(dtype) if x.dtype.is_floating_point else x
    return host_to_device(x, device), host_to_device(y.to(torch.long), device)


def dataset_steps(
    dataset: Dataset[Any],
    batches: Iterable[torch.Tensor],
    *,
    physical_batch_size: int,
    device: torch.device,
    dtype: torch.dtype,
    n_classes: int,
    collective: Collective | None = None,
    num_workers: int = 0,
) -> Iterator[Step]:
    """One :class:`dpml.train.steps.Step` per Poisson sample of ``batches``, reading ``dataset``'s records
    chunk by chunk (labels checked against ``n_classes``, a bad one named by its index)."""
    if num_workers == 0:
        for batch in batches:
            mine = share_of_batch(batch, collective)

            def chunks(mine: torch.Tensor = mine) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
                for indices in index_chunks(mine, physical_batch_size):
                    x, y = _load(dataset, indices.tolist())
                    check_labels(y, indices, n_classes)
                    yield _on_device((x, y), device, dtype)

            yield Step(batch, chunks(), most_rows=physical_batch_size)
        return
    sampler = PoissonChunkSampler(batches, physical_batch_size, collective)
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        multiprocessing_context=WORKER_START,
    )
    chunk_iterator = iter(loader)
    waiting: deque[Any] = deque()  # chunks read while looking for the next step's entry in the plan

    def next_chunk() -> Any:
        return waiting.popleft() if waiting else next(chunk_iterator)

    while True:
        while not sampler.plan:  # the loader has not reached the next step yet: let it read ahead
            try:
                waiting.append(next(chunk_iterator))
            except StopIteration:
                return
        batch, count = sampler.plan.popleft()
        mine = share_of_batch(batch, collective)

        def chunks_read(
            parts: list[torch.Tensor] = index_chunks(mine, physical_batch_size)[:count],  # noqa: B008 (this step's chunks, bound now)
        ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for indices in parts:
                x, y = next_chunk()
                check_labels(torch.as_tensor(y), indices, n_classes)
                yield _on_device((torch.as_tensor(x), torch.as_tensor(y)), device, dtype)

        yield Step(batch, chunks_read(), most_rows=physical_batch_size)


def dataset_size(dataset: Dataset[Any]) -> int:
    """len(dataset) of a map-style data set; an iterable-style one has no fixed n to sample from."""
    if not isinstance(dataset, Sized):
        raise ValueError(
            f"dataset: a map-style torch Dataset with __len__ is needed (Poisson sampling draws each of "
            f"n records independently), got {type(dataset).__name__}"
        )
    return len(dataset)
