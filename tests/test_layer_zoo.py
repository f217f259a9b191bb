"""The benchmark of torch's own layers (``benchmarks/layer_zoo.py``) builds what it names, and at the benchmark's
batch of 64 no layer's parameter takes the exact path: the plan (the probe's check against per-example autograd)
sends none there, and neither does the pass at 64 examples, where a rule that formed every example's gradient would
pass the keep limit (``nn.Bilinear(128, 128, 128)`` on pooled vectors: 64 · 128³ numbers, which took the exact path
at run time before its norms came from Gram matrices). Small widths but the layers' own kinds; a few seconds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dpml.train.clipping import engine_pass
from dpml.train.clipping_check import plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from layer_zoo import LAYER_CLASSES, LAYER_FEATURES, LAYER_ZOO, build_layer  # noqa: E402

SIZE = {"hidden": 16, "layers": 1, "heads": 2, "ffn": 32}


@pytest.mark.parametrize("family", LAYER_ZOO)
def test_each_layer_of_the_benchmark_plans_nothing_onto_the_exact_path(family: str) -> None:
    torch.manual_seed(0)
    model, description = build_layer(family, SIZE, LAYER_CLASSES)
    assert description
    x = torch.randn(4, 8, LAYER_FEATURES, generator=torch.Generator().manual_seed(1))
    assert model(x).shape == (4, LAYER_CLASSES)
    plan = plan_clipping(model, per_example_cross_entropy, tuple(x.shape[1:]))
    assert plan.exact_parameters == () and plan.exact == frozenset(), plan.lines()


def test_a_pooled_bilinear_form_past_the_keep_limit_takes_no_exact_path_at_the_benchmarks_batch() -> None:
    torch.manual_seed(0)
    model, _ = build_layer("layer-bilinear-pooled", {**SIZE, "hidden": 128}, LAYER_CLASSES)
    x = torch.randn(64, 4, LAYER_FEATURES, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, LAYER_CLASSES, (64,), generator=torch.Generator().manual_seed(3))
    found = engine_pass(model, per_example_cross_entropy, x, y)
    assert found.exact == {}, found.reasons
