"""The outputs the recording forward pass keeps (a hooked layer's, a ruled operation's), whose gradients δ the engine
then asks autograd for.

Each is kept with its version, so that an in-place operation later in the pass (``ReLU(inplace=True)``,
``out += identity``) is seen, and with its **gradient edge** (``torch.autograd.graph.get_gradient_edge``): the node
and output slot that produced it, through which δ = ∂(Σ ℓ_i)/∂t reaches it however later in-place operations
rewrite t's history. Not a view's: an in-place rewrite of a view rebases its base and leaves the view's recorded
edge off the graph (its δ would come back as none), so a view rewritten in place is passed on as a copy from the
next pass on (:func:`dpml.train.clipping._record_forward`).

A hooked layer's output that is not a view is let go as soon as it is recorded (``keep(t, let_go=True)``): the
engine reads of it only its gradient edge, shape, dtype and device (:class:`LetGo`), and nothing but autograd's saved
tensors need hold it afterwards, as in a non-private step. Held to the end of the forward pass, a GroupNorm's output
(read by a ReLU, which saves its result, not its input) and a residual block's last output (read by an addition,
which saves nothing) outlived their use: WRN-16-4's recording forward pass on this project's CPU held 331 MiB at
batch 64 where the non-private step peaks at 178. An output that is not let go (a view, or a rule's, which its
pending call holds) is kept with its version and, where it is no view, its edge, by the tensor's id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass(frozen=True, eq=False)
class LetGo:
    """A recorded output let go: what the engine reads of it (its δ by ``edge``, the zeros of an unreached one)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    edge: GradientEdge


Recorded = Union[torch.Tensor, LetGo]


class RecordedOutputs:
    """One kind of recorded output (the hooked layers', or the rules'), in the order they were made."""

    def __init__(self) -> None:
        self.versions: list[tuple[Recorded, int]] = []
        self._edges: dict[int, GradientEdge] = {}

    def keep(self, t: torch.Tensor, let_go: bool = False) -> int:
        """Keep t as it is now, and return its place in the pass; with ``let_go``, t itself is not held unless it is a
        view or needs no gradient (:meth:`recorded` gives what stands for it). Bookkeeping, not the model's
        computation: run with torch functions off (reading a tensor's autograd attributes would pass through the
        recording)."""
        with torch._C.DisableTorchFunction():
            if t.requires_grad and not t._is_view():
                edge = get_gradient_edge(t)
                if let_go:  # (its edge is not filed by id: once t is freed, another tensor may take its id)
                    self.versions.append((LetGo(t.shape, t.dtype, t.device, edge), t._version))
                    return len(self.versions) - 1
                self._edges[id(t)] = edge
            self.versions.append((t, t._version))
        return len(self.versions) - 1

    def recorded(self, place: int) -> Recorded:
        """The output kept at ``place``, or what stands for it once let go."""
        return self.versions[place][0]

    def rewritten_views(self) -> dict[int, torch.Tensor]:
        """The kept views an in-place operation rewrote since (by their place): their edges cannot give their δ."""
        return {
            k: t
            for k, (t, version) in enumerate(self.versions)
            if isinstance(t, torch.Tensor) and t._version != version and t._is_view()
        }

    def edge(self, t: torch.Tensor) -> GradientEdge | None:
        """t's gradient edge as it was kept, or None (a view, not kept here, or let go: a LetGo has its own)."""
        return self._edges.get(id(t))
