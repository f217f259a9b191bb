"""Elementwise affine uses of a parameter broadcast over the batch: z = x ⊙ S (learned scales), z = x + S
or x − S (cls tokens, positional embeddings added, biases written by hand), S the parameter or a tracked
view of it (a shared embedding lookup, ``pos[:, :T]``, ``cls.expand(B, -1, -1)``).

With S right-aligned to z and padded to S' of z's rank: ∇_S ℓ_i = Σ over the dimensions S' broadcasts of
(∂ℓ_i/∂z_i) ⊙ x_i (product) or ± α ∂ℓ_i/∂z_i (sum), materialised (the size of S per example). S' must be
shared (leading size 1) or expanded over the batch (the same elements in every example's slice); the other
operand batch-first, or with a first dimension whose slices each belong to one example (Swin's attention
windows, (B·windows, …)): its rows' gradients are then added up per example; or with its examples along another
dimension (XLNet's time-major queries plus a per-head bias, (T, B, H, d) + (H, d); RecurrentGemma's heads-first
gates plus a bias per head, (H, B·T, d) + (H, 1, d)), read with that one first.
S + c and S − c with c a constant of every example (``1 + w``) are S again, shifted: their result is tracked as a
view of the parameter, and the operation that meets the batch forms the gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from dpml.train.rules.registry import Call, Dense, Pending, Shared, Tracked, Use, broadcast_view, rule

T = torch.Tensor
_SUMS = {torch.add, T.add, T.__add__, T.__radd__}
_DIFFERENCES = {torch.sub, T.sub, T.__sub__}
_PRODUCTS = {torch.mul, T.mul, T.__mul__, T.__rmul__}  # (in place, h += pos: the recorder applies these to a copy)


def _coefficient(call: Call, s_first: bool) -> float | None:
    alpha = float(call.kwargs.get("alpha", 1.0))
    if call.func in _SUMS:
        return 1.0 if s_first else alpha
    if call.func in _DIFFERENCES:
        return 1.0 if s_first else -alpha
    if call.func is T.__rsub__:  # self.__rsub__(other) = other − alpha·self
        return -alpha if s_first else 1.0
    return None


def _shifted(call: Call, s: torch.Tensor, x: Any, tracked: Tracked, coefficient: float | None) -> Shared | None:
    """S + c or S − c, c a number (or a 0-dimensional tensor without gradient; Gemma's RMSNorm scales by 1 + w):
    the result is S's view again (∂z/∂S = I), tracked like ``w.t()``; None otherwise."""
    if coefficient != 1.0 or isinstance(x, bool):
        return None
    constant = isinstance(x, (int, float)) or (isinstance(x, torch.Tensor) and x.dim() == 0 and not x.requires_grad)
    z = call.output
    if not constant or not isinstance(z, torch.Tensor) or z.shape != s.shape:
        return None
    return Shared([(z, Tracked(tracked.param, tracked.index, tracked.shared))])


@rule(*_SUMS, *_DIFFERENCES, T.__rsub__, *_PRODUCTS)
def elementwise(call: Call) -> Pending | Shared | str:
    first: Any = call.args[0]
    second: Any = call.args[1] if len(call.args) > 1 else call.kwargs.get("other")
    s_first = call.tracked(first) is not None
    s, x = (first, second) if s_first else (second, first)
    tracked, z = call.tracked(s), call.output
    if call.tracked(x) is not None:
        return "two parameters"
    shifted = _shifted(call, s, x, tracked, _coefficient(call, s_first))  # type: ignore[arg-type]
    if shifted is not None:
        return shifted
    owners, at = call.leading_examples(x), 0
    axis = call.example_axis(x) if owners is None and isinstance(x, torch.Tensor) and z.dim() == x.dim() else None
    if axis is not None:  # the batch along another dimension (time-major, heads first): read it first
        at, owners = axis
    if owners is None or z.dim() < 1 or z.shape[at] != x.shape[at]:
        return "no operand with a batch dimension"
    found = broadcast_view(call, s, owners, at)  # (rows: the batch, or rows that each belong to one example)
    if isinstance(found, str):
        return found
    view, _, reduce, gather = found
    coefficient = _coefficient(call, s_first)
    other: Any = x.detach() if coefficient is None else None
    scale = 1.0 if coefficient is None else coefficient

    def finish(d: torch.Tensor) -> list[Use]:
        g = d * other if other is not None else (d * scale if scale != 1.0 else d)
        g = g.movedim(at, 0) if at else g
        if reduce:
            g = g.sum(reduce, keepdim=True)
        return [(view, Dense(gather(g)))]

    return Pending(z, [tracked.param], finish)  # type: ignore[union-attr]
