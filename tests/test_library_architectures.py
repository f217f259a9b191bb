"""Architectures from ``transformers`` that once failed the plan, built from tiny configurations with random weights
(never from a hub), through the public planning path: Mamba, whose logits come back in float32 whatever its
parameters' dtype (the probe's clip factors once took the loss's dtype and clashed with the parameters'); RecurrentGemma
after a forward pass, which leaves its recurrent states on its modules with a graph attached (``copy.deepcopy`` refused
them); Perceiver, whose learned latents are expanded over the batch before they meet it (their parameters, and those
of the layers between, once took the exact path). Each is planned with no parameter on the exact path, and Perceiver's
clipped sums equal a float64 per-example loop. Skipped, saying why, where ``transformers`` is not installed (a test
extra pinned in requirements-models.lock)."""

from __future__ import annotations

import torch
from test_library_models import LENGTH, VOCABULARY, tiny_mixtral, transformers_module  # (sets HF_HUB_OFFLINE)
from test_op_rules import assert_exact_without_the_exact_path
from torch import nn

from dpml.models.library import LibraryModel
from dpml.train.clipping_check import plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy

BATCH, CLASSES = 4, 3


class LastToken(nn.Module):
    """A causal language model's next-token logits at the last position, (B, vocabulary)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits[:, -1]


class Classified(nn.Module):
    """A sequence classifier's logits from its ``inputs`` (Perceiver's name for the token ids), (B, classes)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(inputs=ids).logits


def token_batch(classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, VOCABULARY, (BATCH, LENGTH), generator=g), torch.randint(0, classes, (BATCH,), generator=g)


def test_a_mamba_language_model_returning_float32_logits_is_planned_in_float64() -> None:
    transformers = transformers_module()
    torch.manual_seed(0)
    config = transformers.MambaConfig(
        vocab_size=VOCABULARY,
        hidden_size=16,
        state_size=4,
        num_hidden_layers=1,
        expand=2,
        conv_kernel=4,
        time_step_rank=4,
        use_mambapy=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LastToken(transformers.MambaForCausalLM(config)).double()
    ids, _ = token_batch(VOCABULARY)
    assert model(ids).dtype == torch.float32  # the model's own cast, whatever its parameters' dtype
    plan = plan_clipping(model, per_example_cross_entropy, (LENGTH,), ids.dtype)
    assert plan.exact_parameters == ()


def test_a_recurrent_gemma_after_a_forward_pass_of_its_own_is_planned() -> None:
    transformers = transformers_module()
    torch.manual_seed(0)
    config = transformers.RecurrentGemmaConfig(
        vocab_size=VOCABULARY,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        lru_width=16,
        attention_window_size=4,
        conv1d_width=4,
        block_types=["recurrent", "attention"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LastToken(transformers.RecurrentGemmaForCausalLM(config))
    ids, labels = token_batch(VOCABULARY)
    per_example_cross_entropy(model(ids), labels).sum()  # the user's own pass: states with a graph left on modules
    held = [t for m in model.modules() for t in vars(m).values() if isinstance(t, torch.Tensor) and not t.is_leaf]
    assert held  # what copy.deepcopy refuses
    plan = plan_clipping(model, per_example_cross_entropy, (LENGTH,), ids.dtype)
    assert plan.exact_parameters == ()
    assert all(
        t is u
        for t, u in zip(
            held,
            [t for m in model.modules() for t in vars(m).values() if isinstance(t, torch.Tensor) and not t.is_leaf],
            strict=True,
        )
    )


def test_perceiver_latents_expanded_over_the_batch_are_clipped_without_the_exact_path() -> None:
    transformers = transformers_module()
    torch.manual_seed(0)
    config = transformers.PerceiverConfig(
        num_latents=4,
        d_latents=16,
        d_model=16,
        num_blocks=1,
        num_self_attends_per_block=1,
        num_self_attention_heads=2,
        num_cross_attention_heads=1,
        vocab_size=VOCABULARY,
        max_position_embeddings=LENGTH,
        num_labels=CLASSES,
        attention_probs_dropout_prob=0.0,
    )
    model = Classified(transformers.PerceiverForSequenceClassification(config))
    ids, labels = token_batch(CLASSES)
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, ids, labels)


def test_mixtral_with_batched_product_experts_is_clipped_without_the_exact_path() -> None:
    """transformers' ``experts_implementation="batched_mm"``: each token's expert matrices gathered per row,
    ``gate_up_proj[expert_ids]``, multiplied row by row with ``torch.bmm`` (the parameter once took the exact path,
    and the down projection's rows lost their examples)."""
    transformers_module()
    model = LibraryModel(tiny_mixtral(CLASSES, experts_implementation="batched_mm"), tokens=True, vocabulary=VOCABULARY)
    ids, labels = token_batch(CLASSES)
    tokens = torch.stack([ids, torch.ones_like(ids)], 1)  # (B, 2, T): ids and a mask keeping every one
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, tokens, labels)
