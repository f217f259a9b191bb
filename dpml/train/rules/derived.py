"""Computations on parameters alone: a weight formed from parameters before it meets the batch (a
parametrization's g·v/‖v‖, ``cat((q_bias, zeros, v_bias))``, ``A @ B``). The recorder tracks such an output as
if it were a parameter (:class:`Derived`); the engine then carries the per-example gradients of its uses back to
the parameters it came from through the operation's own Jacobian (:func:`pull_back`)."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from dpml.train.exact_path import batched_vjp
from dpml.train.keep_budget import BEYOND_KEEP_LIMIT
from dpml.train.rules.operands import outputs, repeats_first_row, substituted, tensors
from dpml.train.clipping_layers import Piece
from dpml.train.rules.combine import per_example_gradients_of
from dpml.train.rules.ragged import Ragged
from dpml.train.rules.registry import Computed, Dense, Factored, Form, Tracked, Use, function_name
from dpml.train.rules.rerun import LocalRun, RandomState, moved_from, replayed
from dpml.train.rules.stitched import SourceKey, Stitched, stitch


@dataclass(eq=False)
class Derived:
    """The output of a computation on parameters alone (no operand from the batch): a weight formed by its
    parametrization (``weight_norm``'s g·v/‖v‖), a bias concatenated with constants, a position table
    interpolated. The recorder tracks ``output`` as if it were a parameter; the per-example gradients its
    uses give, (B, *output.shape), are pulled back to ``sources`` through the operation's own Jacobian (one
    batched vector-Jacobian product on ``local``, the operation run again on detached copies of the sources,
    ``leaves``: the local derivative, so that a source computed from another source of the same operation is
    not counted twice), and become uses of the parameters — or of the Derived outputs the sources are."""

    output: torch.Tensor
    sources: list[tuple[torch.Tensor, Tracked]]  # the operands that are parameters or their views (or Derived outputs)
    params: list[nn.Parameter]  # the parameters it depends on, through other Derived outputs too
    again: LocalRun  # the call run again on detached copies of the sources, when a pull-back first needs it
    position: int = 0  # which of the call's outputs
    operation: str = ""

    @property
    def call(self) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """(function, args, kwargs) as called."""
        return self.again.func, self.again.args, self.again.kwargs

    @property
    def local(self) -> torch.Tensor:
        """The same output from ``leaves`` (checked equal to ``output``)."""
        return self.again.result()[0][self.position]

    @property
    def leaves(self) -> list[torch.Tensor]:
        """Detached copies of the sources' tensors, requiring gradient."""
        return self.again.result()[1]


