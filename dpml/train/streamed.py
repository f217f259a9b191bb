"""The hooked layers' pieces, each formed while the backward pass goes, as soon as its output gradients δ are there.

A hooked layer's per-example norms and clipped sum come from its input a and its output gradient δ = ∂(Σ_j ℓ_j)/∂z
(book-keeping: Bu et al., ICML 2023, §3; :mod:`dpml.train.clipping_layers`). Asked of autograd all at once, every
layer's δ stays in memory until the backward pass is over, beside every layer's input: the DP step of WRN-16-4
(GroupNorm) then held 2.6× the non-private step's peak memory on this project's CPU at batch 64. But a layer's piece
needs δ only while it is formed, unless its clipped sum reads δ again (a convolution's Σ_i c_i a_i ⋆ δ_i, formed
once the clip factors c are known): a GroupNorm's piece keeps its per-example γ and β gradients, (B, 2C) numbers, a
layer whose per-example gradients are materialised keeps those, and both let δ and the layer's input go.

So each hooked layer's piece is formed in a pre-hook of the autograd node that made its output (the hook sees the
gradients flowing into the node, δ among them, before the node runs), and δ is kept only where a piece still reads
it. A ruled call (:mod:`dpml.train.rules`: an operation on a parameter no hooked layer covers, as timm's
``F.group_norm``) is finished the same way: its uses are formed from its δ as the pass reaches its output, and its
input and δ go unless the uses hold them (a norm's are its per-example γ and β gradients, C numbers an example).
Held to the end of the pass, the ruled norms' inputs and δ stood beside the activations still to be reached:
BiT-50 with GroupNorm at batch 64 on this project's CPU peaked at 1.73 times the non-private step's tensor memory,
1.59 with them let go as reached (``benchmarks/results/tensor_peaks_cpu``).

``torch.autograd.grad`` is asked only for the δ of the *lowest* targets, from whose nodes no other
target's node is reached (:func:`lowest`): every other target's node is on the way from the loss to one of those, so
autograd runs it and its pre-hook fires; a node the loss does not reach runs neither way, and its δ is zero, as
``allow_unused`` gives. The pieces are the numbers the same function forms after the pass (same inputs, same δ);
only the order in which the layers meet the pass's keep budget changes (:mod:`.keep_budget`: latest layer first).

The hooks run where autograd runs the nodes (on a GPU, autograd's device thread): each piece is formed in the
context (:mod:`contextvars`: the keep budget, the shared Gram matrices) the caller entered, in full float32
(:func:`dpml.devices.full_float32`), and the hooks are removed before the pass returns, so that a later backward pass
over a kept graph (the exact path's) does not run them again.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

from torch import nn

from dpml.devices import full_float32
from dpml.train.clipping_layers import Piece, layer_piece
from dpml.train.released import RuledCall, Slot
from dpml.train.rules.registry import Use

Deltas = list[torch.Tensor | None]


def as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A floating tensor recorded under autocast, back in the parameters' dtype (token ids stay integers)."""
    return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor


def layer_pieces(
    edges: Sequence[GradientEdge | None],
    calls: dict[nn.Module, list[tuple[torch.Tensor, Slot]]],
    ruled: list[RuledCall],
    losses: torch.Tensor,
    retain_graph: bool,
    dtype: torch.dtype,
) -> tuple[list[tuple[nn.Module, Piece]], list[list[Use]]]:
    """The hooked layers' pieces (in the order of ``calls``: the forward pass's), each formed as the backward pass of
    Σ_i ℓ_i reaches its calls' outputs (``edges``: the targets by place, :class:`dpml.train.released.Targets`), from
    their inputs and δ cast to ``dtype``; and each ruled call's uses (in the order of ``ruled``), formed by its
    ``finish`` as the pass reaches its output, from its δ cast to ``dtype``. ``calls`` and ``ruled`` are emptied as
    the pieces and uses are formed: a layer's inputs are let go with its δ unless its piece holds them, a ruled
    call's input unless its uses hold it (a norm's per-example γ and β gradients hold C numbers an example)."""
    modules = list(calls)
    groups = [[slot.place for _, slot in calls[module]] for module in modules]
    groups += [[call.slot.place] for call in ruled]
    formed: dict[int, Piece] = {}
    waiting: list[RuledCall | None] = list(ruled)
    ruled.clear()
    finished: list[list[Use]] = [[] for _ in waiting]

    def ready(g: int, deltas: Deltas) -> None:
        if g >= len(modules):  # a ruled call
            call, waiting[g - len(modules)] = waiting[g - len(modules)], None
            assert call is not None
            d = call.slot.zeros() if deltas[0] is None else deltas[0]
            finished[g - len(modules)] = call.finish(as_dtype(d, dtype))
            return
        taken = calls.pop(modules[g])
        formed[g] = layer_piece(
            modules[g],
            [
                (as_dtype(a, dtype), as_dtype(slot.zeros() if d is None else d, dtype))
                for (a, slot), d in zip(taken, deltas, strict=True)
            ],
        )

    Stream(edges, groups, ready, set()).run(losses, retain_graph)
    return [(module, formed[g]) for g, module in enumerate(modules)], finished


