"""One engine pass keeps at most ``PASS_KEEP_LAYERS`` × the device's keep limit of materialised per-example
gradients, all layers together, and at most ``KEEP_SHARE`` of the numbers it holds anyway (its layers' inputs and
output gradients) (:mod:`dpml.train.keep_budget`), counted net of the input and δ a layer lets go by keeping; its
clipped sums stay exact past either bound. The recorded
outputs are let go before the backward pass (:mod:`dpml.train.released`), and a ruled parameter whose uses do not
combine is taken exactly from the forward pass run again, with the same random draws."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from test_clipping_layers import assert_matches_naive_loop, labels, naive_clipped_sum_and_norms
from torch import nn

from dpml.train import clipping, clipping_layers, keep_budget
from dpml.train.rules import combine
from dpml.train.rules.registry import Factored
from dpml.train.dpsgd import per_example_cross_entropy

BATCH, POSITIONS, WIDTH, LAYERS = 9, 6, 16, 8
NARROW = 8  # a width whose per-example gradients (B·d²) are fewer numbers than the layer's input and δ (2·B·T·d)


class DeepSequenceMlp(nn.Module):
    """``LAYERS`` equal dense layers over ``POSITIONS`` positions: each one's per-example gradients are
    materialised (T²(d_in + d_out) > 4·d_in·d_out) and, alone, fit the keep limit the test sets."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(LAYERS))
        self.out = nn.Linear(POSITIONS * width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x.flatten(1))


HELD = LAYERS * 2 * BATCH * POSITIONS * WIDTH + BATCH * (POSITIONS * WIDTH + 3)  # the layers' inputs and δ
KEPT = BATCH * WIDTH * WIDTH  # one hidden layer's per-example weight gradients
NET = KEPT - 2 * BATCH * POSITIONS * WIDTH  # …less its input and δ, which keeping them lets go (> 0 at WIDTH)


