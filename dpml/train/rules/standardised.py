"""A weight standardised row by row before a linear use, clipped without the per-example gradients of either weight:
BiT's ``StdConv2d`` (``F.batch_norm`` of the weight seen as (1, C_out, n), no running statistics), NFNet's
``ScaledStdConv2d`` (the same with a gain per output channel as batch norm's weight), the weight standardisation of
De et al. 2022's DP Wide-ResNets (written by hand, :mod:`.row_jacobian` takes it).

Ŵ_c = (W_c − μ_c)·r_c for each of the C_out rows of n numbers, μ_c their mean, r_c = (v_c + ε)^{-1/2}, v_c their
(biased) variance; the weight used is γ_c Ŵ_c + β_c (γ = 1, β = 0 without an affine part). Its use (a convolution, a
linear map) gives the factored G'_i = Σ_t δ_t a_tᵀ; batch norm's backward, exact with ε, maps a row g_c = G'_i[c] to
∇_{W_c} ℓ_i = ρ_c (g_c − mean(g_c)·1 − Ŵ_c·mean(g_c ⊙ Ŵ_c)), ρ = γ ⊙ r. With ã_t = a_t − mean(a_t)·1,
q_c = Σ_t δ_{t,c} mean(a_t), s_c = Σ_t δ_{t,c} (Ŵ_c·a_t) and m_c = Σ_k Ŵ_{c,k} (0 but for rounding):

    ∇_W ℓ_i = F_i − E_i,  F_i = Σ_t (ρ ⊙ δ_t) ã_tᵀ,  E_i[c] = (ρ_c s_c / n) Ŵ_c,  F_i[c]·Ŵ_c = ρ_c (s_c − q_c m_c),
    ‖∇_W ℓ_i‖² = ‖F_i‖² − (2/n) Σ_c ρ_c² s_c (s_c − q_c m_c) + (1/n²) Σ_c ρ_c² s_c² ‖Ŵ_c‖²,
    ∇_{γ_c} ℓ_i = s_c,  ∇_{β_c} ℓ_i = n q_c,

F_i's norm ghost or materialised as any factored use's (:func:`.combine.use_norms`), and the clipped sum
Σ_i c_i ∇_W ℓ_i = Σ_i c_i F_i − diag(ρ/n ⊙ Σ_i c_i s_i) Ŵ; γ's and β's per-example gradients, C_out numbers each,
become dense uses of theirs (a gain computed from a parameter, NFNet's ``gain * scale``, is then carried back by
the generic pull-back). Without an affine part s is read from the use's own output Ŵa_t where its rule kept it (a
convolution's, :class:`.registry.Factored`'s ``applied``); otherwise it is one product, a_t against Ŵ (dividing the
output by γ instead would lose s's digits where γ is small, and γ starts at 0 in NFNet's last convolutions). The
generic pull-back (:func:`.pull_backs.pull_back_all`) keeps B × |W| numbers instead (151 M at batch 64 for BiT's
512×512×3×3 weights), and past the keep limit sends the weight to the exact path.

Where the use forms each G'_i on demand instead (:class:`.registry.Computed`: a convolution's kernel gradients where
they cost less than a ghost norm), each slice of them is carried back by the row map above as formed (q_c and s_c
read off the rows), and the clipped sum, where they are not kept, is the operation's own Σ_i c_i G'_i with each row
less its mean, times ρ, less diag(ρ/n ⊙ Σ_i c_i s_i) Ŵ. Where the use gives every G'_i materialised
(:class:`.registry.Dense`: a grouped convolution's within the keep limit), they are carried back in place, and the
clipped sum is Σ_i c_i of them.

Taken where the standardisation's sources are the parameter (itself or reshaped, its elements in order), which
nothing else uses, and its gain and shift; its output feeds no other computation; and the output's uses merge into
one use over its (C_out, n) rows. Otherwise the generic pull-back runs.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpml.train.clipping_layers import Piece
from dpml.train.clipping_norms import row_norms_squared
from dpml.train.rules.combine import computed_norms, merged_uses, row_form, use_norms
from dpml.train.rules.derived import Derived
from dpml.train.rules.flat_indices import in_order
from dpml.train.rules.registry import Computed, Dense, Factored, Tracked, Use
from dpml.train.rules.row_affine import row_moments

_BATCH_NORM = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


@dataclass
class Standardisation:
    """A computation that standardises the rows of the parameter ``param`` (ε ``eps``), then scales and shifts them
    by ``gain`` and ``shift`` (``F.batch_norm``'s weight and bias: NFNet's gain; None: none), each a tensor of C_out
    values and the view it is tracked as (None: a constant)."""

    param: nn.Parameter
    eps: float
    gain: tuple[torch.Tensor, Tracked | None] | None
    shift: tuple[torch.Tensor, Tracked | None] | None
    output: torch.Tensor  # (γ ⊙ Ŵ + β as the forward pass computed it)


def _in_order(tracked: Tracked, shape: tuple[int, ...]) -> bool:
    """The view holds its parameter's elements in order, in ``shape``."""
    whole = tracked.index is None or in_order(tracked.index, tracked.param.numel())
    return tuple(tracked.shape()) == shape and whole


