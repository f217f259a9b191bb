"""Per-example clipped gradient sums: Σ_i clip_C(∇_θ ℓ(θ; x_i, y_i)), clip_C(g) = g·min(1, C/‖g‖).

The method is chosen per layer. One forward pass records every *fast* layer's input and output
(forward hooks), one backward pass to those outputs gives the output gradients δ_{i,t} = ∂ℓ_i/∂z_{i,t}
(ℓ_i depends on example i's rows only, so ∂(Σ_j ℓ_j)/∂z_i = ∂ℓ_i/∂z_i), and each fast layer's
per-example gradient norms and clipped sums follow from its activations and δ alone:

- **Linear and Conv2d: no per-example gradient tensor** (Goodfellow 2015; the ghost-norm
  / book-keeping technique of Li et al. 2022 and Bu et al. 2023). Such a layer computes
  z_t = W a_t (+ b) at positions t (one position for a plain dense layer; the output pixels of a
  convolution, with a_t the unfolded input patch), so
      ∇_W ℓ_i = Σ_t δ_t a_tᵀ,        ∇_b ℓ_i = Σ_t δ_t,
      ‖∇_W ℓ_i‖_F² = Σ_{t,s} (a_t·a_s)(δ_t·δ_s)   ("ghost norm": two T×T Gram matrices),
  which for T = 1 is ‖a‖²‖δ‖². Per layer we take the ghost norm or materialise ∇_W ℓ_i,
  whichever is cheaper (T² against d_in·d_out), and the clipped sum is one contraction
  Σ_i c_i Σ_t δ_{i,t} a_{i,t}ᵀ.
- **Embedding** (z_t = W[k_t], token k_t at position t): ∇_W ℓ_i = Σ_t e_{k_t} δ_tᵀ, so
      ‖∇_W ℓ_i‖_F² = Σ_{t,s} [k_t = k_s] (δ_t·δ_s) = Σ_k ‖Σ_{t: k_t = k} δ_t‖²,
  computed by sorting the (example, token) pairs and summing δ over equal pairs: a sort and
  O(T·d) work per example, neither a T×T Gram matrix nor a vocabulary-sized gradient. Positions holding
  ``padding_idx`` get no gradient (as in torch) and are dropped. The clipped sum adds c_i·δ_{i,t}
  into row k_{i,t} (``index_add``).
- **LayerNorm and GroupNorm** (affine): z = x̂⊙γ + β, with x̂ the input normalised (biased
  variance, the layer's eps) over the trailing ``normalized_shape`` dimensions (LayerNorm) or
  over the channels of a group and all spatial positions (GroupNorm); x̂ is recomputed from the
  recorded input with the layer's own function. Per example
      ∇_γ ℓ_i = Σ_t x̂_t⊙δ_t,        ∇_β ℓ_i = Σ_t δ_t
  over the positions t that share γ and β (LayerNorm: all leading non-batch dimensions;
  GroupNorm: the spatial ones, per channel). These are small, so they are materialised.
- **Layers that know their own shortcut** (``ghost_clipping = True``, e.g. the gated model's
  :class:`dpml.models.gated.GatedLinear`): the layer supplies ‖∇_W ℓ_i‖² and Σ_i c_i ∇_W ℓ_i from
  its input and δ (``per_example_norms_squared``, ``clipped_weight_sum``).
- **Any other parameter** (custom modules, or a layer above in an unsupported configuration):
  exact per-example gradients of *those parameters only* with ``torch.func.vmap(grad(·))`` over
  a second forward pass; their squared norms join the layers' before the clip factor is formed.

The layer shortcuts assume that a fast layer's parameters reach the loss only through that
layer's own (stock) forward, once per forward pass, on a batch-first input. Everything
goes through the exact vmap path instead when a fast layer runs twice, when one parameter
belongs to two modules (tied weights), or when an input is not batch-first; a fast layer whose
forward never runs (its weights used directly, as ``nn.MultiheadAttention`` does with
``out_proj``) has its parameters taken by the vmap path. A layer output changed in place later in
the forward pass (``ReLU(inplace=True)``) would no longer be the point where δ is taken: the
forward is then run again with the hooks handing on copies of the outputs. (An input changed in
place is an error in torch's own backward pass already: these layers save their inputs.)

BatchNorm is refused: its batch statistics make each example's output depend on the whole
batch, so per-example clipping would not bound one example's influence (use GroupNorm or
LayerNorm).

c_i = min(1, C / (‖g_i‖ + 1e-6)), so ‖c_i g_i‖ < C strictly (the 1e-6 guards rounding and
g_i = 0): this is what makes the sum's sensitivity C.

The module is one cohesive algorithm: every per-layer closed form above feeds one recording, one
set of squared norms and one clip factor per example (records and the audit's Dirac gradient
canaries alike), so it is kept in one file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, y) -> per-example losses
ClippedSums = Callable[[torch.Tensor], list[tuple[nn.Parameter, torch.Tensor]]]  # c (B,) -> [(p, Σ_i c_i ∇_p ℓ_i)]


def clip_factors(norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
    return torch.clamp(clip_norm / (norms + 1e-6), max=1.0)


def _stock(module: nn.Module, cls: type[nn.Module]) -> bool:
    """``module`` is a ``cls`` that runs ``cls``'s own forward (a subclass may compute something else)."""
    return isinstance(module, cls) and type(module).forward is cls.forward


