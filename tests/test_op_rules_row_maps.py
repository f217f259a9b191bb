"""Weights computed from one parameter row by row — weight standardisation written by hand in its usual spellings, row
normalisation, centring — and BiT's batch-norm standardisation clip like a float64 per-example loop without the
generic pull-back's B × |W| per-example gradients: read off the operations (:mod:`dpml.train.rules.row_affine`), or,
for operations the reading does not list, fitted from vector-Jacobian products and checked
(:mod:`dpml.train.rules.row_jacobian`). A map that is not row by row is left to the generic pull-back, still exact.
Every form is run through each way to a convolution's kernel gradients: factored, formed and kept, formed in slices
of two examples."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from test_op_rules import assert_exact_without_the_exact_path, generator
from test_op_rules_convolutions import in_twos
from test_op_rules_writes import Standardised as BatchNormStandardised
from test_op_rules_writes import StandardisedConvolutions
from torch import nn

from dpml.train import clipping
from dpml.train.dpsgd import per_example_cross_entropy
from dpml.train.rules import combine, convolution, convolution_nd, derived, row_jacobian
from dpml.train.rules.row_affine import broadcast


def _rows(w: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(1, w.dim()))


def _means_of_means(w: torch.Tensor) -> torch.Tensor:
    """Qiao et al.'s code: the mean one dimension at a time, then the standard deviation of the flattened rows."""
    mean = w
    for d in _rows(w):
        mean = mean.mean(dim=d, keepdim=True)
    w = w - mean
    std = w.view(w.size(0), -1).std(dim=1).view(-1, *[1] * (w.dim() - 1)) + 1e-5
    return w / std.expand_as(w)


def _var_mean(w: torch.Tensor) -> torch.Tensor:
    """BiT's original PyTorch ``StdConv2d``."""
    v, m = torch.var_mean(w, dim=list(_rows(w)), keepdim=True, unbiased=False)
    return (w - m) / torch.sqrt(v + 1e-10)


def _in_place(w: torch.Tensor) -> torch.Tensor:
    spread = w.std(dim=_rows(w), keepdim=True, correction=0) + 1e-6
    w = w - w.mean(dim=_rows(w), keepdim=True)
    w /= spread
    return w


def _centred_view(w: torch.Tensor) -> torch.Tensor:
    """The centred rows through a view of them flattened and back (the same numbers, another tensor)."""
    centred = w - w.mean(_rows(w), keepdim=True)
    return centred.view(w.shape[0], -1).view(w.shape)


FORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "std + eps": lambda w: (w - w.mean(_rows(w), keepdim=True)) / (w.std(_rows(w), keepdim=True) + 1e-5),
    "rsqrt of the biased variance": lambda w: (
        (w - w.mean(dim=_rows(w), keepdim=True)) * torch.rsqrt(w.var(dim=_rows(w), keepdim=True, unbiased=False) + 1e-4)
    ),
    "means of means": _means_of_means,
    "var_mean": _var_mean,
    "in place": _in_place,
    "sub with alpha, clamped": lambda w: (
        torch.sub(w, w.sum(_rows(w), keepdim=True), alpha=1 / w[0].numel())
        / w.std(_rows(w), keepdim=True, correction=2).clamp_min(1e-6)
    ),
    "scaled row norm": lambda w: 2.0 * w / torch.linalg.vector_norm(w, dim=_rows(w), keepdim=True),
    "torch.norm of the flat rows": lambda w: w / w.flatten(1).norm(dim=1).view(-1, *[1] * (w.dim() - 1)),
    "centred": lambda w: w - w.mean(_rows(w), keepdim=True),
    "shifted, then var_mean": lambda w: _var_mean(w + 0.5),
    "a view of the centred rows": lambda w: _centred_view(w) / w.std(_rows(w), keepdim=True),
}


