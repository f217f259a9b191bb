"""Per-operation clipping rules on what the first families' tests did not show: weights formed from parameters and
then written in place (DeBERTa's scaled position queries, a block of zeros filled with a parameter), grouped and
depthwise functional convolutions on standardised weights (NFNet's and BiT's), and per-head matrices repeated over
the batch against the heads' rows merged into it (DeBERTa-v2's relative positions). Clipped sums and norms equal a
float64 per-example autograd loop, and nothing takes the exact path but what the rules cannot know: values a view
shows after an in-place write changed them under it."""

from __future__ import annotations

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
from dpml.train.clipping_check import plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy


class WrittenWeights(nn.Module):
    """Weights computed from parameters and then written in place before they meet the batch: divided (``w /= s``, as
    DeBERTa scales its position queries), multiplied by another parameter (``mul_``), a constant buffer added to
    (``b.add_(p)``), a block of zeros filled (``z[:, :k] = p``), and a dropout that in evaluation returns its operand
    itself."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(width, width) * 0.3)
        self.s = nn.Parameter(torch.rand(width, 1) + 0.5)
        self.q = nn.Parameter(torch.randn(width) * 0.3)
        self.p = nn.Parameter(torch.randn(width, 2) * 0.3)
        self.out = nn.Linear(width + 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.a * 2.0
        w /= 3.0
        w.mul_(self.s)
        w = F.dropout(w, p=0.5, training=False)
        b = torch.zeros(w.shape[0], dtype=x.dtype)
        b.add_(self.q)
        z = torch.zeros(w.shape[0], 5, dtype=x.dtype)
        z[:, :2] = self.p
        h = torch.tanh(x @ w.t() + b)
        return self.out(torch.cat([h.mean(1), (h @ z)[:, :, 2:].mean(1)], 1))


def test_weights_written_in_place_before_they_meet_the_batch() -> None:
    torch.manual_seed(2)
    x = torch.randn(6, 4, 6, generator=generator(21), dtype=torch.float64)
    assert_exact_without_the_exact_path(WrittenWeights(), per_example_cross_entropy, x, torch.randint(0, 3, (6,)))


def assert_stale_and_exact(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Parameter ``a`` goes to the exact path for values an in-place write changed under a view, and every clipped
    sum (C = 0.3) and norm equals the float64 per-example loop's; the norms."""
    found = engine_pass(model, per_example_cross_entropy, x, y)
    assert set(found.exact) == {"a"}, found.reasons
    assert "an in-place operation changed since" in found.reasons["a"]
    return assert_clipped_like_the_loop(model, x, y)


