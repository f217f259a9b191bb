"""Per-operation clipping rules (dpml.train.rules): transformer blocks, transformers' BERT and GPT-2, peft
LoRA and hand-written parameter uses get per-example norms and clipped sums equal to a float64
per-example autograd loop, and the plan sends none of their parameters to the exact path."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection

import pytest
import torch
import torch.nn.functional as F
from test_clipping_check import loop_clipped_sum, relative_error
from torch import nn

from dpml.train.clipping import clip_factors, clipped_gradient_sum, engine_pass
from dpml.train.clipping_check import plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def loop_reference(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, clip: float, seed: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """∂ℓ_i/∂θ by one autograd call per example of one batched forward pass (random state ``seed``), clipped."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    torch.manual_seed(seed)
    losses = loss_fn(model(x), y)
    rows = [
        torch.autograd.grad(losses[i], list(params.values()), retain_graph=True, allow_unused=True)
        for i in range(x.shape[0])
    ]
    grads = {
        n: torch.stack([torch.zeros_like(p) if row[k] is None else row[k] for row in rows])
        for k, (n, p) in enumerate(params.items())
    }
    norms = sum(g.reshape(x.shape[0], -1).pow(2).sum(1) for g in grads.values()).sqrt()  # type: ignore[union-attr]
    factors = clip_factors(norms, clip)
    return {n: torch.einsum("b,b...->...", factors, g) for n, g in grads.items()}, norms


def assert_clipped_like_the_loop(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, exact: Collection[str] = ()
) -> torch.Tensor:
    """The engine's clipped sums and norms at C = 0.3 (whatever path each parameter takes; ``exact``: the plan's)
    equal the float64 per-example loop's (cross entropy, seed 0); the norms."""
    reference, norms = loop_reference(model, per_example_cross_entropy, x, y, 0.3, 0)
    sums, found_norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.3, exact=exact)
    torch.testing.assert_close(found_norms, norms, rtol=1e-10, atol=0)
    for name, expected in reference.items():
        torch.testing.assert_close(sums[name], expected, rtol=1e-10, atol=1e-12, msg=name)
    return norms


def assert_exact_without_the_exact_path(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    seed: int = 0,
    planned: bool = True,
    tolerance: float = 1e-10,
    plan_first: bool = False,
) -> None:
    """Clipped sums and norms equal the loop's (C = the median norm, so some examples are clipped) to
    ``tolerance`` (float64 rounding, unless the model computes in float32 itself), no parameter takes the
    exact path, and (``planned``) the probe plans none there either. ``plan_first``: the passes run under the plan
    (what only the probe may confirm: a constant read as the batch, :class:`dpml.train.exact_path.PlannedExact`)."""
    model = model.double()
    exact: Collection[str] = ()
    if plan_first:
        torch.manual_seed(seed)
        plan = plan_clipping(model, loss_fn, tuple(x.shape[1:]), x.dtype, probe=(x, y))
        assert plan.exact_parameters == () and plan.exact == frozenset(), plan.lines()
        exact = plan.exact
    torch.manual_seed(seed)
    found = engine_pass(model, loss_fn, x, y, exact)
    assert found.exact == {}, found.reasons
    reference, norms = loop_reference(model, loss_fn, x, y, 1.0, seed)
    clip = float(norms.median())
    reference, norms = loop_reference(model, loss_fn, x, y, clip, seed)
    torch.manual_seed(seed)
    sums, found_norms = clipped_gradient_sum(model, loss_fn, x, y, clip, exact=exact)
    total = math.sqrt(sum(float(r.norm()) ** 2 for r in reference.values()))
    errors = {n: float((sums[n] - r).norm()) / (float(r.norm()) + 1e-9 * total) for n, r in reference.items()}
    assert max(errors.values()) < tolerance, errors  # (a key bias's gradient is 0 up to rounding: softmax ignores it)
    torch.testing.assert_close(found_norms, norms, rtol=tolerance, atol=0)
    if planned:
        plan = plan_clipping(model, loss_fn, tuple(x.shape[1:]), x.dtype, probe=(x, y))
        assert plan.exact_parameters == () and plan.exact == frozenset(), plan.lines()


# --- hand-written uses of a parameter -----------------------------------------------------------------


