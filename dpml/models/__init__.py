"""Model specs (JSON-able, stored with every model) and the one place that builds a model from one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from dpml.models.gated import GatedSpec, build_gated
from dpml.models.init import BiasFreeReluSpec, build_bias_free_relu
from dpml.models.lipschitz import LipschitzSpec, build_lipschitz
from dpml.models.mlp import MlpSpec, build_mlp
from dpml.models.random_features import RandomFeaturesSpec, build_random_features

if TYPE_CHECKING:
    from dpml.sections import ModelConfig

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


def spec_for(model: "ModelConfig", input_bound: float, in_features: int, n_classes: int,
             linearised: bool = False) -> ModelSpec:
    """The spec of the configured model kind for ``in_features`` inputs and ``n_classes`` outputs.

    ``input_bound`` is X0 (``preprocess.clip_norm``), which the Lipschitz network's input layer enforces;
    ``linearised`` asks for the bias-free ReLU network's first-order expansion (noisy GD's certificate).
    """
    if model.kind == "gated":
        return GatedSpec(in_features, model.gates, n_classes, model.gate_seed)
    if model.kind == "lipschitz":
        shape = model.input_shape
        return LipschitzSpec(in_features, tuple(model.hidden), n_classes, input_bound, model.bias_bound,
                             conv=tuple(model.conv), input_shape=None if shape is None else (shape[0], shape[1], shape[2]),
                             dense_layer=model.dense_layer)
    if model.kind == "random_features":
        return RandomFeaturesSpec(in_features, model.features, n_classes, model.feature_activation, model.feature_seed)
    if model.kind == "bias_free_relu":
        return BiasFreeReluSpec(in_features, tuple(model.hidden), n_classes, model.init, linearised)  # type: ignore[arg-type]
    return MlpSpec(in_features, tuple(model.hidden), n_classes, model.activation)