class StaleView(nn.Module):
    """A view of a computed weight taken before an in-place write and used after it: it shows the new values, which
    the weight's recorded computation does not describe."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.a * 2.0
        seen = base.t()
        base[0] = 0.0
        return self.out(torch.tanh(x @ seen) + torch.tanh(x @ base))


def test_a_view_taken_before_an_in_place_write_goes_to_the_exact_path_and_stays_exact() -> None:
    torch.manual_seed(3)
    model = StaleView().double()
    x, y = torch.randn(5, 4, generator=generator(22), dtype=torch.float64), torch.randint(0, 3, (5,))
    norms = assert_stale_and_exact(model, x, y)
    assert float(norms.min()) > 0.3  # every example clipped: the write's effect is in each clipped gradient


class WrittenThroughViews(nn.Module):
    """Copies of parameters and computed weights written in place, through views too, before they meet the batch:
    Swin-V2's attention bias (``b = qkv_bias.clone(); b[n:2n].zero_()``, torchvision's ``shifted_window_attention``), a
    copy scaled and a row of it set (``c.mul_(2)``, ``c[0] = 0``), a block of a constant filled through a view
    (``z[:, :2].copy_(p)``), a slice of a computed weight scaled by a parameter and passed through an in-place
    activation (``F.relu(w[1:3], inplace=True)``), and that written view used beside its base."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.a = nn.Parameter(torch.randn(width, width) * 0.4)
        self.c = nn.Parameter(torch.randn(width, width) * 0.4)
        self.p = nn.Parameter(torch.randn(width, 2) * 0.4)
        self.s = nn.Parameter(torch.rand(2, width) + 0.5)
        self.out = nn.Linear(3 * width + 15, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.qkv.bias.clone()
        n = bias.numel() // 3
        bias[n : 2 * n].zero_()
        h = torch.tanh(F.linear(x, self.qkv.weight, bias))
        c = self.c.clone()
        c.mul_(2.0)
        c[0] = 0.0
        z = torch.zeros(x.shape[-1], 5, dtype=x.dtype)
        z[:, :2].copy_(self.p)
        w = self.a * 1.5
        rows = w[1:3]
        rows.mul_(self.s)
        F.relu(rows, inplace=True)
        seen = [torch.tanh(x @ c).mean(2), (x @ z).mean(1), torch.tanh(x @ w).mean(2), (x @ rows.t()).mean(1)]
        return self.out(torch.cat([h.mean(1), *seen], 1))


def test_copies_and_computed_weights_written_through_views_clip_without_the_exact_path() -> None:
    torch.manual_seed(11)
    x = torch.randn(6, 4, 6, generator=generator(27), dtype=torch.float64)
    assert_exact_without_the_exact_path(WrittenThroughViews(), per_example_cross_entropy, x, torch.randint(0, 3, (6,)))


class StaleCopy(nn.Module):
    """A parameter's copy written through a view, and used after: with a view of it taken before the write (which
    shows the new values, not those of the parameter's own view it was tracked as), or laid out transposed (its
    view not taken again on a contiguous copy): both are used as the copy they are, not as the parameter."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.out = nn.Linear(4, 3)
        self.transposed = transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        copy = self.a.t().clone() if self.transposed else self.a.clone()
        seen = copy.t()
        copy[1:3].mul_(3.0)
        return self.out(torch.tanh(x @ (copy if self.transposed else seen)) + torch.tanh(x @ copy))


@pytest.mark.parametrize("transposed", [False, True], ids=["a view taken before", "a transposed copy"])
def test_a_copy_written_where_its_values_cannot_be_followed_goes_to_the_exact_path_and_stays_exact(
    transposed: bool,
) -> None:
    torch.manual_seed(12)
    model = StaleCopy(transposed).double()
    x, y = torch.randn(5, 4, generator=generator(28), dtype=torch.float64), torch.randint(0, 3, (5,))
    assert_stale_and_exact(model, x, y)


class StandardisedConvolutions(nn.Module):
    """NFNet's and BiT's convolutions: a weight standardised per output channel (``F.batch_norm`` over its own numbers,
    ``reshape_as`` back) and scaled by a gain, then ``F.conv2d``; a grouped convolution (2 groups, stride 2), a
    depthwise one with a bias, and a depthwise ``F.conv1d`` (ConvBERT's span convolution)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 3, 3, 3))
        self.gain = nn.Parameter(torch.rand(4, 1, 1, 1) + 0.5)
        self.w2 = nn.Parameter(torch.randn(6, 2, 3, 3) * 0.3)
        self.w3 = nn.Parameter(torch.randn(6, 1, 3, 3) * 0.3)
        self.b3 = nn.Parameter(torch.randn(6) * 0.1)
        self.w4 = nn.Parameter(torch.randn(6, 1, 3) * 0.3)
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.w1.reshape(1, 4, -1)
        standard = F.batch_norm(flat, None, None, training=True, momentum=0.0, eps=1e-5).reshape_as(self.w1)
        h = torch.tanh(F.conv2d(x, standard * self.gain, padding=1))
        h = torch.tanh(F.conv2d(h, self.w2, stride=2, groups=2))
        h = torch.tanh(F.conv2d(h, self.w3, self.b3, padding=1, groups=6))
        line = torch.tanh(F.conv1d(h.mean(2), self.w4, padding=1, groups=6))
        return self.out(torch.cat([h.mean((2, 3)), line.mean(2)], 1))


def test_grouped_convolutions_on_standardised_weights() -> None:
    torch.manual_seed(4)
    x = torch.randn(5, 3, 9, 9, generator=generator(23), dtype=torch.float64)
    assert_exact_without_the_exact_path(
        StandardisedConvolutions(), per_example_cross_entropy, x, torch.randint(0, 3, (5,))
    )


class RepeatedHeads(nn.Module):
    """Per-head matrices repeated over the batch (``w.repeat(B, 1, 1)``, ``torch.tile``) against the heads' rows merged
    into the batch dimension, (B·H, T, d), on either side of ``torch.bmm`` (DeBERTa-v2's relative positions)."""

    def __init__(self, width: int = 6, heads: int = 2, relative: int = 4) -> None:
        super().__init__()
        self.heads, self.size = heads, width // heads
        self.query = nn.Linear(width, width)
        self.keys = nn.Parameter(torch.randn(heads * relative, self.size) * 0.3)
        self.values = nn.Parameter(torch.randn(heads, self.size, relative) * 0.3)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q = self.query(x).view(batch, length, self.heads, self.size).permute(0, 2, 1, 3).reshape(-1, length, self.size)
        keys = self.keys.view(self.heads, -1, self.size).repeat(batch, 1, 1)  # (B·H, R, d)
        scores = torch.softmax(torch.bmm(q, keys.transpose(1, 2)), -1)  # (B·H, T, R)
        mixed = torch.bmm(torch.tile(self.values, (batch, 1, 1)), scores.transpose(1, 2))  # (B·H, d, T)
        merged = mixed.view(batch, self.heads, self.size, length).permute(0, 3, 1, 2).reshape(batch, length, width)
        return self.out(torch.tanh(merged).mean(1))


def test_per_head_matrices_repeated_over_the_batch() -> None:
    torch.manual_seed(5)
    x = torch.randn(5, 4, 6, generator=generator(24), dtype=torch.float64)
    assert_exact_without_the_exact_path(RepeatedHeads(), per_example_cross_entropy, x, torch.randint(0, 3, (5,)))


def test_matrices_that_differ_from_one_example_to_another_are_each_examples_own() -> None:
    """A parameter of B·H matrices used as they are: example k's rows meet matrices no other example meets (a
    parameter indexed by the example). They are not one matrix every example shares: each is a matrix chosen for
    its row (the rule of a mixture of experts' ``W[expert_ids]``), whose gradient is its one example's, exactly as
    the per-example loop has it."""

    class PerRow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(10, 3, 3) * 0.3)
            self.out = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = x.view(5, 4, 2, 3).permute(0, 2, 1, 3).reshape(10, 4, 3)
            return self.out(torch.bmm(rows, self.w).view(5, 2, 4, 3).mean((1, 2)))

    x = torch.randn(5, 4, 6, generator=generator(25), dtype=torch.float64)
    # (planned=False: the model is written for a batch of 5, the probe's is another size)
    assert_exact_without_the_exact_path(
        PerRow(), per_example_cross_entropy, x, torch.randint(0, 2, (5,)), planned=False
    )


@pytest.mark.parametrize("version", ["deberta", "deberta-v2"])
def test_deberta_disentangled_attention(version: str) -> None:
    """DeBERTa's relative-position attention: position queries and keys computed from the shared relative embeddings
    (scaled in place), repeated over the batch (v2), met by every head's content rows."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    common = dict(vocab_size=30, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16)
    common |= dict(max_position_embeddings=16, num_labels=3, pad_token_id=0, relative_attention=True)
    if version == "deberta":
        config = transformers.DebertaConfig(pos_att_type=["p2c", "c2p"], max_relative_positions=8, **common)
        model = transformers.DebertaForSequenceClassification(config)
    else:
        config = transformers.DebertaV2Config(
            pos_att_type=["p2c", "c2p"],
            max_relative_positions=8,
            position_buckets=4,
            position_biased_input=False,
            **common,
        )
        model = transformers.DebertaV2ForSequenceClassification(config)
    torch.manual_seed(6)
    x = ids_and_mask(5, 7, 30, 0, 25)
    assert_exact_without_the_exact_path(
        HuggingFace(model.eval()), per_example_cross_entropy, x, torch.randint(0, 3, (5,)), seed=7
    )


class DroppedWeight(nn.Module):
    """Dropout on a weight before it meets the batch (DeBERTa drops out its relative embeddings), then dropout on the
    activations: the recording runs the weight's dropout again for its Jacobian, from the same random state, and
    leaves the later draws as they were."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) * 0.4)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = F.dropout(self.w, 0.3, training=self.training)
        h = F.dropout(torch.tanh(x @ w), 0.2, training=self.training)
        return self.out(h.mean(1))


def test_a_weight_dropped_out_in_training_draws_the_same_masks_as_without_the_recording() -> None:
    torch.manual_seed(8)
    x = torch.randn(6, 4, 6, generator=generator(26), dtype=torch.float64)
    assert_exact_without_the_exact_path(
        DroppedWeight().train(), per_example_cross_entropy, x, torch.randint(0, 3, (6,)), seed=9
    )


class LowRankWithMagnitude(nn.Module):
    """DoRA's weight: W = m ⊙ (W₀ + B A) / ‖W₀ + B A‖ (per output row), a chain of computations on parameters whose
    outputs are the layer's size while the trained factors (B, A, m) are small."""

    def __init__(self, width: int = 8, rank: int = 2) -> None:
        super().__init__()
        self.frozen = nn.Parameter(torch.randn(width, width) * 0.3, requires_grad=False)
        self.b = nn.Parameter(torch.randn(width, rank) * 0.3)
        self.a = nn.Parameter(torch.randn(rank, width) * 0.3)
        self.m = nn.Parameter(torch.rand(width, 1) + 0.5)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.frozen + self.b @ self.a
        weight = self.m * merged / merged.norm(dim=1, keepdim=True)
        return self.out(torch.tanh(x @ weight.t()))


def test_a_computed_weight_larger_than_the_keep_limit_is_carried_back_a_slice_of_examples_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """B × the weight's 64 numbers (384) pass the limit, B × the factors' (at most 48) do not: the weight's per-example
    gradients are formed one example at a time, and nothing takes the exact path."""
    monkeypatch.setattr("dpml.train.keep_budget.KEEP_PER_EXAMPLE_LIMIT", 100)
    torch.manual_seed(10)
    x = torch.randn(6, 8, generator=generator(30), dtype=torch.float64)
    assert_exact_without_the_exact_path(
        LowRankWithMagnitude(), per_example_cross_entropy, x, torch.randint(0, 3, (6,)), planned=False
    )


class PooledHeads(nn.Module):
    """MViT's pooled attention: each head's map merged into the batch dimension, (B·h, C, H, W) or head-major
    (h·B, …), pooled by a depthwise convolution with a bias and by a full one, max-pooled, and its rows met by
    relative-position tables (``torch.einsum``) after the pooling gave them back their (B, h, …) shape."""

    def __init__(self, head_major: bool) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=4)
        self.full = nn.Parameter(torch.randn(4, 4, 3, 3) * 0.3)
        self.rel = nn.Parameter(torch.randn(2, 3, 4) * 0.5)
        self.out = nn.Linear(3 + 4, 3)
        self.head_major = head_major

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, heads = 2, 16 positions, C = 4)
        batch, heads, _, channels = x.shape
        merged = x.transpose(0, 1) if self.head_major else x
        maps = merged.reshape(batch * heads, 4, 4, channels).permute(0, 3, 1, 2)
        pooled = self.depthwise(maps) + F.conv2d(F.max_pool2d(maps, 2), self.full, padding=1)
        pooled = (
            pooled.reshape(heads, batch, channels, 4) if self.head_major else pooled.reshape(batch, heads, channels, 4)
        )
        pooled = pooled.transpose(0, 1) if self.head_major else pooled
        rel = torch.einsum("byhwc,hkc->byhwk", pooled.transpose(2, 3).reshape(batch, heads, 2, 2, channels), self.rel)
        return self.out(torch.cat([rel.mean((1, 2, 3)), torch.tanh(pooled).mean((1, 3))], 1))


