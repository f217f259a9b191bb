"""Recurrent layers (dpml.train.rules.recurrent): nn.LSTM, nn.GRU, nn.RNN and their cells, in every layout and option
torch offers (time-major or batch-first, stacked, bidirectional, dropout between layers, projections, no biases, an
initial state from the batch or learned, packed sequences of different lengths), get per-example norms and clipped
sums equal to a float64 per-example autograd loop over the fused kernel, with no parameter on the exact path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_op_rules import assert_clipped_like_the_loop, assert_exact_without_the_exact_path
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from dpml.train.clipping import clipped_gradient_sum, engine_pass
from dpml.train.clipping_check import plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy
from dpml.train.rules.combine import merged_uses
from dpml.train.rules.registry import Dense, Factored, Tracked

VOCABULARY, WIDTH, CLASSES = 20, 5, 3


class Recurrent(nn.Module):
    """Token ids (B, T) → embedding → ``rnn`` (its outputs' mean over time, and its final hidden state) → classes."""

    def __init__(self, rnn: nn.Module, initial: str = "none") -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCABULARY, WIDTH)
        self.rnn = rnn
        self.initial = initial
        directions = 2 if rnn.bidirectional else 1
        out = rnn.proj_size if getattr(rnn, "proj_size", 0) else rnn.hidden_size
        self.hidden_size, self.states = rnn.hidden_size, rnn.num_layers * directions
        self.start = nn.Parameter(torch.randn(self.states, 1, out) * 0.3) if initial == "learned" else None
        self.from_input = nn.Linear(WIDTH, out) if initial == "batch" else None
        self.head = nn.Linear(directions * out + out, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        x = h if self.rnn.batch_first else h.transpose(0, 1)
        hx = None
        if self.start is not None or self.from_input is not None:
            batch = ids.shape[0]
            if self.start is not None:
                h0 = self.start.expand(-1, batch, -1).contiguous()
            else:
                h0 = torch.tanh(self.from_input(h.mean(1))).unsqueeze(0).expand(self.states, -1, -1).contiguous()
            if isinstance(self.rnn, nn.LSTM):
                hx = (h0, torch.zeros(self.states, batch, self.hidden_size, dtype=h0.dtype))
            else:
                hx = h0
        out, final = self.rnn(x, hx)
        last = final[0] if isinstance(final, tuple) else final
        pooled = out.mean(1 if self.rnn.batch_first else 0)
        return self.head(torch.cat([pooled, last[-1]], 1))


def tokens(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCABULARY, (batch, length), generator=g), torch.randint(0, CLASSES, (batch,), generator=g)


RNNS = {
    "lstm, time-major, 2 layers, bidirectional, dropout": lambda: nn.LSTM(
        WIDTH, 4, num_layers=2, bidirectional=True, dropout=0.4
    ),
    "lstm, batch-first, projections": lambda: nn.LSTM(WIDTH, 6, num_layers=2, batch_first=True, proj_size=3),
    "lstm, no biases, projections": lambda: nn.LSTM(WIDTH, 4, bias=False, proj_size=2),
    "gru, batch-first, 2 layers, bidirectional": lambda: nn.GRU(
        WIDTH, 4, num_layers=2, batch_first=True, bidirectional=True
    ),
    "gru, time-major, dropout": lambda: nn.GRU(WIDTH, 4, num_layers=3, dropout=0.3),
    "rnn tanh, bidirectional": lambda: nn.RNN(WIDTH, 4, bidirectional=True),
    "rnn relu, batch-first, no biases": lambda: nn.RNN(WIDTH, 4, nonlinearity="relu", bias=False, batch_first=True),
}


@pytest.mark.parametrize("kind", list(RNNS))
def test_recurrent_layers_are_exact_without_the_exact_path(kind: str) -> None:
    torch.manual_seed(3)
    model = Recurrent(RNNS[kind]()).train()
    x, y = tokens(6, 7, 11)
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, y, seed=5)


@pytest.mark.parametrize("initial", ["learned", "batch"])
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_an_initial_state_learned_or_computed_from_the_batch(cell: type[nn.Module], initial: str) -> None:
    torch.manual_seed(4)
    model = Recurrent(cell(WIDTH, 4, num_layers=2, batch_first=True), initial)
    x, y = tokens(5, 6, 12)
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, y)


