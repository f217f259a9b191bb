"""Time-series classifiers from ``transformers`` (built from tiny configurations, random weights) go in unchanged
through ``dpml.train_private``: their forward takes the series positionally, (B, T, channels), and names its
prediction otherwise than ``logits`` (PatchTST's ``prediction_logits``, PatchTSMixer's ``prediction_outputs``), which
the adapter reads (:func:`dpml.models.library.logits_from_output`); every parameter by a layer's shortcut or a rule."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is ever fetched from a hub: the models are built from configurations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from conftest import trains_without_the_exact_path

LENGTH, CHANNELS, CLASSES = 32, 3, 3


def _patchtst(transformers: Any) -> nn.Module:
    config = transformers.PatchTSTConfig(
        num_input_channels=CHANNELS,
        context_length=LENGTH,
        patch_length=8,
        patch_stride=8,
        d_model=16,
        num_attention_heads=2,
        num_hidden_layers=2,
        ffn_dim=32,
        norm_type="layernorm",  # (its default, BatchNorm, mixes the examples of a batch: refused)
        num_targets=CLASSES,
    )
    return transformers.PatchTSTForClassification(config)


def _patchtsmixer(transformers: Any) -> nn.Module:
    config = transformers.PatchTSMixerConfig(
        num_input_channels=CHANNELS,
        context_length=LENGTH,
        patch_length=8,
        patch_stride=8,
        d_model=16,
        num_layers=2,
        num_targets=CLASSES,
    )
    return transformers.PatchTSMixerForTimeSeriesClassification(config)


@pytest.mark.parametrize("build", [_patchtst, _patchtsmixer], ids=["patchtst", "patchtsmixer"])
def test_a_time_series_classifier_trains_through_train_private(
    build: Callable[[Any], nn.Module], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra; not installed here")
    torch.manual_seed(0)
    model = build(transformers)
    generator = torch.Generator().manual_seed(3)
    series = torch.randn(96, LENGTH, CHANNELS, generator=generator)
    labels = (series[:, :, 0].mean(1) > 0).long() + (series[:, :, 1].mean(1) > 0.2).long()
    result = trains_without_the_exact_path(
        model,
        TensorDataset(series, labels),
        expected_batch_size=24,
        learning_rate=0.1,
        ledger=str(tmp_path / "ledger.db"),
        epsilon_budget=100.0,
        lineage="series",
    )
    assert result.epsilon < 100
