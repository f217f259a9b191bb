"""Fully connected classifiers, built from a JSON-able spec so a saved model can be rebuilt."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn


@dataclass(frozen=True)
class MlpSpec:
    in_features: int
    hidden: tuple[int, ...]
    n_classes: int
    activation: str = "tanh"

    def to_dict(self) -> dict:
        return asdict(self) | {"kind": "mlp", "hidden": list(self.hidden)}

    @classmethod
    def from_dict(cls, payload: dict) -> "MlpSpec":
        return cls(
            int(payload["in_features"]),
            tuple(int(h) for h in payload["hidden"]),
            int(payload["n_classes"]),
            str(payload.get("activation", "tanh")),
        )


_ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}


def build_mlp(spec: MlpSpec) -> nn.Sequential:
    """Linear → activation → … → Linear (logits). ``hidden=()`` is multinomial logistic regression."""
    layers: list[nn.Module] = []
    width = spec.in_features
    for hidden in spec.hidden:
        layers += [nn.Linear(width, hidden), _ACTIVATIONS[spec.activation]()]
        width = hidden
    layers.append(nn.Linear(width, spec.n_classes))
    return nn.Sequential(*layers)