class HandStandardised(nn.Module):
    """A 3×3 convolution, a 1-D one over the image's rows and a linear map, each weight computed by ``form`` before
    its use (the convolutions through ``F.conv2d`` / ``F.conv1d``, the map through ``F.linear``)."""

    def __init__(self, form: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.form = form
        self.square = nn.Parameter(torch.randn(6, 3, 3, 3) + 0.3)
        self.line = nn.Parameter(torch.randn(4, 6, 3))
        self.linear = nn.Parameter(torch.randn(3, 4) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 5, 5)
        h = torch.tanh(F.conv2d(x, self.form(self.square), padding=1))
        h = torch.tanh(F.conv1d(h.mean(3), self.form(self.line), padding=1))  # (B, 4, 5)
        return F.linear(h.mean(2), self.form(self.linear))


WAYS = ["factored", "kept", "sliced"]


def _by_way(monkeypatch: pytest.MonkeyPatch, way: str) -> None:
    """The convolutions' kernel gradients factored (ghost norms), or formed by torch's kernels and kept, or formed
    two examples at a time (a keep limit of 40 numbers) with the clipped sum from the clip-weighted weight gradient."""
    monkeypatch.setattr(convolution_nd, "materialise", lambda *args: way != "factored")
    if way == "sliced":
        monkeypatch.setattr("dpml.train.keep_budget.KEEP_PER_EXAMPLE_LIMIT", 40)
        monkeypatch.setattr(combine, "heap_sized_slices", lambda count, each, device: in_twos(count))


def _taken(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the parameters the row maps take, pass after pass (filled as the engine runs)."""
    taken: set[str] = set()
    original = clipping.row_map_pieces

    def spy(nodes, uses, ruled, params, already=()):  # type: ignore[no-untyped-def]
        found = original(nodes, uses, ruled, params, already)
        taken.update(ruled[key] for key in found)
        return found

    monkeypatch.setattr(clipping, "row_map_pieces", spy)
    return taken


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(31)
    return torch.randn(8, 3, 5, 5, generator=generator(7), dtype=torch.float64), torch.randint(0, 3, (8,))


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("form", list(FORMS))
def test_hand_written_standardisation_is_read_off_its_operations(
    monkeypatch: pytest.MonkeyPatch, form: str, way: str
) -> None:
    """Each spelling is read as each row's affine map of itself: no probe, no generic pull-back, the loop's numbers."""
    _by_way(monkeypatch, way)
    taken = _taken(monkeypatch)

    def refused(*args: object) -> None:
        raise AssertionError("the row map was probed or pulled back, not read")

    monkeypatch.setattr(row_jacobian, "fitted_row_map", refused)
    monkeypatch.setattr(derived, "pull_back", refused)
    x, y = _batch()
    assert_exact_without_the_exact_path(HandStandardised(FORMS[form]), per_example_cross_entropy, x, y)
    assert taken == {"square", "line", "linear"}


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("form", [*FORMS, "F.normalize"])
def test_a_row_map_the_reading_does_not_list_is_fitted_and_checked(
    monkeypatch: pytest.MonkeyPatch, form: str, way: str
) -> None:
    """With the reading switched off (and ``F.normalize``, which it does not list), the row map is fitted from four
    vector-Jacobian products of the recorded operations: the same numbers, still without the generic pull-back's
    per-example gradients of the weights."""
    _by_way(monkeypatch, way)
    taken = _taken(monkeypatch)
    monkeypatch.setattr(row_jacobian, "read_row_map", lambda *args: None)
    spelled = FORMS.get(form, lambda w: F.normalize(w.flatten(1), dim=1).view_as(w))
    x, y = _batch()
    assert_exact_without_the_exact_path(HandStandardised(spelled), per_example_cross_entropy, x, y)
    assert taken == {"square", "line", "linear"}


NOT_ROW_BY_ROW: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "the whole weight's norm": lambda w: w / w.norm(),
    "tanh": torch.tanh,
    "each number times its size": lambda w: w * w.abs(),
    "a row flipped, less its mean": lambda w: w.flip(-1) - w.mean(_rows(w), keepdim=True),
    "means over the output channels": lambda w: w - w.mean(0, keepdim=True),
}


@pytest.mark.parametrize("form", list(NOT_ROW_BY_ROW))
def test_a_map_that_is_not_row_by_row_is_left_to_the_generic_pull_back(
    monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """Neither the reading nor the probes' checks take these (a norm over the whole weight passes three of the four
    probes; only the random one shows that it mixes rows): the generic pull-back does, exactly."""
    taken = _taken(monkeypatch)
    x, y = _batch()
    assert_exact_without_the_exact_path(HandStandardised(NOT_ROW_BY_ROW[form]), per_example_cross_entropy, x, y)
    assert taken == set()


class SharedSteps(nn.Module):
    """A weight standardised by hand whose steps reach more than its convolution: the standardised weight also
    doubled into a second convolution, or the centred weight used by one of its own, or the raw weight besides."""

    def __init__(self, shared: str) -> None:
        super().__init__()
        self.shared = shared
        self.weight = nn.Parameter(torch.randn(4, 3, 3, 3) + 0.3)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 5, 5)
        centred = self.weight - self.weight.mean(_rows(self.weight), keepdim=True)
        standardised = centred / (self.weight.std(_rows(self.weight), keepdim=True) + 1e-5)
        h = F.conv2d(x, standardised, padding=1)
        other = {"the output": 2 * standardised, "a step": centred, "the weight": 0.5 * self.weight}[self.shared]
        h = torch.tanh(h + F.conv2d(x.flip(3), other, padding=1))
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("shared", ["the output", "a step", "the weight"])
def test_a_standardisation_whose_steps_reach_another_use_is_left_to_the_generic_pull_back(
    monkeypatch: pytest.MonkeyPatch, shared: str
) -> None:
    """The closed form holds for a weight whose one use is the standardised one: where the standardised weight, a
    step on the way or the weight itself reaches another, the generic pull-back takes it, exactly."""
    taken = _taken(monkeypatch)
    x, y = _batch()
    assert_exact_without_the_exact_path(SharedSteps(shared), per_example_cross_entropy, x, y)
    assert taken == set()


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("write", [False, True])
def test_batch_norm_standardisation_takes_every_way_to_the_kernels_gradients(
    monkeypatch: pytest.MonkeyPatch, way: str, write: bool
) -> None:
    """BiT's and NFNet's ``F.batch_norm`` form (a gain that starts at 0, a shift), factored, formed and kept, or in
    slices: the loop's numbers, and neither the generic pull-back nor the row maps."""
    _by_way(monkeypatch, way)
    taken = _taken(monkeypatch)
    x, y = _batch()
    assert_exact_without_the_exact_path(BatchNormStandardised(write), per_example_cross_entropy, x, y)
    assert taken == set()


class GainedStandardised(nn.Module):
    """NFNet's ``ScaledStdConv2d``: ``F.batch_norm`` of the weight with a gain per output channel (some 0, as NFNet
    starts its last ones, one tiny) and no shift, then ``F.conv2d``; the convolution's output written in place or
    not (its own product Ŵ a_t, divided by the gain, is then at hand or not)."""

    def __init__(self, write: bool) -> None:
        super().__init__()
        self.write = write
        self.weight = nn.Parameter(torch.randn(5, 3, 3, 3))
        self.gain = nn.Parameter(torch.tensor([0.0, 1.5, -0.7, 1e-6, 0.0]))
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 5, 5)
        rows = self.weight.reshape(1, 5, -1)
        scaled = F.batch_norm(rows, None, None, self.gain * 27**-0.5, training=True, momentum=0.0, eps=1e-5)
        h = F.conv2d(x, scaled.reshape_as(self.weight), padding=1)
        if self.write:
            h += 0.25
        return self.out(torch.tanh(h).mean((2, 3)))


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("write", [False, True])
def test_a_gained_standardisation_reads_the_convolutions_own_products(
    monkeypatch: pytest.MonkeyPatch, way: str, write: bool
) -> None:
    """Rows whose gain is 0 have no product in the convolution's output: theirs are formed on their own; the others
    are the output divided by the gain (a gain of 1e-6 included). The loop's numbers for the weight and the gain."""
    _by_way(monkeypatch, way)
    x, y = _batch()
    assert_exact_without_the_exact_path(GainedStandardised(write), per_example_cross_entropy, x, y)