def _is_fast(module: nn.Module) -> bool:
    """Layers whose per-example gradients follow from their activations and output gradients."""
    if getattr(module, "ghost_clipping", False):  # a dpml layer that computes its own (e.g. GatedLinear)
        return True
    if _stock(module, nn.Linear):
        return True
    if _stock(module, nn.Conv2d):
        return module.groups == 1 and module.padding_mode == "zeros" and isinstance(module.padding, tuple)
    if _stock(module, nn.Embedding):
        # max_norm renormalises rows of W inside the forward; scale_grad_by_freq scales by counts in
        # the whole batch. (sparse only changes the layout of .grad, which the sums here never use.)
        return module.max_norm is None and not module.scale_grad_by_freq
    if _stock(module, nn.LayerNorm):
        return module.weight is not None
    if _stock(module, nn.GroupNorm):
        return module.affine
    return False


def _layer_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters a fast layer's shortcut accounts for: its weight and (if any) bias."""
    return [p for p in (getattr(module, "weight", None), getattr(module, "bias", None)) if p is not None]


def _trainable(p: nn.Parameter | None) -> bool:
    return p is not None and p.requires_grad


def _batch_first(module: nn.Module, inputs: torch.Tensor, batch: int) -> bool:
    """The recorded input has the batch as its leading dimension (the shortcuts need it)."""
    if inputs.dim() == 0 or inputs.shape[0] != batch:
        return False
    if isinstance(module, nn.Conv2d):
        return inputs.dim() == 4
    if isinstance(module, nn.LayerNorm):
        return inputs.dim() > len(module.normalized_shape)
    return isinstance(module, nn.Embedding) or inputs.dim() >= 2