class DerivedNodes:
    """The computations on parameters alone of one recording pass: their :class:`Derived` nodes in the order they ran
    (``nodes``), each found by the tensor that stands for its output (the output itself, or a detached alias where
    the output tensor already stands for an earlier node: an in-place write ``w /= s`` gives w new values, a node of
    their own); and the tensors standing for values that an in-place write has changed since (``stale``): a view
    of them taken before the write shows the new values, which their node does not describe."""

    def __init__(self, batch: int) -> None:
        self.batch = batch  # (a constant's rows are compared by value only where there are as many as examples)
        self.nodes: list[Derived] = []
        self._by_key: dict[int, Derived] = {}
        self.stale: set[int] = set()
        self.stale_copies: dict[int, Tracked] = {}  # id(t) -> how t was tracked: a parameter's copy written since
        self._runs_by_memory: dict[int | None, list[LocalRun]] = {}  # a storage's address -> the runs that read it

    def of(self, key: torch.Tensor) -> Derived | None:
        return self._by_key.get(id(key))

    def written(self, base: torch.Tensor, was: Tracked, entries: Iterable[tuple[torch.Tensor, Tracked]]) -> None:
        """``base``, tracked as ``was``, is about to be written in place: what shows its values from then on is stale
        (but what is tracked again after the write). A computation's output: every view of it (its key). A copy of a
        parameter tracked as the parameter's view (``p.clone()``): the tracked ``entries`` that share its memory."""
        if self.of(was.param) is not None:
            self.stale.add(id(was.param))
            return
        memory = base if base._base is None else base._base
        for t, tracked in entries:
            if t is memory or t._base is memory:
                self.stale_copies[id(t)] = tracked

    def awaiting_runs(self) -> bool:
        """Some recorded computation has not been run again yet (an in-place write may have to wait for it)."""
        return bool(self._runs_by_memory)

    def before_write(self, target: torch.Tensor) -> None:
        """``target`` (tracked or not: a constant too) is about to be written in place: each recorded computation
        that reads or gave its memory is run again first (:class:`.rerun.LocalRun`), while it still holds the
        numbers the computation saw; after the write the run would give other numbers, and its parameters would
        take the exact path."""
        for run in self._runs_by_memory.pop(_memory(target), []):
            run.failure()

    def stale_among(self, operands: list[torch.Tensor], tracked: Callable[[Any], Tracked | None]) -> list[Tracked]:
        """The ``tracked`` operands that show values an in-place write changed since they were tracked."""
        if not self.stale and not self.stale_copies:
            return []
        seen = [(t, h) for t in operands if (h := tracked(t)) is not None]
        return [h for t, h in seen if id(h.param) in self.stale or self.stale_copies.get(id(t)) is h]

    def own_values(self, t: torch.Tensor, tracked: Tracked | None) -> bool:
        """t is a parameter or a view of its memory (not a copy of it, nor a computation's output)."""
        if tracked is None or self.of(tracked.param) is not None:
            return False
        return t is tracked.param or t._base is tracked.param

    def record(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        tracked: Callable[[Any], Tracked | None],
        state: RandomState,
    ) -> list[tuple[torch.Tensor, Tracked]]:
        """Nodes for the outputs of ``func`` (those that require gradient) from its operands that are ``tracked``
        (views of parameters, or outputs of other nodes): each output with the :class:`Tracked` it is to be tracked
        as (whether the call can be run again is found when a pull-back needs it, :class:`.rerun.LocalRun`). Where
        the operands repeat one row along their first dimension (:func:`first_rows`), the node is the call on that
        row, and each output its repetition."""
        rows = first_rows(func, args, kwargs, out, tracked, state, self.batch)
        if rows is None:
            return self._record(func, args, kwargs, out, tracked, state)
        one, sliced, (sliced_args, sliced_kwargs) = rows
        found = self._record(func, sliced_args, sliced_kwargs, one, lambda t: sliced.get(id(t), tracked(t)), state)
        return [
            (o, Tracked(t.param, t.flat_index().expand(o.shape), t.shared))
            for o, (_, t) in zip([o for o in outputs(out) if o.requires_grad], found, strict=True)
        ]

    def _record(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        tracked: Callable[[Any], Tracked | None],
        state: RandomState,
    ) -> list[tuple[torch.Tensor, Tracked]]:
        sources: dict[int, tuple[torch.Tensor, Tracked]] = {}
        for t in tensors(args, kwargs):
            seen = tracked(t)
            if seen is not None:
                sources.setdefault(id(t), (t, seen))
        again = LocalRun(func, args, kwargs, out, {key: t for key, (t, _) in sources.items()}, state)
        for held in {_memory(t) for t in (*tensors(args, kwargs), *outputs(out))} - {None}:
            self._runs_by_memory.setdefault(held, []).append(again)
        params = list(
            {
                id(p): p
                for _, tracked in sources.values()  # through other computations to the parameters
                for p in (
                    self._by_key[id(tracked.param)].params if id(tracked.param) in self._by_key else [tracked.param]
                )
            }.values()
        )
        tracked_as = []
        for position, o in enumerate(outputs(out)):
            if o.requires_grad:
                key = o.detach() if id(o) in self._by_key or any(o is t for t, _ in sources.values()) else o
                node = Derived(key, list(sources.values()), params, again, position, function_name(func))
                self.nodes.append(node)
                self._by_key[id(key)] = node
                tracked_as.append((o, Tracked(key)))  # type: ignore[arg-type]
        return tracked_as


def _memory(t: torch.Tensor) -> int | None:
    """The address of the storage ``t`` views (None where it has none: a meta or sparse tensor)."""
    try:
        address = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return address or None


