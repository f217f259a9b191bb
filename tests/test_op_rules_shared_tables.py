"""Linear maps on inputs computed from parameters alone (``dpml/train/rules/linear_on_parameters.py``): DeBERTa's
relative position table, normed and projected by the very query and key layers the tokens go through, its rows then
gathered by each pair's relative position. The layer's weight gradient is handed on factored and joined with its
uses on the tokens: clipped sums and norms equal a float64 per-example loop, nothing takes the exact path, and a
keep limit below B × |W| (which the generic pull-back would form) sends nothing there either."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_clipping_check import loop_clipped_sum, relative_error
from test_op_rules import HuggingFace, assert_exact_without_the_exact_path, generator, ids_and_mask
from torch import nn

from dpml.train.clipping import clipped_gradient_sum, engine_pass
from dpml.train.dpsgd import per_example_cross_entropy


class Conv1D(nn.Module):
    """transformers' GPT-2 ``Conv1D`` (a weight (n_in, n_out), ``torch.addmm``), written out so the test needs no
    library: its rows flattened, as there."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.3)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight, alpha=0.7)
        return flat.reshape(*x.shape[:-1], -1)


class RelativePositions(nn.Module):
    """Token ids (B, T) → disentangled attention (DeBERTa, He et al. 2021, eq. 4): scores q·k + q·P_k[δ] + k·P_q[δ]
    with P = proj(LayerNorm(table)) from parameters alone and δ the relative position clamped to the table's 2·span
    rows. ``projection``: ``linear`` (nn.Linear, shared with the tokens'), ``addmm`` (a Conv1D, shared too),
    ``matmul`` (``table @ W.t() + b`` with the shared layers' own weight and bias), ``mlp`` (a layer, GELU, then the
    shared layer: a linear call on parameters that another such call feeds), ``expanded``
    (the table expanded over the batch first, as a carried row: :func:`dpml.train.rules.derived.first_rows`)."""

    def __init__(self, projection: str, span: int, vocab: int = 13, width: int = 8) -> None:
        super().__init__()
        self.projection, self.span = projection, span
        self.embed = nn.Embedding(vocab, width)
        self.table = nn.Parameter(torch.randn(2 * span, width))
        self.norm = nn.LayerNorm(width)
        layer = Conv1D if projection == "addmm" else nn.Linear
        self.query, self.key = layer(width, width), layer(width, width)
        self.inner = nn.Linear(width, width)
        self.out = nn.Linear(width, 3)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (B, T, width)
        batch, length = ids.shape
        table = self.norm(self.table)  # (2·span, width): parameters alone
        if self.projection == "mlp":
            table = F.gelu(self.inner(table))
        if self.projection == "expanded":
            table = table.unsqueeze(0).expand(batch, -1, -1)
        if self.projection == "matmul":  # (the layers' weights on the right, transposed views: x @ Wᵀ + b)
            pos_key = table @ self.key.weight.t() + self.key.bias
            pos_query = torch.matmul(table, self.query.weight.t()) + self.query.bias
        else:
            pos_key, pos_query = self.key(table), self.query(table)
        q, k = self.query(h), self.key(h)
        steps = torch.arange(length)
        relative = (steps[:, None] - steps[None, :]).clamp(-self.span, self.span - 1) + self.span
        index = relative.expand(batch, length, length)
        c2p = torch.matmul(q, pos_key.transpose(-1, -2)).gather(-1, index)
        p2c = torch.matmul(k, pos_query.transpose(-1, -2)).gather(-1, index).transpose(-1, -2)
        scores = (torch.matmul(q, k.transpose(-1, -2)) + c2p + p2c) / 3.0
        return self.out(torch.tanh(torch.matmul(scores.softmax(-1), h)).mean(1))


def _ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, 13, (batch, length), generator=generator(31))


@pytest.mark.parametrize("projection", ["linear", "addmm", "matmul", "mlp", "expanded"])
@pytest.mark.parametrize(
    ("span", "length"),
    [(2, 5), (4, 2), (6, 13)],
    ids=["every row reached", "rows no pair reaches", "more rows than the layer's outputs"],
)
def test_a_layer_on_a_table_of_parameters_is_exact_without_the_exact_path(
    projection: str, span: int, length: int
) -> None:
    """At 2 tokens and span 4, relative positions reach 3 of the table's 8 rows: the others' δ is zero for every
    example (left out on a CPU) and their gradients must come back zero, the rest exact. At span 6 the table's 12 rows
    outnumber the layer's 8 outputs: its weight's gradients are formed, not factored."""
    torch.manual_seed(30)
    model = RelativePositions(projection, span)
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, _ids(6, length), torch.arange(6) % 3)


