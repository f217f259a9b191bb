"""More models of the families ``benchmarks/families.py`` measures, each built from its library's config with random
weights (no hub): the other encoders, decoders and vision models people bring, at the size ``--size`` gives them.
``families.py`` asks this module for a family it does not build itself (``--families roberta llama …``, or
``--families zoo`` for all of them):

- text (the same token batches as BERT's, its vocabulary): ``roberta``, ``xlm-roberta``, ``distilbert``, ``electra`` and
  ``albert`` (factorised embeddings half as wide), ``deberta-v2`` (as DeBERTa-v3 configures it: disentangled relative
  attention, a normed table of 512 relative positions through each layer's query and key projections), ``markuplm`` (its
  XPath embeddings, looked up at the pad ids its forward makes when given none, through two layers on parameters alone),
  ``convbert`` (depthwise Conv1d span kernels), ``gpt-neo`` (local and global attention), ``opt``, ``bloom`` (ALiBi),
  ``llama`` (RMSNorm, rotary positions, gated MLP), ``mistral`` and ``qwen2`` (one key-value head for all query heads),
  ``mixtral`` (a mixture of 8 experts, 2 a token, each a gated MLP as wide as the size's feed-forward layer: each
  example routes a different number of tokens to each expert), ``qwen2-moe`` (8 experts of a quarter of that width, 2 a
  token, beside a shared expert gated per token), ``qwen3-moe`` (8 experts of a quarter of that width, 2 a token, no
  shared expert: the experts do all of its feed-forward work), ``mixtral-eager`` and ``qwen2-moe-eager`` (the same two
  with ``transformers``' other experts implementation, ``experts_implementation="eager"``: one expert at a time, its
  tokens' rows gathered, ``F.linear`` on them, the gated results added back into their tokens' rows by ``index_add_``,
  where the default runs all experts as one grouped product), ``gpt2-lora`` (peft LoRA on GPT-2's ``Conv1D`` attention
  and projections, the body frozen), ``bert-c3a`` (peft C3A on BERT's query and value: a custom autograd Function of the
  batch and its kernels, which no rule knows, run example by example), and more of peft's adapters on BERT, the body
  frozen (:data:`PEFT_ON_BERT`: ``bert-prompt``, ``bert-ia3``, ``bert-dora``, ``bert-loha``, ``bert-lokr``,
  ``bert-oft``, ``bert-boft``, ``bert-hra``, ``bert-road``, ``bert-vera``, ``bert-fourierft``, ``bert-randlora``,
  ``bert-trainable-tokens``, ``bert-shira``; ``--families peft`` for all of them, with ``bert-lora`` and ``bert-c3a``;
  not prefix tuning, which peft's sequence classifiers refuse where the model's forward takes no key-value cache, as
  ``transformers`` 5's classifiers do not), ``longformer`` (local attention in windows of 32, global attention on the
  first token: each example's global tokens written into zeros made for them), ``xlnet`` (time-major relative attention:
  a position table expanded over the batch, each layer's ``r`` projecting it); and (``--families more-text``,
  :data:`NEWER_TEXT`) the encoder-decoders ``t5`` (relative position buckets: an embedding indexed by one table shared
  by the batch, added to every layer's scores; RMS norms without a mean) and ``bart`` (learned positions offset by 2),
  each classifying from its decoder's state at the example's last ``<eos>``, the decoders ``gemma`` (one key-value head,
  RMSNorm with its weight plus one), ``phi`` (partial rotary, attention and MLP in parallel), ``falcon`` (multi-query
  attention, parallel attention and MLP), ``gpt-neox`` (partial rotary, parallel residual), and the encoders
  ``modernbert`` (local and global attention, gated MLP, no biases), ``funnel`` (pooled queries halving the sequence
  between blocks, relative attention), ``mobilebert`` (bottlenecks and ``NoNorm``, an elementwise affine in place of
  LayerNorm) and ``fnet`` (Fourier transforms in place of attention);
- images (32×32, 10 classes): timm's ``deit``, ``beit`` (relative position bias, layer scale), ``swin`` (windows
  of 4, two stages), ``efficientnet-gn`` (EfficientNet-B0, depthwise 3×3 and 5×5, squeeze-excitation, its
  BatchNorms GroupNorms), ``regnet-gn`` (RegNetX-200MF, groups of 8 channels) and ``bit-gn`` (BiT's ResNetV2-50x1:
  each convolution's weight standardised per output channel before ``F.conv2d``, GroupNorm), ``nf-resnet26``
  (NF-ResNet-26: no normalisation layer, each weight standardised and scaled by a gain per channel); torchvision's
  ``resnet34-gn``, ``resnet50-gn``, ``resnext50-gn`` (ResNeXt-50 32×4d: 3×3 convolutions in 32 groups) and
  ``wide-resnet50-gn`` (``GroupNorm(gcd(32, C), C)``), ``mobilenet-v2-gn``, ``resnet18-gn-ws`` (ResNet-18 with
  GroupNorm and every convolution's weight standardised by hand, as Qiao et al.'s code writes it: De et al. 2022's
  recipe for DP training);
- video clips (3 × ``CLIP_FRAMES`` × 32 × 32, 10 classes): torchvision's ``r3d-18-gn`` (R3D-18: 3-D convolutions
  throughout) and ``r2plus1d-18-gn`` (R(2+1)D-18: each 3-D convolution split into a spatial and a temporal one), their
  BatchNorm3d as ``GroupNorm(gcd(32, C), C)``; transformers' ``videomae`` (VideoMAE: a 3-D convolution cuts the clip
  into tubelets of 2 frames × 4 × 4 pixels, then a ViT at the size's width and depth);
- speech (``AUDIO_SAMPLES`` samples of a waveform, one second at 16 kHz as a spoken command's clip, 10 classes):
  transformers' ``sew-d`` (SEW-D: a convolutional feature encoder, a squeezed DeBERTa-v2 encoder whose
  relative-position table passes through ``XDropout``, a custom autograd Function, in training), ``wav2vec2`` and
  ``hubert`` (a feature encoder of seven convolutions, the first with GroupNorm, a grouped convolution as relative
  positions, a BERT-like encoder; SpecAugment's time masks from a learned embedding), the encoders at the size's width
  and depth.

Widths, depths and heads follow ``--size`` (the ``SIZES`` of ``families.py``) for the text models and the ViTs;
the convolutional networks are their named configuration at every size.
"""

