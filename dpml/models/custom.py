"""The user's own ``nn.Module``: ``model.kind: custom``, ``model.factory: package.module:function``.

The function is called as ``function(input_shape, n_classes, **model.options)`` and returns the
module. ``input_shape`` is ``model.input_shape`` when given (the flat prepared rows are reshaped to it
before the module sees them), else ``(in_features,)``. The module is looked up on the Python path,
with the working directory first (a ``models.py`` beside ``params.yaml`` works without installing
it). A module from a library (``transformers``, ``peft``) goes in unchanged: an output object with ``.logits``
and a forward taking ``input_ids``/``attention_mask`` are adapted once here (:mod:`dpml.models.library`).
Before any ε is spent the pipeline refuses BatchNorm and checks the clipping engine on the module
(:mod:`dpml.train.clipping_check`); the module's source file is logged with the MLflow run.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpml.models.library import adapt, check_input_kind, eager

FACTORY_FORMAT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class CustomSpec:
    in_features: int
    factory: str
    n_classes: int
    input_shape: tuple[int, ...] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    inputs: str = "auto"

    def to_dict(self) -> dict:
        return {
            "kind": "custom",
            "in_features": self.in_features,
            "factory": self.factory,
            "n_classes": self.n_classes,
            "input_shape": None if self.input_shape is None else list(self.input_shape),
            "options": dict(self.options),
            "inputs": self.inputs,
        }

    @classmethod
    def from_dict(cls, payload: dict) -> "CustomSpec":
        shape = payload.get("input_shape")
        return cls(
            int(payload["in_features"]),
            str(payload["factory"]),
            int(payload["n_classes"]),
            None if shape is None else tuple(int(v) for v in shape),
            dict(payload.get("options") or {}),
            str(payload.get("inputs", "auto")),
        )


def load_factory(factory: str) -> Callable[..., nn.Module]:
    """The function ``factory`` names, or a ValueError naming ``model.factory`` and what went wrong."""
    if not FACTORY_FORMAT.match(factory):
        raise ValueError(f"model.factory = {factory!r}: give 'package.module:function'")
    module_name, function_name = factory.split(":")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ValueError(
            f"model.factory = {factory!r}: cannot import {module_name!r} ({type(error).__name__}: {error})"
        ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"model.factory = {factory!r}: {module_name!r} has no function {function_name!r}")
    return function  # type: ignore[no-any-return]


def factory_source(factory: str) -> Path | None:
    """The source file of the factory's module (logged with the run), when there is one."""
    try:
        source = inspect.getsourcefile(load_factory(factory))
    except (TypeError, ValueError):
        return None
    return None if source is None else Path(source)


class Reshaped(nn.Module):
    """The user's module behind a reshape of the flat prepared rows to ``input_shape``."""

    def __init__(self, net: nn.Module, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.input_shape = tuple(input_shape)
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(x.shape[0], *self.input_shape))


def build_custom(spec: CustomSpec) -> nn.Module:
    shape = spec.input_shape or (spec.in_features,)
    count = math.prod(shape)
    if count != spec.in_features:
        raise ValueError(
            f"model.input_shape = {list(shape)}: {count} values, but the prepared records have "
            f"{spec.in_features} features"
        )
    factory = load_factory(spec.factory)
    try:
        net = factory(tuple(shape), spec.n_classes, **spec.options)
    except Exception as error:
        raise ValueError(
            f"model.factory = {spec.factory!r}: calling it with input_shape={tuple(shape)}, "
            f"n_classes={spec.n_classes}, options {spec.options} failed: {type(error).__name__}: {error}"
        ) from None
    if not isinstance(net, nn.Module):
        raise ValueError(f"model.factory = {spec.factory!r}: returned a {type(net).__name__}, not a torch.nn.Module")
    net = eager(net)  # a torch.compile wrapper: the module it compiled
    if check_input_kind(spec.inputs, net, "model.inputs"):  # token inputs: the adapter reads the flat [ids…, mask…]
        return adapt(net, tuple(shape), inputs="tokens")
    net = adapt(net, tuple(shape), inputs="tensor", key="model.inputs")  # a library's output object → logits
    return net if spec.input_shape is None or len(shape) == 1 else Reshaped(net, shape)
