"""Models from other libraries go in unchanged (issue 46): Hugging Face ``transformers`` classifiers built from
tiny configurations with random weights (never from a hub), and a ``peft`` LoRA adapter over a frozen body,
train on token ids with attention masks (padding included) through ``dpml.train_private`` and through the
pipeline's ``model.kind: custom`` on a table with a ``tokens`` column, as images do: the certified ε is
recorded, the trained model is saved, reloads and predicts the same logits, padding the mask marks does not
change a prediction, and bad token inputs are refused before any budget is spent, naming what is allowed.

The output adapter and the refusals that need no library run without ``transformers``; the rest skip, saying
why, where it is not installed (it is a test extra pinned in requirements-models.lock, never a runtime
dependency)."""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is ever fetched from a hub: the models are built from configurations

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import REPO, small_params, write_params
from test_op_rules import assert_exact_without_the_exact_path
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import dpml
from dpml.models.library import LibraryModel, ModelOutputError, adapt, logits_from_output
from dpml.ledger.ledger import Ledger
from dpml.train.dpsgd import per_example_cross_entropy

VOCABULARY, LENGTH = 32, 8
NEEDS_TRANSFORMERS = "transformers is a test extra (requirements-models.lock); not installed here"


def transformers_module() -> Any:
    return pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)


def tiny_encoder(kind: str, n_classes: int, seed: int, **config: Any) -> nn.Module:
    """A one-layer ``{kind}ForSequenceClassification`` of width 16 with random weights (dropout as configured by
    default)."""
    transformers = transformers_module()
    torch.manual_seed(seed)
    settings = getattr(transformers, f"{kind}Config")(
        vocab_size=VOCABULARY,
        hidden_size=16,
        num_hidden_layers=1,
        intermediate_size=32,
        max_position_embeddings=LENGTH,
        num_labels=n_classes,
        **config,
    )
    return getattr(transformers, f"{kind}ForSequenceClassification")(settings)  # type: ignore[no-any-return]


def tiny_bert(n_classes: int = 2, seed: int = 0) -> nn.Module:
    """A one-layer BERT classifier with random weights (dropout as configured by default)."""
    return tiny_encoder("Bert", n_classes, seed, num_attention_heads=2)


def tiny_gpt2(n_classes: int = 2, seed: int = 0) -> nn.Module:
    """A one-layer GPT-2 classifier with random weights; id 0 is its padding token."""
    transformers = transformers_module()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCABULARY,
        n_embd=16,
        n_layer=1,
        n_head=2,
        n_positions=LENGTH,
        num_labels=n_classes,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    return transformers.GPT2ForSequenceClassification(config)


def tiny_mixtral(n_classes: int = 2, seed: int = 0, **experts: str) -> nn.Module:
    """A one-layer Mixtral classifier (4 experts, 2 per token, grouped products unless ``experts`` names another
    ``experts_implementation``) with random weights; id 0 pads."""
    transformers = transformers_module()
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        **experts,
        vocab_size=VOCABULARY,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=LENGTH,
        num_labels=n_classes,
        pad_token_id=0,
    )
    return transformers.MixtralForSequenceClassification(config)


