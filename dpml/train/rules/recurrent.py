"""Recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU`` and their cells) unrolled: their fused kernels
(``torch.lstm``, ``torch.gru``, ``torch.rnn_tanh``, ``torch.rnn_relu``, the ``*_cell`` functions) hand autograd
no step of the recurrence, so where a trainable parameter enters one the recorder runs, in its place, the same
recurrence step by step in operations that have rules (:func:`dpml.train.rules.operands.composite_of`), in the
kernel's own order of operations (ATen's CPU cells):

- input terms of every step in one product per layer and direction, x̃_t = W_ih x_t + b_ih;
- LSTM (Hochreiter & Schmidhuber 1997, with a forget gate): (i, f, g, o) = x̃_t + W_hh h_{t−1} + b_hh,
  c_t = σ(f) ⊙ c_{t−1} + σ(i) ⊙ tanh(g), h_t = σ(o) ⊙ tanh(c_t), and with ``proj_size`` h_t ← W_hr h_t;
- GRU (Cho et al. 2014, as torch writes it): (h_r, h_z, h_n) = W_hh h_{t−1} + b_hh, r = σ(x̃_r + h_r),
  z = σ(x̃_z + h_z), n = tanh(x̃_n + r ⊙ h_n), h_t = (h_{t−1} − n) ⊙ z + n;
- Elman RNN: h_t = tanh or relu(x̃_t + W_hh h_{t−1} + b_hh);

layers stacked, a bidirectional layer's reverse direction run from the last step to the first and its outputs
concatenated after the forward direction's, dropout (``torch.dropout``, as the kernel calls it, on the same
time-major outputs) between layers in training. Each example's gradient is then the linear rule's over its
steps, ∇_{W_hh} ℓ_i = Σ_t δ_{i,t} h_{i,t−1}ᵀ and ∇_{b_hh} ℓ_i = Σ_t δ_{i,t} (Goodfellow 2015): the T uses of
W_hh are one factored gradient over T positions (:func:`dpml.train.rules.combine.merged_uses`). The initial
state's rows are given the example map of the input's rows (a zero state built by the module is no activation
of the batch, but its row r feeds the recurrence of row r only). Packed sequences keep the kernel (and the
exact path). Numbers: those of the unrolled operations, which the probe compares with autograd's on the kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from dpml.train.rules.operands import decomposition

State = tuple[torch.Tensor, ...]  # (h,) or, for an LSTM, (h, c)
Step = Callable[[torch.Tensor, State, torch.Tensor, torch.Tensor | None, torch.Tensor | None], State]


def lstm_step(
    gates_in: torch.Tensor, state: State, w_hh: torch.Tensor, b_hh: torch.Tensor | None, w_hr: torch.Tensor | None
) -> State:
    """One LSTM step from its input term x̃_t (N, 4H) (module docstring)."""
    h, c = state
    gates = F.linear(h, w_hh, b_hh) + gates_in
    size = gates.shape[1] // 4
    i, f, g, o = (gates[:, k * size : (k + 1) * size] for k in range(4))
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    return (h if w_hr is None else F.linear(h, w_hr), c)


def gru_step(
    gates_in: torch.Tensor, state: State, w_hh: torch.Tensor, b_hh: torch.Tensor | None, w_hr: torch.Tensor | None
) -> State:
    """One GRU step from its input term x̃_t (N, 3H)."""
    (h,) = state
    hidden = F.linear(h, w_hh, b_hh)
    size = hidden.shape[1] // 3
    x_r, x_z, x_n = (gates_in[:, k * size : (k + 1) * size] for k in range(3))
    h_r, h_z, h_n = (hidden[:, k * size : (k + 1) * size] for k in range(3))
    r, z = torch.sigmoid(h_r + x_r), torch.sigmoid(h_z + x_z)
    n = torch.tanh(x_n + h_n * r)
    return ((h - n) * z + n,)


def elman_step(nonlinearity: Callable[[torch.Tensor], torch.Tensor]) -> Step:
    """One step of an Elman RNN with ``nonlinearity`` (tanh or relu)."""

    def step(
        gates_in: torch.Tensor, state: State, w_hh: torch.Tensor, b_hh: torch.Tensor | None, w_hr: torch.Tensor | None
    ) -> State:
        return (nonlinearity(F.linear(state[0], w_hh, b_hh) + gates_in),)

    return step


def with_input_rows(state: State, like: torch.Tensor) -> State:
    """The state with its hidden rows given the example map of ``like``'s rows (module docstring): h + 0, a zero
    column of ``like`` broadcast (h's values unchanged)."""
    return (state[0] + torch.zeros_like(like[:, :1]), *state[1:])


def run_direction(
    step: Step, x: torch.Tensor, state: State, weights: Sequence[torch.Tensor], has_biases: bool, reverse: bool
) -> tuple[torch.Tensor, State]:
    """One layer in one direction over the time-major x (T, N, F): its outputs (T, N, H) and final state.
    ``weights``: w_ih, w_hh, then b_ih, b_hh with ``has_biases``, then w_hr (an LSTM with ``proj_size``)."""
    w_ih, w_hh = weights[0], weights[1]
    b_ih, b_hh = (weights[2], weights[3]) if has_biases else (None, None)
    w_hr = weights[4 if has_biases else 2] if len(weights) > (4 if has_biases else 2) else None
    gates_in = F.linear(x, w_ih, b_ih)  # every step's input term in one product, as the kernel on a CPU
    steps = range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])
    outputs: list[torch.Tensor] = [gates_in] * x.shape[0]
    state = with_input_rows(state, gates_in[steps[0]])
    for t in steps:
        state = step(gates_in[t], state, w_hh, b_hh, w_hr)
        outputs[t] = state[0]
    return torch.stack(outputs), state