class DeepSequenceConv1D(DeepSequenceMlp):
    """The same layers as transformers' ``Conv1D`` (GPT-2's: ``torch.addmm`` on the positions merged with the batch):
    taken by the operation rules, not hooked."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__(width)
        conv1d = pytest.importorskip("transformers.pytorch_utils", reason="transformers is a test extra").Conv1D
        self.hidden = nn.ModuleList(conv1d(width, width) for _ in range(LAYERS))


def kept_layers(
    monkeypatch: pytest.MonkeyPatch,
    pass_layers: int,
    share: float = 1e9,
    width: int = WIDTH,
    model_class: type[DeepSequenceMlp] = DeepSequenceMlp,
) -> list[int]:
    """Runs the engine against the one-example-at-a-time loop; returns the numbers each layer's clipped sum
    read from kept per-example gradients (one entry per layer that kept them), hooked or ruled."""
    layer_limit = BATCH * width * width  # one hidden layer's per-example weight gradients, exactly
    monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", layer_limit)
    monkeypatch.setattr(keep_budget, "PASS_KEEP_LAYERS", pass_layers)
    monkeypatch.setattr(keep_budget, "KEEP_SHARE", share)
    assert clipping_layers.materialise(BATCH, POSITIONS, width, width, layer_limit)
    kept: list[int] = []
    kept_sum = clipping_layers.kept_sum

    def spy(factors: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
        kept.append(sum(part.numel() for part in parts))
        return kept_sum(factors, parts)

    monkeypatch.setattr(clipping_layers, "kept_sum", spy)
    monkeypatch.setattr(combine, "kept_sum", spy)
    torch.manual_seed(5)
    model = model_class(width).double()
    x = torch.randn(BATCH, POSITIONS, width, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    assert_matches_naive_loop(model, x, labels(BATCH), 0.05)
    return kept


def test_a_pass_keeps_no_more_than_its_budget_and_its_sums_stay_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """One layer's limit, spent net of what each keeping layer lets go: four layers keep, the rest take a second
    pass (the fifth would need its whole KEPT, of which only its freed input and δ are left)."""
    assert KEPT // NET == 4
    assert kept_layers(monkeypatch, pass_layers=1) == [KEPT] * 4


def test_the_budget_is_what_stops_the_keeping(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kept_layers(monkeypatch, pass_layers=100) == [KEPT] * LAYERS


@pytest.mark.parametrize("share", [0.1, 0.25])
def test_a_pass_keeps_no_more_than_its_share_of_what_it_holds(share: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for every layer by the layer count, the share of the held numbers (inputs and δ) bounds the net
    numbers kept."""
    kept = kept_layers(monkeypatch, pass_layers=100, share=share)
    assert kept == [KEPT] * int(share * HELD // NET)
    assert 0 < len(kept) < LAYERS


def test_a_layer_whose_gradients_are_fewer_numbers_than_its_input_and_delta_keeps_them_with_no_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keeping them lets go more than it holds, so which such layers keep does not hang on the order the backward
    pass reaches them in, nor on what the others spent."""
    assert BATCH * NARROW * NARROW < 2 * BATCH * POSITIONS * NARROW
    assert kept_layers(monkeypatch, pass_layers=0, width=NARROW) == [BATCH * NARROW * NARROW] * LAYERS


def test_a_ruled_layer_is_charged_net_of_its_factors_as_a_hooked_one_is_of_its_input_and_delta(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """transformers' ``Conv1D`` goes through the rules (``torch.addmm``): its use's factors are its input and δ rows,
    let go once its piece is formed, so the same budget keeps as many of its layers as of ``nn.Linear``'s."""
    assert kept_layers(monkeypatch, pass_layers=1, model_class=DeepSequenceConv1D) == [KEPT] * 4
    assert (
        kept_layers(monkeypatch, pass_layers=0, width=NARROW, model_class=DeepSequenceConv1D)
        == [BATCH * NARROW * NARROW] * LAYERS
    )


def test_a_ruled_layer_that_keeps_lets_its_factors_go_before_the_next_parameter_s_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the charge counts on is let go: once a ruled weight's piece keeps its per-example gradients, neither its
    clipped sum nor anything of the engine's holds its input and δ rows (the batch aside, which the caller holds):
    their memory is free before the next parameter's piece is formed."""
    from torch.multiprocessing.reductions import StorageWeakRef

    x = torch.randn(BATCH, POSITIONS, NARROW, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    batch_storage = StorageWeakRef(x.untyped_storage())
    watched: list[StorageWeakRef] = []
    alive_at_pieces: list[int] = []
    norms, piece = combine.weight_norms_squared, clipping.parameter_piece

    def keeping(a: torch.Tensor, d: torch.Tensor, freed: int = 0) -> Any:
        squared, kept = norms(a, d, freed)
        if kept is not None:
            watched.extend(StorageWeakRef(t.untyped_storage()) for t in (a, d))
        return squared, kept

    def next_piece(*args: Any, **kwargs: Any) -> Any:
        alive_at_pieces.append(sum(not ref.expired() and ref.cdata != batch_storage.cdata for ref in watched))
        return piece(*args, **kwargs)

    monkeypatch.setattr(combine, "weight_norms_squared", keeping)
    monkeypatch.setattr(clipping, "parameter_piece", next_piece)
    monkeypatch.setattr(keep_budget, "PASS_KEEP_LAYERS", 0)
    torch.manual_seed(5)
    model = DeepSequenceConv1D(NARROW).double()
    found = clipping.engine_pass(model, per_example_cross_entropy, x, labels(BATCH))
    ruled = [unit.name for unit, _ in found.fast if isinstance(unit, clipping.RuleUnit)]
    assert [f"hidden.{k}.weight" for k in range(LAYERS)] == [name for name in ruled if name.endswith("weight")]
    assert len(watched) == 2 * LAYERS  # every one kept, with no budget: each lets go more than it keeps
    assert len(alive_at_pieces) == 2 * LAYERS and alive_at_pieces == [0] * (2 * LAYERS)


def test_a_factor_broadcast_along_a_dimension_lets_go_only_what_it_holds() -> None:
    """The charge's credit is the memory the factors hold: a factor expanded from one row holds one row."""
    row = torch.randn(1, 1, 5)
    v = torch.randn(4, 3, 7)
    assert combine.letting_go(Factored(row.expand(4, 3, 5), v, 5, 7)) == 5 + 4 * 3 * 7
    assert combine.letting_go(Factored(row.expand(4, 3, 5).contiguous(), v, 5, 7)) == 4 * 3 * 5 + 4 * 3 * 7


def test_the_default_share_is_a_quarter() -> None:
    """The share the families' memory was measured with (benchmarks/results/families.md): DP peak ≤ 1.5×."""
    assert keep_budget.KEEP_SHARE == 0.25
    assert keep_budget.pass_total(torch.device("cpu"), 1000) == 250


def test_outside_a_pass_a_layer_keeps_up_to_its_own_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 10)
    assert keep_budget.left() is None and keep_budget.room(123) == 123
    with keep_budget.pass_budget(torch.device("cpu"), held=10**9):
        assert keep_budget.room(100) == 10 * keep_budget.PASS_KEEP_LAYERS
        keep_budget.spend(10 * keep_budget.PASS_KEEP_LAYERS - 3)
        assert keep_budget.room(100) == 3 and keep_budget.left() == 3
        keep_budget.spend(5)
        assert keep_budget.room(100) == 0 and keep_budget.room(100, freed=40) == 38  # (left: -2)
        keep_budget.spend(70, freed=40)  # 30 numbers more than it let go
        assert keep_budget.left() == -32 and keep_budget.room(100, freed=40) == 8
        keep_budget.spend(8, freed=40)  # fewer than it let go: nothing spent
        assert keep_budget.left() == -32
    with keep_budget.pass_budget(torch.device("cpu"), held=100):  # a quarter of what the pass holds: 25
        assert keep_budget.room(100) == 25 and keep_budget.room(7) == 7 and keep_budget.left() == 25
    assert keep_budget.left() is None


class Chain(nn.Module):
    """Three dense layers, GELU and tanh between them: GELU saves its input (the first layer's output z₁), tanh its
    result, so once the forward pass is over only the engine holds the middle layer's output z₂, and only autograd's
    saved tensors z₁."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(6, 32), nn.Linear(32, 32), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.middle(nn.functional.gelu(self.first(x)))))


def test_the_recorded_outputs_are_let_go_and_the_graph_freed_as_the_backward_pass_goes() -> None:
    """When the backward pass reaches the first layer's output z₁, z₂ (recorded for its δ) is freed already: the
    engine asks for δ by gradient edge, not by holding the outputs; and so is z₁, which only GELU's saved tensors
    held: the graph is not kept when no parameter takes the exact path. The sums stay exact."""
    torch.manual_seed(2)
    model = Chain().double()
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    outputs: dict[str, weakref.ref[torch.Tensor]] = {}
    alive_then: list[tuple[bool, bool]] = []

    def watch(name: str) -> Any:
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            outputs[name] = weakref.ref(output)
            if name == "first":
                output.register_hook(
                    lambda grad: alive_then.append((outputs["middle"]() is not None, outputs["first"]() is not None))
                )

        return hook

    hooks = [getattr(model, name).register_forward_hook(watch(name)) for name in ("first", "middle")]
    sums, _ = clipping.clipped_gradient_sum(model, per_example_cross_entropy, x, labels(8), 0.05)
    for hook in hooks:
        hook.remove()
    assert alive_then == [(False, False)]
    reference, _ = naive_clipped_sum_and_norms(model, x, labels(8), 0.05)
    for name in reference:
        torch.testing.assert_close(sums[name], reference[name], rtol=1e-10, atol=1e-12, msg=name)


class DroppedNormed(nn.Module):
    """Dropout, then a weight-normed layer (W = g·v/‖v‖: a computation on parameters,
    :mod:`dpml.train.rules.derived`)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(5, 16)
        self.drop = nn.Dropout(0.5)
        self.outer = nn.utils.parametrizations.weight_norm(nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.drop(torch.tanh(self.inner(x))))


def test_a_ruled_parameter_that_does_not_fit_is_taken_exactly_with_the_same_dropout_masks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the keep limit the weight norm's parameters go to the exact path after the first backward pass freed
    its graph: the forward pass runs again from the same random state. The sums and norms equal those of the
    one-batch forward pass's own per-example gradients (the same dropout masks), and the random state after the
    pass is the one a single forward pass leaves (the next draw is the same)."""
    monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 0)
    torch.manual_seed(4)
    model = DroppedNormed().double().train()
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    y, clip = labels(7), 0.05
    torch.manual_seed(6)
    found = clipping.engine_pass(model, per_example_cross_entropy, x, y)
    assert {name for name, reason in found.reasons.items() if "keep limit" in reason} == {
        "outer.parametrizations.weight.original0",
        "outer.parametrizations.weight.original1",
    }
    torch.manual_seed(6)
    sums, norms = clipping.clipped_gradient_sum(model, per_example_cross_entropy, x, y, clip)
    after_engine = torch.rand(3)
    torch.manual_seed(6)
    losses = clipping.per_example_losses(model, per_example_cross_entropy, x, y)
    after_forward = torch.rand(3)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = [torch.autograd.grad(losses[i], list(params.values()), retain_graph=True) for i in range(7)]
    reference_norms = torch.stack([torch.sqrt(sum((g * g).sum() for g in row)) for row in rows])
    factors = clipping.clip_factors(reference_norms, clip)
    torch.testing.assert_close(norms, reference_norms, rtol=1e-10, atol=1e-12)
    for k, name in enumerate(params):
        expected = sum(factors[i] * rows[i][k] for i in range(7))
        torch.testing.assert_close(sums[name], expected, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(after_engine, after_forward, rtol=0, atol=0)


def test_an_output_two_recorded_calls_read_is_one_target() -> None:
    """A recurrent layer's input terms x̃ are read by their product's rule and by the scan's: one slot, its δ asked
    once and counted once among the numbers the pass holds (the keep budget's base), not twice."""
    from dpml.train.released import Targets
    from dpml.train.streamed import Stream

    weight = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(5, 4, dtype=torch.float64)
    z = x @ weight.t()
    other = torch.tanh(z)
    targets = Targets()
    first, second, third = targets.slot(z, z), targets.slot(z, z), targets.slot(other, other)
    assert first == second and first.place != third.place
    assert targets.numbers() == 2 * z.numel()
    deltas = Stream(targets.edges, [], lambda g, d: None, {first.place}).run((other * other).sum(1), False)
    assert len(deltas) == 2
    expected = 2 * other.detach() * (1 - other.detach() ** 2)
    torch.testing.assert_close(deltas[first.place], expected)
