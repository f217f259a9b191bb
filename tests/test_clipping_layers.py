"""Per-example clipping through Embedding, LayerNorm and GroupNorm (activations and output gradients
only), mixed with parameters that still need per-example vmap, against a one-example-at-a-time loop."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_dpsgd import naive_clipped_sum_and_norms
from torch import nn

from dpml import devices
from dpml.train import (
    clipping,
    clipping_candidates,
    clipping_conv,
    clipping_conv_ways,
    clipping_layers,
    clipping_norms,
    keep_budget,
)
from dpml.train.clipping import clipped_gradient_sum
from dpml.train.clipping_check import plan_clipping
from dpml.train.clipping_norms import clipped_outer_sum, self_gram, shared_grams, without_silent_positions
from dpml.train.dpsgd import per_example_cross_entropy


def assert_matches_naive_loop(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float, most_clipped: bool = True
) -> None:
    sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, clip)
    reference, reference_norms = naive_clipped_sum_and_norms(model, x, y, clip)
    assert set(sums) == set(reference)
    for name in reference:
        torch.testing.assert_close(sums[name], reference[name], rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(norms, reference_norms, rtol=1e-10, atol=1e-12)
    if most_clipped:
        assert float((reference_norms > clip).double().mean()) > 0.75


def randomise_affine(model: nn.Module) -> nn.Module:
    """Normalisation layers start at γ = 1, β = 0: move them off that point."""
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.LayerNorm, nn.GroupNorm)):
                for p in (module.weight, module.bias):
                    if p is not None:
                        p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype) + 0.5)
    return model


def labels(n: int, classes: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))


# --- Embedding -------------------------------------------------------------------------------------------


class Bag(nn.Module):
    """Embedding → mean over positions → Linear."""

    def __init__(self, vocabulary: int = 7, dim: int = 5, padding_idx: int | None = 0, sparse: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, dim, padding_idx=padding_idx, sparse=sparse)
        self.out = nn.Linear(dim, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.out(h.reshape(h.shape[0], -1, h.shape[-1]).mean(1))


def tokens(shape: tuple[int, ...], vocabulary: int = 7, seed: int = 1) -> torch.Tensor:
    """Few distinct tokens over many positions: most examples repeat tokens (and hold the padding token 0)."""
    return torch.randint(0, vocabulary, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("padding_idx", [None, 0, -1])
@pytest.mark.parametrize("shape", [(20, 9), (20, 2, 4), (20,)])
def test_embedding_matches_naive_loop(padding_idx: int | None, shape: tuple[int, ...], vmapped: list) -> None:
    torch.manual_seed(10)
    model = Bag(padding_idx=padding_idx).double()
    x = tokens(shape)
    assert x.dim() == 1 or all(len(set(row.tolist())) < row.numel() for row in x.reshape(shape[0], -1))  # repeats
    for clip in (0.02, 1e3):
        assert_matches_naive_loop(model, x, labels(shape[0]), clip, most_clipped=clip < 1)
    if padding_idx is not None:
        sums, _ = clipped_gradient_sum(model, per_example_cross_entropy, x, labels(shape[0]), 0.02)
        assert not sums["embed.weight"][model.embed.padding_idx].any()
    assert vmapped == []


def test_embedding_norms_equal_the_gram_formula() -> None:
    """‖∇W_i‖² = Σ_{t,s} [k_t = k_s](δ_t·δ_s), with a large vocabulary and long, repetitive sequences."""
    g = torch.Generator().manual_seed(2)
    tokens_ = torch.randint(0, 5, (6, 40), generator=g) * 1000  # vocabulary 5000, five tokens in use
    d = torch.randn(6, 40, 3, generator=g, dtype=torch.float64)
    equal = (tokens_[:, :, None] == tokens_[:, None, :]).double()
    expected = (equal * torch.bmm(d, d.transpose(1, 2))).sum((1, 2))
    torch.testing.assert_close(clipping_layers.embedding_norms_squared(tokens_, d, 5000), expected, rtol=1e-12, atol=0)


def test_sparse_embedding_gives_the_dense_result() -> None:
    torch.manual_seed(11)
    dense = Bag().double()
    sparse = Bag(sparse=True).double()
    sparse.load_state_dict(dense.state_dict())
    x, y = tokens((16, 6)), labels(16)
    expected, expected_norms = clipped_gradient_sum(dense, per_example_cross_entropy, x, y, 0.05)
    got, norms = clipped_gradient_sum(sparse, per_example_cross_entropy, x, y, 0.05)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-12, atol=0)
    torch.testing.assert_close(norms, expected_norms, rtol=1e-12, atol=0)


# --- LayerNorm -------------------------------------------------------------------------------------------


class NormedMlp(nn.Module):
    """Linear → LayerNorm → ReLU → Linear, on inputs (B, *positions, 6)."""

    def __init__(self, bias: bool = True, inplace: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8, eps=1e-3, bias=bias)
        self.act = nn.ReLU(inplace=inplace)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.norm(self.inp(x)))
        return self.out(h.reshape(h.shape[0], -1, 8).mean(1))


@pytest.mark.parametrize("positions", [(), (5,), (2, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_naive_loop(positions: tuple[int, ...], bias: bool, vmapped: list) -> None:
    torch.manual_seed(12)
    model = randomise_affine(NormedMlp(bias)).double()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, *positions, 6, generator=g, dtype=torch.float64) * 2
    assert_matches_naive_loop(model, x, labels(24), 0.05)
    assert vmapped == []


class NormOverTwoDims(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm((4, 3))
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 4, 3)
        return self.out(torch.tanh(self.norm(x)).mean(1).flatten(1))


def test_layer_norm_over_two_trailing_dims_matches_naive_loop(vmapped: list) -> None:
    torch.manual_seed(13)
    model = randomise_affine(NormOverTwoDims()).double()
    x = torch.randn(16, 5, 4, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    assert_matches_naive_loop(model, x, labels(16), 0.05)
    assert vmapped == []


def test_frozen_layer_norm_weight_is_left_out() -> None:
    torch.manual_seed(14)
    model = randomise_affine(NormedMlp()).double()
    model.norm.weight.requires_grad_(False)
    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert_matches_naive_loop(model, x, labels(12), 0.05)
    assert "norm.weight" not in clipped_gradient_sum(model, per_example_cross_entropy, x, labels(12), 0.05)[0]


# --- GroupNorm -------------------------------------------------------------------------------------------


class NormedCnn(nn.Module):
    """Conv2d → GroupNorm → ReLU → flatten → Linear, on size × size images."""

    def __init__(self, groups: int, inplace: bool = False, size: int = 5) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 6, 3, padding=1)
        self.norm = nn.GroupNorm(groups, 6, eps=1e-4)
        self.act = nn.ReLU(inplace=inplace)
        self.out = nn.Linear(6 * size * size, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.norm(self.conv(x))).flatten(1))


@pytest.mark.parametrize("size", [5, 6], ids=["recomputed", "folded"])
@pytest.mark.parametrize("groups", [1, 2, 6])
def test_group_norm_matches_naive_loop(groups: int, size: int, vmapped: list) -> None:
    """Below ``FOLDED_GROUP_NORM_MIN_POSITIONS`` positions a channel (5 × 5) x̂ is recomputed; from it up (6 × 6) ATen's
    GroupNorm kernels run on the batch folded into the channels."""
    assert 5 * 5 < clipping_norms.FOLDED_GROUP_NORM_MIN_POSITIONS <= 6 * 6
    torch.manual_seed(15)
    model = randomise_affine(NormedCnn(groups, size=size)).double()
    x = torch.randn(14, 2, size, size, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    for clip in (0.05, 1e3):
        assert_matches_naive_loop(model, x, labels(14), clip, most_clipped=clip < 1)
    assert vmapped == []


class GroupNormOnVectors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 6): no spatial dimensions
        return self.out(torch.tanh(self.norm(x)))


def test_group_norm_without_spatial_dims_matches_naive_loop() -> None:
    torch.manual_seed(16)
    model = randomise_affine(GroupNormOnVectors()).double()
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 3
    assert_matches_naive_loop(model, x, labels(16), 0.05)


# --- Fast layers mixed with the vmap path ------------------------------------------------------------------


class Scale(nn.Module):
    """A custom module with its own parameter: a learned elementwise scale (only vmap knows it)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale


