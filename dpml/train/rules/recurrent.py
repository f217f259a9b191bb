"""Recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU`` and their cells) run by the recorder: their fused kernels
(``torch.lstm``, ``torch.gru``, ``torch.rnn_tanh``, ``torch.rnn_relu``, the ``*_cell`` functions) hand autograd no
step of the recurrence, so where a trainable parameter enters one the recorder runs, in its place, the same
recurrence in operations that have rules (:func:`dpml.train.rules.operands.composite_of`):

- input terms of every step in one product per layer and direction, x̃_t = W_ih x_t + b_ih;
- LSTM (Hochreiter & Schmidhuber 1997, with a forget gate): (i, f, g, o) = x̃_t + W_hh h_{t−1} + b_hh,
  c_t = σ(f) ⊙ c_{t−1} + σ(i) ⊙ tanh(g), h_t = σ(o) ⊙ tanh(c_t), and with ``proj_size`` h_t ← W_hr h_t;
- GRU (Cho et al. 2014, as torch writes it): (h_r, h_z, h_n) = W_hh h_{t−1} + b_hh, r = σ(x̃_r + h_r),
  z = σ(x̃_z + h_z), n = tanh(x̃_n + r ⊙ h_n), h_t = (h_{t−1} − n) ⊙ z + n;
- Elman RNN: h_t = tanh or relu(x̃_t + W_hh h_{t−1} + b_hh);

layers stacked, a bidirectional layer's reverse direction run from the last step to the first and its outputs
concatenated after the forward direction's, dropout (``torch.dropout``, as the kernel calls it, on the same
time-major outputs) between layers in training. A layer is its input product and one
:func:`dpml.train.rules.recurrent_scan.scan` over the rows of its steps, whose rule gives W_hh and b_hh (and W_hr
inside the steps) their per-example gradients from x̃'s (:mod:`dpml.train.rules.recurrent_scan`); with an LSTM's
projection, its outputs W_hr h are one more product. The cells run step by step in the kernel's own order of
operations (ATen's CPU cells); each example's gradient is then the linear rule's over its steps, ∇_{W_hh} ℓ_i = Σ_t
δ_{i,t} h_{i,t−1}ᵀ and ∇_{b_hh} ℓ_i = Σ_t δ_{i,t} (Goodfellow 2015): the T uses of W_hh are one factored gradient
over T positions (:func:`dpml.train.rules.combine.merged_uses`). The initial state's rows are given the example map
of the input's rows (a zero state built by the module is no activation of the batch, but its row r feeds the
recurrence of row r only). A packed sequence runs as ATen's packed layers do: step t takes the rows of the first
``batch_sizes[t]`` sequences (the longest first), a sequence leaving the batch after its last step (its final state
kept) or, reversed, joining it there from its initial state; where each row's example is, the packing, the steps'
joins and the padding back carry (:mod:`dpml.train.rules.example_maps`). Numbers: those of these operations, which
the probe compares with autograd's on the kernel (the kernel's own arithmetic differs in rounding: oneDNN's on a CPU
in float32, cuDNN's on a GPU).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from dpml.train.rules.operands import decomposition
from dpml.train.rules.recurrent_scan import scan

State = tuple[torch.Tensor, ...]  # (h,) or, for an LSTM, (h, c)
Step = Callable[[torch.Tensor, State, torch.Tensor, torch.Tensor | None, torch.Tensor | None], State]


def row_wise(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` of tensors whose row r is example r's (N, ·), no parameter among them, made one call for the
    recorder: it runs unrecorded, its outputs taking the example map of the operand whose shape they keep (autograd
    still records its operations: its operands' gradients are the same). A cell's pointwise gates are a dozen
    operations a step, each else recorded one by one, where the rules need only the products with W_ih and W_hh."""

    @functools.wraps(function)
    def call(*tensors: torch.Tensor) -> Any:
        if torch.overrides.has_torch_function(tensors):
            return torch.overrides.handle_torch_function(call, tensors, *tensors)
        return function(*tensors)

    return call