def run_layers(
    step: Step,
    x: torch.Tensor,
    hidden: State,
    params: Sequence[torch.Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
) -> tuple[torch.Tensor, ...]:
    """``torch.lstm`` / ``gru`` / ``rnn_*`` on padded sequences: (output, *final states), each final state
    (layers · directions, N, H)."""
    x = x.transpose(0, 1) if batch_first else x
    directions = 2 if bidirectional else 1
    per = len(params) // (num_layers * directions)
    finals: list[State] = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            k = layer * directions + direction
            out, final = run_direction(
                step, x, tuple(h[k] for h in hidden), params[k * per : (k + 1) * per], has_biases, direction == 1
            )
            outputs.append(out)
            finals.append(final)
        x = outputs[0] if directions == 1 else torch.cat(outputs, 2)
        if dropout and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    finals_stacked = [torch.stack([final[j] for final in finals]) for j in range(len(hidden))]
    return (x.transpose(0, 1) if batch_first else x, *finals_stacked)


def _padded(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A call on padded sequences, positional as the modules make it (``params`` third; a packed call has the
    batch sizes second and ``params`` fourth), with at least one step."""
    return (
        not kwargs
        and len(args) == 9
        and isinstance(args[2], (list, tuple))
        and isinstance(args[0], torch.Tensor)
        and args[0].dim() == 3
        and args[0].shape[1 if args[8] else 0] > 0
    )


@decomposition(torch.lstm, applies=_padded)
def lstm(x: torch.Tensor, hx: Sequence[torch.Tensor], params: Sequence[torch.Tensor], *flags: Any) -> Any:
    return run_layers(lstm_step, x, tuple(hx), params, *flags)


@decomposition(torch.gru, applies=_padded)
def gru(x: torch.Tensor, hx: torch.Tensor, params: Sequence[torch.Tensor], *flags: Any) -> Any:
    return run_layers(gru_step, x, (hx,), params, *flags)


@decomposition(torch.rnn_tanh, applies=_padded)
def rnn_tanh(x: torch.Tensor, hx: torch.Tensor, params: Sequence[torch.Tensor], *flags: Any) -> Any:
    return run_layers(elman_step(torch.tanh), x, (hx,), params, *flags)


@decomposition(torch.rnn_relu, applies=_padded)
def rnn_relu(x: torch.Tensor, hx: torch.Tensor, params: Sequence[torch.Tensor], *flags: Any) -> Any:
    return run_layers(elman_step(torch.relu), x, (hx,), params, *flags)


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
    return _cell(elman_step(torch.tanh), x, (hx,), weights)[0]


@decomposition(torch.rnn_relu_cell, applies=_cell_call)
def rnn_relu_cell(x: torch.Tensor, hx: torch.Tensor, *weights: Any) -> Any:
    return _cell(elman_step(torch.relu), x, (hx,), weights)[0]