class HandWritten(nn.Module):
    """A learned scale, a positional parameter added, a cls token concatenated, a weight used twice (once
    through its module, once through ``F.linear``, once transposed in a matmul), LoRA factors as matmuls,
    a packed projection split by ``chunk``, and a GPT-2-style ``torch.addmm`` on flattened rows (again with α and β)."""

    def __init__(self, width: int = 6, length: int = 5, rank: int = 2) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(width) + 0.5)
        self.pos = nn.Parameter(torch.randn(1, length + 3, width) * 0.3)
        self.cls = nn.Parameter(torch.randn(1, 1, width) * 0.3)
        self.lin = nn.Linear(width, width)
        self.lora_a = nn.Parameter(torch.randn(rank, width) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(width, rank) * 0.3)
        self.packed = nn.Parameter(torch.randn(3 * width, width) * 0.3)
        self.conv1d_weight = nn.Parameter(torch.randn(width, width) * 0.3)
        self.conv1d_bias = nn.Parameter(torch.randn(width) * 0.1)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        h = x * self.scale + self.pos[:, :length]
        h = torch.cat((self.cls.expand(batch, -1, -1), h), dim=1)
        h = torch.tanh(self.lin(h)) + F.linear(h, self.lin.weight) * 0.5 + h @ self.lin.weight.t() * 0.25
        h = h + (h @ self.lora_a.T) @ self.lora_b.T
        q, k, v = self.packed.chunk(3)
        h = torch.tanh(F.linear(h, q)) + torch.sigmoid(h @ k.t()) * F.linear(h, v)
        flat = torch.addmm(self.conv1d_bias, h.reshape(-1, width), self.conv1d_weight) + torch.addmm(
            self.conv1d_bias, h.reshape(-1, width), self.conv1d_weight, beta=0.5, alpha=-1.5
        )
        return self.out(torch.tanh(flat.view(batch, length + 1, width)).mean(1))


def test_hand_written_parameter_uses_are_exact_without_the_exact_path() -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 5, 6, generator=generator(1), dtype=torch.float64)
    assert_exact_without_the_exact_path(HandWritten(), per_example_cross_entropy, x, torch.randint(0, 3, (7,)))


class CachesAndRotations(nn.Module):
    """Trained keys put before the batch's as a key cache starts (``torch.cat([torch.tensor([]), keys], dim=-2)``,
    then the batch's keys after them), a weight joined from two slices of one parameter, and a rotation of each row's
    halves in groups, ``torch.stack((-x2, x1), dim=1)`` on rows flattened with the batch, scaled by parameters (peft's
    prefix tuning and RoAd)."""

    def __init__(self, width: int = 8, prefix: int = 3, group: int = 8) -> None:
        super().__init__()
        self.prefix = nn.Embedding(prefix, width)
        self.key = nn.Linear(width, width)
        self.joined = nn.Parameter(torch.randn(width + 2, width) * 0.3)
        self.turn = nn.Parameter(torch.randn(width))
        self.size = nn.Parameter(torch.rand(width) + 0.5)
        self.group = group
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        ids = torch.arange(self.prefix.num_embeddings).unsqueeze(0).expand(batch, -1)  # (as peft's prompt tokens)
        cache = torch.cat([torch.tensor([], dtype=x.dtype), self.prefix(ids)], dim=-2)
        keys = torch.cat([cache, self.key(x)], dim=-2)  # (B, P + T, d)
        attention = torch.softmax(x @ keys.transpose(1, 2), dim=-1) @ keys
        weight = torch.cat((self.joined[:2], self.joined[4:]))  # (d, d): rows 0, 1 and 4 … d + 1
        h = torch.tanh(F.linear(attention, weight))
        halves = h.reshape(-1, 2, self.group // 2)
        rotated = torch.stack((-halves[:, 1], halves[:, 0]), dim=1).reshape(h.shape)
        h = h * (self.size * self.turn.cos()) + rotated * (self.size * self.turn.sin())
        return self.out(h.mean(1))


def test_caches_joined_views_and_rotations_are_exact_without_the_exact_path() -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 5, 8, generator=generator(4), dtype=torch.float64)
    model = CachesAndRotations()
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, torch.randint(0, 3, (7,)))
    plan = plan_clipping(model, per_example_cross_entropy, (5, 8), torch.float64)
    assert {"prefix.weight", "joined", "turn", "size"} <= set(plan.rule_parameters), plan.lines()


class NewTokenRows(nn.Module):
    """A frozen vocabulary with the rows of a few new tokens trained (peft's trainable tokens: ``W.index_copy(0,
    rows, S)``), looked up by the batch's ids (padding 0) and used again as a tied output layer; or (``sliced``) the
    table's first rows also read through a view of it, which leaves it to the generic pull-back."""

    def __init__(self, vocabulary: int = 11, width: int = 6, rows: tuple[int, ...] = (2, 5, 9), sliced: bool = False):
        super().__init__()
        self.register_buffer("table", torch.randn(vocabulary, width))
        self.register_buffer("rows", torch.tensor(rows))
        self.new = nn.Parameter(torch.randn(len(rows), width))
        self.sliced = sliced
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T) ids
        table = self.table.index_copy(0, self.rows, self.new)
        h = torch.tanh(F.embedding(x, table, padding_idx=0))
        mixed = torch.softmax(h @ table.t(), dim=-1) @ self.table + (table[:4].sum(0) if self.sliced else 0)
        return self.out(torch.tanh(h + mixed).mean(1))


@pytest.mark.parametrize("sliced", [False, True], ids=["rows", "rows and a view"])
def test_new_token_rows_in_a_frozen_table_are_exact_without_the_exact_path(sliced: bool) -> None:
    torch.manual_seed(0)
    x = torch.randint(0, 11, (7, 5), generator=generator(6))
    x[:, 0] = torch.tensor([2, 5, 9, 2, 1, 0, 9])  # (the new tokens, padding, an old token)
    model = NewTokenRows(sliced=sliced)
    y = torch.randint(0, 3, (7,))
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, y)