class Mixed(nn.Module):
    """Embedding → Scale → LayerNorm → mean → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(9, 4, padding_idx=0)
        self.scale = Scale(4)
        self.norm = nn.LayerNorm(4)
        self.out = nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.scale(self.embed(tokens))).mean(1))


def test_fast_layers_mixed_with_a_custom_parameter(vmapped: list) -> None:
    torch.manual_seed(17)
    model = randomise_affine(Mixed()).double()
    x = tokens((18, 7), vocabulary=9, seed=8)
    assert_matches_naive_loop(model, x, labels(18), 0.05)
    assert vmapped == []  # the custom parameter (h * scale) by the elementwise rule, not the per-example vmap


# --- Cases the shortcuts must not take ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "model", [nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)), nn.BatchNorm1d(6)]
)
def test_batch_norm_is_refused(model: nn.Module) -> None:
    x = torch.randn(8, 6)
    where = "model layer '1'" if isinstance(model, nn.Sequential) else "the model"
    with pytest.raises(ValueError, match=rf"{where} \(BatchNorm1d\):.*use nn.GroupNorm or nn.LayerNorm"):
        clipped_gradient_sum(model, per_example_cross_entropy, x, labels(8), 1.0)


@pytest.mark.parametrize("groups", [None, 2])
def test_in_place_activation_after_a_fast_layer(groups: int | None, vmapped: list) -> None:
    """ReLU(inplace=True) overwrites the recorded layer output; its δ comes through the edge recorded with it."""
    torch.manual_seed(18)
    if groups is None:
        model = randomise_affine(NormedMlp(inplace=True)).double()
        x = torch.randn(12, 6, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    else:
        model = randomise_affine(NormedCnn(groups, inplace=True)).double()
        x = torch.randn(12, 2, 5, 5, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    assert_matches_naive_loop(model, x, labels(12), 0.05)
    assert vmapped == []


class Residual(nn.Module):
    """Conv → GroupNorm → ReLU(inplace) → Conv → GroupNorm, ``out += x`` in place, ReLU(inplace): ResNet's block,
    whose norms' recorded outputs the in-place operations overwrite. ``extra``: one more in-place ReLU on the
    first convolution's output, for a pass that goes another way than the earlier ones."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(2, 2, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)
        self.norm1, self.norm2 = nn.GroupNorm(1, 2), nn.GroupNorm(2, 2)
        self.out = nn.Linear(2 * 4 * 4, 3)
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(x)
        if self.extra:
            h = torch.relu_(h)
        h = torch.relu_(self.norm1(h))
        h = self.norm2(self.conv2(h))
        h += x
        return self.out(torch.relu_(h).flatten(1))


def test_outputs_overwritten_in_place_are_read_through_their_recorded_edges_in_one_forward_pass() -> None:
    """ResNet's block rewrites its norms' recorded outputs in place (``relu_``, ``out += x``), and with ``extra``
    its first convolution's too: each output's δ comes through the gradient edge kept when it was made, so
    every step is one forward pass with no copies, and matches the per-example loop (pins reading δ from the
    rewritten tensors, which gives the δ after the ReLU, and the former second pass with copies)."""
    torch.manual_seed(21)
    model = randomise_affine(Residual()).double()
    passes = []
    model.register_forward_pre_hook(lambda module, inputs: passes.append(1))
    x = torch.randn(10, 2, 4, 4, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    for extra in (False, True, True):
        model.extra = extra
        passes.clear()
        sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, labels(10), 0.05)
        assert len(passes) == 1, extra
        assert not clipping._OVERWRITTEN_OUTPUTS.get(model)
        passes.clear()
        reference, reference_norms = naive_clipped_sum_and_norms(model, x, labels(10), 0.05)
        for name in reference:
            torch.testing.assert_close(sums[name], reference[name], rtol=1e-10, atol=1e-12, msg=name)
        torch.testing.assert_close(norms, reference_norms, rtol=1e-10, atol=1e-12)