def test_as_many_steps_as_examples() -> None:
    """T = B: the steps' outputs stacked time-major, (T, B, H), keep the example of each row; the convention that a
    tensor of B rows without an example map is batch-first would take the time axis for the batch."""
    torch.manual_seed(6)
    model = Recurrent(nn.LSTM(WIDTH, 4, num_layers=2)).double()
    x, y = tokens(6, 6, 13)
    found = engine_pass(model, per_example_cross_entropy, x, y)
    assert found.exact == {}, found.reasons
    assert_clipped_like_the_loop(model, x, y)


def test_a_zero_initial_state_keeps_the_recurrent_weight_one_factored_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """The zero state nn.LSTM builds is no activation of the batch; given the input's rows, W_hh's first step is one
    more position of its factored gradient, which needs no per-example copy of W_hh: with room for none (a keep
    limit of 8 numbers) the engine still takes no parameter exactly."""
    from dpml.train import keep_budget

    monkeypatch.setattr(keep_budget, "KEEP_PER_EXAMPLE_LIMIT", 8)
    torch.manual_seed(11)
    model = Recurrent(nn.LSTM(WIDTH, 4, batch_first=True)).double()
    x, y = tokens(6, 7, 18)
    found = engine_pass(model, per_example_cross_entropy, x, y)
    assert found.exact == {}, found.reasons
    assert_clipped_like_the_loop(model, x, y)


class Cells(nn.Module):
    """A hand-written recurrence over time with the cells (an LSTM cell, then a GRU cell and an Elman cell on its
    output), the hidden states carried by the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCABULARY, WIDTH)
        self.lstm, self.gru = nn.LSTMCell(WIDTH, 4), nn.GRUCell(4, 3)
        self.elman = nn.RNNCell(3, 3, nonlinearity="relu")
        self.head = nn.Linear(3, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        state, g, e = None, None, None
        for t in range(ids.shape[1]):
            state = self.lstm(h[:, t], state)
            g = self.gru(state[0], g)
            e = self.elman(g, e)
        return self.head(e)


def test_cells_in_a_hand_written_loop() -> None:
    torch.manual_seed(7)
    x, y = tokens(5, 4, 14)
    assert_exact_without_the_exact_path(Cells(), per_example_cross_entropy, x, y)


class Packed(nn.Module):
    """Padded token ids with their lengths (ids 0 are padding) packed, through ``rnn``, padded again and through a
    linear layer at every place (the padded places too: its bias's gradient there is each example's own), the mean
    over each sequence's steps and the last layer's final state."""

    def __init__(self, rnn: nn.Module, enforce_sorted: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCABULARY, WIDTH)
        self.rnn, self.enforce_sorted = rnn, enforce_sorted
        width = getattr(rnn, "proj_size", 0) or rnn.hidden_size
        self.mix = nn.Linear(width * (2 if rnn.bidirectional else 1), 3)
        self.head = nn.Linear(3 + width, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        lengths = (ids != 0).sum(1).clamp(min=1)
        packed = pack_padded_sequence(
            self.emb(ids), lengths.cpu(), batch_first=True, enforce_sorted=self.enforce_sorted
        )
        out, final = self.rnn(packed)
        padded, _ = pad_packed_sequence(out, batch_first=True, total_length=ids.shape[1])  # (not the batch's longest)
        last = final[0] if isinstance(final, tuple) else final
        pooled = torch.tanh(self.mix(padded)).sum(1) / lengths[:, None]
        return self.head(torch.cat([pooled, last[-1]], 1))


def ragged_tokens(batch: int, length: int, seed: int, descending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids with 1 … ``length`` real tokens an example (all lengths different where the batch allows), the rest 0."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randperm(length, generator=g)[:batch] % length) + 1
    if descending:
        lengths = lengths.sort(descending=True).values
    ids = torch.randint(1, VOCABULARY, (batch, length), generator=g) * (torch.arange(length) < lengths[:, None])
    return ids, torch.randint(0, CLASSES, (batch,), generator=g)


PACKED = {  # (no dropout between layers: its masks fall on the packed rows, whose order is the batch's lengths', so
    # the probe's check that replacing one example leaves the others' losses alone refuses it, kernel or not)
    "lstm, 2 layers, bidirectional": lambda: nn.LSTM(WIDTH, 4, num_layers=2, bidirectional=True),
    "gru, bidirectional": lambda: nn.GRU(WIDTH, 4, bidirectional=True),
    "rnn tanh, 2 layers": lambda: nn.RNN(WIDTH, 3, num_layers=2),
}


@pytest.mark.parametrize("kind", list(PACKED))
def test_packed_sequences_of_different_lengths(kind: str) -> None:
    """Sequences leave the batch as they end (and, reversed, join it at their last step): each example's rows at
    every step are its own, through the packing's sort, the steps and the padding back."""
    torch.manual_seed(8)
    x, y = ragged_tokens(6, 7, 15)
    assert_exact_without_the_exact_path(Packed(PACKED[kind]()).train(), per_example_cross_entropy, x, y, seed=2)


