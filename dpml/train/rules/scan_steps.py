"""An LSTM's and a GRU's scan steps, fused on the CPU: the compiled kernels of ``dpml/train/_scan_steps.c`` in place of
the torch operations between a step's matrix products (:mod:`.recurrent_scan`), where they apply: CPU tensors in
float32 or float64, each operand's rows laid out one after the other. Elsewhere (a GPU, half precision, no C compiler)
the scan takes its torch operations, which compute the same numbers up to rounding (tanh as 2σ(2x) − 1 here, as the
LSTM's gates' already are there).

One LSTM step forward, on a step's rows (module docstring of ``_scan_steps.c``):

    σ over (a_i, a_f, 2a_g, a_o),  g = 2σ(2a_g) − 1,  c = f ⊙ c_prev + i ⊙ g,  h = o ⊙ tanh(c);

one step backward, its factors formed from what the forward kept (σ(a), g, the entering c, tanh(c)): dh = dh_own +
dh_next, dc = dc_next + dc_own + dh ⊙ o ⊙ (1 − tanh²c), δ = (σ'_i g, σ'_f c_prev, (1 − g²) i) ⊙ dc and
σ'_o tanh(c) ⊙ dh, the cell gradient passed back dc ⊙ f.

One GRU step forward, after the product q = W_hh h_prev + b_hh: r, z = σ(x̃_r + q_r), σ(x̃_z + q_z), n = tanh(x̃_n +
r ⊙ q_n), h = n + z ⊙ (h_prev − n); backward, from the kept gates, q_n and h_prev: δ = (σ'_r q_n n' dh, σ'_z (h_prev −
n) dh, n' dh) with n' = (1 − z)(1 − n²), the recurrent product's gradient (δ_r, δ_z, r ⊙ δ_n), and dh ⊙ z, the part
of the state gradient passed back that skips the product (torch's operations made five passes forward and four
backward, two of them broadcasting products that cost ten times the fused step)."""

from __future__ import annotations

from collections.abc import Callable

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


class _FusedSteps:
    """A cell's compiled forward and backward steps for one scan's dtype."""

    def __init__(self, forward: object, backward: object) -> None:
        self._forward, self._backward = forward, backward


class FusedLstmSteps(_FusedSteps):
    """The compiled LSTM steps for one scan's dtype (:func:`fused_lstm_steps`)."""

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


def _compiled(
    acts: torch.Tensor, others: tuple[torch.Tensor, ...]
) -> tuple[dict[str, Callable[..., object]], str] | None:
    """The compiled steps and the dtype's kind for a scan over ``acts`` and its other (2-D) operands, or None where
    they do not apply: not all on the CPU in float32 or float64 (one dtype), rows not packed, or no compiled kernel."""
    kind = _KINDS.get(acts.dtype)
    if kind is None or acts.device.type != "cpu" or not _rows_packed(acts):
        return None
    if any(t.device.type != "cpu" or t.dtype != acts.dtype or not _rows_packed(t) for t in others):
        return None
    found = compiled_scan_steps()
    return None if found is None else (found, kind)


def fused_lstm_steps(acts: torch.Tensor, *others: torch.Tensor) -> FusedLstmSteps | None:
    """The compiled LSTM steps for a scan over ``acts`` (R, 4H) and its other (2-D) operands, or None where they do
    not apply (:func:`_compiled`)."""
    compiled = _compiled(acts, others)
    if compiled is None:
        return None
    found, kind = compiled
    return FusedLstmSteps(found[f"lstm_forward_{kind}"], found[f"lstm_backward_{kind}"])


class FusedGruSteps(_FusedSteps):
    """The compiled GRU steps for one scan's dtype (:func:`fused_gru_steps`)."""

    def forward(
        self, x: torch.Tensor, q: torch.Tensor, h_prev: torch.Tensor, gates: torch.Tensor, h: torch.Tensor
    ) -> None:
        """``gates`` (r, z, n) (rows, 3H) and ``h`` (rows, H) written from a step's input terms ``x`` and recurrent
        product ``q`` (rows, 3H, packed) and the entering states ``h_prev`` (a row each, any row stride)."""
        if h_prev.stride(1) != 1:
            h_prev = h_prev.contiguous()
        rows, width = h.shape
        self._forward(  # type: ignore[operator]
            x.data_ptr(), q.data_ptr(), rows, width, h_prev.data_ptr(), h_prev.stride(0), gates.data_ptr(), h.data_ptr()
        )

    def backward(
        self,
        dh_own: torch.Tensor,
        dh_next: torch.Tensor,
        forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        delta: torch.Tensor,
        delta_hh: torch.Tensor,
    ) -> None:
        """δ and the recurrent product's gradient (rows, 3H) written, and dh ⊙ z over ``dh_next`` (rows, H), from the
        step's ``forward`` rows (the gates, q_n with any row stride, the entering states); the others packed."""
        gates, q_n, h_prev = forward
        rows, width = dh_next.shape
        self._backward(  # type: ignore[operator]
            rows,
            width,
            dh_own.data_ptr(),
            dh_next.data_ptr(),
            gates.data_ptr(),
            q_n.data_ptr(),
            q_n.stride(0),
            h_prev.data_ptr(),
            delta.data_ptr(),
            delta_hh.data_ptr(),
        )


def fused_gru_steps(x: torch.Tensor, *others: torch.Tensor) -> FusedGruSteps | None:
    """The compiled GRU steps for a scan over ``x`` (R, 3H) and its other (2-D) operands, or None where they do not
    apply (:func:`_compiled`)."""
    compiled = _compiled(x, others)
    if compiled is None:
        return None
    found, kind = compiled
    return FusedGruSteps(found[f"gru_forward_{kind}"], found[f"gru_backward_{kind}"])


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


def fused_gru_backward(
    fused: FusedGruSteps,
    grad_h: torch.Tensor,
    sizes: Sizes,
    steps: list[Step],
    kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`.recurrent_scan._gru_backward` by the compiled step: the steps in reverse order of ``steps``, each its δ
    and δ^hh from the forward's ``kept`` rows (the gates, q_n, the entering states), then dh ⊙ z + δ^hh W_hh for the
    state before it."""
    gates = kept[0]
    delta, delta_hh = torch.empty_like(gates), torch.empty_like(gates)
    ds, dhs, ghs = by_step(delta, sizes), by_step(delta_hh, sizes), by_step(grad_h, sizes)
    rows = [by_step(t, sizes) for t in kept]
    d_h = gates.new_zeros(sizes[0], grad_h.shape[1])
    d_hs = prefixes(d_h, sizes)
    for t, size, _, _ in steps:
        fused.backward(ghs[t], d_hs[size], (rows[0][t], rows[1][t], rows[2][t]), ds[t], dhs[t])
        d_hs[size].addmm_(dhs[t], w)
    return delta, delta_hh, d_h