class GroupedStandardised(nn.Module):
    """NFNet-F0's grouped ``ScaledStdConv2d`` (``F.batch_norm`` of the weight with a gain per output channel, one 0,
    then ``F.conv2d`` in groups of 2 input channels) and a standardised depthwise kernel without a gain."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.grouped = nn.Parameter(torch.randn(6, 2, 3, 3))
        self.gain = nn.Parameter(torch.tensor([0.0, 1.5, -0.7, 1e-3, 1.0, 0.5]))
        self.depthwise = nn.Parameter(torch.randn(6, 1, 3, 3))
        self.out = nn.Linear(6, 3)

    @staticmethod
    def standardised(w: torch.Tensor, gain: torch.Tensor | None = None) -> torch.Tensor:
        rows = w.reshape(1, w.shape[0], -1)
        return F.batch_norm(rows, None, None, gain, training=True, momentum=0.0, eps=1e-5).reshape_as(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 5, 5)
        h = torch.tanh(self.stem(x))
        h = torch.tanh(F.conv2d(h, self.standardised(self.grouped, self.gain * 18**-0.5), padding=1, groups=2))
        h = torch.tanh(F.conv2d(h, self.standardised(self.depthwise), padding=1, groups=6))
        return self.out(h.mean((2, 3)))


@pytest.mark.parametrize("way", ["kept", "formed", "slots"])
def test_a_grouped_standardisation_is_carried_back_row_by_row(monkeypatch: pytest.MonkeyPatch, way: str) -> None:
    """A grouped convolution's per-example kernel gradients materialised within the keep limit (``kept``), past it
    formed two examples at a time (``formed``) or factored in (group, position) slots (``slots``), carried back
    through the standardisation row by row: the loop's numbers for the weights and the gain, and both weights taken by
    the standardised rule, not the generic pull-back (which took the materialised ones before)."""
    if way != "kept":
        monkeypatch.setattr("dpml.train.keep_budget.KEEP_PER_EXAMPLE_LIMIT", 40)
        monkeypatch.setattr(combine, "heap_sized_slices", lambda count, each, device: in_twos(count))
    monkeypatch.setattr(convolution, "slots_pay", lambda *args: way == "slots")
    formed = {"slots": 0}
    original_slots = convolution.group_slots

    def counted(*args):  # type: ignore[no-untyped-def]
        formed["slots"] += 1
        return original_slots(*args)

    monkeypatch.setattr(convolution, "group_slots", counted)
    taken: set[str] = set()
    original = clipping.standardised_pieces

    def spy(nodes, uses, ruled, params):  # type: ignore[no-untyped-def]
        found = original(nodes, uses, ruled, params)
        taken.update(ruled[key] for key in found)
        return found

    monkeypatch.setattr(clipping, "standardised_pieces", spy)
    x, y = _batch()
    assert_exact_without_the_exact_path(GroupedStandardised(), per_example_cross_entropy, x, y)
    assert taken == {"grouped", "depthwise"}
    assert (formed["slots"] > 0) == (way == "slots")


def test_grouped_kernels_in_slots_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every grouped kernel factored in slots: a grouped 2-D one with a stride, a depthwise one with a bias and a
    depthwise ``F.conv1d`` (their own parameters, no standardisation), the loop's numbers."""
    slotted: list[int] = []
    original = convolution.group_slots
    monkeypatch.setattr(convolution, "beyond_keep_limit", lambda *args: "past it")
    monkeypatch.setattr(convolution, "slots_pay", lambda *args: True)
    monkeypatch.setattr(convolution, "group_slots", lambda *args: slotted.append(1) or original(*args))
    torch.manual_seed(4)
    x = torch.randn(5, 3, 9, 9, generator=generator(23), dtype=torch.float64)
    assert_exact_without_the_exact_path(
        StandardisedConvolutions(), per_example_cross_entropy, x, torch.randint(0, 3, (5,))
    )
    assert len(slotted) >= 3