def test_new_token_rows_given_twice_are_exact() -> None:
    """A row given twice (``index_copy``'s backward gives both its sources the row's gradient, whichever the forward
    kept): the rows' rule, which maps each id to one row of S, leaves such a table to the generic pull-back."""
    torch.manual_seed(0)
    x = torch.randint(0, 11, (7, 5), generator=generator(6))
    x[:, 0] = torch.tensor([2, 5, 9, 2, 1, 0, 9])
    model = NewTokenRows(rows=(2, 5, 2))
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, torch.randint(0, 3, (7,)))


def test_new_token_rows_never_form_the_whole_tables_per_example_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a keep limit below one example's gradient of the whole table (11 × 6 numbers), the generic pull-back
    cannot take the table (its rows read through a view too: the exact path, named), and the selected rows' forms
    need no such numbers (nothing on the exact path)."""
    x = torch.randint(0, 11, (7, 5), generator=generator(7))
    y = torch.randint(0, 3, (7,), generator=generator(8))
    monkeypatch.setattr("dpml.train.keep_budget.KEEP_PER_EXAMPLE_LIMIT", 65)
    found = engine_pass(NewTokenRows(sliced=True).double(), per_example_cross_entropy, x.clone(), y, ())
    assert set(found.exact) == {"new"} and "keep limit" in found.reasons["new"], found.reasons
    found = engine_pass(NewTokenRows().double(), per_example_cross_entropy, x, y, ())
    assert found.exact == {}, found.reasons


class SparseEntries(nn.Module):
    """A few trained entries of a frozen weight (peft's SHiRA): ``W.clone() += torch.sparse_coo_tensor(places,
    values * scale, W.shape)``, one place given twice (its two values add up), the weight used by a linear map; and a
    frozen table with trained entries, looked up by the batch's ids."""

    def __init__(self, width: int = 6, vocabulary: int = 9) -> None:
        super().__init__()
        self.register_buffer("weight", torch.randn(width, width) * 0.3)
        self.register_buffer("places", torch.tensor([[0, 2, 2, 5, 0], [1, 3, 3, 0, 4]]))
        self.values = nn.Parameter(torch.randn(5) * 0.5)
        self.register_buffer("table", torch.randn(vocabulary, width) * 0.5)
        self.register_buffer("cells", torch.tensor([[1, 4, 4, 7], [0, 2, 5, 5]]))
        self.cell_values = nn.Parameter(torch.randn(4))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T) ids
        table = self.table.clone()
        table += torch.sparse_coo_tensor(self.cells, self.cell_values, self.table.shape)
        h = F.embedding(x, table, padding_idx=0)
        weight = self.weight.clone()
        weight += torch.sparse_coo_tensor(self.places, self.values * 1.5, self.weight.shape)
        return self.out(torch.tanh(F.linear(torch.tanh(h), weight)).mean(1))


def test_trained_entries_of_a_frozen_weight_are_exact_without_the_exact_path() -> None:
    torch.manual_seed(0)
    x = torch.randint(0, 9, (7, 5), generator=generator(9))
    x[:, 0] = torch.tensor([1, 4, 7, 0, 4, 2, 1])
    model = SparseEntries()
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, torch.randint(0, 3, (7,)))
    plan = plan_clipping(model, per_example_cross_entropy, (5,), torch.long)
    assert set(plan.rule_parameters) == {"values", "cell_values"}, plan.lines()


