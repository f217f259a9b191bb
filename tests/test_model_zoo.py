"""The operation rules on model families nobody here wrote, built from ``transformers``' configs at tiny sizes with
random weights: every parameter's clipped per-example gradient sum and every norm equal a float64 per-example
autograd loop, and none takes the exact path (the plan's probe agrees). Text classifiers on right-padded tokens,
image classifiers on random images, and ``peft``'s adapters on a frozen body (the plan's probe runs them in training
mode, dropout drawn). About a quarter of a second a model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from test_op_rules import HuggingFace, assert_exact_without_the_exact_path, ids_and_mask
from torch import nn

from dpml.train.clipping_check import plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy

TEXT = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
TEXT |= dict(max_position_embeddings=32, num_labels=3, pad_token_id=0, attn_implementation="eager")
ONE_KV_HEAD = {"num_key_value_heads": 1}
SEQ2SEQ = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2)
SEQ2SEQ |= dict(encoder_ffn_dim=32, decoder_ffn_dim=32, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2)

TEXT_FAMILIES: dict[str, dict[str, Any]] = {
    "bert": {},
    "gpt2": {"bos_token_id": 1, "eos_token_id": 1},
    "llama": ONE_KV_HEAD,
    "distilbert": {},
    "roberta": {},
    "albert": {"embedding_size": 8},  # factorised embeddings, one layer's weights shared by every layer
    "electra": {"embedding_size": 8},
    "deberta": {"relative_attention": True, "pos_att_type": ["p2c", "c2p"], "max_relative_positions": 8},
    "deberta-v2": {
        "relative_attention": True,
        "pos_att_type": ["p2c", "c2p"],
        "max_relative_positions": 8,
        "position_buckets": 4,
        "position_biased_input": False,
    },
    "mpnet": {},
    "squeezebert": dict(embedding_size=16, q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2)
    | dict(intermediate_groups=2, output_groups=2),  # grouped 1-D convolutions
    "convbert": {"embedding_size": 16, "head_ratio": 1, "conv_kernel_size": 3},  # depthwise span convolutions
    "mobilebert": dict(embedding_size=16, intra_bottleneck_size=8, true_hidden_size=8, num_feedforward_networks=1),
    "big_bird": {"attention_type": "original_full"},
    "roformer": {},  # rotary positions
    "rembert": {},
    "megatron-bert": {},
    "opt": {},
    "biogpt": {},
    "bloom": {"bos_token_id": 1, "eos_token_id": 1},  # ALiBi
    "falcon": {"multi_query": True, "new_decoder_architecture": False, "bos_token_id": 1, "eos_token_id": 1},
    "gpt_neox": {"rotary_pct": 0.5},
    "gptj": {"rotary_dim": 4, "bos_token_id": 1, "eos_token_id": 1},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2, "window_size": 4},
    "gpt_bigcode": {"multi_query": True, "bos_token_id": 1, "eos_token_id": 1},
    "mpt": {"d_model": 16, "n_heads": 2, "n_layers": 2, "expansion_ratio": 2, "max_seq_len": 32},
    "ctrl": {},
    "phi": {"partial_rotary_factor": 0.5},
    "phi3": ONE_KV_HEAD,
    "qwen2": ONE_KV_HEAD,
    "qwen3": ONE_KV_HEAD | {"head_dim": 8},
    "stablelm": ONE_KV_HEAD,
    "olmo2": {},
    "gemma": ONE_KV_HEAD | {"head_dim": 8},
    "mistral": ONE_KV_HEAD | {"sliding_window": 16},
    "gemma2": ONE_KV_HEAD | {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 16},
    "modernbert": {"global_attn_every_n_layers": 2, "local_attention": 16},
    "longformer": {"attention_window": 4},  # each example's global tokens written into zeros made for them
    "bart": SEQ2SEQ,
    "mbart": SEQ2SEQ,
    "fnet": {},  # token mixing by a 2-D Fourier transform, no attention
    "nystromformer": {},  # attention through landmarks (segment means) and a pseudo-inverse
    "yoso": {},  # attention by hashing's collision probabilities
    "esm": {},  # rotary positions, token dropout rescaling the embeddings by each sequence's mask
    "xlm": {},  # sinusoidal positions, language embeddings
    "diffllama": {},  # differential attention: two softmaxes subtracted with a learned λ
    "persimmon": {},  # query and key LayerNorms
    "starcoder2": {},
    "glm": {},  # partial rotary positions, interleaved
    "modernbert-decoder": {},
    "eurobert": {},
    "doge": {},  # dynamic mask attention, a learned gate per head
    "olmo3": {},
    "helium": ONE_KV_HEAD | {"head_dim": 8},
    "smollm3": ONE_KV_HEAD | {"head_dim": 8},  # no rotary positions in every fourth layer
    "exaone4": ONE_KV_HEAD | {"head_dim": 8},
    "nemotron": ONE_KV_HEAD | {"head_dim": 8, "partial_rotary_factor": 0.5},  # squared-ReLU MLP, LayerNorm1P
}
FLOAT32_INSIDE = {"gemma", "gemma2", "helium"}  # RMSNorm in float32 whatever the model's dtype: float32 rounding
ENDS_WITH_EOS = {"bart", "mbart"}  # classify at the <eos> token: every sequence ends with one

PATCHES = dict(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
PATCHES |= dict(intermediate_size=32, num_labels=3)
STAGES = dict(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
PYRAMID = STAGES | dict(num_encoder_blocks=2, sr_ratios=[2, 1], num_attention_heads=[1, 2], patch_sizes=[3, 3])
PYRAMID |= dict(strides=[2, 2], mlp_ratios=[2, 2])
IMAGE_FAMILIES: dict[str, dict[str, Any]] = {
    "vit_msn": PATCHES,
    "beit": PATCHES | {"use_relative_position_bias": True, "use_mean_pooling": True, "layer_scale_init_value": 0.1},
    "data2vec-vision": PATCHES | {"use_relative_position_bias": True},
    "dinov2": {k: v for k, v in PATCHES.items() if k != "intermediate_size"}
    | {"mlp_ratio": 2, "layerscale_value": 0.5},
    "swinv2": dict(image_size=16, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=4)
    | {"num_labels": 3},
    "focalnet": dict(image_size=16, patch_size=2, embed_dim=8, depths=[1, 1], focal_levels=[2, 2])
    | dict(focal_windows=[3, 3], num_labels=3),
    "convnext": STAGES | {"num_stages": 2, "patch_size": 2},
    "convnextv2": STAGES | {"num_stages": 2, "patch_size": 2},  # global response normalisation
    "poolformer": STAGES | dict(patch_sizes=[3, 3], strides=[2, 2], padding=[1, 1], num_encoder_blocks=2),
    "segformer": PYRAMID,
    "pvt_v2": PYRAMID,
}


def _text_model(family: str) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra; not installed here")
    return _text_model_from(transformers.AutoConfig.for_model(family, **(TEXT | TEXT_FAMILIES[family])))


def _text_model_from(config: Any) -> nn.Module:
    import transformers

    return transformers.AutoModelForSequenceClassification.from_config(config)


def _labels(count: int) -> torch.Tensor:
    return torch.randint(0, 3, (count,), generator=torch.Generator().manual_seed(1))


def _tokens(family: str) -> torch.Tensor:
    x = ids_and_mask(5, 9, 40, 0, 12)
    if family in ENDS_WITH_EOS:  # no padding; 2 (<eos>) last
        x[:, 1] = 1
        x[:, 0] = x[:, 0].clamp(min=3)
        x[:, 0, -1] = 2
    return x


@pytest.mark.parametrize("family", sorted(TEXT_FAMILIES))
def test_a_text_classifier_of_each_family_clips_exactly_without_the_exact_path(family: str) -> None:
    torch.manual_seed(0)
    model = HuggingFace(_text_model(family).eval())
    tolerance = 1e-6 if family in FLOAT32_INSIDE else 1e-10
    y = torch.randint(0, 3, (5,), generator=torch.Generator().manual_seed(1))
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, _tokens(family), y, tolerance=tolerance)


class Logits(nn.Module):
    """A ``transformers`` model on one tensor (``pixel_values``, or the input named ``key``); returns ``.logits``."""

    def __init__(self, model: nn.Module, key: str = "pixel_values") -> None:
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.key: x}).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", sorted(IMAGE_FAMILIES))
def test_an_image_classifier_of_each_family_clips_exactly_without_the_exact_path(family: str) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra; not installed here")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **IMAGE_FAMILIES[family])
    model = Logits(transformers.AutoModelForImageClassification.from_config(config).eval())
    size = IMAGE_FAMILIES[family].get("image_size", 32)
    x = torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y = torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(3))
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, y)


def _adapter(variant: str, targets: list[str]) -> Any:
    peft = pytest.importorskip("peft", reason="peft is a test extra; not installed here")
    task: dict[str, Any] = {"task_type": "SEQ_CLS"}
    return {
        "lora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.1, **task),
        "dora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_dora=True, **task),
        "rslora": lambda: peft.LoraConfig(r=4, target_modules=targets, use_rslora=True, bias="lora_only", **task),
        "adalora": lambda: peft.AdaLoraConfig(init_r=4, target_r=2, target_modules=targets, total_step=10, **task),
        "lokr": lambda: peft.LoKrConfig(r=2, target_modules=targets, **task),
        "vera": lambda: peft.VeraConfig(r=4, target_modules=targets, **task),
        "fourierft": lambda: peft.FourierFTConfig(n_frequency=10, target_modules=targets, **task),
        "ia3": lambda: peft.IA3Config(target_modules=targets, feedforward_modules=[], **task),
        "prompt": lambda: peft.PromptTuningConfig(num_virtual_tokens=3, **task),
        "p-tuning": lambda: peft.PromptEncoderConfig(num_virtual_tokens=3, encoder_hidden_size=8, **task),
        "boft": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=targets, **task),
        "c3a": lambda: peft.C3AConfig(block_size=4, target_modules=targets, **task),
        "road": lambda: peft.RoadConfig(variant="road_2", group_size=8, target_modules=targets, **task),
        "trainable-tokens": lambda: peft.TrainableTokensConfig(token_indices=[4, 10, 25], **task),
        "loha": lambda: peft.LoHaConfig(r=2, target_modules=targets, **task),
        "oft": lambda: peft.OFTConfig(r=0, oft_block_size=4, target_modules=targets, **task),
        "hra": lambda: peft.HRAConfig(r=2, target_modules=targets, **task),
        "shira": lambda: peft.ShiraConfig(r=2, target_modules=targets, **task),
    }[variant]()


TARGETS = {"bert": ["query", "value"], "gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}
ADAPTED = [
    ("lora", "gpt2"),  # on transformers' Conv1D (fan_in_fan_out)
    ("dora", "llama"),  # a weight's magnitude over its column norms, computed from parameters alone
    ("rslora", "bert"),
    ("adalora", "bert"),
    ("lokr", "bert"),  # Kronecker factors
    ("vera", "gpt2"),  # shared frozen projections, trained scaling vectors
    ("fourierft", "gpt2"),  # a weight from its spectrum (an inverse FFT of parameters)
    ("ia3", "bert"),
    ("prompt", "llama"),  # trained virtual-token embeddings concatenated before the tokens
    ("p-tuning", "bert"),
    ("boft", "bert"),  # butterfly rotations: a permutation buffer cast to the activation's dtype, ``P.to(x)``
    ("c3a", "llama"),  # a custom autograd Function of the batch and a kernel (FFTs, in float32): run example by example
    ("road", "llama"),  # rotations of the output's halves: torch.stack((-x2, x1), dim=1) of rows from the batch
    ("trainable-tokens", "bert"),  # trained rows (of tokens the batch holds) copied into the frozen table, looked up
    ("loha", "bert"),  # Hadamard products of low-rank factors
    ("oft", "bert"),  # orthogonal blocks by the Cayley transform (a solve on parameters alone)
    ("hra", "llama"),  # Householder reflections multiplied into the weight
    ("shira", "bert"),  # trained entries of the frozen weight: a sparse COO tensor added to it
]
ADAPTERS_IN_FLOAT32 = {"c3a"}  # (whatever the model's dtype: float32 rounding)


@pytest.mark.parametrize(("variant", "base"), ADAPTED, ids=[f"{v}-{b}" for v, b in ADAPTED])
def test_a_peft_adapter_of_each_kind_clips_exactly_without_the_exact_path(variant: str, base: str) -> None:
    peft = pytest.importorskip("peft", reason="peft is a test extra; not installed here")
    torch.manual_seed(0)
    model = HuggingFace(peft.get_peft_model(_text_model(base), _adapter(variant, TARGETS[base])).eval())
    y = torch.randint(0, 3, (5,), generator=torch.Generator().manual_seed(1))
    tolerance = 1e-6 if variant in ADAPTERS_IN_FLOAT32 else 1e-10
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, _tokens(base), y, tolerance=tolerance)


class LastLogits(nn.Module):
    """A causal language model on one LongTensor (B, 2, T) of ids and mask: the logits at the last position (as the
    next token's classifier)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x[:, 0], attention_mask=x[:, 1]).logits[:, -1]  # type: ignore[no-any-return]


@pytest.mark.parametrize("base", ["gpt2", "llama"])
def test_prefix_tuning_clips_exactly_without_the_exact_path(base: str) -> None:
    """peft's prefix tuning: trained keys and values before each layer's, put in a key-value cache that starts from an
    empty tensor (``torch.cat([torch.tensor([]), keys], dim=-2)``), then joined with the batch's. (peft gives prefix
    tuning to causal language models; its sequence classifiers refuse models whose forward takes no cache.)"""
    peft = pytest.importorskip("peft", reason="peft is a test extra; not installed here")
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra; not installed here")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(base, **(TEXT | TEXT_FAMILIES[base]))
    language_model = transformers.AutoModelForCausalLM.from_config(config)
    adapter = peft.PrefixTuningConfig(num_virtual_tokens=3, task_type="CAUSAL_LM")
    model = LastLogits(peft.get_peft_model(language_model, adapter).eval())
    y = torch.randint(0, 40, (5,), generator=torch.Generator().manual_seed(1))
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, _tokens(base), y)