def test_slots_pay_where_few_positions_meet_few_groups() -> None:
    """NFNet-F0's 768-channel 3×3 kernels in 6 groups at batch 64: factored in slots on its 2×2 and 1×1 maps, formed on
    8×8 ones (g·T = 384 slots: six weight gradients' worth of clipped sum), and a depthwise kernel never (C slots)."""
    kernel = torch.empty(768, 128, 3, 3)
    assert convolution.slots_pay(64, 4, kernel, 6) and convolution.slots_pay(64, 1, kernel, 6)
    assert not convolution.slots_pay(64, 64, kernel, 6)
    assert not convolution.slots_pay(64, 4, torch.empty(768, 1, 3, 3), 768)


class WrittenAfterUse(nn.Module):
    """a = 2w, read by tanh (which keeps its output, not a: PyTorch's own backward is fine), then a written in place
    and used: tanh's Jacobian must come from a as it was when read."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4)
        a = self.weight * 2
        bent = torch.tanh(a)
        a.mul_(0.5)
        return F.linear(x, bent) + F.linear(x.square(), a)


def test_a_computation_run_again_before_its_operand_is_written_in_place() -> None:
    """The generic pull-back runs each computation again on copies of its operands when it needs its Jacobian; one
    whose operand an in-place write is about to change runs first. Otherwise tanh's copy of a would hold a / 2, its
    numbers would differ from the recorded ones, and the weight would take the exact path."""
    torch.manual_seed(5)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    assert_exact_without_the_exact_path(WrittenAfterUse(), per_example_cross_entropy, x, y)


def test_the_reading_checks_each_rows_numbers_not_only_their_moments() -> None:
    """A row's numbers permuted keep its mean and variance: the reading's value check compares a sample of rows number
    by number too, so a permutation is not taken for the row itself; an affine map of the rows is, with its shift."""
    from dpml.train.rules.row_affine import _Reader

    weight = nn.Parameter(torch.randn(16, 9, dtype=torch.float64))
    reader = _Reader(weight, 16)
    ones = torch.ones(16, dtype=torch.float64)
    assert reader._offsets(weight.detach().flip(1), ones) is None
    shifts = torch.linspace(-1, 1, 16, dtype=torch.float64)
    found = reader._offsets(2.5 * weight.detach() + shifts[:, None], 2.5 * ones)
    assert found is not None
    torch.testing.assert_close(found, shifts)
    assert reader._offsets(2.5 * weight.detach() + shifts[:, None], 2.4 * ones) is None  # (the variance differs)


class ConstantWrittenAfterUse(nn.Module):
    """w + s for a constant s (one shift per row; the sum keeps no operand for its backward, so PyTorch's own backward
    allows the write), bent by tanh (the generic pull-back's), then s written in place — by torch (``add_``: the
    recorder sees it) or, with ``unseen``, through NumPy's view of its memory (nothing does)."""

    def __init__(self, unseen: bool) -> None:
        super().__init__()
        self.unseen = unseen
        self.weight = nn.Parameter(torch.randn(3, 4, dtype=torch.float64) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 4)
        shift = torch.full((3, 1), 0.5, dtype=torch.float64)
        bent = torch.tanh(self.weight + shift)
        if self.unseen:
            shift.numpy()[:] = -0.25
        else:
            shift.add_(-0.75)
        return F.linear(x, bent) + F.linear(x.square(), self.weight + shift)


