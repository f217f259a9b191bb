"""The precision a model's forward pass computes in, whatever dtype its parameters are cast to: the clipping
probe's tolerance follows it (:mod:`dpml.train.clipping_check`).

The probe judges the engine in float64, at a relative tolerance of 1e-6, so that a rule that is off by a small term
shows. A model may compute part of its forward pass in a lower precision whatever its parameters' dtype: Gemma's
and Llama's RMS norms cast their input to float32 (``x.float()``), rotary position tables are built in float32.
Two exact computations through such a step — autograd's per-example reference and the engine's batched pass —
then differ by float32's rounding (Gemma's post-attention norm weight: 1.2e-6 relative, at tiny size), not by an
error of the engine, and the model would be refused for it. So the probe first runs the model's forward pass once
on its probe batch, watching each operation (a dispatch mode, which sees inside autograd Functions too); an
operation that takes a floating operand and gives a floating result of *lower* precision (float64 → float32, or a
float32 tensor written with float64 values) is a *narrowing*, and the check's tolerance is then a thousand times the
ε of the lowest precision narrowed to (float32: 1.2e-4), at most the 1e-3 of a model checked in its own dtype
(:func:`dpml.train.clipping_check._float64_tolerance`). A float32 tensor made from integers (``mask.float()``,
``arange``) narrows nothing: it holds its values exactly, and the tolerance stays 1e-6.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _real_dtype(t: Any) -> torch.dtype | None:  # noqa: ANN401 (any leaf of an operation's operands)
    """The real dtype of a floating or complex tensor (complex64 → float32), None for anything else."""
    if not isinstance(t, torch.Tensor):
        return None
    if t.is_complex():
        return t.dtype.to_real()
    return t.dtype if t.is_floating_point() else None


def _precision(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


class _Narrowings(TorchDispatchMode):
    """Records the result dtypes of operations that narrow a floating operand to a lower precision."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.narrowed: set[torch.dtype] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:  # noqa: ANN401
        out = func(*args, **(kwargs or {}))
        operands = [d for d in map(_real_dtype, tree_leaves((args, kwargs))) if d is not None]
        if operands:
            finest = min(map(_precision, operands))
            for result in map(_real_dtype, tree_leaves(out)):
                if result is not None and _precision(result) > finest:
                    self.narrowed.add(result)
        return out


def narrowest_precision(model: nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """The lowest precision an operation of ``model``'s forward pass on ``x`` narrows a floating operand to
    (module docstring); None where none narrows, or where the pass fails (the probe's own steps then name the
    failure)."""
    watch = _Narrowings()
    try:
        with torch.no_grad(), watch:
            model(x)
    except Exception:  # (the probe's forward pass, run next, reports it)
        return None
    return max(watch.narrowed, key=_precision, default=None)