def _reject_batch_norm(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            where = f"module '{name}'" if name else "the model"
            raise ValueError(
                f"{where} is a {type(module).__name__}: batch normalisation mixes the examples of a batch, so an "
                "example's gradient depends on the others and per-example clipping does not bound its influence "
                "(and the running statistics are released without noise). Use nn.GroupNorm or nn.LayerNorm instead.")


def _patches(module: nn.Module, inputs: torch.Tensor, output_grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, Δ): per-example activations (B, T, d_in) and output gradients (B, T, d_out) of a fast layer."""
    batch = inputs.shape[0]
    if isinstance(module, nn.Linear):
        return inputs.reshape(batch, -1, inputs.shape[-1]), output_grad.reshape(batch, -1, output_grad.shape[-1])
    unfolded = unfold_patches(inputs, module.kernel_size, module.stride, module.padding, module.dilation)
    return unfolded.transpose(1, 2), output_grad.reshape(batch, output_grad.shape[1], -1).transpose(1, 2)


def unfold_patches(x: torch.Tensor, kernel: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
                   dilation: tuple[int, ...]) -> torch.Tensor:
    """The convolution's input patches, (B, C·kh·kw, T) — what ``F.unfold`` returns, as one strided view
    and one copy. (``F.unfold`` itself took ≈4 s instead of ≈30 ms for a 512×1×28×28 batch with two
    intra-op threads on this CPU build of torch 2.13.)"""
    if any(padding):
        x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    batch, channels, height, width = x.shape
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    out_h, out_w = (height - dh * (kh - 1) - 1) // sh + 1, (width - dw * (kw - 1) - 1) // sw + 1
    s = x.stride()
    patches = x.as_strided((batch, channels, kh, kw, out_h, out_w),
                           (s[0], s[1], s[2] * dh, s[3] * dw, s[2] * sh, s[3] * sw))
    return patches.reshape(batch, channels * kh * kw, out_h * out_w)


KEEP_PER_EXAMPLE_LIMIT = 1 << 25  # elements: materialised per-example weight gradients kept for the sum


def _weight_norms_squared(a: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """‖Σ_t δ_t a_tᵀ‖_F² per example, by the cheaper of the Gram trick and materialising.

    When it materialises the per-example gradients G_i = Σ_t δ_t a_tᵀ and they are small enough,
    they are returned too: the clipped sum is then Σ_i c_i G_i, not a second pass over all positions.
    """
    positions = a.shape[1]
    if positions == 1:
        return a[:, 0].pow(2).sum(1) * d[:, 0].pow(2).sum(1), None
    if positions * positions <= a.shape[2] * d.shape[2]:
        return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(d, d.transpose(1, 2))).sum((1, 2)), None
    per_example = torch.bmm(d.transpose(1, 2), a)  # (B, d_out, d_in)
    keep = per_example if per_example.numel() <= KEEP_PER_EXAMPLE_LIMIT else None
    return per_example.pow(2).sum((1, 2)), keep


@dataclass
class _Piece:
    """One fast layer's share: the per-example squared norm (B,) of the gradient of its trainable
    parameters, and ``sums``, which maps the clip factors c (B,) to Σ_i c_i ∇_p ℓ_i for each of them."""

    squared: torch.Tensor
    sums: ClippedSums


def _materialised_piece(per_example: list[tuple[nn.Parameter, torch.Tensor]], like: torch.Tensor) -> _Piece:
    """A piece from explicit per-example gradients G_i (B, *p.shape): ‖G_i‖² and Σ_i c_i G_i (B = len(like))."""
    batch = like.shape[0]
    squared = like.new_zeros(batch)
    for _, g in per_example:
        squared = squared + g.reshape(batch, -1).pow(2).sum(1)
    return _Piece(squared, lambda factors: [(p, torch.einsum("b,b...->...", factors, g)) for p, g in per_example])


def _dense_piece(module: nn.Linear | nn.Conv2d, inputs: torch.Tensor, output_grad: torch.Tensor) -> _Piece:
    """Linear / Conv2d: ‖Σ_t δ_t a_tᵀ‖² by ghost norm or materialised, ‖Σ_t δ_t‖², and their clipped sums."""
    a, d = _patches(module, inputs, output_grad)
    squared = d.new_zeros(d.shape[0])
    kept = None
    if _trainable(module.weight):
        weight_squared, kept = _weight_norms_squared(a, d)
        squared = squared + weight_squared
    if _trainable(module.bias):
        squared = squared + d.sum(1).pow(2).sum(1)

    def sums(factors: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        weighted = d * factors[:, None, None]
        out = []
        if _trainable(module.weight):
            if kept is not None:
                flat = torch.einsum("b,boi->oi", factors, kept)
            else:
                flat = weighted.reshape(-1, d.shape[2]).t() @ a.reshape(-1, a.shape[2])  # (d_out, d_in)
            out.append((module.weight, flat.reshape(module.weight.shape)))
        if _trainable(module.bias):
            out.append((module.bias, weighted.sum((0, 1))))
        return out

    return _Piece(squared, sums)


def _embedding_norms_squared(tokens: torch.Tensor, d: torch.Tensor, vocabulary: int) -> torch.Tensor:
    """Σ_k ‖Σ_{t: k_t = k} δ_t‖² per example = Σ_{t,s} [k_t = k_s](δ_t·δ_s), for tokens (B, T), δ (B, T, D).

    The B·T pairs (i, k_{i,t}) are sorted; equal pairs are then adjacent, and a running count of
    "new pair" flags numbers them, so one ``index_add`` gives the row sums Σ_{t: k_t = k} δ_{i,t}.
    Shapes stay fixed (at most B·T distinct pairs; unused rows stay zero): no device synchronisation.
    """
    batch, positions = tokens.shape
    keys = (torch.arange(batch, device=tokens.device)[:, None] * vocabulary + tokens).reshape(-1)
    keys, order = keys.sort()
    new = torch.ones_like(keys, dtype=torch.bool)
    new[1:] = keys[1:] != keys[:-1]
    pair = new.cumsum(0) - 1  # (B·T,): which distinct (example, token) pair each sorted position holds
    rows = d.new_zeros(batch * positions, d.shape[2]).index_add_(0, pair, d.reshape(-1, d.shape[2])[order])
    example_of_pair = torch.zeros_like(pair).scatter_(0, pair, keys // vocabulary)
    return d.new_zeros(batch).index_add_(0, example_of_pair, rows.pow(2).sum(1))


def _embedding_piece(module: nn.Embedding, inputs: torch.Tensor, output_grad: torch.Tensor) -> _Piece:
    """Embedding: ∇_W ℓ_i = Σ_t e_{k_t} δ_tᵀ (padding positions excluded); clipped sum by ``index_add``."""
    batch = inputs.shape[0]
    tokens = inputs.reshape(batch, -1)
    d = output_grad.reshape(batch, tokens.shape[1], module.embedding_dim)
    if module.padding_idx is not None:
        d = d * (tokens != module.padding_idx).unsqueeze(2)

    def sums(factors: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        weighted = (d * factors[:, None, None]).reshape(-1, module.embedding_dim)
        return [(module.weight, torch.zeros_like(module.weight).index_add_(0, tokens.reshape(-1), weighted))]

    return _Piece(_embedding_norms_squared(tokens, d, module.num_embeddings), sums)


def _affine_norm_piece(module: nn.LayerNorm | nn.GroupNorm, normalised: torch.Tensor, d: torch.Tensor) -> _Piece:
    """z = x̂⊙γ + β with x̂, δ shaped (B, T, *γ.shape): ∇_γ ℓ_i = Σ_t x̂_t⊙δ_t and ∇_β ℓ_i = Σ_t δ_t, materialised."""
    per_example = []
    if _trainable(module.weight):
        per_example.append((module.weight, (normalised * d).sum(1)))
    if _trainable(module.bias):
        per_example.append((module.bias, d.sum(1)))
    return _materialised_piece(per_example, d)


def _layer_norm_piece(module: nn.LayerNorm, inputs: torch.Tensor, output_grad: torch.Tensor) -> _Piece:
    """LayerNorm: x̂ over the trailing ``normalized_shape`` dims; the positions t are the leading non-batch dims."""
    shape = (inputs.shape[0], -1, *module.normalized_shape)
    normalised = F.layer_norm(inputs, module.normalized_shape, eps=module.eps)
    return _affine_norm_piece(module, normalised.reshape(shape), output_grad.reshape(shape))


def _group_norm_piece(module: nn.GroupNorm, inputs: torch.Tensor, output_grad: torch.Tensor) -> _Piece:
    """GroupNorm on (B, C, *spatial): x̂ per (example, group); γ_c, β_c are shared by the spatial positions t."""
    batch, channels = inputs.shape[:2]
    normalised = F.group_norm(inputs, module.num_groups, eps=module.eps)
    return _affine_norm_piece(module, normalised.reshape(batch, channels, -1).transpose(1, 2),
                              output_grad.reshape(batch, channels, -1).transpose(1, 2))


def _own_piece(module: nn.Module, inputs: torch.Tensor, output_grad: torch.Tensor) -> _Piece:
    """A layer with ``ghost_clipping = True`` and only a ``weight``: it supplies ‖∇_W ℓ_i‖² and Σ_i c_i ∇_W ℓ_i
    through ``per_example_norms_squared(inputs, δ)`` and ``clipped_weight_sum(inputs, δ, c)``."""
    if not _trainable(module.weight):
        return _Piece(output_grad.new_zeros(output_grad.shape[0]), lambda factors: [])
    return _Piece(module.per_example_norms_squared(inputs, output_grad),
                  lambda factors: [(module.weight, module.clipped_weight_sum(inputs, output_grad, factors))])


def _layer_piece(module: nn.Module, inputs: torch.Tensor, output_grad: torch.Tensor) -> _Piece:
    if getattr(module, "ghost_clipping", False):
        return _own_piece(module, inputs, output_grad)
    if isinstance(module, nn.Embedding):
        return _embedding_piece(module, inputs, output_grad)
    if isinstance(module, nn.LayerNorm):
        return _layer_norm_piece(module, inputs, output_grad)
    if isinstance(module, nn.GroupNorm):
        return _group_norm_piece(module, inputs, output_grad)
    return _dense_piece(module, inputs, output_grad)  # type: ignore[arg-type]


@dataclass
class _Recording:
    """One forward pass with every fast layer's (input, output) recorded."""

    losses: torch.Tensor
    layers: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]]
    reused: bool       # some layer ran more than once
    overwritten: bool  # some recorded output was modified in place after the layer ran