class OverwrittenViews(nn.Module):
    """Two parameters through ``einsum``, whose outputs are views (of a batched product): the first's output is
    modified in place by ``relu_``, and with ``extra`` the second's too. A view's recorded edge does not survive
    an in-place rewrite (autograd rebases its base), so these are the outputs passed on as copies."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(5, 4)), nn.Parameter(torch.randn(3, 5))
        self.out = nn.Linear(3 * 4, 3)
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 4, 4)
        h = torch.relu_(torch.einsum("bti,oi->bto", x, self.w1))
        g = torch.einsum("bto,po->btp", h, self.w2)
        if self.extra:
            g = torch.relu_(g)
        return self.out(torch.tanh(g).flatten(1))


def test_views_overwritten_in_place_are_copied_where_they_were_in_one_forward_pass_after_the_first() -> None:
    """The first pass finds the overwritten views and runs the forward pass again with copies; later passes copy
    just those from the start (one forward pass); a pass that overwrites another view is found and redone, so
    every pass matches the per-example loop."""
    torch.manual_seed(22)
    model = OverwrittenViews().double()
    passes = []
    model.register_forward_pre_hook(lambda module, inputs: passes.append(1))
    x = torch.randn(10, 4, 4, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    learnt: frozenset = frozenset()
    for extra, expected in ((False, [2, 1, 1]), (True, [2, 1])):
        model.extra = extra
        for step, count in enumerate(expected):
            passes.clear()
            sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, labels(10), 0.05)
            assert len(passes) == count, (extra, step)
        assert clipping._OVERWRITTEN_OUTPUTS[model] > learnt
        learnt = clipping._OVERWRITTEN_OUTPUTS[model]
        assert len(learnt) == (2 if extra else 1)  # the overwritten views only
        passes.clear()
        reference, reference_norms = naive_clipped_sum_and_norms(model, x, labels(10), 0.05)
        for name in reference:
            torch.testing.assert_close(sums[name], reference[name], rtol=1e-10, atol=1e-12, msg=name)
        torch.testing.assert_close(norms, reference_norms, rtol=1e-10, atol=1e-12)


class ReadsOneToken(nn.Module):
    """Two Linear layers on (B, T, 6), the second read at its first position only (as a classifier reads [CLS]):
    the second layer's δ_t is zero at every other position, for every example; the first layer's is not."""

    def __init__(self) -> None:
        super().__init__()
        self.mix, self.last, self.out = nn.Linear(6, 6), nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(x))
        h = h + h.mean(1, keepdim=True)
        return self.out(torch.tanh(self.last(h))[:, 0])


def positions_kept(monkeypatch: pytest.MonkeyPatch, owner: Any) -> list[tuple[int, int]]:
    """Watches ``owner.without_silent_positions``: the positions before and after, for each call."""
    kept = []
    original = owner.without_silent_positions

    def spy(a: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = original(a, d)
        kept.append((d.shape[1], out[1].shape[1]))
        return out

    monkeypatch.setattr(owner, "without_silent_positions", spy)
    return kept


def test_positions_where_no_example_has_a_gradient_are_left_out_and_the_sums_stay_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(22)
    model = ReadsOneToken().double()
    x = torch.randn(10, 7, 6, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    kept = positions_kept(monkeypatch, clipping_layers)
    assert_matches_naive_loop(model, x, labels(10), 0.05)
    # last (one position left), mix (all); out, at one position, is not asked: one position is never dropped
    assert sorted(kept) == [(7, 1), (7, 7)]


class ReadsOneTokenRuled(ReadsOneToken):
    """The same through transformers' ``Conv1D`` (``torch.addmm``: the operation rules, ∇_W = Σ_t a_t δ_tᵀ)."""

    def __init__(self) -> None:
        super().__init__()
        conv1d = pytest.importorskip("transformers.pytorch_utils", reason="transformers is a test extra").Conv1D
        self.mix, self.last = conv1d(6, 6), conv1d(5, 6)


