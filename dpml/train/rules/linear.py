"""Linear maps z_t = W a_t + b at positions t (Goodfellow 2015): ``F.linear`` (``nn.Linear``, the
projections inside ``F.multi_head_attention_forward``) and ``torch.addmm`` (transformers' GPT-2
``Conv1D``: z = b + a W, its input flattened to (B·T, n_in)).

∇_W ℓ_i = Σ_t δ_{i,t} a_{i,t}ᵀ — factored (u = δ, v = a), so its norm is a ghost norm or a
materialised one (:mod:`dpml.train.rules.combine`) — and ∇_b ℓ_i = Σ_t δ_{i,t}, materialised. The
input's rows must be known per example (:meth:`Call.rows`): batch-first, or with its batch dimension
followed through transposes and reshapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dpml.train.rules.ragged import kept_rows, form_of_rows, row_sums
from dpml.train.rules.registry import Call, Dense, Form, Pending, Rows, Tracked, Use, rule


def _not_rows(x: torch.Tensor) -> str:
    return f"its input (shape {tuple(x.shape)}) has no known batch dimension"


@rule(F.linear)
def linear(call: Call) -> Pending | str:
    """F.linear(a, W, b) = a Wᵀ + b."""
    a, weight, bias = call.arg(0, "input"), call.arg(1, "weight"), call.arg(2, "bias")
    if call.tracked(a) is not None:
        return "a parameter as its input"
    rows = call.rows(a)
    if rows is None:
        return _not_rows(a)
    w, b = call.tracked(weight), call.tracked(bias)
    if w is not None and len(w.shape()) != 2:
        return "a weight that is not 2-D"
    a_rows = kept_rows(rows, a.detach())
    return _weight_and_bias(call, w, b, rows, lambda d_rows: form_of_rows(rows, d_rows, a_rows), 1.0)


def _weight_and_bias(
    call: Call,
    w: Tracked | None,
    b: Tracked | None,
    rows: Rows,
    weight_form: Callable[[torch.Tensor], Form],
    beta: float,
) -> Pending:
    """The uses of W (its form from δ's rows as :func:`.ragged.kept_rows` keeps them) and of b (β Σ_t δ_t per
    example)."""

    def finish(d: torch.Tensor) -> list[Use]:
        d_rows = kept_rows(rows, d)
        uses: list[Use] = []
        if w is not None:
            uses.append((w, weight_form(d_rows)))
        if b is not None:
            total = row_sums(rows, d_rows)
            total = total * beta if beta != 1.0 else total
            uses.append((b, Dense(total.reshape(rows.batch, *b.shape()))))
        return uses

    return Pending(call.output, [t.param for t in (w, b) if t is not None], finish)


@rule(torch.addmm, torch.Tensor.addmm)
def addmm(call: Call) -> Pending | str:
    """torch.addmm(b, a, W, beta=β, alpha=α) = β b + α a W, a (N, n_in) the rows of the batch."""
    bias, a, weight = call.arg(0, "input"), call.arg(1, "mat1"), call.arg(2, "mat2")
    beta, alpha = float(call.kwargs.get("beta", 1.0)), float(call.kwargs.get("alpha", 1.0))
    if call.tracked(a) is not None:
        return "a parameter as its first matrix"
    rows = call.rows(a)
    if rows is None:
        return _not_rows(a)
    w, b = call.tracked(weight), call.tracked(bias)
    if b is not None and (len(b.shape()) > 2 or (len(b.shape()) == 2 and b.shape()[0] != 1)):
        return "a bias that is not broadcast over the rows"
    a_rows = kept_rows(rows, a.detach())

    def weight_form(d_rows: torch.Tensor) -> Form:  # ∇_W = α Σ_t a_t δ_tᵀ, W (n_in, n_out)
        return form_of_rows(rows, a_rows, d_rows * alpha if alpha != 1.0 else d_rows)

    return _weight_and_bias(call, w, b, rows, weight_form, beta)
