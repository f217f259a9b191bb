"""Rules for torch's own layers that no hook covers: ``nn.Bilinear``, ``nn.PReLU`` (a slope per channel or one for
all), ``nn.RMSNorm``, ``nn.InstanceNorm1d(affine=True)`` and ``nn.EmbeddingBag`` (sum, mean, weighted, max; a row
per example, or a padded batch packed with offsets): clipped sums and norms equal a float64 per-example autograd
loop, and none of their parameters takes the exact path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_op_rules import assert_clipped_like_the_loop, assert_exact_without_the_exact_path, generator
from torch import nn

from dpml.train import clipping_norms
from dpml.train.clipping import engine_pass
from dpml.train.dpsgd import per_example_cross_entropy
from dpml.train.rules import norm


class TorchLayers(nn.Module):
    """x (B, T, 6): a bilinear form of the sequence and its tanh, PReLU per channel (on (B, C, T)) and shared, an
    RMSNorm, and an affine instance norm over the positions, each feeding the classifier directly (an instance norm's
    x̂ has mean 0 over the positions, so it is pooled after a nonlinearity)."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.bilinear = nn.Bilinear(width, width, 4)
        self.channel_slopes = nn.PReLU(width, init=0.3)
        self.one_slope = nn.PReLU(init=0.2)
        self.rms = nn.RMSNorm(width)
        self.instance = nn.InstanceNorm1d(width, affine=True)
        self.out = nn.Linear(4 + 3 * width, 3)
        with torch.no_grad():  # away from the initial 1 and 0, so that a wrong x̂ or slope would show
            for p in (self.rms.weight, self.instance.weight, self.instance.bias):
                p.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.transpose(1, 2)  # (B, C, T)
        parts = [
            self.bilinear(x, torch.tanh(x)).mean(1),
            self.one_slope(self.channel_slopes(channels - 0.2)).mean(2),
            self.rms(x * 3.0).mean(1),
            torch.tanh(self.instance(channels)).mean(2),
        ]
        return self.out(torch.tanh(torch.cat(parts, 1)))


def test_torch_layers_without_a_hook_are_exact_without_the_exact_path() -> None:
    torch.manual_seed(12)
    x = torch.randn(6, 5, 6, generator=generator(27), dtype=torch.float64)
    assert_exact_without_the_exact_path(TorchLayers(), per_example_cross_entropy, x, torch.randint(0, 3, (6,)))


class Bags(nn.Module):
    """x (B, L, 2): a row of indices per example (x[..., 0]) and their weights (x[..., 1]); bags summed with the
    weights, averaged without index 0 (``padding_idx``), summed from a table also looked up per index, and their
    maximum without index 0 (each column's gradient to the row its maximum came from), from a table also summed."""

    def __init__(self, rows: int = 12, width: int = 5) -> None:
        super().__init__()
        self.summed = nn.EmbeddingBag(rows, width, mode="sum")
        self.averaged = nn.EmbeddingBag(rows, width, mode="mean", padding_idx=0)
        self.largest = nn.EmbeddingBag(rows, width, mode="max", padding_idx=0)
        self.out = nn.Linear(5 * width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = x[..., 0].long(), x[..., 1]
        looked_up = torch.nn.functional.embedding(ids, self.summed.weight).mean(1)  # the same table, another use
        largest = self.largest(ids)
        also_summed = torch.nn.functional.embedding_bag(ids, self.largest.weight, mode="sum")
        parts = [self.summed(ids, per_sample_weights=weights), self.averaged(ids), looked_up, largest, also_summed]
        return self.out(torch.tanh(torch.cat(parts, 1)))


def test_bags_of_indices_summed_or_averaged_are_exact_without_the_exact_path() -> None:
    torch.manual_seed(13)
    ids = torch.randint(0, 12, (6, 4), generator=generator(28))
    ids[0, 1:] = 0  # one bag of padding but for one index
    ids[1] = 0  # one of padding alone: no maximum, no gradient
    ids[2, 2] = ids[2, 0]  # an index twice in one bag
    weights = torch.rand(6, 4, generator=generator(29), dtype=torch.float64) + 0.5
    x = torch.stack([ids.double(), weights], 2)
    assert_exact_without_the_exact_path(Bags(), per_example_cross_entropy, x, torch.randint(0, 3, (6,)))


class ShiftsAndScales(nn.Module):
    """x (B, T, 5) through ``torch.addcmul`` with parameters: β + α ⊙ x (timm's ResMLP ``Affine``, α and β of shape
    (1, 1, C)), β' + γ ⊙ (x ⊙ N(x)) with the response norm of ConvNeXt-V2 (weights viewed (1, 1, C), ``value`` 0.5),
    x + 2·(u ⊙ s) with the scale s (C,) the second factor and no shift parameter, and β'' + x ⊙ c with only the shift a
    parameter (c a constant)."""

    def __init__(self, width: int = 5) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.rand(1, 1, width) + 0.5)
        self.beta = nn.Parameter(torch.randn(1, 1, width))
        self.gamma = nn.Parameter(torch.rand(width) + 0.5)
        self.shift = nn.Parameter(torch.randn(width))
        self.scale = nn.Parameter(torch.rand(width) + 0.5)
        self.bias = nn.Parameter(torch.randn(width))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(torch.addcmul(self.beta, self.alpha, x))
        response = h.norm(p=2, dim=1, keepdim=True)
        normalised = response / (response.mean(dim=-1, keepdim=True) + 1e-6)
        h = h + torch.addcmul(self.shift.view(1, 1, -1), self.gamma.view(1, 1, -1), h * normalised, value=0.5)
        h = torch.tanh(h).addcmul(torch.sin(h), self.scale, value=2.0)
        h = torch.addcmul(self.bias, torch.tanh(h), torch.full_like(h, 0.7))
        return self.out(torch.tanh(h).mean(1))