def test_a_ruled_product_leaves_out_the_positions_where_either_factor_is_zero_for_every_example(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``last``'s δ_t is zero but at the first position; the batch is zero from the fourth position on (padding), so
    ``mix``'s input rows a_t are: neither product reads those positions, and the sums stay exact."""
    from dpml.train.rules import combine

    torch.manual_seed(22)
    model = ReadsOneTokenRuled().double()
    x = torch.randn(10, 7, 6, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    x[:, 3:] = 0
    kept = positions_kept(monkeypatch, combine)
    assert_matches_naive_loop(model, x, labels(10), 0.05)
    # mix: its δ live everywhere, its input at 3 of 7; last: its δ at 1 of 7, then nothing more to drop
    assert sorted(kept) == [(1, 1), (7, 1), (7, 3), (7, 7)]


@pytest.mark.parametrize(
    ("live", "kept"),
    [
        ([{0}, {2}, set()], [0, 2]),  # the first example's one live position does not settle it: the union is kept
        ([{0}, {1, 2, 3}, {6}], None),  # 5 of 7 live, though the first example has one: nothing dropped
        ([{0, 1, 2, 3}, set(), set()], None),  # the first example alone has more than half: settled by it
        ([{5}, {5}, {1, 5}], [1, 5]),
        ([set(), set(), set()], [0]),  # nothing live: one position left, so that shapes stay (B, ≥1, …)
        ([{0, 1, 2}, {3}, set()], None),  # exactly half silent in the first example, 4 of 7 live in all
        ([{0, 1, 2}, set(), {2}], [0, 1, 2]),  # 3 of 7 live: dropped, though the first example holds them all
    ],
)
def test_the_positions_left_out_are_those_silent_in_every_example(live: list[set[int]], kept: list[int] | None) -> None:
    """δ (3 examples, 7 positions, 2 × 2): a position is left out only where every example's δ_t is zero, whichever
    example it is live in; a NaN counts as live. Nothing is dropped unless at least half the positions are silent."""
    generator = torch.Generator().manual_seed(5)
    a = torch.randn(3, 7, 4, generator=generator, dtype=torch.float64)
    d = torch.zeros(3, 7, 2, 2, dtype=torch.float64)
    for example, positions in enumerate(live):
        for t in positions:
            d[example, t, t % 2, 1] = float("nan") if (example, t) == (1, 2) else 1.0 + t
    out_a, out_d = without_silent_positions(a, d)
    if kept is None:
        assert out_a is a and out_d is d
        return
    assert torch.equal(out_a, a[:, kept])
    torch.testing.assert_close(out_d, d[:, kept], equal_nan=True, rtol=0, atol=0)


class TiedLanguageModel(nn.Module):
    """Embedding weight shared with the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(tokens).mean(1))


def test_tied_weights_are_covered_by_the_rules_of_their_operations(vmapped: list) -> None:
    torch.manual_seed(20)
    assert_matches_naive_loop(TiedLanguageModel().double(), tokens((12, 5), vocabulary=6), labels(12, 6), 0.05)
    assert vmapped == []  # lookup and F.linear, with their cross terms: no exact path


class Attention(nn.Module):
    """nn.MultiheadAttention uses out_proj's weights without calling its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attention(x, x, x, need_weights=False)[0].mean(1))


def test_a_fast_layer_whose_forward_never_runs_is_covered_by_the_rules_of_its_operations(vmapped: list) -> None:
    torch.manual_seed(21)
    x = torch.randn(10, 3, 4, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    assert_matches_naive_loop(Attention().double(), x, labels(10), 0.05)
    assert vmapped == []  # out_proj's weights through F.linear inside F.multi_head_attention_forward


# --- Conv2d: grouped-convolution per-example gradients, ghost norms, weight-gradient sums ----------------


class Convs(nn.Module):
    """Two convolutions of rectangular kernels, strides, paddings and dilations, one without bias."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2))  # T = 72 > C_out
        self.deep = nn.Conv2d(3, 12, 3, stride=2, bias=False)  # T = 10 ≤ C_out
        self.out = nn.Linear(12 * 2 * 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.deep(torch.tanh(self.wide(x)))).flatten(1))


@pytest.mark.parametrize("keep, slice_elements", [(True, 1 << 19), (True, 1300), (False, 1 << 19), (False, 1000)])
def test_conv_layers_match_naive_loop(
    keep: bool, slice_elements: int, monkeypatch: pytest.MonkeyPatch, vmapped: list
) -> None:
    """Every Conv2d path equals the one-example-at-a-time loop. Kept (keep): both layers materialise, ``wide``
    by a grouped convolution (T > C_out) and its sums come from the kept gradients, ``deep`` from its
    patches a slice of examples at a time (T ≤ C_out: all 9 in one slice, or 2 per slice with the last
    one short) and its sums by the weight-gradient convolution. Not kept: ``wide`` still materialises
    for its norms (T² > C_in·kh·kw·C_out), ``deep`` takes the ghost norm, from its patches a slice of
    examples at a time on the CPU (all 9 in one slice, or 2 per slice with the last one short: 10·27 +
    2·10² = 470 a row), and both sums come from the weight-gradient convolution."""
    if not keep:
        monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 0)
    monkeypatch.setattr(clipping_conv, "PATCH_SLICE_ELEMENTS", slice_elements)  # deep: 10·27 + 12·27 = 594 a row
    torch.manual_seed(3)
    model = Convs().double()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 2, 11, 10, generator=g, dtype=torch.float64)
    limit = keep_budget.keep_limit(torch.device("cpu"))
    assert clipping_layers.materialise(9, 72, 6, 3, limit) and clipping_layers.materialise(9, 10, 27, 12, limit) == keep
    assert_matches_naive_loop(model, x, labels(9), 0.05)
    assert vmapped == []


@pytest.mark.parametrize("model_name", ["convs", "sequence mlp"])
def test_kept_gradients_in_heap_sized_slices_match_naive_loop(model_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-example gradients kept in slices of examples (each block below the heap's mmap threshold, here
    made 2 examples' worth: 2, 2, …, 1) give the one-example-at-a-time loop's norms and clipped sums; the
    slices cover the batch in order, at least one example each, one slice on a GPU."""
    if model_name == "convs":
        model, x, per_example = Convs().double(), torch.randn(9, 2, 11, 10, dtype=torch.float64), 3 * 2 * 3 * 2
    else:
        model, x, per_example = NormedMlp().double(), torch.randn(9, 2, 3, 6, dtype=torch.float64), 8 * 6
    monkeypatch.setattr(devices, "HEAP_BLOCKS_BELOW", devices.HEAP_BLOCK_MARGIN + 2 * 8 * per_example + 7)
    monkeypatch.setattr(
        keep_budget, "KEEP_SHARE", 1e9
    )  # kept whatever the share of the pass (tests/test_keep_budget.py)
    kept: list[list[int]] = []
    kept_sum = clipping_layers.kept_sum

    def spy(factors: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
        kept.append([part.shape[0] for part in parts])
        return kept_sum(factors, parts)

    monkeypatch.setattr(clipping_layers, "kept_sum", spy)
    torch.manual_seed(3)
    assert_matches_naive_loop(model, x, labels(9), 0.05, most_clipped=False)
    assert [2, 2, 2, 2, 1] in kept
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert devices.heap_sized_slices(9, 8 * per_example, cpu) == [
        slice(0, 2),
        slice(2, 4),
        slice(4, 6),
        slice(6, 8),
        slice(8, 9),
    ]
    assert devices.heap_sized_slices(3, 1 << 40, cpu) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert devices.heap_sized_slices(9, 8 * per_example, gpu) == [slice(0, 9)]
    assert devices.heap_sized_slices(0, 8, cpu) == [slice(0, 0)]


class Conv1ds(nn.Module):
    """Two Conv1d layers, one of them called twice (its calls' positions concatenate), and a frozen bias."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv1d(3, 5, 4, stride=2, padding=2, dilation=2)
        self.shared = nn.Conv1d(5, 5, 3, padding=1, bias=False)
        self.out = nn.Linear(5 * 5, 3)
        self.first.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        return self.out(h.flatten(1))


@pytest.mark.parametrize("keep", [True, False])
def test_conv1d_layers_match_naive_loop(keep: bool, monkeypatch: pytest.MonkeyPatch, vmapped: list) -> None:
    """Conv1d takes the dense shortcut (the Conv2d of height 1): materialised and kept (whatever the pass's share,
    tests/test_keep_budget.py), or ghost-normed."""
    monkeypatch.setattr(keep_budget, "KEEP_SHARE", 1e9)
    if not keep:
        monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 0)
    torch.manual_seed(5)
    model = Conv1ds().double()
    x = torch.randn(8, 3, 12, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    assert model.first(x).shape[2] == 5
    assert_matches_naive_loop(model, x, labels(8), 0.05)
    assert vmapped == []  # no parameter took the exact path
    plan = plan_clipping(model, per_example_cross_entropy, (3, 12), torch.float64)
    assert {"first", "shared"} <= set(plan.fast_layers) and plan.exact == frozenset()


class GroupedConvs(nn.Module):
    """Depthwise with padding="same", groups = 2 with a stride (called twice), a grouped Conv1d with
    padding="valid", and a "same" Conv1d of even kernel (uneven padding: the exact path)."""

    def __init__(self) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(4, 8, 3, padding="same", groups=4, dilation=2)
        self.pair = nn.Conv2d(8, 8, 2, stride=2, groups=2, bias=False)
        self.line = nn.Conv1d(8, 6, 3, padding="valid", groups=2)
        self.uneven = nn.Conv1d(6, 3, 4, padding="same")
        self.out = nn.Linear(3 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.depthwise(x))  # (B, 8, 8, 8)
        h = torch.tanh(self.pair(torch.tanh(self.pair(h))))  # (B, 8, 2, 2)
        h = torch.tanh(self.line(h.flatten(2)))  # (B, 6, 2)
        return self.out(torch.tanh(self.uneven(h)).flatten(1))  # (B, 3, 2)


@pytest.mark.parametrize("keep", [True, False])
def test_grouped_and_same_padded_convolutions_match_naive_loop(
    keep: bool, monkeypatch: pytest.MonkeyPatch, vmapped: list
) -> None:
    """Kept: the per-example gradients of the whole batch at once; not kept: one example per slice and the
    clipped sums by the weight-gradient convolution. Only the uneven "same" layer takes the exact path."""
    if not keep:
        monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 0)
    torch.manual_seed(7)
    model = GroupedConvs().double()
    x = torch.randn(7, 4, 8, 8, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    assert_matches_naive_loop(model, x, labels(7), 0.05)
    assert vmapped == [["uneven.weight", "uneven.bias"]]
    plan = plan_clipping(model, per_example_cross_entropy, (4, 8, 8), torch.float64)
    assert {"depthwise", "pair", "line"} <= set(plan.fast_layers) and plan.exact == frozenset()


def test_conv_per_example_gradients_equal_autograd() -> None:
    conv = nn.Conv2d(3, 4, (4, 3), stride=(2, 3), padding=(2, 1), dilation=(1, 2)).double()
    x = torch.randn(5, 3, 12, 13, dtype=torch.float64)
    delta = torch.randn_like(conv(x))
    expected = torch.stack(
        [torch.autograd.grad((conv(x[i : i + 1]) * delta[i : i + 1]).sum(), conv.weight)[0] for i in range(5)]
    )
    got = clipping_conv_ways.per_example_conv_gradients("grouped forward", conv, x, delta)
    torch.testing.assert_close(got.reshape(expected.shape), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("channels", [3, 8])
def test_per_example_gradients_by_the_weight_gradient_equal_autograd(channels: int) -> None:
    """The grouped weight-gradient way gives the same per-example gradients as autograd, one example at a
    time, for rectangular kernels, strides, paddings and dilations."""
    conv = nn.Conv2d(channels, 4, (4, 3), stride=(2, 3), padding=(2, 1), dilation=(1, 2)).double()
    x = torch.randn(5, channels, 12, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    delta = torch.randn_like(conv(x))
    expected = torch.stack(
        [torch.autograd.grad((conv(x[i : i + 1]) * delta[i : i + 1]).sum(), conv.weight)[0] for i in range(5)]
    )
    got = clipping_conv_ways.per_example_conv_gradients("weight gradient", conv, x, delta)
    torch.testing.assert_close(got.reshape(expected.shape), expected, rtol=1e-10, atol=1e-12)


def test_each_conv_way_is_picked_by_device_and_shape() -> None:
    way = clipping_conv_ways.per_example_conv_way
    assert way("cpu", 16, 784, 64) == "weight gradient"  # T > C_out, at least 8 input channels
    assert way("cpu", 3, 1024, 16) == "grouped forward"  # T > C_out, an image of few channels
    assert way("cpu", 64, 49, 256) == "patch slices"  # T ≤ C_out
    assert way("cuda", 64, 784, 64) == way("cuda", 1, 196, 16) == "patches"


@pytest.mark.parametrize(
    ("layer", "size", "compiled"),
    [
        (nn.Conv2d(16, 32, 4, 2), 13, True),  # the Opacus CNN's second: 1.1× the ghost norm's multiply-adds
        (nn.Conv2d(128, 128, 3, padding=1), 14, True),  # 2.2× the input Gram's
        (nn.Conv2d(64, 64, 3, padding=1), 8, True),  # 2.6×
        (nn.Conv2d(128, 256, 3, 2, padding=1), 14, False),  # 4.3×
        (nn.Conv2d(256, 256, 3, padding=1), 7, False),  # 12.5× the input Gram's
        (nn.Conv2d(128, 128, 3, padding=1), 4, False),  # 12×
    ],
)
def test_a_layer_that_keeps_nothing_takes_the_compiled_norms_where_they_cost_least(
    layer: nn.Conv2d, size: int, compiled: bool
) -> None:
    """Norms that keep no per-example gradient come from the compiled kernel up to ``COMPILED_GHOST_RATIO`` times
    the ghost norm's multiply-adds (the shapes measured for it), else from the ghost norm."""
    geometry = clipping_conv.conv_geometry(layer)
    assert geometry is not None
    out = layer(torch.zeros(1, layer.in_channels, size, size))
    count = out[0, 0].numel()
    assert (
        clipping_conv.compiled_beats_ghost(
            out.new_empty(1, layer.in_channels, size, size).shape, count, layer.out_channels, geometry
        )
        is compiled
    )


def test_a_gpu_keeps_per_example_gradients_in_proportion_to_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU a layer keeps at most ``KEEP_PER_EXAMPLE_LIMIT`` elements; on a GPU that many per 4 GiB of
    the device's memory (never fewer than the CPU's), so a limit patched to 0 keeps nothing anywhere."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert keep_budget.keep_limit(cpu) == keep_budget.KEEP_PER_EXAMPLE_LIMIT == 1 << 25
    for memory, times in ((143771 << 20, 35), (80 << 30, 20), (24 << 30, 6), (2 << 30, 1)):
        monkeypatch.setattr(keep_budget, "_gpu_memory", lambda index, memory=memory: memory)
        assert keep_budget.keep_limit(gpu) == times << 25, memory
    # what the limit decides: a 128→128 3×3 layer at 14×14 for 512 examples (75M elements) is ghost-normed
    # within the CPU's limit and materialised within an H200's
    assert not clipping_layers.materialise(512, 196, 1152, 128, 1 << 25)
    assert clipping_layers.materialise(512, 196, 1152, 128, 35 << 25)
    monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 0)
    assert keep_budget.keep_limit(cpu) == keep_budget.keep_limit(gpu) == 0


class WideConvs(nn.Module):
    """Eight input channels and more positions than output channels: the grouped weight-gradient way."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv2d(8, 8, 3, padding=1)
        self.second = nn.Conv2d(8, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2))
        self.out = nn.Linear(4 * 5 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.second(torch.tanh(self.first(x)))).flatten(1))


@pytest.mark.parametrize("keep", [True, False])
def test_convolutions_of_eight_channels_match_naive_loop(
    keep: bool, monkeypatch: pytest.MonkeyPatch, vmapped: list
) -> None:
    if not keep:
        monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 0)
    torch.manual_seed(10)
    model = WideConvs().double()
    x = torch.randn(6, 8, 9, 8, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    assert model.second(model.first(x)).shape[2:] == (5, 6)
    assert clipping_conv_ways.per_example_conv_way("cpu", 8, 72, 8) == "weight gradient"
    assert clipping_layers.materialise(6, 72, 72, 8, keep_budget.keep_limit(torch.device("cpu")))  # kept or not
    assert_matches_naive_loop(model, x, labels(6), 0.05)
    assert vmapped == []


class TwoBranches(nn.Module):
    """Two dense layers and two convolutions whose outputs are added: autograd hands each pair one and the
    same gradient tensor (``AddBackward`` passes it on to both), so a shortcut that scaled its δ in place
    would scale its partner's too."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_a, self.conv_b = nn.Conv2d(2, 6, 3, stride=2), nn.Conv2d(2, 6, 3, stride=2)  # T = 9 ≤ C_out
        self.left, self.right = nn.Linear(6 * 9, 5), nn.Linear(6 * 9, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv_a(x) + self.conv_b(x)).flatten(1)
        return self.out(torch.tanh(self.left(h) + self.right(h)))


def test_layers_whose_outputs_are_added_match_naive_loop(vmapped: list) -> None:
    torch.manual_seed(12)
    model = TwoBranches().double()
    x = torch.randn(7, 2, 7, 7, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    a, b = model.conv_a(x), model.conv_b(x)
    grad_a, grad_b = torch.autograd.grad((a + b).tanh().sum(), [a, b])
    assert grad_a.data_ptr() == grad_b.data_ptr()  # the premise: one gradient tensor for both
    assert_matches_naive_loop(model, x, labels(7), 0.05)
    assert vmapped == []


# --- The compiled convolution norms (float32 on the CPU) ---------------------------------------------------

COMPILED_GEOMETRIES = [  # (C_in, C_out, kernel, stride, padding, dilation, (H, W), batch)
    (1, 16, 8, 2, 3, 1, (28, 28), 9),  # the Opacus example CNN's first convolution
    (16, 32, 4, 2, 0, 1, (13, 13), 7),  # its second: T = 25 ≤ C_out
    (3, 5, (3, 2), (2, 1), (4, 0), (1, 3), (9, 11), 5),  # rectangular, padding past the kernel, dilation
    (7, 6, 1, 3, 0, 1, (10, 8), 4),  # 1×1, stride past the kernel
    (20, 3, 5, 1, 2, 2, (6, 7), 3),  # C_in·K = 500: several column blocks and a partial one
    (2, 9, (2, 5), (3, 2), (1, 2), (2, 1), (5, 9), 6),  # C_out = 9: a partial block of output channels
    (3, 4, (2, 6), 1, (1, 3), 1, (7, 10), 3),  # a kernel width of no specialised copy (6)
    (32, 9, (3, 2), (2, 1), (2, 0), (1, 2), (9, 8), 5),  # direct: two vectors a kernel offset, partial blocks
    (16, 4, 1, 2, 0, 1, (7, 9), 4),  # direct 1×1 strided: one vector, a 16-column block
]
BEYOND_THE_PATCH_WAY = (48, 5, 3, 1, 1, 1, (17, 18), 3)  # direct at T = 306 > COMPILED_MAX_POSITIONS; a 48-column tail
# each geometry by the patch way, and those whose C_in is a multiple of 16 by the direct way too
COMPILED_CASES = [(g, True) for g in [*COMPILED_GEOMETRIES, BEYOND_THE_PATCH_WAY] if g[0] % 16 == 0] + [
    (g, False) for g in COMPILED_GEOMETRIES
]


def compiled_kernel(tmp_path) -> object:  # type: ignore[no-untyped-def]
    """``_conv_norms.c`` compiled here, into an empty cache: a broken C file fails the tests using it."""
    from dpml.train import kernels

    if kernels.c_compiler() is None:
        pytest.skip("no C compiler here: the convolutions' norms take the torch ways (tested above)")
    library = kernels.compile_kernel(tmp_path, kernels.CONV_SOURCE, kernels.CONV_FLAGS)
    assert library is not None, "the C compiler failed on _conv_norms.c"
    kernel = kernels.load_conv_norms(library)
    assert kernel is not None
    return kernel


@pytest.mark.parametrize(
    "geometry, direct",
    COMPILED_CASES,
    ids=lambda g: (
        ("direct" if g else "patches") if isinstance(g, bool) else f"{g[0]}x{g[1]}-k{g[2]}-s{g[3]}-p{g[4]}-d{g[5]}"
    ),
)
def test_compiled_convolution_norms_equal_autograd(
    geometry: tuple,
    direct: bool,
    tmp_path,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each example's weight gradient (kept) and its squared norm from the compiled kernel, by its direct way
    (columns in (u, v, c) order) or its patch way, equal autograd's, one example at a time in float64, to
    float32 rounding; and the same bits whether torch runs one or two threads (each example is one thread's
    work) or the kept gradients come two examples to a slice."""
    kernel = compiled_kernel(tmp_path)
    monkeypatch.setattr(clipping_conv, "compiled_conv_norms", lambda: kernel)
    channels, out_channels, size, stride, padding, dilation, (height, width), batch = geometry
    if not direct:
        monkeypatch.setattr(clipping_conv, "direct_way", lambda in_channels: False)
    conv = nn.Conv2d(channels, out_channels, size, stride=stride, padding=padding, dilation=dilation)
    g = torch.Generator().manual_seed(len(str(geometry)))
    x = torch.randn(batch, channels, height, width, generator=g)
    delta = torch.randn(conv(x).shape, generator=g)
    exact = conv.double()
    expected = torch.stack(
        [
            torch.autograd.grad((exact(x[i : i + 1].double()) * delta[i : i + 1].double()).sum(), exact.weight)[
                0
            ].reshape(out_channels, -1)
            for i in range(batch)
        ]
    )
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(clipping_conv.compiled_norms(x, delta, clipping_conv.conv_geometry(conv), keep=True))
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(devices, "HEAP_BLOCKS_BELOW", devices.HEAP_BLOCK_MARGIN + 2 * 4 * expected[0].numel())
    results.append(clipping_conv.compiled_norms(x, delta, clipping_conv.conv_geometry(conv), keep=True))
    assert [len(part) for part in results[-1][1]] == [2] * (batch // 2) + [1] * (batch % 2)  # type: ignore[index]
    assert all(found[2] == direct for found in results)  # type: ignore[index]
    (squared, grads), *others = [(found[0], torch.cat(found[1])) for found in results]  # type: ignore[index]
    assert all(torch.equal(squared, other[0]) and torch.equal(grads, other[1]) for other in others)
    if direct:  # (B, C_out, kh, kw, C_in) to the weight's order
        grads = (
            grads.reshape(batch, out_channels, *conv.kernel_size, channels)
            .permute(0, 1, 4, 2, 3)
            .reshape(batch, out_channels, -1)
        )
    scale = float(expected.abs().max())
    torch.testing.assert_close(grads.double(), expected, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(squared.double(), expected.pow(2).sum((1, 2)), rtol=2e-5, atol=0.0)
    alone, none, _ = clipping_conv.compiled_norms(x, delta, clipping_conv.conv_geometry(conv), keep=False)  # type: ignore[misc]
    assert none is None and torch.equal(alone, squared)
    assert clipping_conv.compiled_norms(x.double(), delta.double(), clipping_conv.conv_geometry(conv), True) is None
    for layout in LAYOUTS:  # the same numbers read where they lie: the same bits as from contiguous tensors
        at = clipping_conv.conv_geometry(conv)
        found = clipping_conv.compiled_norms(laid_out(x, layout), laid_out(delta, layout), at, True)
        assert found is not None and torch.equal(found[0], squared), layout
        assert torch.equal(torch.cat(found[1]).reshape(grads.shape), torch.cat(results[0][1]).reshape(grads.shape))  # type: ignore[index]


LAYOUTS = ["channels last", "rows apart", "inside a larger tensor", "examples interleaved"]


def laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A (B, C, H, W) tensor with the same numbers in another layout of memory: channels last (a model run in
    ``torch.channels_last``, or ConvNeXt's LayerNorm2d permuted back), each row's positions apart (a transposed
    map: its positions are not one stride apart), a view inside a larger padded tensor, the batch innermost."""
    if layout == "channels last":
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "rows apart":
        return t.transpose(2, 3).contiguous().transpose(2, 3)
    if layout == "inside a larger tensor":
        batch, channels, height, width = t.shape
        larger = torch.full((batch, channels + 2, height + 1, width + 3), float("nan"), dtype=t.dtype)
        view = larger[:, 1 : channels + 1, 1:, 2 : width + 2]
        return view.copy_(t)
    assert layout == "examples interleaved"
    return t.permute(1, 2, 3, 0).contiguous().permute(3, 0, 1, 2)


INPUT_GRAM_GEOMETRIES = [  # stride-1 (C_in, C_out, kernel, padding, dilation, (H, W)): P² < T²·kh·kw
    (5, 4, 3, 1, 1, (7, 7)),  # WRN-16-4's 7×7 layers' shape
    (3, 2, (3, 2), (2, 0), (2, 1), (8, 6)),  # rectangular kernel, padding on one axis, dilation on the other
    (4, 3, 5, 2, 1, (5, 6)),
    (2, 6, 3, 0, 1, (9, 7)),  # no padding
]


@pytest.mark.parametrize("slice_elements", [1 << 22, 2000])
@pytest.mark.parametrize(
    "geometry", INPUT_GRAM_GEOMETRIES, ids=lambda g: f"{g[0]}x{g[1]}-k{g[2]}-p{g[3]}-d{g[4]}-{g[5]}"
)
def test_ghost_norms_from_the_input_gram_equal_autograd(
    geometry: tuple, slice_elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ghost norm of a stride-1 convolution from the Gram matrix of its padded input's positions (all
    examples at once, or one per slice) equals ‖∇_W ℓ_i‖² of autograd, one example at
    a time in float64; it is taken where it pays, not for a strided or 1×1 unpadded convolution."""
    monkeypatch.setattr(clipping_conv, "INPUT_GRAM_SLICE_ELEMENTS", slice_elements)
    channels, out_channels, size, padding, dilation, (height, width) = geometry
    conv = nn.Conv2d(channels, out_channels, size, padding=padding, dilation=dilation).double()
    g = torch.Generator().manual_seed(height * width)
    x = torch.randn(7, channels, height, width, generator=g, dtype=torch.float64)
    delta = torch.randn(conv(x).shape, generator=g, dtype=torch.float64)
    expected = torch.stack(
        [
            torch.autograd.grad((conv(x[i : i + 1]) * delta[i : i + 1]).sum(), conv.weight)[0].pow(2).sum()
            for i in range(7)
        ]
    )
    geo = clipping_conv.conv_geometry(conv)
    assert geo is not None and clipping_conv.input_gram_pays(x.shape, delta[0, 0].numel(), geo)
    found = clipping_conv.patch_slice_norms_squared(x, delta.flatten(2), geo, ghost=True)
    torch.testing.assert_close(found, expected, rtol=1e-10, atol=0.0)
    strided = clipping_conv.conv_geometry(nn.Conv2d(channels, out_channels, size, stride=2, padding=padding))
    assert not clipping_conv.input_gram_pays(x.shape, 16, strided)  # type: ignore[arg-type]
    assert not clipping_conv.input_gram_pays(x.shape, height * width, ((1, 1), (1, 1), (0, 0), (1, 1)))


@pytest.mark.parametrize("keep", [True, False])
def test_a_float32_cnn_clips_alike_with_and_without_the_compiled_norms(
    keep: bool, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The engine on a float32 CNN (both of the Opacus example's convolution shapes, kept and not kept; with
    nothing kept the second is ghost-normed by the torch ways and normed by the kernel instead):
    norms and clipped sums with the compiled kernel equal those of the torch ways to float32 rounding."""
    if not keep:
        monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 0)
        assert not clipping_layers.materialise(33, 25, 256, 32, 0)
        assert clipping_conv.compiled_beats_ghost(
            torch.Size((33, 16, 13, 13)), 25, 32, ((4, 4), (2, 2), (0, 0), (1, 1))
        )
    kernel = compiled_kernel(tmp_path)
    torch.manual_seed(14)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 8, 2, padding=3),
        nn.ReLU(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, 2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 5 * 5, 10),
    )
    x, y = torch.randn(33, 1, 28, 28, generator=torch.Generator().manual_seed(15)), labels(33, 10)
    monkeypatch.setattr(clipping_conv, "compiled_conv_norms", lambda: None)
    reference, reference_norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.5)
    monkeypatch.setattr(clipping_conv, "compiled_conv_norms", lambda: kernel)
    sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.5)
    torch.testing.assert_close(norms, reference_norms, rtol=1e-5, atol=1e-6)
    for name in reference:
        torch.testing.assert_close(sums[name], reference[name], rtol=1e-4, atol=1e-5, msg=name)
    assert float((reference_norms > 0.5).float().mean()) > 0.5
    wide = ((3, 3), (1, 1), (1, 1), (1, 1))  # T = 17 × 17 > COMPILED_MAX_POSITIONS: a torch way is faster there
    assert clipping_conv.compiled_norms(torch.randn(2, 3, 17, 17), torch.randn(2, 4, 17, 17), wide, False) is None
    assert clipping_conv.compiled_norms(torch.randn(2, 16, 17, 17), torch.randn(2, 4, 17, 17), wide, False) is not None


