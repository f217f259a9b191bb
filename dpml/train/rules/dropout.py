"""Dropout on rows alike: a computation on parameters alone carried on one row (:func:`.derived.first_rows`: MarkupLM's
XPath tables looked up at ids the forward makes, a DETR's queries expanded over the batch) meets dropout, which
draws a mask per row, so that its output's rows are no longer one row's repeats. Dropout multiplies its input by the
mask it draws, M ∈ {0, 1/(1 − p)} elementwise (per channel for ``dropout1d/2d/3d``), so with S the repeated row,

    dropout(S expanded over the batch) = S ⊙ M,   M of one row per example,                              (1)

an elementwise product of the tracked S with an operand of the batch's rows: the product rule
(:mod:`.elementwise`) takes it, each example's gradient of S being δ_i ⊙ M_i (δ the backward pass's gradient of the
output), and the chain before the dropout stays carried on its one row. Without (1), the dropout's output was a
computation on parameters of B rows, each example's gradient of it pulled back through all B rows (B times the
chain's cost), or, where its use has no rule for such an operand (a product with the batch's keys), the exact path.

M is drawn by the same call on ones of the input's shape: the same draws from the same generator state (their
number depends on the shape, not on the values), so the model's later draws are what they would have been; and
S ⊙ M is, value for value, what the call computes (it multiplies its input by that mask). The probe judges the
product's per-example gradients against autograd as it judges every rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dpml.train.rules.registry import Tracked

MASKING = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, torch.dropout, torch.feature_dropout})
"""The dropouts that multiply their input by the mask they draw (alpha dropout also shifts it: not here)."""


def _rate_and_training(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, bool]:
    """(p, training) of ``F.dropout(input, p=0.5, training=True, …)`` or ``torch.dropout(input, p, train)``."""
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
    return float(p), bool(training)


def mask_of_repeated_rows(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tracked: Callable[[Any], Tracked | None], batch: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(S, M) of (1) where ``func`` is one of :data:`MASKING`, in training with p > 0, out of place, on a tracked
    view whose first dimension is the batch's and repeats one row (its index's stride 0): M drawn by the call on
    ones, B rows; None otherwise, with nothing drawn."""
    if func not in MASKING or batch <= 1 or not args or not isinstance(args[0], torch.Tensor):
        return None
    source, view = args[0], tracked(args[0])
    if view is None or view.index is None or source.dim() < 1 or source.shape[0] != batch:
        return None
    if view.index.stride(0) != 0 or kwargs.get("inplace", len(args) > 3 and args[3]):
        return None
    p, training = _rate_and_training(args, kwargs)
    if not training or p <= 0.0:
        return None
    with torch.no_grad():
        mask = func(torch.ones_like(source), *args[1:], **kwargs)
    return source, mask