def test_shifts_and_scales_by_addcmul_are_exact_without_the_exact_path() -> None:
    torch.manual_seed(14)
    x = torch.randn(6, 4, 5, generator=generator(30), dtype=torch.float64)
    assert_exact_without_the_exact_path(ShiftsAndScales(), per_example_cross_entropy, x, torch.randint(0, 3, (6,)))


class ReadsWhatWeightsAre(nn.Module):
    """A layer whose weight's dtype, device and shape are read outside its call (SigLIP casts its pixels to the patch
    embedding's ``weight.dtype`` first), a patch embedding with ``padding="valid"``, and functional convolutions
    padded by name (``"same"``, ``"valid"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, 4, 2, stride=2, padding="valid")
        self.same = nn.Parameter(torch.randn(4, 4, 3, 3) * 0.3)
        self.valid = nn.Parameter(torch.randn(4, 4, 1, 1) * 0.3)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.patches.weight
        assert weight.shape[0] == 4 and weight.numel() == 48 and weight.dim() == 4 and len(weight) == 4
        h = torch.tanh(self.patches(x.to(dtype=weight.dtype, device=weight.device)))
        h = torch.tanh(F.conv2d(h, self.same, padding="same") + F.conv2d(h, self.valid, padding="valid"))
        return self.out(h.mean((2, 3)))


def test_what_a_weight_is_read_outside_its_layer_leaves_the_layer_its_shortcut_and_named_padding_is_ruled() -> None:
    torch.manual_seed(16)
    model = ReadsWhatWeightsAre()
    x, y = torch.randn(5, 3, 6, 6, generator=generator(33), dtype=torch.float64), torch.randint(0, 3, (5,))
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, y)
    found = engine_pass(model, per_example_cross_entropy, x, y)
    assert any(unit is model.patches for unit, _ in found.fast), [unit for unit, _ in found.fast]


class GatedPositionBias(nn.Module):
    """WavLM's gated relative position bias: a table looked up by relative-position buckets, (H, T, T), repeated over
    the batch with a slice per head, (B·H, T, T), and scaled by a gate computed from each example ((B·H, T, 1));
    head-major (H·B rows) too, and the same through ``torch.addcmul``."""

    def __init__(self, head_major: bool, heads: int = 2, length: int = 4) -> None:
        super().__init__()
        self.table = nn.Embedding(5, heads)
        self.gate = nn.Linear(3, heads)
        self.out = nn.Linear(length, 3)
        positions = torch.arange(length)
        self.register_buffer("buckets", (positions[None, :] - positions[:, None]).clamp(-2, 2) + 2)
        self.head_major = head_major

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 3)
        batch, length, heads = x.shape[0], x.shape[1], self.table.embedding_dim
        bias = self.table(self.buckets).permute(2, 0, 1)  # (H, T, T), every example's
        gate = torch.sigmoid(self.gate(x)).transpose(1, 2)  # (B, H, T)
        if self.head_major:
            gate, bias = gate.transpose(0, 1).reshape(-1, length, 1), bias.repeat_interleave(batch, 0)
        else:
            gate, bias = gate.reshape(-1, length, 1), bias.unsqueeze(0).repeat(batch, 1, 1, 1).view(-1, length, length)
        scores = torch.softmax(torch.addcmul(gate * bias, gate, bias, value=0.5), -1)  # (B·H or H·B, T, T)
        scores = scores.view(heads, batch, -1).transpose(0, 1) if self.head_major else scores.view(batch, heads, -1)
        return self.out(scores.reshape(batch, -1, length).mean(1))


@pytest.mark.parametrize("head_major", [False, True], ids=["example-major", "head-major"])
def test_a_table_with_a_slice_per_head_repeated_over_the_batch_is_clipped_without_the_exact_path(
    head_major: bool,
) -> None:
    torch.manual_seed(17)
    x, y = torch.randn(5, 4, 3, generator=generator(34), dtype=torch.float64), torch.randint(0, 3, (5,))
    assert_exact_without_the_exact_path(GatedPositionBias(head_major), per_example_cross_entropy, x, y)


class GroupedExperts(nn.Module):
    """A mixture of experts as ``transformers`` runs it by default: each token routed to its top expert (a different
    number of an example's tokens to each: ragged rows), the tokens (time-major) sorted by expert and gathered, two
    grouped products (``F.grouped_mm`` with the experts' offsets; the second weight stored transposed), scattered back
    and scaled by the router's probability. ``F.grouped_mm`` computes in float32 only."""

    def __init__(self, experts: int = 3, width: int = 8, hidden: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.up = nn.Parameter(torch.randn(experts, width, hidden) * 0.3)
        self.down = nn.Parameter(torch.randn(experts, width, hidden) * 0.3)  # (E, n_out, n_in): used transposed
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, width)
        tokens = x.transpose(0, 1).reshape(-1, x.shape[-1])  # time-major: an expert's rows not example by example
        probabilities = torch.softmax(self.router(tokens), -1)
        gate, expert = probabilities.max(-1)
        order = torch.argsort(expert, stable=True)
        offsets = torch.cumsum(torch.bincount(expert, minlength=self.up.shape[0]), 0).to(torch.int32)
        hidden = torch.tanh(F.grouped_mm(tokens[order].float(), self.up.float(), offs=offsets))
        routed = F.grouped_mm(hidden, self.down.float().transpose(-2, -1), offs=offsets).to(x.dtype)
        mixed = routed[torch.argsort(order)] * gate.unsqueeze(-1)
        return self.out(torch.tanh(mixed).reshape(x.shape[1], x.shape[0], -1).mean(0))


def test_a_mixture_of_experts_grouped_product_is_clipped_without_the_exact_path() -> None:
    torch.manual_seed(18)
    x, y = torch.randn(5, 6, 8, generator=generator(35), dtype=torch.float64), torch.randint(0, 3, (5,))
    model = GroupedExperts()
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, y, tolerance=1e-5)
    expert = model.router(x).argmax(-1)  # (B, T)
    counts = torch.stack([torch.bincount(row, minlength=3) for row in expert])  # (B, E): tokens per example and expert
    assert bool((counts != counts[:1]).any())  # ragged: the examples send different numbers of tokens to an expert


class TimeMajorTokens(nn.Module):
    """Token ids looked up time-major, (T, B) (XLNet's layout), then a linear layer on the (T, B, d) rows: the ids are
    each example's own, not indices shared by the batch (the lookup once took them for shared ones, silently wrong)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 4)
        self.inner = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (B, T)
        h = torch.tanh(self.inner(self.table(ids.t())))  # (T, B, 4)
        return self.out(h.transpose(0, 1).mean(1))


def test_time_major_token_ids_are_each_examples_own_and_their_rows_are_followed() -> None:
    torch.manual_seed(21)
    model = TimeMajorTokens().double()
    x, y = torch.randint(0, 10, (5, 6), generator=generator(38)), torch.randint(0, 3, (5,))
    found = engine_pass(model, per_example_cross_entropy, x, y)
    assert found.exact == {}, found.reasons  # the lookup's rule takes the ids by the rows its output carries
    assert_clipped_like_the_loop(model, x, y)


class LearnedQueries(nn.Module):
    """Learned queries every example shares, expanded over the batch before they meet it (Perceiver's latents, a set
    transformer's seeds): through ``torch.matmul`` (``expand``), ``torch.einsum`` (``broadcast_to``, the queries'
    own scale per query) and a time-major einsum (the queries expanded over the batch's second dimension)."""

    def __init__(self, way: str) -> None:
        super().__init__()
        self.way = way
        self.queries = nn.Parameter(torch.randn(3, 4))
        self.scale = nn.Parameter(torch.rand(3) + 0.5)
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 4)
        batch = x.shape[0]
        if self.way == "matmul":
            scores = torch.matmul(self.queries.expand(batch, -1, -1), x.transpose(1, 2))  # (B, 3, T)
        elif self.way == "einsum":
            queries = torch.broadcast_to(self.queries * self.scale[:, None], (batch, 3, 4))
            scores = torch.einsum("bqd,btd->bqt", queries, x)
        else:
            queries = self.queries[:, None, :].expand(3, batch, 4)  # (3, B, 4): the batch second
            scores = torch.einsum("qbd,tbd->bqt", queries, x.transpose(0, 1))
        return self.out((scores.softmax(-1) @ x).flatten(1))


@pytest.mark.parametrize("way", ["matmul", "einsum", "time-major"])
def test_learned_queries_expanded_over_the_batch_are_clipped_without_the_exact_path(way: str) -> None:
    torch.manual_seed(22)
    x, y = torch.randn(5, 6, 4, generator=generator(36), dtype=torch.float64), torch.randint(0, 3, (5,))
    assert_exact_without_the_exact_path(LearnedQueries(way), per_example_cross_entropy, x, y)


class QueriesPerExample(nn.Module):
    """A parameter with a slice per place in the batch (B, 3, 4), each example meeting its own: not shared by the
    batch, so not the queries above — its slices must not be taken for one shared S_0."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(batch, 3, 4))
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("bqd,btd->bqt", self.queries, x)
        return self.out((scores.softmax(-1) @ x).flatten(1))


def test_a_parameter_with_a_slice_per_example_is_not_taken_for_queries_every_example_shares() -> None:
    torch.manual_seed(23)
    x, y = torch.randn(5, 6, 4, generator=generator(37), dtype=torch.float64), torch.randint(0, 3, (5,))
    model = QueriesPerExample(5).double()
    assert_clipped_like_the_loop(model, x, y)


class ExpertsByBatchedProduct(nn.Module):
    """A mixture of experts as transformers' ``batched_mm`` experts compute it: each token's rows repeated for its top
    two experts, the chosen matrices gathered per row (``W[expert_ids]``) and multiplied row by row with ``torch.bmm``
    (the parameter first, or second, transposed), a gated activation between the up and down projections."""

    def __init__(self, parameter_first: bool) -> None:
        super().__init__()
        self.parameter_first = parameter_first
        self.router = nn.Linear(4, 3)
        self.up = nn.Parameter(torch.randn(3, 6, 4) * 0.3)  # (experts, out, in)
        self.down = nn.Parameter(torch.randn(3, 5, 3) * 0.3)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 4)
        flat = x.reshape(-1, 4)
        top = self.router(flat).topk(2, -1)
        ids, rows = top.indices.reshape(-1), flat.repeat_interleave(2, dim=0)
        if self.parameter_first:
            h = torch.bmm(self.up[ids], rows.unsqueeze(-1)).squeeze(-1)
        else:
            h = torch.bmm(rows.unsqueeze(1), self.up.transpose(1, 2)[ids]).squeeze(1)
        gate, up = h.chunk(2, dim=-1)
        out = torch.bmm(self.down[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        out = (out * top.values.softmax(-1).reshape(-1, 1)).view(-1, 2, 5).sum(1)
        return self.head(out.reshape(x.shape[0], -1, 5).mean(1))


@pytest.mark.parametrize("parameter_first", [True, False])
def test_experts_chosen_per_row_by_a_batched_product_are_clipped_without_the_exact_path(parameter_first: bool) -> None:
    torch.manual_seed(24)
    x, y = torch.randn(5, 6, 4, generator=generator(38), dtype=torch.float64), torch.randint(0, 3, (5,))
    assert_exact_without_the_exact_path(ExpertsByBatchedProduct(parameter_first), per_example_cross_entropy, x, y)


class OverlappingRowsPerToken(nn.Module):
    """Each token's matrix made of two of a parameter's rows, chosen per token (``P[pairs[ids]]``): matrices that
    share their first row but not their second are different views, not one matrix used by several tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(3, 3)
        self.rows = nn.Parameter(torch.randn(4, 3))
        self.register_buffer("pairs", torch.tensor([[0, 1], [0, 2], [0, 3]]))
        self.head = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 3)
        flat = x.reshape(-1, 3)
        chosen = self.rows[self.pairs[self.router(flat).argmax(-1)]]  # (B·T, 2, 3)
        out = torch.bmm(chosen, flat.unsqueeze(-1)).squeeze(-1)  # (B·T, 2)
        return self.head(out.reshape(x.shape[0], -1, 2).mean(1))


