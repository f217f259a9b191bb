"""A network linearised at its initialisation (seed 000, Eq. 3): the model noisy GD's KL bound is exact for."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call, jvp


class LinearisedNetwork(nn.Module):
    """f_lin(W; x) = f(W0; x) + J(W0; x)(W − W0): the first-order expansion of ``network`` at W0 (Eq. 3).

    W0 is a snapshot of the network's parameters when wrapped, kept as buffers (``anchor_i``); the
    trainable parameters (``weights.i``, in the network's parameter order) start at W0. The forward
    pass is one Jacobian-vector product ``torch.func.jvp`` at W0 along W − W0, so f_lin is exactly
    affine in W and ∇_W ℓ(f_lin(W; x)) = J(W0; x)ᵀ ∂ℓ/∂f — the model of Thm 4.1 / Cor. 4.2. The
    wrapped network is a private copy (later changes to ``network`` do not affect it); its own
    buffers, if any, are registered here too (``state_i``) so that ``.to()`` moves them.
    """

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        template = copy.deepcopy(network)
        self._names = [name for name, _ in template.named_parameters()]
        self._buffer_names = [name for name, _ in template.named_buffers()]
        if not self._names:
            raise ValueError(f"network {type(network).__name__}: has no parameters to linearise")
        self.weights = nn.ParameterList([nn.Parameter(p.detach().clone()) for p in template.parameters()])
        for index, p in enumerate(template.parameters()):
            self.register_buffer(f"anchor_{index}", p.detach().clone())
        for index, b in enumerate(template.buffers()):
            self.register_buffer(f"state_{index}", b.detach().clone())
        self._template = (template,)  # a tuple: not registered as a submodule, so its parameters stay out

    def anchor(self) -> list[torch.Tensor]:
        """W0, in the network's parameter order."""
        return [getattr(self, f"anchor_{i}") for i in range(len(self._names))]

    def network_at(self, values: Sequence[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The wrapped network f(W; x) with its parameters set to ``values`` (no copy of the module)."""
        state = dict(zip(self._names, values, strict=True))
        state |= {name: getattr(self, f"state_{i}") for i, name in enumerate(self._buffer_names)}
        return functional_call(self._template[0], state, (x,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        anchor = tuple(self.anchor())
        direction = tuple(w - w0 for w, w0 in zip(self.weights, anchor, strict=True))
        value, derivative = jvp(lambda *values: self.network_at(values, x), anchor, direction)
        return value + derivative