def _standardisation(node: Derived, nodes: list[Derived], uses: dict[int, list[Use]]) -> Standardisation | None:
    """What ``node`` is where it standardises a parameter's rows as the module docstring says; else None."""
    if node.call[0] is not F.batch_norm:
        return None
    _, args, kwargs = node.call
    bound: dict[str, Any] = dict(zip(_BATCH_NORM, args, strict=False)) | kwargs
    x, gain, shift = bound.get("input"), bound.get("weight"), bound.get("bias")
    views = {id(t): tracked for t, tracked in node.sources}
    if bound.get("running_mean") is not None or bound.get("running_var") is not None or not bound.get("training"):
        return None
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] != 1 or id(x) not in views:
        return None
    if len(views) != len({id(t) for t in (x, gain, shift) if isinstance(t, torch.Tensor)}):
        return None  # (a source that is none of the three, or one tensor in two places)
    tracked = views[id(x)]
    param = tracked.param
    if not isinstance(param, nn.Parameter) or uses.get(id(param)) or not _in_order(tracked, tuple(x.shape)):
        return None
    others = [other for other in nodes if other is not node]
    if any(id(p) == id(param) for other in others for p in other.params):
        return None  # W enters another computation too
    if any(t.param is node.output for other in others for _, t in other.sources):
        return None  # Ŵ feeds another computation
    affine = [None if t is None else (t.detach(), views.get(id(t))) for t in (gain, shift)]
    return Standardisation(param, float(bound.get("eps", 1e-5)), affine[0], affine[1], node.output)


@dataclass(frozen=True)
class _Rows:
    """Ŵ's ingredients, all but Ŵ: each row's mean μ and r = (v + ε)^{-1/2} (C_out,), and ρ = γ ⊙ r."""

    mean: torch.Tensor
    r: torch.Tensor
    scale: torch.Tensor


def _standardised(found: Standardisation, rows: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, _Rows]:
    """Ŵ (C_out, n) and its rows' μ, r and ρ = γ ⊙ r: r from each row's mean and variance (one mean and one norm,
    :func:`.row_affine.row_moments`; batch norm's kernel again cost a tenth of BiT's step), Ŵ the forward pass's own
    output where there is no gain or shift, else (W − μ)·r."""
    weight = found.param.detach().reshape(rows, n).to(dtype)
    mean, var = row_moments(weight)
    mean, r = mean.to(dtype), (var + found.eps).rsqrt().to(dtype)
    hat = _own_output(found, rows, n, dtype)
    if hat is None:
        hat = (weight - mean[:, None]) * r[:, None]
    scale = r if found.gain is None else r * found.gain[0].reshape(-1).to(dtype)
    return hat, _Rows(mean, r, scale)


