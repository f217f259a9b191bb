"""A weight computed from one parameter row by row, however it is written, clipped without the per-example
gradients of either: weight standardisation by hand (Qiao et al. 2019; De et al. 2022's DP Wide-ResNets), as
``(w − w.mean(…)) / (w.std(…) + ε)``, ``(w − μ) * torch.rsqrt(w.var(…) + ε)``, biased or not, in one step or
several; row-wise normalisation ``w / w.norm(…)``, ``F.normalize``; centring alone; any constant scale
(``F.batch_norm``'s form, with a gain and shift, is :mod:`.standardised`'s).

T = f(W), both seen as C rows of n numbers, T used by one use whose per-example gradients have those rows (a
convolution, a linear map): the use gives g_c = G_i[c] and ∇_{W_c} ℓ_i = J_cᵀ g_c where f acts row by row
(J_c = ∂T_c/∂W_c). The rule is taken where each J_cᵀ is a scale of the identity plus a map within U_c = [1, T_c]
(n × 2):

    J_cᵀ = α_c I + U_c M_c U_cᵀ                                                                              (1)

which every function of the kind above satisfies: with z = W_c − mean(W_c)·1 and T_c = φ(σ²(W_c))·z + k·1,
J_cᵀ = φ·(I − 11ᵀ/n) + (2φ'/n)·z zᵀ, and z ∈ span(1, T_c). α and M come from the operations where
:mod:`.row_affine` reads them (every operation listed there: no Jacobian run at all); otherwise (1) is fitted and
checked, not assumed, at each pass, by three vector-Jacobian products of the recorded operations
(:func:`.pull_backs.pulled_back_probes`) on the cotangents

    g₁ + 1,   g₂ + T,   r        (g₁, g₂ random and orthogonal to 1 and T_c in each row; r random),

each a random scale per row times a random row. The parts along g₁ and g₂ give α_c twice; the parts in U_c give
J_cᵀ1 = U_c a₁ and J_cᵀT_c = U_c a₂ (least squares, K_c = U_cᵀU_c), so X_c = [a₁ a₂] − α_c I and M_c = X_c K_c⁺. The
rule is taken only where both residuals, and (1) applied to r, are within rounding (a random r finds a map that
is not row by row, such as W / ‖W‖_F, which the first two pass). Else the generic pull-back runs.

Each example's gradient is then, with p_c = ⟨1, g_c⟩, s_c = ⟨T_c, g_c⟩, (e_c, h_c) = M_c (p_c, s_c)ᵀ and
g̃_c = g_c − (p_c/n)·1:

    ∇_{W_c} ℓ_i = α_c g̃_c + e'_c 1 + h_c T_c,   e'_c = e_c + α_c p_c / n,
    ‖∇_W ℓ_i‖² = ‖F_i‖² + Σ_c [2 α_c h_c (s_c − p_c T̄_c) + n e'_c² + 2 e'_c h_c ΣT_c + h_c² ‖T_c‖²],

for a factored use G_i = Σ_t u_t v_tᵀ: F_i = Σ_t (α ⊙ u_t) ṽ_tᵀ, ṽ_t = v_t − mean(v_t)·1 (its norm ghost or
materialised as any factored use's, :func:`.combine.use_norms`; centred so that a large mean in the activations does
not cancel digits), T̄_c = ΣT_c / n, s_c read from the use's own product T v_t where its rule kept it
(:class:`.registry.Factored`'s ``applied``), and the clipped sum Σ_i c_i F_i + (Σ_i c_i e'_i) 1ᵀ + diag(Σ_i c_i h_i) T.
For a use whose G_i the operation forms on demand (:class:`.registry.Computed`), each slice of them is carried back
as formed, and the clipped sum, where they are not kept, comes from the operation's own Σ_i c_i G_i. Norms and sum
come from the same per-example gradients, so each example's clipped contribution is within C whatever α and M are
(they are computed from W alone, never from the batch). The generic pull-back keeps B × |W| numbers and, for
``std`` (no batching rule), loops example by example.
"""