def token_data(n: int = 128, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids (n, T) in [1, vocabulary) with trailing padding (id 0, mask 0): every example keeps 2 to T tokens;
    the label is whether the first token is in the upper half of the vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCABULARY, (n, LENGTH), generator=generator)
    lengths = torch.randint(2, LENGTH + 1, (n,), generator=generator)
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    return ids * mask, mask, (ids[:, 0] >= VOCABULARY // 2).long()


def quick(model: nn.Module, dataset: Dataset[Any], tmp: Path, **extra: Any) -> dpml.PrivateTraining:
    """A short private run charged to a ledger and logged to MLflow, as a user would call it."""
    settings: dict[str, Any] = dict(
        noise_multiplier=1.0,
        delta=1e-5,
        epochs=1,
        clip_norm=1.0,
        expected_batch_size=32,
        physical_batch_size=64,
        learning_rate=0.5,
        tune_physical_batch=False,
        seed=0,
        ledger=str(tmp / "ledger.db"),
        epsilon_budget=100.0,
        lineage="tokens",
    )
    return dpml.train_private(model, dataset, **(settings | extra))


def logits(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return logits_from_output(model(input_ids=ids, attention_mask=mask))


# --------------------------------------------------------------------------------------------------------------
# Output objects: one adapter turns them into logits; anything else is refused before training.


class Output:
    """A ModelOutput-like object: the logits as an attribute."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class Returning(nn.Module):
    """A linear classifier whose forward wraps its logits with ``wrap``."""

    def __init__(self, wrap: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> Any:
        return self.wrap(self.linear(x))


@pytest.mark.parametrize(
    "wrap",
    [
        Output,
        lambda z: {"logits": z, "hidden": z},
        lambda z: (z, z.sum()),
        lambda z: [z],
        lambda z: {"prediction_logits": z, "hidden_states": z.exp()},  # PatchTST's classifier
        lambda z: {"prediction_outputs": z, "last_hidden_state": z.exp()},  # PatchTSMixer's
    ],
    ids=["attribute", "dict", "tuple", "list", "prediction-logits", "prediction-outputs"],
)
def test_an_output_object_becomes_its_logits_in_one_adapter(wrap: Callable[[torch.Tensor], Any]) -> None:
    net = Returning(wrap)
    model = adapt(net, (4,))
    assert isinstance(model, LibraryModel) and model.net is net
    x = torch.randn(3, 4)
    assert torch.equal(model(x), net.linear(x))
    assert set(model.state_dict()) == {"net.linear.weight", "net.linear.bias"}
    plain = nn.Linear(4, 2)
    assert adapt(plain, (4,)) is plain  # a module that already returns logits is not wrapped


def test_an_output_without_logits_is_refused_before_any_budget_is_spent(tmp_path: Path) -> None:
    with pytest.raises(
        ModelOutputError,
        match=r"^model: its forward returned a builtins.set; dpml reads the logits "
        r"from a \(batch, classes\) logits tensor, an object with a .logits",
    ):
        adapt(Returning(lambda z: {1, 2}), (4,))
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    with pytest.raises(ModelOutputError, match=r"its forward returned a builtins.dict"):
        quick(Returning(lambda z: {"scores": z}), data, tmp_path)
    with pytest.raises(ModelOutputError, match=r"its forward returned a builtins.dict"):  # which of the two?
        quick(Returning(lambda z: {"start_logits": z, "end_logits": -z}), data, tmp_path)
    assert not (tmp_path / "ledger.db").exists() or Ledger(tmp_path / "ledger.db", 1e-5).spends() == []


def test_a_positional_model_and_a_tuple_output_train_unchanged(tmp_path: Path) -> None:
    net = Returning(lambda z: (z,))
    before = net.linear.weight.detach().clone()
    result = quick(
        net,
        TensorDataset(torch.randn(128, 4), torch.randint(0, 2, (128,))),
        tmp_path,
        mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        mlflow_artifact_location=str(tmp_path / "a"),
    )
    assert result.model is net and not torch.equal(net.linear.weight, before)
    logged = torch.load(_logged_state(result, tmp_path))
    assert set(logged) == {"linear.weight", "linear.bias"}  # the user's own keys, no adapter prefix
    assert torch.equal(logged["linear.weight"], net.linear.weight.detach())


class WithAuxiliaryHead(nn.Module):
    """As torchvision's GoogLeNet and Inception v3: the logits alone in evaluation, a named tuple of them and an
    auxiliary head's in training (``GoogLeNetOutputs(logits, aux_logits2, aux_logits1)``); or, with ``readable``
    False, a training output no logits can be read from."""

    Outputs = collections.namedtuple("Outputs", ["logits", "aux_logits"])

    def __init__(self, readable: bool = True) -> None:
        super().__init__()
        self.body, self.aux, self.readable = nn.Linear(4, 2), nn.Linear(4, 2), readable

    def forward(self, x: torch.Tensor) -> Any:
        z = self.body(x)
        if not self.training:
            return z
        return self.Outputs(z, self.aux(x)) if self.readable else {"scores": z, "aux": self.aux(x)}


def test_a_model_whose_training_output_is_an_object_trains_on_its_logits(tmp_path: Path) -> None:
    """The adapter looks at the output in both modes: a module that returns a tensor in evaluation and its logits
    with an auxiliary head's in training is adapted, trains on the logits (the auxiliary head gets noise alone), and
    evaluates as it did; one whose training output holds no logits is refused before any budget."""
    net = WithAuxiliaryHead()
    model = adapt(net, (4,))
    assert isinstance(model, LibraryModel) and model.net is net and net.training  # (its mode as it was)
    x = torch.randn(3, 4)
    assert torch.equal(model.train()(x), net.body(x)) and torch.equal(model.eval()(x), net.body(x))
    before = net.body.weight.detach().clone()
    result = quick(net.train(), TensorDataset(torch.randn(128, 4), torch.randint(0, 2, (128,))), tmp_path)
    assert result.model is net and not torch.equal(net.body.weight, before)
    assert result.history["exact_clipping_parameters"] == 0
    refused = WithAuxiliaryHead(readable=False)
    with pytest.raises(ModelOutputError, match=r"its forward returned a builtins.dict"):
        adapt(refused, (4,))
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    with pytest.raises(ModelOutputError, match=r"its forward returned a builtins.dict"):
        quick(refused, data, tmp_path / "refused")
    assert not (tmp_path / "refused").exists() or Ledger(tmp_path / "refused" / "ledger.db", 1e-5).spends() == []


def test_the_adapter_s_look_at_training_mode_leaves_the_module_s_buffers_as_they_were() -> None:
    """A training-mode pass updates running statistics: the adapter's look at the output puts them back."""
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    before = {name: b.clone() for name, b in net.named_buffers()}
    assert adapt(net, (4,)) is net
    assert all(torch.equal(b, before[name]) for name, b in net.named_buffers())


PLAIN_FACTORIES = textwrap.dedent('''
    from torch import nn


    class Scores(nn.Module):
        def __init__(self, features, classes, wrap):
            super().__init__()
            self.linear = nn.Linear(features, classes)
            self.wrap = wrap

        def forward(self, x):
            z = self.linear(x)
            return {"logits": z} if self.wrap == "dict" else (z, None) if self.wrap == "tuple" else {"scores": z}


    def scores(input_shape, n_classes, wrap="dict"):
        return Scores(input_shape[0], n_classes, wrap)


    class Bag(nn.Module):
        """The mean embedding of the tokens the mask keeps, then a linear layer."""

        def __init__(self, vocabulary, classes):
            super().__init__()
            self.embedding = nn.Embedding(vocabulary, 8)
            self.out = nn.Linear(8, classes)

        def forward(self, input_ids, attention_mask):
            kept = attention_mask.unsqueeze(-1).float()
            return self.out((self.embedding(input_ids) * kept).sum(1) / kept.sum(1))


    def bag(input_shape, n_classes):
        return Bag(32, n_classes)
''')


def test_a_custom_factory_s_output_object_is_adapted_where_the_model_is_built(workdir: Path) -> None:
    from dpml.models import build_model, spec_for, spec_from_dict
    from dpml.sections import ModelConfig

    (workdir / "plainmodels.py").write_text(PLAIN_FACTORIES)
    try:
        for wrap in ("dict", "tuple"):
            spec = spec_for(ModelConfig(kind="custom", factory="plainmodels:scores", options={"wrap": wrap}), 1.0, 4, 3)
            model = build_model(spec)
            x = torch.randn(5, 4)
            assert isinstance(model, LibraryModel) and torch.equal(model(x), model.net.linear(x))
            rebuilt = build_model(spec_from_dict(spec.to_dict()))  # as the register stage and reproduce rebuild it
            rebuilt.load_state_dict(model.state_dict())
            assert torch.equal(rebuilt(x), model(x))
        with pytest.raises(ModelOutputError, match=r"^model: its forward returned a builtins.dict; dpml reads"):
            build_model(
                spec_for(ModelConfig(kind="custom", factory="plainmodels:scores", options={"wrap": "other"}), 1.0, 4, 3)
            )
        with pytest.raises(
            ValueError,
            match=r"^model.inputs = 'tokens': Scores.forward takes no input_ids keyword argument$",
        ):
            build_model(spec_for(ModelConfig(kind="custom", factory="plainmodels:scores", inputs="tokens"), 1.0, 4, 3))
    finally:
        sys.modules.pop("plainmodels", None)


def test_an_unknown_inputs_setting_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^inputs = 'ids': must be one of auto, tensor, tokens$"):
        quick(nn.Linear(4, 2), TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), tmp_path, inputs="ids")
    with pytest.raises(ValueError, match=r"^inputs = 'tokens': Linear.forward takes no input_ids keyword argument$"):
        quick(nn.Linear(4, 2), TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), tmp_path, inputs="tokens")
    assert not (tmp_path / "ledger.db").exists() or Ledger(tmp_path / "ledger.db", 1e-5).spends() == []