@pytest.mark.parametrize("head_major", [False, True], ids=["example-major", "head-major"])
def test_convolutions_and_pooling_on_images_grouped_by_example(head_major: bool) -> None:
    torch.manual_seed(13)
    x = torch.randn(5, 2, 16, 4, generator=generator(29), dtype=torch.float64)
    assert_exact_without_the_exact_path(
        PooledHeads(head_major), per_example_cross_entropy, x, torch.randint(0, 3, (5,))
    )


class ChannelMajorPooling(nn.Module):
    """2-D pooling and interpolation of a channel-major (C, B, H, W) tensor: each (channel, example) map pooled on its
    own, so the pooled maps keep their examples in the second dimension; then a linear layer on the rows."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Parameter(torch.randn(6, 6) * 0.4)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 4, 4, C = 6)
        maps = x.permute(3, 0, 1, 2)  # (C, B, H, W)
        pooled = F.interpolate(F.max_pool2d(maps, 2), scale_factor=2.0, mode="nearest")
        rows = pooled.permute(1, 2, 3, 0).reshape(x.shape[0], -1, x.shape[-1])  # (B, H·W, C)
        return self.out(torch.tanh(F.linear(rows, self.inner)).mean(1))


def test_pooling_a_channel_major_tensor_keeps_each_maps_example() -> None:
    torch.manual_seed(14)
    x, y = torch.randn(5, 4, 4, 6, generator=generator(31), dtype=torch.float64), torch.randint(0, 3, (5,))
    assert_exact_without_the_exact_path(ChannelMajorPooling(), per_example_cross_entropy, x, y)


class MaskedPlaces(nn.Module):
    """A learned embedding written into the places a mask chooses (wav2vec2's masked time steps: ``h[mask] = v``, the
    mask here from each example's own values), a learned row written at the first position (``h[:, 0] = c``), and a
    learned scalar into a block (``h[:, 1:3, :2] = s``, broadcast over a block of each example)."""

    def __init__(self, width: int = 5) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.masked = nn.Parameter(torch.randn(width) * 0.5)
        self.first = nn.Parameter(torch.randn(width) * 0.5)
        self.block = nn.Parameter(torch.randn(1) * 0.5)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T = 6, width)
        h = self.inner(x)
        h[x[..., 0] > 0.3] = self.masked
        h[:, 0] = self.first
        h[:, 1:3, :2] = self.block
        return self.out(torch.tanh(h).mean(1))


def test_parameters_written_into_chosen_places_of_an_activation_clip_without_the_exact_path() -> None:
    torch.manual_seed(15)
    x, y = torch.randn(5, 6, 5, generator=generator(32), dtype=torch.float64), torch.randint(0, 3, (5,))
    assert_exact_without_the_exact_path(MaskedPlaces(), per_example_cross_entropy, x, y)


class ExpandedPositions(nn.Module):
    """ConViT's positional attention: a constant table of relative positions expanded over the batch
    (``rel_indices.expand(B, …)``, stride 0), projected by a linear layer, softmaxed, and mixed with each example's
    content scores by a learned gate; ``mixes_rows``: a running sum along the expanded dimension first, which makes
    the rows differ (the probe must find the one-row node wrong and take the parameters exactly)."""

    def __init__(self, mixes_rows: bool = False, built: bool = False, heads: int = 2, length: int = 4) -> None:
        super().__init__()
        self.built = built
        offsets = torch.arange(length)[None, :] - torch.arange(length)[:, None]
        self.register_buffer("relative", torch.stack([offsets, offsets.abs(), offsets**2], -1).float()[None])
        self.positions = nn.Linear(3, heads)
        self.gate = nn.Parameter(torch.randn(heads) * 0.5)
        self.content = nn.Linear(3, heads * length)
        self.out = nn.Linear(heads * length, 3)
        self.mixes_rows = mixes_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 3)
        batch, length = x.shape[0], x.shape[1]
        table = self.relative.to(x.dtype)
        table = (
            torch.zeros(batch, *table.shape[1:], dtype=x.dtype) + table
            if self.built
            else table.expand(batch, -1, -1, -1)
        )
        position = self.positions(table).permute(0, 3, 1, 2)
        position = torch.softmax(position.cumsum(0) if self.mixes_rows else position, -1)  # (B, H, T, T)
        content = torch.softmax(self.content(x).view(batch, length, -1, length).transpose(1, 2), -1)
        gate = torch.sigmoid(self.gate).view(1, -1, 1, 1)
        mixed = (1.0 - gate) * content + gate * position
        return self.out(mixed.mean(2).reshape(batch, -1))


@pytest.mark.parametrize("built", [False, True], ids=["expanded", "built with equal rows"])
def test_a_constant_repeated_over_the_batch_and_projected_is_one_row_of_parameters(built: bool) -> None:
    """ConViT's table expanded over the batch, or EdgeNeXt's way: a table built with a batch dimension whose rows are
    equal (``zeros(B, …) + table``)."""
    torch.manual_seed(19)
    x, y = torch.randn(5, 4, 3, generator=generator(36), dtype=torch.float64), torch.randint(0, 3, (5,))
    assert_exact_without_the_exact_path(ExpandedPositions(built=built), per_example_cross_entropy, x, y)


def test_rows_mixed_along_the_expanded_dimension_are_found_by_the_probe_and_taken_exactly() -> None:
    torch.manual_seed(19)
    model = ExpandedPositions(mixes_rows=True).double()
    x, y = torch.randn(5, 4, 3, generator=generator(36), dtype=torch.float64), torch.randint(0, 3, (5,))
    # (each example's position scores depend on its place in the batch, which add-remove neighbours refuse)
    plan = plan_clipping(
        model, per_example_cross_entropy, (4, 3), torch.float64, probe=(x, y), neighbouring="replace-one"
    )
    assert "positions.weight" in plan.exact_parameters, plan.lines()  # (its bias shifts a softmax: no gradient)
    assert_clipped_like_the_loop(model, x[1:], y[1:], exact=plan.exact)


class DifferentRows(nn.Module):
    """A constant with a batch-sized first dimension whose rows differ (``arange(B)`` spread over a table), projected
    by a linear layer and added to each example's activations: not one row repeated, so no one-row node."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Linear(3, 3)
        self.out = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 3)
        table = torch.arange(x.shape[0], dtype=x.dtype).view(-1, 1, 1) * torch.ones(1, x.shape[1], 3, dtype=x.dtype)
        return self.out(torch.tanh(x + self.positions(table)).mean(1))