def _children(node: Node) -> Iterator[Node]:
    return (child for child, _ in node.next_functions if child is not None)


def lowest(edges: Sequence[GradientEdge]) -> list[int]:
    """The places of the edges whose node reaches no other edge's node through the graph below it (one walk over the
    graph's nodes below the targets, each visited once; the nodes are held for the walk, so that their ids stay
    theirs)."""
    targets = {id(edge.node) for edge in edges}
    below: dict[int, bool] = {}  # id(node) -> some target node lies strictly below it
    held: list[Node] = []
    for edge in edges:
        if id(edge.node) not in below:
            _walk(edge.node, targets, below, held)
    return [place for place, edge in enumerate(edges) if not below[id(edge.node)]]


def _walk(start: Node, targets: set[int], below: dict[int, bool], held: list[Node]) -> None:
    """Fill ``below`` for ``start`` and every node under it (depth first, without recursion: graphs run deep)."""
    stack: list[tuple[Node, Iterator[Node]]] = [(start, _children(start))]
    found = {id(start): False}
    held.append(start)
    while stack:
        node, children = stack[-1]
        for child in children:
            key = id(child)
            if key in below:
                found[id(node)] = found[id(node)] or below[key] or key in targets
            elif key not in found:
                found[key] = False
                held.append(child)
                stack.append((child, _children(child)))
                break
        else:
            stack.pop()
            below[id(node)] = found.pop(id(node))
            if stack:
                parent = id(stack[-1][0])
                found[parent] = found[parent] or below[id(node)] or id(node) in targets


class Stream:
    """One backward pass of Σ_i ℓ_i with consumers of δ: ``groups[g]`` are the places (among ``edges``) whose δ the
    consumer g reads, ``ready(g, deltas)`` forms what it needs from them once they are all there (None: the loss does
    not reach that place), and the δ of the places in ``kept`` are returned for what reads them after the pass."""

    def __init__(
        self,
        edges: Sequence[GradientEdge | None],
        groups: Sequence[Sequence[int]],
        ready: Callable[[int, Deltas], None],
        kept: set[int],
    ) -> None:
        self.edges, self.groups, self.ready, self.kept = edges, groups, ready, kept
        self.found: dict[int, torch.Tensor | None] = {}
        self.waiting = [len(set(places)) for places in groups]
        self.readers: dict[int, list[int]] = {}  # place -> the groups that read it
        for g, places in enumerate(groups):
            for place in dict.fromkeys(places):
                self.readers.setdefault(place, []).append(g)
        self.unread = {place: len(readers) for place, readers in self.readers.items()}
        self.context = contextvars.copy_context()

    def run(self, losses: torch.Tensor, retain_graph: bool) -> Deltas:
        """The backward pass: every group's ``ready`` called (in the order the pass reaches them; those whose places
        it does not reach at the end), and the δ of the ``kept`` places."""
        for place, edge in enumerate(self.edges):
            if edge is None:  # an output that needs no gradient: δ = 0
                self._arrived(place, None)
        asked = {place: edge for place, edge in enumerate(self.edges) if edge is not None}
        lowest_places = [list(asked)[k] for k in lowest(list(asked.values()))]
        lowest_nodes = {id(asked[place].node) for place in lowest_places}
        by_node: dict[int, tuple[Node, list[tuple[int, int]]]] = {}
        for place, edge in asked.items():
            by_node.setdefault(id(edge.node), (edge.node, []))[1].append((place, edge.output_nr))
        handles = [
            node.register_prehook(self._hook(slots))
            for key, (node, slots) in by_node.items()
            if key not in lowest_nodes  # (a lowest node does not run: its δ is asked for)
        ]
        try:
            lowest_edges = [asked[place] for place in lowest_places]
            grad = torch.autograd.grad
            captured = grad(losses.sum(), lowest_edges, allow_unused=True, retain_graph=retain_graph) if asked else ()
        finally:
            for handle in handles:
                handle.remove()
        for place, delta in zip(lowest_places, captured, strict=True):
            self._arrived(place, delta)
        for place in asked:  # a node the pass did not run: the loss does not reach it
            if place not in self.found:
                self._arrived(place, None)
        for g, places in enumerate(self.groups):
            if not places and self.waiting[g] == 0:
                self._form(g)
        return [self.found.get(place) if place in self.kept else None for place in range(len(self.edges))]

    def _hook(self, slots: list[tuple[int, int]]) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def prehook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            for place, output_nr in slots:
                self._arrived(place, grad_outputs[output_nr])

        return prehook

    def _arrived(self, place: int, delta: torch.Tensor | None) -> None:
        if place in self.found:
            return
        self.found[place] = delta
        for g in self.readers.get(place, []):
            self.waiting[g] -= 1
            if self.waiting[g] == 0:
                self._form(g)

    def _form(self, g: int) -> None:
        places = self.groups[g]
        self.context.run(self._formed, g, [self.found[place] for place in places])
        for place in dict.fromkeys(places):
            self.unread[place] -= 1
            if self.unread[place] == 0 and place not in self.kept:
                self.found[place] = None  # let go: no group reads it again

    def _formed(self, g: int, deltas: Deltas) -> None:
        with full_float32():
            self.ready(g, deltas)