from __future__ import annotations

import math
from typing import Any

NEWER_TEXT = ["t5", "bart", "gemma", "phi", "falcon", "gpt-neox", "modernbert", "funnel", "mobilebert", "fnet"]
TEXT_ZOO = [
    "roberta",
    "xlm-roberta",
    "distilbert",
    "electra",
    "albert",
    "deberta-v2",
    "markuplm",
    "convbert",
    "gpt-neo",
    "opt",
    "bloom",
    "llama",
    "mistral",
    "qwen2",
    "mixtral",
    "qwen2-moe",
    "qwen3-moe",
    "mixtral-eager",
    "qwen2-moe-eager",
    "gpt2-lora",
    "bert-c3a",
    "longformer",
    "xlnet",
    *NEWER_TEXT,
]
DEBERTA_V3_ATTENTION = {  # microsoft/deberta-v3-base's (DebertaV2Config's defaults leave relative attention off)
    "relative_attention": True,
    "pos_att_type": ["p2c", "c2p"],
    "share_att_key": True,
    "norm_rel_ebd": "layer_norm",
    "position_buckets": 256,
    "max_relative_positions": -1,
    "position_biased_input": False,
}
END_OF_SEQUENCE = {"t5": 1, "bart": 2}  # family: its <eos> id, which its classifier reads (each example ends in one)
EAGER_EXPERTS = {"mixtral-eager": "mixtral", "qwen2-moe-eager": "qwen2-moe"}  # family: the config it shares
QV, IA3 = ["query", "value"], ["key", "value", "output.dense"]
PEFT_ON_BERT: dict[str, tuple[str, dict[str, Any], str]] = {  # family: (peft's config class, its settings, what it is)
    "bert-prompt": ("PromptTuningConfig", {"num_virtual_tokens": 8}, "prompt tuning: 8 trained input embeddings"),
    "bert-ia3": ("IA3Config", {"target_modules": IA3, "feedforward_modules": IA3[2:]}, "IA3 scales on key, value, FFN"),
    "bert-dora": ("LoraConfig", {"r": 8, "target_modules": QV, "use_dora": True}, "DoRA r=8 on query and value"),
    "bert-loha": ("LoHaConfig", {"r": 8, "target_modules": QV}, "LoHa r=8 on query and value"),
    "bert-lokr": ("LoKrConfig", {"r": 8, "target_modules": QV}, "LoKr r=8 on query and value"),
    "bert-oft": ("OFTConfig", {"r": 0, "oft_block_size": 32, "target_modules": QV}, "OFT blocks of 32 on query, value"),
    "bert-boft": ("BOFTConfig", {"boft_block_size": 16, "target_modules": QV}, "BOFT blocks of 16 on query and value"),
    "bert-hra": ("HRAConfig", {"r": 8, "target_modules": QV}, "HRA: 8 Householder reflections on query and value"),
    "bert-road": ("RoadConfig", {"target_modules": QV}, "RoAd: rotations of query's and value's outputs"),
    "bert-vera": ("VeraConfig", {"r": 16, "target_modules": QV}, "VeRA r=16 on query and value"),
    "bert-fourierft": ("FourierFTConfig", {"n_frequency": 100, "target_modules": QV}, "FourierFT, 100 frequencies"),
    "bert-randlora": ("RandLoraConfig", {"r": 8, "target_modules": QV}, "RandLoRA r=8 on query and value"),
    "bert-trainable-tokens": ("TrainableTokensConfig", {"token_indices": list(range(1, 65))}, "64 trained token rows"),
    "bert-shira": ("ShiraConfig", {"r": 8, "target_modules": QV}, "SHiRA: sparse trained entries of query and value"),
}
TEXT_ZOO += list(PEFT_ON_BERT)
PEFT_FAMILIES = {"gpt2-lora", "bert-c3a", *PEFT_ON_BERT}
TIMM_IMAGES = ("deit", "beit", "swin", "efficientnet-gn", "regnet-gn", "bit-gn", "nf-resnet26")
IMAGE_ZOO = [
    "deit",
    "beit",
    "swin",
    "resnet34-gn",
    "resnet50-gn",
    "resnext50-gn",
    "wide-resnet50-gn",
    "efficientnet-gn",
    "mobilenet-v2-gn",
    "regnet-gn",
    "bit-gn",
    "nf-resnet26",
    "resnet18-gn-ws",
]
VIDEO_ZOO = ["r3d-18-gn", "r2plus1d-18-gn", "videomae"]
CLIP_FRAMES = 8
AUDIO_ZOO = ["sew-d", "wav2vec2", "hubert"]
AUDIO_SAMPLES = 16000
ZOO = TEXT_ZOO + IMAGE_ZOO + VIDEO_ZOO + AUDIO_ZOO