class MixedRotation(nn.Module):
    """The rotation's halves joined with another example's rows (``roll`` along the batch): the join's rows hold two
    examples, so the parameter after it must not be clipped as if each row were one example's."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.turn = nn.Parameter(torch.randn(width))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = torch.stack((x, x.roll(1, 0)), dim=1).sum(1)  # (B, T, d): row i mixes examples i and i − 1
        return self.out((joined * self.turn).mean(1))


def test_a_join_of_rows_from_two_examples_is_not_clipped_by_a_rule() -> None:
    """(The probe refuses such a model outright; the engine on its own sends the parameter to the exact path.)"""
    x = torch.randn(7, 5, 8, generator=generator(5), dtype=torch.float64)
    found = engine_pass(MixedRotation().double(), per_example_cross_entropy, x, torch.randint(0, 3, (7,)), ())
    assert "turn" in found.exact, found.reasons


class IndexEquations(nn.Module):
    """Parameters entering through index equations: an einsum projection (the weight first and transposed), per-head
    weights in an einsum and in a batched matmul (x (B, H, T, d) @ w (H, d, e)), a bilinear form over positions,
    a vector contracted with an ellipsis, a weight expanded over the batch into ``torch.bmm``, on either side, and
    the same weight again through ``F.linear`` (uses of one weight by two operations: their cross terms)."""

    def __init__(self, width: int = 6, heads: int = 2) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.randn(width, width) * 0.3)
        self.heads = nn.Parameter(torch.randn(heads, width // heads, 4) * 0.3)
        self.heads_matmul = nn.Parameter(torch.randn(heads, 1, width // heads, 3) * 0.3)
        self.bilinear = nn.Parameter(torch.randn(width, width) * 0.2)
        self.gate = nn.Parameter(torch.randn(width) * 0.3)
        self.mix = nn.Parameter(torch.randn(width, width) * 0.3)
        self.left = nn.Parameter(torch.randn(5, 5) * 0.3)
        self.n_heads = heads
        self.out = nn.Linear(width + 2 * 4 + 2 * 3 + 1 + 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        h = torch.tanh(torch.einsum("oi,bti->bto", self.proj, x)) + 0.5 * F.linear(x, self.proj)
        split = h.view(batch, length, self.n_heads, -1).transpose(1, 2)  # (B, H, T, d)
        per_head = torch.einsum("bhtd,hde->bhe", split, self.heads).flatten(1)
        by_matmul = torch.tanh(split.unsqueeze(2) @ self.heads_matmul.unsqueeze(0)).mean(3).flatten(1)
        pairs = torch.einsum("bsi,bsi->b", torch.einsum("bti,ij->btj", h, self.bilinear), h).unsqueeze(1)
        gated = torch.einsum("...i,i", h, self.gate).mean(1, keepdim=True)
        mixed = torch.bmm(h, self.mix.expand(batch, -1, -1))
        mixed = torch.bmm(self.left.unsqueeze(0).expand(batch, -1, -1), torch.tanh(mixed))
        return self.out(torch.cat([mixed.mean(1), per_head, by_matmul, pairs, gated], 1))


def test_index_equations_and_batched_products_are_exact_without_the_exact_path() -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 5, 6, generator=generator(3), dtype=torch.float64)
    assert_exact_without_the_exact_path(IndexEquations(), per_example_cross_entropy, x, torch.randint(0, 3, (7,)))


def test_an_index_equation_summing_over_the_batch_is_left_to_the_exact_path_and_named() -> None:
    """A parameter multiplied by a batch statistic (the batch index summed away): no per-example rule applies."""

    class BatchMean(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3))
            self.out = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(x @ self.w) + torch.einsum("bi,ij->j", x, self.w).mean()

    found = engine_pass(
        BatchMean().double(),
        per_example_cross_entropy,
        torch.randn(5, 4, dtype=torch.float64),
        torch.randint(0, 2, (5,)),
    )
    assert (
        set(found.exact) == {"w"}
        and "torch.einsum: the batch index on the parameter or summed away" in found.reasons["w"]
    )


class ConvolutionTwice(nn.Module):
    """A convolution's kernel used by its layer and again by ``F.conv2d`` (stride 2, padding 1), a Conv1d's by
    ``F.conv1d``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.line = nn.Conv1d(3, 2, 2)
        self.out = nn.Linear(3 * 3 * 3 + 2 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        g = F.conv2d(h[:, :2], self.conv.weight, stride=2, padding=1)
        row = F.conv1d(h.mean(2), self.line.weight, self.line.bias, dilation=2) + torch.tanh(self.line(h.mean(3)))[
            ..., :3
        ].sum(-1, keepdim=True)
        return self.out(torch.cat([g.flatten(1), row.flatten(1)], 1))


def test_a_convolution_used_twice() -> None:
    torch.manual_seed(9)
    x = torch.randn(5, 2, 6, 6, generator=generator(12), dtype=torch.float64)
    assert_exact_without_the_exact_path(ConvolutionTwice(), per_example_cross_entropy, x, torch.randint(0, 3, (5,)))


class TiedLanguageModel(nn.Module):
    """Input embedding and output layer tied (``F.linear(h, emb.weight)``), positions looked up with ids (T,)
    shared by the batch, a padding index."""

    def __init__(self, vocabulary: int = 11, width: int = 6, length: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocabulary, width, padding_idx=0)
        self.positions = nn.Embedding(length, width)
        self.mix = nn.Linear(width, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.positions(torch.arange(tokens.shape[1]))
        return F.linear(torch.tanh(self.mix(h)), self.emb.weight)  # (B, T, V)


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy per example, (B,)."""
    batch, length, vocabulary = logits.shape
    return (
        F.cross_entropy(logits.reshape(-1, vocabulary), targets.reshape(-1), reduction="none")
        .view(batch, length)
        .mean(1)
    )


def test_tied_embeddings_get_the_norm_of_the_sum_of_their_uses() -> None:
    torch.manual_seed(1)
    tokens = torch.randint(0, 11, (6, 5), generator=generator(2))
    tokens[:, -1] = 0  # padding
    assert_exact_without_the_exact_path(
        TiedLanguageModel(), token_loss, tokens, torch.randint(0, 11, (6, 5), generator=generator(3))
    )


class Unruled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x = nn.Linear(4, 4)
        self.offset = nn.Parameter(torch.randn(4))
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reversed_ = torch.tanh(self.x(x)).flip(0)  # (the examples in reverse order: not run example by example)
        return self.out(torch.atan2(reversed_, torch.cumsum(self.offset, 0) + 2).flip(0))


def test_the_plan_names_each_exact_parameter_and_the_operation_that_sent_it_there() -> None:
    torch.manual_seed(2)
    model = Unruled().double()
    plan = plan_clipping(model, per_example_cross_entropy, (4,))
    assert plan.exact_parameters == ("offset",)
    assert any(line.startswith("offset: torch.atan2: no rule, and an operand") for line in plan.lines()), plan.lines()
    x, y = torch.randn(5, 4, dtype=torch.float64, generator=generator(3)), torch.randint(0, 2, (5,))
    sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.3, exact=plan.exact)
    reference, reference_norms = loop_clipped_sum(model, x, y, 0.3)
    assert relative_error(sums, reference) < 1e-10
    torch.testing.assert_close(norms, reference_norms, rtol=1e-10, atol=0)


class ComputedFromParameters(nn.Module):
    """Weights computed from parameters alone before they meet the batch: a cumulative sum, a bias concatenated
    with a constant (timm's BEiT and EVA: q, zeros, v), a position table interpolated (transformers' BEiT), a
    weight normalised by hand and through ``weight_norm`` (a parametrization), a product of two parameters, and
    the same weight used both directly and through its computation."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.randn(4))
        self.q_bias, self.v_bias = nn.Parameter(torch.randn(4) * 0.3), nn.Parameter(torch.randn(4) * 0.3)
        self.register_buffer("k_bias", torch.zeros(4), persistent=False)
        self.qkv = nn.Parameter(torch.randn(12, 4) * 0.3)
        self.table = nn.Parameter(torch.randn(1, 2, 3, 3) * 0.3)
        self.direction = nn.Parameter(torch.randn(4, 4))
        self.normed = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))
        self.low_a, self.low_b = nn.Parameter(torch.randn(4, 2) * 0.5), nn.Parameter(torch.randn(2, 4) * 0.5)
        self.out = nn.Linear(4 + 2 * 16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x + torch.cumsum(self.offset, 0))
        bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
        q, k, v = F.linear(h, self.qkv, bias).chunk(3, -1)
        h = torch.tanh(q * k + v)
        unit = self.direction / self.direction.norm(dim=1, keepdim=True)
        h = torch.tanh(
            F.linear(h, unit) + 0.5 * F.linear(h, self.direction) + self.normed(h) + h @ (self.low_a @ self.low_b)
        )
        scores = F.interpolate(self.table, size=(4, 4), mode="bilinear", align_corners=False)  # (1, 2, 4, 4)
        mixed = torch.tanh(h[:, None, :, None] * scores).flatten(1)
        return self.out(torch.cat([h, mixed], 1))


