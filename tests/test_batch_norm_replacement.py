"""``dpml.replace_batch_norm``: a model built with batch normalisation (a ``transformers`` ResNet, built from a tiny
config with random weights, whose constructor takes no norm layer) is refused by ``dpml.train_private`` before any
budget is spent, with a pointer to the function; once converted, each BatchNorm is a GroupNorm with the same eps,
scale and shift, each example's output no longer depends on the others, and the model trains and clips exactly (a
float64 per-example loop). Layers a GroupNorm would not stand in for faithfully are refused before anything is
replaced."""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import trains_without_the_exact_path
from test_model_zoo import Logits
from test_op_rules import assert_exact_without_the_exact_path
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import dpml
from dpml.models.batch_norm import BatchNormAsGroupNorm
from dpml.ledger.ledger import Ledger
from dpml.train.dpsgd import per_example_cross_entropy

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is ever fetched from a hub: the models are built from configurations

NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _random_affine(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every norm layer's scale and shift drawn at random (as a pretrained model's would be, not 1 and 0)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine:
                module.weight.copy_(torch.rand(module.weight.shape, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(module.bias.shape, generator=generator))
    return model


def _resnet() -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra; not installed here")
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 24], depths=[1, 1], num_labels=3)
    torch.manual_seed(0)
    return _random_affine(Logits(transformers.ResNetForImageClassification(config)))


class Mixed(nn.Module):
    """BatchNorm of each dimension and kind, 48 channels (not a multiple of 32), one layer used twice, no affine."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 48, 3, padding=1)
        self.norm2d = nn.BatchNorm2d(48, eps=1e-3)
        self.shared = nn.BatchNorm1d(6)
        self.plain = nn.BatchNorm1d(6, affine=False)
        self.sync = nn.SyncBatchNorm(4)
        self.volume = nn.BatchNorm3d(4)
        self.head = nn.Linear(48, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm2d(self.conv(x)).mean((2, 3))
        h = self.shared(self.head(h))
        h = self.plain(self.shared(h))
        v = self.volume(x[:, :1, None].expand(-1, 4, 2, -1, -1))
        return h + v.mean((1, 2, 3, 4))[:, None] + self.sync(x[:, :1].expand(-1, 4, -1, -1)).mean((1, 2, 3))[:, None]


def test_each_batch_norm_becomes_a_group_norm_with_its_eps_scale_shift_and_dtype() -> None:
    model = _random_affine(Mixed()).double()
    before = copy.deepcopy(model)
    assert dpml.replace_batch_norm(model) is model
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert model.shared is model.shared and sum(1 for _ in model.modules()) == sum(1 for _ in before.modules())
    for name in ("norm2d", "shared", "plain", "sync", "volume"):
        old, new = getattr(before, name), getattr(model, name)
        channels = old.num_features
        assert type(new) is nn.GroupNorm and new.num_channels == channels, name
        groups = 1 if type(old) is nn.BatchNorm1d else math.gcd(32, channels)  # 1-D: rows have no positions
        assert new.num_groups == groups and new.eps == old.eps and new.affine == old.affine, name
        if old.affine:
            assert torch.equal(new.weight, old.weight) and torch.equal(new.bias, old.bias), name
            assert new.weight.dtype == torch.float64 and new.weight.requires_grad, name
    assert model.norm2d.num_groups == 16  # gcd(32, 48): min(32, 48) groups would not divide 48 channels
    x = torch.randn(5, 48, 4, 4, dtype=torch.float64)
    expected = F.group_norm(x, 16, before.norm2d.weight, before.norm2d.bias, eps=1e-3)
    torch.testing.assert_close(model.norm2d(x), expected, rtol=0, atol=0)


def test_after_the_replacement_no_example_moves_another_examples_output() -> None:
    """The property per-example clipping rests on: in training mode the BatchNorm model's output for example 0
    changes when example 1 does; the converted model's does not."""
    model = Mixed().double().train()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    changed = x.clone()
    changed[1] += 3.0
    assert not torch.allclose(model(x)[0], model(changed)[0])
    dpml.replace_batch_norm(model)
    torch.testing.assert_close(model(x)[0], model(changed)[0], rtol=0, atol=0)