def test_a_constant_written_in_place_after_its_use_is_read_as_it_was() -> None:
    """The write is seen: the computation that read the constant runs again first, with the numbers it read."""
    torch.manual_seed(5)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    assert_exact_without_the_exact_path(ConstantWrittenAfterUse(unseen=False), per_example_cross_entropy, x, y)


def test_a_computation_that_gives_other_numbers_when_run_again_takes_the_exact_path_named() -> None:
    """A write no torch operation makes (NumPy's view of the constant) is not seen: run again when its Jacobian is
    needed, the computation gives other numbers, so the weight takes the exact path, and the reason says why — the
    numbers are still the loop's."""
    from test_op_rules import assert_clipped_like_the_loop

    from dpml.train.clipping import engine_pass

    torch.manual_seed(5)
    model = ConstantWrittenAfterUse(unseen=True)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    found = engine_pass(model, per_example_cross_entropy, x, y)
    assert list(found.exact) == ["weight"]
    assert "gives other numbers when run again" in found.reasons["weight"], found.reasons
    assert_clipped_like_the_loop(model, x, y)


def test_the_readers_broadcast_is_torchs() -> None:
    """The reader's own broadcast of shapes (torch's costs 60 µs a call) gives ``torch.broadcast_shapes``' shape, or
    None where torch refuses, for 5,000 random sets of one to three shapes of up to four sizes among 0, 1, 2 and 3."""
    draw = random.Random(4)
    refused = 0
    for _ in range(5000):
        shapes = [torch.Size(draw.choices((0, 1, 2, 3), k=draw.randint(0, 4))) for _ in range(draw.randint(1, 3))]
        try:
            expected: torch.Size | None = torch.broadcast_shapes(*shapes)
        except RuntimeError:
            expected, refused = None, refused + 1
        assert broadcast(*shapes) == expected, shapes
    assert 500 < refused < 4500  # (both answers met often)