def _logged_state(result: dpml.PrivateTraining, tmp: Path) -> Path:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    return Path(client.download_artifacts(result.mlflow_run_id, "model_state.pt", str(tmp)))


# --------------------------------------------------------------------------------------------------------------
# Token inputs through dpml.train_private.


@pytest.mark.parametrize("build", [tiny_bert, tiny_gpt2, tiny_mixtral], ids=["bert", "gpt2", "mixtral"])
def test_train_private_trains_a_transformers_classifier_on_padded_tokens(
    build: Callable[..., nn.Module], tmp_path: Path
) -> None:
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, mask, y = token_data()
    result = quick(
        model,
        TensorDataset(ids, mask, y),
        tmp_path,
        mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        mlflow_artifact_location=str(tmp_path / "artifacts"),
    )
    assert result.model is model and 0 < result.epsilon < 100
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # it trained
    [spend] = Ledger(tmp_path / "ledger.db", 1e-5).spends()
    assert spend.mechanism is not None and spend.id == result.spend_id
    from mlflow import MlflowClient

    run = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(result.mlflow_run_id)
    assert run.data.metrics["epsilon"] == pytest.approx(result.epsilon)
    reloaded = build(seed=1)  # other random weights, replaced by the logged state
    reloaded.load_state_dict(torch.load(_logged_state(result, tmp_path)))
    assert torch.allclose(logits(reloaded, ids, mask), logits(model, ids, mask), atol=1e-6)


