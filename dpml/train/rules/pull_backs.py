"""The per-example gradients of the uses of computations on parameters alone (:mod:`.derived`) carried back to the
parameters they came from: through each computation's own Jacobian (:func:`.derived.pull_back`, or the chain run
as one graph, :mod:`.stitched`), or, for a linear call, its closed form (:mod:`.linear_on_parameters`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from dpml.train.clipping_layers import Piece
from dpml.train.keep_budget import BEYOND_KEEP_LIMIT
from dpml.train.rules.combine import per_example_gradients_of
from dpml.train.rules.derived import Derived, pull_back
from dpml.train.rules.linear_on_parameters import linear_call, linear_uses
from dpml.train.rules.ragged import Ragged
from dpml.train.rules.registry import Computed, Dense, Factored, Form, Tracked, Use
from dpml.train.rules.stitched import SourceKey, Stitched, stitch


def _examples(form: Form, rows: slice) -> Form:
    """A use's per-example gradients for the examples ``rows`` only."""
    if isinstance(form, Ragged):
        form = form.padded()
    if isinstance(form, Computed):
        return Dense(form.gradients(rows))
    if isinstance(form, Dense):
        return Dense(form.grads[rows])
    applied = None if form.applied is None else form.applied[rows]
    lengths = None if form.lengths is None else form.lengths[rows]
    return Factored(form.u[rows], form.v[rows], form.rows, form.cols, applied, lengths)


def pull_back_all(
    nodes: list[Derived],
    uses: dict[int, list[Use]],
    relevant: set[int],
    batch: int,
    dtype: torch.dtype,
    limit: int,
    params: dict[int, nn.Parameter],
) -> tuple[list[Use], dict[int, str], dict[int, Piece]]:
    """The uses of the computations on parameters (``nodes`` in the order they ran; those whose output is among the
    ``relevant`` ids) carried back to the parameters they came from: (the parameter's view, its per-example
    gradients' form) for each source that is one; why a parameter cannot be; and {id: piece} for parameters whose
    per-example gradients are formed again for their sum (:func:`_pull_back_stretch`). Later computations first: a
    linear call that :mod:`.linear_on_parameters` reads by its closed form (its weight's gradients factored), the
    computations between such calls by the generic pull-back, each stretch handing its sources' gradients on as uses
    of the computations still to come."""
    chain = _reaching_a_use([node for node in reversed(nodes) if id(node.output) in relevant], uses)
    computed, ahead = {id(node.output) for node in nodes}, {id(node.output) for node in chain}
    pulled: list[Use] = []
    failed: dict[int, str] = {}
    pieces: dict[int, Piece] = {}

    closed: set[int] = set()  # the parameters a closed form handed uses on to

    def hand_on(found: Iterable[Use]) -> None:
        for tracked, form in found:
            (uses.setdefault(id(tracked.param), []) if id(tracked.param) in ahead else pulled).append((tracked, form))

    stretch: list[Derived] = []

    def flush() -> None:
        found, stopped, recomputed = _pull_back_stretch(
            list(stretch), computed, uses, relevant, batch, dtype, limit, params
        )
        hand_on((tracked, Dense(g)) for tracked, g in found)
        failed.update(stopped)
        pieces.update(recomputed)
        stretch.clear()

    for node in chain:
        call = linear_call(node, batch, limit)
        if call is None:
            stretch.append(node)
            continue
        if stretch:  # (the computations after it first: its output's per-example gradients complete)
            flush()
        local = [(t, _examples(f, slice(0, batch))) for t, f in uses.get(id(node.output), [])]
        found = linear_uses(node, call, local, batch, dtype)
        closed.update(id(tracked.param) for tracked, _ in found if id(tracked.param) not in ahead)
        hand_on(found)
    if stretch:
        flush()
    for key in pieces.keys() & closed:  # (formed again for its sum, the pull-back's share only: a use of its own)
        failed[key] = f"its per-example gradients {BEYOND_KEEP_LIMIT} ({limit}) and a linear call on parameters uses it"
        del pieces[key]
    while blocked := [node for node in chain if {id(p) for p in node.params} & failed.keys()]:  # and what shares them
        for node in blocked:
            reason = next(failed[id(p)] for p in node.params if id(p) in failed)
            failed.update({id(p): reason for p in node.params if id(p) not in failed})
        chain = [node for node in chain if node not in blocked]
    return pulled, failed, pieces


