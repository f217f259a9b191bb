"""timm's image architectures beyond the families' ViT and ResNets, for ``benchmarks/families.py`` (``--families
timm``, or any of them by name): one model of each architecture timm ships that trains on 32×32 images, built from
its registered configuration with random weights, made small where the configuration allows it (fewer blocks,
patches of 4 on a 32×32 image; the MLP-Mixers' configurations fix their patches of 16 and their depth: four
tokens). None of them was looked at while the engine's rules were written: the sweep is what a user who brings
another timm model meets.

timm's BatchNorm2d (and its ``BatchNormAct2d``) become GroupNorm(gcd(32, C), C) with the activation kept
(``family_zoo._batch_norms_to_group_norms``), as a DP user must replace them; other batch norms stay, and dpml's
plan refuses them (LeViT's ``BatchNorm1d``): that refusal, with its message, is the row's result.
"""

from __future__ import annotations

from typing import Any

TIMM_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    # vision transformers and their variants (patches of 4 on 32×32 images)
    "timm-vit-small": ("vit_small_patch16_224", {"img_size": 32, "patch_size": 4, "depth": 4}),
    "timm-vit-registers": (
        "vit_base_patch16_reg4_gap_256",
        {"img_size": 32, "patch_size": 4, "depth": 2, "embed_dim": 192, "num_heads": 3},
    ),
    "timm-deit3": ("deit3_small_patch16_224", {"img_size": 32, "patch_size": 4, "depth": 3}),
    "timm-deit-distilled": ("deit_tiny_distilled_patch16_224", {"img_size": 32, "patch_size": 4, "depth": 3}),
    # ...and as registered, only the image size changed: 12 blocks over 2×2 patches of 16 and the class token (5
    # tokens), a step of many small products whose host cost is the DP step's main cost
    "timm-vit-tiny-p16": ("vit_tiny_patch16_224", {"img_size": 32}),
    "timm-deit-tiny-p16": ("deit_tiny_patch16_224", {"img_size": 32}),
    "timm-cait": ("cait_xxs24_224", {"img_size": 32, "patch_size": 4, "depth": 3}),
    "timm-eva02": ("eva02_tiny_patch14_224", {"img_size": 32, "patch_size": 4, "depth": 3}),
    "timm-flexivit": ("flexivit_small", {"img_size": 32, "patch_size": 4, "depth": 3}),
    "timm-beitv2": (
        "beitv2_base_patch16_224",
        {"img_size": 32, "patch_size": 4, "depth": 2, "embed_dim": 192, "num_heads": 3},
    ),
    "timm-sam-vit": (
        "samvit_base_patch16",
        {
            "img_size": 32,
            "patch_size": 4,
            "depth": 2,
            "embed_dim": 192,
            "num_heads": 3,
            "global_attn_indexes": (1,),
            "window_size": 4,
        },
    ),
    "timm-convit": ("convit_tiny", {"img_size": 32, "depth": 3}),
    "timm-xcit": ("xcit_nano_12_p16_224", {"img_size": 32, "patch_size": 8}),
    "timm-tnt": ("tnt_s_patch16_224", {"img_size": 32}),
    "timm-pit": ("pit_ti_224", {"img_size": 32}),
    "timm-volo": ("volo_d1_224", {"img_size": 32}),
    # hierarchical and windowed transformers
    "timm-twins": ("twins_svt_small", {"img_size": 32}),
    "timm-pvt-v2": ("pvt_v2_b0", {}),
    "timm-coat": ("coat_lite_tiny", {"img_size": 32}),
    "timm-mvitv2": ("mvitv2_tiny", {"img_size": 32}),
    "timm-davit": ("davit_tiny", {}),
    "timm-focalnet": ("focalnet_tiny_srf", {}),
    "timm-hiera": ("hiera_tiny_224", {"img_size": (32, 32)}),
    "timm-gcvit": ("gcvit_xxtiny", {"img_size": 32}),
    "timm-maxvit": ("maxvit_nano_rw_256", {"img_size": 32}),
    "timm-coatnet": ("coatnet_nano_rw_224", {"img_size": 32}),
    "timm-efficientvit": ("efficientvit_b0", {}),
    "timm-levit": ("levit_128s", {"img_size": 32}),
    # MLPs and metaformers
    "timm-mixer": ("mixer_s16_224", {"img_size": 32}),
    "timm-resmlp": ("resmlp_12_224", {"img_size": 32}),
    "timm-gmlp": ("gmlp_ti16_224", {"img_size": 32}),
    "timm-sequencer": ("sequencer2d_s", {"img_size": 32}),
    "timm-poolformer": ("poolformer_s12", {}),
    "timm-poolformerv2": ("poolformerv2_s12", {}),
    "timm-convformer": ("convformer_s18", {}),
    "timm-mambaout": ("mambaout_femto", {}),
    # convolutional networks
    "timm-convnextv2": ("convnextv2_atto", {}),
    "timm-inception-next": ("inception_next_tiny", {}),
    "timm-edgenext": ("edgenext_xx_small", {}),
    "timm-rdnet": ("rdnet_tiny", {}),
    "timm-starnet": ("starnet_s1", {}),
    "timm-fastvit": ("fastvit_t8", {}),
    "timm-ghostnet": ("ghostnet_050", {}),
    "timm-mobilenetv3": ("mobilenetv3_small_050", {}),
    "timm-mobilenetv4": ("mobilenetv4_conv_small", {}),
    "timm-lcnet": ("lcnet_050", {}),
    "timm-rexnet": ("rexnet_100", {}),
    "timm-densenet": ("densenet121", {}),
    "timm-dla": ("dla34", {}),
    "timm-dpn": ("dpn48b", {}),
    "timm-hrnet": ("hrnet_w18_small", {}),
    "timm-repvgg": ("repvgg_a0", {}),
    "timm-res2net": ("res2net50_14w_8s", {}),
    "timm-resnest": ("resnest14d", {}),
    "timm-selecsls": ("selecsls42", {}),
    "timm-skresnet": ("skresnet18", {}),
    "timm-vovnet": ("ese_vovnet19b_dw", {}),
    "timm-tresnet": ("tresnet_m", {}),
    "timm-cspnet": ("cspresnet50", {}),
    "timm-vgg": ("vgg11", {}),
    "timm-nfnet": ("dm_nfnet_f0", {}),
    "timm-nf-regnet": ("nf_regnet_b0", {}),
}
TIMM_ZOO = list(TIMM_SPECS)


def build_timm(family: str, classes: int) -> tuple[Any, str]:
    """The family's timm classifier for 32×32 images (random weights from the current seed), its BatchNorm2d layers
    as GroupNorm, and a line on what it is."""
    import timm

    from family_zoo import _batch_norms_to_group_norms

    name, settings = TIMM_SPECS[family]
    model = _batch_norms_to_group_norms(timm.create_model(name, pretrained=False, num_classes=classes, **settings))
    shown = ", ".join(f"{key}={value}" for key, value in settings.items())
    return model, f"timm {timm.__version__} {name}" + (f" ({shown})" if shown else "") + ", BatchNorm2d as GroupNorm"