from __future__ import annotations

from collections.abc import Collection
import torch
from torch import nn

from dpml.train.clipping_layers import Piece
from dpml.train.rules.combine import computed_norms, merged_uses, row_form, use_norms
from dpml.train.rules.derived import Derived
from dpml.train.rules.pull_backs import pulled_back_probes
from dpml.train.rules.flat_indices import in_order
from dpml.train.rules.registry import Computed, Factored, Use
from dpml.train.rules.row_affine import RowMap, read_row_map

_PROBE_SEED = 20190227  # the probes' own generator: the model's random draws are left as they were


class _Graph:
    """The recorded computations indexed once per pass: each by its output's id, and the readers of each tensor."""

    def __init__(self, nodes: list[Derived]) -> None:
        self.nodes = nodes
        self.by_output = {id(node.output): node for node in nodes}
        self.readers: dict[int, list[Derived]] = {}
        for node in nodes:
            for key in dict.fromkeys(id(t.param) for _, t in node.sources):
                self.readers.setdefault(key, []).append(node)

    def chain(self, output: Derived, uses: dict[int, list[Use]]) -> tuple[list[Derived], nn.Parameter] | None:
        """The computations ``output`` comes from, in the order they ran, and the one parameter they all read, where
        no other computation or use reads that parameter or any of their outputs but the last; else None."""
        found: dict[int, Derived] = {}
        stack = [output]
        while stack:
            node = stack.pop()
            if id(node.output) not in found:
                found[id(node.output)] = node
                stack += [self.by_output[id(t.param)] for _, t in node.sources if id(t.param) in self.by_output]
        param = output.params[0] if len(output.params) == 1 else None
        if not isinstance(param, nn.Parameter) or uses.get(id(param)):
            return None
        if self.readers.get(id(output.output)):
            return None  # T feeds another computation
        for key in [id(param), *found]:
            if key != id(output.output) and any(id(r.output) not in found for r in self.readers.get(key, ())):
                return None  # W, or a step on the way, enters another computation
        if any(uses.get(key) for key in found if key != id(output.output)):
            return None  # a step on the way has a use of its own
        return [node for node in self.nodes if id(node.output) in found], param