def _own_output(found: Standardisation, rows: int, n: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Ŵ as the forward pass made it, where there is no gain or shift (else None)."""
    if found.gain is None and found.shift is None:
        return found.output.detach().reshape(rows, n).to(dtype)
    return None


def _less_rows_of_hat(total: torch.Tensor, k: torch.Tensor, found: Standardisation, moments: _Rows) -> torch.Tensor:
    """total − diag(k) Ŵ, in place, without Ŵ held from the norms to the sums: the forward pass's own Ŵ, else
    diag(k ⊙ r)(W − μ1ᵀ) from the parameter (a gained Ŵ is a copy of the weight: every standardised weight's held at
    once was 52 MiB of NF-ResNet-26's 213 MiB DP peak at batch 64, against the non-private step's 112)."""
    rows, n = total.shape
    own = _own_output(found, rows, n, total.dtype)
    if own is not None:
        return total.addcmul_(k[:, None], own, value=-1)
    weight = found.param.detach().reshape(rows, n).to(total.dtype)
    return total.addcmul_(
        (k * moments.r.to(total.dtype))[:, None], weight - moments.mean.to(total.dtype)[:, None], value=-1
    )


def _carried_back(
    grads: torch.Tensor, hat: torch.Tensor, rho: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch norm's backward on every row g_c of ``grads`` (B, C_out, n), in place: ρ_c (g_c − q_c·1 − (s_c/n) Ŵ_c) with
    q_c = mean(g_c) and s_c = ⟨Ŵ_c, g_c⟩ (module docstring); the carried rows, q and s (B, C_out)."""
    n = grads.shape[2]
    q, s = grads.mean(2), torch.linalg.vecdot(grads, hat, dim=2)
    return grads.sub_(q[..., None]).mul_(rho[:, None]).addcmul_(-(rho * s / n)[..., None], hat), q, s


def _computed_piece(found: Standardisation, form: Computed) -> tuple[Piece, torch.Tensor, torch.Tensor]:
    """W's piece, and s and n·q, from a use whose per-example gradients G_i the operation forms on demand (a
    convolution's kernel gradients): each slice's rows g_c carried back by batch norm's backward,
    ρ_c (g_c − q_c·1 − (s_c/n) Ŵ_c) with q_c = mean(g_c), s_c = ⟨Ŵ_c, g_c⟩; where they are not kept, the clipped sum
    from the operation's own Σ_i c_i G_i, whose rows less their means times ρ, less diag(ρ/n ⊙ Σ_i c_i s_i) Ŵ."""
    rows, n = form.shape
    hat, moments = _standardised(found, rows, n, found.param.dtype)
    scale = moments.scale
    found_s: list[torch.Tensor] = []
    found_q: list[torch.Tensor] = []

    def carried(grads: torch.Tensor, examples: slice) -> torch.Tensor:
        back, q, s = _carried_back(grads, hat.to(grads.dtype), scale.to(grads.dtype))  # (its own)
        found_s.append(s)
        found_q.append(q)
        return back

    def total(factors: torch.Tensor) -> torch.Tensor:
        rho, s = scale.to(factors.dtype), torch.cat(found_s).to(factors.dtype)
        g = form.weighted_sum(factors).reshape(rows, n)  # (one weight gradient, formed for this)
        return _less_rows_of_hat(
            g.sub_(g.mean(1, keepdim=True)).mul_(rho[:, None]), rho / n * (factors @ s), found, moments
        )

    squared, sums = computed_norms(form, carried, total)
    piece = Piece(squared, lambda factors: [(found.param, sums(factors).reshape(found.param.shape))])
    return piece, torch.cat(found_s), torch.cat(found_q) * n


def _dense_piece(found: Standardisation, grads: torch.Tensor) -> tuple[Piece, torch.Tensor, torch.Tensor]:
    """W's piece, and s and n·q, from a use that gives every example's G_i materialised, (B, C_out, n) (a grouped
    convolution's within the keep limit): each row carried back in place by batch norm's backward, as
    :func:`_computed_piece` carries formed ones, ρ_c (g_c − q_c·1 − (s_c/n) Ŵ_c); the clipped sum Σ_i c_i of the carried
    ones. (The generic pull-back ran batch norm's backward under vmap, B × |W| numbers more: NFNet-F0's four grouped
    256-channel kernels at batch 64 held 288 MiB of its outputs at the DP step's peak.)"""
    _, rows, n = grads.shape
    hat, moments = _standardised(found, rows, n, grads.dtype)
    carried, q, s = _carried_back(grads, hat, moments.scale.to(grads.dtype))

    def sums(factors: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(found.param, torch.einsum("b,b...->...", factors, carried).reshape(found.param.shape))]

    return Piece(row_norms_squared(carried), sums), s, q * n


def _products(found: Standardisation, form: Factored, hat: torch.Tensor) -> torch.Tensor:
    """Ŵ_c · a_t (B, T, C_out): the use's own output γ_c (Ŵ_c · a_t) divided by γ_c where it kept it and there is no
    shift (γ scales every term of the row's sum alike, so the quotient has the product's own rounding), one product
    for the rows whose γ is 0 (NFNet starts some there) or where the output is not at hand."""
    if form.applied is None or found.shift is not None:
        return form.v @ hat.t()
    if found.gain is None:
        return form.applied
    gain = found.gain[0].reshape(-1).to(form.applied.dtype)
    zero = gain == 0
    product = form.applied / torch.where(zero, torch.ones_like(gain), gain)
    if bool(zero.any()):
        product[..., zero] = form.v @ hat[zero].t()
    return product


def _piece(found: Standardisation, form: Factored) -> tuple[Piece, torch.Tensor, torch.Tensor]:
    """W's piece from the one factored use of γ ⊙ Ŵ + β (module docstring), and the per-example gradients of γ and β,
    s and n·q (B, C_out)."""
    rows, n, param = form.rows, form.cols, found.param
    dtype = form.u.dtype
    hat, moments = _standardised(found, rows, n, dtype)
    scale = moments.scale  # ρ = γ ⊙ r
    u, v = form.u, form.v  # (B, T, C_out), (B, T, n)
    mean_a = v.mean(2, keepdim=True)
    product = _products(found, form, hat)
    s = (u * product).sum(1)  # (B, C_out)
    q = (u * mean_a).sum(1)
    f_squared, f_sums = use_norms(Factored(u * scale, v - mean_a, rows, n))
    scaled = scale * s
    squared = f_squared - (2 / n) * (scaled * scale * (s - q * hat.sum(1))).sum(1)
    squared = (squared + (scaled.square() * hat.square().sum(1)).sum(1) / n**2).clamp_min(0)

    def sums(factors: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        total = f_sums(factors).reshape(rows, n)  # (formed for this: changed in place)
        return [(param, _less_rows_of_hat(total, scale / n * (factors @ s), found, moments).reshape(param.shape))]

    return Piece(squared, sums), s, q * n


def standardised_pieces(
    nodes: list[Derived], uses: dict[int, list[Use]], ruled: Collection[int], params: dict[int, nn.Parameter]
) -> dict[int, tuple[list[Derived], Piece]]:
    """{id(W): ([the standardisation], W's piece)} for each computation of ``nodes`` taken here (W's id among
    ``ruled``); the per-example gradients of a gain and shift join ``uses`` (dense, (B, C_out)), for the rules or the
    pull-back to take on; W, and the gain and shift where they are parameters, join ``params`` (by id)."""
    taken = {}
    for node in nodes:
        found = _standardisation(node, nodes, uses)
        merged = merged_uses(uses.get(id(node.output), [])) if found is not None else []
        if found is None or id(found.param) not in ruled or len(merged) != 1:
            continue
        view, form = merged[0]
        rows = node.output.shape[1]
        shape = (rows, node.output.numel() // rows)
        dense = (
            isinstance(form, Dense) and form.grads.is_floating_point() and form.grads[0].numel() == shape[0] * shape[1]
        )
        if not (dense or row_form(form, shape)) or not _in_order(view, shape):
            continue
        if isinstance(form, Dense):
            piece, gain, shift = _dense_piece(found, form.grads.reshape(-1, *shape))
        else:
            piece, gain, shift = _piece(found, form) if isinstance(form, Factored) else _computed_piece(found, form)  # type: ignore[arg-type]
        for affine, grads in ((found.gain, gain), (found.shift, shift)):
            tracked = None if affine is None else affine[1]
            if tracked is not None and id(tracked.param) in uses:
                uses[id(tracked.param)].append((tracked, Dense(grads.reshape(grads.shape[0], *tracked.shape()))))
                params[id(tracked.param)] = tracked.param
        taken[id(found.param)] = ([node], piece)
        params[id(found.param)] = found.param
        del uses[id(node.output)], merged, view, form  # (what the piece does not read goes now, not with the pass)
    return taken