def test_weights_computed_from_parameters_alone_are_exact_without_the_exact_path() -> None:
    torch.manual_seed(20)
    x = torch.randn(6, 4, generator=generator(21), dtype=torch.float64)
    assert_exact_without_the_exact_path(
        ComputedFromParameters(), per_example_cross_entropy, x, torch.randint(0, 2, (6,))
    )


@pytest.mark.parametrize("limit", [6 * 64 - 1, 63], ids=["the batch's too many", "one example's too many"])
def test_a_computation_on_parameters_too_large_to_keep_per_example(monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
    """A weight_norm weight's per-example gradients are materialised to pull them back to g and v. Where the batch's
    B·n pass the keep limit but one example's n do not, they are formed again, a slice of examples at a time, for the
    clipped sum (nothing on the exact path); where one example's do, the parameters take the exact path (named, with
    the sizes). Exact either way."""
    torch.manual_seed(22)
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 2)).double()
    x, y = torch.randn(6, 8, generator=generator(23), dtype=torch.float64), torch.randint(0, 2, (6,))
    assert engine_pass(model, per_example_cross_entropy, x, y).exact == {}
    monkeypatch.setattr("dpml.train.keep_budget.KEEP_PER_EXAMPLE_LIMIT", limit)
    found = engine_pass(model, per_example_cross_entropy, x, y)
    originals = {n for n, _ in model.named_parameters() if ".original" in n}
    assert set(found.exact) == (originals if limit < 64 else set()), found.reasons
    assert all("exceed the keep limit" in found.reasons[n] and "(64 numbers)" in found.reasons[n] for n in found.exact)
    reference, _ = loop_clipped_sum(model, x, y, 0.4)
    sums, _ = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.4)
    assert relative_error(sums, reference) < 1e-10


class DetachedProduct(nn.Module):
    """DoRA's shape: the low-rank factors' product B·A formed from parameters alone, read only detached (for the
    norm of each output's row of W + B·A), the factors' own uses being the batch's products x·Aᵀ·Bᵀ."""

    def __init__(self, width: int = 8, rank: int = 2) -> None:
        super().__init__()
        self.register_buffer("base", torch.randn(width, width) * 0.3)
        self.a, self.b = nn.Parameter(torch.randn(rank, width) * 0.3), nn.Parameter(torch.randn(width, rank) * 0.3)
        self.magnitude = nn.Parameter(torch.rand(width) + 0.5)
        self.out = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = self.b @ self.a  # (width, width), from parameters alone
        scale = self.magnitude / (self.base + product.detach()).norm(dim=1)
        return self.out(torch.tanh((F.linear(x, self.base) + F.linear(F.linear(x, self.a), self.b)) * scale))