def test_a_constant_whose_rows_differ_is_not_taken_for_one_row() -> None:
    torch.manual_seed(20)
    model = DifferentRows().double()
    x, y = torch.randn(5, 4, 3, generator=generator(37), dtype=torch.float64), torch.randint(0, 3, (5,))
    assert_clipped_like_the_loop(model, x, y)


class Standardised(nn.Module):
    """Convolutions whose weights are standardised per output channel before use, as BiT's ``StdConv2d`` writes it
    (``F.batch_norm`` of the weight seen as (1, C_out, n), no running statistics): a 2-D one with a bias (its output
    written in place after, with ``write``), a 1-D one without, over the image's rows, and a 1×1 one with NFNet's gain
    computed from a parameter (``ScaledStdConv2d``: gain · fan-in^-½; one gain 0, as NFNet starts its last ones, one
    small) and a shift."""

    def __init__(self, write: bool) -> None:
        super().__init__()
        self.write = write
        self.square = nn.Parameter(torch.randn(6, 3, 3, 3))
        self.bias = nn.Parameter(torch.randn(6) * 0.3)
        self.line = nn.Parameter(torch.randn(4, 6, 3))
        self.scaled = nn.Parameter(torch.randn(5, 4, 1))
        self.gain = nn.Parameter(torch.tensor([0.0, 1.5, -0.7, 1e-3, 1.0]).reshape(5, 1, 1))
        self.shift = nn.Parameter(torch.randn(5) * 0.2)
        self.out = nn.Linear(5, 3)

    @staticmethod
    def standardised(
        w: torch.Tensor, gain: torch.Tensor | None = None, shift: torch.Tensor | None = None
    ) -> torch.Tensor:
        rows = w.reshape(1, w.shape[0], -1)
        return F.batch_norm(rows, None, None, gain, shift, training=True, momentum=0.0, eps=1e-6).reshape_as(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 5, 5)
        h = F.conv2d(x, self.standardised(self.square), self.bias, padding=1)
        if self.write:  # (the recorded output's values are then no longer what the convolution gave)
            h += 0.5
        rows = torch.tanh(h).mean(3)  # (B, 6, 5)
        h = torch.tanh(F.conv1d(rows, self.standardised(self.line), padding=1))  # (B, 4, 5)
        scaled = self.standardised(self.scaled, (self.gain * 4**-0.5).view(-1), self.shift)
        return self.out(torch.tanh(F.conv1d(h, scaled)).mean(2))


