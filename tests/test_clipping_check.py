"""The pre-flight clipping probe on modules nobody here wrote: weights used outside their layer's forward,
parametrized weights, recurrent layers, batch-mixing modules (dpml.train.clipping_check)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

from dpml.train.clipping import clipped_gradient_sum
from dpml.train.clipping_check import ClippingUnsupported, plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy, train_dpsgd


def loop_clipped_sum(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float, seed: int | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Reference: ∂ℓ_i/∂θ by one autograd call per example of one batched forward pass, clipped and added
    (``seed``: the random state of that forward pass, for dropout)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if seed is not None:
        torch.manual_seed(seed)
    losses = per_example_cross_entropy(model(x), y)
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    norms = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(losses[i], list(params.values()), retain_graph=True, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values(), strict=True)]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        norms.append(norm)
        for n, g in zip(params, grads, strict=True):
            total[n] += min(1.0, clip / (float(norm) + 1e-6)) * g
    return total, torch.stack(norms).detach()


def relative_error(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max(float((found[n] - expected[n]).norm() / expected[n].norm()) for n in expected)


class TiedByMatmul(nn.Module):
    """Output layer tied to the embedding through ``h @ emb.weight.T`` (no module call)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(9, 6)
        self.hidden = nn.Linear(6, 6)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.hidden(self.emb(tokens).mean(1))) @ self.emb.weight.T


class FunctionalReuse(nn.Module):
    """``F.linear(x, self.a.weight)`` beside ``self.a(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.a(x)) + F.linear(x, self.a.weight))


def tokens(shape: tuple[int, ...], vocabulary: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocabulary, shape, generator=torch.Generator().manual_seed(seed))


def labels(n: int, classes: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", ["matmul", "functional"])
def test_a_weight_used_outside_its_layer_is_covered_by_the_rules_of_its_operations(case: str) -> None:
    """The layer's hook alone would miss the second use; the operations' rules see both (cross terms
    included), so the engine is exact without a plan, and the plan sends nothing to the exact path."""
    torch.manual_seed(1)
    if case == "matmul":
        model, x, y, shape, dtype = TiedByMatmul().double(), tokens((12, 5), 9, 0), labels(12, 9), (5,), torch.long
    else:
        model, shape, dtype = FunctionalReuse().double(), (6,), torch.float32
        x, y = torch.randn(12, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64), labels(12, 3)
    reference, norms = loop_clipped_sum(model, x, y, 0.5)
    unplanned, found_norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.5)
    assert relative_error(unplanned, reference) < 1e-10
    torch.testing.assert_close(found_norms, norms, rtol=1e-10, atol=0)
    plan = plan_clipping(model, per_example_cross_entropy, shape, dtype)
    assert plan.exact_parameters == () and plan.exact == frozenset()


class HiddenReuse(nn.Module):
    """``x @ self.a.weight.t()`` computed with torch's function handling off, as a library's own fast path may run it
    (a custom autograd Function with the weight among its operands is seen: ``tests/test_custom_functions.py``): no
    torch function call shows this use of the weight, beside ``self.a(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch._C.DisableTorchFunction():
            hidden = x @ self.a.weight.t()
        return self.out(torch.tanh(self.a(x)) + hidden)


def test_a_weight_used_where_no_operation_is_seen_is_found_by_the_probe_and_taken_exactly() -> None:
    torch.manual_seed(1)
    model = HiddenReuse().double()
    x, y = torch.randn(12, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64), labels(12, 3)
    reference, norms = loop_clipped_sum(model, x, y, 0.5)
    unplanned, _ = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.5)
    assert relative_error(unplanned, reference) > 0.05  # the rules alone are wrong: the probe has work to do
    plan = plan_clipping(model, per_example_cross_entropy, (6,))
    assert any(re.search(r"model layer 'a' \(Linear\): its shortcut is [\d.]+% off", note) for note in plan.notes), (
        plan.notes
    )
    assert "a.weight" in plan.exact and "a.weight" in plan.exact_parameters
    sums, found_norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.5, exact=plan.exact)
    assert relative_error(sums, reference) < 1e-10
    torch.testing.assert_close(found_norms, norms, rtol=1e-10, atol=0)