def test_packed_sequences_already_sorted() -> None:
    torch.manual_seed(9)
    x, y = ragged_tokens(5, 6, 16, descending=True)
    model = Packed(nn.LSTM(WIDTH, 4, batch_first=True, proj_size=2), enforce_sorted=True)
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, y)


def test_float32_lstm_with_dropout_passes_the_probe() -> None:
    """In float32 the kernel on this CPU is oneDNN's and draws its dropout between layers as the unrolled layers do
    (``torch.dropout`` on the same time-major outputs): the probe compares the two and keeps the rules."""
    torch.manual_seed(9)
    model = Recurrent(nn.LSTM(WIDTH, 8, num_layers=2, batch_first=True, dropout=0.5)).train()
    x, y = tokens(6, 9, 16)
    plan = plan_clipping(model, per_example_cross_entropy, tuple(x.shape[1:]), x.dtype, probe=(x, y))
    assert plan.exact_parameters == (), plan.lines()
    assert len(plan.rule_parameters) == 8


def test_uses_of_one_view_are_merged_into_one_sum_over_their_positions() -> None:
    """T uses of one weight (W_hh at each step) are one factored gradient over T positions, and T dense uses of one
    bias are their sum: the same per-example gradients as the uses added up one by one."""
    weight, bias = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(4))
    g = torch.Generator().manual_seed(0)
    steps = [(torch.randn(2, 1, 4, generator=g), torch.randn(2, 1, 3, generator=g)) for _ in range(5)]
    uses = [(Tracked(weight), Factored(u, v, 4, 3)) for u, v in steps]
    uses += [(Tracked(bias), Dense(u[:, 0])) for u, _ in steps]
    merged = merged_uses(uses)
    assert len(merged) == 2
    (w_view, w_form), (b_view, b_form) = merged
    assert w_view.param is weight and b_view.param is bias
    assert isinstance(w_form, Factored) and w_form.u.shape == (2, 5, 4) and isinstance(b_form, Dense)
    expected = sum(torch.einsum("bti,btj->bij", u, v) for u, v in steps)
    torch.testing.assert_close(torch.einsum("bti,btj->bij", w_form.u, w_form.v), expected)
    torch.testing.assert_close(b_form.grads, sum(u[:, 0] for u, _ in steps))
    transposed = merged_uses(
        [(Tracked(weight), Factored(*steps[0], 4, 3)), (Tracked(weight, torch.arange(12)), Dense(torch.zeros(2, 12)))]
    )
    assert len(transposed) == 2  # another view of the parameter, another kind: kept apart


def test_the_rules_clip_a_stacked_lstm_as_the_exact_path_does() -> None:
    """On a stacked batch-first LSTM, the rules' clipped sum and norms (some examples clipped) equal those of the exact
    path, which backpropagates each example's loss through the fused kernel."""
    torch.manual_seed(10)
    model = Recurrent(nn.LSTM(WIDTH, 6, num_layers=2, batch_first=True)).double()
    x, y = tokens(7, 5, 17)
    sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.2)
    names = frozenset(n for n, _ in model.named_parameters() if n.startswith("rnn."))
    exact_sums, exact_norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.2, exact=names)
    torch.testing.assert_close(norms, exact_norms, rtol=1e-10, atol=0)
    for name, value in exact_sums.items():
        torch.testing.assert_close(sums[name], value, rtol=1e-10, atol=1e-12)
    assert F.relu(norms - 0.2).sum() > 0  # some examples clipped
