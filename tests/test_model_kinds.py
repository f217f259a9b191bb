"""Image models as kinds (cnn, wide_resnet) and the user's own module (custom), up to the point where the
train stage refuses a module it cannot clip exactly with nothing spent."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, SHARED_FASHION, small_params, write_params
from test_clipping_check import loop_clipped_sum
from pydantic import ValidationError
from torch import nn

from dpml.config import load
from dpml.models import build_model, spec_for, spec_from_dict
from dpml.ledger.ledger import Ledger
from dpml.sections import ModelConfig
from dpml.train.clipping import clipped_gradient_sum
from dpml.train.clipping_check import plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy

USER_MODELS = textwrap.dedent('''
    import torch
    from torch import nn


    class Tied(nn.Module):
        """The output layer reads the input layer's weight through a matmul (no module call)."""

        def __init__(self, features, classes, width):
            super().__init__()
            self.inp = nn.Linear(features, width)
            self.out = nn.Linear(width, classes)

        def forward(self, x):
            h = torch.tanh(self.inp(x))
            return self.out(h) + (h @ self.inp.weight)[:, : self.out.out_features]


    class Centred(nn.Module):
        def __init__(self, features, classes):
            super().__init__()
            self.a = nn.Linear(features, classes)

        def forward(self, x):
            return self.a(x - x.mean(0))


    def tied(input_shape, n_classes, width=8):
        return Tied(input_shape[0], n_classes, width)


    def centred(input_shape, n_classes):
        return Centred(input_shape[0], n_classes)


    def batch_norm(input_shape, n_classes):
        return nn.Sequential(nn.Linear(input_shape[0], 16), nn.BatchNorm1d(16), nn.Linear(16, n_classes))


    def image(input_shape, n_classes):
        assert len(input_shape) == 3
        return nn.Sequential(nn.Conv2d(input_shape[0], 4, 3), nn.GroupNorm(2, 4), nn.Flatten(),
                             nn.Linear(4 * 6 * 6, n_classes))