class Parametrized(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        wrap = {
            "weight_norm": parametrizations.weight_norm,
            "spectral_norm": parametrizations.spectral_norm,
            "orthogonal": parametrizations.orthogonal,
        }[kind]
        self.a = wrap(nn.Linear(6, 6))
        self.norm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.tanh(self.a(x))))


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "orthogonal"])
def test_parametrized_weights_get_the_gradients_of_their_original_parameters(kind: str) -> None:
    torch.manual_seed(2)
    model = Parametrized(kind).double()
    plan = plan_clipping(model, per_example_cross_entropy, (6,))
    originals = [n for n, _ in model.named_parameters() if ".original" in n]
    # the weight is computed from its originals by parameter-only operations: their Jacobian carries the
    # linear rule's per-example gradients back to the originals, so nothing takes the exact path
    assert originals and not set(originals) & set(plan.exact_parameters), plan.exact_parameters
    x = torch.randn(10, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    state = {n: b.clone() for n, b in model.named_buffers()}
    sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, labels(10, 3), 0.3, exact=plan.exact)
    with torch.no_grad():  # the reference's forward pass starts from the same power-iteration state
        for n, b in model.named_buffers():
            b.copy_(state[n])
    reference, reference_norms = loop_clipped_sum(model, x, labels(10, 3), 0.3)
    assert set(sums) == set(reference)
    assert relative_error(sums, reference) < 1e-10
    torch.testing.assert_close(norms, reference_norms, rtol=1e-10, atol=0)


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.Module], layers: int, bidirectional: bool) -> None:
        super().__init__()
        self.rnn = cell(5, 4, num_layers=layers, batch_first=True, bidirectional=bidirectional)
        self.out = nn.Linear(8 if bidirectional else 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize(
    "cell,layers,bidirectional", [(nn.GRU, 1, False), (nn.LSTM, 2, False), (nn.RNN, 1, True), (nn.GRU, 2, True)]
)
def test_recurrent_layers_get_exact_per_example_gradients(
    cell: type[nn.Module], layers: int, bidirectional: bool
) -> None:
    torch.manual_seed(3)
    model = Recurrent(cell, layers, bidirectional).double()
    plan = plan_clipping(model, per_example_cross_entropy, (7, 5))
    # the fused kernels run unrolled into operations with rules (dpml.train.rules.recurrent): no exact path
    assert plan.exact_parameters == () and plan.fast_layers == ("out",)
    assert any(n.startswith("rnn.weight_hh") for n in plan.rule_parameters), plan.rule_parameters
    x = torch.randn(9, 7, 5, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, labels(9, 3), 0.2, exact=plan.exact)
    reference, reference_norms = loop_clipped_sum(model, x, labels(9, 3), 0.2)
    assert relative_error(sums, reference) < 1e-10
    torch.testing.assert_close(norms, reference_norms, rtol=1e-10, atol=0)


class CentredOnTheBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x - x.mean(0))


