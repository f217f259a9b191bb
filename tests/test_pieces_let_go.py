"""What the engine no longer reads is let go as soon as it is done with, not with the pass: a ruled call's input and δ
once its uses are formed, as the backward pass reaches its output (a group norm's: its per-example γ and β gradients
are all it needs of them), and a standardised weight's uses once its piece is formed (BiT's ``F.batch_norm`` of the
weight, a standardisation written by hand). ``python benchmarks/tensor_peaks.py`` measures what that is worth
(``benchmarks/results/tensor_peaks_cpu``)."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_op_rules import assert_exact_without_the_exact_path
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from dpml.train import clipping
from dpml.train.dpsgd import per_example_cross_entropy
from dpml.train.rules import row_jacobian, standardised

BATCH, POSITIONS, WIDTH, LAYERS = 6, 5, 7, 3


def _by_batch_norm(w: torch.Tensor) -> torch.Tensor:
    """BiT's ``StdConv2d``: batch norm of the weight's rows, no running statistics."""
    rows = w.reshape(1, w.shape[0], -1)
    return F.batch_norm(rows, None, None, training=True, momentum=0.0, eps=1e-5).reshape_as(w)


def _by_hand(w: torch.Tensor) -> torch.Tensor:
    """BiT's original PyTorch spelling."""
    v, m = torch.var_mean(w, dim=1, keepdim=True, unbiased=False)
    return (w - m) / torch.sqrt(v + 1e-10)


SPELLINGS = {
    "batch norm": (_by_batch_norm, standardised, "_piece"),
    "by hand": (_by_hand, row_jacobian, "_factored_piece"),
}


class StandardisedLayers(nn.Module):
    """Linear maps over a sequence's positions whose weights are standardised row by row before each use."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.standardise = SPELLINGS[spelling][0]
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(WIDTH, WIDTH)) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.tanh(F.linear(x, self.standardise(w)))
        return self.head(x.mean(1))


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_a_standardised_weight_s_factors_go_once_its_piece_is_formed(
    spelling: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When each standardised weight's piece is formed, the factors (δ and input) of the ones before it are gone:
    their pieces hold what they read (the centred copies, or kept gradients), not the uses they came from; the sums
    stay the float64 loop's."""
    _, module, name = SPELLINGS[spelling]
    original = getattr(module, name)
    x = torch.randn(BATCH, POSITIONS, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    batch = StorageWeakRef(x.untyped_storage()).cdata
    watched: list[StorageWeakRef] = []
    alive: list[int] = []

    def piece(found: Any, form: Any, *rest: Any) -> Any:
        gc.collect()
        alive.append(sum(not ref.expired() and ref.cdata != batch for ref in watched))
        watched.extend(StorageWeakRef(t.untyped_storage()) for t in (form.u, form.v))
        return original(found, form, *rest)

    monkeypatch.setattr(module, name, piece)
    torch.manual_seed(4)
    model = StandardisedLayers(spelling).double()
    clipping.engine_pass(model, per_example_cross_entropy, x, torch.randint(0, 3, (BATCH,)))
    assert len(alive) == LAYERS and alive == [0] * LAYERS
    monkeypatch.setattr(module, name, original)
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, torch.randint(0, 3, (BATCH,)))


