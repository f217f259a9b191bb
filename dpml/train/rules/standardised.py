"""A weight standardised row by row before a linear use, clipped without the per-example gradients of either weight:
BiT's and NFNet's ``StdConv2d`` (``F.batch_norm`` of the weight seen as (1, C_out, n), no running statistics, no
affine), the weight standardisation of De et al. 2022's DP Wide-ResNets.

Ŵ_c = (W_c − μ_c)·r_c for each of the C_out rows of n numbers, μ_c their mean, r_c = (v_c + ε)^{-1/2}, v_c their
(biased) variance. The use of Ŵ (a convolution, a linear map) gives the factored G'_i = Σ_t δ_t a_tᵀ; batch norm's
backward, exact with ε, maps a row g_c = G'_i[c] to ∇_{W_c} ℓ_i = r_c (g_c − mean(g_c)·1 − Ŵ_c·mean(g_c ⊙ Ŵ_c)). With
ã_t = a_t − mean(a_t)·1, q_c = Σ_t δ_{t,c} mean(a_t), s_c = Σ_t δ_{t,c} (Ŵ_c·a_t) (the use's own output Ŵa_t
weighted by δ) and m_c = Σ_k Ŵ_{c,k} (0 but for rounding):

    ∇_W ℓ_i = F_i − E_i,  F_i = Σ_t (r ⊙ δ_t) ã_tᵀ,  E_i[c] = (r_c s_c / n) Ŵ_c,  F_i[c]·Ŵ_c = r_c (s_c − q_c m_c),
    ‖∇_W ℓ_i‖² = ‖F_i‖² − (2/n) Σ_c r_c² s_c (s_c − q_c m_c) + (1/n²) Σ_c r_c² s_c² ‖Ŵ_c‖²,

F_i's norm ghost or materialised as any factored use's (:func:`.combine.use_norms`), and the clipped sum
Σ_i c_i ∇_W ℓ_i = Σ_i c_i F_i − diag(r/n ⊙ Σ_i c_i s_i) Ŵ. The generic pull-back (:func:`.derived.pull_back_all`) keeps
B × |W| numbers instead (151 M at batch 64 for BiT's 512×512×3×3 weights), and past the keep limit sends the weight to
the exact path.

Taken where the standardisation's one source is a parameter (itself or reshaped, its elements in order) that nothing
else uses, its output feeds no other computation, and the output's uses merge into one factored use over its
(C_out, n) rows; otherwise the generic pull-back runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpml.train.clipping_layers import Piece
from dpml.train.rules.combine import merged_uses, use_norms
from dpml.train.rules.derived import Derived
from dpml.train.rules.registry import Factored, Tracked, Use, in_order

_BATCH_NORM = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


def _in_order(tracked: Tracked, shape: tuple[int, ...]) -> bool:
    """The view holds its parameter's elements in order, in ``shape``."""
    return tuple(tracked.shape()) == shape and in_order(tracked.flat_index(), tracked.param.numel())


def _standardisation(
    node: Derived, nodes: list[Derived], uses: dict[int, list[Use]]
) -> tuple[nn.Parameter, float] | None:
    """(the parameter W, ε) where ``node`` standardises W's rows as the module docstring says; else None."""
    if node.call is None or node.call[0] is not F.batch_norm or len(node.sources) != 1:
        return None
    _, args, kwargs = node.call
    bound: dict[str, Any] = dict(zip(_BATCH_NORM, args, strict=False)) | kwargs
    x, (source, tracked) = bound.get("input"), node.sources[0]
    if any(bound.get(k) is not None for k in ("running_mean", "running_var", "weight", "bias")):
        return None
    if not bound.get("training", False) or source is not x or x.dim() < 2 or x.shape[0] != 1:
        return None
    param = tracked.param
    if not isinstance(param, nn.Parameter) or uses.get(id(param)) or not _in_order(tracked, tuple(x.shape)):
        return None
    others = [other for other in nodes if other is not node]
    if any(id(p) == id(param) for other in others for p in other.params):
        return None  # W enters another computation too
    if any(t.param is node.output for other in others for _, t in other.sources):
        return None  # Ŵ feeds another computation
    return param, float(bound.get("eps", 1e-5))


def _piece(param: nn.Parameter, standardised: torch.Tensor, form: Factored, eps: float) -> Piece:
    """W's piece from the one factored use of Ŵ (module docstring)."""
    rows, n = form.rows, form.cols
    hat = standardised.detach().reshape(rows, n).to(form.u.dtype)
    weight = (
        param.detach().reshape(1, rows, n).to(form.u.dtype)
    )  # r from batch norm's own kernel (torch's var: ≈4× slower)
    r = torch.native_batch_norm(weight, None, None, None, None, True, 0.0, eps)[2]
    u, v = form.u, form.v  # (B, T, C_out), (B, T, n)
    mean_a = v.mean(2, keepdim=True)
    s = (u * (v @ hat.t() if form.applied is None else form.applied)).sum(1)  # (B, C_out)
    q = (u * mean_a).sum(1)
    f_squared, f_sums = use_norms(Factored(u * r, v - mean_a, rows, n))
    scaled = r * s
    squared = f_squared - (2 / n) * (scaled * r * (s - q * hat.sum(1))).sum(1)
    squared = (squared + (scaled.square() * hat.square().sum(1)).sum(1) / n**2).clamp_min(0)

    def sums(factors: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        removed = (r / n * (factors @ s))[:, None] * hat
        return [(param, (f_sums(factors) - removed).reshape(param.shape))]

    return Piece(squared, sums)


def standardised_pieces(nodes: list[Derived], uses: dict[int, list[Use]]) -> list[tuple[Derived, nn.Parameter, Piece]]:
    """(the standardisation, its parameter, the parameter's piece) for each computation of ``nodes`` taken here."""
    taken = []
    for node in nodes:
        found = _standardisation(node, nodes, uses)
        merged = merged_uses(uses.get(id(node.output), [])) if found is not None else []
        if found is None or len(merged) != 1:
            continue
        (view, form), (param, eps) = merged[0], found
        if not isinstance(form, Factored):
            continue
        rows = node.output.shape[1]
        shape = (rows, node.output.numel() // rows)
        if not form.u.is_floating_point() or not form.v.is_floating_point() or (form.rows, form.cols) != shape:
            continue
        if _in_order(view, shape):
            taken.append((node, param, _piece(param, node.output, form, eps)))
    return taken