def _within_rounding(residual: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> bool:
    """Each row's residual (C, n) within rounding of its terms' size ``scale`` (C,)."""
    tolerance = 10 * torch.finfo(dtype).eps ** 0.5
    floor = 1e-3 * scale.amax()
    return bool((residual.norm(dim=-1) <= tolerance * (scale + floor)).all())


def _in_span(t: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """U_cᵀ v (…, C, 2) for each row's v, ``vectors`` (…, C, n); U_c = [1, T_c], T's rows ``t`` (C, n)."""
    return torch.stack([vectors.sum(-1), (t * vectors).sum(-1)], -1).double()


def _from_span(t: torch.Tensor, coordinates: torch.Tensor) -> torch.Tensor:
    """U_c x (…, C, n) for each row's coordinates x, (…, C, 2)."""
    x = coordinates.to(t.dtype)
    return x[..., 0, None] + x[..., 1, None] * t


def _rank_one_draws(count: int, n: int, k: int, like: torch.Tensor) -> torch.Tensor:
    """k random (C, n) cotangents, each σ ξᵀ (a random scale per row times a random row): C + n draws each, from
    the probes' own generator (the model's random stream is not touched)."""
    generator = torch.Generator(device=like.device).manual_seed(_PROBE_SEED)
    scales = torch.randn(k, count, 1, generator=generator, device=like.device, dtype=torch.float64)
    directions = torch.randn(k, 1, n, generator=generator, device=like.device, dtype=torch.float64)
    return (scales.to(like.dtype) * directions.to(like.dtype)).contiguous()


def fitted_row_map(chain: list[Derived], param: nn.Parameter, output: torch.Tensor) -> RowMap | None:
    """(1) fitted to the chain's Jacobian at the current W and checked (module docstring); None where it does not
    hold to rounding, or where the weight's precision is below float32's (a check within bfloat16's rounding
    tells little)."""
    dtype = output.dtype
    if torch.finfo(dtype).eps > torch.finfo(torch.float32).eps or any(node.again.failure() for node in chain):
        return None
    count, n = output.shape[0], output.numel() // output.shape[0]
    t = output.detach().reshape(count, n)
    sums, squares = t.sum(1, dtype=torch.float64), t.square().sum(1, dtype=torch.float64)
    gram = torch.stack([torch.stack([torch.full_like(sums, n), sums], 1), torch.stack([sums, squares], 1)], 1)
    gram_inverse = torch.linalg.pinv(gram, hermitian=True)  # K_c⁺ (C, 2, 2)
    drawn = _rank_one_draws(count, n, 3, t)
    apart = drawn[:2] - _from_span(t, (gram_inverse @ _in_span(t, drawn[:2])[..., None])[..., 0])  # g_1, g_2 ⊥ U_c
    probes = torch.stack([apart[0] + 1, apart[1] + t, drawn[2]])
    pulled = pulled_back_probes(chain, output, probes.reshape(3, *output.shape), param).reshape(3, count, n)
    along = (pulled[:2] * apart).sum(2, dtype=torch.float64) / apart.square().sum(2, dtype=torch.float64)
    alpha = along.mean(0).nan_to_num(0.0)  # (no room beside 1 and T_c: n ≤ 2, or rows of one value and n = 1)
    stretched = alpha.to(dtype)[:, None]
    spanned = gram_inverse @ _in_span(t, pulled[:2]).permute(1, 2, 0)  # J_cᵀ 1 and J_cᵀ T_c in U_c (C, 2, 2)
    coordinates = spanned - torch.diag_embed(alpha[:, None].expand(-1, 2))  # X_c: J_cᵀ U_c − α_c U_c = U_c X_c
    mix = coordinates @ gram_inverse  # M_c = X_c K_c⁺
    fitted = stretched * apart + _from_span(t, spanned.permute(2, 0, 1))  # (2, C, n)
    predicted = stretched * drawn[2] + _from_span(t, (mix @ _in_span(t, drawn[2])[..., None])[..., 0])
    sizes = pulled.norm(dim=2) + torch.cat([fitted, predicted[None]]).norm(dim=2)
    residuals = torch.cat([pulled[:2] - fitted, (pulled[2] - predicted)[None]])
    if not all(_within_rounding(r, scale, dtype) for r, scale in zip(residuals, sizes, strict=True)):
        return None
    return RowMap(alpha, mix, t, sums, squares)


def _coefficients(found: RowMap, p: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e_c, h_c) = M_c (p_c, s_c)ᵀ (module docstring) of each example's p_c = ⟨1, g_c⟩ and s_c = ⟨T_c, g_c⟩, (B, C)."""
    mix = found.mix.to(p.dtype)
    return mix[:, 0, 0] * p + mix[:, 0, 1] * s, mix[:, 1, 0] * p + mix[:, 1, 1] * s


def _factored_piece(found: RowMap, form: Factored, param: nn.Parameter) -> Piece:
    """W's piece from T's one factored use (module docstring)."""
    dtype, n = form.u.dtype, form.cols
    alpha, t = found.alpha.to(dtype), found.rows.to(dtype)
    u, v = form.u, form.v  # (B, S, C), (B, S, n)
    mean_v = v.mean(2, keepdim=True)
    p = n * (u * mean_v).sum(1)  # (B, C)
    product = form.applied if form.applied is not None else v @ t.t()  # T_c · v_s: the use's own, or one product
    s = torch.linalg.vecdot(u, product, dim=1)
    e, h = _coefficients(found, p, s)
    e_centred = e + alpha * p / n
    sums_t, squares_t = found.sums.to(dtype), found.squares.to(dtype)
    f_squared, f_sums = use_norms(Factored(u * alpha, v - mean_v, form.rows, n))
    extra = 2 * alpha * h * (s - p * sums_t / n) + n * e_centred.square() + 2 * e_centred * h * sums_t
    squared = (f_squared + (extra + h.square() * squares_t).sum(1)).clamp_min(0)

    def sums(factors: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        total = f_sums(factors).add_((factors @ e_centred)[:, None]).addcmul_((factors @ h)[:, None], t)  # (fresh)
        return [(param, total.reshape(param.shape))]

    return Piece(squared, sums)


def _computed_piece(found: RowMap, form: Computed, param: nn.Parameter) -> Piece:
    """W's piece from T's one use whose per-example gradients G_i the operation forms on demand (a convolution's
    kernel gradients): each slice's G_i carried back row by row, J_cᵀ g_c = α_c g_c + e_c 1 + h_c T_c (the module
    docstring's, uncentred: G_i is at hand), and the clipped sum, where they are not kept, from the operation's own
    Σ_i c_i G_i: α ⊙ (Σ_i c_i G_i) + (Σ_i c_i e_i) 1ᵀ + diag(Σ_i c_i h_i) T."""
    count, n = form.shape
    coefficients: list[torch.Tensor] = []  # (e_i, h_i) of each slice in turn

    def carried(grads: torch.Tensor, examples: slice) -> torch.Tensor:
        alpha, t = found.alpha.to(grads.dtype)[:, None], found.rows.to(grads.dtype)
        p, s = grads.sum(2), torch.linalg.vecdot(grads, t, dim=2)
        e, h = _coefficients(found, p, s)
        coefficients.append(torch.stack([e, h]))
        return grads.mul_(alpha).add_(e[..., None]).addcmul_(h[..., None], t)  # (the slice's own, formed for this)

    def total(factors: torch.Tensor) -> torch.Tensor:
        e, h = torch.cat(coefficients, 1).to(factors.dtype)  # (every example's, in batch order)
        t = found.rows.to(factors.dtype)
        alpha = found.alpha.to(factors.dtype)[:, None]
        total = form.weighted_sum(factors).reshape(count, n).mul_(alpha)  # (one weight gradient, formed for this)
        return total.add_((factors @ e)[:, None]).addcmul_((factors @ h)[:, None], t)

    squared, sums = computed_norms(form, carried, total)
    return Piece(squared, lambda factors: [(param, sums(factors).reshape(param.shape))])


def row_map_pieces(
    nodes: list[Derived],
    uses: dict[int, list[Use]],
    ruled: Collection[int],
    params: dict[int, nn.Parameter],
    taken: Collection[int] = (),
) -> dict[int, tuple[list[Derived], Piece]]:
    """{id(W): (the computations from W to T, W's piece)} for each T = f(W) of ``nodes`` that (1) describes (W's id
    among ``ruled`` and not ``taken`` already); W joins ``params`` (by id)."""
    found: dict[int, tuple[list[Derived], Piece]] = {}
    graph = _Graph(nodes)
    for node in nodes:
        merged = merged_uses(uses.get(id(node.output), []))
        if len(merged) != 1 or node.output.dim() < 2 or not node.output.is_floating_point():
            continue
        view, form = merged[0]
        count = node.output.shape[0]
        shape = (count, node.output.numel() // count)
        if (
            shape[1] < 3
            or not row_form(form, shape)
            or not (view.index is None or in_order(view.index, count * shape[1]))
        ):
            continue
        chain = graph.chain(node, uses)
        if chain is None or id(chain[1]) not in ruled or id(chain[1]) in taken or id(chain[1]) in found:
            continue
        steps, param = chain
        if param.numel() != node.output.numel():
            continue
        fitted = read_row_map(steps, param, node.output) or fitted_row_map(steps, param, node.output)
        if fitted is None:
            continue
        piece = _factored_piece if isinstance(form, Factored) else _computed_piece
        found[id(param)] = (steps, piece(fitted, form, param))  # type: ignore[arg-type]
        params[id(param)] = param
        del uses[id(node.output)], merged, view, form  # (what the piece does not read goes now, not with the pass)
    return found
