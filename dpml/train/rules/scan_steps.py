"""An LSTM scan's step, fused on the CPU: the compiled kernel of ``dpml/train/_scan_steps.c`` in place of the torch
operations between a step's two matrix products (:mod:`.recurrent_scan`), where it applies: CPU tensors in float32
or float64, each operand's rows laid out one after the other. Elsewhere (a GPU, half precision, no C compiler) the
scan takes its torch operations, which compute the same numbers up to rounding (tanh as 2σ(2x) − 1 here, as the
gates' already are there).

One step forward, on a step's rows (module docstring of ``_scan_steps.c``):

    σ over (a_i, a_f, 2a_g, a_o),  g = 2σ(2a_g) − 1,  c = f ⊙ c_prev + i ⊙ g,  h = o ⊙ tanh(c);

one step backward, its factors formed from what the forward kept (σ(a), g, the entering c, tanh(c)): dh = dh_own +
dh_next, dc = dc_next + dc_own + dh ⊙ o ⊙ (1 − tanh²c), δ = (σ'_i g, σ'_f c_prev, (1 − g²) i) ⊙ dc and
σ'_o tanh(c) ⊙ dh, the cell gradient passed back dc ⊙ f."""

from __future__ import annotations

import torch

from dpml.train.kernels import compiled_scan_steps

_KINDS = {torch.float32: "f32", torch.float64: "f64"}
Sizes = tuple[int, ...]  # the rows of each step, in the order of the rows
Step = tuple[int, int, int, int]  # (step, its rows, the step whose states enter it or −1, how many it carries)
StateGradients = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor], dict[int, torch.Tensor], list[torch.Tensor]
]


def by_step(t: torch.Tensor, sizes: Sizes) -> list[torch.Tensor]:
    """The rows of each step, as views (one call for all steps: a loop's slicing is its own cost)."""
    return list(t.split(sizes))


def prefixes(t: torch.Tensor, sizes: Sizes) -> dict[int, torch.Tensor]:
    """t's first n rows for every step's n (a backward pass's states, the sequences a step holds)."""
    return {n: t if n == t.shape[0] else t[:n] for n in set(sizes)}


def state_gradients(
    like: torch.Tensor, rows: int, sizes: Sizes, width: int, projection: torch.Tensor | None
) -> StateGradients:
    """An LSTM backward pass's running gradients, zero: of the states the steps pass on (one a sequence, H wide, or P
    with a ``projection``: W_hr h), of the cell states, and (R, P) with a projection the gradient each of the
    ``rows`` rows' projected state receives from the step after it ((0, ·) without); then the first two's prefixes
    for every step's rows and the third's rows by step."""
    passed = width if projection is None else projection.shape[0]
    d_h, d_c = like.new_zeros(sizes[0], passed), like.new_zeros(sizes[0], width)
    d_projected = like.new_zeros(rows if projection is not None else 0, passed)
    d_ps = by_step(d_projected, sizes) if projection is not None else []
    return d_h, d_c, d_projected, prefixes(d_h, sizes), prefixes(d_c, sizes), d_ps


def _rows_packed(t: torch.Tensor) -> bool:
    """t's rows lie one after the other, each contiguous (a block of a step's rows, or a prefix of one)."""
    return t.dim() == 2 and t.stride(1) == 1 and (t.shape[0] <= 1 or t.stride(0) == t.shape[1])


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedLstmSteps:
    """The compiled forward and backward steps for one scan's dtype (:func:`fused_lstm_steps`)."""

    def __init__(self, forward: object, backward: object) -> None:
        self._forward, self._backward = forward, backward

    def forward(
        self,
        acts: torch.Tensor,
        c_prev: torch.Tensor,
        g: torch.Tensor,
        c: torch.Tensor,
        tanh_c: torch.Tensor,
        h: torch.Tensor,
    ) -> None:
        """``acts`` (rows, 4H) from pre-activations to σ in place; g, c, tanh(c), h (rows, H) written."""
        if c_prev.stride(1) != 1:  # (a step's states where they are the initial ones: a row each, any layout)
            c_prev = c_prev.contiguous()
        rows, width = h.shape
        self._forward(
            acts.data_ptr(), rows, width, c_prev.data_ptr(), c_prev.stride(0), *map(_address, (g, c, tanh_c, h))
        )  # type: ignore[operator]

    def backward(
        self,
        dh_own: torch.Tensor,
        dh_next: torch.Tensor | None,
        dc_next: torch.Tensor,
        dc_own: torch.Tensor | None,
        forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        delta: torch.Tensor,
        dc_prev: torch.Tensor,
    ) -> None:
        """δ (rows, 4H) and the cell gradient passed back (rows, H) written, from the step's ``forward`` rows (σ(a),
        g, the entering c, tanh(c)); ``dc_prev`` may be ``dc_next``. Every operand's rows packed (blocks and prefixes
        of the tensors :func:`fused_lstm_steps` checked)."""
        rows, width = dc_prev.shape
        operands = (dh_own, dh_next, dc_next, dc_own, *forward, delta, dc_prev)
        self._backward(rows, width, *map(_address, operands))  # type: ignore[operator]


def fused_lstm_steps(acts: torch.Tensor, *others: torch.Tensor) -> FusedLstmSteps | None:
    """The compiled steps for a scan over ``acts`` (R, 4H) and its other (2-D) operands, or None where they do not
    apply: not all on the CPU in float32 or float64 (one dtype), rows not packed, or no compiled kernel here."""
    kind = _KINDS.get(acts.dtype)
    if kind is None or acts.device.type != "cpu" or not _rows_packed(acts):
        return None
    if any(t.device.type != "cpu" or t.dtype != acts.dtype or not _rows_packed(t) for t in others):
        return None
    found = compiled_scan_steps()
    if found is None:
        return None
    return FusedLstmSteps(found[f"forward_{kind}"], found[f"backward_{kind}"])


def fused_lstm_backward(
    fused: FusedLstmSteps,
    grad_h: torch.Tensor,
    grad_c: torch.Tensor | None,
    sizes: Sizes,
    steps: list[Step],
    kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    w: torch.Tensor,
    projection: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`.recurrent_scan._lstm_backward` by the compiled step: the steps in reverse order of ``steps``, each
    its δ from the forward's ``kept`` rows (σ(a), g, the entering c, tanh(c)) and the state gradients, then
    δ W_hh (W_hrᵀ first with a ``projection``) for the state before it."""
    acts = kept[0]
    width = kept[3].shape[1]
    delta = torch.empty_like(acts)
    ds, ghs = by_step(delta, sizes), by_step(grad_h, sizes)
    gcs = None if grad_c is None else by_step(grad_c, sizes)
    rows = [by_step(t, sizes) for t in kept]
    d_h, d_c, d_projected, d_hs, d_cs, d_ps = state_gradients(grad_h, acts.shape[0], sizes, width, projection)
    for t, size, _, _ in steps:
        if projection is None:
            dh_own, dh_next = ghs[t], d_hs[size]
        else:
            d_ps[t].copy_(d_hs[size])
            dh_own, dh_next = torch.addmm(ghs[t], d_hs[size], projection), None
        step_rows = (rows[0][t], rows[1][t], rows[2][t], rows[3][t])  # (σ(a), g, the entering c, tanh c)
        fused.backward(dh_own, dh_next, d_cs[size], None if gcs is None else gcs[t], step_rows, ds[t], d_cs[size])
        torch.mm(ds[t], w, out=d_hs[size])
    return delta, d_h, d_c, d_projected