''')


@pytest.fixture
def user_models(workdir: Path) -> Path:
    (workdir / "usermodels.py").write_text(USER_MODELS)
    sys.path.insert(0, str(workdir))
    yield workdir
    sys.path.remove(str(workdir))
    sys.modules.pop("usermodels", None)


@pytest.mark.parametrize("kind", ["cnn", "wide_resnet"])
def test_image_kinds_take_every_layer_by_its_shortcut_and_match_a_per_example_loop(kind: str) -> None:
    extra = (
        {"channels": [4, 8], "norm_groups": 2, "hidden": [8]}
        if kind == "cnn"
        else {"depth": 10, "widen": 1, "norm_groups": 4}
    )
    spec = spec_for(ModelConfig(kind=kind, input_shape=[1, 8, 8], **extra), 1.0, 64, 5)
    assert spec_from_dict(spec.to_dict()) == spec
    torch.manual_seed(0)
    model = build_model(spec).double()
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    plan = plan_clipping(model, per_example_cross_entropy, (64,))
    assert plan.exact_parameters == () and not plan.notes
    x = torch.rand(6, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.arange(6) % 5
    sums, norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.1)
    expected, expected_norms = loop_clipped_sum(model, x, y, 0.1)
    torch.testing.assert_close(norms, expected_norms, rtol=1e-9, atol=0)
    for n in expected:
        torch.testing.assert_close(sums[n], expected[n], rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("name", ["cnn-fashion-mnist.yaml", "wrn-fashion-mnist.yaml"])
def test_the_image_configs_validate_and_build(name: str) -> None:
    if not SHARED_FASHION.is_dir():
        pytest.skip(
            f"{name} reads Fashion-MNIST from ../shared/datasets/fashion-mnist, absent beside this checkout: "
            "the image configs were not validated"
        )
    config = load(REPO / "configs" / name)
    spec = spec_for(config.model, config.preprocess.clip_norm, 784, 10)
    assert type(build_model(spec)(torch.zeros(2, 784))) is torch.Tensor


@pytest.mark.parametrize(
    "model,message",
    [
        ({"kind": "cnn"}, r"model.input_shape = None: model.kind = 'cnn' needs \[channels, height, width\]"),
        ({"kind": "cnn", "input_shape": [1, 8, 8], "channels": [6], "norm_groups": 4}, r"6 channels do not split into"),
        (
            {"kind": "wide_resnet", "input_shape": [1, 8, 8], "depth": 12},
            r"model.depth = 12: a wide ResNet has depth 6n \+ 4",
        ),
        ({"kind": "custom"}, r"model.factory = None: give it exactly when model.kind is 'custom'"),
        ({"kind": "mlp", "factory": "usermodels:tied"}, r"model.factory = 'usermodels:tied': give it exactly when"),
        ({"kind": "custom", "factory": "usermodels.tied"}, r"give 'package.module:function'"),
        (
            {"kind": "custom", "factory": "no_such_module_here:f"},
            r"cannot import 'no_such_module_here' \(ModuleNotFoundError",
        ),
        ({"kind": "custom", "factory": "usermodels:missing"}, r"'usermodels' has no function 'missing'"),
        ({"kind": "mlp", "options": {"width": 3}}, r"model.options = \{'width': 3\}: only for model.kind: custom"),
    ],
)
def test_bad_model_settings_are_refused_naming_the_key(user_models: Path, model: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ModelConfig(**model)


def test_a_custom_factory_gets_the_input_shape_and_options(user_models: Path) -> None:
    config = ModelConfig(kind="custom", factory="usermodels:tied", options={"width": 5})
    model = build_model(spec_for(config, 1.0, 64, 10))
    assert model.inp.out_features == 5 and model.out.out_features == 10
    image = build_model(
        spec_for(ModelConfig(kind="custom", factory="usermodels:image", input_shape=[1, 8, 8]), 1.0, 64, 3)
    )
    assert image(torch.zeros(2, 64)).shape == (2, 3)  # flat rows reshaped to [1, 8, 8] before the module
    with pytest.raises(
        ValueError, match=r"model.input_shape = \[1, 4, 4\]: 16 values, but the prepared records have 64"
    ):
        build_model(spec_for(ModelConfig(kind="custom", factory="usermodels:image", input_shape=[1, 4, 4]), 1.0, 64, 3))


def train_stage(workdir: Path, path: Path, factory: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dpml", "stage", "train", "--params", str(path), "--set", f"model.factory={factory}"],
        capture_output=True,
        text=True,
        cwd=workdir,
    )


def test_the_train_stage_refuses_modules_it_cannot_clip_with_nothing_spent_and_trains_a_tied_one_exactly(
    user_models: Path,
) -> None:
    params = small_params(user_models, model={"kind": "custom", "factory": "usermodels:tied", "hidden": []})
    path = write_params(user_models / "p.yaml", params)
    for stage in ("ingest", "split", "preprocess"):
        subprocess.run(
            [sys.executable, "-m", "dpml", "stage", stage, "--params", str(path)],
            check=True,
            capture_output=True,
            cwd=user_models,
        )
    ledger, train = user_models / "ledger.db", user_models / "artifacts" / "train"
    for factory, message in [
        (
            "usermodels:centred",
            r"dpml: error: model: replacing example 0 of a probe batch changed the loss of example \d",
        ),
        (
            "usermodels:batch_norm",
            r"dpml: error: model layer '1' \(BatchNorm1d\): batch normalisation mixes .*dpml\.replace_batch_norm",
        ),
    ]:
        done = train_stage(user_models, path, factory)
        assert done.returncode == 1, done.stderr
        assert any(re.search(message, line) for line in done.stderr.splitlines()), done.stderr
        assert not ledger.exists() or Ledger(ledger, 1e-5).spends() == []  # refused before the reservation
        assert not (train / "model.pt").exists()

    done = train_stage(user_models, path, "usermodels:tied")
    assert done.returncode == 0, done.stderr
    # inp.weight reaches the loss through inp's call and through `h @ inp.weight`: inp's shortcut alone would
    # miss the second use, so the operation rules cover inp's parameters with both uses, and the plan is
    # clean: its one line is logged at INFO, none at WARNING (a note or an exact parameter would be)
    assert not [
        line
        for line in done.stderr.splitlines()
        if "per-example clipping" in line or "shortcut" in line or "exact per-example" in line
    ], done.stderr
    assert (train / "model_source.py").read_text() == USER_MODELS  # logged with the MLflow run at register
    assert yaml.safe_load((train / "metrics.json").read_text())["train_exact_clipping_parameters"] == 0
    [spend] = Ledger(ledger, 1e-5).spends()
    assert spend.mechanism is not None


TIED_PLAN = [
    "per-example clipping: 1 layer(s) by their shortcut, 2 parameter(s) by operation rules, "
    "0 parameter(s) by exact per-example autograd"
]
PLAN_IN_A_PROCESS = textwrap.dedent("""
    import json
    import dpml
    from dpml.models import build_model, spec_for
    from dpml.sections import ModelConfig
    from dpml.train.clipping_check import plan_clipping
    from dpml.train.dpsgd import per_example_cross_entropy

    model = build_model(spec_for(ModelConfig(kind="custom", factory="usermodels:tied"), 1.0, 64, 10))
    plan = plan_clipping(model, per_example_cross_entropy, (64,))
    print(json.dumps({"dpml": dpml.__file__, "lines": plan.lines(), "fast": plan.fast_layers,
                      "rules": plan.rule_parameters, "exact": plan.exact_parameters}))
""")


def test_a_dpml_subprocess_of_a_test_imports_the_dpml_under_test(tmp_path: Path) -> None:
    """A test's `python -m dpml` runs in a temporary directory: it must import this checkout's dpml, not
    another copy the interpreter finds (an editable install of another checkout), or the stage tests would
    test that copy while the in-process tests test this one (conftest.py puts this checkout first)."""
    done = subprocess.run(
        [sys.executable, "-c", "import dpml; print(dpml.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    )
    assert Path(done.stdout.strip()).resolve() == REPO / "dpml" / "__init__.py"


def test_the_tied_model_is_planned_the_same_in_every_process_with_rules_for_the_tied_weight(user_models: Path) -> None:
    """The plan of the tied model (inp.weight used by layer inp and by a matmul outside it) is the same in
    processes with different string hashing (PYTHONHASHSEED) and in this one: inp's parameters by the
    operation rules with both their uses, never by inp's shortcut alone; none exact."""
    config = ModelConfig(kind="custom", factory="usermodels:tied")
    plan = plan_clipping(build_model(spec_for(config, 1.0, 64, 10)), per_example_cross_entropy, (64,))
    here = {
        "lines": plan.lines(),
        "fast": list(plan.fast_layers),
        "rules": list(plan.rule_parameters),
        "exact": list(plan.exact_parameters),
    }
    assert here == {"lines": TIED_PLAN, "fast": ["out"], "rules": ["inp.weight", "inp.bias"], "exact": []}
    for seed in ("0", "1", "2"):
        done = subprocess.run(
            [sys.executable, "-c", PLAN_IN_A_PROCESS],
            capture_output=True,
            text=True,
            cwd=user_models,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout.strip().splitlines()[-1])
        assert Path(found.pop("dpml")).resolve() == REPO / "dpml" / "__init__.py"
        assert found == here, f"PYTHONHASHSEED={seed}"