def test_a_weight_formed_from_parameters_and_read_only_detached_is_never_pulled_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No use reaches B·A: its per-example gradients are zeros, neither formed nor pulled back, so a keep limit below
    one example's B·A (64 numbers) sends nothing to the exact path; exact."""
    torch.manual_seed(23)
    x, y = torch.randn(6, 8, generator=generator(24), dtype=torch.float64), torch.randint(0, 2, (6,))
    monkeypatch.setattr("dpml.train.keep_budget.KEEP_PER_EXAMPLE_LIMIT", 63)
    found = engine_pass(DetachedProduct().double(), per_example_cross_entropy, x, y, ())
    assert found.exact == {}, found.reasons
    assert_exact_without_the_exact_path(DetachedProduct(), per_example_cross_entropy, x, y)


class MaskToken(nn.Module):
    """A mask token (DINOv2's, BEiT's) that replaces the masked positions only when the forward pass is given a
    mask: without one the loss never reaches it."""

    def __init__(self, masked: bool, width: int = 6) -> None:
        super().__init__()
        self.masked = masked
        self.mask_token = nn.Parameter(torch.randn(1, 1, width) * 0.3)
        self.embed, self.out = nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.masked:
            h = torch.where((x[..., :1] > 0.5), self.mask_token.to(h.dtype), h)
        return self.out(torch.tanh(h).mean(1))


@pytest.mark.parametrize("masked", [False, True])
def test_a_parameter_the_loss_does_not_reach_is_zero_without_the_exact_path(masked: bool) -> None:
    torch.manual_seed(24)
    x = torch.randn(6, 5, 6, generator=generator(25), dtype=torch.float64)
    assert_exact_without_the_exact_path(MaskToken(masked), per_example_cross_entropy, x, torch.randint(0, 3, (6,)))
    sums, _ = clipped_gradient_sum(
        MaskToken(masked).double(), per_example_cross_entropy, x, torch.randint(0, 3, (6,)), 0.5
    )
    assert (float(sums["mask_token"].abs().max()) > 0) == masked


# --- torch transformer blocks ---------------------------------------------------------------------------


class Encoder(nn.Module):
    """nn.TransformerEncoder on (B, T, D) with padding (features whose first entry is above 1 are padding)
    and optionally a causal mask; dropout in attention and feed-forward."""

    def __init__(self, causal: bool, width: int = 8, dropout: float = 0.1) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, 2, 16, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.causal = causal
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = x[..., 0] > 1.0
        padding[:, 0] = False
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype) if self.causal else None
        h = self.encoder(x, mask=mask, src_key_padding_mask=padding, is_causal=self.causal)
        keep = (~padding).unsqueeze(-1).to(h.dtype)
        return self.out((h * keep).sum(1) / keep.sum(1))


@pytest.mark.parametrize("causal", [False, True])
def test_transformer_encoder_with_padding_and_masks(causal: bool) -> None:
    torch.manual_seed(3)
    x = torch.randn(6, 5, 8, generator=generator(4), dtype=torch.float64)
    assert_exact_without_the_exact_path(
        Encoder(causal), per_example_cross_entropy, x, torch.randint(0, 3, (6,)), seed=7
    )


class CrossAttention(nn.Module):
    """nn.MultiheadAttention with separate query and key/value inputs (the packed weight split by ``chunk``)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.attention(x[:, :2], x, x * 0.5, need_weights=False)
        return self.out(h.mean(1))


def test_cross_attention_splits_the_packed_projection() -> None:
    torch.manual_seed(4)
    x = torch.randn(5, 4, 8, generator=generator(5), dtype=torch.float64)
    assert_exact_without_the_exact_path(CrossAttention(), per_example_cross_entropy, x, torch.randint(0, 3, (5,)))


class AttentionWithWeights(nn.Module):
    """nn.MultiheadAttention returning its averaged weights (the batched-matmul path, attention dropout on)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True, dropout=0.1)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, weights = self.attention(x, x, x, need_weights=True)
        return self.out(h.mean(1)) + weights.mean((1, 2))[:, None]


def test_attention_that_returns_its_weights() -> None:
    torch.manual_seed(12)
    x = torch.randn(5, 5, 8, generator=generator(15), dtype=torch.float64)  # batch = sequence length
    assert_exact_without_the_exact_path(
        AttentionWithWeights(), per_example_cross_entropy, x, torch.randint(0, 3, (5,)), seed=3
    )


# --- transformers and peft --------------------------------------------------------------------------------


