"""Token records for :func:`dpml.train_private`: each example's ids and attention mask as one record.

A model whose forward takes ``input_ids`` and ``attention_mask`` (:mod:`dpml.models.library`) reads a
map-style data set whose ``dataset[i]`` is

- ``(input_ids, attention_mask, label)``: what ``TensorDataset(input_ids, attention_mask, labels)``
  gives for a tokenizer's padded ``(N, T)`` outputs; the mask is 1 for a token, 0 for padding; or
- ``(input_ids, label)``: every position is a token (a mask of ones); or
- a mapping, as a Hugging Face ``datasets`` set in torch format gives: ``input_ids``, ``attention_mask``
  (optional) and one of ``labels`` / ``label``; a tokenizer's ``token_type_ids`` only where all 0 (one segment:
  what the model assumes without them, as dpml passes ids and mask alone). Any other key is refused, named.

:class:`TokenRecords` turns each record into the pair ``(tokens, label)`` with ``tokens`` one integer
tensor ``(2, T)`` (row 0 the ids, row 1 the mask), so an example's ids and mask travel as one record
through Poisson sampling, chunking and the data loader's collation, and can never be paired with
another example's. :func:`check_token_records` reads every record once before any work (before the
clipping probe and the ledger's reservation): ids are integers in [0, vocabulary) (when the model's
input embedding says its vocabulary), the mask has the ids' shape and holds only 0 and 1 with at least
one token kept, and every example has the same length T.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from dpml.train.dataset_steps import LABEL_KEYS, check_record

BLOCK = 4096  # records checked together


class TokenRecords(Dataset[tuple[torch.Tensor, Any]]):
    """``dataset``'s token records as pairs ``((2, T) ids and mask, label)`` (module docstring)."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, Any]:
        ids, mask, label = _parts(self.dataset[index], index)
        return torch.stack([ids.long(), mask.long()]), label


RECORD_KEYS = ("input_ids", "attention_mask", "token_type_ids", *LABEL_KEYS)


def _mapping_parts(item: Mapping[Any, Any], index: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(ids, mask, label) of a mapping record (module docstring), or a refusal naming the key and what is allowed."""
    other = [key for key in item if key not in RECORD_KEYS]
    labels = [key for key in LABEL_KEYS if key in item]
    if other or "input_ids" not in item or len(labels) != 1:
        found = f"key {other[0]!r}" if other else f"keys {sorted(map(str, item))}"
        raise ValueError(
            f"dataset[{index}]: a mapping record has {found}; it holds input_ids, attention_mask (optional), "
            "token_type_ids (optional, all 0) and one of labels / label"
        )
    if "token_type_ids" in item and bool(torch.as_tensor(item["token_type_ids"]).ne(0).any()):
        raise ValueError(
            f"dataset[{index}] token_type_ids: not all 0; dpml passes the model input_ids and attention_mask "
            "alone, so a second segment would be read as the first: one segment per record"
        )
    ids = torch.as_tensor(item["input_ids"])
    mask = torch.as_tensor(item["attention_mask"]) if "attention_mask" in item else torch.ones_like(ids)
    return ids, mask, item[labels[0]]


def _parts(item: Any, index: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(ids, mask, label) of one record; a record of another form is refused, naming what is allowed."""
    if isinstance(item, Mapping):
        return _mapping_parts(item, index)
    if isinstance(item, (tuple, list)) and len(item) == 3:
        return torch.as_tensor(item[0]), torch.as_tensor(item[1]), item[2]
    if isinstance(item, (tuple, list)) and len(item) == 2:
        ids = torch.as_tensor(item[0])
        return ids, torch.ones_like(ids), item[1]
    raise ValueError(
        f"dataset[{index}]: a record for a model taking input_ids and attention_mask is (input_ids, "
        "attention_mask, label), as TensorDataset(ids, mask, labels) gives, (input_ids, label), or a mapping with "
        "input_ids, attention_mask and labels; got "
        f"{type(item).__name__}" + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else "")
    )


def _check_shapes(ids: torch.Tensor, mask: torch.Tensor, index: int, length: int | None) -> None:
    """One record's ids: an integer (T,) tensor; its mask: the same shape; T the same for every record."""
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(
            f"dataset[{index}] input_ids: a {ids.dtype} tensor of shape {list(ids.shape)}; each example's "
            "ids must be one integer tensor of shape (T,)"
        )
    if mask.shape != ids.shape:
        raise ValueError(
            f"dataset[{index}] attention_mask: shape {list(mask.shape)} differs from its input_ids' "
            f"{list(ids.shape)}; one mask value per token"
        )
    if length is not None and ids.shape[0] != length:
        raise ValueError(
            f"dataset[{index}] input_ids: length {ids.shape[0]}, but dataset[0] has {length}; pad every "
            "example to one length T and mark the padding 0 in its attention_mask"
        )


def _check_block(ids: torch.Tensor, mask: torch.Tensor, first: int, vocabulary: int | None) -> None:
    """The values of a block of records (n, T) whose first is ``dataset[first]``."""
    bad_mask = ((mask != 0) & (mask != 1)).any(1)
    if bad_mask.any():
        row = int(bad_mask.nonzero()[0])
        value = mask[row][(mask[row] != 0) & (mask[row] != 1)][0].item()
        raise ValueError(
            f"dataset[{first + row}] attention_mask: value {value!r}; a mask holds only 1 (a token) and 0 (padding)"
        )
    empty = (mask == 0).all(1)
    if empty.any():
        raise ValueError(
            f"dataset[{first + int(empty.nonzero()[0])}] attention_mask: all 0 (only padding); each "
            "example needs at least one token the mask keeps"
        )
    too_high = ids >= vocabulary if vocabulary is not None else torch.zeros_like(ids, dtype=torch.bool)
    wrong = (ids < 0) | too_high
    rows = wrong.any(1)
    if rows.any():
        row = int(rows.nonzero()[0])
        allowed = (
            f"in [0, {vocabulary}) (the model's input embedding has {vocabulary} tokens)"
            if vocabulary is not None
            else "≥ 0"
        )
        raise ValueError(
            f"dataset[{first + row}] input_ids: token id {int(ids[row][wrong[row]][0])}; ids must be {allowed}"
        )


def check_token_records(dataset: Dataset[Any], n: int, vocabulary: int | None) -> int:
    """Every record of ``dataset`` checked (module docstring) before any work; returns the length T."""
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 3:
        ids, mask = dataset.tensors[0], dataset.tensors[1]
        _check_shapes(ids[0], mask[0], 0, None)
        if ids.dim() != 2 or mask.shape != ids.shape:
            raise ValueError(
                f"dataset: TensorDataset input_ids of shape {list(ids.shape)} and attention_mask of shape "
                f"{list(mask.shape)}; both must be (N, T)"
            )
        _check_block(ids, mask, 0, vocabulary)
        return int(ids.shape[1])
    length: int | None = None
    for start in range(0, n, BLOCK):
        ids_block, mask_block = [], []
        for index in range(start, min(n, start + BLOCK)):
            item = dataset[index]
            ids, mask, label = _parts(item, index)
            check_record((ids, label), index)
            _check_shapes(ids, mask, index, length)
            length = int(ids.shape[0])
            ids_block.append(ids)
            mask_block.append(mask)
        _check_block(torch.stack(ids_block), torch.stack(mask_block), start, vocabulary)
    return int(length or 0)
