"""One recurrent layer in one direction as one operation, :func:`scan`, and its rule: the recurrence over the rows of
its steps run as one autograd node whose backward pass is backpropagation through time written out, so that the
recording sees a fused kernel's layer as two operations (its input product, then the scan) and not as T steps of a
dozen operations each.

Rows. A layer's input terms x̃ = W_ih x + b_ih are rows (R, G) laid out step by step, as ATen's packed layers read
them: step t holds the rows of the first n_t sequences (n_t non-increasing; padded sequences: n_t = N for every t,
the time-major rows), rows s_t … s_t + n_t − 1 with s_t = Σ_{u<t} n_u. Forward, step t takes the states of sequences
0 … n_t − 1 after step t − 1 (or their initial states); reversed, the states after step t + 1, a sequence joining at
its last step from its initial state. The scan returns, row by row, the hidden state h after the row's step (and an
LSTM's cell state c), and the state that entered it, h_prev (the recurrent product's input; not differentiable).

Steps (module :mod:`dpml.train.rules.recurrent` gives the cells with their papers), with a_r the pre-activations:

- LSTM: a = x̃ + W_hh h_prev + b_hh = (a_i, a_f, a_g, a_o); i, f, o = σ(a_i, a_f, a_o), g = tanh(a_g);
  c = f ⊙ c_prev + i ⊙ g, h = o ⊙ tanh(c); with a projection (``proj_size``), the state passed on is W_hr h;
- GRU: (q_r, q_z, q_n) = W_hh h_prev + b_hh; r, z = σ(x̃_r + q_r), σ(x̃_z + q_z); n = tanh(x̃_n + r ⊙ q_n);
  h = n + z ⊙ (h_prev − n);
- Elman: h = tanh or relu(x̃ + W_hh h_prev + b_hh).

Backward (Werbos 1990, backpropagation through time), from the last step processed to the first, with ∂h the
gradient reaching a row's h (its own, plus what the step after it sends back) and ∂c likewise:

- LSTM: δ_o = ∂h ⊙ tanh(c) ⊙ o(1 − o); ∂c += ∂h ⊙ o ⊙ (1 − tanh²c); δ_i = ∂c ⊙ g ⊙ i(1 − i);
  δ_f = ∂c ⊙ c_prev ⊙ f(1 − f); δ_g = ∂c ⊙ i ⊙ (1 − g²); sent back: ∂c_prev = ∂c ⊙ f, ∂h_prev = W_hhᵀ δ (with a
  projection, the passed-on state's gradient, and ∂h = ∂h_own + W_hrᵀ ∂h_passed);
- GRU: δ_n = ∂h ⊙ (1 − z)(1 − n²); δ_z = ∂h ⊙ (h_prev − n) ⊙ z(1 − z); δ_r = δ_n ⊙ q_n ⊙ r(1 − r); the
  recurrent product's gradient δ^hh = (δ_r, δ_z, δ_n ⊙ r); sent back: ∂h_prev = ∂h ⊙ z + W_hhᵀ δ^hh;
- Elman: δ = ∂h ⊙ (1 − h²) (tanh) or ∂h ⊙ [h > 0] (relu); sent back: ∂h_prev = W_hhᵀ δ.

The scan's gradient with respect to x̃ is δ (the pre-activations' gradient). Each factor that does not depend on ∂h
is formed for all rows at once before the loop, so a step costs one product and a few elementwise operations; on the
CPU an LSTM's and a GRU's step runs its elementwise work as one compiled pass instead, the backward forming the
factors from what the forward kept (:mod:`.scan_steps`).

Arithmetic: in x̃'s dtype, the weights cast to it; in float32 where x̃ is in half precision (under autocast, the input
product's), the outputs then cast back to x̃'s dtype: the recurrence adds up rounding over its T steps.
tanh of a pre-activation (an LSTM's g gate, an Elman RNN's tanh, a GRU's n gate in its compiled step) is 2σ(2a) − 1,
with 2a formed from doubled operands (exact): one σ over all of a step's gates, where this CPU's tanh costs several
times σ. It differs from tanh by rounding only (≤ 2 ulp of 1 in absolute terms), as the fused kernels' own
activations do from ATen's.

Rule. W_hh enters every row's step linearly, W_hh h_prev, and its gradient there is δ^hh (δ itself for an LSTM and
an Elman RNN, whose pre-activations add x̃ and W_hh h_prev; GRU's (δ_r, δ_z, δ_n ⊙ r)). So ∇_{W_hh} ℓ_i =
Σ_{rows of i} δ^hh h_prevᵀ and ∇_{b_hh} ℓ_i = Σ_{rows of i} δ^hh (Goodfellow 2015), one factored gradient over the
rows of example i. δ is the gradient of the scan's operand x̃, which the engine's one backward pass gives. An
initial state computed from the batch must hold, row s, the example of sequence s (as every state the module makes
does); otherwise the rule refuses, and W_hh and b_hh take the exact path.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import handle_torch_function, has_torch_function

from dpml.train.rules.scan_steps import (
    Sizes,
    Step,
    by_step,
    fused_gru_backward,
    fused_gru_steps,
    fused_lstm_backward,
    fused_lstm_steps,
    prefixes,
    state_gradients,
)
from dpml.train.rules.registry import Call, Dense, Factored, Pending, Rows, Use, rule

KINDS = ("lstm", "gru", "rnn_tanh", "rnn_relu")
Scanned = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


def scan(
    kind: str,
    gates_in: torch.Tensor,
    sizes: Sizes,
    h0: torch.Tensor,
    c0: torch.Tensor | None,
    w_hh: torch.Tensor,
    b_hh: torch.Tensor | None,
    reverse: bool,
    w_hr: torch.Tensor | None = None,
) -> Scanned:
    """The recurrence ``kind`` over the rows of x̃ = ``gates_in`` (R, G·H), step t's rows the first ``sizes[t]``
    sequences', from the initial states ``h0`` (and ``c0``: an LSTM) (sizes[0], H) (module docstring): (h rows (R, H),
    c rows (R, H) or None, h_prev rows (R, H), a GRU's r rows (R, H) or None). With an LSTM's projection ``w_hr``
    (P, H), the states entering the steps are the projected W_hr h (the initial ones and h_prev (R, P)), and the h
    rows are those before the projection. Seen by the recording as one call."""
    operands = tuple(t for t in (gates_in, h0, c0, w_hh, b_hh, w_hr) if t is not None)
    if has_torch_function(operands):
        found: Scanned = handle_torch_function(scan, operands, kind, gates_in, sizes, h0, c0, w_hh, b_hh, reverse, w_hr)
        return found
    scanned: Scanned = _Scan.apply(  # type: ignore[no-untyped-call]
        kind, gates_in, sizes, h0, c0, w_hh, b_hh, reverse, w_hr
    )
    return scanned


@functools.lru_cache(maxsize=256)
def step_rows(sizes: Sizes, reverse: bool) -> tuple[list[Step], torch.Tensor]:
    """The steps in the order they run, each as (its index t, its number of rows, the index of the step whose states
    enter it, −1 for none, how many of its sequences that step carries: the others start from their initial
    states), and for every row the row of the state that enters its step: the same sequence's row one step back
    (forward) or on (reversed), or R + s for sequence s's initial state (row s of ``h0`` after the R rows)."""
    starts = list(itertools.accumulate(sizes[:-1], initial=0))
    total = starts[-1] + sizes[-1]
    entering = torch.empty(total, dtype=torch.int64)
    steps: list[Step] = []
    for t in range(len(sizes) - 1, -1, -1) if reverse else range(len(sizes)):
        start, size = starts[t], sizes[t]
        before = t + 1 if reverse else t - 1
        before, carried = (before, min(size, sizes[before])) if 0 <= before < len(sizes) else (-1, 0)
        entering[start : start + carried] = torch.arange(starts[before], starts[before] + carried)
        entering[start + carried : start + size] = torch.arange(total + carried, total + size)
        steps.append((t, size, before, carried))
    return steps, entering


