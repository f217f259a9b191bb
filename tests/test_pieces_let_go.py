"""What the engine's rule pieces no longer read is let go as they are formed, not with the pass: the uses of a
standardised weight once its piece is formed (BiT's ``F.batch_norm`` of the weight, a standardisation written by hand),
each ruled call and its δ once its uses are formed. Both measured on BiT-50 at batch 64 on a CPU: the DP step's peak
of tensor memory 418 → 343 MiB, the non-private step's 196 (``benchmarks/results/rule_memory_cpu``)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_op_rules import assert_exact_without_the_exact_path
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from dpml.train import clipping, released
from dpml.train.dpsgd import per_example_cross_entropy
from dpml.train.released import RuledCall, Slot
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


def _call(slot: int, held: torch.Tensor, finished: list[int]) -> RuledCall:
    def finish(delta: torch.Tensor) -> list[Any]:
        finished.append(slot)
        return [] if held.numel() == 0 else []

    return RuledCall([], finish, "op", Slot(slot, torch.Size([2]), torch.float32, torch.device("cpu")))


def test_each_call_and_each_delta_goes_once_taken() -> None:
    """The calls come in their order with their δ; when a call is taken the ones before it (and what their
    ``finish`` holds) are gone, and a δ goes after the last call that reads it, not before."""
    finished: list[int] = []
    inputs = [torch.randn(1000) for _ in range(4)]
    refs = [StorageWeakRef(t.untyped_storage()) for t in inputs]
    calls = [_call(slot, t, finished) for slot, t in zip([0, 1, 0, 2], inputs, strict=True)]
    del inputs
    deltas: list[torch.Tensor | None] = [torch.full((2,), float(k)) for k in range(3)] + [torch.ones(2)]
    seen = []
    for k, (call, delta) in enumerate(released.each_with_its_delta(calls, deltas)):
        call.finish(delta)
        gc.collect()
        seen.append((call.slot.place, float(delta[0]), [ref.expired() for ref in refs[:k]]))
        del call, delta
    assert [(place, value) for place, value, _ in seen] == [(0, 0.0), (1, 1.0), (0, 0.0), (2, 2.0)]
    assert all(all(gone) for _, _, gone in seen)  # every earlier call's input gone when the next is taken
    assert calls == [] and finished == [0, 1, 0, 2]
    assert deltas[:3] == [None, None, None] and deltas[3] is not None  # (a δ no call reads stays for the pass)


class GroupNormAct(nn.GroupNorm):
    """timm's spelling: ``F.group_norm`` called by a module of its own (a ruled operation, not a hooked layer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps))


class NormedLayers(nn.Module):
    """Linear maps over positions, each followed by a group norm over the channels, whose uses (its weight's and
    bias's per-example gradients) are C numbers an example: its input is not read once they are formed."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(WIDTH + 1, WIDTH + 1) for _ in range(LAYERS))
        self.norms = nn.ModuleList(GroupNormAct(2, WIDTH + 1) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH + 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear, norm in zip(self.linears, self.norms, strict=True):
            x = norm(linear(x).transpose(1, 2)).transpose(1, 2)
        return self.head(x.mean(1))


def test_a_ruled_call_s_input_goes_once_its_uses_are_formed(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the uses of the k-th group norm call are formed, the inputs of the calls before it are gone (their uses,
    C numbers an example each, are what the pass holds of them), not held until every call's uses are."""
    x = torch.randn(BATCH, POSITIONS, WIDTH + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(6)
    model = NormedLayers().double()
    inputs: list[StorageWeakRef] = []
    for norm in model.norms:
        norm.register_forward_hook(lambda m, args, out: inputs.append(StorageWeakRef(args[0].untyped_storage())))
    original, alive = clipping.cast_form, []

    def cast(form: Any, dtype: torch.dtype) -> Any:
        gc.collect()
        alive.append(sum(not ref.expired() for ref in inputs[: len(alive) // 2]))  # (two uses a call: γ, β)
        return original(form, dtype)

    monkeypatch.setattr(clipping, "cast_form", cast)
    found = clipping.engine_pass(model, per_example_cross_entropy, x, torch.randint(0, 3, (BATCH,)))
    ruled = sorted(unit.name for unit, _ in found.fast if isinstance(unit, clipping.RuleUnit))
    assert ruled == sorted(f"norms.{k}.{p}" for k in range(LAYERS) for p in ("weight", "bias"))
    assert len(alive) == 2 * LAYERS and alive == [0] * (2 * LAYERS)
    monkeypatch.setattr(clipping, "cast_form", original)
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, torch.randint(0, 3, (BATCH,)))