def test_a_transformers_resnet_is_refused_for_its_batch_norm_then_trains_and_clips_exactly_once_replaced(
    tmp_path: Path,
) -> None:
    model = _resnet()
    generator = torch.Generator().manual_seed(2)
    images = torch.randn(64, 3, 16, 16, generator=generator)
    labels = torch.randint(0, 3, (64,), generator=generator)
    ledger = tmp_path / "ledger.db"
    settings = dict(ledger=str(ledger), epsilon_budget=100.0, lineage="images")
    with pytest.raises(ValueError, match=r"\(BatchNorm2d\): batch normalisation mixes .*dpml\.replace_batch_norm"):
        dpml.train_private(model, TensorDataset(images, labels), **settings, noise_multiplier=1.0, delta=1e-5)
    assert not ledger.exists() or Ledger(ledger, 1e-5).spends() == []  # refused before anything was charged
    dpml.replace_batch_norm(model)
    x, y = images[:5].double(), labels[:5]
    assert_exact_without_the_exact_path(copy.deepcopy(model).eval(), per_example_cross_entropy, x, y)
    result = trains_without_the_exact_path(model, TensorDataset(images, labels), **settings)
    assert len(Ledger(ledger, 1e-5).spends()) == 1 and result.epsilon < 100


class NormThenRelu(nn.BatchNorm2d):
    """A subclass with a forward of its own that calls its parent's: a GroupNorm in its place would drop its ReLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(super().forward(x))


class NormDropAct(nn.BatchNorm2d):
    """As timm's ``BatchNormAct2d`` writes it (timm itself is not installable beside this torch build): its own
    ``F.batch_norm`` call on its running statistics, scale and shift, a step counter, then dropout and an activation."""

    def __init__(self, channels: int, drop: float = 0.0) -> None:
        super().__init__(channels)
        self.drop, self.act = nn.Dropout(drop), nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        stats = not self.training or self.track_running_stats
        x = F.batch_norm(
            x,
            self.running_mean if stats else None,
            self.running_var if stats else None,
            self.weight,
            self.bias,
            self.training,
            self.momentum,
            self.eps,
        )
        return self.act(self.drop(x))


class NormTwice(nn.BatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(super().forward(x))


class NormOfSomethingElse(nn.BatchNorm2d):
    """Its own norm, then a batch norm of other statistics (it would mix the batch's examples)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(super().forward(x), None, None, training=True)


class NoNormAtAll(nn.BatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class SubclassNet(nn.Module):
    """Convolutions with the two subclasses in place of plain batch norms (48 channels: 16 groups of 3)."""

    def __init__(self, drop: float = 0.0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 48, 3, padding=1)
        self.first = NormThenRelu(48)
        self.mix = nn.Conv2d(48, 8, 3, padding=1)
        self.second = NormDropAct(8, drop)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.mix(self.first(self.conv(x)))).mean((2, 3)))