def test_padding_the_mask_marks_does_not_change_a_prediction() -> None:
    """A property of the model, checked through dpml's adapter: the mask reaches the model."""
    model = LibraryModel(tiny_bert(), tokens=True, vocabulary=VOCABULARY).eval()
    ids, mask, _ = token_data(32)
    other = torch.where(
        mask.bool(), ids, torch.randint(1, VOCABULARY, ids.shape, generator=torch.Generator().manual_seed(5))
    )
    assert not torch.equal(other, ids) and (mask == 0).any()
    with torch.no_grad():
        padded = model(torch.stack([ids, mask], 1))
        masked_change = (model(torch.stack([other, mask], 1)) - padded).abs().max()
        assert torch.equal(model(torch.cat([ids, mask], 1).float()), padded)  # the flat float form of a table
        unmasked_change = (model(torch.stack([other, torch.ones_like(mask)], 1)) - padded).abs().max()
    # (random weights give logits of order 1e-3, so the two changes are compared with each other)
    assert unmasked_change > 0 and masked_change <= 1e-3 * unmasked_change  # without the mask the padding counts


def tiny_fnet(n_classes: int = 2, seed: int = 0) -> nn.Module:
    """A one-layer FNet classifier with random weights: its forward takes ``input_ids`` and no ``attention_mask``
    (its Fourier mixing has no mask), and dropout as configured by default."""
    return tiny_encoder("FNet", n_classes, seed, pad_token_id=0)


def test_a_model_that_takes_no_attention_mask_trains_on_its_ids_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """FNet's forward names ``input_ids`` and no ``attention_mask``: it gets token inputs all the same (detected, or
    asked for with ``inputs="tokens"``), called with the ids alone, and says so; its padding is then read as tokens
    (a padded id changes its prediction, as it would outside dpml). It trains exactly, without the exact path."""
    ids, mask, y = token_data()
    adapted = adapt(tiny_fnet(), (2, LENGTH), torch.int64, inputs="tokens")
    assert isinstance(adapted, LibraryModel) and adapted.tokens and not adapted.masked
    padded = torch.where(mask.bool(), ids, torch.randint(1, VOCABULARY, ids.shape))
    with torch.no_grad():
        adapted.eval()
        assert torch.equal(adapted(torch.stack([ids, mask], 1)), logits_from_output(adapted.net(input_ids=ids)))
        assert not torch.allclose(adapted(torch.stack([padded, mask], 1)), adapted(torch.stack([ids, mask], 1)))
    adapted.train()
    assert_exact_without_the_exact_path(adapted, per_example_cross_entropy, torch.stack([ids, mask], 1)[:6], y[:6])
    model = tiny_fnet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="dpml"):
        result = quick(model, TensorDataset(ids, mask, y), tmp_path)
    assert result.model is model and 0 < result.epsilon < 100
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "FNetForSequenceClassification.forward takes input_ids and no attention_mask" in caplog.text


