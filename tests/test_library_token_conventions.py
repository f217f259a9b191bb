"""A library model's own token conventions in the clipping probe: the synthetic batch dpml checks the engine on
(before any budget is spent, never a record) is laid out as the model's tokenizer would lay out a record — ordinary
ids, the ``<eos>`` its config names last, its padding id under the mask — so that models whose forward needs that
layout go in unchanged: T5's, mT5's and BART's sequence classifiers read each example's last ``<eos>`` and refuse a
batch whose examples hold different numbers of them (a probe of random ids failed on every one of them)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is ever fetched from a hub: the models are built from configurations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from conftest import SHORT_PRIVATE_RUN, trains_without_the_exact_path
from dpml.models.library import TokenConventions, probe_tokens, token_conventions

VOCABULARY, LENGTH = 40, 9
NEEDS_TRANSFORMERS = "transformers is a test extra (requirements-models.lock); not installed here"


class Configured(nn.Module):
    """A module with a ``config`` (the attribute Hugging Face's models and peft's wrappers carry)."""

    def __init__(self, **ids: Any) -> None:
        super().__init__()
        self.config = SimpleNamespace(**ids)


@pytest.mark.parametrize(
    ("net", "special", "pad", "eos"),
    [
        (Configured(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2), {0, 1, 2}, 1, 2),
        (Configured(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0), {0, 1}, 0, 1),
        (Configured(pad_token_id=None, bos_token_id=3, eos_token_id=[5, 6]), {0, 3, 5, 6}, 0, 5),  # Llama 3's list
        (Configured(pad_token_id=4, sep_token_id=7, cls_token_id=8, mask_token_id=9, unk_token_id=10), None, 4, None),
        (nn.Linear(2, 2), {0}, 0, None),  # no config: padding 0, no <eos>, as before
    ],
    ids=["bart", "t5", "list-of-eos", "bert-like", "no-config"],
)
def test_the_probe_lays_tokens_out_as_the_model_s_tokenizer_would(
    net: nn.Module, special: set[int] | None, pad: int, eos: int | None
) -> None:
    conventions = token_conventions(net)
    special = special if special is not None else {4, 7, 8, 9, 10}
    assert conventions == TokenConventions(frozenset(special), pad, eos)
    count = 2 * LENGTH
    ids, mask = probe_tokens(count, LENGTH, VOCABULARY, torch.Generator().manual_seed(3), conventions).unbind(1)
    assert ids.shape == mask.shape == (count, LENGTH) and set(mask.unique().tolist()) == {0, 1}
    kept = mask.sum(1)
    assert torch.equal(kept, LENGTH - torch.arange(count) % ((LENGTH + 1) // 2))  # trailing padding, ≥ 1 token kept
    assert torch.equal(mask, (torch.arange(LENGTH)[None] < kept[:, None]).long())
    assert bool((ids[mask == 0] == pad).all())  # the model's padding id under the mask
    assert bool(((ids >= 0) & (ids < VOCABULARY)).all())
    last = ids[torch.arange(count), kept - 1]
    ordinary = torch.where(torch.arange(LENGTH)[None] < (kept - int(eos is not None))[:, None], ids, -1)
    drawn = set(ordinary[ordinary >= 0].tolist())
    assert not drawn & special and len(drawn) > VOCABULARY // 2  # every ordinary id is free to be drawn, no special
    if eos is not None:
        assert bool((last == eos).all()) and bool(((ids == eos) & (mask == 1)).sum(1).eq(1).all())  # one, last
    else:
        assert not set(last.tolist()) & special


def test_a_vocabulary_of_special_ids_only_still_gives_a_probe() -> None:
    tokens = probe_tokens(3, 4, 2, torch.Generator().manual_seed(0), TokenConventions(frozenset({0, 1}), 0, None))
    assert tokens.shape == (3, 2, 4) and bool(((tokens[:, 0] == 0) | (tokens[:, 0] == 1)).all())


def test_special_ids_the_vocabulary_does_not_hold_are_not_used() -> None:
    """A configuration's defaults may name ids past a small vocabulary (GPT-Neo's <eos> 50256 with 40 tokens): no
    <eos> then, and padding 0, never an id the input embedding would fail on."""
    conventions = token_conventions(Configured(pad_token_id=50, eos_token_id=45, bos_token_id=3))
    ids, mask = probe_tokens(8, LENGTH, VOCABULARY, torch.Generator().manual_seed(1), conventions).unbind(1)
    assert bool((ids < VOCABULARY).all()) and bool((ids[mask == 0] == 0).all()) and (mask == 0).any()
    assert not bool((ids[mask == 1] == 3).any())


T5_SIZES = dict(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2)
T5_TOKENS = dict(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


def _t5(transformers: Any) -> nn.Module:
    config = transformers.T5Config(vocab_size=VOCABULARY, num_labels=3, **T5_SIZES, **T5_TOKENS)
    return transformers.T5ForSequenceClassification(config)


def _mt5(transformers: Any) -> nn.Module:
    config = transformers.MT5Config(vocab_size=VOCABULARY, num_labels=3, **T5_SIZES, **T5_TOKENS)
    return transformers.MT5ForSequenceClassification(config)


def _bart(transformers: Any) -> nn.Module:
    config = transformers.BartConfig(
        vocab_size=VOCABULARY,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=LENGTH + 2,
        num_labels=3,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return transformers.BartForSequenceClassification(config)


def _records(conventions: TokenConventions, n: int = 96) -> TensorDataset:
    """What a tokenizer gives: ordinary ids, ``<eos>`` last, the padding id under the mask (2 to T tokens kept);
    the label is whether the first id is in the upper half of the vocabulary."""
    generator = torch.Generator().manual_seed(8)
    ids = torch.randint(3, VOCABULARY, (n, LENGTH), generator=generator)
    kept = torch.randint(2, LENGTH + 1, (n,), generator=generator)
    label = (ids[:, 0] >= VOCABULARY // 2).long()
    assert conventions.eos is not None
    ids[torch.arange(n), kept - 1] = conventions.eos
    mask = (torch.arange(LENGTH)[None] < kept[:, None]).long()
    return TensorDataset(torch.where(mask.bool(), ids, conventions.pad), mask, label)


@pytest.mark.parametrize("build", [_t5, _mt5, _bart], ids=["t5", "mt5", "bart"])
def test_a_classifier_that_reads_its_eos_token_trains_through_train_private(
    build: Callable[[Any], nn.Module], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)
    torch.manual_seed(0)
    model = build(transformers)
    result = trains_without_the_exact_path(
        model,
        _records(token_conventions(model)),
        expected_batch_size=24,
        ledger=str(tmp_path / "ledger.db"),
        epsilon_budget=100.0,
        lineage="tokens",
    )
    assert result.epsilon < 100


def test_a_model_whose_input_embedding_is_wrapped_knows_its_vocabulary_and_trains(tmp_path: Path) -> None:
    """peft's trainable tokens wrap BERT's word embeddings (``get_input_embeddings()`` is then a
    ``TrainableTokensLayer``, not an ``nn.Embedding``): the vocabulary is the table inside it, so ids past it are
    refused before any work, and the model trains with its new rows clipped by rules, none on the exact path."""
    transformers = pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)
    peft = pytest.importorskip("peft", reason="peft is a test extra (requirements-models.lock); not installed here")
    from dpml.models.library import input_vocabulary

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCABULARY, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16
    )
    bert = transformers.BertForSequenceClassification(config)
    adapter = peft.TrainableTokensConfig(token_indices=[3, 4, 5], task_type="SEQ_CLS")
    model = peft.get_peft_model(bert, adapter)
    assert not isinstance(model.get_input_embeddings(), nn.Embedding)
    assert input_vocabulary(model) == VOCABULARY
    records = _records(TokenConventions(frozenset({0}), 0, 2))
    ids, mask, label = records.tensors
    beyond = ids.clone()
    beyond[7, 0] = VOCABULARY  # (one past the table's last row)
    past = TensorDataset(beyond, mask, label)
    import dpml

    with pytest.raises(ValueError, match=rf"dataset\[7\].*in \[0, {VOCABULARY}\)"):
        dpml.train_private(model, past, **SHORT_PRIVATE_RUN)
    result = trains_without_the_exact_path(
        model,
        records,
        expected_batch_size=24,
        ledger=str(tmp_path / "ledger.db"),
        epsilon_budget=100.0,
        lineage="tokens",
    )
    assert result.epsilon < 100
