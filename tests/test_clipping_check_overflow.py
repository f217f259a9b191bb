"""A model whose forward pass overflows in float64 alone — a mask scaled by ``torch.finfo(torch.float64).min`` in
float32, 0·(−inf) = nan where the mask keeps a position, as ``transformers``' Canine writes its attention mask — is
checked in its own dtype rather than refused (dpml.train.clipping_check); one that is not finite in its own dtype too
is still refused, naming the gradient."""

from __future__ import annotations

import logging
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is ever fetched from a hub: the models are built from configurations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from conftest import trains_without_the_exact_path
from dpml.train.clipping import clipped_gradient_sum
from dpml.train.clipping_check import ClippingUnsupported, NotFinite, plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy
from test_clipping_check import loop_clipped_sum


class MaskedByTheWidestMinimum(nn.Module):
    """Positions whose first feature is below ``cut`` are masked out of a mean by the float64 minimum, computed in
    float32 (as Canine's ``(1.0 - mask.float()) * torch.finfo(scores.dtype).min``): finite for float32 weights,
    nan for float64 ones — or in float32 as well where ``overflow_always`` scales by infinity itself."""

    def __init__(self, overflow_always: bool = False) -> None:
        super().__init__()
        self.overflow_always = overflow_always
        self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 4)
        h = torch.tanh(self.inp(x))
        minimum = float("-inf") if self.overflow_always else torch.finfo(h.dtype).min
        scores = (1.0 - (x[..., :1] > -1.5).float()) * minimum  # (B, T, 1), in float32 whatever h's dtype
        weights = torch.softmax(h.sum(-1, keepdim=True) + scores.to(h.dtype), dim=1)
        return self.out((weights * h).sum(1))


def test_a_model_that_overflows_in_float64_alone_is_checked_in_its_own_dtype(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = MaskedByTheWidestMinimum()
    with caplog.at_level(logging.INFO, logger="dpml.clipping"):
        plan = plan_clipping(model, per_example_cross_entropy, (5, 4))
    assert not plan.exact_parameters and len(plan.fast_layers) == 2
    assert "checking the model in its own dtype" in caplog.text and "not finite" in caplog.text
    x = torch.randn(6, 5, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(2))
    assert torch.isfinite(model(x)).all() and bool((x[..., 0] <= -1.5).any())  # finite in float32, some masked
    _, norms = loop_clipped_sum(model, x, y, 1.0)
    expected, norms = loop_clipped_sum(model, x, y, float(norms.median()))
    sums, found_norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, float(norms.median()))
    torch.testing.assert_close(found_norms, norms, rtol=1e-5, atol=0)
    for name, total in expected.items():
        torch.testing.assert_close(sums[name], total, rtol=1e-5, atol=1e-7)


def test_a_model_that_is_not_finite_in_its_own_dtype_either_is_refused() -> None:
    with pytest.raises(NotFinite, match=r"per-example (gradient of 'inp\.weight'|losses) .* not finite"):
        plan_clipping(MaskedByTheWidestMinimum(overflow_always=True), per_example_cross_entropy, (5, 4))
    assert issubclass(NotFinite, ClippingUnsupported)


def test_canine_trains_through_train_private() -> None:
    """Canine (characters hashed into buckets, downsampled, upsampled) in float64 makes nan of its attention mask."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra; not installed here")
    torch.manual_seed(0)
    config = transformers.CanineConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=2,
        downsampling_rate=4,
        local_transformer_stride=16,
    )
    model = transformers.CanineForSequenceClassification(config)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(32, 5000, (24, 32), generator=generator)  # Unicode code points
    kept = torch.randint(17, 33, (24,), generator=generator)
    mask = (torch.arange(32)[None] < kept[:, None]).long()
    trains_without_the_exact_path(
        model, TensorDataset(ids * mask, mask, torch.randint(0, 2, (24,), generator=generator))
    )
