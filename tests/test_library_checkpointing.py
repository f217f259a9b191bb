"""``transformers`` models with gradient checkpointing switched on, as users switch it on to save memory
(``model.activation_checkpointing_enable()``, formerly ``gradient_checkpointing_enable``): each block's forward pass
runs again inside the backward pass.

Non-reentrant checkpointing (``transformers``' default) trains exactly: clipped sums and norms equal a float64
per-example loop, dropout on (the recomputation replays the block's random state), nothing on the exact path.
Reentrant checkpointing (``use_reentrant=True``, the default of older ``transformers``) backpropagates into the
parameters' ``.grad`` from inside the backward pass, which per-example gradients by ``torch.autograd.grad`` cannot
run: it is refused before any ε is charged, saying to switch it to non-reentrant. Skipped, saying why, where
``transformers`` is not installed (a test extra pinned in requirements-models.lock).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import refused_before_any_charge
from test_library_models import LENGTH, VOCABULARY, tiny_bert, tiny_gpt2
from test_op_rules import assert_exact_without_the_exact_path
from torch import nn
from torch.utils.data import TensorDataset

from dpml.models.library import LibraryModel
from dpml.train.dpsgd import per_example_cross_entropy

BUILDERS = {"bert": tiny_bert, "gpt2": tiny_gpt2}


def checkpointed(kind: str, reentrant: bool) -> nn.Module:
    net = BUILDERS[kind](3, 0)
    net.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    return net.train()


def token_batch(count: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids from 2 up, every other record padded (id 0, mask 0) after its first 5 tokens, and 3 classes."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCABULARY, (count, LENGTH), generator=g)
    mask = torch.ones(count, LENGTH, dtype=torch.long)
    mask[::2, 5:] = 0
    ids[mask == 0] = 0
    return ids, mask, torch.randint(0, 3, (count,), generator=g)


def blocks_run_per_pass(net: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> int:
    """How often the first attention block's forward runs in one training forward and backward pass."""
    first = next(m for name, m in net.named_modules() if name.endswith(("attention", "attn")))
    calls = []
    handle = first.register_forward_hook(lambda *_: calls.append(1))
    try:
        net(input_ids=ids, attention_mask=mask).logits.sum().backward()
    finally:
        handle.remove()
    net.zero_grad(set_to_none=True)
    return len(calls)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_non_reentrant_checkpointing_clips_exactly_with_nothing_on_the_exact_path(kind: str) -> None:
    net = checkpointed(kind, reentrant=False)
    ids, mask, labels = token_batch(6)
    assert blocks_run_per_pass(net, ids, mask) == 2  # the block runs again in the backward pass: checkpointing is on
    model = LibraryModel(net, tokens=True, vocabulary=VOCABULARY)
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, torch.stack([ids, mask], 1), labels)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_reentrant_checkpointing_is_refused_before_anything_is_charged(kind: str, tmp_path: Path) -> None:
    net = checkpointed(kind, reentrant=True)
    ids, mask, labels = token_batch(40)
    assert blocks_run_per_pass(net, ids, mask) == 2
    refused_before_any_charge(tmp_path / "ledger.db", net, TensorDataset(ids, mask, labels), "use_reentrant=False")
