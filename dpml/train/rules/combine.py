"""One parameter's per-example squared norm and clipped sum from the per-example gradients of its uses.

A parameter θ used by U operations has ∇_θ ℓ_i = Σ_u G_{u,i} (each G_u mapped to θ's coordinates), and
‖Σ_u G_{u,i}‖² = Σ_u ‖G_{u,i}‖² + 2 Σ_{u<u'} ⟨G_{u,i}, G_{u',i}⟩: the cross terms are what a tied
embedding (lookup + LM head) or a weight used twice adds. Uses of one view of θ and one kind are first added up
(:func:`merged_uses`: dense gradients summed, factored ones joined along their positions); then the cheapest
exact way is taken:

1. **One use**, or uses over pairwise disjoint elements of θ (``in_proj_weight.chunk(3)``), each view
   injective: no cross terms; each use's own norm — for a factored G = Σ_t u_t v_tᵀ the ghost norm
   Σ_{t,s}(u_t·u_s)(v_t·v_s) or the materialised one, whichever :func:`dpml.train.clipping_norms.materialise`
   picks (Li et al. 2022; Bu et al. 2023), for a one-hot factor the embedding's sorted sums
   (:func:`dpml.train.clipping_layers.embedding_norms_squared`);
2. **Overlapping factored uses of a 2-D θ** (as θ or θᵀ): cross terms ⟨G, G'⟩ = Σ_{t,s}(u_t·u'_s)(v_t·v'_s),
   with a one-hot factor as a gather (u'_s[k_t]) or an index comparison ([k_t = k'_s]);
3. otherwise every use **materialised** in θ's coordinates (over the elements the uses reach), when the
   B × that many numbers fit in the device's keep limit; else θ takes the exact path.

The clipped sum is Σ_u of each use's Σ_i c_i G_{u,i}, mapped back to θ by ``index_add`` over the
view's index — the same numbers as the norms (no TF32: :func:`dpml.devices.full_float32` around the
caller).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

import torch
from torch import nn

from dpml.train.clipping_layers import Piece, weight_norms_squared
from dpml.train.clipping_norms import (
    clipped_outer_sum,
    embedding_norms_squared,
    kept_sum,
    row_norms_squared,
    without_silent_positions,
)
from dpml.devices import heap_sized_slices
from dpml.train.keep_budget import keep_limit, room, spend
from dpml.train.ragged_norms import packed, ragged_norms
from dpml.train.rules.ragged import Ragged
from dpml.train.rules.flat_indices import disjoint, injective
from dpml.train.rules.registry import Computed, Dense, Factored, Form, Tracked, Use

SumFn = Callable[[torch.Tensor], torch.Tensor]  # c (B,) -> Σ_i c_i G_i in the use's coordinates


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


def cast_form(form: Form, dtype: torch.dtype) -> Form:
    """A form recorded under autocast, in the parameters' dtype (indices stay integers)."""
    if isinstance(form, (Ragged, Computed)):
        return form.cast(dtype)
    if isinstance(form, Dense):
        return Dense(_cast(form.grads, dtype))
    applied = None if form.applied is None else _cast(form.applied, dtype)
    return Factored(_cast(form.u, dtype), _cast(form.v, dtype), form.rows, form.cols, applied, form.lengths)


def _one_hot(t: torch.Tensor) -> bool:
    """A factor of integer indices (an embedding's rows e_k), not of values (real or complex)."""
    return not t.is_floating_point() and not t.is_complex()