def test_matrices_chosen_per_token_that_share_a_first_element_are_told_apart() -> None:
    torch.manual_seed(25)
    x, y = torch.randn(5, 6, 3, generator=generator(39), dtype=torch.float64), torch.randint(0, 3, (5,))
    model = OverlappingRowsPerToken().double()
    assert len(set(model.router(x.reshape(-1, 3)).argmax(-1).tolist())) > 1  # several pairs in use
    assert_clipped_like_the_loop(model, x, y)


class FunctionalGroupNorm(nn.Module):
    """``F.group_norm`` called with a module's γ and β and an activation in the same forward (timm's
    ``GroupNormAct``, whose output is the activation's: no layer hook applies), on size × size maps; with ``which``
    only γ or only β trainable."""

    def __init__(self, groups: int, size: int, which: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 6, 3, padding=1)
        self.gamma = nn.Parameter(torch.rand(6) + 0.5, requires_grad=which != "beta")
        self.beta = nn.Parameter(torch.randn(6) * 0.3, requires_grad=which != "gamma")
        self.groups = groups
        self.out = nn.Linear(6 * size * size, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.group_norm(self.conv(x), self.groups, self.gamma, self.beta, eps=1e-4)
        return self.out(F.silu(h).flatten(1))


@pytest.mark.parametrize("which", ["both", "gamma", "beta"])
@pytest.mark.parametrize("size", [5, 6], ids=["recomputed", "folded"])
@pytest.mark.parametrize("groups", [1, 2, 6])
def test_a_functional_group_norms_affine_clips_like_the_loop(
    monkeypatch: pytest.MonkeyPatch, groups: int, size: int, which: str
) -> None:
    """A group norm's γ and β by their rule: below ``FOLDED_GROUP_NORM_MIN_POSITIONS`` positions a channel (5 × 5) x̂
    is recomputed, from it up (6 × 6) ATen's GroupNorm kernels run on the batch folded into the channels, as for the
    layer's hook; the float64 loop's clipped sums and norms either way, with γ, β or both trainable."""
    assert 5 * 5 < clipping_norms.FOLDED_GROUP_NORM_MIN_POSITIONS <= 6 * 6
    folded = {"calls": 0}

    def counted(*args: object) -> tuple[torch.Tensor, torch.Tensor] | None:
        found = clipping_norms.group_norm_affine_gradients(*args)  # type: ignore[arg-type]
        folded["calls"] += found is not None
        return found

    monkeypatch.setattr(norm, "group_norm_affine_gradients", counted)
    torch.manual_seed(15)
    x = torch.randn(7, 2, size, size, generator=generator(6), dtype=torch.float64)
    model = FunctionalGroupNorm(groups, size, which)
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, torch.randint(0, 3, (7,)))
    assert (folded["calls"] > 0) == (size == 6), folded