def _entering(rows: torch.Tensor, initial: torch.Tensor, sizes: Sizes, reverse: bool) -> torch.Tensor:
    """For every row, the state that entered its step (:func:`step_rows`)."""
    index = step_rows(sizes, reverse)[1].to(rows.device)
    return torch.cat([rows, initial]).index_select(0, index)


def _state_in(rows: list[torch.Tensor], initial: torch.Tensor, step: Step) -> torch.Tensor:
    """The states entering ``step``: the rows of the step before it (a view where it carries every sequence, as it
    does on padded sequences and forward over packed ones), and initial states for the sequences it does not."""
    _, size, before, carried = step
    if carried == size:
        return rows[before] if rows[before].shape[0] == size else rows[before][:size]
    if carried == 0:
        return initial[:size]
    return torch.cat([rows[before][:carried], initial[carried:size]])


def _doubled(t: torch.Tensor, columns: slice) -> torch.Tensor:
    """t, a tensor of the caller's own, with ``columns`` of its last dimension times 2 in place (exact in floating
    point): σ(2a) of a pre-activation a computed from doubled operands is σ of exactly twice a's rounded value, and
    tanh(a) = 2σ(2a) − 1 (one σ over every gate at once, not a tanh of its own)."""
    t[..., columns] *= 2
    return t