def text_config(family: str, size: dict, length: int, vocabulary: int, classes: int) -> Any:  # noqa: ANN401
    """The family's ``transformers`` config at ``size`` (``hidden``, ``layers``, ``heads``, ``ffn``)."""
    import transformers as tr

    h, layers, heads, ffn = size["hidden"], size["layers"], size["heads"], size["ffn"]
    common: dict[str, Any] = {"vocab_size": vocabulary, "num_labels": classes, "pad_token_id": 0}
    bert_like = {"hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads, "intermediate_size": ffn}
    decoder = {**bert_like, "max_position_embeddings": max(512, length)}
    configs = {
        "roberta": lambda: tr.RobertaConfig(**bert_like, max_position_embeddings=length + 2, **common),
        "xlm-roberta": lambda: tr.XLMRobertaConfig(**bert_like, max_position_embeddings=length + 2, **common),
        "distilbert": lambda: tr.DistilBertConfig(dim=h, n_layers=layers, n_heads=heads, hidden_dim=ffn, **common),
        "electra": lambda: tr.ElectraConfig(**bert_like, embedding_size=h // 2, **common),
        "albert": lambda: tr.AlbertConfig(**bert_like, embedding_size=h // 2, **common),
        "deberta-v2": lambda: tr.DebertaV2Config(**bert_like, **DEBERTA_V3_ATTENTION, **common),
        "markuplm": lambda: tr.MarkupLMConfig(**bert_like, max_position_embeddings=max(512, length), **common),
        "convbert": lambda: tr.ConvBertConfig(**bert_like, embedding_size=h, **common),
        "gpt-neo": lambda: tr.GPTNeoConfig(
            hidden_size=h,
            num_layers=layers,
            num_heads=heads,
            intermediate_size=ffn,
            attention_types=[[["global", "local"], max(1, layers // 2)]],
            max_position_embeddings=max(512, length),
            **common,
        ),
        "opt": lambda: tr.OPTConfig(
            hidden_size=h,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            ffn_dim=ffn,
            word_embed_proj_dim=h,
            max_position_embeddings=max(512, length),
            **common,
        ),
        "bloom": lambda: tr.BloomConfig(hidden_size=h, n_layer=layers, n_head=heads, **common),
        "llama": lambda: tr.LlamaConfig(**decoder, num_key_value_heads=heads, **common),
        "mistral": lambda: tr.MistralConfig(**decoder, num_key_value_heads=1, head_dim=h // heads, **common),
        "qwen2": lambda: tr.Qwen2Config(**decoder, num_key_value_heads=1, **common),
        "mixtral": lambda: tr.MixtralConfig(
            **decoder, num_key_value_heads=1, num_local_experts=8, num_experts_per_tok=2, **common
        ),
        "qwen2-moe": lambda: tr.Qwen2MoeConfig(
            **decoder,
            num_key_value_heads=1,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=ffn // 4,
            shared_expert_intermediate_size=ffn,
            **common,
        ),
        "qwen3-moe": lambda: tr.Qwen3MoeConfig(
            **decoder,
            num_key_value_heads=1,
            head_dim=h // heads,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=ffn // 4,
            **common,
        ),
        "longformer": lambda: tr.LongformerConfig(
            **bert_like, attention_window=32, max_position_embeddings=length + 2, **common
        ),
        "xlnet": lambda: tr.XLNetConfig(d_model=h, n_layer=layers, n_head=heads, d_inner=ffn, **common),
        "t5": lambda: tr.T5Config(
            d_model=h,
            d_kv=h // heads,
            d_ff=ffn,
            num_layers=layers,
            num_heads=heads,
            eos_token_id=END_OF_SEQUENCE["t5"],
            decoder_start_token_id=0,
            **common,
        ),
        "bart": lambda: tr.BartConfig(
            d_model=h,
            encoder_layers=layers,
            decoder_layers=layers,
            encoder_attention_heads=heads,
            decoder_attention_heads=heads,
            encoder_ffn_dim=ffn,
            decoder_ffn_dim=ffn,
            eos_token_id=END_OF_SEQUENCE["bart"],
            max_position_embeddings=max(512, length),
            **common,
        ),
        "gemma": lambda: tr.GemmaConfig(**decoder, num_key_value_heads=1, head_dim=h // heads, **common),
        "phi": lambda: tr.PhiConfig(**decoder, **common),
        "falcon": lambda: tr.FalconConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, **common),
        "gpt-neox": lambda: tr.GPTNeoXConfig(**decoder, **common),
        "modernbert": lambda: tr.ModernBertConfig(**bert_like, max_position_embeddings=max(512, length), **common),
        "funnel": lambda: tr.FunnelConfig(
            d_model=h, n_head=heads, d_head=h // heads, d_inner=ffn, block_sizes=[1] * layers, **common
        ),
        "mobilebert": lambda: tr.MobileBertConfig(
            **bert_like, embedding_size=h // 2, intra_bottleneck_size=h // 2, true_hidden_size=h // 2, **common
        ),
        "fnet": lambda: tr.FNetConfig(hidden_size=h, num_hidden_layers=layers, intermediate_size=ffn, **common),
        **{
            name: lambda: tr.BertConfig(**bert_like, max_position_embeddings=max(512, length), **common)
            for name in ("bert-c3a", *PEFT_ON_BERT)
        },
        "gpt2-lora": lambda: tr.GPT2Config(
            n_embd=h, n_layer=layers, n_head=heads, n_inner=ffn, n_positions=max(1024, length), **common
        ),
    }
    return configs[EAGER_EXPERTS.get(family, family)]()


def build_text(family: str, size: dict, length: int, vocabulary: int, classes: int) -> tuple[Any, str]:
    """The family's sequence classifier (random weights from the current seed) and a line on what it is."""
    import transformers as tr

    config = text_config(family, size, length, vocabulary, classes)
    if family == "gpt2-lora":
        import peft

        lora = peft.LoraConfig(
            task_type=peft.TaskType.SEQ_CLS,
            r=8,
            lora_alpha=16,
            lora_dropout=0.1,
            target_modules=["c_attn", "c_proj"],
            fan_in_fan_out=True,
        )
        model = peft.get_peft_model(tr.GPT2ForSequenceClassification(config), lora)
        return model, "peft LoRA r=8 on GPT-2's c_attn and c_proj (Conv1D), the body frozen"
    if family in PEFT_ON_BERT:
        import peft

        kind, settings, what = PEFT_ON_BERT[family]
        adapter = getattr(peft, kind)(task_type=peft.TaskType.SEQ_CLS, **settings)
        return peft.get_peft_model(tr.BertForSequenceClassification(config), adapter), f"peft {what}, the body frozen"
    if family == "bert-c3a":
        import peft

        block = config.hidden_size // 4
        c3a = peft.C3AConfig(task_type=peft.TaskType.SEQ_CLS, block_size=block, target_modules=["query", "value"])
        model = peft.get_peft_model(tr.BertForSequenceClassification(config), c3a)
        return model, f"peft C3A (block-circulant kernels of {block}, FFTs) on BERT's query and value, the body frozen"
    experts = {"experts_implementation": "eager"} if family in EAGER_EXPERTS else {}
    model = tr.AutoModelForSequenceClassification.from_config(config, **experts)
    line = f"{type(model).__name__}, attention {model.config._attn_implementation}"
    return model, line + (", experts one at a time (eager)" if experts else "")


def _group_norm(channels: int) -> Any:  # noqa: ANN401
    from torch import nn

    return nn.GroupNorm(math.gcd(32, channels), channels)


def _timm_group_norm_act(channels: int, **settings: Any) -> Any:  # noqa: ANN401
    """timm's normalisation-and-activation layer as a GroupNorm of gcd(32, C) groups (for ``norm_layer=``)."""
    from timm.layers import GroupNormAct

    kept = {k: v for k, v in settings.items() if k in ("apply_act", "act_layer", "eps", "affine", "drop_layer")}
    return GroupNormAct(channels, num_groups=math.gcd(32, channels), **kept)


def _batch_norms_to_group_norms(model: Any) -> Any:  # noqa: ANN401
    """Every BatchNorm2d (timm's ``BatchNormAct2d`` with its activation) of ``model`` as a GroupNorm."""
    from timm.layers import BatchNormAct2d, GroupNormAct
    from torch import nn

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, BatchNormAct2d):
                replaced = GroupNormAct(child.num_features, num_groups=math.gcd(32, child.num_features))
                replaced.act, replaced.drop = child.act, child.drop
                setattr(module, name, replaced)
            elif isinstance(child, nn.BatchNorm2d):
                setattr(module, name, _group_norm(child.num_features))
    return model


def _hand_standardised(model: Any) -> Any:  # noqa: ANN401
    """Every ``nn.Conv2d`` of ``model`` with its weight standardised by hand before ``F.conv2d``, as Qiao et al.'s
    weight standardisation code writes it (means one dimension at a time, the flattened rows' std + 1e-5)."""
    import torch.nn.functional as F
    from torch import nn

    class HandStandardisedConv2d(nn.Conv2d):
        def forward(self, x: Any) -> Any:  # noqa: ANN401
            w = self.weight
            w = w - w.mean(dim=1, keepdim=True).mean(dim=2, keepdim=True).mean(dim=3, keepdim=True)
            std = w.view(w.size(0), -1).std(dim=1).view(-1, 1, 1, 1) + 1e-5
            w = w / std.expand_as(w)
            return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)

    for module in model.modules():
        if type(module) is nn.Conv2d:
            module.__class__ = HandStandardisedConv2d
    return model


def build_image(family: str, size: dict, classes: int) -> tuple[Any, str]:
    """The family's image classifier for 32×32 images (random weights from the current seed), and a line."""
    import timm

    if family in ("deit", "beit"):
        name = "deit_tiny_patch16_224" if family == "deit" else "beit_base_patch16_224"
        model = timm.create_model(
            name,
            pretrained=False,
            img_size=32,
            patch_size=4,
            num_classes=classes,
            depth=size["vit_depth"],
            embed_dim=192,
            num_heads=3,
        )
        return model, f"timm {timm.__version__} {name} (192 wide, 3 heads, {size['vit_depth']} blocks, patch 4)"
    if family == "swin":
        model = timm.create_model(
            "swin_tiny_patch4_window7_224",
            pretrained=False,
            img_size=32,
            window_size=4,
            num_classes=classes,
            depths=(2, 2),
            num_heads=(3, 6),
            embed_dim=96,
        )
        return model, f"timm {timm.__version__} Swin (96 wide, stages of 2 and 2 blocks, windows of 4)"
    if family == "efficientnet-gn":
        model = timm.create_model(
            "efficientnet_b0", pretrained=False, num_classes=classes, norm_layer=_timm_group_norm_act
        )
        return model, f"timm {timm.__version__} EfficientNet-B0, GroupNorm(gcd(32, C), C)"
    if family == "bit-gn":  # StdConv2d: each weight standardised, then F.conv2d (the functional rule, not a hook)
        model = timm.create_model("resnetv2_50x1_bit", pretrained=False, num_classes=classes)
        return model, f"timm {timm.__version__} BiT ResNetV2-50x1 (weight-standardised convolutions, GroupNorm)"
    if family == "nf-resnet26":  # no normalisation layer: ScaledStdConv2d (a gain per channel) and skip-init gains
        model = timm.create_model("nf_resnet26", pretrained=False, num_classes=classes)
        return model, f"timm {timm.__version__} NF-ResNet-26 (scaled weight-standardised convolutions, no norm layers)"
    if family == "regnet-gn":
        model = _batch_norms_to_group_norms(timm.create_model("regnetx_002", pretrained=False, num_classes=classes))
        return model, f"timm {timm.__version__} RegNetX-200MF, GroupNorm(gcd(32, C), C)"
    import torchvision.models as models

    builders = {
        "resnet34-gn": models.resnet34,
        "resnet50-gn": models.resnet50,
        "resnext50-gn": models.resnext50_32x4d,
        "wide-resnet50-gn": models.wide_resnet50_2,
    }
    if family in builders:
        return builders[family](num_classes=classes, norm_layer=_group_norm), f"torchvision {family[:-3]}, GroupNorm"
    if family == "resnet18-gn-ws":  # De et al. 2022's recipe: GroupNorm and weight standardisation, written by hand
        model = _hand_standardised(models.resnet18(num_classes=classes, norm_layer=_group_norm))
        return model, "torchvision ResNet-18, GroupNorm, every convolution's weight standardised by hand (Qiao et al.)"
    if family == "mobilenet-v2-gn":
        return models.mobilenet_v2(num_classes=classes, norm_layer=_group_norm), "torchvision MobileNet-V2, GroupNorm"
    raise ValueError(f"unknown family {family!r}")


def build_video(family: str, size: dict, classes: int) -> tuple[Any, str]:
    """The family's classifier of clips (B, 3, ``CLIP_FRAMES``, 32, 32) (random weights from the current seed), and a
    line on what it is."""
    from torch import nn

    if family == "videomae":
        import transformers as tr

        config = tr.VideoMAEConfig(
            image_size=32,
            patch_size=4,
            num_frames=CLIP_FRAMES,
            tubelet_size=2,
            hidden_size=size["hidden"],
            num_hidden_layers=size["layers"],
            num_attention_heads=size["heads"],
            intermediate_size=size["ffn"],
            num_labels=classes,
        )

        class Clips(nn.Module):  # (B, C, T, H, W) as torchvision's video models take them, to VideoMAE's (B, T, C, …)
            def __init__(self) -> None:
                super().__init__()
                self.model = tr.VideoMAEForVideoClassification(config)

            def forward(self, x: Any) -> Any:  # noqa: ANN401
                return self.model(pixel_values=x.transpose(1, 2)).logits

        layers = f"{size['hidden']} wide, {size['layers']} layers"
        return Clips(), f"VideoMAEForVideoClassification ({layers}, tubelets of 2 frames × 4 × 4 pixels)"
    import torchvision.models.video as video

    builders = {"r3d-18-gn": video.r3d_18, "r2plus1d-18-gn": video.r2plus1d_18}
    if family not in builders:
        raise ValueError(f"unknown family {family!r}")
    model = builders[family](num_classes=classes)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.BatchNorm3d):
                setattr(module, name, _group_norm(child.num_features))
    return model, f"torchvision {family[:-3]}, GroupNorm"


def build_audio(family: str, size: dict, classes: int) -> tuple[Any, str]:
    """The family's classifier of waveforms (B, ``AUDIO_SAMPLES``) (random weights from the current seed, in training
    its own dropouts and SpecAugment as configured by default), and a line on what it is."""
    import transformers as tr
    from torch import nn

    encoder = {
        "hidden_size": size["hidden"],
        "num_hidden_layers": size["layers"],
        "num_attention_heads": size["heads"],
        "intermediate_size": size["ffn"],
        "num_labels": classes,
    }
    builders = {
        "sew-d": (tr.SEWDConfig, tr.SEWDForSequenceClassification),
        "wav2vec2": (tr.Wav2Vec2Config, tr.Wav2Vec2ForSequenceClassification),
        "hubert": (tr.HubertConfig, tr.HubertForSequenceClassification),
    }
    if family not in builders:
        raise ValueError(f"unknown family {family!r}")
    config_class, model_class = builders[family]
    config = config_class(**encoder)

    class Waveforms(nn.Module):  # one tensor in, the logits out
        def __init__(self) -> None:
            super().__init__()
            self.model = model_class(config)

        def forward(self, x: Any) -> Any:  # noqa: ANN401
            return self.model(input_values=x).logits

    return Waveforms(), f"{model_class.__name__} ({size['hidden']} wide, {size['layers']} layers), its default encoder"
