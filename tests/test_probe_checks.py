"""The probe's independence checks (:mod:`dpml.train.probe_checks`). A model that mixes the examples of a batch only
where a parameter is still zero, as peft's Lily does (its routing averaged over every token of the batch, its
adapter factor initialised to zero): each example's loss ignores the others at the probe's parameters, its gradient
does not, and after one step its loss would not either. It is refused before any step, naming the parameter, by the
plan and by training; a zero-initialised adapter that mixes nothing passes. An embedding whose backward pass divides
each row's gradient by the batch's count of its token (``scale_grad_by_freq``) is refused the same way, the reason
named. A model whose examples depend on the batch's size alone (no example's values reach another's) is refused by
removing one; dropout alone passes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import refused_before_any_charge
from test_clipping_check import labels
from torch import nn
from torch.utils.data import TensorDataset


from dpml.train.clipping_check import ClippingUnsupported, plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy, train_dpsgd

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is ever fetched from a hub: the models are built from configurations

GRADIENT_MOVED = (
    r"replacing example 0 of a probe batch changed the gradient of the other examples' losses with respect to "
    r"'{}' \(.* relative\), though not the losses: the model mixes the examples"
)


class BatchRoutedAdapter(nn.Module):
    """A frozen layer plus an adapter: h = A x, a mixture of experts' factors B_e weighted by the routing averaged
    over the batch (``batch_routing``) or each example's own (else), added as (h @ Σ_e p_e B_e). B starts at 0
    (``start`` 0) or drawn at random with that scale."""

    def __init__(self, batch_routing: bool, start: float = 0.0) -> None:
        super().__init__()
        self.base = nn.Linear(6, 3).requires_grad_(False)
        self.a = nn.Linear(6, 4, bias=False)
        self.router = nn.Linear(4, 2, bias=False)
        self.b = nn.Parameter(start * torch.randn(2, 4, 3))
        self.batch_routing = batch_routing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        routing = torch.softmax(self.router(h), dim=-1)  # (B, experts)
        if self.batch_routing:
            mixture = torch.einsum("e,eio->io", routing.mean(0), self.b)
            return self.base(x) + h @ mixture
        return self.base(x) + torch.einsum("bi,be,eio->bo", h, routing, self.b)


def test_a_model_that_mixes_the_batch_where_a_parameter_is_zero_is_refused_naming_it() -> None:
    torch.manual_seed(3)
    with pytest.raises(ClippingUnsupported, match=GRADIENT_MOVED.format("b")):
        plan_clipping(BatchRoutedAdapter(batch_routing=True), per_example_cross_entropy, (6,))


def test_the_same_mixing_once_the_parameter_is_not_zero_is_refused_by_the_losses() -> None:
    torch.manual_seed(3)
    with pytest.raises(ClippingUnsupported, match=r"replacing example 0 of a probe batch changed the loss of example"):
        plan_clipping(BatchRoutedAdapter(batch_routing=True, start=0.3), per_example_cross_entropy, (6,))


def test_training_refuses_it_before_any_step_and_routing_per_example_trains() -> None:
    torch.manual_seed(4)
    x, y = torch.randn(40, 6), labels(40, 3)
    settings = dict(sample_rate=0.25, epochs=1, clip_norm=1.0, noise_multiplier=1.0, neighbouring="add_remove", seed=0)
    mixing = BatchRoutedAdapter(batch_routing=True)
    before = [p.detach().clone() for p in mixing.parameters()]
    with pytest.raises(ClippingUnsupported, match=GRADIENT_MOVED.format("b")):
        train_dpsgd(mixing, x, y, optimizer=torch.optim.SGD(mixing.parameters(), lr=0.1), **settings)
    assert all(torch.equal(a, b) for a, b in zip(before, mixing.parameters(), strict=True))
    own = BatchRoutedAdapter(batch_routing=False)  # zero-initialised too, but each example routed alone
    train_dpsgd(own, x, y, optimizer=torch.optim.SGD(own.parameters(), lr=0.1), **settings)
    assert own.b.abs().sum() > 0


def test_peft_lily_is_refused_naming_its_adapter_factor() -> None:
    peft = pytest.importorskip("peft", reason="peft is a test extra; not installed here")
    from test_model_zoo import _text_model, _tokens
    from test_op_rules import HuggingFace

    torch.manual_seed(0)
    config = peft.LilyConfig(target_modules=["query", "value"], task_type="SEQ_CLS")
    model = HuggingFace(peft.get_peft_model(_text_model("bert"), config))
    x = _tokens("bert")
    with pytest.raises(ClippingUnsupported, match=GRADIENT_MOVED.format(r".*lily_B\..*")):
        plan_clipping(model, per_example_cross_entropy, tuple(x.shape[1:]), x.dtype, probe=(x, labels(x.shape[0], 3)))


class ScaledByTheBatchSize(nn.Module):
    """Each example's logits scaled by the number of examples in its batch: no example's values reach another's
    output, so replacing one moves nothing, but adding or removing one moves every other example's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 3)
        self.drop = nn.Dropout(0.3)  # (the size check runs in evaluation mode: no mask drawn anew for fewer rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.a(x)) * (1.0 + 0.1 * x.shape[0])