def test_a_model_that_mixes_the_examples_of_a_batch_is_refused_before_any_step() -> None:
    torch.manual_seed(4)
    model = CentredOnTheBatch()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(50, 6), labels(50, 3)
    with pytest.raises(
        ClippingUnsupported, match=r"replacing example 0 of a probe batch changed the loss of example \d"
    ):
        train_dpsgd(
            model,
            x,
            y,
            sample_rate=0.2,
            epochs=1,
            clip_norm=1.0,
            noise_multiplier=1.0,
            neighbouring="add_remove",
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            seed=0,
        )
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class NotFinite(nn.Module):
    """A forward pass that is nan for every input (a softmax over a row masked out entirely), or whose gradient alone
    is (the square root of zero times the output)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.a = nn.Linear(6, 3)
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.where == "loss":
            return torch.softmax(h.masked_fill(torch.ones_like(h, dtype=torch.bool), float("-inf")), 1) + h
        return h + torch.sqrt(h * 0.0)  # sqrt(0) = 0, its derivative infinite: inf · 0 = nan


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_a_model_whose_probe_loss_or_gradient_is_not_finite_is_refused_before_any_step(where: str) -> None:
    """nan compares neither equal nor different: a check that let it through would judge nothing."""
    torch.manual_seed(5)
    with pytest.raises(ClippingUnsupported, match=r"not finite \(nan or inf\)"):
        plan_clipping(NotFinite(where), per_example_cross_entropy, (6,))


def test_batch_norm_is_refused_naming_the_layer() -> None:
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    with pytest.raises(ValueError, match=r"model layer '1' \(BatchNorm1d\): .*use nn.GroupNorm or nn.LayerNorm"):
        plan_clipping(model, per_example_cross_entropy, (6,))


class RunningAverage(nn.Module):
    """A user's module that keeps a running average of its inputs in a buffer (data, released unnoised)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 3)
        self.register_buffer("seen_mean", torch.zeros(6))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.seen_mean.mul_(0.9).add_(0.1 * x.mean(0))
        self.calls += 1
        return self.a(x)


class CountsCalls(RunningAverage):
    """Only a counter written in the forward pass: nothing about the examples."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.a(x)


@pytest.mark.parametrize("case", ["instance-norm", "own-average"])
def test_a_buffer_written_from_the_examples_is_refused_before_any_step(case: str) -> None:
    """Such a buffer would be released with the model without noise (the per-example outputs stay independent)."""
    torch.manual_seed(5)
    if case == "instance-norm":
        model: nn.Module = nn.Sequential(
            nn.Unflatten(1, (2, 3, 3)),
            nn.Conv2d(2, 4, 2),
            nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
            nn.Flatten(),
            nn.Linear(16, 3),
        )
        shape, buffer = (18,), r"'2\.running_mean'"
    else:
        model, shape, buffer = RunningAverage(), (6,), "'seen_mean'"
    x, y = torch.randn(40, *shape), labels(40, 3)
    before = {n: b.clone() for n, b in model.state_dict().items()}
    with pytest.raises(
        ClippingUnsupported,
        match=rf"model buffer {buffer}: the training-mode forward pass writes the "
        "examples into it .* without noise",
    ):
        train_dpsgd(
            model,
            x,
            y,
            sample_rate=0.2,
            epochs=1,
            clip_norm=1.0,
            noise_multiplier=1.0,
            neighbouring="add_remove",
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            seed=0,
        )
    assert all(torch.equal(before[n], b) for n, b in model.state_dict().items())  # not one step taken


@pytest.mark.parametrize("case", ["counter", "instance-norm-without-statistics", "spectral-norm"])
def test_buffers_written_without_the_examples_pass(case: str) -> None:
    if case == "counter":
        model: nn.Module = CountsCalls()
        shape: tuple[int, ...] = (6,)
    elif case == "spectral-norm":
        model, shape = nn.Sequential(parametrizations.spectral_norm(nn.Linear(6, 5)), nn.ReLU(), nn.Linear(5, 3)), (6,)
    else:
        model, shape = (
            nn.Sequential(
                nn.Unflatten(1, (2, 3, 3)),
                nn.Conv2d(2, 4, 2),
                nn.InstanceNorm2d(4, affine=True),
                nn.Flatten(),
                nn.Linear(16, 3),
            ),
            (18,),
        )
    assert list(model.buffers()) or case == "instance-norm-without-statistics"
    plan_clipping(model, per_example_cross_entropy, shape)


class Crashes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 3)
        self.table: dict[int, int] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.table[x.shape[0]]


def test_a_module_that_fails_is_named_in_one_line_not_a_bare_key_error() -> None:
    with pytest.raises(
        ClippingUnsupported, match=r"^model: the forward pass failed on a synthetic probe batch: KeyError: 6$"
    ):
        plan_clipping(Crashes(), per_example_cross_entropy, (6,))


def test_a_loss_without_one_value_per_example_is_refused() -> None:
    def mean_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y)

    with pytest.raises(ValueError, match=r"one loss per example, shape \(6,\); got shape \(\)"):
        plan_clipping(nn.Linear(6, 3), mean_loss, (6,))


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.drop = nn.Dropout(0.3)
        self.b = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(F.relu(self.a(x), inplace=True)))


def test_dropout_and_in_place_activations_keep_the_shortcuts_and_the_random_state() -> None:
    model = DropoutNet()
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    plan = plan_clipping(model, per_example_cross_entropy, (6,))
    assert torch.equal(torch.rand(3), expected)  # the probe left the global random state alone
    assert plan.exact == frozenset() and plan.exact_parameters == () and set(plan.fast_layers) == {"a", "b"}


@pytest.mark.parametrize("model,exact", [(TiedByMatmul, 0), (HiddenReuse, 2)])
def test_training_takes_the_planned_exact_path(model: type[nn.Module], exact: int) -> None:
    """A tied embedding is covered by its operations' rules; a weight used where no operation is seen is found by
    the probe and taken exactly, with its layer's bias (a.weight, a.bias)."""
    torch.manual_seed(5)
    built = model()
    x = (
        tokens((80, 5), 9, 6)
        if model is TiedByMatmul
        else torch.randn(80, 6, generator=torch.Generator().manual_seed(6))
    )
    y = labels(80, 9 if model is TiedByMatmul else 3)
    result = train_dpsgd(
        built,
        x,
        y,
        sample_rate=0.25,
        epochs=1,
        clip_norm=1.0,
        noise_multiplier=1.0,
        neighbouring="add_remove",
        optimizer=torch.optim.SGD(built.parameters(), lr=0.1),
        seed=0,
    )
    assert result.history["exact_clipping_parameters"] == exact