class CastLikeTheBatch(nn.Module):
    """A rotation formed from a parameter and a constant permutation cast to the activation's dtype and device,
    ``P.to(x)`` (peft's BOFT writes its butterfly so): the cast reads only x's dtype, so the product of the two is
    still a computation on parameters alone, not a use with the batch."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.skew = nn.Parameter(torch.randn(1, width, width, generator=generator(40), dtype=torch.float64) * 0.3)
        self.register_buffer("permutation", torch.eye(width, dtype=torch.float64)[torch.randperm(width)][None])
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rotation = torch.matrix_exp(self.skew - self.skew.transpose(1, 2))
        permutation = self.permutation.to(x)
        rotation = torch.bmm(permutation, torch.bmm(rotation, permutation.permute(0, 2, 1)))[0]
        return self.out(torch.tanh(x @ rotation))


def test_a_constant_cast_like_the_batch_stays_a_constant() -> None:
    torch.manual_seed(15)
    x = torch.randn(6, 5, 4, generator=generator(41), dtype=torch.float64)
    assert_exact_without_the_exact_path(
        CastLikeTheBatch(), per_example_cross_entropy, x[:, 0], torch.randint(0, 3, (6,))
    )


class PackedBags(nn.Module):
    """x (B, L, 2): a padded row of indices per example (0 the padding) and weights, packed by ``ids[mask]`` into one
    flat row with offsets from the lengths, as ``nn.EmbeddingBag(text, offsets)`` is fed: averaged; summed with the
    weights and ``include_last_offset``; their maximum without index 3 (``padding_idx``). ``aligned`` False: the flat
    row cut into B bags of 2 indices, which are not the examples."""

    def __init__(self, aligned: bool = True, rows: int = 12, width: int = 5) -> None:
        super().__init__()
        self.averaged = nn.EmbeddingBag(rows, width, mode="mean")
        self.summed = nn.EmbeddingBag(rows, width, mode="sum", include_last_offset=True)
        self.largest = nn.EmbeddingBag(rows, width, mode="max", padding_idx=3)
        self.out = nn.Linear(3 * width, 3)
        self.aligned = aligned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = x[..., 0].long(), x[..., 1]
        mask = ids != 0
        flat, lengths = ids[mask], mask.sum(1)
        ends = lengths.cumsum(0)
        starts = ends - lengths if self.aligned else torch.arange(0, 2 * len(ids), 2)
        parts = [
            self.averaged(flat, starts),
            self.summed(flat, torch.cat([starts, ends[-1:]]), per_sample_weights=weights[mask]),
            self.largest(flat, starts),
        ]
        return self.out(torch.tanh(torch.cat(parts, 1)))


def _packed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 12, (6, 5), generator=generator(42))
    ids[0, 2:] = 0  # examples of 2, 1 and 5 indices
    ids[3, 1:] = 0
    ids[1, :2] = 3  # two indices the maximum does not count
    weights = torch.rand(6, 5, generator=generator(43), dtype=torch.float64) + 0.5
    return torch.stack([ids.double(), weights], 2), torch.randint(0, 3, (6,), generator=generator(44))


def test_bags_packed_into_one_flat_row_by_offsets_are_exact_without_the_exact_path() -> None:
    torch.manual_seed(16)
    x, y = _packed_batch()
    assert_exact_without_the_exact_path(PackedBags(), per_example_cross_entropy, x, y)


def test_bags_that_are_not_the_examples_take_the_exact_path_named() -> None:
    from test_op_rules import assert_clipped_like_the_loop

    from dpml.train.clipping import engine_pass

    torch.manual_seed(16)
    x, y = _packed_batch()
    model = PackedBags(aligned=False).double()
    found = engine_pass(model, per_example_cross_entropy, x, y)
    assert sorted(found.exact) == ["averaged.weight", "largest.weight", "summed.weight"], found.reasons
    assert all("bags that are not the examples one by one" in why for why in found.reasons.values()), found.reasons
    assert_clipped_like_the_loop(model, x, y)


class SideTablesAtPadding(nn.Module):
    """RoCBert's embeddings: beside the batch's own lookup, a large table (padding id 0) looked up at ids the forward
    makes, the same for every example (``padding``: ``zeros(B, T)``, padding alone; ``pattern``: a few rows and the
    padding, copied for each example; ``computed``: the pattern in a table computed from two parameters), joined with
    it along the features."""

    def __init__(self, shared: str, vocabulary: int = 5000, width: int = 4) -> None:
        super().__init__()
        self.words = nn.Embedding(50, width)
        self.side = nn.Embedding(vocabulary, width, padding_idx=0)
        self.scale = nn.Parameter(torch.rand(vocabulary, width) + 0.5)
        self.shared = shared
        self.mix = nn.Linear(2 * width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T) ids
        batch, length = x.shape
        if self.shared == "padding":
            ids = torch.zeros(batch, length, dtype=torch.long)
        else:
            ids = torch.tensor([0, 17, 4093, 17, 0, 2])[torch.arange(length) % 6].repeat(batch, 1)
        side = F.embedding(ids, self.side.weight * self.scale, 0) if self.shared == "computed" else self.side(ids)
        return self.mix(torch.tanh(torch.cat((self.words(x), side), -1))).mean(1)


@pytest.mark.parametrize("shared", ["padding", "pattern", "computed"])
def test_a_large_table_looked_up_at_shared_padding_is_read_on_the_rows_it_reaches(
    shared: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its per-example gradients are B × (rows reached) × width numbers, not B × |table|: with a layer's keep limit
    below one example's |table| (5000 × 4), the table still needs no exact path (it did while the lookup was pulled
    back through the whole table), and the clipped sums and norms are the loop's (the padding rows' gradient zero).
    A table computed from parameters (``computed``) is exact too; the product that forms it is pulled back whole
    (B × |table| numbers: within the default limit)."""
    from dpml.train import keep_budget

    if shared != "computed":
        monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 10_000)
    x = torch.randint(0, 50, (7, 9), generator=generator(3))
    assert_exact_without_the_exact_path(SideTablesAtPadding(shared), per_example_cross_entropy, x, x[:, 0] % 3)


