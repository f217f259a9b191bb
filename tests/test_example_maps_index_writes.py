"""Rows added (``index_add``) or copied (``index_copy``) back into each token's row by an index from the data — a
mixture of experts' outputs returned to their tokens, as JetMoE's ``zeros.index_add(0, batch_index, expert_outputs)``
— keep their examples (dpml.train.rules.example_maps, ``INDEX_WRITES``): a parameter that meets them alone (a bias
added after) is clipped by its rule, exactly. Where rows of two examples meet in one place, the map is lost and that
parameter takes the exact path: attributing the place to either example would let the other's gradient escape its
clipping."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_op_rules import assert_exact_without_the_exact_path
from torch import nn

from dpml.train.clipping import engine_pass
from dpml.train.dpsgd import per_example_cross_entropy

BATCH, LENGTH, WIDTH, EXPERTS = 6, 5, 4, 3


class RoutedExperts(nn.Module):
    """Each token routed to its top ``k`` experts (by a router's scores), the pairs sorted by expert, each expert's
    rows through its own matrix, and the gated results written back into the rows of their tokens (``into``: zeros
    made for them, or the tokens' own rows), then a bias and a classifier. ``places``: each token's own row, the
    same position of the first example (``fold``: every example's rows meet there), or the row one example on
    (``shift``: into the tokens' own rows, each place then holds two examples' values)."""

    def __init__(self, write: str, into: str = "zeros", k: int = 2, places: str = "own") -> None:
        super().__init__()
        self.write, self.into, self.k, self.places = write, into, k, places
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.Parameter(torch.randn(EXPERTS, WIDTH, WIDTH) / 2)
        self.bias = nn.Parameter(torch.randn(WIDTH))
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, WIDTH)
        batch, length, _ = x.shape
        h = x.reshape(-1, WIDTH)
        gates, chosen = torch.softmax(self.router(h), -1).topk(self.k, -1)
        experts, order = chosen.reshape(-1).sort(stable=True)
        tokens = order // self.k
        rows = (
            torch.cat(
                [
                    F.linear(part, self.experts[e])
                    for e, part in enumerate(h[tokens].split(experts.bincount(minlength=EXPERTS).tolist()))
                ]
            )
            * gates.reshape(-1)[order, None]
        )
        places = {"own": tokens, "fold": tokens % length, "shift": (tokens + length) % (batch * length)}[self.places]
        target = h.new_zeros(h.shape) if self.into == "zeros" else h * 1.0
        if self.write == "index_add":
            mixed = target.index_add(0, places, rows)
        elif self.write == "index_add_":
            mixed = target.index_add_(0, places, rows)
        else:  # index_copy, one expert per token: each place written once
            mixed = torch.index_copy(target, 0, places, rows)
        z = torch.tanh(mixed.view(batch, length, WIDTH) + self.bias)
        return self.out(z.mean(1))


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, LENGTH, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (BATCH,), generator=g)


@pytest.mark.parametrize(
    ("write", "into", "k"),
    [("index_add", "zeros", 2), ("index_add_", "zeros", 2), ("index_add", "tokens", 2), ("index_copy", "zeros", 1)],
)
def test_rows_written_back_to_their_tokens_keep_their_examples(write: str, into: str, k: int) -> None:
    torch.manual_seed(0)
    x, y = batch()
    assert_exact_without_the_exact_path(RoutedExperts(write, into, k), per_example_cross_entropy, x, y)


@pytest.mark.parametrize(("into", "places"), [("zeros", "fold"), ("tokens", "shift"), ("tokens", "fold")])
def test_rows_of_two_examples_written_into_one_place_lose_the_map(into: str, places: str) -> None:
    """A place that holds two examples' values belongs to neither: the bias that meets it has no rule, and takes the
    exact path (such a model mixes its examples, which the probe refuses; the recording must not claim a map)."""
    torch.manual_seed(0)
    x, y = batch()
    found = engine_pass(RoutedExperts("index_add", into, places=places).double(), per_example_cross_entropy, x, y)
    assert "bias" in found.exact, found.reasons


class TimeMajorWrites(nn.Module):
    """Index writes into a time-major (T, B, W) tensor, where each example's places are a column: the map varies
    along the batch's dimension and is alike along the width. ``along``: ``time`` (each example's steps written back
    in reverse: every place keeps its column's example), ``batch`` (the columns swapped round by the index: each
    place one example's, the rows put back in order before the classifier), ``fold`` (the columns of every other
    example added into one of two: each place two examples', the map lost)."""

    def __init__(self, along: str) -> None:
        super().__init__()
        self.along = along
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.bias = nn.Parameter(torch.randn(WIDTH))
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, WIDTH)
        batch, length, _ = x.shape
        h = torch.tanh(self.inner(x)).transpose(0, 1)  # (T, B, WIDTH)
        if self.along == "time":
            written = h.new_zeros(h.shape).index_add(0, torch.arange(length - 1, -1, -1), h)
        elif self.along == "batch":
            order = torch.arange(batch).roll(1)
            written = h.new_zeros(h.shape).index_copy(1, order, h)
        else:
            written = h.new_zeros(length, 2, WIDTH).index_add(1, torch.arange(batch) % 2, h)
        z = torch.tanh(written + self.bias)  # (the bias meets each place once: its rule needs each place's example)
        rows = z.mean(0)
        rows = rows.index_select(0, order) if self.along == "batch" else rows.repeat(batch // len(rows), 1)
        return self.out(rows)


@pytest.mark.parametrize("along", ["time", "batch"])
def test_writes_into_each_examples_column_keep_their_examples(along: str) -> None:
    """The map worked out on one place of each row (the width alike) and broadcast back gives each column's example:
    the bias is clipped by its rule, exactly."""
    torch.manual_seed(0)
    x, y = batch()
    assert_exact_without_the_exact_path(TimeMajorWrites(along), per_example_cross_entropy, x, y)


def test_columns_of_two_examples_added_into_one_lose_the_map() -> None:
    torch.manual_seed(0)
    x, y = batch()
    found = engine_pass(TimeMajorWrites("fold").double(), per_example_cross_entropy, x, y)
    assert "bias" in found.exact, found.reasons
