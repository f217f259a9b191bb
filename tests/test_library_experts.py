"""Mixtures of experts from ``transformers`` that once took the exact path, built from tiny configurations with random
weights. GPT-OSS has a bias per expert: each token's biases gathered by its expert ids, ``bias[expert_ids]``, and
added to its rows — a slice of the parameter per row, chosen row by row
(:func:`dpml.train.rules.registry.broadcast_view`); in each of transformers' expert implementations the biases took
the exact path ("an operand that is not broadcast over the batch"). JetMoE adds its experts' outputs back into each
token's row, ``zeros.index_add(0, batch_index, expert_outputs)``, and a bias after: that row's examples were lost
(:meth:`dpml.train.rules.example_maps.ExampleMaps._follow_index_write`). Now every parameter is clipped by a rule,
exactly (a float64 per-example loop) where the implementation runs in float64."""

from __future__ import annotations

import pytest
import torch
from test_library_models import LENGTH, VOCABULARY, transformers_module  # (sets HF_HUB_OFFLINE)
from test_op_rules import assert_exact_without_the_exact_path
from torch import nn
from torch.utils.data import TensorDataset

from conftest import trains_without_the_exact_path
from dpml.models.library import LibraryModel
from dpml.train.clipping_check import plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy

CLASSES = 3


def with_random_biases(model: nn.Module, suffix: str) -> nn.Module:
    """The model with its parameters named ``*suffix`` drawn at random (initialised to zero, a bias's gradient would
    not depend on it)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(suffix):
                p.normal_(0, 0.5)
    return model


def tiny_gpt_oss(**experts: str) -> nn.Module:
    """A two-layer GPT-OSS classifier: 4 experts with biases, 2 per token, sliding and full attention layers."""
    transformers = transformers_module()
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        **experts,
        vocab_size=VOCABULARY,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=LENGTH,
        sliding_window=4,
        num_labels=CLASSES,
        pad_token_id=0,
    )
    model = transformers.GptOssForSequenceClassification(config)
    return with_random_biases(model, "_bias")


def tokens_and_labels(count: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCABULARY, (count, LENGTH), generator=g)
    kept = torch.randint(2, LENGTH + 1, (count,), generator=g)
    mask = (torch.arange(LENGTH)[None] < kept[:, None]).long()
    return torch.stack([ids * mask, mask], 1), torch.randint(0, CLASSES, (count,), generator=g)


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_expert_biases_are_clipped_exactly_without_the_exact_path(implementation: str) -> None:
    model = LibraryModel(tiny_gpt_oss(experts_implementation=implementation), tokens=True, vocabulary=VOCABULARY)
    tokens, labels = tokens_and_labels()
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, tokens, labels)


def test_expert_biases_of_grouped_products_train_through_train_private() -> None:
    """The default, grouped products (``torch._grouped_mm``, no float64 kernel on the CPU: planned in float32)."""
    model = tiny_gpt_oss()
    plan = plan_clipping(
        LibraryModel(model, tokens=True, vocabulary=VOCABULARY), per_example_cross_entropy, (2, LENGTH), torch.int64
    )
    assert not plan.exact_parameters and any(name.endswith("gate_up_proj_bias") for name in plan.rule_parameters), (
        plan.lines()
    )
    tokens, labels = tokens_and_labels(24)
    trains_without_the_exact_path(model, TensorDataset(tokens[:, 0], tokens[:, 1], labels))


def test_jetmoe_trains_through_train_private() -> None:
    """JetMoE: a mixture of attention heads and a mixture of MLP experts, each merged by ``index_add`` into zeros."""
    transformers = transformers_module()
    torch.manual_seed(0)
    config = transformers.JetMoeConfig(
        vocab_size=VOCABULARY,
        hidden_size=16,
        num_hidden_layers=2,
        num_key_value_heads=2,
        kv_channels=8,
        intermediate_size=32,
        max_position_embeddings=LENGTH,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_labels=CLASSES,
        pad_token_id=0,
    )
    model = transformers.JetMoeForSequenceClassification(config)
    with_random_biases(model, ".bias")
    tokens, labels = tokens_and_labels(24)
    trains_without_the_exact_path(model, TensorDataset(tokens[:, 0], tokens[:, 1], labels))