def _record_forward(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, layers: list[nn.Module],
                    copy: bool) -> _Recording:
    """Per-example losses, with forward hooks on ``layers``. With ``copy`` the hooks pass a copy of each
    output on, so that in-place operations later in the forward pass (``ReLU(inplace=True)``) leave
    the recorded output, whose gradient is δ, out of the graph's rewrites."""
    records: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
    versions: dict[nn.Module, int] = {}
    reused = False

    def remember(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor | None:
        nonlocal reused
        reused = reused or module in records
        records[module] = (inputs[0].detach(), output)
        versions[module] = output._version
        return output.clone() if copy else None

    handles = [m.register_forward_hook(remember) for m in layers]
    try:
        losses = loss_fn(model(x), y)
    finally:
        for handle in handles:
            handle.remove()
    overwritten = any(output._version != versions[m] for m, (_, output) in records.items())
    return _Recording(losses, records, reused, overwritten)


def _shares_parameters(model: nn.Module, layers: list[nn.Module]) -> bool:
    """Some fast layer's parameter is also registered on another module (tied weights)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    return any(owners[id(p)] > 1 for m in layers for p in _layer_parameters(m))


def _per_example_gradients(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                           names: list[str]) -> dict[str, torch.Tensor]:
    """Exact per-example gradients of the named parameters only (the others held fixed)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def one_loss(trainable: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, ({**params, **trainable}, buffers), (xi.unsqueeze(0),))
        return loss_fn(logits, yi.unsqueeze(0)).sum()

    return vmap(grad(one_loss), in_dims=(None, 0, 0))({n: params[n] for n in names}, x, y)


@dataclass(frozen=True)
class DiracGradients:
    """Extra examples whose whole gradient is a Dirac: example j has gradient ``norm``·e_{k_j}, where k_j
    (``coordinates[j]``) is a flat index over the model's trainable parameters in ``named_parameters``
    order. The audit's gradient canaries enter the engine this way: *before* clipping, with a norm well
    above C, so that they are clipped by the same factor line as the records (and a trainer that does
    not clip shows it: their contribution is then ``norm``, not C)."""

    coordinates: torch.Tensor  # (b,) int64
    norm: float


def _flat_slots(names: list[str], shapes: list[torch.Size], coordinates: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(parameter name, positions in ``coordinates``, flat index inside that parameter) for each parameter hit."""
    out, offset = [], 0
    for name, shape in zip(names, shapes):
        size = int(torch.Size(shape).numel())
        inside = (coordinates >= offset) & (coordinates < offset + size)
        if bool(inside.any()):
            positions = torch.nonzero(inside).flatten()
            out.append((name, positions, coordinates[positions] - offset))
        offset += size
    if bool(((coordinates < 0) | (coordinates >= offset)).any()):
        raise ValueError(f"Dirac gradient coordinates must lie in [0, {offset}) (the trainable parameters)")
    return out


def _record_norms_and_sums(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                           names: dict[int, str]) -> tuple[torch.Tensor, Callable[[torch.Tensor], dict[str, torch.Tensor]]]:
    """The records' per-example squared gradient norms ‖∇ℓ_i‖² (B,), and the map c ↦ {name: Σ_i c_i ∇ℓ_i}."""
    if x.shape[0] == 0:
        params = dict(model.named_parameters())
        return x.new_zeros(0), lambda factors: {n: torch.zeros_like(params[n]) for n in names.values()}
    fast = [m for m in model.modules() if _is_fast(m) and any(id(p) in names for p in _layer_parameters(m))]
    if _shares_parameters(model, fast):  # a tied weight's gradient sums over its modules: exact path
        return _all_by_vmap(model, loss_fn, x, y, list(names.values()))
    squared = torch.zeros(x.shape[0], device=x.device, dtype=next(model.parameters()).dtype)
    pieces: list[_Piece] = []
    covered: set[int] = set()
    if fast:
        recording = _record_forward(model, loss_fn, x, y, fast, copy=False)
        if recording.overwritten and not recording.reused:
            recording = _record_forward(model, loss_fn, x, y, fast, copy=True)
        used = [m for m in fast if m in recording.layers]
        if recording.reused or not all(_batch_first(m, recording.layers[m][0], x.shape[0]) for m in used):
            return _all_by_vmap(model, loss_fn, x, y, list(names.values()))  # (a layer applied twice shares its weight)
        output_grads = torch.autograd.grad(recording.losses.sum(), [recording.layers[m][1] for m in used],
                                           allow_unused=True)
        for module, output_grad in zip(used, output_grads):
            inputs, output = recording.layers[module]
            piece = _layer_piece(module, inputs, torch.zeros_like(output) if output_grad is None else output_grad)
            squared += piece.squared
            pieces.append(piece)
            covered.update(id(p) for p in _layer_parameters(module))
    slow = [n for i, n in names.items() if i not in covered]  # includes fast layers whose forward never ran
    per_example = _per_example_gradients(model, loss_fn, x, y, slow) if slow else {}
    for g in per_example.values():
        squared += g.reshape(g.shape[0], -1).pow(2).sum(1)

    def sums_of(factors: torch.Tensor) -> dict[str, torch.Tensor]:
        sums: dict[str, torch.Tensor] = {}
        for piece in pieces:
            for p, total in piece.sums(factors):
                sums[names[id(p)]] = total
        for name, g in per_example.items():
            sums[name] = torch.einsum("b,b...->...", factors, g)
        return sums

    return squared, sums_of


def _all_by_vmap(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
                 names: list[str]) -> tuple[torch.Tensor, Callable[[torch.Tensor], dict[str, torch.Tensor]]]:
    per_example = _per_example_gradients(model, loss_fn, x, y, names)
    squared = sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in per_example.values())
    return squared, lambda factors: {n: torch.einsum("b,b...->...", factors, g) for n, g in per_example.items()}  # type: ignore[return-value]


def clipped_gradient_sum(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, clip_norm: float,
                         diracs: DiracGradients | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Σ_i clip_C(g_i) per parameter name (trainable parameters only), and the unclipped norms ‖∇ℓ_i‖ of the records.

    The examples i are the records (g_i = ∇ℓ_i) and, with ``diracs``, the Dirac gradients of
    :class:`DiracGradients`; both are clipped by one factor line, c_i = min(1, C/(‖g_i‖ + 1e-6))."""
    _reject_batch_norm(model)
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    squared, sums_of = _record_norms_and_sums(model, loss_fn, x, y, names)
    records = squared.shape[0]
    if diracs is not None:
        extra = torch.full((diracs.coordinates.numel(),), float(diracs.norm) ** 2, device=squared.device, dtype=squared.dtype)
        squared = torch.cat([squared, extra])
    norms = squared.sqrt()
    factors = clip_factors(norms, clip_norm)
    sums = sums_of(factors[:records])
    if diracs is not None and diracs.coordinates.numel():
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        slots = _flat_slots([n for n, _ in trainable], [p.shape for _, p in trainable], diracs.coordinates.to(squared.device))
        for name, positions, flat in slots:
            contribution = factors[records:][positions] * float(diracs.norm)
            sums[name] = sums[name].reshape(-1).index_add(0, flat, contribution.to(sums[name].dtype)).reshape(sums[name].shape)
    return sums, norms[:records].detach()
