"""A module wrapped by ``torch.compile`` goes in as the module it compiled: through ``dpml.train_private`` (tensor and
token inputs: the wrapper's ``forward(*args, **kwargs)`` hides the module's ``input_ids`` and ``attention_mask``) and
through the pipeline's ``model.kind: custom`` factory. The clipping engine runs the module eagerly — its hooks and
torch function mode see the operations a compiled graph fuses — on the wrapper's own parameters, so the wrapper the
user holds is the model trained. Before, the probe refused it with TorchDynamo's own error on its second backward."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is ever fetched from a hub: the models are built from configurations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from conftest import trains_without_the_exact_path
from dpml.models.library import eager


def test_a_compiled_module_trains_through_train_private_as_the_module_it_compiled() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    compiled = torch.compile(net)
    assert eager(compiled) is net and eager(net) is net
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(96, 6, generator=generator)
    trains_without_the_exact_path(compiled, TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()))


def test_a_compiled_transformers_classifier_takes_its_token_inputs() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra; not installed here")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
        pad_token_id=0,
    )
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 30, (64, 8), generator=generator)
    mask = (torch.arange(8)[None] < torch.randint(2, 9, (64, 1), generator=generator)).long()
    trains_without_the_exact_path(
        torch.compile(transformers.BertForSequenceClassification(config)),
        TensorDataset(ids * mask, mask, ids[:, 0] % 2),
    )


COMPILED_FACTORY = textwrap.dedent("""
    import torch
    from torch import nn


    def compiled(input_shape, n_classes):
        return torch.compile(nn.Sequential(nn.Linear(input_shape[0], 8), nn.Tanh(), nn.Linear(8, n_classes)))
""")


def test_a_custom_factory_s_compiled_module_is_built_as_the_module_it_compiled(workdir: Path) -> None:
    """The pipeline builds the model again from its factory (the register stage, ``dpml reproduce``): each build is the
    eager module, with the same state-dict keys (no ``_orig_mod.``), whatever the factory returns."""
    from dpml.models import build_model, spec_for, spec_from_dict
    from dpml.sections import ModelConfig

    (workdir / "compiledmodels.py").write_text(COMPILED_FACTORY)  # (the factory loader imports from the cwd)
    try:
        spec = spec_for(ModelConfig(kind="custom", factory="compiledmodels:compiled"), 1.0, 4, 3)
        model = build_model(spec)
        assert isinstance(model, nn.Sequential)
        assert set(model.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        rebuilt = build_model(spec_from_dict(spec.to_dict()))
        rebuilt.load_state_dict(model.state_dict())
        x = torch.randn(5, 4)
        assert torch.equal(rebuilt(x), model(x))
    finally:
        sys.modules.pop("compiledmodels", None)