def _pull_back_stretch(
    stretch: list[Derived],
    computed: set[int],
    uses: dict[int, list[Use]],
    relevant: set[int],
    batch: int,
    dtype: torch.dtype,
    limit: int,
    params: dict[int, nn.Parameter],
    stitching: bool = True,
) -> tuple[list[tuple[Tracked, torch.Tensor]], dict[int, str], dict[int, Piece]]:
    """Computations of the chain (later ones first; ``computed``: every computation's output) carried back by the
    generic pull-back: (the source's view, its per-example gradients (B, *view)) for each source, a parameter or an
    earlier computation's output; why a parameter cannot be (one example's per-example gradients of a computation
    pass ``limit`` numbers); and {id: piece} for each parameter whose per-example gradients, kept for the whole batch,
    would pass ``limit`` and that has no use of its own (:func:`_recomputed_pieces`; the parameter joins ``params``,
    by id). A computation's output's per-example gradients are formed a slice of examples at a time, at most
    ``limit`` numbers (a weight formed from LoRA factors is as large as the layer's: B × d_in·d_out at once would not
    fit where the factors' gradients do), through every computation in turn, later ones first: all of them as one
    graph where it is the recorded one (:func:`.stitched.stitch`, ``stitching``), else one at a time."""
    chain = stretch
    together = stitch(chain) if stitching and chain else None  # (its run is the check that each runs again)
    failed: dict[int, str] = {}
    unkept: dict[int, str] = {}  # too many to keep for the whole batch: a piece that forms them again for its sum
    for node in chain:
        reason = None if together is not None else node.again.failure()
        if reason is not None:
            failed.update({id(p): f"{node.operation} on parameters: {reason}" for p in node.params})
            continue
        widest = max(t.numel() for t in (node.output, *[t for t, _ in node.sources]))
        sizes = [(id(s.param), batch * t.numel()) for t, s in node.sources]
        for key, size in [(None, widest)] if widest > limit else sizes:  # (one example's, where that is too many)
            if size > limit and key not in computed:
                reason = f"{node.operation} on parameters: its per-example gradients ({size} numbers)"
                reason = f"{reason} {BEYOND_KEEP_LIMIT} ({limit})"
                if key is None:
                    failed.update({id(p): reason for p in node.params})
                else:
                    unkept[key] = reason
    failed |= {key: reason for key, reason in unkept.items() if uses.get(key)}  # (a use of its own: kept, or exact)
    while blocked := [node for node in chain if any(id(p) in failed for p in node.params)]:  # and what shares them
        for node in blocked:
            reason = next(failed[id(p)] for p in node.params if id(p) in failed)
            failed.update({id(p): reason for p in node.params if id(p) not in failed})
        chain = [node for node in chain if node not in blocked]
    if not chain:
        return [], failed, {}
    if together is not None and len(together.outputs) != len(chain):  # (some left out: the rest, closed, as one)
        together = stitch(chain)
        if together is None:
            return _pull_back_stretch(stretch, computed, uses, relevant, batch, dtype, limit, params, stitching=False)
    kept_out = unkept.keys() - failed.keys()  # formed again for their sums
    lazy = {id(s.param): s.param for node in chain for _, s in node.sources if id(s.param) in kept_out}
    squared = {key: torch.zeros(batch, dtype=dtype, device=chain[0].output.device) for key in lazy}

    def norms(key: int, rows: slice, g: torch.Tensor) -> None:
        squared[key][rows] = g.square().sum(1)

    parts = _slices(chain, together, uses, relevant, lazy, batch, dtype, limit, norms)
    pulled = [
        (chain[k].sources[j][1], found[0] if len(found) == 1 else torch.cat(found)) for (k, j), found in parts.items()
    ]
    params |= lazy
    return pulled, failed, _recomputed_pieces(chain, together, uses, relevant, lazy, squared, batch, dtype, limit)


