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
LayerNorm's form, the usual norm of such layers. The same holds of a 2-D or 3-D map of one position (a squeeze-and-
excitation or split-attention branch after global pooling: timm's SKNet, ResNeSt; HRNet's low branches on small
images), where a group of one number normalises to 0 whatever the input (and torch refuses a batch of one): on such a
map the replacement takes one group, on larger maps gcd(groups, C) (:class:`GroupsByPositions`). Its ``eps`` and its
affine scale and shift (a pretrained model's learned γ and β) are carried over on the same device and dtype; the
running mean and variance are dropped. GroupNorm is not BatchNorm: a model converted from pretrained weights is a
new model whose accuracy the private training has to earn.

Only ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm`` themselves become ``nn.GroupNorm``. A subclass has a forward
of its own (timm's ``BatchNormAct2d``: the norm, then dropout and an activation; 15 of the 60 timm architectures of
``benchmarks/timm_zoo.py`` are built with it) that a GroupNorm would silently drop: it is kept, and its own forward
runs inside :class:`BatchNormAsGroupNorm`, which computes the one ``F.batch_norm`` call it makes on its own scale,
shift and running statistics as ``F.group_norm`` over the same groups (the rest of its forward, its activation, its
dropout, its hooks, run as written; its running statistics are never read nor updated). A forward that makes no such
call, or more than one, or calls ``F.batch_norm`` on other tensors, is refused when it runs, naming the layer (the
clipping plan runs it before any ε is spent). A lazy layer not yet given its input, and a layer of the plain classes
with hooks of its own (which a GroupNorm in its place would drop), are refused; every layer is checked before any is
replaced, so a refused model is left as it was.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

REPLACED = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
"""The classes whose forward is batch normalisation and nothing else: each instance of exactly one is replaced."""


def replace_batch_norm(model: nn.Module, groups: int = 32) -> nn.Module:
    """Replace, in place, every batch normalisation layer of ``model`` by ``nn.GroupNorm(gcd(groups, C), C)`` (one
    group for a ``BatchNorm1d``) with the same ``eps``, affine scale and shift, device and dtype, and every subclass of
    one with a forward of its own by :class:`BatchNormAsGroupNorm` over the same groups (module docstring); returns
    ``model`` (or, when ``model`` is itself a batch normalisation layer, its replacement). A layer used at several
    places of the model is one replacement at all of them. Raises ``ValueError`` naming the layer, before anything is
    replaced, for a lazy layer not yet run or a layer of the plain classes with hooks."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups: {groups!r} is not allowed; a positive integer (C is split into gcd(groups, C))")
    for name, module in model.named_modules(remove_duplicate=True):
        _check_replaceable(name, module)
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        return _replacement(model, groups)
    replacements: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        if isinstance(parent, BatchNormAsGroupNorm):
            continue  # (its layer is the subclass it normalises by groups)
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                if id(child) not in replacements:
                    replacements[id(child)] = _replacement(child, groups)
                setattr(parent, child_name, replacements[id(child)])
    return model


def _replacement(layer: nn.modules.batchnorm._BatchNorm, groups: int) -> nn.Module:
    """A plain batch normalisation layer's GroupNorm; a subclass with a forward of its own, wrapped."""
    if type(layer) in REPLACED:
        return _group_norm(layer, groups)
    return BatchNormAsGroupNorm(layer, group_count(layer, groups))


def group_count(batch_norm: nn.modules.batchnorm._BatchNorm, groups: int) -> int:
    """The replacement's number of groups: gcd(groups, C), one for a ``BatchNorm1d`` (module docstring)."""
    return 1 if isinstance(batch_norm, nn.BatchNorm1d) else math.gcd(groups, batch_norm.num_features)


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
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks)
    if type(module) in REPLACED and any(hooks):
        raise ValueError(f"{where} ({kind}) has hooks registered on it, which a GroupNorm in its place would drop")


def _group_norm(batch_norm: nn.modules.batchnorm._BatchNorm, groups: int) -> nn.GroupNorm:
    """``nn.GroupNorm(gcd(groups, C), C)`` (one group for a ``BatchNorm1d``) with ``batch_norm``'s eps, affine scale
    and shift, device and dtype; of more than one group, with :class:`GroupsByPositions` (one on a map of one
    position)."""
    channels = batch_norm.num_features
    count = group_count(batch_norm, groups)
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
    if count > 1:
        group_norm.register_forward_pre_hook(GroupsByPositions(count))
    return group_norm