def test_peft_lora_trains_its_adapter_and_leaves_the_frozen_body(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft", reason="peft is a test extra (requirements-models.lock); not installed here")
    model = peft.get_peft_model(
        tiny_bert(), peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value"])
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and any("lora_" in n for n in trainable) and not any("embeddings" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, mask, y = token_data()
    result = quick(model, TensorDataset(ids, mask, y), tmp_path)
    assert 0 < result.epsilon < 100
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable  # the frozen body got neither gradient nor noise


class Records(Dataset[Any]):
    """Records given one by one (no TensorDataset shortcut)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]


def _bad(change: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Dataset[Any]]) -> Dataset[Any]:
    ids, mask, y = token_data(64)
    return change(ids, mask, y)


def _mixed_lengths(ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> Dataset[Any]:
    items = [(ids[i], mask[i], int(y[i])) for i in range(len(y))]
    items[3] = (ids[3][:5], mask[3][:5], int(y[3]))
    return Records(items)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda i, m, y: TensorDataset(i, m * 2, y), r"dataset\[0\] attention_mask: value 2; a mask holds only 1"),
        (
            lambda i, m, y: TensorDataset(i + VOCABULARY * m, m, y),
            rf"dataset\[0\] input_ids: token id \d+; ids must be in \[0, {VOCABULARY}\) \(the model's input embedding",
        ),
        (
            lambda i, m, y: TensorDataset(i - 2 * m, m, y),
            r"dataset\[\d+\] input_ids: token id -\d+; ids must be in \[0, ",
        ),
        (
            lambda i, m, y: TensorDataset(i, torch.cat([m[:, :1] * 0, m[:, 1:] * 0], 1), y),
            r"dataset\[0\] attention_mask: all 0 \(only padding\); each example needs at least one token",
        ),
        (
            lambda i, m, y: TensorDataset(i.float(), m, y),
            r"dataset\[0\] input_ids: a torch.float32 tensor of shape \[8\]; "
            r"each example's ids must be one integer tensor",
        ),
        (
            lambda i, m, y: Records([(i[k], m[k][:4], int(y[k])) for k in range(len(y))]),
            r"dataset\[0\] attention_mask: shape \[4\] differs from its input_ids' \[8\]",
        ),
        (_mixed_lengths, r"dataset\[3\] input_ids: length 5, but dataset\[0\] has 8; pad every example to one length"),
        (
            lambda i, m, y: Records([({"input_ids": i[k]},) for k in range(len(y))]),
            r"dataset\[0\]: a record for a model taking input_ids and attention_mask is "
            r"\(input_ids, attention_mask, label\)",
        ),
    ],
    ids=[
        "mask-value",
        "id-above-vocabulary",
        "negative-id",
        "all-padding",
        "float-ids",
        "mask-shape",
        "lengths",
        "record-form",
    ],
)
def test_bad_token_inputs_are_refused_before_any_budget_is_spent(change: Any, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        quick(tiny_bert(), _bad(change), tmp_path)
    assert not (tmp_path / "ledger.db").exists() or Ledger(tmp_path / "ledger.db", 1e-5).spends() == []


@pytest.mark.parametrize("workers", [0, 1])
def test_each_example_s_mask_goes_with_its_ids_through_sampling_chunks_and_workers(workers: int) -> None:
    """Records whose mask is a function of their own ids (as many tokens as the first id says): every chunk
    that a Poisson sample becomes, read here or by a worker process, keeps each row's ids with its mask and
    its label."""
    from dpml.train.dataset_steps import dataset_steps
    from dpml.train.steps import poisson_batches
    from dpml.train.token_records import TokenRecords

    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCABULARY, (200, LENGTH), generator=generator)
    kept = ids[:, 0] % LENGTH + 1
    mask = (torch.arange(LENGTH)[None, :] < kept[:, None]).long()
    labels = torch.arange(200) % 2
    steps = dataset_steps(
        TokenRecords(TensorDataset(ids * mask, mask, labels)),
        poisson_batches(200, 0.3, 3, seed=7),
        physical_batch_size=5,
        device=torch.device("cpu"),
        dtype=torch.float32,
        n_classes=2,
        num_workers=workers,
    )
    rows = 0
    for step in steps:
        chunks = list(step.chunks)
        assert sum(x.shape[0] for x, _ in chunks) == step.batch.numel() and all(x.shape[0] <= 5 for x, _ in chunks)
        for (x, y), indices in zip(chunks, step.batch.split(5), strict=True):
            assert x.shape[1:] == (2, LENGTH) and x.dtype == torch.long
            assert torch.equal(x[:, 1], (torch.arange(LENGTH)[None, :] < (x[:, 0, 0] % LENGTH + 1)[:, None]).long())
            assert torch.equal(x[:, 0], (ids * mask)[indices]) and torch.equal(y, labels[indices])
            rows += x.shape[0]
    assert rows > 100


# --------------------------------------------------------------------------------------------------------------
# Token inputs through the pipeline: model.kind custom on a table with a tokens column.

FACTORIES = textwrap.dedent('''
    """Library classifiers from tiny configurations (random weights, no hub)."""
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2ForSequenceClassification


    def bert(input_shape, n_classes, vocabulary=32):
        length = input_shape[0] // 2  # the prepared record: [ids..., mask...]
        return BertForSequenceClassification(BertConfig(
            vocab_size=vocabulary, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=length, num_labels=n_classes))


    def gpt2(input_shape, n_classes, vocabulary=32):
        return GPT2ForSequenceClassification(GPT2Config(
            vocab_size=vocabulary, n_embd=16, n_layer=1, n_head=2, n_positions=input_shape[0] // 2,
            num_labels=n_classes, pad_token_id=0, bos_token_id=1, eos_token_id=1))
''')


def token_table(path: Path, n: int = 300, seed: int = 0) -> pd.DataFrame:
    """Examples of 2 to T token ids written as text, and a label from the first id."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        ids = rng.integers(1, VOCABULARY, size=int(rng.integers(2, LENGTH + 1)))
        rows.append({"text": " ".join(map(str, ids)), "label": "high" if ids[0] >= VOCABULARY // 2 else "low"})
    frame = pd.DataFrame(rows)
    frame.to_csv(path, index=False)
    return frame


def token_params(tmp: Path, factory: str) -> Path:
    params = small_params(
        tmp,
        data={
            "source": "csv:tokens.csv",
            "label_column": "label",
            "classes": ["low", "high"],
            "columns": {"text": {"type": "tokens", "length": LENGTH, "vocabulary": VOCABULARY}},
        },
        model={"kind": "custom", "factory": factory, "hidden": []},
        train={"epochs": 1, "sample_rate": 0.25, "tune_physical_batch": False},
    )
    params["preprocess"] = {"clip_norm": 1.0}
    return write_params(tmp / "params.yaml", params)


@pytest.fixture
def library_factories(workdir: Path) -> Iterator[Path]:
    transformers_module()
    (workdir / "hfmodels.py").write_text(FACTORIES)
    yield workdir
    sys.modules.pop("hfmodels", None)


def stage(workdir: Path, params: Path, name: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "dpml", "stage", name, "--params", str(params)],
        capture_output=True,
        text=True,
        cwd=workdir,
        env=env,
    )


def stages_in_process(params: Path, *names: str) -> None:
    """Stages run here (the train stage, the one that calls the user's factory, runs as the ``dpml`` command)."""
    from dpml.config import load
    from dpml.stages import run_stage

    for name in names:
        run_stage(name, load(params))


@pytest.mark.parametrize("factory", ["hfmodels:bert", pytest.param("hfmodels:gpt2", marks=pytest.mark.exhaustive)])
def test_the_pipeline_trains_a_library_model_on_a_tokens_table_and_serves_it(
    factory: str, library_factories: Path
) -> None:
    """GPT-2 pools the last token that is not its padding id, BERT the first: both read the mask."""
    from dpml.config import load
    from dpml.models import build_model, spec_from_dict
    from dpml.stages.layout import Layout
    from dpml.tracking.serving import save_classifier

    frame = token_table(library_factories / "tokens.csv")
    params = token_params(library_factories, factory)
    stages_in_process(params, "ingest", "split", "preprocess")
    done = stage(library_factories, params, "train")
    assert done.returncode == 0, done.stderr[-3000:]
    stages_in_process(params, "certify")
    layout = Layout(load(params))
    certificate = json.loads(layout.certificate.read_text())
    [spend] = Ledger(library_factories / "ledger.db", 1e-5).spends()
    assert 0 < certificate["epsilon"] < 1000 and spend.mechanism is not None
    spec = json.loads(layout.model_spec.read_text())
    assert spec["kind"] == "custom" and spec["in_features"] == 2 * LENGTH
    model = build_model(spec_from_dict(spec))
    model.load_state_dict(torch.load(layout.model))
    model.eval()
    prepared = np.load(layout.prepared["test"])["x"]
    assert set(np.unique(prepared[:, LENGTH:])) <= {0.0, 1.0} and (prepared[:, LENGTH:] == 0).any()  # padding kept
    with torch.no_grad():
        expected = torch.softmax(model(torch.from_numpy(prepared)).double(), 1).numpy()
    accuracy = float((expected.argmax(1) == np.load(layout.prepared["test"])["y"]).mean())
    assert accuracy == pytest.approx(json.loads(layout.train_metrics.read_text())["test_accuracy"])

    import mlflow

    from dpml.data.tables import table_encoding
    from dpml.stages.register import serving_spec

    config = load(params)
    spec_of_release = serving_spec(config, json.loads(layout.prepared_meta.read_text()))
    folder = save_classifier(model, 2 * LENGTH, spec_of_release, library_factories / "served")
    served = mlflow.pyfunc.load_model(str(folder)).predict(frame[["text"]].iloc[:20])
    encoded, _ = table_encoding(config.data, config.preprocess).encode(frame[["text"]].iloc[:20])
    with torch.no_grad():
        direct = torch.softmax(model(torch.from_numpy(encoded.astype(np.float32))).double(), 1).numpy()
    assert np.allclose(served["probability(high)"].to_numpy(), direct[:, 1], atol=1e-6)


def test_a_bad_tokens_table_is_refused_before_any_budget_is_spent(workdir: Path) -> None:
    """Needs no library: the table is read and refused at ingest, naming the row, the column and what is allowed."""
    from dpml.data.sources import DataError

    (workdir / "hfmodels.py").write_text("def bert(input_shape, n_classes):\n    raise AssertionError\n")
    frame = token_table(workdir / "tokens.csv")
    params = token_params(workdir, "hfmodels:bert")
    for number, (cell, message) in enumerate(
        [
            (
                f"3 {VOCABULARY} 4",
                rf"row 7, column 'text': token id {VOCABULARY} is outside the "
                rf"vocabulary \[0, {VOCABULARY}\)",
            ),
            ("3 -1", r"row 7, column 'text': '-1' is not a token id; a tokens cell holds integers in"),
            (
                " ".join(["5"] * (LENGTH + 1)),
                rf"row 7, column 'text': {LENGTH + 1} token ids, more than its "
                rf"length {LENGTH}; truncate",
            ),
            ("", r"row 7, column 'text': missing value; a tokens column has no fill"),
        ]
    ):
        bad = frame.copy()
        bad.loc[7, "text"] = cell
        bad.to_csv(workdir / "tokens.csv", index=False)
        if number == 0:  # the command's one line
            done = stage(workdir, params, "ingest")
            assert done.returncode == 1, done.stderr[-2000:]
            assert any(re.search(f"^dpml: error: .*{message}", line) for line in done.stderr.splitlines()), done.stderr[
                -2000:
            ]
        else:
            with pytest.raises(DataError, match=message):
                stages_in_process(params, "ingest")
    assert not (workdir / "ledger.db").exists()
    sys.modules.pop("hfmodels", None)


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"model": {"kind": "mlp"}},
            r"model.kind = 'mlp': data.columns.text holds token ids, which only a model taking "
            r"input_ids and attention_mask reads",
        ),
        (
            {
                "data": {
                    "columns": {
                        "text": {"type": "tokens", "length": 4, "vocabulary": 8},
                        "n": {"type": "numeric", "lower": 0, "upper": 1},
                    }
                }
            },
            r"'text' is a tokens column, so it must be the only feature column",
        ),
        (
            {"data": {"columns": {"text": {"type": "tokens", "length": 4, "vocabulary": 8, "pad_id": 8}}}},
            r"pad_id = 8: must be a token id in \[0, vocabulary = 8\)",
        ),
        ({"model": {"inputs": "tokens", "kind": "mlp"}}, r"model.inputs = 'tokens': only for model.kind: custom"),
    ],
)
def test_token_settings_are_checked_with_the_configuration(change: dict[str, Any], message: str, workdir: Path) -> None:
    from dpml.config import load

    (workdir / "hfmodels.py").write_text("def bert(input_shape, n_classes):\n    raise AssertionError\n")
    token_table(workdir / "tokens.csv", n=10)
    path = token_params(workdir, "hfmodels:bert")
    params = yaml.safe_load(path.read_text())
    for section, values in change.items():
        params[section] |= values
    if params["model"]["kind"] != "custom":
        params["model"].pop("factory", None)
    write_params(path, params)
    with pytest.raises(Exception, match=message):
        load(path)
    sys.modules.pop("hfmodels", None)