class TablesAtOneRowOfIds(nn.Module):
    """MarkupLM's XPath embeddings: tables looked up at ids the forward makes, one row per example and all alike
    (``full((B, T, depth), k)``, ``ids``: or expanded from one row), joined and mapped by layers on parameters alone,
    the result added to the batch's own embedding."""

    def __init__(
        self, made: str, depth: int = 3, width: int = 4, hidden: int = 16, dropout: float = 0.0, alpha: bool = False
    ) -> None:
        super().__init__()
        self.made, self.dropout, self.alpha = made, dropout, alpha
        self.words = nn.Embedding(30, hidden)
        self.tables = nn.ModuleList(nn.Embedding(20, width) for _ in range(depth))
        self.inner = nn.Linear(depth * width, hidden)
        self.out = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T) ids
        batch, length = x.shape
        if self.made == "full":
            ids = torch.full((batch, length, len(self.tables)), 7)
        else:
            ids = (torch.arange(length * len(self.tables)) % 20).view(1, length, -1).expand(batch, -1, -1)
        tables = torch.cat([table(ids[:, :, k]) for k, table in enumerate(self.tables)], -1)
        drop = F.alpha_dropout if self.alpha else F.dropout
        paths = drop(torch.tanh(self.inner(tables)), self.dropout, self.training)
        return self.out(torch.tanh(self.words(x) + paths)).mean(1)