def groups_for(groups: int, x: torch.Tensor) -> int:
    """``groups``, or one where the (B, C, …) input ``x`` has one position (module docstring)."""
    return groups if math.prod(x.shape[2:]) > 1 else 1


class GroupsByPositions:
    """A replacement GroupNorm's forward pre-hook: its ``num_groups`` set, before each call, to ``groups`` on an input
    of more than one position, and to one on a map of one position (module docstring), so that the layer stays a stock
    ``nn.GroupNorm`` (the clipping engine's shortcut for it reads the groups it ran with)."""

    def __init__(self, groups: int) -> None:
        self.groups = groups

    def __call__(self, module: nn.GroupNorm, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            module.num_groups = groups_for(self.groups, args[0])


def reject_batch_norm(model: nn.Module) -> None:
    """Refuse batch normalisation, but where :class:`BatchNormAsGroupNorm` computes it as a group norm."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    wrapped = {id(m.layer) for m in model.modules() if isinstance(m, BatchNormAsGroupNorm)} if found else set()
    for name, module in found:
        if id(module) not in wrapped:
            where = f"model layer '{name}'" if name else "the model"
            raise ValueError(
                f"{where} ({type(module).__name__}): batch normalisation mixes the examples of a batch, so one's "
                "gradient depends on the others and per-example clipping does not bound its influence (and the running "
                "statistics are released without noise); use nn.GroupNorm or nn.LayerNorm, or dpml.replace_batch_norm"
            )


_BATCH_NORM_SIGNATURE = inspect.signature(F.batch_norm)


class BatchNormAsGroupNorm(nn.Module):
    """A subclass of a batch normalisation class run by its own forward, with the batch normalisation it computes on
    its own parameters replaced by a group normalisation (module docstring): the one call
    ``F.batch_norm(x, running_mean, running_var, γ, β, training, momentum, eps)`` the forward makes is computed as
    ``F.group_norm(x, groups, γ, β, eps)`` (one group on a map of one position: :func:`groups_for`) — each example
    normalised by its own channels' statistics, in training and in evaluation alike — and the rest of the forward runs
    as written. ``layer``: the subclass, kept whole (its parameters are this module's ``layer.weight`` and
    ``layer.bias``)."""

    def __init__(self, layer: nn.modules.batchnorm._BatchNorm, groups: int) -> None:
        super().__init__()
        self.layer = layer
        self.groups = groups

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        swap = _GroupNormInstead(self.layer, self.groups)
        with swap:
            out = self.layer(*args, **kwargs)
        if swap.calls != 1:
            raise RuntimeError(
                f"{type(self.layer).__name__}: its forward called F.batch_norm on its own parameters {swap.calls} "
                "times; dpml.replace_batch_norm computes exactly one such call as a group norm (build the model with "
                "a group norm in its place: most constructors take one, torchvision's and timm's norm_layer=)"
            )
        return out

    def extra_repr(self) -> str:
        return f"groups={self.groups}"


class _GroupNormInstead(TorchFunctionMode):
    """While a :class:`BatchNormAsGroupNorm`'s layer runs: its ``F.batch_norm`` call on its own tensors computed as
    ``F.group_norm``, counted; a call on other tensors refused (it would mix the examples of the batch)."""

    def __init__(self, layer: nn.modules.batchnorm._BatchNorm, groups: int) -> None:
        super().__init__()
        self.layer, self.groups, self.calls = layer, groups, 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is not F.batch_norm:
            return func(*args, **(kwargs or {}))
        call = _BATCH_NORM_SIGNATURE.bind(*args, **(kwargs or {}))
        call.apply_defaults()
        given, layer = call.arguments, self.layer
        names = ("running_mean", "running_var", "weight", "bias")
        if any(given[name] is not getattr(layer, name) for name in names):
            raise RuntimeError(
                f"{type(layer).__name__}: its forward calls F.batch_norm on tensors other than its own running "
                "statistics, scale and shift, a batch normalisation dpml.replace_batch_norm cannot replace"
            )
        self.calls += 1
        x = given["input"]
        return F.group_norm(x, groups_for(self.groups, x), given["weight"], given["bias"], given["eps"])
