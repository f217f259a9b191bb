"""A parameter multiplied by a constant that holds one slice per example: XLNet's relative-position table, built from
``torch.arange`` (nothing from the batch), expanded over the batch, dropped out row by row, and projected by each
layer's ``r`` (``einsum("ibh,hnd->ibnd", pos, r)``) before its slices meet each example's queries. No forward map says
whose each slice is; the einsum rule reads the constant's one dimension of the batch's size as the examples' and the
plan's float64 probe judges that reading against autograd. Where it holds (the slices meet one example's rows each),
nothing takes the exact path; where it does not (a table of T rows when T = B, used by every example; slices mixed
along the batch before they meet the queries), the probe sends the parameter to the exact path and the clipped sums
stay the per-example loop's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_op_rules import (
    HuggingFace,
    assert_clipped_like_the_loop,
    assert_exact_without_the_exact_path,
    generator,
    ids_and_mask,
)
from torch import nn

from dpml.train.clipping import engine_pass
from dpml.train.exact_path import PlannedExact
from dpml.train.clipping_check import ClippingUnsupported, plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy


def position_table(length: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """XLNet's sinusoid table of relative positions length … −length + 1, (2T, width), width even; constants alone."""
    positions = torch.arange(length, -length, -1.0, dtype=dtype)
    frequencies = 1 / 10000 ** (torch.arange(0, width, 2.0, dtype=dtype) / width)
    angles = positions[:, None] * frequencies[None, :]
    return torch.cat([angles.sin(), angles.cos()], -1)


class RelativePositions(nn.Module):
    """Two layers of XLNet's position attention, time-major: each layer's queries ``einsum("ibh,hnd->ibnd", x, q)``,
    position keys from the one table both layers share (``mode``: ``per-example``, expanded over the batch and
    dropped out row by row as XLNet does; ``shared``, the table alone, (2T, d), broadcast to every example;
    ``mixed``, as XLNet's but the product summed along the batch before it meets the queries) and scores
    ``ibnd,jbnd->bnij``."""

    def __init__(self, mode: str, width: int = 6, heads: int = 2, size: int = 3, dropout: float = 0.2) -> None:
        super().__init__()
        self.mode, self.dropout = mode, dropout
        self.q = nn.ParameterList([nn.Parameter(torch.randn(width, heads, size) * 0.4) for _ in range(2)])
        self.r = nn.ParameterList([nn.Parameter(torch.randn(width, heads, size) * 0.4) for _ in range(2)])
        self.bias = nn.Parameter(torch.randn(heads, size) * 0.3)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, width)
        h = x.transpose(0, 1)  # (T, B, width)
        length, batch = h.shape[:2]
        table = position_table(length, h.shape[-1], h.dtype)
        if self.mode == "shared" or (self.mode == "shared from 8" and batch >= 8):
            pos: torch.Tensor = table
        else:
            pos = F.dropout(table[:, None, :].expand(-1, batch, -1), p=self.dropout, training=True)
        for q, r in zip(self.q, self.r, strict=True):
            queries = torch.einsum("ibh,hnd->ibnd", h, q)
            if pos.dim() == 2:
                keys = torch.einsum("jh,hnd->jnd", pos, r)
                scores = torch.einsum("ibnd,jnd->bnij", queries + self.bias, keys)
            else:
                keys = torch.einsum("ibh,hnd->ibnd", pos, r)
                if self.mode == "mixed":
                    keys = keys.cumsum(1)  # slice b of the keys: slices 0 … b of the product, met by example b
                scores = torch.einsum("ibnd,jbnd->bnij", queries + self.bias, keys)
            weights = torch.softmax(scores[..., :length] / math.sqrt(q.shape[-1]), dim=-1)  # (B, n, T, T)
            h = h + torch.tanh(torch.einsum("bnij,jbh->ibh", weights, h))
        return self.out(h.mean(0))


def test_a_position_table_expanded_over_the_batch_is_clipped_without_the_exact_path() -> None:
    torch.manual_seed(51)
    x, y = torch.randn(5, 4, 6, generator=generator(51), dtype=torch.float64), torch.randint(0, 3, (5,))
    assert_exact_without_the_exact_path(
        RelativePositions("per-example"), per_example_cross_entropy, x, y, plan_first=True
    )


@pytest.mark.parametrize(("mode", "length", "ruled"), [("shared", 3, True), ("mixed", 2, False)])
def test_a_table_whose_slices_are_not_the_examples_is_never_read_as_the_batch(
    mode: str, length: int, ruled: bool
) -> None:
    """``shared``: a table of 2T = 6 rows at the probe's batch of 6, so that its one dimension of the batch's size is
    not the batch's: the probe finds that reading wrong and plans ``r`` as a weight computed from parameters alone,
    as without the reading; ``mixed``: the product's slices summed along the batch before they meet the queries
    (2T = 4), so that example b's gradient of ``r`` comes from slices 0 … b: the probe finds the reading wrong, and no
    rule takes the product as a weight either: ``r`` is planned exact. No reading is planned, and the engine's
    clipped sums are the loop's. (A constant summed along the batch before the product, by contrast, is read right:
    its slices are still each example's alone.)"""
    torch.manual_seed(52)
    model = RelativePositions(mode, width=4, dropout=0.0).double()
    # ("mixed": each example's keys depend on its place in the batch, which add-remove neighbours refuse)
    plan = plan_clipping(model, per_example_cross_entropy, (length, 4), torch.float64, neighbouring="replace-one")
    assert plan.exact.constant_reads == (), plan.lines()  # type: ignore[attr-defined]
    assert ({"r.0", "r.1"} <= set(plan.rule_parameters)) == ruled, plan.lines()
    assert ({"r.0", "r.1"} <= set(plan.exact_parameters)) != ruled, plan.lines()
    x, y = torch.randn(6, length, 4, generator=generator(52), dtype=torch.float64), torch.randint(0, 3, (6,))
    assert_clipped_like_the_loop(model, x, y, exact=plan.exact)
    if mode == "mixed":
        with pytest.raises(ClippingUnsupported, match=r"removing example 0 of a probe batch changed the loss"):
            plan_clipping(model, per_example_cross_entropy, (length, 4), torch.float64)