def _arithmetic(dtype: torch.dtype) -> torch.dtype:
    """The scan's arithmetic: float32 for input terms in half precision (bfloat16, float16: under autocast), whose
    rounding would otherwise add up over the T steps of the state's recurrence; else their own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _Scan(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        kind: str,
        gates_in: torch.Tensor,
        sizes: Sizes,
        h0: torch.Tensor,
        c0: torch.Tensor | None,
        w_hh: torch.Tensor,
        b_hh: torch.Tensor | None,
        reverse: bool,
        w_hr: torch.Tensor | None,
    ) -> Scanned:
        dtype = _arithmetic(gates_in.dtype)
        x = gates_in.to(dtype)
        w = w_hh.to(dtype)
        b = None if b_hh is None else b_hh.to(dtype)
        steps = step_rows(sizes, reverse)[0]
        h0 = h0.to(dtype)
        ctx.set_materialize_grads(False)
        operands = (kind, gates_in, sizes, h0, c0, w_hh, b_hh, reverse, w_hr)
        ctx.edges = {i: k for k, i in enumerate(i for i, a in enumerate(operands) if isinstance(a, torch.Tensor))}
        ctx.kind, ctx.sizes, ctx.reverse, ctx.dtypes = kind, sizes, reverse, (gates_in.dtype, w_hh.dtype)
        c_rows = r_rows = None
        if kind == "lstm":
            assert c0 is not None
            projection = None if w_hr is None else w_hr.to(dtype)
            h_rows, p_rows, c_rows, acts, g_rows, tanh_c = _lstm_forward(
                x, sizes, steps, h0, c0.to(dtype), w, b, projection
            )
            c_prev = _entering(c_rows, c0.to(dtype), sizes, reverse)
            h_prev = _entering(p_rows, h0, sizes, reverse)
            ctx.save_for_backward(acts, g_rows, tanh_c, c_prev, h_prev, w, projection, h_rows)
        elif kind == "gru":
            h_rows, gates, q_n = _gru_forward(x, sizes, steps, h0, w, b)
            h_prev = _entering(h_rows, h0, sizes, reverse)
            r_rows = gates[:, : h0.shape[1]].clone()
            ctx.save_for_backward(gates, q_n, h_prev, w)
        else:
            h_rows = _elman_forward(x, sizes, steps, h0, w, b, kind == "rnn_relu")
            h_prev = _entering(h_rows, h0, sizes, reverse)
            ctx.save_for_backward(h_rows, h_prev, w)
        ctx.mark_non_differentiable(*(t for t in (h_prev, r_rows) if t is not None))
        out = gates_in.dtype
        return h_rows.to(out), None if c_rows is None else c_rows.to(out), h_prev, r_rows

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        grad_h, grad_c = grads[0], grads[1]
        steps = step_rows(ctx.sizes, ctx.reverse)[0][::-1]  # the steps in the order opposite to the forward pass's
        d_hr = None
        if ctx.kind == "lstm":
            acts, g_rows, tanh_c, c_prev, h_prev, w, projection, h_rows = ctx.saved_tensors
            delta, d_h0, d_c0, d_projected = _lstm_backward(
                grad_h, grad_c, ctx.sizes, steps, acts, g_rows, tanh_c, c_prev, w, projection
            )
            delta_hh = delta
            if _asked(ctx, 8):  # ∇W_hr = Σ_rows ∂(W_hr h)ᵀ h, the states' gradients the steps sent back
                d_hr = d_projected.t().mm(h_rows).to(ctx.dtypes[1])
        elif ctx.kind == "gru":
            gates, q_n, h_prev, w = ctx.saved_tensors
            delta, delta_hh, d_h0 = _gru_backward(grad_h, ctx.sizes, steps, gates, q_n, h_prev, w)
            d_c0 = None
        else:
            h_rows, h_prev, w = ctx.saved_tensors
            delta, d_h0 = _elman_backward(grad_h, ctx.sizes, steps, h_rows, w, ctx.kind == "rnn_relu")
            delta_hh, d_c0 = delta, None
        d_w = delta_hh.t().mm(h_prev).to(ctx.dtypes[1]) if _asked(ctx, 5) else None
        d_b = delta_hh.sum(0).to(ctx.dtypes[1]) if _asked(ctx, 6) else None
        return None, delta.to(ctx.dtypes[0]), None, d_h0, d_c0, d_w, d_b, None, d_hr


def _asked(ctx: Any, index: int) -> bool:
    """Whether this backward pass uses the gradient of operand ``index``: it requires one, and the pass reaches the
    node it flows to. The engine's pass asks autograd for the gradients of recorded outputs only, so a weight's batch
    gradient (W_hh's: a (G × R)·(R × H) product, as large as the input product's) is not formed there. Where autograd
    cannot tell (a leaf's node under ``torch.autograd.grad`` asked for that leaf), it is formed."""
    if not ctx.needs_input_grad[index]:
        return False
    node = ctx.next_functions[ctx.edges[index]][0]  # one edge for each tensor operand, in order
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # a leaf's node while torch.autograd.grad runs: autograd does not say
        return True


def _zeros_or(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """An output's gradient in ``like``'s dtype, its rows packed (autograd hands ``h.sum()``'s on as one row expanded,
    which the compiled steps do not read), or zeros (R, H) where the pass sends none."""
    if grad is None:
        return torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    return grad.to(like.dtype).contiguous()


def _lstm_forward(
    gates_in: torch.Tensor,
    sizes: Sizes,
    steps: list[Step],
    h0: torch.Tensor,
    c0: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    projection: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h rows, the states the steps pass on (W_hr h with a ``projection``, else h itself), c rows, the activated
    gates i, f, o (the g columns hold σ(2a_g)), g = tanh(a_g) = 2σ(2a_g) − 1 and tanh(c), row by row."""
    width = w.shape[0] // 4  # H (the states passed on have P with a projection)
    g_cols = slice(2 * width, 3 * width)
    acts = _doubled(gates_in.clone() if b is None else gates_in + b, g_cols)  # the steps activate it in place
    w_t = _doubled(w.t().clone(), g_cols)
    g_rows = acts.new_empty(acts.shape[0], width)
    c_rows, tanh_c, h_rows = torch.empty_like(g_rows), torch.empty_like(g_rows), torch.empty_like(g_rows)
    a_all = by_step(acts, sizes)
    gs, cs, tcs, hs = (by_step(t, sizes) for t in (g_rows, c_rows, tanh_c, h_rows))
    p_rows = h_rows if projection is None else h_rows.new_empty(h_rows.shape[0], projection.shape[0])
    ps, p_t = by_step(p_rows, sizes), None if projection is None else projection.t()
    fused = fused_lstm_steps(acts, c0)  # (None: torch's operations, on each gate's columns by step)
    i_all, f_all, g_all, o_all = (
        ([],) * 4 if fused is not None else (by_step(acts[:, k * width : (k + 1) * width], sizes) for k in range(4))
    )
    for step in steps:
        t = step[0]
        h, c = _state_in(ps, h0, step), _state_in(cs, c0, step)
        a_all[t].addmm_(h, w_t)
        if fused is not None:
            fused.forward(a_all[t], c, gs[t], cs[t], tcs[t], hs[t])
        else:
            a_all[t].sigmoid_()
            g = torch.mul(g_all[t], 2, out=gs[t]).sub_(1)
            cell = torch.mul(f_all[t], c, out=cs[t]).addcmul_(i_all[t], g)
            torch.mul(o_all[t], torch.tanh(cell, out=tcs[t]), out=hs[t])
        if p_t is not None:
            torch.mm(hs[t], p_t, out=ps[t])
    return h_rows, p_rows, c_rows, acts, g_rows, tanh_c


def _lstm_backward(
    grad_h: torch.Tensor | None,
    grad_c: torch.Tensor | None,
    sizes: Sizes,
    steps: list[Step],
    acts: torch.Tensor,
    g: torch.Tensor,
    tanh_c: torch.Tensor,
    c_prev: torch.Tensor,
    w: torch.Tensor,
    projection: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """δ (R, 4H), the initial states' gradients (module docstring) and, with a ``projection``, the gradient each
    row's projected state W_hr h received from the step after it (R, P): ∂h = ∂h_own + W_hrᵀ ∂(W_hr h)."""
    width = tanh_c.shape[1]
    grad_h = _zeros_or(grad_h, tanh_c)
    grad_c = None if grad_c is None else grad_c.to(grad_h.dtype).contiguous()
    fused = fused_lstm_steps(acts, grad_h, g, c_prev, tanh_c, *([] if grad_c is None else [grad_c]))
    if fused is not None:  # (its factors formed step by step from what the forward kept)
        return fused_lstm_backward(fused, grad_h, grad_c, sizes, steps, (acts, g, c_prev, tanh_c), w, projection)
    i, o = acts[:, :width], acts[:, 3 * width :]
    factors = torch.addcmul(acts, acts, acts, value=-1)  # σ'(a) = σ(1 − σ) for i, f, o
    factors[:, :width].mul_(g)
    factors[:, width : 2 * width].mul_(c_prev)
    torch.mul(g, g, out=factors[:, 2 * width : 3 * width]).neg_().add_(1).mul_(i)
    factors[:, 3 * width :].mul_(tanh_c)
    to_cell = torch.addcmul(o, o * tanh_c, tanh_c, value=-1)  # ∂c += ∂h ⊙ o ⊙ (1 − tanh²c)
    delta = torch.empty_like(acts)
    stacked_delta, stacked_factors = delta.view(-1, 4, width), factors.view(-1, 4, width)
    ds, d3s, dos = by_step(delta, sizes), by_step(stacked_delta[:, :3], sizes), by_step(stacked_delta[:, 3], sizes)
    k3s, kos = by_step(stacked_factors[:, :3], sizes), by_step(stacked_factors[:, 3], sizes)
    ghs, gcs = by_step(grad_h, sizes), None if grad_c is None else by_step(grad_c, sizes)
    fs, tos = by_step(acts[:, width : 2 * width], sizes), by_step(to_cell, sizes)
    d_h, d_c, d_projected, d_hs, d_cs, d_ps = state_gradients(tanh_c, tanh_c.shape[0], sizes, width, projection)
    for t, size, _, _ in steps:
        if projection is None:
            dh = ghs[t] + d_hs[size]
        else:
            d_ps[t].copy_(d_hs[size])
            dh = torch.addmm(ghs[t], d_hs[size], projection)
        dc = torch.addcmul(d_cs[size] if gcs is None else d_cs[size] + gcs[t], dh, tos[t])
        torch.mul(k3s[t], dc.unsqueeze(1), out=d3s[t])
        torch.mul(kos[t], dh, out=dos[t])
        torch.mul(dc, fs[t], out=d_cs[size])
        torch.mm(ds[t], w, out=d_hs[size])
    return delta, d_h, d_c, d_projected


def _gru_forward(
    gates_in: torch.Tensor, sizes: Sizes, steps: list[Step], h0: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h rows, the gates (r, z, n) and the recurrent product's n part q_n, row by row."""
    width = h0.shape[1]
    gates, products = torch.empty_like(gates_in), torch.empty_like(gates_in)  # products: W_hh h_prev + b_hh
    q_n, h_rows = products[:, 2 * width :], gates_in.new_empty(gates_in.shape[0], width)
    w_t, qs, hs = w.t(), by_step(products, sizes), by_step(h_rows, sizes)
    fused = fused_gru_steps(gates_in)  # (None: torch's operations, on each gate's columns by step)
    if fused is not None:  # whole rows by step
        xs, gs = by_step(gates_in, sizes), by_step(gates, sizes)
    else:
        rz_cols, n_cols = slice(0, 2 * width), slice(2 * width, None)
        x_rz, x_n = by_step(gates_in[:, rz_cols], sizes), by_step(gates_in[:, n_cols], sizes)
        r_cols, z_cols = slice(0, width), slice(width, 2 * width)
        rzs, rs, zs, ns = (by_step(gates[:, cols], sizes) for cols in (rz_cols, r_cols, z_cols, n_cols))
    for step in steps:
        t = step[0]
        h = _state_in(hs, h0, step)
        q = torch.mm(h, w_t, out=qs[t]) if b is None else torch.addmm(b, h, w_t, out=qs[t])
        if fused is not None:
            fused.forward(xs[t], q, h, gs[t], hs[t])
            continue
        torch.add(x_rz[t], q[:, : 2 * width], out=rzs[t]).sigmoid_()
        n = torch.addcmul(x_n[t], rs[t], q[:, 2 * width :], out=ns[t]).tanh_()
        torch.lerp(n, h, zs[t], out=hs[t])  # n + z ⊙ (h_prev − n)
    return h_rows, gates, q_n


def _gru_backward(
    grad_h: torch.Tensor | None,
    sizes: Sizes,
    steps: list[Step],
    gates: torch.Tensor,
    q_n: torch.Tensor,
    h_prev: torch.Tensor,
    w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """δ, δ^hh (R, 3H) and the initial state's gradient (module docstring)."""
    width = q_n.shape[1]
    grad_h = _zeros_or(grad_h, q_n)
    fused = fused_gru_steps(gates, grad_h, h_prev) if q_n.stride(1) == 1 else None
    if fused is not None:  # (its factors formed step by step from what the forward kept)
        return fused_gru_backward(fused, grad_h, sizes, steps, (gates, q_n, h_prev), w)
    r, z, n = gates.chunk(3, 1)
    to_n = (1 - z) * (1 - n * n)
    factors = torch.cat([to_n * q_n * r * (1 - r), (h_prev - n) * z * (1 - z), to_n], 1)
    hh_factors = torch.cat([factors[:, : 2 * width], to_n * r], 1)
    delta, delta_hh = torch.empty_like(gates), torch.empty_like(gates)
    ks, khs = by_step(factors.view(-1, 3, width), sizes), by_step(hh_factors.view(-1, 3, width), sizes)
    ds, dhs = by_step(delta.view(-1, 3, width), sizes), by_step(delta_hh.view(-1, 3, width), sizes)
    ghs, zs, hh_rows = by_step(grad_h, sizes), by_step(z, sizes), by_step(delta_hh, sizes)
    d_h = q_n.new_zeros(sizes[0], width)
    d_hs = prefixes(d_h, sizes)
    for t, size, _, _ in steps:
        dh = ghs[t] + d_hs[size]
        torch.mul(ks[t], dh.unsqueeze(1), out=ds[t])
        torch.mul(khs[t], dh.unsqueeze(1), out=dhs[t])
        torch.addmm(dh * zs[t], hh_rows[t], w, out=d_hs[size])
    return delta, delta_hh, d_h


def _elman_forward(
    gates_in: torch.Tensor,
    sizes: Sizes,
    steps: list[Step],
    h0: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    relu: bool,
) -> torch.Tensor:
    everything = slice(0, None)
    h_rows = gates_in.clone() if b is None else gates_in + b  # the steps add W_hh h_prev and activate it in place
    w_t = w.t() if relu else _doubled(w.t().clone(), everything)
    hs = by_step(h_rows if relu else _doubled(h_rows, everything), sizes)
    for step in steps:
        out = hs[step[0]].addmm_(_state_in(hs, h0, step), w_t)
        out.relu_() if relu else out.sigmoid_().mul_(2).sub_(1)  # tanh(a) = 2σ(2a) − 1
    return h_rows


def _elman_backward(
    grad_h: torch.Tensor | None,
    sizes: Sizes,
    steps: list[Step],
    h_rows: torch.Tensor,
    w: torch.Tensor,
    relu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_h = _zeros_or(grad_h, h_rows)
    slope = (h_rows > 0).to(h_rows.dtype) if relu else 1 - h_rows * h_rows
    delta = torch.empty_like(h_rows)
    ghs, slopes, ds = by_step(grad_h, sizes), by_step(slope, sizes), by_step(delta, sizes)
    d_h = h_rows.new_zeros(sizes[0], h_rows.shape[1])
    d_hs = prefixes(d_h, sizes)
    for t, size, _, _ in steps:
        torch.mul(ghs[t] + d_hs[size], slopes[t], out=ds[t])
        torch.mm(ds[t], w, out=d_hs[size])
    return delta, d_h


@rule(scan)
def recurrence(call: Call) -> Pending | str:
    """W_hh and b_hh of a :func:`scan` (module docstring): one factored gradient over the rows of each example, from
    δ = the gradient of the operand x̃; and an LSTM's projection W_hr where the steps use it (:func:`_passed_on`)."""
    kind, gates_in, sizes, h0, c0, w_hh, b_hh, reverse = call.args[:8]
    w_hr = call.args[8] if len(call.args) > 8 else None
    if any(call.tracked(t) is not None for t in (gates_in, h0, c0)):
        return "a parameter as its input or initial state"
    rows = call.rows(gates_in)
    if rows is None:
        return f"its input terms (shape {tuple(gates_in.shape)}) have no known batch dimension"
    owners = call.leading_examples(gates_in)
    for state in (h0, c0):
        if state is not None and call.from_batch(state):
            found = call.leading_examples(state)
            if owners is None or found is None or not torch.equal(found.cpu(), owners[: sizes[0]].cpu()):
                return "an initial state whose rows are not the examples of its sequences"
    w, b, hr = call.tracked(w_hh), call.tracked(b_hh), call.tracked(w_hr)
    h_rows, _, h_prev, r_rows = call.output
    prev = rows.of(h_prev.detach())
    passed_on = None if hr is None else _passed_on(sizes, reverse, w_hh, rows.of(h_rows.detach()))

    def finish(d: torch.Tensor) -> list[Use]:
        if r_rows is not None:  # GRU: δ^hh = (δ_r, δ_z, δ_n ⊙ r)
            width = d.shape[1] // 3
            d = torch.cat([d[:, : 2 * width], d[:, 2 * width :] * r_rows.to(d.dtype)], 1)
        d_rows = rows.of(d)
        uses: list[Use] = []
        if w is not None:
            uses.append((w, Factored(d_rows, prev, d_rows.shape[2], prev.shape[2])))
        if b is not None:
            uses.append((b, Dense(d_rows.sum(1).reshape(d_rows.shape[0], *b.shape()))))
        if hr is not None and passed_on is not None:
            uses.append((hr, passed_on(d, rows)))
        return uses

    return Pending(gates_in, [t.param for t in (w, b, hr) if t is not None], finish)


def _passed_on(
    sizes: Sizes, reverse: bool, w_hh: torch.Tensor, h: torch.Tensor
) -> Callable[[torch.Tensor, Rows], Factored]:
    """W_hr's use inside an LSTM's steps: each row's state passed on is W_hr h, and the gradient it receives is
    W_hhᵀ δ of the row of the step that reads it (the same sequence's next one), none for a sequence's last. So
    ∇_{W_hr} ℓ_i (there) = Σ_{rows of i} (W_hhᵀ δ_next) hᵀ: factored, ``h`` the rows before the projection (B, k, H),
    from δ (R, 4H) once the backward pass has given it. The layer's outputs W_hr h are the decomposition's own
    linear map (:func:`dpml.train.rules.recurrent.scan_direction`): that use is the linear rule's."""
    entering = step_rows(sizes, reverse)[1]
    reads = torch.nonzero(entering < entering.numel()).flatten()  # the rows whose entering state is a row's
    read = entering[reads]

    def factored(d: torch.Tensor, rows: Rows) -> Factored:
        sent = d.new_zeros(d.shape[0], w_hh.shape[1])
        sent.index_copy_(0, read.to(d.device), d.index_select(0, reads.to(d.device)) @ w_hh.detach().to(d.dtype))
        u = rows.of(sent)
        return Factored(u, h, u.shape[2], h.shape[2])

    return factored