def _reaching_a_use(chain: list[Derived], uses: dict[int, list[Use]]) -> list[Derived]:
    """The computations of ``chain`` (later ones first) whose output some use reaches, itself or through a later
    computation: the others' per-example gradients are zeros, and so is all they would pass back (a weight formed
    only to be detached, as DoRA's B·A for its norm), so they are neither formed nor pulled back."""
    needed: set[int] = set()
    kept = []
    for node in chain:
        if uses.get(id(node.output)) or id(node.output) in needed:
            needed |= {id(s.param) for _, s in node.sources}
            kept.append(node)
    return kept


def pulled_back_probes(
    chain: list[Derived], output: torch.Tensor, probes: torch.Tensor, param: nn.Parameter
) -> torch.Tensor:
    """(∂output/∂param)ᵀ p_k for each of the cotangents ``probes`` (k, *output.shape), through the computations
    ``chain`` (in the order they ran, ``output`` the last one's): (k, param.numel()) in the parameter's own
    coordinates, the chain carried back as the per-example pull-back carries it."""
    found: list[torch.Tensor] = []

    def keep(key: int, rows: slice, g: torch.Tensor) -> None:
        found.append(g)

    count, dtype = probes.shape[0], probes.dtype
    probed: dict[int, list[Use]] = {id(output): [(Tracked(output), Dense(probes))]}  # type: ignore[arg-type]
    relevant = {id(node.output) for node in chain} | {id(param)}
    later_first = list(reversed(chain))
    together = stitch(later_first)
    _slices(later_first, together, probed, relevant, {id(param)}, count, dtype, probes.numel(), keep, keep=False)
    return torch.cat(found) if found else probes.new_zeros(count, param.numel())


Visit = Callable[[int, slice, torch.Tensor], None]