def _factored_norms(form: Factored) -> tuple[torch.Tensor, SumFn]:
    """‖Σ_t u_t v_tᵀ‖² per example and the clipped sum's function, (rows, cols); on a CPU over the positions where
    neither factor is zero for every example only (a classifier that reads one token: its last block's δ), as a
    hooked layer's (:func:`dpml.train.clipping_norms.without_silent_positions`)."""
    if _one_hot(form.v) and not _one_hot(form.u):
        squared, sums = _factored_norms(form.transposed())
        return squared, lambda factors: sums(factors).t()
    if _one_hot(form.u):
        if _one_hot(form.v):
            raise ValueError("two one-hot factors")
        tokens, d = form.u, form.v

        def embedded(factors: torch.Tensor) -> torch.Tensor:
            weighted = (d * factors[:, None, None]).reshape(-1, form.cols)
            return d.new_zeros(form.rows, form.cols).index_add_(0, tokens.reshape(-1), weighted)

        return embedding_norms_squared(tokens, d, form.rows), embedded
    u, v = form.u, form.v
    if u.device.type == "cpu" and u.shape[1] > 1 and form.lengths is None:  # (real or complex: no one-hot here)
        u, v = without_silent_positions(u, v)  # (over the positions where some example's v_t is not zero only)
        v, u = without_silent_positions(v, u)  # (…and u_t)
    if u.shape[1] == 1:  # one position: ‖u‖²‖v‖²
        squared, kept = row_norms_squared(u[:, 0]) * row_norms_squared(v[:, 0]), None
    elif form.lengths is not None and u.is_floating_point() and v.is_floating_point():
        return ragged_norms(packed(u, form.lengths), packed(v, form.lengths), form.lengths)  # the padding skipped
    else:  # (B, rows, cols) kept when materialised and small, charged net of the factors they let go
        squared, kept = weight_norms_squared(v, u, letting_go(form))
    if kept is not None:
        return squared, lambda factors: kept_sum(factors, kept)  # (u and v not held: let go with the form)
    return squared, lambda factors: clipped_outer_sum(u, v, factors)