@pytest.mark.parametrize("made", ["full", "expanded"])
def test_tables_looked_up_at_one_row_of_ids_are_carried_on_that_row(made: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookups' views repeat one row (stride 0), so the computations on them are carried on that row alone: with a
    layer's keep limit (400) below one example's gradient of the whole (B, T, hidden) result (8 · 6 · 16 = 768), no
    parameter takes the exact path (before, every table and the inner layer did: MarkupLM's 100 tables made its DP step
    25 times its non-private one), and sums and norms equal the float64 loop's."""
    from dpml.train import keep_budget

    monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 400)
    x = torch.randint(0, 30, (8, 6), generator=generator(4))
    assert_exact_without_the_exact_path(TablesAtOneRowOfIds(made), per_example_cross_entropy, x, x[:, 0] % 3)


@pytest.mark.parametrize("made", ["full", "expanded"])
@pytest.mark.parametrize("alpha", [False, True], ids=["dropout", "alpha-dropout"])
def test_random_draws_on_rows_alike_are_not_carried_on_one_row(made: str, alpha: bool) -> None:
    """MarkupLM in training mode: dropout after the layer on the alike rows draws a mask per row, so the rows are no
    longer one row's repeats. Before 1606359 the chain was carried on the first row through the draw anyway (the
    engine's sums were wrong, and the probe sent every table and the inner layer to the exact path: MarkupLM's 103
    parameters). Dropout is now the row times a mask per example (``dpml/train/rules/dropout.py``); alpha dropout,
    which also shifts, ends the carrying (a draw moves the generator: ``derived.first_rows``). Either way the tables
    and the layer take no exact path, and sums and norms equal the float64 loop's under the same draws."""
    x = torch.randint(0, 30, (8, 6), generator=generator(4))
    model = TablesAtOneRowOfIds(made, dropout=0.3, alpha=alpha).train()
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, x[:, 0] % 3)


