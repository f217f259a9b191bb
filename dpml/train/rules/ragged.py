"""Factored uses of ragged rows kept packed: the tokens a mixture of experts routes to one expert, each example a
different number of them (:class:`.registry.Rows` with ``counts``). Padded to (B, W, n), every example's rows to the
most any example holds, the factors of such a use are mostly zero rows (an example's padding tokens, all alike, go to
the same experts: W several times the mean), and forming them costs a zero fill and a copy of B·W rows. So a rule on
such rows keeps each factor packed, (N, n) example by example: its norm and clipped sum read them so
(:func:`dpml.train.ragged_norms.ragged_norms`), a bias's per-example sums add them up by example, and only a reader
that needs (B, W, n) (a weight used twice, a computed weight's pull-back) pads them, by :meth:`Ragged.padded`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpml.train.ragged_norms import row_owners
from dpml.train.rules.registry import Factored, Rows


@dataclass(eq=False)
class Ragged:
    """Per-example gradient Σ_t u_t v_tᵀ of a 2-D view (rows × cols) over ragged rows: ``u`` (N, rows) and ``v``
    (N, cols) where the operation had them, ``layout`` the rows' :class:`.registry.Rows` (``layout.counts`` and
    ``layout.order``, example by example, on the CPU)."""

    u: torch.Tensor
    v: torch.Tensor
    rows: int
    cols: int
    layout: Rows

    def padded(self) -> Factored:
        """The same use as (B, W, ·) factors, zero rows after each example's (their count kept as ``lengths``)."""
        u, v = self.layout.of(self.u), self.layout.of(self.v)
        return Factored(u, v, self.rows, self.cols, lengths=self.layout.counts)

    def transposed(self) -> Ragged:
        return Ragged(self.v, self.u, self.cols, self.rows, self.layout)

    def cast(self, dtype: torch.dtype) -> Ragged:
        u, v = (t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t for t in (self.u, self.v))
        return Ragged(u, v, self.rows, self.cols, self.layout)


def kept_rows(rows: Rows, t: torch.Tensor) -> torch.Tensor:
    """t's rows as a factor keeps them: (N, n) where they lie where the examples hold different numbers of them (their
    order, example by example, is ``rows.order``), else (B, k, n) (:meth:`.registry.Rows.of`)."""
    return t.reshape(-1, t.shape[-1]) if rows.counts is not None else rows.of(t)


def form_of_rows(rows: Rows, u: torch.Tensor, v: torch.Tensor) -> Factored | Ragged:
    """Σ_t u_t v_tᵀ per example of two factors :func:`kept_rows` gave."""
    if rows.counts is not None:
        return Ragged(u, v, u.shape[-1], v.shape[-1], rows)
    return Factored(u, v, u.shape[2], v.shape[2])


def row_sums(rows: Rows, kept: torch.Tensor) -> torch.Tensor:
    """Σ_t of each example's rows, (B, n), of a factor :func:`kept_rows` gave."""
    if rows.counts is None:
        return kept.sum(1)
    owners = row_owners(rows.counts, rows.order).to(kept.device)
    return kept.new_zeros(rows.batch, kept.shape[-1]).index_add_(0, owners, kept)