@pytest.mark.parametrize("write", [False, True])
def test_weights_standardised_before_their_convolutions_clip_without_per_example_weights(
    monkeypatch: pytest.MonkeyPatch, write: bool
) -> None:
    """Clipped sums and norms equal the loop's with a keep limit of 100 numbers: the generic pull-back through the
    standardisation would keep B × |W| (8 × 162) of them, so it would send the weights to the exact path."""
    from dpml.train import keep_budget

    torch.manual_seed(31)
    model = Standardised(write)
    x, y = torch.randn(8, 3, 5, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 100)
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, y)


class Computed(nn.Module):
    """A convolution whose weight is a computation on it that no closed form here covers (w·σ(w), ``alone``, not a
    map of each row by itself that :mod:`dpml.train.rules.row_jacobian` takes), or tanh(w) beside a use of w itself:
    the generic pull-back forms their per-example gradients, B × 162 numbers."""

    def __init__(self, alone: bool) -> None:
        super().__init__()
        self.alone = alone
        self.weight = nn.Parameter(torch.randn(6, 3, 3, 3))
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.alone:
            h = F.conv2d(x, w * torch.sigmoid(w), padding=1)
        else:
            h = F.conv2d(x, torch.tanh(w), padding=1) + F.conv2d(x, w, padding=1)
        return self.out(torch.tanh(h).mean((2, 3)))