SPEECH = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, num_labels=3)
SPEECH |= dict(conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8)
SPEECH |= dict(num_conv_pos_embedding_groups=2, mask_time_prob=0.2, mask_time_length=3, layerdrop=0.0)


SPEECH_FAMILIES: dict[str, dict[str, Any]] = {
    "wav2vec2": {},
    "hubert": {},
    "wavlm": {"num_buckets": 8, "max_bucket_distance": 16},  # a gated relative position bias, a slice per head
}


@pytest.mark.parametrize("family", sorted(SPEECH_FAMILIES))
def test_a_speech_classifier_masking_with_numpys_generator_plans_no_exact_path(family: str) -> None:
    """In training, SpecAugment writes a learned embedding over time steps chosen with NumPy's global generator
    (``h[mask] = masked_spec_embed``). The probe's passes draw the same masks (each seeds NumPy's generator alike; a
    first pass run again restores it), the embedding is clipped by its rule, and training's NumPy state is as before.
    The plan's probe confirms every clipped sum and norm against per-example autograd before it returns."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra; not installed here")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **(SPEECH | SPEECH_FAMILIES[family]))
    model = Logits(transformers.AutoModelForAudioClassification.from_config(config).train(), key="input_values")
    np.random.seed(5)
    before = np.random.get_state()[1].copy(), np.random.get_state()[2]
    plan = plan_clipping(model, per_example_cross_entropy, (400,))
    assert plan.exact_parameters == (), plan.lines()
    assert any(name.endswith("masked_spec_embed") for name in plan.rule_parameters), plan.rule_parameters
    after = np.random.get_state()
    assert np.array_equal(after[1], before[0]) and after[2] == before[1]


MIXTURES: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
    ),
}


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("family", sorted(MIXTURES))
def test_a_mixture_of_experts_plans_no_exact_path(family: str, implementation: str) -> None:
    """``transformers``' experts, by grouped products (the default: in float32 only, so the probe checks the model in
    float32) or one expert at a time: an example's tokens are routed to each expert in different numbers (ragged
    rows). The plan's probe confirms every clipped sum and norm against per-example autograd before it returns."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra; not installed here")
    torch.manual_seed(0)
    settings = TEXT | ONE_KV_HEAD | MIXTURES[family] | {"experts_implementation": implementation}
    model = HuggingFace(_text_model_from(transformers.AutoConfig.for_model(family, **settings)).train())
    plan = plan_clipping(model, per_example_cross_entropy, (2, 9), torch.long, probe=(_tokens(family), _labels(5)))
    assert plan.exact_parameters == (), plan.lines()
    assert any("experts" in name for name in plan.rule_parameters), plan.rule_parameters