class HuggingFace(nn.Module):
    """A transformers model on one LongTensor (B, 2, T): token ids and attention mask; returns ``.logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x[:, 0], attention_mask=x[:, 1]).logits


def ids_and_mask(batch: int, length: int, vocabulary: int, pad: int, seed: int) -> torch.Tensor:
    """Token ids with right padding of random lengths (padding tokens ``pad``), and the attention mask."""
    ids = torch.randint(1, vocabulary, (batch, length), generator=generator(seed))
    lengths = torch.randint(2, length + 1, (batch,), generator=generator(seed + 1))
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return torch.stack([ids.masked_fill(mask == 0, pad), mask], dim=1)


def tiny_bert(classes: int = 3) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.BertConfig(
        vocab_size=30,
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        num_labels=classes,
        pad_token_id=0,
        attn_implementation="eager",
    )
    return transformers.BertForSequenceClassification(config)


def tiny_gpt2_config(classes: int = 3):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    return transformers.GPT2Config(
        vocab_size=30,
        n_embd=8,
        n_layer=2,
        n_head=2,
        n_positions=16,
        num_labels=classes,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        attn_implementation="eager",
    )


def test_bert_for_sequence_classification() -> None:
    torch.manual_seed(5)
    x = ids_and_mask(6, 7, 30, 0, 6)
    assert_exact_without_the_exact_path(
        HuggingFace(tiny_bert()), per_example_cross_entropy, x, torch.randint(0, 3, (6,)), seed=8
    )


def test_gpt2_for_sequence_classification() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(6)
    model = transformers.GPT2ForSequenceClassification(tiny_gpt2_config())
    x = ids_and_mask(6, 7, 30, 0, 7)
    assert_exact_without_the_exact_path(
        HuggingFace(model), per_example_cross_entropy, x, torch.randint(0, 3, (6,)), seed=9
    )


def decoder_families():  # type: ignore[no-untyped-def]
    """Tiny decoders of other families: OPT (its last LayerNorm on the batch's rows flattened to (B·T, d)),
    Gemma (RMSNorm scaling by 1 + w), LLaMA (RMSNorm w ⊙ x̂, rotary positions, grouped key/value heads)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    common = {"vocab_size": 30, "num_labels": 3, "pad_token_id": 0, "max_position_embeddings": 16}
    return {
        "opt": lambda: transformers.OPTForSequenceClassification(
            transformers.OPTConfig(
                hidden_size=8, num_hidden_layers=1, num_attention_heads=2, ffn_dim=16, word_embed_proj_dim=8, **common
            )
        ),
        "gemma": lambda: transformers.GemmaForSequenceClassification(
            transformers.GemmaConfig(
                hidden_size=8,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=4,
                intermediate_size=16,
                **common,
            )
        ),
        "llama": lambda: transformers.LlamaForSequenceClassification(
            transformers.LlamaConfig(
                hidden_size=8,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                intermediate_size=16,
                **common,
            )
        ),
    }


@pytest.mark.parametrize("family", ["opt", "gemma", "llama"])
def test_decoders_of_other_families(family: str) -> None:
    torch.manual_seed(11)
    model = decoder_families()[family]()
    x = ids_and_mask(6, 7, 30, 0, 12)
    # Gemma's RMSNorm computes in float32 whatever the model's dtype (x.float(), 1 + w.float()): its weights'
    # gradients carry float32 rounding (ε = 1.2e-7) in the loop and in the engine alike.
    tolerance = 1e-6 if family == "gemma" else 1e-10
    assert_exact_without_the_exact_path(
        HuggingFace(model), per_example_cross_entropy, x, torch.randint(0, 3, (6,)), seed=13, tolerance=tolerance
    )


def test_a_shared_bias_inside_fused_attention_and_attention_windows() -> None:
    """Parameters every example shares that meet the batch inside a function without a closed form here: T5's
    relative-position bias as ``F.scaled_dot_product_attention``'s mask (through ``torch.where``), and Swin's,
    added to attention over windows whose first dimension is B × windows (per-row copies added up per
    example: :mod:`dpml.train.rules.broadcast`)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")

    class T5Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.T5Config(
                vocab_size=30, d_model=8, d_kv=4, d_ff=16, num_layers=2, num_heads=2, attn_implementation="sdpa"
            )
            self.encoder = transformers.T5EncoderModel(config)
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.encoder(input_ids=x[:, 0], attention_mask=x[:, 1]).last_hidden_state
            return self.head(hidden.mean(1))

    class Pixels(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(pixel_values=x).logits

    torch.manual_seed(12)
    assert_exact_without_the_exact_path(
        T5Classifier(), per_example_cross_entropy, ids_and_mask(6, 7, 30, 0, 14), torch.randint(0, 3, (6,)), seed=15
    )
    swin = transformers.SwinForImageClassification(
        transformers.SwinConfig(
            image_size=8, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=2, num_labels=3
        )
    )
    x = torch.randn(5, 3, 8, 8, generator=generator(16), dtype=torch.float64)
    assert_exact_without_the_exact_path(Pixels(swin), per_example_cross_entropy, x, torch.randint(0, 3, (5,)), seed=17)


class WindowAttention(nn.Module):
    """Swin-style attention written out: the image's tokens split into 2×2 windows ((B·windows, 4, C): each row
    of the first dimension is one example's window), a relative-position bias table indexed and added to the
    scores with ``+`` (timm's way), the windows merged back."""

    def __init__(self, channels: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(channels, 3 * channels)
        self.table = nn.Parameter(torch.randn(9, heads) * 0.5)
        coords = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(2), indexing="ij")).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + 1
        self.register_buffer("index", relative[..., 0] * 3 + relative[..., 1], persistent=False)
        self.head = nn.Linear(channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, size = x.shape[0], x.shape[1], x.shape[2]
        h = x.permute(0, 2, 3, 1).reshape(batch, size // 2, 2, size // 2, 2, channels)
        windows = h.permute(0, 1, 3, 2, 4, 5).reshape(-1, 4, channels)  # (B·windows, 4, C)
        q, k, v = self.qkv(windows).reshape(-1, 4, 3, self.heads, channels // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.table[self.index.view(-1)].view(4, 4, self.heads).permute(2, 0, 1)
        attention = torch.softmax(q @ k.transpose(-2, -1) * 0.5 + bias.unsqueeze(0), -1)
        out = (attention @ v).transpose(1, 2).reshape(-1, 4, channels)
        return self.head(torch.tanh(out).reshape(batch, -1, channels).mean(1))


def test_a_bias_shared_by_attention_windows() -> None:
    torch.manual_seed(18)
    x = torch.randn(5, 4, 4, 4, generator=generator(19), dtype=torch.float64)
    assert_exact_without_the_exact_path(WindowAttention(), per_example_cross_entropy, x, torch.randint(0, 3, (5,)))


def test_gpt2_language_model_with_tied_embeddings() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(7)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    assert model.lm_head.weight is model.transformer.wte.weight
    x = ids_and_mask(5, 6, 30, 0, 8)
    assert_exact_without_the_exact_path(
        HuggingFace(model), token_loss, x, torch.randint(0, 30, (5, 6), generator=generator(9)), seed=10
    )


def test_peft_lora_on_a_frozen_bert() -> None:
    peft = pytest.importorskip("peft", reason="peft is not installed")
    torch.manual_seed(8)
    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["query", "value"], lora_dropout=0.1, modules_to_save=["classifier"]
    )
    model = peft.get_peft_model(tiny_bert(), config)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "classifier" in n for n in trainable)
    x = ids_and_mask(6, 7, 30, 0, 10)
    assert_exact_without_the_exact_path(
        HuggingFace(model), per_example_cross_entropy, x, torch.randint(0, 3, (6,)), seed=11
    )


class VisionTransformer(nn.Module):
    """transformers' ViT (cls token concatenated, position embeddings added as a parameter) on (B, C, H, W)."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers", reason="transformers is not installed")
        config = transformers.ViTConfig(
            image_size=8,
            patch_size=4,
            num_channels=2,
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=16,
            num_labels=3,
            attn_implementation="eager",
        )
        self.model = transformers.ViTForImageClassification(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).logits


def test_vit_cls_token_and_position_embeddings() -> None:
    torch.manual_seed(10)
    x = torch.randn(5, 2, 8, 8, generator=generator(13), dtype=torch.float64)
    assert_exact_without_the_exact_path(VisionTransformer(), per_example_cross_entropy, x, torch.randint(0, 3, (5,)))


class InPlace(nn.Module):
    """Ruled outputs modified in place afterwards: ``F.linear(…)`` then ``mul_``, ``h += pos`` then ``h *= scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 6) * 0.4)
        self.pos = nn.Parameter(torch.randn(4, 6) * 0.3)
        self.scale = nn.Parameter(torch.rand(6) + 0.5)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.weight)
        h.mul_(1.5)
        h += self.pos
        h *= self.scale
        return self.out(torch.tanh(h).mean(1))


