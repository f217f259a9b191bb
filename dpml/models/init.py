"""Initialisation schemes of seed 000 (Ye et al., *Initialization Matters*, Eq. 5 and Table 1): the bias-free
fully connected ReLU network and its weights drawn W_l ~ N(0, β_l) entrywise, with the variances β_l of
:mod:`dpml.init_schemes` (kept there, without torch, because the KL accountant reads them too). PyTorch's default
``nn.Linear`` initialisation is none of these schemes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from dpml.init_schemes import Scheme, init_variances
from dpml.models.linearised import LinearisedNetwork


def bias_free_relu_mlp(widths: list[int]) -> nn.Sequential:
    """Linear(no bias) → ReLU → … → Linear(no bias): seed 000's network for widths [d, m_1, …, o]."""
    layers: list[nn.Module] = []
    for layer, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:], strict=True), start=1):
        layers.append(nn.Linear(fan_in, fan_out, bias=False))
        if layer < len(widths) - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def initialise(model: nn.Sequential, scheme: Scheme, generator: torch.Generator | None = None) -> nn.Sequential:
    """Redraw every weight of a :func:`bias_free_relu_mlp` from N(0, β_l) in place."""
    linears = [m for m in model if isinstance(m, nn.Linear)]
    widths = [linears[0].in_features] + [m.out_features for m in linears]
    with torch.no_grad():
        for module, beta in zip(linears, init_variances(scheme, widths), strict=True):
            module.weight.normal_(0.0, beta**0.5, generator=generator)
    return model


@dataclass(frozen=True)
class BiasFreeReluSpec:
    """Seed 000's network as a model spec: widths [d, *hidden, o], its init scheme, linearised or not.

    The linearised model f_lin(W) = f(W0) + J(W0)(W − W0) stores W0 with its weights, so the spec
    only says that it is linearised; loading restores W0 from the state dict.
    """

    in_features: int
    hidden: tuple[int, ...]
    n_classes: int
    init: str = "he"
    linearised: bool = False

    @property
    def widths(self) -> list[int]:
        return [self.in_features, *self.hidden, self.n_classes]

    def to_dict(self) -> dict:
        return asdict(self) | {"kind": "bias_free_relu", "hidden": list(self.hidden)}

    @classmethod
    def from_dict(cls, payload: dict) -> "BiasFreeReluSpec":
        return cls(
            int(payload["in_features"]),
            tuple(int(h) for h in payload["hidden"]),
            int(payload["n_classes"]),
            str(payload.get("init", "he")),
            bool(payload.get("linearised", False)),
        )


def build_bias_free_relu(spec: BiasFreeReluSpec, generator: torch.Generator | None = None) -> nn.Module:
    """The network initialised by ``spec.init`` (from ``generator``), wrapped as linearised at that W0 if asked."""
    network = initialise(bias_free_relu_mlp(spec.widths), spec.init, generator)  # type: ignore[arg-type]
    if not spec.linearised:
        return network
    return LinearisedNetwork(network)