@row_wise
def lstm_gates(gates_in: torch.Tensor, hidden: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_t, c_t) from x̃_t and W_hh h_{t−1} + b_hh (module docstring)."""
    i, f, g, o = (hidden + gates_in).chunk(4, 1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


@row_wise
def gru_gates(gates_in: torch.Tensor, hidden: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """h_t from x̃_t, W_hh h_{t−1} + b_hh and h_{t−1} (module docstring)."""
    size = hidden.shape[1] // 3
    x_r, x_z, x_n = (gates_in[:, k * size : (k + 1) * size] for k in range(3))
    h_r, h_z, h_n = (hidden[:, k * size : (k + 1) * size] for k in range(3))
    r, z = torch.sigmoid(h_r + x_r), torch.sigmoid(h_z + x_z)
    n = torch.tanh(x_n + h_n * r)
    return (h - n) * z + n


def lstm_step(
    gates_in: torch.Tensor, state: State, w_hh: torch.Tensor, b_hh: torch.Tensor | None, w_hr: torch.Tensor | None
) -> State:
    """One LSTM step from its input term x̃_t (N, 4H) (module docstring)."""
    h, c = lstm_gates(gates_in, F.linear(state[0], w_hh, b_hh), state[1])
    return (h if w_hr is None else F.linear(h, w_hr), c)


def gru_step(
    gates_in: torch.Tensor, state: State, w_hh: torch.Tensor, b_hh: torch.Tensor | None, w_hr: torch.Tensor | None
) -> State:
    """One GRU step from its input term x̃_t (N, 3H)."""
    return (gru_gates(gates_in, F.linear(state[0], w_hh, b_hh), state[0]),)


def elman_step(nonlinearity: Callable[[torch.Tensor], torch.Tensor]) -> Step:
    """One step of an Elman RNN with ``nonlinearity`` (tanh or relu)."""

    def step(
        gates_in: torch.Tensor, state: State, w_hh: torch.Tensor, b_hh: torch.Tensor | None, w_hr: torch.Tensor | None
    ) -> State:
        return (nonlinearity(F.linear(state[0], w_hh, b_hh) + gates_in),)

    return step


STEPS: dict[str, Step] = {
    "lstm": lstm_step,
    "gru": gru_step,
    "rnn_tanh": elman_step(torch.tanh),
    "rnn_relu": elman_step(torch.relu),
}


def with_input_rows(state: State, like: torch.Tensor) -> State:
    """The state with its rows given the example map of ``like``'s rows (module docstring): s + 0, a zero column of
    ``like`` broadcast (the values unchanged)."""
    zero = torch.zeros_like(like[:, :1])
    return tuple(s + zero for s in state)


def split_weights(
    weights: Sequence[torch.Tensor], has_biases: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """w_ih, w_hh, b_ih, b_hh, w_hr of one layer and direction (None where absent)."""
    b_ih, b_hh = (weights[2], weights[3]) if has_biases else (None, None)
    w_hr = weights[4 if has_biases else 2] if len(weights) > (4 if has_biases else 2) else None
    return weights[0], weights[1], b_ih, b_hh, w_hr


def scan_direction(
    kind: str,
    rows: torch.Tensor,
    sizes: tuple[int, ...],
    initial: State,
    weights: Sequence[torch.Tensor],
    has_biases: bool,
    reverse: bool,
) -> tuple[torch.Tensor, State]:
    """One layer in one direction over the rows of its steps (step t: the first ``sizes[t]`` sequences'), as two
    recorded operations: the input terms of every step in one product, then the recurrence
    (:func:`dpml.train.rules.recurrent_scan.scan`); with an LSTM's projection a third, its outputs W_hr h in one
    product. Its output rows and each sequence's final state (the state after its last step: forward, the row of
    its last step; reversed, its row of step 0)."""
    w_ih, w_hh, b_ih, b_hh, w_hr = split_weights(weights, has_biases)
    gates_in = F.linear(rows, w_ih, b_ih)
    state = with_input_rows(tuple(s[: sizes[0]] for s in initial), gates_in[: sizes[0]])
    h_rows, c_rows, _, _ = scan(
        kind, gates_in, sizes, state[0], state[1] if len(state) > 1 else None, w_hh, b_hh, reverse, w_hr
    )
    out = h_rows if w_hr is None else F.linear(h_rows, w_hr)
    last = final_rows(sizes, reverse).to(rows.device)
    return out, tuple(t.index_select(0, last) for t in (out, c_rows) if t is not None)


@functools.lru_cache(maxsize=256)
def final_rows(sizes: tuple[int, ...], reverse: bool) -> torch.Tensor:
    """Each sequence's row after its last step: reversed, its row of step 0; forward, its row of step len − 1."""
    if reverse:
        return torch.arange(sizes[0])
    starts = torch.tensor([0, *itertools.accumulate(sizes[:-1])])
    sequences = torch.arange(sizes[0])
    lengths = (torch.tensor(sizes)[None, :] > sequences[:, None]).sum(1)  # each sequence's number of steps
    return starts[lengths - 1] + sequences


