"""A learned shift and scale in one call: z = β + v·(α ⊙ y) (``torch.addcmul(β, α, y, value=v)``), β and α parameters
broadcast over the batch (either may be absent: a batch tensor or a constant in its place), y the other factor
(timm's ResMLP ``Affine``, β + α ⊙ x; ConvNeXt-V2's global response normalisation, β + γ ⊙ (x ⊙ N(x))).

As :mod:`.elementwise` (:func:`.registry.broadcast_view`): with S right-aligned to z and padded to S' of z's rank,
the per-example gradients are, over the dimensions S' broadcasts,

    ∇_β ℓ_i = Σ δ_i,    ∇_α ℓ_i = v · Σ δ_i ⊙ y_i,

materialised (the size of the parameter per example); a batch-first operand (or one whose first-dimension slices
each belong to one example) gives the rows. A product of two parameters (α ⊙ α') is left to the exact path.
"""

from __future__ import annotations

from typing import Any

import torch

from dpml.train.rules.registry import Call, Dense, Gather, Pending, Tracked, Use, broadcast_view, rule


@rule(torch.addcmul, torch.Tensor.addcmul)
def addcmul(call: Call) -> Pending | str:
    shift, first, second = call.arg(0, "input"), call.arg(1, "tensor1"), call.arg(2, "tensor2")
    value = call.kwargs.get("value", 1)
    if call.kwargs.get("out") is not None or not isinstance(value, (int, float)) or isinstance(value, bool):
        return "an out= tensor or a value that is not a number"
    if call.tracked(first) is not None and call.tracked(second) is not None:
        return "a product of two parameters"
    scale, other = (first, second) if call.tracked(first) is not None else (second, first)
    parameters: list[tuple[Any, float | None]] = [(shift, None)] if call.tracked(shift) is not None else []
    if call.tracked(scale) is not None:
        parameters.append((scale, float(value)))
    if not parameters:
        return "no parameter among its operands"
    z = call.output
    examples = [call.leading_examples(t) for t in (shift, first, second) if call.tracked(t) is None]
    owners = next((e for e in examples if e is not None and z.dim() >= 1 and e.numel() == z.shape[0]), None)
    if owners is None:
        return "no batch-first operand"
    y = other.detach()
    views: list[tuple[Tracked, tuple[int, ...], Gather, float | None]] = []
    for s, coefficient in parameters:
        found = broadcast_view(call, s, owners)
        if isinstance(found, str):
            return found
        views.append((found[0], found[2], found[3], coefficient))

    def finish(d: torch.Tensor) -> list[Use]:
        uses: list[Use] = []
        for view, reduce, gather, coefficient in views:
            g = d if coefficient is None else d * y * coefficient
            if reduce:
                g = g.sum(reduce, keepdim=True)
            uses.append((view, Dense(gather(g))))
        return uses

    return Pending(z, [call.tracked(s).param for s, _ in parameters], finish)  # type: ignore[union-attr]