def _slices(
    chain: list[Derived],
    together: Stitched | None,
    uses: dict[int, list[Use]],
    relevant: set[int],
    lazy: Collection[int],
    batch: int,
    dtype: torch.dtype,
    limit: int,
    visit: Visit,
    keep: bool = True,
) -> dict[tuple[int, int], list[torch.Tensor]]:
    """The chain carried back a slice of examples at a time (through ``together``, the chain run as one graph, where
    given; else one computation at a time): each slice's per-example gradients of a ``lazy`` parameter, added up over
    its places in the chain in its own coordinates, handed to ``visit`` (its id, the rows, (slice, its numel)); with
    ``keep``, those of the other parameters kept, by (computation, source)."""
    step = max(1, limit // max(t.numel() for node in chain for t in (node.output, *[t for t, _ in node.sources])))
    parts: dict[tuple[int, int], list[torch.Tensor]] = {}
    for start in range(0, batch, step):
        rows = slice(start, min(start + step, batch))
        local = {id(node.output): [(t, _examples(f, rows)) for t, f in uses.get(id(node.output), [])] for node in chain}
        count = rows.stop - rows.start
        pulled = (
            _through_each(chain, local, count, dtype)
            if together is None
            else _through_all(together, chain, local, count, dtype)
        )
        found: dict[int, torch.Tensor] = {}  # a lazy parameter's per-example gradients in this slice, (slice, numel)
        for (k, j), tracked, g in pulled:
            key = id(tracked.param)
            if key in lazy:
                flat = g.reshape(g.shape[0], -1).to(dtype)
                if tracked.index is None:  # the parameter itself
                    found[key] = found[key] + flat if key in found else flat
                else:
                    total = found[key] if key in found else flat.new_zeros(g.shape[0], tracked.param.numel())
                    found[key] = total.index_add_(1, tracked.flat_index().reshape(-1), flat)
            elif key in relevant and keep:
                parts.setdefault((k, j), []).append(g.to(dtype))
        for key, total in found.items():
            visit(key, rows, total)
    return parts


Pulled = Iterator[tuple[SourceKey, Tracked, torch.Tensor]]


def _through_each(chain: list[Derived], local: dict[int, list[Use]], count: int, dtype: torch.dtype) -> Pulled:
    """A slice's per-example gradients carried back one computation at a time (later ones first): each source's,
    by its key (k, j), where it is no computation's output still to come (there, a use of that output)."""
    for k, node in enumerate(chain):
        gradients = per_example_gradients_of(
            local.pop(id(node.output)), node.output, count, _complex_as(dtype, node.output)
        )
        for j, ((_, tracked), g) in enumerate(zip(node.sources, pull_back(node, gradients), strict=True)):
            if id(tracked.param) in local:  # the output of a computation still to come: a use of it
                local[id(tracked.param)].append((tracked, Dense(g.to(_complex_as(dtype, tracked.param)))))
            else:
                yield (k, j), tracked, g


def _through_all(
    together: Stitched, chain: list[Derived], local: dict[int, list[Use]], count: int, dtype: torch.dtype
) -> Pulled:
    """A slice's per-example gradients carried back through the whole chain run as one graph (:mod:`.stitched`)."""
    gradients = {
        id(node.output): per_example_gradients_of(
            local[id(node.output)], node.output, count, _complex_as(dtype, node.output)
        )
        for node in chain
        if local[id(node.output)]
    }
    yield from together.pull_back(gradients)


def _complex_as(dtype: torch.dtype, t: torch.Tensor) -> torch.dtype:
    """The engine's ``dtype``, or its complex counterpart for a complex computation's output ``t`` (its per-example
    gradients keep their imaginary parts until the pull-back reaches the real parameters)."""
    if not t.is_complex():
        return dtype
    return torch.complex128 if dtype == torch.float64 else torch.complex64


def _recomputed_pieces(
    chain: list[Derived],
    together: Stitched | None,
    uses: dict[int, list[Use]],
    relevant: set[int],
    lazy: dict[int, nn.Parameter],
    squared: dict[int, torch.Tensor],
    batch: int,
    dtype: torch.dtype,
    limit: int,
) -> dict[int, Piece]:
    """The ``lazy`` parameters' pieces, for parameters whose per-example gradients are too many to keep for the whole
    batch: their norms (``squared``, from the first pass over the slices), and a clipped sum that carries the chain
    back again, slice by slice, adding up c_i times each example's gradient (one pass for all of them, at the first
    parameter's sum; the factors are one pass's). Twice the pull-back's work, no B × |θ| numbers kept, and no exact
    path (a computed weight no closed form takes, a DoRA weight or ``torch.tanh(w)``, past the keep limit)."""
    done: dict[str, Any] = {}

    def totals(factors: torch.Tensor) -> dict[int, torch.Tensor]:
        if done.get("factors") is not factors:
            found: dict[int, torch.Tensor] = {}

            def weigh(key: int, rows: slice, g: torch.Tensor) -> None:
                part = torch.einsum("b,b...->...", factors[rows].to(g.dtype), g)
                found[key] = found[key] + part if key in found else part

            _slices(chain, together, uses, relevant, lazy, batch, dtype, limit, weigh, keep=False)
            done.update(factors=factors, found=found)
        return done["found"]  # type: ignore[no-any-return]

    def piece(key: int) -> Piece:
        param = lazy[key]
        return Piece(squared[key], lambda factors: [(param, totals(factors)[key].reshape(param.shape))])

    return {key: piece(key) for key in lazy}