def run_layers(
    kind: str,
    x: torch.Tensor,
    hidden: State,
    params: Sequence[torch.Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool | None,
    sizes: list[int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """``torch.lstm`` / ``gru`` / ``rnn_*`` on padded sequences, or (``sizes``: the batch size of each step) on a
    packed sequence's rows: (output, *final states), each final state (layers · directions, N, H). Each layer and
    direction is one scan (:func:`scan_direction`) over the rows of its steps (padded sequences: the time-major
    rows, N at every step)."""
    x = x.transpose(0, 1) if batch_first else x
    directions = 2 if bidirectional else 1
    per = len(params) // (num_layers * directions)
    steps = tuple(sizes) if sizes is not None else (x.shape[1],) * x.shape[0]
    finals: list[State] = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            k = layer * directions + direction
            state, weights = tuple(h[k] for h in hidden), params[k * per : (k + 1) * per]
            rows = x if sizes is not None else x.reshape(-1, x.shape[-1])
            out, final = scan_direction(kind, rows, steps, state, weights, has_biases, direction == 1)
            outputs.append(out if sizes is not None else out.view(*x.shape[:2], -1))
            finals.append(final)
        x = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    finals_stacked = [torch.stack([final[j] for final in finals]) for j in range(len(hidden))]
    return (x.transpose(0, 1) if batch_first else x, *finals_stacked)


def _packed(args: tuple[Any, ...]) -> bool:
    """A call on a packed sequence: the batch sizes second, ``params`` fourth (a padded call has them third)."""
    return isinstance(args[1], torch.Tensor) and isinstance(args[3], (list, tuple))


def _sequences(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A call positional as the modules make it, on padded sequences (3-D, at least one step) or a packed one."""
    if kwargs or len(args) != 9 or not isinstance(args[0], torch.Tensor):
        return False
    if _packed(args):
        return bool(args[1].device.type == "cpu" and args[1].dim() == 1 and args[1].numel() > 0)
    return isinstance(args[2], (list, tuple)) and args[0].dim() == 3 and args[0].shape[1 if args[8] else 0] > 0


def run_call(kind: str, args: tuple[Any, ...], state: Callable[[Any], State]) -> tuple[torch.Tensor, ...]:
    """A padded or packed call's (x, [batch sizes,] hx, params, has_biases, num_layers, dropout, train, bidirectional
    [, batch_first]) through :func:`run_layers`, ``state`` making the hx argument a state."""
    if _packed(args):
        data, sizes, hx, params, has_biases, layers, dropout, train, bidirectional = args
        steps = [int(n) for n in sizes.tolist()]
        return run_layers(kind, data, state(hx), params, has_biases, layers, dropout, train, bidirectional, None, steps)
    x, hx, params, *flags = args
    return run_layers(kind, x, state(hx), params, *flags)


@decomposition(torch.lstm, applies=_sequences)
def lstm(*args: Any) -> Any:
    return run_call("lstm", args, tuple)


@decomposition(torch.gru, applies=_sequences)
def gru(*args: Any) -> Any:
    return run_call("gru", args, lambda hx: (hx,))


@decomposition(torch.rnn_tanh, applies=_sequences)
def rnn_tanh(*args: Any) -> Any:
    return run_call("rnn_tanh", args, lambda hx: (hx,))


@decomposition(torch.rnn_relu, applies=_sequences)
def rnn_relu(*args: Any) -> Any:
    return run_call("rnn_relu", args, lambda hx: (hx,))


def _cell_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A cell called positionally on batched input (N, F), as ``nn.LSTMCell`` and the others call it."""
    return not kwargs and 4 <= len(args) <= 6 and isinstance(args[0], torch.Tensor) and args[0].dim() == 2


def _cell(step: Step, x: torch.Tensor, state: State, weights: Sequence[Any]) -> State:
    w_ih, w_hh = weights[0], weights[1]
    b_ih, b_hh = (tuple(weights[2:4]) + (None, None))[:2]
    return step(F.linear(x, w_ih, b_ih), with_input_rows(state, x), w_hh, b_hh, None)


@decomposition(torch.lstm_cell, applies=_cell_call)
def lstm_cell(x: torch.Tensor, hx: Sequence[torch.Tensor], *weights: Any) -> Any:
    return _cell(lstm_step, x, tuple(hx), weights)


@decomposition(torch.gru_cell, applies=_cell_call)
def gru_cell(x: torch.Tensor, hx: torch.Tensor, *weights: Any) -> Any:
    return _cell(gru_step, x, (hx,), weights)[0]


@decomposition(torch.rnn_tanh_cell, applies=_cell_call)
def rnn_tanh_cell(x: torch.Tensor, hx: torch.Tensor, *weights: Any) -> Any:
    return _cell(STEPS["rnn_tanh"], x, (hx,), weights)[0]


@decomposition(torch.rnn_relu_cell, applies=_cell_call)
def rnn_relu_cell(x: torch.Tensor, hx: torch.Tensor, *weights: Any) -> Any:
    return _cell(STEPS["rnn_relu"], x, (hx,), weights)[0]
