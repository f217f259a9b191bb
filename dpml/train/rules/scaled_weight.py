"""A weight divided by a scalar function of itself, T = W / s(W), clipped without the per-example gradients of
either: ``torch.nn.utils.parametrizations.spectral_norm`` (s = σ = uᵀ W v, u and v from the power iteration, held
fixed), a whole-tensor normalisation W / ‖W‖ (``weight_norm(…, dim=None)``'s direction), however it is written.

T's use gives each example's gradient G_i (T's shape); the chain rule through T = W / s(W) gives

    ∇_W ℓ_i = J G_i = G_i / s − (⟨G_i, W⟩ / s²) ∇s(W) = α G_i + ⟨T, G_i⟩ E,   α = 1/s,  E = −∇s / s,       (1)

a scale of the identity plus a rank-one map whose functional is ⟨T, ·⟩ (spectral norm: E = −u vᵀ / σ). The rule is
taken where a step of the computation reduces W to one number (s) and (1) holds, fitted and checked at each pass
as :mod:`.row_jacobian` checks its row maps — the whole weight one row — by three vector-Jacobian products of the
recorded computations on the cotangents

    g (random, ⊥ T),   T,   r (random):

J g = α g gives α, J T = α T + ‖T‖² E gives E, and (1) applied to r must give J r to rounding. Every T = W · f(W)
with f scalar has the form (W / max|W|, W · tanh(mean W)); a map of another kind, whose functional is not along T
(global centring W − mean(W): ⟨1, ·⟩), fails there and takes the generic pull-back.

With s_i = ⟨T, G_i⟩ and e_i = ⟨E, G_i⟩, each example's squared norm and the clipped sum are

    ‖∇_W ℓ_i‖² = α² ‖G_i‖² + 2 α s_i e_i + s_i² ‖E‖²,    Σ_i c_i ∇_W ℓ_i = α Σ_i c_i G_i + (Σ_i c_i s_i) E;

for a factored use G_i = Σ_t u_t v_tᵀ, ‖G_i‖² is the use's own (ghost or materialised) norm, s_i = Σ_t u_t · (T v_t)
reads the use's own product where its rule kept it, and e_i = Σ_t u_t · (E v_t) is one product with E (where E is
of rank one, a bᵀ, as spectral norm's: Σ_t (u_t · a)(b · v_t)), where the generic pull-back forms B × |W| numbers
and carries them through the chain. A use whose G_i the operation forms on demand (a convolution's kernel) is
carried back slice by slice by (1). α and E come from W alone, never from the batch; norms and sums come from the
same (1), so each example's clipped share is within C whatever they are, up to the rounding of the expansion: where
J G_i is small beside α G_i (G_i nearly along the direction s removes), the terms cancel and their rounding (of
α² ‖G_i‖², say) is left as absolute error, which could put the norm below J G_i's and let its share past C. So each
squared norm of a factored use is raised by :data:`ROUNDING_GUARD` ulps of the terms' absolute sum, so that
rounding up to that size cannot put it below J G_i's; a norm without cancellation is raised by a few parts in a
million in float32 (in float64, the probe's check, far less than its tolerance). A use formed on demand is carried
back as the vectors J G_i themselves, whose norms are those of the numbers added."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from dpml.train.clipping_layers import Piece
from dpml.train.rules.combine import computed_norms, merged_uses, row_form, use_norms
from dpml.train.rules.derived import Derived, pulled_back_probes
from dpml.train.rules.registry import Computed, Factored, Use, in_order
from dpml.train.rules.row_jacobian import ComputationGraph, reduces_to_a_number, within_rounding

_PROBE_SEED = 20190228  # the probes' own generator: the model's random draws are left as they were
ROUNDING_GUARD = 64  # the expanded norm's terms' rounding, ulps of the use's precision, added to each squared norm


@dataclass(frozen=True)
class ScaledMap:
    """(1) of the module docstring at the current W: α, E (T's shape, flattened as (C, n)) and T itself."""

    alpha: float
    direction: torch.Tensor  # E
    weight: torch.Tensor  # T
    factors: tuple[torch.Tensor, torch.Tensor] | None = None  # (a, b) where E = a bᵀ to rounding (spectral norm's)


def fitted_scaled_map(chain: list[Derived], param: nn.Parameter, output: torch.Tensor) -> ScaledMap | None:
    """(1) fitted to the chain's Jacobian at the current W and checked (module docstring); None where it does not
    hold to rounding, or where the weight's precision is below float32's."""
    if torch.finfo(output.dtype).eps > torch.finfo(torch.float32).eps or any(node.again.failure() for node in chain):
        return None
    return scaled_map_of(lambda probes: pulled_back_probes(chain, output, probes, param), output.detach())


def scaled_map_of(pull_back: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> ScaledMap | None:
    """(1) of the map whose vector-Jacobian products ``pull_back`` gives ((k, *T.shape) cotangents → (k, |W|)), at
    T = ``t``: fitted on the probes g ⊥ T, T and r, and checked on all three to rounding; None where it fails."""
    dtype, flat = t.dtype, t.reshape(-1)
    squared = float(flat.double().square().sum())
    if squared == 0.0:
        return None
    generator = torch.Generator(device=t.device).manual_seed(_PROBE_SEED)
    drawn = torch.randn(2, flat.numel(), generator=generator, device=t.device, dtype=dtype)
    apart = drawn[0] - (float((drawn[0].double() * flat.double()).sum()) / squared) * flat  # g ⊥ T
    pulled = pull_back(torch.stack([apart, flat, drawn[1]]).reshape(3, *t.shape)).reshape(3, -1).to(dtype)
    alpha = float((pulled[0].double() * apart.double()).sum() / apart.double().square().sum())
    direction = (pulled[1] - alpha * flat) / squared
    predicted = alpha * drawn[1] + float((flat.double() * drawn[1].double()).sum()) * direction
    fitted = torch.stack([alpha * apart, alpha * flat + squared * direction, predicted])
    residuals = (pulled - fitted)[:, None]  # (3 probes, one row, |W|)
    sizes = (pulled.norm(dim=1) + fitted.norm(dim=1))[:, None]
    if not all(within_rounding(r, scale, dtype) for r, scale in zip(residuals, sizes, strict=True)):
        return None
    count = t.shape[0]
    direction = direction.reshape(count, -1)
    return ScaledMap(alpha, direction, t.reshape(count, -1), _rank_one(direction, generator))


def _rank_one(e: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a, b) with E = a bᵀ to rounding, where E is of rank one (spectral norm's −u vᵀ / σ): from E x and Eᵀ y for
    random x, y, E = (E x)(Eᵀ y)ᵀ / (yᵀ E x) exactly where it is; None otherwise. Each example's ⟨E, G_i⟩ is then
    Σ_t (u_t · a)(b · v_t), not a product with E."""
    x, y = (torch.randn(k, generator=generator, device=e.device, dtype=torch.float64) for k in reversed(e.shape))
    a, b = e.double() @ x, e.double().t() @ y
    scale = float(y @ a)
    if scale == 0.0:
        return None
    left = a / scale
    residual = (e.double() - torch.outer(left, b))[None]
    if not within_rounding(residual.to(e.dtype), e.norm()[None], e.dtype):
        return None
    return left.to(e.dtype), b.to(e.dtype)


def _factored_piece(found: ScaledMap, form: Factored, param: nn.Parameter) -> Piece:
    """W's piece from T's one factored use (module docstring)."""
    dtype = form.u.dtype
    t, e = found.weight.to(dtype), found.direction.to(dtype)
    u, v = form.u, form.v  # (B, S, C), (B, S, n)
    product = form.applied if form.applied is not None else v @ t.t()  # T v_s: the use's own, or one product
    s = torch.linalg.vecdot(u, product, dim=1).sum(1, dtype=torch.float64)  # ⟨T, G_i⟩ (B,)
    if found.factors is not None:  # ⟨E, G_i⟩ = Σ_t (u_t · a)(b · v_t)
        left, right = (f.to(dtype) for f in found.factors)
        along = ((u @ left) * (v @ right)).sum(1, dtype=torch.float64)
    else:
        along = torch.linalg.vecdot(u, v @ e.t(), dim=1).sum(1, dtype=torch.float64)  # ⟨E, G_i⟩ (B,)
    g_squared, g_sums = use_norms(Factored(u, v, form.rows, form.cols))
    alpha, e_squared = found.alpha, float(e.double().square().sum())
    terms = [alpha**2 * g_squared.double(), 2 * alpha * s * along, s.square() * e_squared]
    squared = terms[0] + terms[1] + terms[2]
    squared += ROUNDING_GUARD * torch.finfo(dtype).eps * sum(term.abs() for term in terms)  # (never below J G_i's)

    def sums(factors: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        total = g_sums(factors).mul_(alpha).add_(e * (factors.double() @ s).to(e.dtype))  # (fresh)
        return [(param, total.reshape(param.shape))]

    return Piece(squared.clamp_min(0).to(g_squared.dtype), sums)


def _computed_piece(found: ScaledMap, form: Computed, param: nn.Parameter) -> Piece:
    """W's piece from T's one use whose per-example gradients G_i the operation forms on demand: each slice's G_i
    carried back by (1), and the clipped sum, where they are not kept, from the operation's own Σ_i c_i G_i."""
    count, n = form.shape
    shares: list[torch.Tensor] = []  # ⟨T, G_i⟩ of each slice in turn

    def carried(grads: torch.Tensor, examples: slice) -> torch.Tensor:
        t, e = found.weight.to(grads.dtype), found.direction.to(grads.dtype)
        s = (grads * t).sum((1, 2))
        shares.append(s)
        return grads.mul_(found.alpha).add_(s[:, None, None] * e)  # (the slice's own, formed for this)

    def total(factors: torch.Tensor) -> torch.Tensor:
        s = torch.cat(shares).to(factors.dtype)  # (every example's, in batch order)
        weighted = form.weighted_sum(factors).reshape(count, n).mul_(found.alpha)  # (formed for this)
        return weighted.add_(found.direction.to(factors.dtype) * (factors @ s))

    squared, sums = computed_norms(form, carried, total)
    return Piece(squared, lambda factors: [(param, sums(factors).reshape(param.shape))])


def scaled_weight_pieces(
    nodes: list[Derived],
    uses: dict[int, list[Use]],
    ruled: Collection[int],
    params: dict[int, nn.Parameter],
    taken: Collection[int] = (),
) -> dict[int, tuple[list[Derived], Piece]]:
    """{id(W): (the computations from W to T, W's piece)} for each T = W / s(W) of ``nodes`` that (1) describes (W's
    id among ``ruled`` and not ``taken`` already); W joins ``params`` (by id)."""
    found: dict[int, tuple[list[Derived], Piece]] = {}
    graph = ComputationGraph(nodes)
    for node in nodes:
        merged = merged_uses(uses.get(id(node.output), []))
        if len(merged) != 1 or node.output.dim() < 2 or not node.output.is_floating_point():
            continue
        view, form = merged[0]
        count = node.output.shape[0]
        shape = (count, node.output.numel() // count)
        if not row_form(form, shape) or not (view.index is None or in_order(view.index, count * shape[1])):
            continue
        chain = graph.chain(node, uses)
        if chain is None or id(chain[1]) not in ruled or id(chain[1]) in taken or id(chain[1]) in found:
            continue
        steps, param = chain
        if param.numel() != node.output.numel() or node.output.numel() < 3 or not reduces_to_a_number(steps):
            continue
        fitted = fitted_scaled_map(steps, param, node.output)
        if fitted is None:
            continue
        piece = _factored_piece if isinstance(form, Factored) else _computed_piece
        found[id(param)] = (steps, piece(fitted, form, param))  # type: ignore[arg-type]
        params[id(param)] = param
    return found