class QueriesWithDropout(nn.Module):
    """A DETR's decoder queries: a learned table made one per example (``expand`` over the batch, or added to zeros
    of the batch's shape), mapped by a layer on parameters alone, then dropout — one mask per example — before the
    product with the batch's keys (a use the elementwise rule alone does not take)."""

    def __init__(self, made: str, dropout: str, queries: int = 4, width: int = 6) -> None:
        super().__init__()
        self.made, self.dropout = made, dropout
        self.queries = nn.Parameter(torch.randn(queries, width))
        self.inner = nn.Linear(width, width)
        self.key = nn.Linear(width, width, bias=False)  # (a key's bias: its gradient is 0 up to rounding)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, width)
        if self.made == "expanded":
            q = self.queries.unsqueeze(0).expand(x.shape[0], -1, -1)
        elif self.made == "repeated":  # (DETR's query embeddings)
            q = self.queries.unsqueeze(0).repeat(x.shape[0], 1, 1)
        elif self.made == "tiled":
            q = torch.tile(self.queries, (x.shape[0], 1, 1))
        else:
            q = torch.zeros(x.shape[0], *self.queries.shape, dtype=x.dtype) + self.queries
        q = torch.tanh(self.inner(q))
        if self.dropout == "module":
            q = self.drop(q)
        elif self.dropout == "none":
            pass
        elif self.dropout == "channels":
            q = F.dropout1d(q, 0.3, self.training)  # (B, queries, width): a query's whole row kept or dropped
        else:
            q = torch.dropout(q, 0.3, self.training)
        scores = torch.matmul(q, self.key(x).transpose(1, 2)).softmax(-1)
        return self.out(torch.matmul(scores, x)).mean(1)


