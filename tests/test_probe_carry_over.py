"""A model that keeps something of one batch in a plain attribute and reads it in the next pass is refused before any
ε is spent (:func:`dpml.train.probe_checks.check_nothing_carried`): a record would move every later step's clipped
sum, outside the sensitivity C. The first test shows the leak on the step itself. A model whose losses change from pass
to pass with nothing changed (a count of its passes) is refused, saying the probe cannot judge it; a module that keeps
a batch's values without reading them again passes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import refused_before_any_charge
from torch import nn
from torch.utils.data import TensorDataset

from dpml.train.clipping import clipped_gradient_sum
from dpml.train.clipping_check import ClippingUnsupported, plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy

CARRIED = r"replacing example 0 of one probe batch changed the loss of example \d+ of the next batch"


class CentresOnLastBatch(nn.Module):
    """Subtracts the mean of the previous batch (a plain tensor attribute, not a buffer) before its layers."""

    def __init__(self, as_number: bool = False) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3)
        self.as_number = as_number
        self.centre: torch.Tensor | float = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x - self.centre)
        mean = x.detach().mean(0)
        self.centre = float(mean.mean()) if self.as_number else mean
        return out


class CountsPasses(nn.Module):
    """Scales its output by a schedule of how many passes it has made: state, though not the examples'."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3)
        self.passes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.passes += 1
        return self.layer(x) * (1 + 0.1 * self.passes)


class KeepsLastInputs(nn.Module):
    """Keeps the last batch's hidden values for inspection and never reads them (as a visualisation hook would)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(6, 5)
        self.head = nn.Linear(5, 3)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(x))
        self.last = h.detach()
        return self.head(h)


def test_a_carried_centre_moves_the_next_steps_sum_beyond_the_clipped_gradient() -> None:
    """Why the check: two neighbouring first batches (example 0 replaced), then the same second batch: its clipped
    sum differs, though no record of it differs."""
    g = torch.Generator().manual_seed(0)
    first, second, y = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,))
    other = first.clone()
    other[0] = 50.0
    sums = []
    for before in (first, other):
        torch.manual_seed(1)
        model = CentresOnLastBatch()
        clipped_gradient_sum(model, per_example_cross_entropy, before, y, 1.0)
        sums.append(clipped_gradient_sum(model, per_example_cross_entropy, second, y, 1.0)[0])
    moved = sum(float((a - b).pow(2).sum()) for a, b in zip(sums[0].values(), sums[1].values(), strict=True)) ** 0.5
    assert moved > 0.1


@pytest.mark.parametrize("as_number", [False, True], ids=["tensor", "number"])
def test_state_carried_from_one_batch_to_the_next_is_refused(as_number: bool) -> None:
    torch.manual_seed(2)
    with pytest.raises(ClippingUnsupported, match=CARRIED):
        plan_clipping(CentresOnLastBatch(as_number), per_example_cross_entropy, (6,))


def test_a_model_that_counts_its_passes_is_refused_as_one_the_probe_cannot_judge() -> None:
    torch.manual_seed(2)
    with pytest.raises(ClippingUnsupported, match=r"changed from one pass to the next .* cannot judge"):
        plan_clipping(CountsPasses(), per_example_cross_entropy, (6,))


def test_values_kept_but_never_read_again_pass() -> None:
    torch.manual_seed(2)
    assert plan_clipping(KeepsLastInputs(), per_example_cross_entropy, (6,)).exact_parameters == ()


def test_train_private_refuses_it_before_anything_is_charged(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    records = TensorDataset(torch.randn(60, 6, generator=g), torch.randint(0, 3, (60,), generator=g))
    refused_before_any_charge(tmp_path / "ledger.db", CentresOnLastBatch(), records, CARRIED)
