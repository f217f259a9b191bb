"""The index maps' checks (:mod:`dpml.train.rules.registry`: ``same_along``, ``injective``, ``disjoint``,
``rows_within``) read no
value where an index is a view of a flat index, and must then give exactly what comparing the values gives; on any
other index they compare values. Checked against the values on views made the ways the recorder makes them."""

from __future__ import annotations

import gc
import itertools
import random
import weakref

import pytest
import torch
from torch import nn

from dpml.train.clipping import engine_pass
from dpml.train.dpsgd import per_example_cross_entropy
from dpml.train.rules import flat_indices, registry
from dpml.train.rules.flat_indices import disjoint, injective, rows_within, same_along
from dpml.train.rules.registry import Tracked


def flat_index(*shape: int) -> torch.Tensor:
    return Tracked(nn.Parameter(torch.zeros(shape))).flat_index()


def random_view(index: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """A chain of up to four of the view operations a model applies to a parameter."""
    for _ in range(rng.randint(0, 4)):
        choice = rng.choice(["t", "chunk", "narrow", "select", "expand", "unsqueeze", "flatten", "permute", "strided"])
        if index.dim() == 0:
            break
        dim = rng.randrange(index.dim())
        if choice == "t" and index.dim() == 2:
            index = index.t()
        elif choice == "chunk" and index.shape[dim] >= 2:
            index = index.chunk(2, dim)[rng.randrange(2)]
        elif choice == "narrow" and index.shape[dim] >= 2:
            start = rng.randrange(index.shape[dim] - 1)
            index = index.narrow(dim, start, rng.randint(1, index.shape[dim] - start))
        elif choice == "select" and index.dim() > 1:
            index = index.select(dim, rng.randrange(index.shape[dim]))
        elif choice == "expand":
            index = index.unsqueeze(0).expand(rng.randint(1, 3), *index.shape)
        elif choice == "unsqueeze":
            index = index.unsqueeze(dim)
        elif choice == "flatten" and index.is_contiguous():
            index = index.flatten()
        elif choice == "permute":
            order = list(range(index.dim()))
            rng.shuffle(order)
            index = index.permute(*order)
        elif choice == "strided" and index.is_contiguous() and index.numel() >= 4:
            index = index.flatten().as_strided((2, 3), (1, 1))  # overlapping windows: the values must decide
    return index


def by_values_same_along(index: torch.Tensor, dim: int) -> bool:
    return index.numel() == 0 or torch.equal(index, index.narrow(dim, 0, 1).expand_as(index))


def by_values_injective(index: torch.Tensor) -> bool:
    return torch.unique(index).numel() == index.numel()


def test_the_checks_of_views_of_a_flat_index_equal_the_checks_of_their_values() -> None:
    rng = random.Random(7)
    for trial in range(600):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        base = flat_index(*shape)
        views = [random_view(base, rng) for _ in range(3)]
        for index in views:
            for dim in range(index.dim()):
                assert same_along(index, dim) == by_values_same_along(index, dim), (trial, index)
            assert injective(index) == by_values_injective(index), (trial, index)
        if all(by_values_injective(index) for index in views):
            everything = torch.cat([index.reshape(-1) for index in views])
            assert disjoint(views) == by_values_injective(everything), (trial, views)


def by_values_rows_within(index: torch.Tensor, width: int) -> bool:
    starts = torch.arange(index.shape[0]).view(-1, *[1] * (index.dim() - 1)) * width
    return bool(((index >= starts) & (index < starts + width)).all())


def test_whether_each_row_reads_its_own_row_is_told_from_a_views_geometry_as_from_its_values() -> None:
    """A per-row value (C numbers, or C rows of w) broadcast, sliced or moved: each slice of the view's first dimension
    must read its own row's numbers alone; the geometry's answer equals the values' for every width that divides."""
    rng = random.Random(11)
    seen = {True: 0, False: 0}
    for trial in range(800):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        index = random_view(flat_index(*shape), rng)
        if index.dim() == 0 or index.numel() == 0:
            continue
        for width in range(1, max(2, flat_index(*shape).numel() + 1)):
            expected = by_values_rows_within(index, width)
            assert rows_within(index, width) == expected, (trial, width, index)
            assert rows_within(index.clone(), width) == expected, (trial, width, index)  # (not a view: by values)
            seen[expected] += 1
    assert min(seen.values()) > 100  # (both answers met often)
    per_row = flat_index(5, 1)
    assert rows_within(per_row.expand(5, 7), 1)  # std.expand_as(w)
    assert not rows_within(flat_index(5).view(1, 5).expand(5, 5), 1)  # each row reads every row's value
    assert rows_within(flat_index(4, 6).view(4, 2, 3), 6) and not rows_within(flat_index(4, 6).view(2, 12), 6)


def test_the_flat_indices_of_a_pass_view_one_count_which_goes_with_them() -> None:
    """Each parameter's flat index is a view of one arange per device (outside a recording pass, one each time a
    parameter is the largest so far, not one per parameter), whose elements stay 0, 1, …; it is let go with the last
    index that views it."""
    large, small = flat_index(5, 6, 7), flat_index(3, 4)
    assert small._base is large._base and small._base.numel() >= 5 * 6 * 7
    assert torch.equal(small.reshape(-1), torch.arange(12)) and torch.equal(large.reshape(-1), torch.arange(210))
    larger = flat_index(300)
    assert larger._base is not large._base  # (a larger count; the smaller one stays while its views do)
    written = flat_index(2, 3)
    assert written._base is larger._base
    written[1].fill_(0)  # (no rule writes an index; one written is read by its values from then on)
    assert not injective(written) and not flat_indices.offsets_are_values(larger)
    assert flat_indices.offsets_are_values(large)
    assert flat_index(4)._base is not larger._base
    count = weakref.ref(large._base)
    del small, large
    gc.collect()
    assert count() is None


class ViewedWeights(nn.Module):
    """Weights of growing sizes, each reshaped before its use (as timm's ``StdConv2d`` views its weight): every pass
    indexes a view of each, the smallest first."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(w, w) / w) for w in (4, 8, 16, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.tanh(x @ w.reshape(2, -1).reshape(w.shape).t()[: x.shape[1]])
        return x[:, :3]


def test_a_model_s_next_pass_makes_one_count_as_long_as_its_last_pass_asked_for() -> None:
    """A pass asks for counts as its views are indexed (the smallest weight's first); the model's first pass makes a
    longer count each time a longer one is asked for (each stays alive with its views' indices), every later pass
    one, as long as the longest the last pass asked for, made when first asked for. Outside a pass a count is as
    long as asked."""
    torch.manual_seed(3)
    model, x, y = ViewedWeights(), torch.randn(6, 4), torch.randint(0, 3, (6,))
    seen: list[torch.Tensor] = []
    original = flat_indices.counting

    def counted(count: int, device: torch.device) -> torch.Tensor:
        seen.append(original(count, device))
        return seen[-1]

    passes = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "counting", counted)
        for _ in range(3):
            patch.setattr(flat_indices, "_COUNTING", {})  # (no count left alive by another pass answers here)
            found = engine_pass(model, per_example_cross_entropy, x, y)
            passes.append(([index.numel() for index in seen], {id(index._base): index._base.numel() for index in seen}))
            seen.clear()
            del found
    (asked, first), (again, second), (_, third) = passes
    assert sorted(set(asked)) == sorted(set(again)) and max(asked) == 32 * 32 and min(asked) < 8 * 8
    assert len(first) >= 4  # the first pass: a longer count for each longer weight
    assert list(second.values()) == [32 * 32] and list(third.values()) == [32 * 32]  # then one for the pass
    assert flat_index(3)._base.numel() >= 3


def test_the_chunks_of_a_packed_projection_are_disjoint_and_an_expanded_token_the_same_for_every_example() -> None:
    """The two cases met per step (attention's q, k, v chunks of one weight; ViT's class token expanded over the
    batch), with an index that is not a view of a flat index beside them: the same answers from its values."""
    packed = flat_index(3 * 4, 4)
    q, k, v = packed.chunk(3)
    assert injective(q) and disjoint([q, k, v]) and not disjoint([q, packed[2:6]])
    token = flat_index(1, 1, 8).expand(5, 1, 8)
    assert same_along(token, 0) and not injective(token)
    gathered = flat_index(6, 4)[torch.tensor([2, 2, 2])]  # an embedding row looked up with the same id: not a view
    assert same_along(gathered, 0) and not injective(gathered)
    assert not same_along(flat_index(6, 4)[torch.tensor([1, 2])], 0)
    for a, b in itertools.combinations([q, k, v], 2):
        assert disjoint([a, b])


class PackedProjection(nn.Module):
    """One weight chunked into three matrices, each used on the batch: views of its flat index, every pass."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.packed, self.out = nn.Linear(6, 4), nn.Parameter(torch.randn(3 * 4, 4)), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        q, k, v = self.packed.chunk(3)
        return self.out(h @ q.t() + h @ k.t() + h @ v.t())


def test_the_flat_indices_are_forgotten_with_their_tensors() -> None:
    """Every pass makes flat indices; a run of any length holds only the live ones (a set of every flat index ever
    made would grow with each step of a run)."""
    torch.manual_seed(5)
    model, x, y = PackedProjection(), torch.randn(8, 6), torch.randint(0, 3, (8,))
    found = engine_pass(model, per_example_cross_entropy, x, y)
    assert len(flat_indices._FLAT_INDICES) >= 1  # made, and alive while the pass's pieces are
    del found
    for _ in range(20):
        engine_pass(model, per_example_cross_entropy, x, y)
    gc.collect()
    assert len(flat_indices._FLAT_INDICES) < 3
