"""A parameter on either side of a matrix product: ``x @ W``, ``W @ x``, ``torch.matmul``, ``torch.mm``
(with W a 2-D parameter, or a view of one: ``x @ w.t()``, ``x @ w[:, :k]``; a 1-D one is a column; one of
more dimensions, broadcast against x's leading ones, goes to :func:`dpml.train.rules.einsum.matmul_batched`).

- x @ W, x (B, …, T, n_in), W (n_in, n_out): ∇_W ℓ_i = Σ_t a_t δ_tᵀ, factored (u = a, v = δ);
- W @ x, x (B, …, n_in, T), W (n_out, n_in): ∇_W ℓ_i = Σ_t δ_t a_tᵀ over the columns t (u = δ, v = a).

The activation must be batch-first (or have its rows known: :meth:`Call.rows`) for x @ W, and
batch-first with at least 3 dimensions for W @ x (a 2-D right operand is one matrix, not a batch).
"""

from __future__ import annotations

from typing import Any

import torch

from dpml.train.rules.einsum import matmul_batched
from dpml.train.rules.registry import Call, Factored, Pending, Tracked, Use, rule


def _operands(call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """(left, right) of the product, whichever way it was written."""
    first: torch.Tensor = call.arg(0, "input")
    second: Any = call.args[1] if len(call.args) > 1 else call.kwargs.get("other", call.kwargs.get("mat2"))
    return (second, first) if getattr(call.func, "__name__", "") == "__rmatmul__" else (first, second)


@rule(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.mm, torch.Tensor.mm)
def matmul(call: Call) -> Pending | str:
    left, right = _operands(call)
    tl, tr = call.tracked(left), call.tracked(right)
    if tl is not None and tr is not None:
        return "a product of two parameters"
    if tr is not None:
        return _param_on_the_right(call, left, tr)
    return _param_on_the_left(call, right, tl)  # type: ignore[arg-type]


def _param_on_the_right(call: Call, x: torch.Tensor, w: Tracked) -> Pending | str:
    if len(w.shape()) > 2:
        return matmul_batched(call, x, w, s_left=False)
    rows = call.rows(x) if x.dim() >= 2 else None
    if rows is None:
        return f"its activation (shape {tuple(x.shape)}) has no known batch dimension"
    column = len(w.shape()) == 1
    a_rows = rows.of(x.detach())

    def finish(d: torch.Tensor) -> list[Use]:
        d_rows = rows.of(d.unsqueeze(-1) if column else d)
        return [(w, Factored(a_rows, d_rows, a_rows.shape[2], d_rows.shape[2]))]

    return Pending(call.output, [w.param], finish)


def _param_on_the_left(call: Call, x: torch.Tensor, w: Tracked) -> Pending | str:
    if len(w.shape()) > 2:
        return matmul_batched(call, x, w, s_left=True)
    if len(w.shape()) != 2:
        return "a parameter on the left that is not 2-D"
    if x.dim() < 3 or not call.batch_first(x):
        return f"its activation (shape {tuple(x.shape)}) is not batch-first with a batch of matrices"
    batch = x.shape[0]
    a_rows = x.detach().transpose(-1, -2).reshape(batch, -1, x.shape[-2])  # (B, T, n_in): the columns

    def finish(d: torch.Tensor) -> list[Use]:
        d_rows = d.transpose(-1, -2).reshape(batch, -1, d.shape[-2])  # (B, T, n_out)
        return [(w, Factored(d_rows, a_rows, d_rows.shape[2], a_rows.shape[2]))]

    return Pending(call.output, [w.param], finish)