class DoubledLinear(nn.Module):
    """Holds a Linear's own parameters and uses them through ``F.linear`` in a forward of its own: swapped in for
    that Linear, the model keeps the same trainable parameters, so its kept fast-layer candidates go stale."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * nn.functional.linear(x, self.weight, self.bias)


def test_the_fast_candidates_are_found_once_and_a_stale_list_stays_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three passes walk the model's modules once; after a layer is swapped for a module that holds the same
    parameters (the kept list names a layer no longer called), the sums still match the per-example loop: the
    parameters take the rule of ``F.linear``, with the doubled output's gradient."""
    torch.manual_seed(23)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    walks = []
    original = clipping_candidates.find_fast_candidates

    def counted(*args: object) -> list[nn.Module]:
        walks.append(1)
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(clipping_candidates, "find_fast_candidates", counted)
    for _ in range(3):
        assert_matches_naive_loop(model, x, labels(12), 0.05)
    assert len(walks) == 1
    model[2] = DoubledLinear(model[2])
    assert_matches_naive_loop(model, x, labels(12), 0.05)
    assert len(walks) == 1  # the same parameters: the stale list was used


def test_a_gram_asked_again_within_a_pass_is_formed_once_and_only_for_the_same_numbers() -> None:
    """Within ``shared_grams`` the Gram matrix of the same numbers (a new view of them with the same layout) is the one
    formed before; other numbers get their own: another layout of the same storage, the operand changed in place, and
    a new tensor made after the first was let go (the entry holds its operand, so no new tensor takes its memory while
    it is remembered). Outside the block nothing is remembered."""
    g = torch.Generator().manual_seed(0)
    storage = torch.randn(24, 5, dtype=torch.float64, generator=g)

    def view() -> torch.Tensor:
        return storage.view(4, 6, 5)  # (B, T, n)

    def gram(t: torch.Tensor) -> torch.Tensor:
        return torch.bmm(t, t.transpose(1, 2))

    assert self_gram(view()) is not self_gram(view())
    with shared_grams():
        first = self_gram(view())
        assert self_gram(view()) is first
        storage.mul_(2)  # (while the first Gram is still remembered)
        torch.testing.assert_close(self_gram(view()), gram(view()), rtol=0, atol=0)
        other = storage.view(6, 4, 5)  # the same storage read as another batch
        torch.testing.assert_close(self_gram(other), gram(other), rtol=0, atol=0)
        strided = storage.view(6, 4, 5).transpose(0, 1)
        torch.testing.assert_close(self_gram(strided), gram(strided), rtol=0, atol=0)
        for _ in range(8):  # fresh tensors of one size (large enough for the allocator to reuse its blocks), let go
            fresh = torch.randn(4, 64, 64, dtype=torch.float64, generator=g)
            torch.testing.assert_close(self_gram(fresh), gram(fresh), rtol=0, atol=0)
            del fresh