@pytest.mark.parametrize("made", ["expanded", "zeros", "repeated", "tiled"])
@pytest.mark.parametrize("dropout", ["none", "module", "channels", "function"])
def test_dropout_after_a_carried_chain_is_a_mask_per_example(made: str, dropout: str) -> None:
    """Dropout on the carried rows multiplies them by a mask of one row per example (``dpml/train/rules/dropout.py``):
    the product rule takes it and the chain before stays carried, so queries, layer and keys take no exact path
    (before, all three did: the dropout's output was a computation on parameters of B rows, which the product with
    the keys has no rule for), and sums and norms equal the float64 loop's under the same masks; the generator is
    left where the model's own pass leaves it. Queries copied by ``repeat`` or ``tile`` along a dimension of one are
    rows alike as ``expand``'s are (their index an expansion: ``operands._repeated_index``); before, the chain on them
    took the exact path even without dropout."""
    x = torch.randn(8, 5, 6, generator=generator(6), dtype=torch.float64)
    model = QueriesWithDropout(made, dropout).train()
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, torch.arange(8) % 3)
    torch.manual_seed(1)
    engine_pass(model, per_example_cross_entropy, x, torch.arange(8) % 3, ())
    after_pass = torch.rand(3)
    torch.manual_seed(1)
    model(x)
    assert torch.equal(after_pass, torch.rand(3))  # the generator left where the model's own pass leaves it


class LatentQueries(nn.Module):
    """The Perceiver's cross-attention: learned latents expanded over the batch (``latents.expand(B, n, d)``), normed
    and mapped to queries by layers on parameters alone, then a product with the batch's keys."""

    def __init__(self, width: int, latents: int = 3) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(latents, width))
        self.norm = nn.LayerNorm(width)
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, width)
        queries = self.query(self.norm(self.latents.expand(x.shape[0], -1, -1)))
        scores = torch.matmul(queries, self.key(x).transpose(-1, -2)).softmax(-1)  # (B, latents, T)
        return self.out(torch.matmul(scores, x)).mean(1)


@pytest.mark.parametrize("batch", [5, 8])
def test_latents_expanded_over_the_batch_are_carried_on_one_row_whatever_the_batch_size(batch: int) -> None:
    """The chain on the expanded latents runs on their one row, so the product with the keys reads them as one matrix
    every example shares. Width 8: at a batch of 8 the norm's and the query's weights have a first dimension of the
    batch's size, which the chain took for rows that differ, and every parameter of the chain went to the exact path at
    that batch size only (the Perceiver's DP step at 0.07 of its non-private one at a batch of 32 = its latents'
    width); the probe, at another batch size, had planned none there."""
    x = torch.randn(batch, 4, 8, generator=generator(6), dtype=torch.float64)
    assert_exact_without_the_exact_path(LatentQueries(8), per_example_cross_entropy, x, torch.arange(batch) % 3)
