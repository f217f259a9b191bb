"""The affine part of a normalisation, z = x̂ ⊙ γ + β: ``F.layer_norm`` and ``F.group_norm`` (the stock
modules where their hooks do not apply), ``F.rms_norm`` (``nn.RMSNorm``: γ alone, x̂ = x / rms(x)) and
``F.instance_norm`` with an affine (``nn.InstanceNorm*d(affine=True)``). x̂ is recomputed from the recorded input
with the same function without γ, β; ∇_γ ℓ_i = Σ_t x̂_{i,t} ⊙ δ_{i,t} and ∇_β ℓ_i = Σ_t δ_{i,t} over the positions t
sharing γ and β, materialised (they are small); a group norm's over many positions on a CPU, as its layer's, by ATen's
GroupNorm kernels on the batch folded into the channels (:func:`dpml.train.clipping_norms.group_norm_affine_gradients`),
x̂ never formed (BiT's 49 norms, timm's ``GroupNormAct``: 20–22 → 15–16 ms a step at batch 64, ad hoc). A layer or RMS
norm's input may also be the batch's rows flattened or reordered (:meth:`Call.rows`), as before OPT's last norm; a group
or instance norm's may hold each example's slices along its first dimension (:meth:`Call.slices_by_example`: LeViT's
tokens flattened to (B·N, C), each example's maps merged into (B·k, C, H, W)), the sums over t then running over all of
the example's slices.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dpml.train.clipping_norms import group_norm_affine_gradients
from dpml.train.rules.registry import Call, Dense, Pending, Tracked, Use, by_example, rule


def _affine(
    call: Call,
    gamma: Tracked | None,
    beta: Tracked | None,
    layout: Callable[[torch.Tensor], torch.Tensor],
    normalised: Callable[[], torch.Tensor],
    positions: int,
    folded: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None] = lambda d: None,
) -> Pending:
    """The uses of γ and β given δ's per-example layout (B, …) and x̂; ``positions`` the dimension summed;
    ``folded``: both per-example gradients at once from δ where a kernel gives them (else None)."""

    def finish(d: torch.Tensor) -> list[Use]:
        both = folded(d)
        if both is not None:
            return [(t, Dense(g)) for t, g in zip((gamma, beta), both, strict=True) if t is not None]
        d = layout(d)
        uses: list[Use] = []
        if gamma is not None:
            uses.append((gamma, Dense((layout(normalised()) * d).sum(positions))))
        if beta is not None:
            uses.append((beta, Dense(d.sum(positions))))
        return uses

    return Pending(call.output, [t.param for t in (gamma, beta) if t is not None], finish)


def _rows_layout(call: Call, x: torch.Tensor, shape: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor] | str:
    """δ as (B, positions, *shape) for a norm over x's trailing ``shape``: a batch-first x's positions, or the
    batch's rows flattened or reordered (OPT's decoder: (B·T, d) before its last norm) example by example."""
    if call.batch_first(x):
        batch = x.shape[0]
        return lambda d: d.reshape(batch, -1, *shape)
    rows = call.rows(x) if len(shape) == 1 else None
    if rows is None:
        return f"its input (shape {tuple(x.shape)}) has no known batch dimension"
    return rows.of


@rule(F.layer_norm)
def layer_norm(call: Call) -> Pending | str:
    x, shape = call.arg(0, "input"), tuple(call.arg(1, "normalized_shape"))
    weight, bias, eps = call.arg(2, "weight"), call.arg(3, "bias"), call.arg(4, "eps", 1e-5)
    if call.tracked(x) is not None or x.dim() <= len(shape):
        return f"its input (shape {tuple(x.shape)}) is not batch-first"
    layout, recorded = _rows_layout(call, x, shape), x.detach()
    if isinstance(layout, str):
        return layout
    return _affine(
        call, call.tracked(weight), call.tracked(bias), layout, lambda: F.layer_norm(recorded, shape, eps=eps), 1
    )


@rule(F.group_norm)
def group_norm(call: Call) -> Pending | str:
    x, groups = call.arg(0, "input"), call.arg(1, "num_groups")
    weight, bias, eps = call.arg(2, "weight"), call.arg(3, "bias"), call.arg(4, "eps", 1e-5)
    known, rows = call.slices_by_example(x)
    if call.tracked(x) is not None or not known or x.dim() < 2:
        return f"its input (shape {tuple(x.shape)}) is not batch-first"
    channels, recorded = x.shape[1], x.detach()

    def folded(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if rows is not None else group_norm_affine_gradients(recorded.to(d.dtype), d, groups, eps)

    return _affine(
        call,
        call.tracked(weight),
        call.tracked(bias),
        lambda d: by_example(d.reshape(d.shape[0], channels, -1), rows),
        lambda: F.group_norm(recorded, groups, eps=eps),
        2,
        folded,
    )


@rule(F.rms_norm, torch.rms_norm)
def rms_norm(call: Call) -> Pending | str:
    x, shape = call.arg(0, "input"), tuple(call.arg(1, "normalized_shape"))
    weight, eps = call.arg(2, "weight"), call.arg(3, "eps")
    if call.tracked(x) is not None or x.dim() <= len(shape):
        return f"its input (shape {tuple(x.shape)}) is not batch-first"
    layout, recorded = _rows_layout(call, x, shape), x.detach()
    if isinstance(layout, str):
        return layout
    return _affine(call, call.tracked(weight), None, layout, lambda: F.rms_norm(recorded, shape, eps=eps), 1)


@rule(F.instance_norm)
def instance_norm(call: Call) -> Pending | str:
    x, mean, variance = call.arg(0, "input"), call.arg(1, "running_mean"), call.arg(2, "running_var")
    weight, bias = call.arg(3, "weight"), call.arg(4, "bias")
    from_input, eps = call.arg(5, "use_input_stats", True), call.arg(7, "eps", 1e-5)
    known, rows = call.slices_by_example(x)
    if call.tracked(x) is not None or not known or x.dim() < 3:
        return f"its input (shape {tuple(x.shape)}) is not batch-first"
    channels, recorded = x.shape[1], x.detach()
    if from_input:  # (the running statistics, when kept, are neither read nor updated again)
        mean = variance = None
    return _affine(
        call,
        call.tracked(weight),
        call.tracked(bias),
        lambda d: by_example(d.reshape(d.shape[0], channels, -1), rows),
        lambda: F.instance_norm(recorded, mean, variance, use_input_stats=from_input, eps=eps),
        2,
    )
