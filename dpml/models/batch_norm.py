"""BatchNorm out, GroupNorm in: a model built with batch normalisation, made trainable with DP-SGD.

DP-SGD clips each example's gradient, which bounds that example's influence only when the example's loss depends on
no other example of the batch. In training mode ``nn.BatchNorm*d`` normalises each channel by the statistics of the
whole batch, so it breaks that premise (and its running statistics would be released without noise): dpml refuses
it before any ε is spent (:func:`dpml.train.clipping_layers.reject_batch_norm`). Most model constructors take a norm
layer (torchvision's and timm's ``norm_layer=``); a model that does not — ``transformers``' ResNet, RegNet,
MobileNet, MobileViT, a network read from a file — goes through :func:`replace_batch_norm`, as Opacus's
``ModuleValidator.fix`` does.

A ``BatchNorm2d``, ``BatchNorm3d`` or ``SyncBatchNorm`` over C channels becomes ``nn.GroupNorm(gcd(groups, C), C)``:
the statistics of each example's own channels in groups of C / gcd(groups, C), over its positions too, no running
statistics. ``gcd`` so that every C is accepted (``min(32, C)`` groups would not divide C = 48). A ``BatchNorm1d``
becomes ``nn.GroupNorm(1, C)``: it is fed (B, C) rows as often as (B, C, L) sequences (an MLP's features, LeViT's
tokens flattened to (B·N, C)), and on rows a group of C / 32 channels has no positions to add to it — one channel
alone normalises to 0 for every input, two to ±1 — so its statistics are taken over all C channels (and positions),
LayerNorm's form, the usual norm of such layers. (The same holds of a 2-D map shrunk to 1 × 1: with C ≤ ``groups``
channels each group is one number; pass a smaller ``groups`` for such a model.) Its ``eps`` and its
affine scale and shift (a pretrained model's learned γ and β) are carried over on the same device and dtype; the
running mean and variance are dropped. GroupNorm is not BatchNorm: a model converted from pretrained weights is a
new model whose accuracy the private training has to earn.

Only ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm`` themselves are replaced. A subclass has a forward of its own
(timm's ``BatchNormAct2d`` applies an activation after the norm) that a GroupNorm would silently drop, so it is
refused, as are a lazy layer not yet given its input and a layer with hooks of its own; every layer is checked before
any is replaced, so a refused model is left as it was.
"""

from __future__ import annotations

import math

import torch
from torch import nn

REPLACED = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
"""The classes whose forward is batch normalisation and nothing else: each instance of exactly one is replaced."""


def replace_batch_norm(model: nn.Module, groups: int = 32) -> nn.Module:
    """Replace, in place, every batch normalisation layer of ``model`` by ``nn.GroupNorm(gcd(groups, C), C)`` (one
    group for a ``BatchNorm1d``) with the same ``eps``, affine scale and shift, device and dtype (module docstring);
    returns ``model`` (or, when ``model`` is itself a batch normalisation layer, its GroupNorm). A layer used at
    several places of the model is one GroupNorm at all of them. Raises ``ValueError`` naming the layer, before
    anything is replaced, for a subclass of a batch normalisation class, a lazy layer not yet run, or a layer with
    hooks."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups: {groups!r} is not allowed; a positive integer (C is split into gcd(groups, C))")
    for name, module in model.named_modules(remove_duplicate=True):
        _check_replaceable(name, module)
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        return _group_norm(model, groups)
    replacements: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                if id(child) not in replacements:
                    replacements[id(child)] = _group_norm(child, groups)
                setattr(parent, child_name, replacements[id(child)])
    return model


def _check_replaceable(name: str, module: nn.Module) -> None:
    """Refuse a batch normalisation layer that :func:`_group_norm` would not replace faithfully."""
    if not isinstance(module, nn.modules.batchnorm._BatchNorm):
        return
    where = f"model layer '{name}'" if name else "the model"
    kind = type(module).__name__
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        raise ValueError(
            f"{where} ({kind}): its channel count is not known until it has seen an input; run one forward pass "
            "first, then replace its batch normalisation"
        )
    if type(module) not in REPLACED:
        raise ValueError(
            f"{where} ({kind}): a subclass of {type(module).__mro__[1].__name__} with a forward of its own, which a "
            "GroupNorm in its place would drop (an activation after the norm, say); build the model with a group "
            "norm in its place (most constructors take one: torchvision's and timm's norm_layer=)"
        )
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks)
    if any(hooks):
        raise ValueError(f"{where} ({kind}) has hooks registered on it, which a GroupNorm in its place would drop")


def _group_norm(batch_norm: nn.modules.batchnorm._BatchNorm, groups: int) -> nn.GroupNorm:
    """``nn.GroupNorm(gcd(groups, C), C)`` (one group for a ``BatchNorm1d``) with ``batch_norm``'s eps, affine scale
    and shift, device and dtype."""
    channels = batch_norm.num_features
    count = 1 if type(batch_norm) is nn.BatchNorm1d else math.gcd(groups, channels)
    like = batch_norm.weight if batch_norm.affine else batch_norm.running_mean
    group_norm = nn.GroupNorm(count, channels, eps=batch_norm.eps, affine=batch_norm.affine)
    if like is not None:
        group_norm.to(device=like.device, dtype=like.dtype)
    if batch_norm.affine:
        with torch.no_grad():
            group_norm.weight.copy_(batch_norm.weight)
            group_norm.bias.copy_(batch_norm.bias)
        group_norm.weight.requires_grad_(batch_norm.weight.requires_grad)
        group_norm.bias.requires_grad_(batch_norm.bias.requires_grad)
    group_norm.train(batch_norm.training)
    return group_norm
