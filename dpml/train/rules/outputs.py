"""The outputs the recording forward pass keeps (a hooked layer's, a ruled operation's), whose gradients δ the engine
then asks autograd for.

Each is kept with its version, so that an in-place operation later in the pass (``ReLU(inplace=True)``,
``out += identity``) is seen, and with its **gradient edge** (``torch.autograd.graph.get_gradient_edge``): the node
and output slot that produced it, through which δ = ∂(Σ ℓ_i)/∂t reaches it however later in-place operations
rewrite t's history. Not a view's: an in-place rewrite of a view rebases its base and leaves the view's recorded
edge off the graph (its δ would come back as none), so a view rewritten in place is passed on as a copy from the
next pass on (:func:`dpml.train.clipping._record_forward`).
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


class RecordedOutputs:
    """One kind of recorded output (the hooked layers', or the rules'), in the order they were made."""

    def __init__(self) -> None:
        self.versions: list[tuple[torch.Tensor, int]] = []
        self._edges: dict[int, GradientEdge] = {}

    def keep(self, t: torch.Tensor) -> int:
        """Keep t as it is now, and return its place in the pass. Bookkeeping, not the model's computation: run
        with torch functions off (reading a tensor's autograd attributes would pass through the recording)."""
        with torch._C.DisableTorchFunction():
            self.versions.append((t, t._version))
            if t.requires_grad and not t._is_view():
                self._edges[id(t)] = get_gradient_edge(t)
        return len(self.versions) - 1

    def rewritten_views(self) -> dict[int, torch.Tensor]:
        """The kept views an in-place operation rewrote since (by their place): their edges cannot give their δ."""
        return {k: t for k, (t, version) in enumerate(self.versions) if t._version != version and t._is_view()}

    def edge(self, t: torch.Tensor) -> GradientEdge | None:
        """t's gradient edge as it was kept, or None (a view, or not kept here)."""
        return self._edges.get(id(t))
