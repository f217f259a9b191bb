"""Model specs (JSON-able, stored with every model) and the one place that builds a model from one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from dpml.models.custom import CustomSpec, build_custom
from dpml.models.gated import GatedSpec, build_gated
from dpml.models.init import BiasFreeReluSpec, build_bias_free_relu
from dpml.models.lipschitz import LipschitzSpec, build_lipschitz
from dpml.models.mlp import MlpSpec, build_mlp
from dpml.models.random_features import RandomFeaturesSpec, build_random_features
from dpml.models.vision import CnnSpec, WideResNetSpec, build_cnn, build_wide_resnet, check_input_shape

if TYPE_CHECKING:
    from dpml.sections import ModelConfig

ModelSpec = (
    MlpSpec | GatedSpec | LipschitzSpec | BiasFreeReluSpec | RandomFeaturesSpec | CnnSpec | WideResNetSpec | CustomSpec
)
SPECS: dict[str, Any] = {
    "mlp": MlpSpec,
    "gated": GatedSpec,
    "lipschitz": LipschitzSpec,
    "bias_free_relu": BiasFreeReluSpec,
    "random_features": RandomFeaturesSpec,
    "cnn": CnnSpec,
    "wide_resnet": WideResNetSpec,
    "custom": CustomSpec,
}
BUILDERS: dict[type, Any] = {
    MlpSpec: build_mlp,
    GatedSpec: build_gated,
    LipschitzSpec: build_lipschitz,
    BiasFreeReluSpec: build_bias_free_relu,
    RandomFeaturesSpec: build_random_features,
    CnnSpec: build_cnn,
    WideResNetSpec: build_wide_resnet,
    CustomSpec: build_custom,
}


def spec_from_dict(payload: dict[str, Any]) -> ModelSpec:
    kind = payload.get("kind", "mlp")
    if kind not in SPECS:
        raise ValueError(f"unknown model kind {kind!r}: expected one of {', '.join(SPECS)}")
    return SPECS[kind].from_dict(payload)  # type: ignore[no-any-return]


def build_model(spec: ModelSpec) -> nn.Module:
    return BUILDERS[type(spec)](spec)  # type: ignore[no-any-return]


def spec_for(
    model: "ModelConfig", input_bound: float, in_features: int, n_classes: int, linearised: bool = False
) -> ModelSpec:
    """The spec of the configured model kind for ``in_features`` inputs and ``n_classes`` outputs.

    ``input_bound`` is X0 (``preprocess.clip_norm``), which the Lipschitz network's input layer enforces;
    ``linearised`` asks for the bias-free ReLU network's first-order expansion (noisy GD's certificate).
    """
    if model.kind == "gated":
        return GatedSpec(in_features, model.gates, n_classes, model.gate_seed)
    if model.kind == "lipschitz":
        shape = model.input_shape
        return LipschitzSpec(
            in_features,
            tuple(model.hidden),
            n_classes,
            input_bound,
            model.bias_bound,
            conv=tuple(model.conv),
            input_shape=None if shape is None else (shape[0], shape[1], shape[2]),
            dense_layer=model.dense_layer,
        )
    if model.kind == "random_features":
        return RandomFeaturesSpec(in_features, model.features, n_classes, model.feature_activation, model.feature_seed)
    if model.kind == "cnn":
        return CnnSpec(
            in_features,
            check_input_shape(_shape(model), in_features),
            tuple(model.channels),
            tuple(model.hidden),
            n_classes,
            model.norm_groups,
            model.activation,
        )
    if model.kind == "wide_resnet":
        return WideResNetSpec(
            in_features,
            check_input_shape(_shape(model), in_features),
            n_classes,
            model.depth,
            model.widen,
            model.norm_groups,
        )
    if model.kind == "custom":
        assert model.factory is not None  # checked when the configuration was validated
        return CustomSpec(in_features, model.factory, n_classes, _shape(model), dict(model.options), model.inputs)
    if model.kind == "bias_free_relu":
        return BiasFreeReluSpec(in_features, tuple(model.hidden), n_classes, model.init, linearised)  # type: ignore[arg-type]
    return MlpSpec(in_features, tuple(model.hidden), n_classes, model.activation)


def _shape(model: "ModelConfig") -> tuple[int, ...] | None:
    return None if model.input_shape is None else tuple(int(v) for v in model.input_shape)