@pytest.mark.parametrize("projection", ["linear", "addmm", "matmul"])
def test_a_keep_limit_below_the_layers_per_example_gradients_takes_nothing_exactly(
    projection: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table is 4 rows of 8, the shared layer's weight 8 × 8: a keep limit of 6 · 64 − 1 numbers holds the batch's
    gradients of the table and of the layer's output (6 · 32) but not of its weight (6 · 64), which the generic
    pull-back forms and, the weight having uses of its own on the tokens, sends to the exact path. Factored, nothing
    goes there, and the sums stay exact."""
    torch.manual_seed(32)
    model = RelativePositions(projection, span=2).double()
    x, y = _ids(6, 5), torch.arange(6) % 3
    monkeypatch.setattr("dpml.train.keep_budget.KEEP_PER_EXAMPLE_LIMIT", 6 * 64 - 1)
    found = engine_pass(model, per_example_cross_entropy, x, y, ())
    assert found.exact == {}, found.reasons
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, y, planned=False)


class TableAndSquashedWeight(nn.Module):
    """One weight in a linear call on a table (parameters alone) and, squashed by tanh (a computation on it alone),
    in a layer on the batch's rows: no rule's use of its own, so past the keep limit the generic pull-back would form
    its per-example gradients again for its sum — the tanh's share alone, not the closed form's."""

    def __init__(self, width: int = 8, rows: int = 4) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, width))
        self.weight = nn.Parameter(torch.randn(width, width) * 0.3)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, width)
        keys = F.linear(self.table, self.weight)  # (rows, width): a linear call on parameters alone
        h = F.linear(x, torch.tanh(self.weight))
        scores = torch.matmul(h, keys.t()).softmax(-1)  # (B, T, rows)
        return self.out(torch.tanh(torch.matmul(scores, keys)).mean(1))


def test_a_weight_past_the_keep_limit_that_a_closed_form_also_uses_is_taken_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A keep limit of 6 · 64 − 1 holds the table's and the keys' gradients (6 · 32) but not the weight's (6 · 64):
    the tanh's pull-back would form them again for the sum, without the closed form's share (before: no exact path and
    that share lost). The weight takes the exact path, named with the limit, and the clipped sums equal the loop's."""
    torch.manual_seed(34)
    model = TableAndSquashedWeight().double()
    x, y = torch.randn(6, 5, 8, generator=generator(35), dtype=torch.float64), torch.arange(6) % 3
    monkeypatch.setattr("dpml.train.keep_budget.KEEP_PER_EXAMPLE_LIMIT", 6 * 64 - 1)
    found = engine_pass(model, per_example_cross_entropy, x, y, ())
    assert "weight" in found.exact, found.reasons  # (and the table, which shares its call: exact alike)
    assert all("exceed the keep limit (383)" in found.reasons[name] for name in found.exact)
    reference, _ = loop_clipped_sum(model, x, y, 0.3)
    sums, _ = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.3)
    assert relative_error(sums, reference) < 1e-10


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["eval", "dropout"])
def test_deberta_v3_attention_projects_its_normed_table_by_the_token_layers(dropout: float) -> None:
    """``transformers``' DeBERTa-v2 as DeBERTa-v3 configures it (``share_att_key``: the relative table, normed and
    dropped out once a layer, goes through that layer's own query and key projections; ``position_buckets``) in
    training mode: exact under the same masks, nothing on the exact path."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.DebertaV2Config(
        vocab_size=30,
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        num_labels=3,
        pad_token_id=0,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_buckets=4,
        max_relative_positions=-1,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    model = transformers.DebertaV2ForSequenceClassification(config).train()
    torch.manual_seed(8)
    x = ids_and_mask(5, 7, 30, 0, 33)
    assert_exact_without_the_exact_path(HuggingFace(model), per_example_cross_entropy, x, torch.arange(5) % 3, seed=9)


class ScatteredRows(nn.Module):
    """A table of 10 rows through a Conv1D-style ``addmm`` whose bias is a matrix, one row for each table row (so
    each output row has a bias row of its own), the keys then scored against the tokens twice: one product's
    columns 0, 3 and 7 kept (scattered: fewer than half of the 10, gathered), the other's 2, 3, 5 and 6 (a run with
    a gap: taken as the range 2–6); and row 9 scaled by each example's mean token (a materialised use). Rows 1, 4 and 8
    reach nothing: their bias rows' gradients are zero for every example."""

    def __init__(self, vocab: int = 13, width: int = 8, rows: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.table = nn.Parameter(torch.randn(rows, width))
        self.weight = nn.Parameter(torch.randn(width, width) * 0.3)
        self.bias_rows = nn.Parameter(torch.randn(rows, width) * 0.1)
        self.out = nn.Linear(3 + 4 + width, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (B, T, width)
        keys = torch.addmm(self.bias_rows, self.table, self.weight, alpha=0.7)  # (rows, width): parameters alone
        scattered = torch.matmul(h, keys.t())[..., [0, 3, 7]]
        run = torch.matmul(torch.tanh(h), keys.t())[..., [2, 3, 5, 6]]
        scaled = keys[9] * h.mean(1)  # (B, width)
        pooled = torch.cat([torch.tanh(scattered).mean(1), torch.tanh(run).mean(1), scaled], 1)
        return self.out(pooled)


def test_a_table_whose_rows_are_reached_in_scattered_places_is_exact_without_the_exact_path() -> None:
    """Only the rows some use reaches are formed (a gathered set, a range with a gap, a materialised use's row): the
    clipped sums, the bias matrix's zero rows among them, equal the float64 loop's, nothing on the exact path."""
    torch.manual_seed(36)
    model = ScatteredRows()
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, _ids(6, 5), torch.arange(6) % 3)


def _factor(g: torch.Generator, batch: int, positions: int, width: int, dead: str) -> torch.Tensor:
    """A factor (B, T, width) whose columns are zero for every example as ``dead`` says: none, every other one, all
    but a run with a gap, or all."""
    factor = torch.randn(batch, positions, width, generator=g, dtype=torch.float64)
    keep = torch.ones(width, dtype=torch.bool)
    if dead == "scattered":
        keep[1::2] = False
    elif dead == "run":
        keep[:] = False
        keep[width // 3 : width // 3 + max(2, width // 3)] = True
        keep[width // 3 + 1] = width < 6
    elif dead == "all":
        keep[:] = False
    return factor * keep


@pytest.mark.parametrize("seed", range(6))
def test_gradients_on_the_reached_rows_equal_those_formed_whole(seed: int) -> None:
    """dpml.train.rules.linear_on_parameters.gradients_on_reached_rows on random uses of a (P, n) output (factored
    uses of disjoint random views whose factors have dead columns — none, scattered, a run with a gap, all — and
    materialised uses with zero entries): the rows it keeps are those of the whole per-example gradients
    (:func:`dpml.train.rules.combine.per_example_gradients_of`) that are not zero for every example and more, equal
    to them there, and the rows it leaves out are zero there."""
    from dpml.train.rules.combine import per_example_gradients_of
    from dpml.train.rules.linear_on_parameters import gradients_on_reached_rows
    from dpml.train.rules.registry import Dense, Factored, Tracked

    g = torch.Generator().manual_seed(seed)
    batch, rows, width = 3, int(torch.randint(4, 12, (), generator=g)), int(torch.randint(2, 7, (), generator=g))
    output = torch.zeros(rows, width, dtype=torch.float64)
    places = torch.randperm(output.numel(), generator=g)
    uses, start = [], 0
    for k in range(int(torch.randint(1, 4, (), generator=g))):
        a, b = int(torch.randint(1, 4, (), generator=g)), int(torch.randint(1, 4, (), generator=g))
        if start + a * b > places.numel():
            break
        view = Tracked(output, places[start : start + a * b].view(a, b))  # type: ignore[arg-type]
        start += a * b
        if k % 2 == 0:
            dead = ["none", "scattered", "run", "all"][int(torch.randint(0, 4, (), generator=g))]
            u, v = _factor(g, batch, 4, a, dead), _factor(g, batch, 4, b, "scattered" if seed % 2 else "none")
            uses.append((view, Factored(u, v, a, b)))
        else:
            grads = torch.randn(batch, a, b, generator=g, dtype=torch.float64)
            uses.append((view, Dense(grads * (torch.rand(a, b, generator=g) < 0.5))))
    whole = per_example_gradients_of(uses, output, batch, torch.float64).reshape(batch, rows, width)
    found, live = gradients_on_reached_rows(uses, output, batch, torch.float64)
    if live is None:
        assert torch.equal(found, whole)
        return
    left_out = torch.ones(rows, dtype=torch.bool).index_fill_(0, live, False)
    assert bool((whole[:, left_out] == 0).all())
    assert torch.allclose(found, whole[:, live], rtol=1e-12, atol=1e-12)
