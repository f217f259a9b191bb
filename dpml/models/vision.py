"""Standard image classifiers for DP-SGD, with GroupNorm (never BatchNorm: batch statistics mix the
examples of a batch, so per-example clipping would not bound one example's influence).

- ``cnn``: ``channels`` blocks of 3×3 convolution (padding 1) → GroupNorm → activation → 2×2 average
  pooling, then dense layers of the ``hidden`` widths and the output layer. Tanh is the default
  activation: bounded activations train better under clipping and noise (Papernot et al. 2021,
  *Tempered sigmoid activations for deep learning with differential privacy*).
- ``wide_resnet``: WRN-depth-widen (Zagoruyko & Komodakis 2016) with pre-activation blocks and GroupNorm
  of ``norm_groups`` groups — WRN-16-4 is the standard DP-SGD image model (De et al. 2022, *Unlocking
  high-accuracy differentially private image classification through scale*). Three stages of
  n = (depth − 4)/6 blocks of widths 16·widen, 32·widen, 64·widen (strides 1, 2, 2), global average
  pooling and one output layer.

The pipeline's features are flat rows; both models start by reshaping them to ``input_shape`` [C, H, W].
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

_ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}


@dataclass(frozen=True)
class CnnSpec:
    in_features: int
    input_shape: tuple[int, int, int]
    channels: tuple[int, ...]
    hidden: tuple[int, ...]
    n_classes: int
    norm_groups: int = 4
    activation: str = "tanh"

    def to_dict(self) -> dict:
        return asdict(self) | {
            "kind": "cnn",
            "input_shape": list(self.input_shape),
            "channels": list(self.channels),
            "hidden": list(self.hidden),
        }

    @classmethod
    def from_dict(cls, payload: dict) -> "CnnSpec":
        return cls(
            int(payload["in_features"]),
            tuple(int(v) for v in payload["input_shape"]),  # type: ignore[arg-type]
            tuple(int(c) for c in payload["channels"]),
            tuple(int(h) for h in payload["hidden"]),
            int(payload["n_classes"]),
            int(payload["norm_groups"]),
            str(payload["activation"]),
        )


@dataclass(frozen=True)
class WideResNetSpec:
    in_features: int
    input_shape: tuple[int, int, int]
    n_classes: int
    depth: int = 16
    widen: int = 4
    norm_groups: int = 16

    def to_dict(self) -> dict:
        return asdict(self) | {"kind": "wide_resnet", "input_shape": list(self.input_shape)}

    @classmethod
    def from_dict(cls, payload: dict) -> "WideResNetSpec":
        return cls(
            int(payload["in_features"]),
            tuple(int(v) for v in payload["input_shape"]),  # type: ignore[arg-type]
            int(payload["n_classes"]),
            int(payload["depth"]),
            int(payload["widen"]),
            int(payload["norm_groups"]),
        )


def check_input_shape(input_shape: tuple[int, ...] | None, in_features: int) -> tuple[int, int, int]:
    """[C, H, W] (its length is checked when the configuration is validated) whose product is the
    number of prepared features."""
    assert input_shape is not None and len(input_shape) == 3, "checked by ModelConfig"
    c, h, w = (int(v) for v in input_shape)
    if c * h * w != in_features:
        raise ValueError(
            f"model.input_shape = {list(input_shape)}: {c}·{h}·{w} = {c * h * w} values, but the "
            f"prepared records have {in_features} features"
        )
    return c, h, w


def build_cnn(spec: CnnSpec) -> nn.Sequential:
    c, h, w = spec.input_shape
    layers: list[nn.Module] = [nn.Unflatten(1, spec.input_shape)]
    for width in spec.channels:
        layers += [
            nn.Conv2d(c, width, 3, padding=1),
            nn.GroupNorm(min(spec.norm_groups, width), width),
            _ACTIVATIONS[spec.activation](),
        ]
        if h >= 2 and w >= 2:
            layers.append(nn.AvgPool2d(2))
            h, w = h // 2, w // 2
        c = width
    layers.append(nn.Flatten())
    features = c * h * w
    for width in spec.hidden:
        layers += [nn.Linear(features, width), _ACTIVATIONS[spec.activation]()]
        features = width
    layers.append(nn.Linear(features, spec.n_classes))
    return nn.Sequential(*layers)


class _WideBlock(nn.Module):
    """Pre-activation residual block: GN → ReLU → conv3×3(stride) → GN → ReLU → conv3×3, plus the input
    (through a 1×1 convolution when the width or the stride changes)."""

    def __init__(self, width_in: int, width_out: int, stride: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, width_in)
        self.conv1 = nn.Conv2d(width_in, width_out, 3, stride=stride, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, width_out)
        self.conv2 = nn.Conv2d(width_out, width_out, 3, padding=1, bias=False)
        self.shortcut = (
            nn.Conv2d(width_in, width_out, 1, stride=stride, bias=False)
            if stride != 1 or width_in != width_out
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(x))
        skip = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(torch.relu(self.norm2(out)))
        return out + skip


def build_wide_resnet(spec: WideResNetSpec) -> nn.Sequential:
    if (spec.depth - 4) % 6:
        raise ValueError(f"model.depth = {spec.depth}: a wide ResNet has depth 6n + 4 (10, 16, 22, 28, 40)")
    blocks = (spec.depth - 4) // 6
    widths = [16, 16 * spec.widen, 32 * spec.widen, 64 * spec.widen]
    layers: list[nn.Module] = [
        nn.Unflatten(1, spec.input_shape),
        nn.Conv2d(spec.input_shape[0], widths[0], 3, padding=1, bias=False),
    ]
    width = widths[0]
    for stage, stride in zip(widths[1:], (1, 2, 2), strict=True):
        for index in range(blocks):
            layers.append(_WideBlock(width, stage, stride if index == 0 else 1, spec.norm_groups))
            width = stage
    layers += [
        nn.GroupNorm(spec.norm_groups, width),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, spec.n_classes),
    ]
    return nn.Sequential(*layers)
