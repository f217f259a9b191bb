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

The same holds for single entries: T = W + sparse(P, V) (a sparse COO tensor of the values V at the places P =
(r_j, c_j), added to a constant table: peft's SHiRA), whose Jacobian selects entries, ∇_{V_j} ℓ_i = (∇_T ℓ_i)[r_j,
c_j] (duplicate places add up in T, and each still reads its own place). A sparse tensor has no generic pull-back
(its computation would send V's parameter to the exact path); its entries' gradients are, from a factored use,
Σ_t u_t[r_j] v_t[c_j], B × |V| numbers (a materialised one: its entries; a lookup's: Σ_{t: k_t = r_j} δ_t[c_j]).

T's uses (and those of its transpose: a tied output layer's ``h @ T.t()``) then join S's (V's) own
(:func:`scattered_row_uses`), and the generic pull-back skips T. T used any other way (another view of it, or an
operand of another computation on parameters) is left to the generic pull-back (where a sparse tensor sends its
parameter to the exact path, named).
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
    """Moves the uses of each T = W.index_copy(0, r, S), or T = W + sparse(P, V), among ``nodes`` (module docstring)
    to S's (V's) parameter, by (1): ``uses`` and ``params`` updated, the ids of the T taken returned (their pull-back
    is done; a sparse tensor read by T alone is then read by nothing the pull-back takes)."""
    consumers: dict[int, int] = {}  # id of a node's output -> how many computations read it
    for node in nodes:
        for _, s in node.sources:
            consumers[id(s.param)] = consumers.get(id(s.param), 0) + 1
    by_output = {id(node.output): node for node in nodes}
    taken: set[int] = set()
    for node in nodes:
        found = _scattered(node) or _sparse_added(node, by_output, consumers)
        key = id(node.output)
        if found is None or key not in relevant or key in consumers:
            continue
        places, source = found
        if id(source.param) not in uses:
            continue
        shape = tuple(node.output.shape)
        moved = [_selected(_as_table(view, form, shape), places) for view, form in uses.get(key, [])]
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


ADDITIONS = {torch.add, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.__add__, torch.Tensor.__iadd__}


def _sparse_added(
    node: Derived, by_output: dict[int, Derived], consumers: dict[int, int]
) -> tuple[tuple[torch.Tensor, torch.Tensor], Tracked] | None:
    """((the rows r, the columns c), V as tracked) where ``node`` is T = W + sparse(P, V): W a constant dense 2-D
    tensor, the sparse tensor its one source, made by ``torch.sparse_coo_tensor(P, V, T's shape)`` from constant
    places P (2, k) and values V (k,) that are a parameter or a computation on parameters, and read by T alone."""
    func, args, kwargs = node.call
    if func not in ADDITIONS or len(node.sources) != 1 or len(args) != 2 or kwargs.get("alpha", 1) != 1:
        return None
    base, added = args
    maker = by_output.get(id(node.sources[0][1].param))
    if not isinstance(base, torch.Tensor) or base.layout != torch.strided or base.dim() != 2 or maker is None:
        return None
    made, made_args, made_kwargs = maker.call
    if made is not torch.sparse_coo_tensor or consumers.get(id(maker.output)) != 1 or len(maker.sources) != 1:
        return None
    places, values = (made_args + (made_kwargs.get("indices"), made_kwargs.get("values")))[:2]
    held, tracked = maker.sources[0]
    if not isinstance(places, torch.Tensor) or held is not values or node.sources[0][0] is not added:
        return None
    if places.shape != (2, values.numel()) or values.dim() != 1 or tuple(added.shape) != tuple(base.shape):
        return None
    return (places[0].to(torch.long), places[1].to(torch.long)), tracked


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


def _selected(form: Form | None, places: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> Form | None:
    """A use's per-example gradients of T at the rows r, or the entries (r, c), only: (1) of the module docstring
    (None for a form computed on demand, left to the generic pull-back)."""
    if form is None:
        return None
    if isinstance(places, tuple):
        return _entries(form, *places)
    rows = places
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


def _entries(form: Form, rows: torch.Tensor, cols: torch.Tensor) -> Dense | None:
    """Each example's gradient of T at the entries (r_j, c_j), (B, k)."""
    if isinstance(form, Dense):
        return Dense(form.grads[:, rows.to(form.grads.device), cols.to(form.grads.device)])
    if not isinstance(form, Factored):
        return None
    rows, cols = rows.to(form.v.device), cols.to(form.v.device)
    positions = form.v.shape[1]
    if form.u.is_floating_point() or form.u.is_complex():  # Σ_t u_t[r_j] v_t[c_j]
        if form.rows * form.cols <= positions * rows.numel():  # (the whole product is fewer numbers: its entries)
            return Dense(torch.bmm(form.u.transpose(1, 2), form.v)[:, rows, cols])
        return Dense((form.u.index_select(-1, rows) * form.v.index_select(-1, cols)).sum(1))
    at_cols = form.v.index_select(-1, cols)  # (B, T, k)
    hits = form.u.unsqueeze(-1) == rows  # (B, T, k): the positions whose id is r_j
    return Dense((at_cols * hits.to(at_cols.dtype)).sum(1))