SEQUENCE_MIXERS: dict[str, dict[str, Any]] = {  # transformers' base models with no sequence-classification head
    "mamba": dict(state_size=4, expand=2, conv_kernel=3, time_step_rank=4),  # the selective scan, step by step
    "mamba2": dict(state_size=4, expand=2, conv_kernel=3, num_heads=4, head_dim=8, n_groups=1, chunk_size=8),
    "rwkv": dict(attention_hidden_size=16, intermediate_size=32, context_length=32),  # out[:, t] = row_t, 16 steps
    "recurrent_gemma": dict(
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        lru_width=16,
        attention_window_size=8,
        head_dim=8,
        conv1d_width=3,
        block_types=["recurrent", "recurrent", "attention"],
    ),
    "lfm2": dict(
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        layer_types=["conv", "full_attention"],
        conv_L_cache=3,
        block_auto_adjust_ff_dim=False,
    ),
    "xlstm": dict(
        embedding_dim=16,
        num_heads=2,
        qk_dim_factor=0.5,
        v_dim_factor=1.0,
        chunk_size=8,
        mode="train",
        chunkwise_kernel="chunkwise--native_autograd",
        sequence_kernel="native_sequence__native",
        step_kernel="native",
    ),
}


class MeanPooled(nn.Module):
    """A base model's hidden states (token ids in, no padding) averaged over the tokens, then a linear head."""

    def __init__(self, base: nn.Module, width: int) -> None:
        super().__init__()
        self.base, self.head = base, nn.Linear(width, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.base(input_ids=ids).last_hidden_state.mean(1))  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", sorted(SEQUENCE_MIXERS))
def test_a_state_space_or_recurrent_model_of_each_family_clips_exactly_without_the_exact_path(family: str) -> None:
    """Mamba's and Mamba-2's scans, RWKV's time-mixing loop, RecurrentGemma's LRU, LFM2's gated convolutions and
    xLSTM's cells, as their libraries run them on a CPU (their decays exponentiated in float32 whatever the model's
    dtype: float32 rounding)."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test extra; not installed here")
    torch.manual_seed(0)
    settings = dict(hidden_size=16, num_hidden_layers=2, vocab_size=40, use_cache=False) | SEQUENCE_MIXERS[family]
    base = transformers.AutoModel.from_config(transformers.AutoConfig.for_model(family, **settings))
    ids = torch.randint(1, 40, (5, 16), generator=torch.Generator().manual_seed(2))
    assert_exact_without_the_exact_path(
        MeanPooled(base.eval(), 16), per_example_cross_entropy, ids, _labels(5), tolerance=1e-6
    )
