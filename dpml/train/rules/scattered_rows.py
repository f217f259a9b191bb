"""A frozen table with some of its rows replaced by a parameter's (``W.index_copy(0, rows, S)``: peft's trainable
tokens, the embeddings of new tokens trained inside a frozen vocabulary), clipped without forming each example's
gradient of the whole table.

T = W with T[r_j] = S_j (j = 1 … k, the rows r_j distinct, W a constant) is a computation on parameters alone
(:class:`.derived.Derived`); its generic pull-back would materialise ∇_T ℓ_i, B × |W| numbers (a vocabulary of 30,000
rows for 64 new tokens). But ∂T/∂S only selects rows, so each example's gradient of S is rows r of its gradient of T:

    ∇_{S_j} ℓ_i = (∇_T ℓ_i)[r_j]                                                                           (1)

and every form a rule gives T's uses keeps its shape under (1):

- an embedding lookup's, ∇_T ℓ_i = Σ_t e_{k_t} δ_tᵀ (a one-hot factor, the ids k_t): ∇_S ℓ_i = Σ_{t: k_t ∈ r}
  e_{j(k_t)} δ_tᵀ, the ids mapped to their row j of S and the other positions' δ_t dropped;
- a factored one, Σ_t u_t v_tᵀ (a linear map's): u_t's entries r, v_t as it is;
- a materialised one: its rows r.

T's uses (and those of its transpose: a tied output layer's ``h @ T.t()``) then join S's own
(:func:`scattered_row_uses`), and the generic pull-back skips T. T used any other way (another view of it, or an
operand of another computation on parameters) is left to the generic pull-back.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from dpml.train.rules.derived import Derived
from dpml.train.rules.registry import Dense, Factored, Form, Tracked, Use

INDEX_COPIES = {torch.index_copy, torch.Tensor.index_copy}


def scattered_row_uses(
    nodes: list[Derived], uses: dict[int, list[Use]], relevant: Collection[int], params: dict[int, nn.Parameter]
) -> set[int]:
    """Moves the uses of each T = W.index_copy(0, r, S) among ``nodes`` (module docstring) to S's parameter, by (1):
    ``uses`` and ``params`` updated, the ids of the T taken returned (their pull-back is done)."""
    sources_of_others = {id(s.param) for node in nodes for _, s in node.sources}
    taken: set[int] = set()
    for node in nodes:
        found = _scattered(node)
        key = id(node.output)
        if found is None or key not in relevant or key in sources_of_others:
            continue
        rows, source = found
        if id(source.param) not in uses:
            continue
        moved = [_selected(_as_table(view, form, tuple(node.output.shape)), rows) for view, form in uses.get(key, [])]
        if not moved or any(form is None for form in moved):
            continue
        uses[id(source.param)] += [(source, form) for form in moved if form is not None]
        params[id(source.param)] = source.param
        uses[key] = []
        taken.add(key)
    return taken


def _scattered(node: Derived) -> tuple[torch.Tensor, Tracked] | None:
    """(the rows r, S as tracked) where ``node`` is T = W.index_copy(0, r, S) with W a constant 2-D table, S its one
    source and r distinct rows; else None."""
    func, args, kwargs = node.call
    if func not in INDEX_COPIES or len(node.sources) != 1:
        return None
    names = ("input", "dim", "index", "source")
    given = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    base, dim, rows, source = (given.get(name) for name in names)
    tensor_operands = (base, rows, source)
    if not all(isinstance(t, torch.Tensor) for t in tensor_operands) or not isinstance(dim, int):
        return None
    assert isinstance(base, torch.Tensor) and isinstance(rows, torch.Tensor) and isinstance(source, torch.Tensor)
    held, tracked = node.sources[0]
    if held is not source or base.dim() != 2 or dim % 2 != 0 or rows.dim() != 1:
        return None
    if rows.unique().numel() != rows.numel() or source.shape != (rows.numel(), base.shape[1]):
        return None
    return rows.to(torch.long), tracked


def _as_table(view: Tracked, form: Form, shape: tuple[int, ...]) -> Form | None:
    """A use's form in T's own coordinates: as it is for T itself, transposed for T's transpose (``h @ T.t()``, a tied
    output layer); None for any other view of T."""
    if view.index is None:
        return form
    transpose = torch.arange(view.index.numel(), device=view.index.device).reshape(shape).t()
    if tuple(view.index.shape) != shape[::-1] or not torch.equal(view.index, transpose):
        return None
    if isinstance(form, Factored):
        return form.transposed()
    return Dense(form.grads.transpose(1, 2)) if isinstance(form, Dense) else None


def _selected(form: Form | None, rows: torch.Tensor) -> Form | None:
    """A use's per-example gradients of T, rows r only: (1) of the module docstring (None for a form computed on
    demand, left to the generic pull-back)."""
    if form is None:
        return None
    if isinstance(form, Dense):
        return Dense(form.grads.index_select(1, rows.to(form.grads.device)))
    if not isinstance(form, Factored):
        return None
    if form.u.is_floating_point() or form.u.is_complex():  # Σ_t u_t v_tᵀ: rows of T are u's entries
        return Factored(form.u.index_select(-1, rows.to(form.u.device)), form.v, rows.numel(), form.cols)
    position = torch.full((form.rows,), -1, dtype=torch.long, device=form.u.device)
    position[rows.to(form.u.device)] = torch.arange(rows.numel(), device=form.u.device)
    mapped = position[form.u]
    kept = mapped >= 0
    return Factored(mapped.clamp(min=0), form.v * kept.unsqueeze(-1).to(form.v.dtype), rows.numel(), form.cols)
