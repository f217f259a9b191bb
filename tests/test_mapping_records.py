"""Records as mappings, what a Hugging Face ``datasets`` set in torch format gives: token records (``input_ids``,
``attention_mask``, ``labels`` or ``label``) for a model taking ``input_ids`` and ``attention_mask``, and image
records (``{"pixel_values": x, "label": y}``: one input and the label) for any other, train through
``dpml.train_private`` exactly as the same records as tuples do: with one seed, the same sampled batches, clipping and
noise, so the same trained weights. A mapping dpml cannot read whole (another key, two labels or two inputs, a second
segment's ``token_type_ids``) is refused before any budget is spent, naming the keys."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is ever fetched from a hub: the models are built from configurations

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import dpml
from dpml.ledger.ledger import Ledger
from test_library_models import LENGTH, VOCABULARY, tiny_bert

COUNT = 64
SETTINGS: dict[str, Any] = dict(
    noise_multiplier=1.0, delta=1e-5, epochs=1, clip_norm=1.0, expected_batch_size=16, learning_rate=0.5, seed=3
)


class Mappings(Dataset[dict[str, Any]]):
    """The records as mappings, ``change`` applied to each."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, change: Any = None) -> None:
        self.ids, self.mask, self.labels, self.change = ids, mask, labels, change

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        record = {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}
        return self.change(record) if self.change else record


def _tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCABULARY, (COUNT, LENGTH), generator=generator)
    mask = (torch.arange(LENGTH)[None] < torch.randint(2, LENGTH + 1, (COUNT, 1), generator=generator)).long()
    return ids * mask, mask, (ids[:, 0] >= VOCABULARY // 2).long()


def _weights_after(dataset: Dataset[Any]) -> dict[str, torch.Tensor]:
    model = tiny_bert()
    dpml.train_private(model, dataset, **SETTINGS)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "change",
    [
        None,
        lambda r: {"input_ids": r["input_ids"], "attention_mask": r["attention_mask"], "label": r["labels"]},
        lambda r: r | {"token_type_ids": torch.zeros_like(r["input_ids"])},  # a tokenizer's, one segment
        lambda r: r | {"input_ids": r["input_ids"].tolist(), "attention_mask": r["attention_mask"].tolist()},
    ],
    ids=["labels", "label", "token-type-ids-all-0", "lists"],
)
def test_mapping_records_train_as_the_same_records_as_tuples(change: Any) -> None:
    ids, mask, labels = _tokens()
    expected = _weights_after(TensorDataset(ids, mask, labels))
    found = _weights_after(Mappings(ids, mask, labels, change))
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(found[name], value), name


def test_a_mapping_without_a_mask_is_every_position_a_token() -> None:
    ids, _, labels = _tokens()
    full = ids + (ids == 0).long()  # no padding
    expected = _weights_after(TensorDataset(full, labels))  # (input_ids, label) pairs
    only_ids = Mappings(
        full, torch.ones_like(full), labels, lambda r: {"input_ids": r["input_ids"], "labels": r["labels"]}
    )
    found = _weights_after(only_ids)
    assert all(torch.equal(found[k], v) for k, v in expected.items())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda r: r | {"pixel_values": torch.zeros(3)},
            r"a mapping record has key 'pixel_values'; it holds input_ids",
        ),
        (lambda r: r | {"label": r["labels"]}, r"a mapping record has keys \['attention_mask', 'input_ids', 'label',"),
        (lambda r: {"input_ids": r["input_ids"]}, r"a mapping record has keys \['input_ids'\]; it holds"),
        (
            lambda r: r | {"token_type_ids": (torch.arange(LENGTH) >= LENGTH // 2).long()},
            r"token_type_ids: not all 0; dpml passes the model input_ids and attention_mask alone",
        ),
    ],
    ids=["other-key", "two-labels", "no-label", "second-segment"],
)
def test_a_mapping_dpml_cannot_read_whole_is_refused_before_any_budget_is_spent(
    change: Any, message: str, tmp_path: Path
) -> None:
    ids, mask, labels = _tokens()
    ledger = tmp_path / "ledger.db"
    with pytest.raises(ValueError, match=r"^dataset\[0\].*" + message):
        dpml.train_private(
            tiny_bert(),
            Mappings(ids, mask, labels, change),
            **SETTINGS,
            ledger=str(ledger),
            epsilon_budget=10.0,
            lineage="tokens",
        )
    assert not ledger.exists() or Ledger(ledger, 1e-5).spends() == []


class ImageMappings(Dataset[dict[str, Any]]):
    """Image records as a ``datasets`` set with a transform gives them: ``{"pixel_values": x, key: y}``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, key: str = "label", extra: dict[str, Any] | None = None):
        self.x, self.y, self.key, self.extra = x, y, key, extra or {}

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"pixel_values": self.x[i], self.key: self.y[i], **self.extra}


def _images() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(COUNT, 3, 8, 8, generator=generator)
    return x, (x[:, 0].mean((1, 2)) > 0).long()


def _image_weights_after(dataset: Dataset[Any]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2))
    dpml.train_private(model, dataset, **SETTINGS)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("key", ["label", "labels"])
def test_image_mapping_records_train_as_the_same_pairs(key: str) -> None:
    x, y = _images()
    expected = _image_weights_after(TensorDataset(x, y))
    found = _image_weights_after(ImageMappings(x, y, key))
    assert all(torch.equal(found[k], v) for k, v in expected.items())


def test_an_image_mapping_of_two_inputs_is_refused_before_any_budget_is_spent(tmp_path: Path) -> None:
    x, y = _images()
    ledger = tmp_path / "ledger.db"
    with pytest.raises(
        ValueError, match=r"^dataset\[0\]: a mapping record holds one input and one of labels / label; "
    ):
        dpml.train_private(
            nn.Sequential(nn.Flatten(), nn.Linear(192, 2)),
            ImageMappings(x, y, extra={"mask": torch.ones(3)}),
            **SETTINGS,
            ledger=str(ledger),
            epsilon_budget=10.0,
            lineage="images",
        )
    assert not ledger.exists() or Ledger(ledger, 1e-5).spends() == []