@pytest.mark.parametrize("layouts", [("batch", "batch"), ("time", "time"), ("time", "batch"), ("batch", "time")])
@pytest.mark.parametrize("widths", [(7, 3), (3, 7)])
def test_a_clipped_outer_sum_pairs_each_examples_positions_whatever_the_operands_layouts(
    layouts: tuple[str, str], widths: tuple[int, int]
) -> None:
    """Σ_i c_i Σ_t δ_{i,t} a_{i,t}ᵀ from operands laid out batch-major (B, T, ·) or time-major (T, B, ·) read as
    (B, T, ·) views, each scaled side (the narrower), equals the sum over examples and positions one by one."""
    g = torch.Generator().manual_seed(1)
    batch, length = 4, 5

    def operand(layout: str, width: int) -> torch.Tensor:
        if layout == "batch":
            return torch.randn(batch, length, width, dtype=torch.float64, generator=g)
        return torch.randn(length, batch, width, dtype=torch.float64, generator=g).transpose(0, 1)

    d, a = operand(layouts[0], widths[0]), operand(layouts[1], widths[1])
    factors = torch.rand(batch, dtype=torch.float64, generator=g)
    expected = sum(factors[i] * d[i, t][:, None] * a[i, t][None, :] for i in range(batch) for t in range(length))
    torch.testing.assert_close(clipped_outer_sum(d, a, factors), expected, rtol=1e-12, atol=1e-14)