def test_a_computed_weight_too_large_to_keep_for_the_batch_is_formed_again_for_its_sum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A keep limit of 400 numbers: two examples' 2 × 162 fit, the batch's 8 × 162 do not; the weight's norms come from
    one pass over the examples in slices of two and its clipped sum from a second, with nothing on the exact path."""
    from dpml.train import keep_budget

    torch.manual_seed(31)
    x, y = torch.randn(8, 3, 5, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 400)
    assert_exact_without_the_exact_path(Computed(alone=True), per_example_cross_entropy, x, y, planned=False)


def test_a_pass_that_takes_a_planned_parameter_exactly_at_a_larger_batch_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The weight has a use of its own beside its computation, so its pulled-back gradients are kept for the batch:
    at batch 4 within a limit of 1,000 numbers, at batch 8 (8 × 162) past it. It takes the exact path there (still
    exact), and the run's log names it, once."""
    from dpml.train import keep_budget

    torch.manual_seed(31)
    model = Computed(alone=False).double()
    x, y = torch.randn(8, 3, 5, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    assert engine_pass(model, per_example_cross_entropy, x[:4], y[:4]).exact == {}
    monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 1000)
    with caplog.at_level("WARNING", logger="dpml.clipping"):
        assert_clipped_like_the_loop(model, x[:4], y[:4])  # 4 × 162 numbers: within the limit, nothing said
        assert caplog.records == []
        assert_clipped_like_the_loop(model, x, y)
        assert_clipped_like_the_loop(model, x, y)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "weight: torch.tanh on parameters" in said[0] and "batch of 8" in said[0], said