class GroupNormAct(nn.GroupNorm):
    """timm's spelling: ``F.group_norm`` called by a module of its own (a ruled operation, not a hooked layer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps))


class NormedLayers(nn.Module):
    """Linear maps over positions, each followed by a group norm over the channels, whose uses (its weight's and
    bias's per-example gradients) are C numbers an example: its input is not read once they are formed. ``watch``
    (layer k, the linear map's output) is called in the forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(WIDTH + 1, WIDTH + 1) for _ in range(LAYERS))
        self.norms = nn.ModuleList(GroupNormAct(2, WIDTH + 1) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH + 1, 3)
        self.watch: Callable[[int, torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, (linear, norm) in enumerate(zip(self.linears, self.norms, strict=True)):
            z = linear(x)
            if self.watch is not None:
                self.watch(k, z)
            x = norm(z.transpose(1, 2)).transpose(1, 2)
        return self.head(x.mean(1))


def test_a_ruled_call_s_input_goes_as_the_backward_pass_forms_its_uses() -> None:
    """A ruled call's uses are formed as the backward pass reaches its output, and its input goes then: when the
    pass reaches the k-th linear map's output, the inputs of the group norms above it (each the output of the
    linear map below it) are gone, not held until the pass is over; the sums stay the float64 loop's."""
    x = torch.randn(BATCH, POSITIONS, WIDTH + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(6)
    model = NormedLayers().double()
    inputs: dict[int, StorageWeakRef] = {}
    alive: dict[int, int] = {}

    def reached(k: int, grad: torch.Tensor) -> None:
        gc.collect()
        alive[k] = sum(not inputs[j].expired() for j in range(k + 1, LAYERS))

    def watch(k: int, z: torch.Tensor) -> None:
        inputs[k] = StorageWeakRef(z.untyped_storage())
        if z.requires_grad:
            z.register_hook(functools.partial(reached, k))

    model.watch = watch
    found = clipping.engine_pass(model, per_example_cross_entropy, x, torch.randint(0, 3, (BATCH,)))
    ruled = sorted(unit.name for unit, _ in found.fast if isinstance(unit, clipping.RuleUnit))
    assert ruled == sorted(f"norms.{k}.{p}" for k in range(LAYERS) for p in ("weight", "bias"))
    assert sorted(alive) == list(range(LAYERS)) and set(alive.values()) == {0}
    model.watch = None
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, torch.randint(0, 3, (BATCH,)))


class GainedLayers(nn.Module):
    """NFNet's ``ScaledStdConv2d`` as linear maps: the weight's rows standardised by ``F.batch_norm`` with a gain per
    output row (some 0, as NFNet starts its last ones), so Ŵ is not the forward pass's output but (W − μ)·r."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(WIDTH, WIDTH)) for _ in range(LAYERS))
        self.gains = nn.ParameterList(
            nn.Parameter(torch.rand(WIDTH) * (torch.arange(WIDTH) > 1)) for _ in range(LAYERS)
        )
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w, gain in zip(self.weights, self.gains, strict=True):
            rows = w.reshape(1, WIDTH, -1)
            scaled = F.batch_norm(rows, None, None, gain * WIDTH**-0.5, training=True, momentum=0.0, eps=1e-5)
            x = torch.tanh(F.linear(x, scaled.reshape_as(w)))
        return self.head(x.mean(1))


def test_a_gained_standardised_weight_s_piece_does_not_hold_its_standardised_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where a gain scales the standardised rows, Ŵ = (W − μ)·r is formed for the norms and formed again for the clipped
    sum, not held from one to the other: once the pass's pieces are formed, every Ŵ formed for them is gone (one
    weight's worth each, BiT- and NFNet-sized weights add up to the model's size)."""
    original, formed = standardised._standardised, []

    def spied(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        hat, scale = original(*args)
        formed.append(StorageWeakRef(hat.untyped_storage()))
        return hat, scale

    monkeypatch.setattr(standardised, "_standardised", spied)
    x = torch.randn(BATCH, POSITIONS, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    torch.manual_seed(9)
    model = GainedLayers().double()
    found = clipping.engine_pass(model, per_example_cross_entropy, x, torch.randint(0, 3, (BATCH,)))
    gc.collect()
    taken = [unit.name for unit, _ in found.fast if isinstance(unit, clipping.RuleUnit)]
    assert {f"weights.{k}" for k in range(LAYERS)} <= set(taken)
    assert len(formed) == LAYERS and all(ref.expired() for ref in formed)
    assert len(found.sums(torch.ones(BATCH, dtype=torch.float64))) == len(taken) + 2  # (formed again: the head's too)
    monkeypatch.setattr(standardised, "_standardised", original)
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, torch.randint(0, 3, (BATCH,)))


class RowProjections(nn.Module):
    """transformers' ``Conv1D`` spelled out: ``torch.addmm`` on the B·T rows of the activations, each output viewed
    back as (B, T, d) and added to the residual stream (an addition saves nothing for its backward: in a non-private
    step nothing holds the output past it). ``watch`` (layer k, its output) is called in the forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH) for _ in range(LAYERS))
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(WIDTH)) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, 3)
        self.watch: Callable[[int, torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, positions, width = x.shape
        for k, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            h = torch.addmm(b, x.reshape(-1, width), w)
            if self.watch is not None:
                self.watch(k, h)
            x = x + h.view(batch, positions, width)
        return self.head(x.mean(1))


def test_the_recording_pass_holds_no_activation_past_its_last_use() -> None:
    """The example maps of the recording forward pass (where each example's rows are in a tensor of B·T rows) do not
    keep the tensor alive: when layer k's projection runs, the outputs of the ones before it are gone, as in a
    non-private step (each one's whole use was the addition after it)."""
    x = torch.randn(BATCH, POSITIONS, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    torch.manual_seed(12)
    model = RowProjections().double()
    made: list[StorageWeakRef] = []
    alive: list[int] = []

    def watch(k: int, h: torch.Tensor) -> None:
        gc.collect()
        alive.append(sum(not ref.expired() for ref in made))
        made.append(StorageWeakRef(h.untyped_storage()))

    model.watch = watch
    found = clipping.engine_pass(model, per_example_cross_entropy, x, torch.randint(0, 3, (BATCH,)))
    ruled = {unit.name for unit, _ in found.fast if isinstance(unit, clipping.RuleUnit)}
    assert {f"weights.{k}" for k in range(LAYERS)} <= ruled
    assert alive == [0] * LAYERS
    model.watch = None
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, torch.randint(0, 3, (BATCH,)))