def letting_go(form: Factored) -> int:
    """The numbers a factored use's factors hold, which keeping its per-example gradients lets go: the clipped sum
    reads them no more, and its form is dropped once its parameter's piece is formed
    (:func:`dpml.train.clipping.engine_pass`) — as a hooked layer's input and δ (:mod:`dpml.train.streamed`). A
    factor broadcast along a dimension (a stride of 0) counts for the storage it views, not its shape. As for the
    hooked layers, one input read by two calls (the same activations into two separately called projections) counts
    for each: its memory goes with the last form that holds it."""
    factors = [form.u, form.v] + ([form.applied] if form.applied is not None else [])
    return sum(min(t.numel(), t.untyped_storage().nbytes() // t.element_size()) for t in factors)


def computed_norms(
    form: Computed, transform: Callable[[torch.Tensor, slice], torch.Tensor] | None = None, total: SumFn | None = None
) -> tuple[torch.Tensor, SumFn]:
    """The norms of gradients formed on demand, or of ``transform`` (G, the examples' slice) of them, a map row by row
    of each example's gradient (a computed weight's Jacobian carrying a convolution's kernel gradients back to the
    parameter, :mod:`.row_jacobian`): all of them formed and kept where they fit what the pass may keep (the clipped
    sum is then Σ_i c_i of the kept ones), else formed a slice of examples at a time for the norms alone and the
    clipped sum left to the operation (``weighted_sum``; with a transform, ``total``, called after every slice). Where
    the operation has its norms in closed form (``squared_norms``) and there is no transform, none is formed."""
    if transform is None and form.squared_norms is not None:  # (a closed form: none formed)
        return form.squared_norms(), form.weighted_sum if total is None else total
    change = transform or (lambda grads, examples: grads)
    numbers = form.batch * math.prod(form.shape)
    if numbers <= room(keep_limit(form.device)):
        spend(numbers)
        everything = slice(0, form.batch)
        grads = change(form.gradients(everything), everything)
        return row_norms_squared(grads), lambda factors: torch.einsum("b,b...->...", factors, grads)
    each = math.prod(form.shape) * 4  # bytes an example's gradient holds in float32 (the slices' size only)
    squared = [
        row_norms_squared(change(form.gradients(s), s)) for s in heap_sized_slices(form.batch, each, form.device)
    ]
    return torch.cat(squared), form.weighted_sum if total is None else total


def row_form(form: Form, shape: tuple[int, int]) -> bool:
    """A computed weight's one use gives each example's gradient as (C, n) rows: factored in floats, or formed on
    demand (the closed forms of :mod:`.standardised` and :mod:`.row_jacobian` read either)."""
    if isinstance(form, Computed):
        return tuple(form.shape) == shape
    if isinstance(form, Factored):
        floats = form.u.is_floating_point() and form.v.is_floating_point()
        return floats and (form.rows, form.cols) == shape
    return False


def use_norms(form: Form) -> tuple[torch.Tensor, SumFn]:
    """One use's per-example squared norm (B,) and its clipped sum in the use's coordinates."""
    if isinstance(form, Ragged):
        return ragged_norms(form.u, form.v, form.layout.counts, form.layout.order)  # type: ignore[arg-type]
    if isinstance(form, Computed):
        return computed_norms(form)
    if isinstance(form, Dense):
        grads = form.grads
        return row_norms_squared(grads), lambda factors: torch.einsum("b,b...->...", factors, grads)
    return _factored_norms(form)


def to_parameter(tracked: Tracked, total: torch.Tensor) -> torch.Tensor:
    """A sum in the view's coordinates, in the parameter's (index_add over the view's index)."""
    p = tracked.param
    if tracked.index is None:
        return total.reshape(p.shape)
    flat = total.new_zeros(p.numel()).index_add_(0, tracked.index.reshape(-1), total.reshape(-1))
    return flat.reshape(p.shape)


def _disjoint(uses: list[Use]) -> bool:
    if not all(t.index is None or injective(t.index) for t, _ in uses):
        return False
    if sum(t.index is None for t, _ in uses) > (1 if len(uses) == 1 else 0):
        return False
    if len(uses) == 1:
        return True
    return disjoint([t.index for t, _ in uses if t.index is not None])  # (none is None here)


def _orientation(tracked: Tracked) -> str | None:
    """'same' when the view is the 2-D parameter itself, 'transposed' when it is its transpose."""
    p = tracked.param
    if tracked.index is None:
        return "same" if p.dim() == 2 else None
    if p.dim() != 2:
        return None
    grid = torch.arange(p.numel(), device=p.device).view(p.shape)
    if tracked.index.shape == p.shape and torch.equal(tracked.index, grid):
        return "same"
    if tracked.index.shape == p.shape[::-1] and torch.equal(tracked.index, grid.t()):
        return "transposed"
    return None


def _gram(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(x_t · y_s) per example, (B, T, S), a one-hot factor given by its indices."""
    if _one_hot(x) and _one_hot(y):
        return x[:, :, None] == y[:, None, :]
    if _one_hot(x):
        return _gram(y, x).transpose(1, 2)
    if _one_hot(y):  # x_t · e_{k_s} = x_t[k_s]
        return x.gather(2, y[:, None, :].expand(-1, x.shape[1], -1))
    return torch.bmm(x, y.transpose(1, 2))


def _cross(a: Factored, b: Factored) -> torch.Tensor:
    """⟨Σ_t u_t v_tᵀ, Σ_s u'_s v'_sᵀ⟩ per example = Σ_{t,s} (u_t·u'_s)(v_t·v'_s)."""
    left, right = _gram(a.u, b.u), _gram(a.v, b.v)
    if left.dtype == torch.bool:
        return right.masked_fill(~left, 0).sum((1, 2))
    if right.dtype == torch.bool:
        return left.masked_fill(~right, 0).sum((1, 2))
    return (left * right).sum((1, 2))


def _materialised(form: Form, batch: int) -> torch.Tensor:
    """A use's per-example gradients (B, numel of its view)."""
    if isinstance(form, Computed):
        return form.gradients(slice(0, batch)).reshape(batch, -1)
    if isinstance(form, Dense):
        return form.grads.reshape(batch, -1)
    if _one_hot(form.v):
        return (
            _materialised(form.transposed(), batch).view(batch, form.cols, form.rows).transpose(1, 2).reshape(batch, -1)
        )
    if _one_hot(form.u):
        keys = (torch.arange(batch, device=form.u.device)[:, None] * form.rows + form.u).reshape(-1)
        grads = form.v.new_zeros(batch * form.rows, form.cols).index_add_(0, keys, form.v.reshape(-1, form.cols))
        return grads.view(batch, -1)
    return torch.bmm(form.u.transpose(1, 2), form.v).reshape(batch, -1)


def per_example_gradients_of(uses: list[Use], like: torch.Tensor, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """Σ_u G_{u,i} materialised in the coordinates of ``like`` (a :class:`dpml.train.rules.registry.Derived`
    output the uses are views of), (B, *like.shape); zeros when it has no use."""
    if len(uses) == 1 and uses[0][0].index is None:  # (the output itself)
        return _materialised(uses[0][1], batch).to(dtype).reshape(batch, *like.shape)
    total = torch.zeros(batch, like.numel(), dtype=dtype, device=like.device)
    for tracked, form in uses:
        total.index_add_(1, tracked.flat_index().reshape(-1), _materialised(form, batch).to(dtype))
    return total.view(batch, *like.shape)


def _same_view(a: Tracked, b: Tracked) -> bool:
    """Two views of one parameter that are surely the same coordinates: the parameter itself, or one index tensor."""
    if a.param is not b.param or a.shared != b.shared or (a.index is None) != (b.index is None):
        return False
    if a.index is None or b.index is None:
        return True
    left, right = a.index, b.index
    return (left.data_ptr(), left.shape, left.stride()) == (right.data_ptr(), right.shape, right.stride())


def _kind(form: Form) -> tuple[object, ...]:
    if isinstance(form, Ragged):
        return ("factored", form.rows, form.cols, form.u.dtype, form.v.dtype, 3, 3)  # padded if merged
    if isinstance(form, Computed):
        return ("computed", form.shape, form.batch)
    if isinstance(form, Dense):
        return ("dense", form.grads.shape, form.grads.dtype)
    return ("factored", form.rows, form.cols, form.u.dtype, form.v.dtype, form.u.dim(), form.v.dim())


def added_computed(forms: list[Computed]) -> Computed:
    """Σ_u G_u of uses formed on demand in the same coordinates (a kernel used by two calls): their gradients and their
    weighted sums added up."""
    first = forms[0]
    return Computed(
        first.batch,
        first.shape,
        first.device,
        lambda s: sum((f.gradients(s) for f in forms[1:]), forms[0].gradients(s)),
        lambda c: sum((f.weighted_sum(c) for f in forms[1:]), forms[0].weighted_sum(c)),
        lambda dtype: added_computed([f.cast(dtype) for f in forms]),
    )


def _as_computed(form: Factored, like: Computed) -> Computed:
    """A factored use (of real factors) as one formed on demand, to be added to ``like``'s: Σ_t u_t v_tᵀ per example
    of a slice, and Σ_i c_i Σ_t u_{i,t} v_{i,t}ᵀ."""
    u, v = form.u, form.v
    return Computed(
        like.batch,
        like.shape,
        like.device,
        lambda s: torch.bmm(u[s].transpose(1, 2), v[s]),
        lambda c: (u * c[:, None, None]).reshape(-1, form.rows).t() @ v.reshape(-1, form.cols),
        lambda dtype: _as_computed(cast_form(form, dtype), like),  # type: ignore[arg-type]
    )


def _joined_to_computed(uses: list[Use]) -> list[Use]:
    """Each factored use of real factors in the coordinates of a use formed on demand (a kernel used by two calls of
    other geometries, one of them ghost-normed) as one formed on demand too, so that :func:`merged_uses` adds them up
    (no cross terms, nothing materialised beyond a slice)."""
    computed = [(t, f) for t, f in uses if isinstance(f, Computed)]
    if not computed:
        return uses
    joined: list[Use] = []
    for t, f in uses:
        like = next((c for view, c in computed if _same_view(view, t)), None)
        real = isinstance(f, Factored) and f.u.is_floating_point() and f.v.is_floating_point()
        if like is not None and real and like.shape == (f.rows, f.cols):  # type: ignore[union-attr]
            f = _as_computed(f, like)  # type: ignore[arg-type]
        joined.append((t, f))
    return joined


def merged_uses(uses: list[Use]) -> list[Use]:
    """Uses in the same coordinates (:func:`_same_view`) and of the same kind, added up before any norm: dense
    gradients summed (those formed on demand: :func:`added_computed`), factored ones side by side along their
    positions — Σ_u Σ_t u_{u,t} v_{u,t}ᵀ is one sum over all the positions, so one (ghost or materialised) norm
    replaces the U(U − 1)/2 cross terms of :func:`_with_cross_terms` (an RNN's W_hh at each of its T steps; a layer
    shared across depth). The same per-example gradients, added in another order."""
    groups: list[list[Use]] = []
    for use in _joined_to_computed(uses):
        group = next((g for g in groups if _same_view(g[0][0], use[0]) and _kind(g[0][1]) == _kind(use[1])), None)
        if group is None:
            groups.append([use])
        else:
            group.append(use)
    merged: list[Use] = []
    for group in groups:
        tracked, form = group[0]
        if len(group) > 1 and isinstance(form, Computed):
            form = added_computed([f for _, f in group])  # type: ignore[misc]
        elif len(group) > 1 and isinstance(form, Dense):
            form = Dense(torch.stack([f.grads for _, f in group]).sum(0))  # type: ignore[union-attr]
        elif len(group) > 1 and isinstance(form, (Factored, Ragged)):
            group = [(t, f.padded() if isinstance(f, Ragged) else f) for t, f in group]
            form = group[0][1]
            u = torch.cat([f.u for _, f in group], 1)  # type: ignore[union-attr]
            products = [f.applied for _, f in group]  # type: ignore[union-attr]
            applied = None if any(p is None for p in products) else torch.cat(products, 1)  # type: ignore[arg-type]
            form = Factored(u, torch.cat([f.v for _, f in group], 1), form.rows, form.cols, applied)  # type: ignore[union-attr]
        merged.append((tracked, form))
    return merged


def parameter_piece(param: nn.Parameter, uses: list[Use], batch: int, limit: int) -> Piece | str:
    """The parameter's piece (module docstring), or why none is formed within ``limit`` numbers."""
    uses = merged_uses(uses)
    if _disjoint(uses):
        return _separate(param, uses)
    uses = [(t, f.padded() if isinstance(f, Ragged) else f) for t, f in uses]  # read as (B, W, ·) from here on
    oriented = [(_orientation(t), form) for t, form in uses]
    factored = [(o, form) for o, form in oriented if o is not None and isinstance(form, Factored)]
    if len(factored) == len(oriented):
        return _with_cross_terms(param, [(form if o == "same" else form.transposed()) for o, form in factored])
    return _all_materialised(param, uses, batch, limit)


def _separate(param: nn.Parameter, uses: list[Use]) -> Piece:
    parts = [(tracked, *use_norms(form)) for tracked, form in uses]
    squared = sum((s for _, s, _ in parts[1:]), parts[0][1])

    def sums(factors: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if len(parts) == 1:
            return [(param, to_parameter(parts[0][0], parts[0][2](factors)))]
        totals = [fn(factors) for _, _, fn in parts]  # disjoint views: each added into one sum in θ's coordinates
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in totals])
        flat = totals[0].new_zeros(param.numel(), dtype=dtype)
        for (tracked, _, _), total in zip(parts, totals, strict=True):
            flat.index_add_(0, tracked.flat_index().reshape(-1), total.reshape(-1).to(flat.dtype))
        return [(param, flat.view(param.shape))]

    return Piece(squared, sums)


def _with_cross_terms(param: nn.Parameter, forms: list[Factored]) -> Piece:
    parts = [use_norms(form) for form in forms]
    squared = sum((s for s, _ in parts[1:]), parts[0][0])
    for a, b in itertools.combinations(forms, 2):
        squared = squared + 2 * _cross(a, b)
    squared = squared.clamp_min(0)  # rounding of the cross terms; exact arithmetic gives ≥ 0

    def sums(factors: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        totals = [fn(factors).reshape(param.shape) for _, fn in parts]
        return [(param, sum(totals[1:], totals[0]))]

    return Piece(squared, sums)


def _all_materialised(param: nn.Parameter, uses: list[Use], batch: int, limit: int) -> Piece | str:
    indices = [t.flat_index().reshape(-1) for t, _ in uses]
    reached = torch.unique(torch.cat(indices))
    largest = max(index.numel() for index in indices)
    if batch * max(reached.numel(), largest) > limit:
        return (
            f"its {len(uses)} uses overlap and their per-example gradients ({batch} × {reached.numel()} numbers) "
            "do not fit the keep limit"
        )
    grads = None
    for index, (_, form) in zip(indices, uses, strict=True):
        part = _materialised(form, batch)
        positions = torch.searchsorted(reached, index)
        grads = (part.new_zeros(batch, reached.numel()) if grads is None else grads).index_add_(1, positions, part)
    assert grads is not None
    spend(grads.numel())  # kept whatever the pass's budget: the exact path's alternative keeps as many

    def sums(factors: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        flat = grads.new_zeros(param.numel()).index_add_(0, reached, factors @ grads)
        return [(param, flat.reshape(param.shape))]

    return Piece(row_norms_squared(grads), sums)