def test_the_grams_a_pass_remembers_are_the_last_asked_for() -> None:
    """Attention's order: the query's input a and δ_q, the key's a (remembered) and δ_k, the value's a: still
    remembered, since asking for it again made it the last let go."""
    g = torch.Generator().manual_seed(2)
    a, d_q, d_k = (torch.randn(2, 3, 4, dtype=torch.float64, generator=g) for _ in range(3))
    with shared_grams():
        first = self_gram(a)
        self_gram(d_q)
        assert self_gram(a) is first
        self_gram(d_k)
        assert self_gram(a) is first


class ChannelsLastNet(nn.Module):
    """A ConvNeXt-like network in ``torch.channels_last``: a strided stem, a depthwise 3×3, LayerNorm2d as
    ConvNeXt writes it (permute, layer norm over the channels, permute back: a channels-last view), 1×1 layers of
    16 and of 12 input channels (the compiled kernel's direct and patch ways), GroupNorm, a residual sum."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 2, stride=2)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.norm = nn.LayerNorm(16)
        self.up = nn.Conv2d(16, 12, 1)
        self.down = nn.Conv2d(12, 16, 1)
        self.group_norm = nn.GroupNorm(4, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.norm(self.depthwise(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = x + self.down(torch.tanh(self.up(y)))
        return self.head(self.group_norm(x).mean((2, 3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_a_model_in_channels_last_memory_format_matches_the_naive_loop(
    dtype: torch.dtype, tmp_path, monkeypatch: pytest.MonkeyPatch, vmapped: list
) -> None:  # type: ignore[no-untyped-def]
    """A model and its inputs in ``torch.channels_last`` (what oneDNN and tensor cores prefer): the norms and clipped
    sums equal the float64 naive loop's (in float32 to float32 rounding, the convolutions' norms by the compiled
    kernel reading the channels-last tensors in place; in float64 by the torch ways), nothing on the exact path."""
    reads: list[bool] = []
    if dtype == torch.float32:
        kernel = compiled_kernel(tmp_path)
        monkeypatch.setattr(clipping_conv, "compiled_conv_norms", lambda: kernel)
        run = clipping_conv._run_kernel

        def counted(x: torch.Tensor, d: torch.Tensor, shape: torch.Tensor, squared, grads) -> None:  # type: ignore[no-untyped-def]
            reads.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
            run(x, d, shape, squared, grads)

        monkeypatch.setattr(clipping_conv, "_run_kernel", counted)
    torch.manual_seed(21)
    model = ChannelsLastNet().to(dtype=dtype, memory_format=torch.channels_last)
    x = torch.randn(6, 3, 10, 10, generator=torch.Generator().manual_seed(22), dtype=dtype)
    x, y = x.contiguous(memory_format=torch.channels_last), labels(6)
    plan = plan_clipping(model, per_example_cross_entropy, tuple(x.shape[1:]), dtype)
    assert not plan.exact
    reference, reference_norms = naive_clipped_sum_and_norms(copy.deepcopy(model).double(), x.double(), y, 0.05)
    sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.05)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(norms.double(), reference_norms, rtol=tolerance, atol=0.0)
    for name, expected in reference.items():
        assert float((sums[name].double() - expected).norm() / expected.norm()) < tolerance, name
    assert float((reference_norms > 0.05).double().mean()) > 0.75
    assert vmapped == []
    if dtype == torch.float32:  # the kernel ran on channels-last inputs, read in place
        assert reads and any(reads)