def test_frozen_parameters_get_neither_gradient_nor_noise() -> None:
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    x, y = torch.randn(60, 6), labels(60, 3)
    train_dpsgd(
        model,
        x,
        y,
        sample_rate=0.3,
        epochs=2,
        clip_norm=1.0,
        noise_multiplier=2.0,
        neighbouring="add_remove",
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        seed=1,
    )
    assert torch.equal(model[0].weight, frozen)


class KeepsItsStates(nn.Module):
    """A recurrent block that keeps its last states on itself in ``forward`` (as RecurrentGemma's caches do): after a
    forward pass with gradients they are tensors with a graph attached, which ``copy.deepcopy`` refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(4, 5)
        self.out = nn.Linear(5, 3)
        self.last: torch.Tensor | None = None
        self.cache: dict[str, list[torch.Tensor]] = {"states": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], 5)
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
            self.cache["states"] = [*self.cache["states"][-1:], h]
        self.last = h
        return self.out(h)


def test_a_model_holding_tensors_with_a_graph_after_a_forward_pass_is_planned_and_left_as_it_was() -> None:
    torch.manual_seed(0)
    model = KeepsItsStates()
    x, y = torch.randn(6, 3, 4), labels(6, 3)
    per_example_cross_entropy(model(x), y).sum()  # a forward pass of the user's, with gradients
    kept, cache = model.last, model.cache["states"]
    assert kept is not None and kept.grad_fn is not None
    plan = plan_clipping(model, per_example_cross_entropy, (3, 4), torch.float32)
    assert plan.exact_parameters == ()
    assert model.last is kept and model.cache["states"] is cache  # the model itself untouched


class Float32Logits(nn.Module):
    """Parameters in float64, logits returned in float32 (transformers' Mamba models cast theirs with ``.float()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(8, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x))).float()


def test_a_model_whose_logits_are_in_another_dtype_than_its_parameters_is_planned() -> None:
    """The probe's clip factors are in the parameters' dtype, as the engine's: the clipped sums of a float64 model
    whose loss comes in float32 are checked, not refused for a dtype clash."""
    torch.manual_seed(0)
    model = Float32Logits().double()
    plan = plan_clipping(model, per_example_cross_entropy, (8,), torch.float64)
    assert plan.exact_parameters == ()
