"""Model specs (JSON-able, stored with every model) and the one place that builds a model from one."""

from __future__ import annotations

from typing import Any

from torch import nn

from dpml.models.gated import GatedSpec, build_gated
from dpml.models.init import BiasFreeReluSpec, build_bias_free_relu
from dpml.models.lipschitz import LipschitzSpec, build_lipschitz
from dpml.models.mlp import MlpSpec, build_mlp
from dpml.models.random_features import RandomFeaturesSpec, build_random_features

ModelSpec = MlpSpec | GatedSpec | LipschitzSpec | BiasFreeReluSpec | RandomFeaturesSpec


def spec_from_dict(payload: dict[str, Any]) -> ModelSpec:
    kind = payload.get("kind", "mlp")
    if kind == "mlp":
        return MlpSpec.from_dict(payload)
    if kind == "gated":
        return GatedSpec.from_dict(payload)
    if kind == "lipschitz":
        return LipschitzSpec.from_dict(payload)
    if kind == "bias_free_relu":
        return BiasFreeReluSpec.from_dict(payload)
    if kind == "random_features":
        return RandomFeaturesSpec.from_dict(payload)
    raise ValueError(f"unknown model kind {kind!r}: expected mlp, gated, lipschitz, bias_free_relu or random_features")


def build_model(spec: ModelSpec) -> nn.Module:
    if isinstance(spec, GatedSpec):
        return build_gated(spec)
    if isinstance(spec, LipschitzSpec):
        return build_lipschitz(spec)
    if isinstance(spec, BiasFreeReluSpec):
        return build_bias_free_relu(spec)
    if isinstance(spec, RandomFeaturesSpec):
        return build_random_features(spec)
    return build_mlp(spec)
