"""Embedding lookups z_t = W[k_t] (``F.embedding``; ``nn.Embedding`` where its hook does not apply).

- **Indices per example** (B, …), computed from the batch's inputs (or not batch-first, their rows known by the
  example map the lookup's output carries: time-major ids, ids moved along the batch): ∇_W ℓ_i = Σ_t e_{k_t} δ_tᵀ,
  factored with a one-hot factor (the indices), so ‖∇_W ℓ_i‖² = Σ_k ‖Σ_{t: k_t = k} δ_t‖²
  (:func:`dpml.train.clipping_layers.embedding_norms_squared`); ``padding_idx`` positions get no gradient.
- **Indices shared by the batch** (position ids (1, T) or (T,): not computed from the batch's inputs): the
  output is the same for every example, a view of W (rows k_t), tracked; the operation where it meets the
  batch (``h + pos``) forms each example's gradient and maps it back through the indices; ids of one row per
  example, all alike (``zeros(B, T)``), give the view one row repeated (stride 0), so that a computation on it is
  carried on that row alone (:func:`.derived.first_rows`: MarkupLM's 100 XPath tables). Where some of them are
  ``padding_idx`` (RoCBert's shape and pronunciation ids, ``zeros(B, T)`` made in its forward: all padding) the
  output is no view (its padding positions have no gradient) but a computation on W (:mod:`.derived`), whose
  per-example gradients would be W's size; it is read on the rows it reaches alone (:func:`_narrowed`).

Bags of indices (``F.embedding_bag``, ``nn.EmbeddingBag``) given as one row per example, (B, L), summed or averaged,
with per-index weights or not: z_i = Σ_j c_{i,j} W[k_{i,j}] (c the weight, divided by the bag's count of indices other
than ``padding_idx`` for the mean), so ∇_W ℓ_i = Σ_j e_{k_{i,j}} (c_{i,j} δ_i)ᵀ: the lookup's form with δ_i spread over
the bag. A bag's maximum (``mode="max"``): each column's gradient goes to the one row that column's maximum came from
(:func:`_bag_maxima`). Bags given by offsets into one flat row of indices: the same, where bag b holds example b's
indices (:func:`_bags_by_offsets`: a padded batch packed by ``x[mask]``, its offsets from the lengths).

``max_norm`` (renormalises W inside the forward) and ``scale_grad_by_freq`` (counts over the whole batch)
have no rule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dpml.train.rules.operands import repeats_first_row
from dpml.train.rules.registry import Call, Decomposed, Factored, Pending, Rows, Shared, Tracked, Use, rule


@rule(F.embedding)
def embedding(call: Call) -> Pending | Shared | Decomposed | str:
    ids, weight = call.arg(0, "input"), call.arg(1, "weight")
    padding_idx = call.arg(2, "padding_idx")
    w = call.tracked(weight)
    if w is None or call.tracked(ids) is not None:
        return "a parameter as its indices"
    if call.arg(3, "max_norm") is not None or call.arg(5, "scale_grad_by_freq", False):
        return "max_norm or scale_grad_by_freq"
    if len(w.shape()) != 2:
        return "a table that is not 2-D"
    if padding_idx is not None and padding_idx < 0:
        padding_idx += w.shape()[0]
    if call.batch_first(ids):  # computed from the batch, batch-first
        batch = ids.shape[0]
        tokens = ids.reshape(batch, -1)

        def finish(d: torch.Tensor) -> list[Use]:
            d = d.reshape(batch, tokens.shape[1], -1)
            if padding_idx is not None:
                d = d * (tokens != padding_idx).unsqueeze(2)
            return [(w, Factored(tokens, d, w.shape()[0], d.shape[2]))]

        return Pending(call.output, [w.param], finish)
    if call.from_batch(ids):  # each example's own ids, not batch-first: XLNet's time-major (T, B), ids moved
        rows = call.rows(call.output)  # the lookup's rows carry the ids' example map
        if rows is None:
            return f"indices from the batch (shape {tuple(ids.shape)}) whose examples are not known"
        tokens = rows.of(ids.unsqueeze(-1)).squeeze(-1)  # (B, k), example by example (ragged: 0 where d is 0)

        def finish_rows(d: torch.Tensor) -> list[Use]:
            d_rows = rows.of(d)
            if padding_idx is not None:
                d_rows = d_rows * (tokens != padding_idx).unsqueeze(2)
            return [(w, Factored(tokens, d_rows, w.shape()[0], d_rows.shape[2]))]

        return Pending(call.output, [w.param], finish_rows)
    if padding_idx is not None and bool((ids == padding_idx).any()):
        return _narrowed(ids, weight, w, padding_idx)
    # ids of one row per example, all alike: by their layout anywhere, by value on the CPU only (on a GPU the
    # comparison would wait for the device in every pass, which a CUDA graph cannot hold; BERT's token type ids are
    # expanded, read without it)
    one_row = ids.dim() >= 1 and ids.shape[0] == call.batch > 1
    if one_row and repeats_first_row(ids, call.batch, by_value=ids.device.type == "cpu"):
        index = w.flat_index()[ids[:1]].expand(*ids.shape, w.shape()[1])  # (one row repeated: stride 0)
    else:
        index = w.flat_index()[ids]  # (…, D): the rows k_t of W, as positions in the parameter
    return Shared([(call.output, Tracked(w.param, index, shared=True))])


def _narrowed(ids: torch.Tensor, weight: torch.Tensor, w: Tracked, padding_idx: int) -> Decomposed | str:
    """A lookup at shared indices some of which are ``padding_idx``, z_t = W[k_t] with ∂z_t/∂W = 0 where k_t is
    ``padding_idx``, read on the rows it reaches alone: W' = W[u] (u the distinct indices, sorted: a view of W),
    k'_t the place of k_t in u, z_t = W'[k'_t] with the padding at the place of ``padding_idx`` in u — the same
    values and gradient, a computation on W' whose per-example gradients are B × |u| × D numbers, not B × |W|
    (a table of 24858 rows looked up at padding alone: 32 examples' 12.7 M numbers each, formed twice a step). A
    table no larger than its indices reach is narrow already: a computation on it (:mod:`.derived`)."""
    used, places = torch.unique(ids, return_inverse=True)
    if used.numel() == weight.shape[0]:
        return "shared indices that hit padding_idx, on a table they reach every row of"
    padding = int((used == padding_idx).nonzero()[0, 0])
    table = weight[used]
    return Decomposed(lambda: F.embedding(places, table, padding), [(table, _rows_of(w, used))])


def _rows_of(w: Tracked, rows: torch.Tensor) -> Tracked:
    """The view W[rows] of the 2-D view ``w``, its index made from ``rows`` alone (not a count as long as the table,
    12.7 M numbers for RoCBert's shape table)."""
    if w.index is not None:
        return Tracked(w.param, w.index[rows], w.shared)
    width = w.param.shape[1]
    return Tracked(w.param, rows[:, None] * width + torch.arange(width, device=rows.device), w.shared)


@rule(F.embedding_bag)
def embedding_bag(call: Call) -> Pending | str:
    ids, weight, offsets = call.arg(0, "input"), call.arg(1, "weight"), call.arg(2, "offsets")
    mode, per_index, padding_idx = (
        call.arg(6, "mode", "mean"),
        call.arg(8, "per_sample_weights"),
        call.arg(10, "padding_idx"),
    )
    w = call.tracked(weight)
    if w is None or call.tracked(ids) is not None or call.tracked(per_index) is not None:
        return "a parameter as its indices or their weights"
    if call.arg(3, "max_norm") is not None or call.arg(5, "scale_grad_by_freq", False):
        return "max_norm or scale_grad_by_freq"
    if len(w.shape()) != 2:
        return "a table that is not 2-D"
    if padding_idx is not None and padding_idx < 0:
        padding_idx += w.shape()[0]
    if offsets is not None:
        found = _bags_by_offsets(call, ids, offsets)
        if isinstance(found, str):
            return found
        starts, owners, rows = found
    elif ids.dim() != 2 or not call.batch_first(ids):
        return "bags that are not one row of indices per example"
    else:  # one row of indices per example: bag b is row b
        batch, size = ids.shape
        starts = torch.arange(0, batch * size, size, device=ids.device)
        owners, rows = torch.arange(batch).repeat_interleave(size), Rows(batch, None)
        ids, per_index = ids.reshape(-1), None if per_index is None else per_index.reshape(-1)
    if mode == "max":
        return _bag_maxima(call, w, ids, starts, padding_idx)
    return _summed_bags(call, w, ids, owners, rows, mode, per_index, padding_idx)


def _bags_by_offsets(
    call: Call, ids: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Rows] | str:
    """Bags given by ``offsets`` into one flat row of indices (``ids`` (N,), as ``x[mask]`` packs a padded batch):
    (each bag's start, the example of each index, the indices example by example) where bag b is example b's
    indices — B bags, and the recorder's example of each index is the bag ``offsets`` puts it in —, so that the
    bags' output is batch-first; else why not."""
    owners = call.leading_examples(ids) if ids.dim() == 1 else None
    if owners is None:
        return "a flat row of indices whose examples are not known"
    owners = owners.cpu()
    if call.arg(9, "include_last_offset", False):
        offsets = offsets[:-1]
    bag_of = torch.searchsorted(offsets.detach().cpu(), torch.arange(ids.shape[0]), right=True) - 1
    rows = Rows.of_map(owners.unsqueeze(1), call.batch)
    if offsets.shape[0] != call.batch or not torch.equal(bag_of, owners.to(bag_of.dtype)) or rows is None:
        return "bags that are not the examples one by one"
    return offsets, owners, rows


def _summed_bags(
    call: Call,
    w: Tracked,
    ids: torch.Tensor,
    owners: torch.Tensor,
    rows: Rows,
    mode: str,
    per_index: torch.Tensor | None,
    padding_idx: int | None,
) -> Pending:
    """Bags summed or averaged, ``ids`` (N,) flat, ``owners`` (N,) the example (= bag) of each index, ``rows`` them
    example by example: ∇_W ℓ_i = Σ_{j in bag i} e_{k_j} (c_j δ_i)ᵀ, c_j the index's weight (``per_sample_weights``,
    or 1; 0 at ``padding_idx``), divided by the bag's count of indices counted for the mean; the indices example by
    example (ragged: padded with index 0 and no gradient)."""
    kept = (ids != padding_idx) if padding_idx is not None else torch.ones_like(ids, dtype=torch.bool)
    share = kept.to(call.arg(1, "weight").dtype) if per_index is None else per_index.detach() * kept
    owned = owners.to(ids.device)
    if mode == "mean":
        counts = torch.zeros(call.batch, dtype=share.dtype, device=ids.device).index_add_(
            0, owned, kept.to(share.dtype)
        )
        share = share / counts.clamp(min=1)[owned]
    tokens = rows.of(ids.unsqueeze(1)).squeeze(2)  # (B, width): each example's indices

    def finish(d: torch.Tensor) -> list[Use]:
        spread = rows.of(share.to(d.dtype).unsqueeze(1) * d.reshape(call.batch, -1)[owned])  # (B, width, D): c_j δ_i
        return [(w, Factored(tokens, spread, w.shape()[0], spread.shape[2]))]

    return Pending(call.output, [w.param], finish)


def _bag_maxima(call: Call, w: Tracked, ids: torch.Tensor, starts: torch.Tensor, padding_idx: int | None) -> Pending:
    """``mode="max"``: z_{i,d} = max_j W[k_{i,j}, d], so ∂ℓ_i/∂W = Σ_d e_{m_{i,d}} (δ_{i,d} e_d)ᵀ with m_{i,d} the row
    the kernel took column d's maximum from (its own ``max_indices``, ties as its backward pass breaks them): one
    entry per column, each in its own place. Over W's entries as one column (V·D × 1) that is a lookup of the D
    entries m_{i,d}·D + d with the gradients δ_{i,d}, whose squared norm Σ_d δ_{i,d}² and clipped sum the factored
    form gives. An all-padding bag (no index counted) has no maximum and no gradient."""
    table, batch = w.shape(), call.batch
    _, _, counted, chosen = torch.ops.aten._embedding_bag(
        call.arg(1, "weight").detach(),
        ids,
        starts,
        False,
        2,
        False,
        None,
        False,
        -1 if padding_idx is None else padding_idx,
    )
    live = (counted > 0).unsqueeze(1)  # (B, 1): a bag with an index counted has maxima
    entries = chosen.clamp(min=0) * table[1] + torch.arange(table[1], device=ids.device)  # (B, D)
    column = Tracked(w.param, w.flat_index().reshape(-1, 1))  # W's entries as one column

    def finish(d: torch.Tensor) -> list[Use]:
        d = (d.reshape(batch, table[1]) * live).unsqueeze(2)  # (B, D, 1): δ_{i,d} at entry m_{i,d}·D + d
        return [(column, Factored(entries, d, table[0] * table[1], 1))]

    return Pending(call.output, [w.param], finish)