def test_a_table_as_long_as_a_training_batch_is_not_read_as_the_batch_unless_the_plan_read_it() -> None:
    """A shared table planned at the probe's batch of 6 (2T = 8: no dimension of the batch's size, so ``r`` is a
    weight computed from parameters alone), then a pass at a batch of 8 = 2T: its one dimension of the batch's size
    is the table's rows, which a pass allowed any reading would take for the batch — wrong sums — and a pass under
    the plan does not."""
    torch.manual_seed(53)
    model = RelativePositions("shared", width=4, dropout=0.0).double()
    plan = plan_clipping(model, per_example_cross_entropy, (4, 4), torch.float64)
    assert plan.exact_parameters == () and plan.exact.constant_reads == (), plan.lines()  # type: ignore[attr-defined]
    x, y = torch.randn(8, 4, 4, generator=generator(53), dtype=torch.float64), torch.randint(0, 3, (8,))
    assert_clipped_like_the_loop(model, x, y, exact=plan.exact)
    found = engine_pass(model, per_example_cross_entropy, x, y, plan.exact)
    assert found.constants_read == {} and found.exact == {}
    misread = engine_pass(model, per_example_cross_entropy, x, y, any_constant_reads=True)
    assert misread.constants_read == {"r.0": 0} and misread.exact == {}  # (r.1 then reads the table's new map)
    with pytest.raises(AssertionError):  # what the plan's gate prevents: the table's rows clipped as examples
        assert_clipped_like_the_loop(model, x, y, exact=PlannedExact((), [("r.0", 0)]))


def test_a_reading_the_probe_confirmed_is_made_along_its_own_dimension_only() -> None:
    """A model that expands its table over the batch below 8 examples (read along dimension 1 on the probe's 6) and
    shares it from 8 on: at a batch of 8 = 2T the table's one dimension of the batch's size is its rows (dimension
    0), which the plan did not confirm, so ``r`` is taken as a weight computed from parameters alone."""
    torch.manual_seed(54)
    model = RelativePositions("shared from 8", width=4, dropout=0.0).double()
    plan = plan_clipping(model, per_example_cross_entropy, (4, 4), torch.float64)
    assert plan.exact.constant_reads == (("r.0", 1),), plan.lines()  # type: ignore[attr-defined]
    x, y = torch.randn(8, 4, 4, generator=generator(54), dtype=torch.float64), torch.randint(0, 3, (8,))
    assert_clipped_like_the_loop(model, x, y, exact=plan.exact)
    assert engine_pass(model, per_example_cross_entropy, x, y, plan.exact).constants_read == {}


@pytest.mark.parametrize("batch", [8, 4], ids=["rows-2T", "width"])
def test_a_confirmed_reading_is_made_where_another_dimension_has_the_batch_s_size_too(batch: int) -> None:
    """The table expanded over the batch, planned at the probe's batch of 6 (2T = 8 rows, width 4: the reading
    along dimension 1 confirmed), then a pass at a batch of 8 = 2T, or of 4 = the width: two dimensions of the
    expanded table have the batch's size. The engine reads the one the plan confirmed, so ``r`` keeps its rule
    (before, the ambiguity sent it to the exact path at every such step: XLNet at a batch of 2T ran 20 to 30 times
    slower), and the clipped sums are the per-example loop's."""
    torch.manual_seed(55)
    model = RelativePositions("per-example", width=4, dropout=0.0).double()
    plan = plan_clipping(model, per_example_cross_entropy, (4, 4), torch.float64)
    assert plan.exact.constant_reads == (("r.0", 1),), plan.lines()  # type: ignore[attr-defined]
    x, y = torch.randn(batch, 4, 4, generator=generator(55), dtype=torch.float64), torch.randint(0, 3, (batch,))
    found = engine_pass(model, per_example_cross_entropy, x, y, plan.exact)
    assert found.exact == {} and found.constants_read == {"r.0": 1}, found.reasons  # (r.1: the table's new map)
    assert_clipped_like_the_loop(model, x, y, exact=plan.exact)


def test_xlnet_is_clipped_without_the_exact_path() -> None:
    """transformers' XLNet: every layer's ``rel_attn.r`` (the position table's projection) by the einsum rule."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.XLNetConfig(vocab_size=30, d_model=8, n_layer=2, n_head=2, d_inner=16, num_labels=3)
    model = transformers.XLNetForSequenceClassification(config)
    torch.manual_seed(8)
    x = ids_and_mask(5, 7, 30, 5, 26)
    assert_exact_without_the_exact_path(
        HuggingFace(model.train()), per_example_cross_entropy, x, torch.randint(0, 3, (5,)), seed=8, plan_first=True
    )