def test_a_subclass_keeps_its_own_forward_with_its_norm_computed_by_groups() -> None:
    """Its activation (and dropout) kept, its batch norm a group norm of its own scale and shift, each example on its
    own; the running statistics neither read nor updated; the layer's parameters are trained as before."""
    model = _random_affine(SubclassNet()).double().train()
    stats = {name: b.clone() for name, b in model.named_buffers() if "running" in name}
    before = copy.deepcopy(model)
    assert dpml.replace_batch_norm(model, groups=16) is model
    first, second = model.first, model.second
    assert isinstance(first, BatchNormAsGroupNorm) and first.layer is before_layer(before, model, "first")
    assert (first.groups, second.groups) == (16, 8)  # gcd(16, 48), gcd(16, 8)
    assert {n for n, p in model.named_parameters() if p.requires_grad} >= {"first.layer.weight", "second.layer.bias"}
    x = torch.randn(6, 48, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    expected = F.relu(F.group_norm(x, 16, first.layer.weight, first.layer.bias, first.layer.eps))
    torch.testing.assert_close(first(x), expected, rtol=0, atol=0)
    h = x[:, :8]
    torch.testing.assert_close(second(h), F.silu(F.group_norm(h, 8, second.layer.weight, second.layer.bias)))
    images = torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    changed = images.clone()
    changed[1] += 3.0
    assert not torch.allclose(before(images)[0], before(changed)[0])  # batch statistics: example 1 moved example 0
    torch.testing.assert_close(model(images)[0], model(changed)[0], rtol=0, atol=0)
    model.eval()  # evaluation normalises by the example's groups too, never by running statistics
    torch.testing.assert_close(first(x), expected, rtol=0, atol=0)
    for name, value in stats.items():
        assert torch.equal(
            dict(model.named_buffers())[name.replace("first.", "first.layer.").replace("second.", "second.layer.")],
            value,
        ), name


def before_layer(before: nn.Module, model: nn.Module, name: str) -> nn.Module:
    """The layer the replacement wraps: the model's own instance (not a copy), of the same class as before."""
    layer = getattr(model, name).layer
    assert type(layer) is type(getattr(before, name))
    return layer


def test_a_model_with_subclassed_batch_norms_trains_and_clips_exactly_once_replaced(tmp_path: Path) -> None:
    """Refused as it was built; replaced, exact against a float64 per-example loop with no parameter on the exact
    path (dropout in the subclass's forward included), then a private run charged once."""
    generator = torch.Generator().manual_seed(4)
    images = torch.randn(48, 3, 6, 6, generator=generator)
    labels = torch.randint(0, 3, (48,), generator=generator)
    ledger = tmp_path / "ledger.db"
    settings = dict(ledger=str(ledger), epsilon_budget=100.0, lineage="images")
    torch.manual_seed(0)
    model = _random_affine(SubclassNet(drop=0.25))
    with pytest.raises(ValueError, match=r"model layer 'first' \(NormThenRelu\): batch normalisation mixes"):
        dpml.train_private(model, TensorDataset(images, labels), **settings, noise_multiplier=1.0, delta=1e-5)
    dpml.replace_batch_norm(model)
    assert_exact_without_the_exact_path(
        copy.deepcopy(model).train(), per_example_cross_entropy, images[:5].double(), labels[:5]
    )
    result = trains_without_the_exact_path(model, TensorDataset(images, labels), **settings)
    assert len(Ledger(ledger, 1e-5).spends()) == 1 and result.epsilon < 100


class Excitation(nn.Module):
    """A squeeze-and-excitation gate whose batch norms see one position (as timm's SKNet and ResNeSt): the pooled
    channels normalised by a plain BatchNorm2d and by a subclass, then a gate over the 4×4 map."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 64, 3, padding=1)
        self.norm = nn.BatchNorm2d(64)
        self.squeeze = nn.Conv2d(64, 32, 1)
        self.pooled = nn.BatchNorm2d(32)
        self.excite = nn.Conv2d(32, 64, 1)
        self.gate = NormDropAct(64)
        self.head = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.conv(x))
        g = self.gate(self.excite(self.pooled(self.squeeze(h.mean((2, 3), keepdim=True)))))
        return self.head((h * torch.sigmoid(g)).mean((2, 3)))


def test_a_batch_norm_on_one_position_normalises_all_its_channels_together_once_replaced(tmp_path: Path) -> None:
    """On a map of one position a group of one number would normalise to 0 whatever the input (and torch refuses a
    batch of one): the replacement, plain or of a subclass, takes one group there and gcd(32, C) on larger maps; such
    a model, fed one record at a time too, clips exactly and trains."""
    torch.manual_seed(0)
    model = dpml.replace_batch_norm(_random_affine(Excitation()).double())
    pooled, gate, norm = model.pooled, model.gate, model.norm
    column = torch.randn(5, 32, 1, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    expected = F.group_norm(column, 1, pooled.weight, pooled.bias, pooled.eps)
    torch.testing.assert_close(pooled(column), expected, rtol=0, atol=0)
    assert expected.abs().amax() > 0.5  # (32 groups of one number would have given β alone)
    torch.testing.assert_close(pooled(column[:1]), expected[:1], rtol=0, atol=0)  # one record: no refusal
    wide = torch.randn(5, 64, 1, 1, dtype=torch.float64)
    torch.testing.assert_close(gate(wide), F.silu(F.group_norm(wide, 1, gate.layer.weight, gate.layer.bias)))
    maps = torch.randn(5, 64, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(gate(maps), F.silu(F.group_norm(maps, 32, gate.layer.weight, gate.layer.bias)))
    torch.testing.assert_close(norm(maps), F.group_norm(maps, 32, norm.weight, norm.bias), rtol=0, atol=0)
    assert pooled(torch.randn(2, 32, 4, 4, dtype=torch.float64)).shape == (2, 32, 4, 4) and pooled.num_groups == 32
    generator = torch.Generator().manual_seed(7)
    images = torch.randn(48, 3, 4, 4, generator=generator)
    labels = torch.randint(0, 3, (48,), generator=generator)
    assert_exact_without_the_exact_path(
        copy.deepcopy(model), per_example_cross_entropy, images[:5].double(), labels[:5]
    )
    trains_without_the_exact_path(model.float(), TensorDataset(images, labels), physical_batch_size=1)


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        (NormTwice(4), r"NormTwice: its forward called F.batch_norm on its own parameters 2 times"),
        (NoNormAtAll(4), r"NoNormAtAll: its forward called F.batch_norm on its own parameters 0 times"),
        (NormOfSomethingElse(4), r"NormOfSomethingElse: its forward calls F.batch_norm on tensors other than its own"),
    ],
)
def test_a_subclass_whose_norm_is_not_one_call_on_its_own_tensors_is_refused_before_any_budget(
    layer: nn.Module, message: str, tmp_path: Path
) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), layer, nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(2, 3, 6, 6))  # (the lazy head given its input)
    dpml.replace_batch_norm(model)
    with pytest.raises(RuntimeError, match=message):
        model(torch.randn(2, 3, 6, 6))
    generator = torch.Generator().manual_seed(5)
    dataset = TensorDataset(
        torch.randn(32, 3, 6, 6, generator=generator), torch.randint(0, 3, (32,), generator=generator)
    )
    ledger = tmp_path / "ledger.db"
    with pytest.raises(RuntimeError, match=message):
        dpml.train_private(
            model, dataset, noise_multiplier=1.0, delta=1e-5, ledger=str(ledger), epsilon_budget=10.0, lineage="images"
        )
    assert not ledger.exists() or Ledger(ledger, 1e-5).spends() == []


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        (nn.LazyBatchNorm2d(), r"model layer 'odd' \(LazyBatchNorm2d\): its channel count is not known"),
        ("hooked", r"model layer 'odd' \(BatchNorm2d\) has hooks registered on it"),
    ],
)
def test_a_layer_a_group_norm_would_not_stand_in_for_is_refused_before_anything_is_replaced(
    layer: nn.Module | str, message: str
) -> None:
    if layer == "hooked":
        layer = nn.BatchNorm2d(8)
        layer.register_forward_hook(lambda module, args, output: output * 2)
    model = nn.Sequential()
    model.add_module("first", nn.BatchNorm2d(8))
    model.add_module("odd", layer)
    with pytest.raises(ValueError, match=message):
        dpml.replace_batch_norm(model)
    assert type(model.first) is nn.BatchNorm2d  # nothing replaced: a refused model is left as it was


@pytest.mark.parametrize("groups", [0, -4, 2.5, True, "32"])
def test_groups_other_than_a_positive_integer_are_refused_naming_the_value(groups: object) -> None:
    with pytest.raises(ValueError, match=rf"groups: {groups!r} is not allowed; a positive integer"):
        dpml.replace_batch_norm(nn.Sequential(nn.BatchNorm1d(4)), groups=groups)  # type: ignore[arg-type]


def test_a_model_that_is_one_batch_norm_layer_comes_back_as_its_group_norm() -> None:
    replaced = dpml.replace_batch_norm(nn.BatchNorm2d(12), groups=8)
    assert type(replaced) is nn.GroupNorm and replaced.num_groups == 4 and replaced.num_channels == 12


@pytest.mark.parametrize("channels", [16, 64])
def test_a_batch_norm_on_rows_still_passes_its_inputs_on(channels: int) -> None:
    """A BatchNorm1d fed (B, C) rows (an MLP's features, LeViT's flattened tokens): in groups of C / 32 channels the
    rows would normalise to 0 (one channel a group) or ±1 (two) whatever the input; over all C they do not."""
    layer = dpml.replace_batch_norm(nn.BatchNorm1d(channels))
    rows = torch.randn(8, channels, generator=torch.Generator().manual_seed(5))
    out = layer(rows)
    assert out.abs().max() > 1.05 and out.std(0).min() > 0.1  # neither 0 nor ±1: the inputs' differences kept
    torch.testing.assert_close(out, F.layer_norm(rows, (channels,), eps=layer.eps))


def _converted(family: str) -> tuple[nn.Module, int]:
    """A ``transformers`` image classifier built with BatchNorm (a tiny config, random weights, random affine),
    converted; with its image size."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra; not installed here")
    torch.manual_seed(0)
    if family == "levit":  # BatchNorm1d on tokens flattened to (B·N, C), BatchNorm2d in its convolutional stem
        config = transformers.LevitConfig(image_size=64, patch_size=16, hidden_sizes=[32, 48, 64], depths=[1, 1, 1])
        config.update(dict(num_attention_heads=[1, 2, 2], key_dim=[8, 8, 8], num_labels=3))
        model, size = transformers.LevitForImageClassification(config), 64
    elif family == "mobilevit":  # depthwise convolutions, a transformer on unfolded patches
        config = transformers.MobileViTConfig(image_size=64, patch_size=2, hidden_sizes=[16, 16, 16], num_labels=3)
        config.neck_hidden_sizes = [8, 8, 16, 16, 16, 16, 32]  # (64 pixels: its last maps 2 × 2, not 1 × 1)
        model, size = transformers.MobileViTForImageClassification(config), 64
    else:  # regnet: grouped convolutions, squeeze-and-excitation
        config = transformers.RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
        config.update(dict(groups_width=8, layer_type="y"))
        model, size = transformers.RegNetForImageClassification(config), 16
    return dpml.replace_batch_norm(Logits(_random_affine(model))), size


@pytest.mark.parametrize("family", ["levit", "mobilevit", "regnet"])
def test_converted_image_models_of_transformers_clip_exactly_without_the_exact_path(family: str) -> None:
    model, size = _converted(family)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    x = torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    y = torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(7))
    # MobileViT's last LayerNorm bias has a gradient 0 up to rounding (5e-19 of the whole gradient: the
    # normalisation after it takes out a shift), so its error is judged against 1e-9 of the whole, not its own
    tolerance = 1e-9 if family == "mobilevit" else 1e-10
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, y, tolerance=tolerance)
