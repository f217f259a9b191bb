"""A model whose own passes write into a parameter is refused before any ε is spent
(dpml.train.probe_checks, **No writes to parameters**).

DP-SGD certifies parameters changed by the noisy step alone. ``nn.Embedding(max_norm=…)`` renormalises, in place and
without noise, the rows each batch looks up: trained as it was, the released table showed which tokens the private
records hold (the first test shows it on the unguarded update; dpml certified ε ≈ 2.9 for such a run before the
check). The check reads version counters and storage, not values: a bound the probe's rows stay within is refused
too, and so are writes by a module's own code (``.data`` in place or swapped, a hook in the backward pass). Models
whose passes write nothing a parameter holds pass as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import refused_before_any_charge, trains_charged_once
from torch import nn
from torch.utils.data import TensorDataset

from dpml.train.clipping_check import ClippingUnsupported, plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy

VOCABULARY, WIDTH, LENGTH = 50, 8, 4


class Bag(nn.Module):
    """Mean of the tokens' embeddings, then a linear head; ``embedding`` keywords go to ``nn.Embedding``."""

    def __init__(self, **embedding: float) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, WIDTH, **embedding)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(1))


class ShrinksInForward(nn.Module):
    """Scales its weight in place in every training-mode forward pass (a hand-written weight decay)."""

    def __init__(self, swap: bool = False) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3)
        self.swap = swap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            if self.swap:
                self.layer.weight.data = self.layer.weight.data * 0.999
            else:
                self.layer.weight.data.mul_(0.999)
        return self.layer(x)


class WritesInBackward(nn.Module):
    """A hook on the hidden activations' gradient that writes its size into the head's bias."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(6, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(x))
        if h.requires_grad:
            h.register_hook(self._record)
        return self.head(h)

    def _record(self, grad: torch.Tensor) -> None:
        with torch.no_grad():
            self.head.bias.add_(1e-3 * grad.norm())


class RescalesOnSwitch(nn.Module):
    """Halves its weight when it goes into evaluation and doubles it back on its first training pass (RWKV's
    ``_rescale_layers``): written once, from the mode alone."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3)
        self.halved = True  # as after a forward pass in evaluation mode (dpml's own look at the output width)
        with torch.no_grad():
            self.layer.weight.div_(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.halved:
            with torch.no_grad():
                self.layer.weight.mul_(2)
            self.halved = False
        return self.layer(x)


class InitialisesFromFirstBatch(nn.Module):
    """Glow's ActNorm: on its first training pass it sets its shift to minus the batch's mean, once."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(6))
        self.head = nn.Linear(6, 3)
        self.initialised = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and not self.initialised:
            with torch.no_grad():
                self.shift.copy_(-x.mean(0))
            self.initialised = True
        return self.head(x + self.shift)


def token_records(n: int, seed: int = 0) -> TensorDataset:
    """Records that hold only tokens 1…5 of the vocabulary, and binary labels."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(1, 6, (n, LENGTH), generator=g), torch.randint(0, 2, (n,), generator=g))


def test_max_norm_writes_the_private_tokens_into_the_table_without_noise() -> None:
    """Why the check exists: one noisy step (σ = 1, C = 1, batch 20) as DP-SGD releases it, with the forward pass's
    renormalisation left in. The rows of the tokens in the records end at norm ≤ 1 + the step; the absent rows keep
    their starting norms (well above 1 in 8 dimensions), so the table shows which tokens the records hold."""
    torch.manual_seed(0)
    model = Bag(max_norm=1.0)
    start = model.embedding.weight.detach().norm(dim=1).clone()
    tokens, labels = token_records(20).tensors
    losses = per_example_cross_entropy(model(tokens), labels)
    grads = [torch.autograd.grad(loss, model.embedding.weight, retain_graph=True)[0] for loss in losses]
    clipped = sum(g * min(1.0, 1.0 / float(g.norm())) for g in grads)
    with torch.no_grad():
        model.embedding.weight -= 0.1 * (clipped + torch.randn_like(clipped)) / 20
    end = model.embedding.weight.detach().norm(dim=1)
    present, absent = end[1:6], end[6:]
    assert bool((start[1:6] > 1.2).all())  # the seed's rows start above the bound…
    assert float(present.max()) < 1.1 and float(absent.min()) > 1.2  # …and only the records' rows were pulled down
    assert bool(((end[6:] - start[6:]).abs() < 0.1).all())


@pytest.mark.parametrize("bound", [1.0, 1e6])
def test_an_embedding_with_max_norm_is_refused_by_the_plan_whatever_the_bound(bound: float) -> None:
    """At 1e6 the renormalisation changes no value on the probe batch: the write is refused all the same."""
    with pytest.raises(ClippingUnsupported, match=r"model parameter\(s\) 'embedding.weight': .* max_norm"):
        plan_clipping(Bag(max_norm=bound), per_example_cross_entropy, (LENGTH,), torch.int64)


@pytest.mark.parametrize("swap", [False, True], ids=["in-place", "data-swapped"])
def test_a_module_that_changes_its_own_weight_in_forward_is_refused(swap: bool) -> None:
    with pytest.raises(ClippingUnsupported, match=r"'layer.weight': every training-mode pass writes into them"):
        plan_clipping(ShrinksInForward(swap), per_example_cross_entropy, (6,))


def test_a_write_from_the_backward_pass_is_refused() -> None:
    with pytest.raises(ClippingUnsupported, match=r"'head.bias': every training-mode pass"):
        plan_clipping(WritesInBackward(), per_example_cross_entropy, (6,))


def test_an_initialisation_from_the_first_batch_is_refused() -> None:
    with pytest.raises(ClippingUnsupported, match=r"'shift': the first training-mode pass writes the examples"):
        plan_clipping(InitialisesFromFirstBatch(), per_example_cross_entropy, (6,))


def test_a_write_made_once_from_the_mode_alone_passes(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="dpml.clipping"):
        plan = plan_clipping(RescalesOnSwitch(), per_example_cross_entropy, (6,))
    assert plan.exact_parameters == ()
    assert "'layer.weight'" in caplog.text and "written once by the first training-mode pass" in caplog.text


def test_train_private_refuses_it_before_anything_is_charged_or_any_record_is_read_by_the_model(
    tmp_path: Path,
) -> None:
    """Every input the model sees before the refusal is synthetic: the probe's, and the one record of its shape that
    reads the output width (the records hold tokens 1…5 only; a synthetic row of them is a 1-in-10⁴ draw)."""
    model = Bag(max_norm=1.0)
    records = token_records(60)
    seen: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda _, inputs: seen.append(inputs[0].detach().clone()))
    refused_before_any_charge(tmp_path / "ledger.db", model, records, "max_norm=None", inputs="tensor")
    assert seen, "the model was never called"
    private = {tuple(row.tolist()) for row in records.tensors[0]}
    assert not any(tuple(row.tolist()) in private for batch in seen for row in batch.reshape(-1, LENGTH).long())


def test_the_same_model_without_max_norm_trains(tmp_path: Path) -> None:
    """The check's counterpart: padding rows, sparse-free lookups and a tied head write nothing and train, charged
    once."""
    trains_charged_once(tmp_path / "ledger.db", Bag(padding_idx=0), token_records(60), inputs="tensor")