@pytest.mark.exhaustive
def test_dpml_run_releases_a_bert_trained_on_a_tokens_table(library_factories: Path) -> None:
    """The whole pipeline (audit, gate, registration) on a token table: the release answers raw text cells."""
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{library_factories / 'mlflow.db'}")
    frame = token_table(library_factories / "tokens.csv")
    params = token_params(library_factories, "hfmodels:bert")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "dpml", "run", "--engine", "local", "--params", str(params)],
        capture_output=True,
        text=True,
        cwd=library_factories,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    model = mlflow.pyfunc.load_model("models:/dpml-test-model/1")
    answer = model.predict(frame[["text"]].iloc[:5])
    assert list(answer.columns) == ["label", "probability(low)", "probability(high)"]


# --------------------------------------------------------------------------------------------------------------
# The libraries are pinned test extras, never runtime dependencies.

LIBRARIES = ("transformers", "peft", "timm", "torchvision", "accelerate")


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def test_the_model_libraries_are_a_pinned_extra_and_never_runtime_dependencies() -> None:
    import ast
    import tomllib
    from importlib import metadata

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {re.split(r"[=<>\[ ]", d)[0].lower() for d in project["dependencies"]}
    extra = dict(d.split("==") for d in project["optional-dependencies"]["models"])
    models_lock, runtime_lock = _pins(REPO / "requirements-models.lock"), _pins(REPO / "requirements.lock")
    assert not runtime & set(LIBRARIES) and not set(runtime_lock) & set(LIBRARIES)
    assert {"transformers", "peft"} <= set(extra) and "timm" not in models_lock and "torchvision" not in models_lock
    for name, version in extra.items():
        assert models_lock[name] == version, name
    assert not set(models_lock) & set(runtime_lock)  # the shared packages keep the runtime lock's pins
    for name, version in models_lock.items():  # the lock is what this environment runs, where it is installed
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        assert installed == version, f"{name}: installed {installed}, locked {version}"
    for source in (REPO / "dpml").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not [n for n in names if n.split(".")[0] in LIBRARIES], f"{source} imports {names}"


def test_dpml_runs_without_loading_any_model_library() -> None:
    code = (
        "import sys, dpml, dpml.api, dpml.cli, dpml.stages, dpml.tracking.serving, dpml.models.library, "
        "dpml.train.token_records; print(sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{LIBRARIES!r}))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_a_token_model_on_records_that_are_not_tokens_is_refused_before_the_spend(workdir: Path) -> None:
    """The digits' pixels would be read as ids and masks: the train stage refuses before the ledger is touched."""
    (workdir / "plainmodels.py").write_text(PLAIN_FACTORIES)
    params = write_params(
        workdir / "params.yaml",
        small_params(workdir, model={"kind": "custom", "factory": "plainmodels:bag", "hidden": []}),
    )
    try:
        stages_in_process(params, "ingest", "split", "preprocess")
        with pytest.raises(
            ValueError,
            match=r"model.factory = 'plainmodels:bag': its module is called with input_ids "
            r"and attention_mask, but sklearn:digits has no tokens column",
        ):
            stages_in_process(params, "train")
    finally:
        sys.modules.pop("plainmodels", None)
    assert not (workdir / "ledger.db").exists() or Ledger(workdir / "ledger.db", 1e-5).spends() == []