def test_outputs_modified_in_place_after_their_operation() -> None:
    torch.manual_seed(11)
    x = torch.randn(6, 4, 6, generator=generator(14), dtype=torch.float64)
    assert_exact_without_the_exact_path(InPlace(), per_example_cross_entropy, x, torch.randint(0, 3, (6,)))


# --- sweeps --------------------------------------------------------------------------------------------------


@pytest.mark.exhaustive
@pytest.mark.parametrize("batch", [1, 2, 5, 7])
@pytest.mark.parametrize("seed", range(3))
def test_sweep_batch_sizes_including_the_sequence_length(batch: int, seed: int) -> None:
    """Batches equal to the sequence length (5) are where a batch dimension moved by a transpose could be
    mistaken for another: the example maps must still find each example's rows."""
    torch.manual_seed(seed)
    x = torch.randn(batch, 5, 8, generator=generator(seed), dtype=torch.float64)
    y = torch.randint(0, 3, (batch,), generator=generator(seed + 1))
    for model in (Encoder(causal=seed % 2 == 1), CrossAttention(), HandWritten(width=8)):
        assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, y, seed=seed, planned=False)
    tokens = ids_and_mask(batch, 5, 30, 0, seed)
    assert_exact_without_the_exact_path(
        HuggingFace(tiny_bert()), per_example_cross_entropy, tokens, y, seed=seed, planned=False
    )
