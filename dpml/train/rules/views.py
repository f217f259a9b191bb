"""Operations that select or rearrange a tensor's elements without computing new values.

On a parameter they make a *tracked view* (``w.t()``, ``w.chunk(3)[1]``, ``w[:k]``, ``w.view(…)``,
``cls.expand(B, -1, -1)``): the same operation applied to the parameter's index tensor says where each
element comes from, so a rule's per-example gradient of the view maps back to the parameter's
coordinates. On an activation they carry its example map (:mod:`dpml.train.rules.recorder`).
Casts and copies keep every element where it is (the index passes through unchanged). What a tensor is (``w.dtype``,
``w.shape``) is no use of its values.
"""

from __future__ import annotations

import torch

from dpml.train.rules.registry import IDENTITY_VIEWS, INDEX_VIEWS, METADATA, SHAPE_ONLY, VALUE_OF_FIRST

T = torch.Tensor
INDEX_VIEWS.update(
    {
        T.t,
        torch.t,
        T.transpose,
        torch.transpose,
        T.swapaxes,
        torch.swapaxes,
        T.T.__get__,  # type: ignore[attr-defined]  # (the properties' getters)
        T.mT.__get__,  # type: ignore[attr-defined]
        T.permute,
        torch.permute,
        T.movedim,
        torch.movedim,
        T.view,
        T.reshape,
        torch.reshape,
        T.view_as,
        T.reshape_as,
        T.flatten,
        torch.flatten,
        T.unflatten,
        T.unsqueeze,
        torch.unsqueeze,
        T.squeeze,
        torch.squeeze,
        T.expand,
        T.expand_as,
        T.repeat,  # (copies of elements: the index copied likewise)
        T.repeat_interleave,
        torch.repeat_interleave,
        T.tile,
        torch.tile,
        T.broadcast_to,
        torch.broadcast_to,
        T.chunk,
        torch.chunk,
        T.split,
        torch.split,
        T.unbind,
        torch.unbind,
        T.narrow,
        torch.narrow,
        T.select,
        torch.select,
        T.__getitem__,
    }
)
IDENTITY_VIEWS.update({T.contiguous, T.clone, torch.clone, T.to, T.float, T.double, T.half, T.bfloat16, T.type_as})
SHAPE_ONLY.update({T.view_as, T.reshape_as, T.expand_as, T.type_as})
VALUE_OF_FIRST.update({T.to, T.type_as})
METADATA.update(
    {
        T.dtype.__get__,  # type: ignore[attr-defined]
        T.device.__get__,
        T.shape.__get__,  # type: ignore[attr-defined]
        T.ndim.__get__,  # type: ignore[attr-defined]
        T.layout.__get__,  # type: ignore[attr-defined]
        T.requires_grad.__get__,  # type: ignore[attr-defined]
        T.is_cuda.__get__,  # type: ignore[attr-defined]
        T.size,
        T.dim,
        T.numel,
        T.nelement,
        T.__len__,
        T.stride,
        T.is_floating_point,
        T.is_complex,
        T.is_contiguous,
        T.element_size,
        T.get_device,
    }
)