def test_a_model_that_depends_on_the_batch_size_alone_is_refused_under_add_remove_only() -> None:
    """Under replace-one neighbours the batch keeps its size and the others their places: the same model passes."""
    torch.manual_seed(5)
    with pytest.raises(ClippingUnsupported, match=r"removing example 0 of a probe batch changed the loss of example"):
        plan_clipping(ScaledByTheBatchSize(), per_example_cross_entropy, (6,))
    replaced = plan_clipping(ScaledByTheBatchSize(), per_example_cross_entropy, (6,), neighbouring="replace-one")
    assert replaced.exact_parameters == ()
    dropout = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.3), nn.Linear(8, 3))  # masks drawn per pass: not a size
    assert plan_clipping(dropout, per_example_cross_entropy, (6,)).exact_parameters == ()


class FrequencyScaledBag(nn.Module):
    """Token embeddings averaged, then a linear head; the embedding built with ``scale_grad_by_freq``: the backward
    pass divides each row's gradient by how often the batch holds its token, so the others' gradients move with
    example 0's tokens while their losses do not."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(12, 5, scale_grad_by_freq=True)
        self.head = nn.Linear(5, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(1))


def test_an_embedding_that_scales_its_gradient_by_the_batch_s_token_counts_is_refused_naming_it() -> None:
    torch.manual_seed(6)
    with pytest.raises(ClippingUnsupported, match=GRADIENT_MOVED.format("embedding.weight") + ".*scale_grad_by_freq"):
        plan_clipping(FrequencyScaledBag(), per_example_cross_entropy, (4,), torch.int64)


def batch_balanced_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy weighted by the inverse of each label's count in the batch (class balancing per batch): under
    replace-one neighbours the batch keeps its size, and a record's label alone moves the others' weights."""
    counts = torch.bincount(y, minlength=logits.shape[1]).clamp(min=1).to(logits.dtype)
    return F.cross_entropy(logits, y, reduction="none") * (len(y) / counts[y]) / logits.shape[1]


def smoothed_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, y, reduction="none", label_smoothing=0.1)


def test_a_loss_weighted_by_the_batch_s_label_counts_is_refused_under_replace_one(tmp_path: Path) -> None:
    """The replaced record takes another label as well as another input (replacing the input alone left every
    weight as it was, and such a loss trained with its ε certified)."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(ClippingUnsupported, match=r"changed the loss of example \d+ .* label counts"):
        plan_clipping(model, batch_balanced_loss, (6,), neighbouring="replace-one")
    records = TensorDataset(torch.randn(60, 6), labels(60, 3))
    refused_before_any_charge(
        tmp_path / "ledger.db", model, records, "label counts", loss=batch_balanced_loss, neighbouring="replace-one"
    )
    plan_clipping(model, smoothed_loss, (6,), neighbouring="replace-one")  # a loss of each record alone passes
