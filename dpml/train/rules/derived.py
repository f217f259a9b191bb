"""Computations on parameters alone: a weight formed from parameters before it meets the batch (a
parametrization's g·v/‖v‖, ``cat((q_bias, zeros, v_bias))``, ``A @ B``). The recorder tracks such an output as
if it were a parameter (:class:`Derived`); the engine then carries the per-example gradients of its uses back to
the parameters it came from through the operation's own Jacobian (:func:`pull_back`; the whole chain:
:mod:`.pull_backs`)."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from dpml.train.exact_path import batched_vjp
from dpml.train.rules.operands import outputs, repeats_first_row, substituted, tensors
from dpml.train.rules.registry import Tracked, function_name
from dpml.train.rules.rerun import LocalRun, RandomState, moved_from, replayed


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
