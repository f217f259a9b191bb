"""The recorded outputs, let go before the backward pass that gives their gradients.

The engine needs a recorded output z (a hooked layer's, a ruled operation's) for one thing only: to ask autograd for
its δ = ∂(Σ_j ℓ_j)/∂z. Its gradient edge (``torch.autograd.graph.get_gradient_edge``: the node and the output slot
that made it) is enough for that, and the norms and sums read the layer's *input* and δ, never z. Held to the end of
the backward pass, the outputs would stay in memory beside the δ that replace them: on this project's CPU
≈ 64 MiB of ViT-tiny's at batch 64 (the non-private step saves 108 MiB in all), 88 MiB of the encoder's. So each
output is replaced by a :class:`Slot` (its place among the backward's targets, and what a zero δ looks like, for an
output the loss does not reach) before the backward pass runs, and the pass frees the activations it saved as it
goes, as a non-private step's does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from dpml.train.rules.outputs import Recorded
from dpml.train.rules.registry import Pending, Use


@dataclass(frozen=True)
class Slot:
    """A recorded output once let go: its place among the backward pass's targets, and its shape, dtype and device."""

    place: int
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def zeros(self) -> torch.Tensor:
        """The δ of an output the loss does not reach."""
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)


@dataclass(frozen=True)
class RuledCall:
    """A rule's pending call without its output: the parameters it covers, ``finish`` (δ ↦ their uses) and where
    its δ will be."""

    params: list[nn.Parameter]
    finish: Callable[[torch.Tensor], list[Use]]
    operation: str
    slot: Slot


@dataclass
class Targets:
    """What the backward pass is asked for: one gradient edge per slot (None: the output needs no gradient)."""

    edges: list[GradientEdge | None] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)
    _places: dict[tuple[int, int], Slot] = field(default_factory=dict)  # (id(node), output) -> its slot

    def slot(self, output: Recorded, edge: torch.Tensor | GradientEdge) -> Slot:
        """Let ``output`` go: its edge (``edge``, or the tensor's own as it is now) joins the targets, once however
        many recorded calls read its δ (a recurrent layer's input terms: their product's rule and the scan's)."""
        if isinstance(edge, torch.Tensor):
            edge = get_gradient_edge(edge) if edge.requires_grad else None  # type: ignore[assignment]
        key = (id(edge.node), edge.output_nr) if isinstance(edge, GradientEdge) else None
        if key is not None and key in self._places:
            return self._places[key]
        self.edges.append(edge if isinstance(edge, GradientEdge) else None)
        self.slots.append(Slot(len(self.edges) - 1, output.shape, output.dtype, output.device))
        if key is not None:
            self._places[key] = self.slots[-1]
        return self.slots[-1]

    def ruled(self, pending: Pending, edge: torch.Tensor | GradientEdge) -> RuledCall:
        return RuledCall(pending.params, pending.finish, pending.operation, self.slot(pending.output, edge))

    def numbers(self) -> int:
        """How many numbers the slots' δ hold together."""
        return sum(slot.shape.numel() for slot in self.slots)