def first_rows(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: Any,
    tracked: Callable[[Any], Tracked | None],
    state: RandomState,
    batch: int,
) -> tuple[Any, dict[int, Tracked], tuple[tuple[Any, ...], dict[str, Any]]] | None:
    """A computation on parameters and constants whose operands repeat one row along the first dimension of its
    outputs, N > 1 (a constant expanded over the batch, ConViT's ``rel_indices.expand(B, …)``, or built with equal
    rows; or a tracked view repeated so, the output of an earlier such call): the call run again on the first rows
    alone (its outputs, the sliced operands' views, the sliced call), where its outputs are then one row each; None
    otherwise. A view's rows are told apart by its index's stride 0; a constant's by stride 0, or by value where it
    is built in the forward pass with one row per example (N = ``batch``; not a frozen parameter: on a GPU, the
    comparison waits for it, and such constants are rare). An operand of fewer dimensions than the outputs that does
    not repeat a row is left whole: broadcast, its first dimension meets the outputs' last ones, not their rows (a
    norm's weight of N numbers, a layer's (N, n) weight on (N, T, n) rows), and where the call pairs it with the rows
    all the same, the call on one row gives other than one row and the chain is not carried; so whether a chain is
    carried does not depend on a size that equals N at one batch size only (the Perceiver's latents of width 32 at a
    batch of 32). Nor is a call that draws random numbers, each row its own (alpha dropout, noise added; dropout is
    taken before, as the row times its mask: :mod:`.dropout`). An operation that mixes the rows (a running sum along
    that dimension) makes the node's rows another function, which the probe's check against per-example autograd
    finds and takes exactly."""
    shaped = [o for o in outputs(out) if o.dim() >= 1]
    if not shaped or shaped[0].shape[0] <= 1:
        return None
    n, dims, cut, sliced = shaped[0].shape[0], shaped[0].dim(), {}, {}
    for t in tensors(args, kwargs):
        if t.dim() < 1 or t.shape[0] != n:
            continue
        view = tracked(t)
        if view is None:  # a constant: expanded, or built with equal rows (EdgeNeXt's features of zeros(B, H, W))
            repeated = repeats_first_row(t, batch, by_value=not isinstance(t, nn.Parameter) and not t.is_meta)
        else:
            repeated = view.index is not None and view.index.stride(0) == 0
        if not repeated:
            if t.dim() < dims:  # (a norm's or a layer's weight of N numbers: not the outputs' rows)
                continue
            return None
        cut[id(t)] = (t, t[:1])
        if view is not None:
            sliced[id(cut[id(t)][1])] = Tracked(view.param, view.flat_index()[:1], view.shared)
    if not cut:
        return None
    call = substituted(args, kwargs, cut)
    try:
        with torch.enable_grad(), replayed(state):
            one = func(*call[0], **call[1])
            drew = moved_from(state)
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None
    if drew:  # (a draw on the repeated rows: each row draws its own, the rows are no longer one row's repeats)
        return None
    pairs = list(zip(outputs(one), outputs(out), strict=False))
    if len(pairs) != len(outputs(out)) or any(o.dim() < 1 or o.shape != (1, *r.shape[1:]) for o, r in pairs):
        return None
    return one, sliced, call


def pull_back(node: Derived, gradients: torch.Tensor) -> list[torch.Tensor]:
    """Each example's gradient of a :class:`Derived` output, (B, *output.shape), as the gradients of its sources,
    each (B, *source.shape): B vector-Jacobian products of the operation alone at once (a loop where an
    operator has no batching rule), the chain rule's step ∂ℓ_i/∂s = (∂o/∂s)ᵀ ∂ℓ_i/∂o with the sources
    independent (a source that is itself a Derived output passes its share on when its own turn comes)."""
    return batched_vjp(node.local, node.leaves, gradients.to(node.local.dtype))


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
    stitching: bool = True,
) -> tuple[list[tuple[Tracked, torch.Tensor]], dict[int, str], dict[int, Piece]]:
    """The uses of the computations on parameters (``nodes`` in the order they ran; those whose output is among the
    ``relevant`` ids) carried back to the parameters they came from: (the parameter's view, its per-example
    gradients (B, *view)) for each source that is one; why a parameter cannot be (one example's per-example gradients
    of a computation pass ``limit`` numbers); and {id: piece} for each parameter whose per-example gradients, kept
    for the whole batch, would pass ``limit`` and that has no use of its own (:func:`_recomputed_pieces`; the parameter
    joins ``params``, by id). A computation's output's per-example gradients are formed a slice of examples at a time,
    at most ``limit`` numbers (a weight formed from LoRA factors is as large as the layer's: B × d_in·d_out at once
    would not fit where the factors' gradients do), through every computation in turn, later ones first: all of them
    as one graph where it is the recorded one (:func:`.stitched.stitch`, ``stitching``), else one at a time."""
    chain = _reaching_a_use([node for node in reversed(nodes) if id(node.output) in relevant], uses)
    together = stitch(chain) if stitching and chain else None  # (its run is the check that each runs again)
    computed = {id(node.output) for node in nodes}
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
            return pull_back_all(nodes, uses, relevant, batch, dtype, limit, params, stitching=False)
    kept_out = unkept.keys() - failed.keys()  # formed again for their sums
    lazy = {id(s.param): s.param for node in chain for _, s in node.sources if id(s.param) in kept_out}
    squared = {key: torch.zeros(batch, dtype=dtype, device=chain[0].output.device) for key in lazy}

    def norms(key: int, rows: slice, g: torch.Tensor) -> None:
        squared[key][rows] = g.square().sum(1)

    parts = _slices(chain, together, uses, relevant, lazy, batch, dtype, limit, norms)
    pulled = [(chain[k].sources[j][1], torch.cat(found)) for (k, j), found in parts.items()]
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