class SparseDelta(nn.Module):
    """A frozen weight plus a few trained entries scattered into it by ``torch.sparse_coo_tensor`` (peft's SHiRA
    writes its adapter so): a sparse tensor computed from a parameter, added to the weight (``added``), or that sum
    computed on further before its use (scaled)."""

    def __init__(self, added: bool) -> None:
        super().__init__()
        self.register_buffer("base", torch.randn(3, 4, generator=generator(7), dtype=torch.float64))
        self.register_buffer("where", torch.tensor([[0, 1, 2, 2], [3, 0, 1, 3]]))
        self.values = nn.Parameter(torch.randn(4, generator=generator(8), dtype=torch.float64))
        self.added = added

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = torch.sparse_coo_tensor(self.where, self.values, (3, 4))
        if self.added:
            return F.linear(x, self.base + delta)
        return F.linear(x, (self.base + delta) * 2.0)


@pytest.mark.parametrize("added", [True, False], ids=["added to a weight", "then scaled"])
def test_a_weight_built_as_a_sparse_tensor_is_exact_and_named_where_it_takes_the_exact_path(added: bool) -> None:
    """Added to a constant weight, the sparse tensor's values are clipped by their entries' rule
    (:mod:`dpml.train.rules.scattered_rows`). Used any other way, the pull-back cannot compare or differentiate a
    sparse output (``torch.equal`` has no sparse kernel: the probe failed on it): the parameter takes the exact path
    with the reason, not a crash. The numbers are the loop's either way."""
    from test_op_rules import assert_clipped_like_the_loop

    from dpml.train.clipping import engine_pass

    torch.manual_seed(5)
    model = SparseDelta(added)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    found = engine_pass(model, per_example_cross_entropy, x, y)
    if added:
        assert found.exact == {}, found.reasons
    else:
        assert list(found.exact) == ["values"], found.reasons
        assert "is a torch.sparse_coo tensor, whose Jacobian the pull-back does not form" in found.reasons["values"]
    assert_clipped_like_the_loop(model, x, y, exact=set(found.exact))
