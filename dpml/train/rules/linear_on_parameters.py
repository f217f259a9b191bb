"""A linear map whose input is computed from parameters alone, carried back by its closed form, not by a batched
backward pass through the call: DeBERTa's relative position embeddings through each layer's query and key projections
(``share_att_key``), MarkupLM's XPath layers where the forward makes the ids, SwinV2's position-bias MLP on its
coordinate table, DETR's first decoder layer on its query embeddings.

Such a call is a computation on parameters alone (:class:`.derived.Derived`): its input x is the same for every example,
so each example's gradients of its output, δ_i (the sum of its uses, (B, *out)), are all it adds. For
``F.linear(x, W, b)``, at positions t (the output's leading dimensions; Goodfellow 2015, as :mod:`.linear`):

    ∇_W ℓ_i = Σ_t δ_{i,t} x_tᵀ,    ∇_b ℓ_i = Σ_t δ_{i,t},    ∇_{x_t} ℓ_i = Wᵀ δ_{i,t},

and for ``torch.addmm(b, x, W, beta=β, alpha=α)`` = β b + α x W: ∇_W ℓ_i = α Σ_t x_t δ_{i,t}ᵀ, ∇_b ℓ_i = β δ_i summed to
b's shape, ∇_x ℓ_i = α δ_i Wᵀ (``x @ W``, ``torch.matmul`` or ``mm`` with a 2-D W on the right: the same, α = 1 and no
b; W may be a view, ``weight.t()``). W's is handed on *factored* (u = δ_i, v = x the same for every example), so its
norm is a ghost norm or a materialised one, whichever is cheaper (:mod:`.combine`), and its uses on the batch's own rows
join it along the positions (:func:`.combine.merged_uses`): one norm, no cross terms. Where the factors' T·(n_in +
n_out) numbers an example pass ∇_W's n_in·n_out (peft DoRA's ``lora_A(eye)``: as many positions as inputs, r outputs;
LoHa's ``w1a @ w1b``; a table longer than half its layer's width), x repeated for every example would weigh more than
∇_W itself, so ∇_W is formed (one product per example, B × |W| numbers within the keep limit, as the generic pull-back
forms them without its batched backward pass). The generic pull-back (:func:`.derived.pull_back`) forms B × |W| numbers
and B products of the size of the call itself.

On a CPU the positions where δ_{i,t} = 0 for every example are left out (DeBERTa's c2p and p2c scores gather 2T − 1
of the table's 2k relative positions: 255 of 512 at 128 tokens): they add nothing to ∇_W or ∇_b, and x_t's gradient
there is zero for every example (on a GPU that test would wait for the device, as
:func:`dpml.train.clipping_norms.without_silent_positions`).

Taken only where the call can be read so: a real floating weight of two dimensions, a parameter or its view; input,
weight and output of one dtype (no autocast), strided; no operand written in place since the call (the values read now
are those it read); no operand passed twice. Otherwise the generic pull-back takes the call."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dpml.train.rules.derived import Derived
from dpml.train.rules.registry import Dense, Factored, Form, Tracked, Use

_LINEAR_CALLS = (F.linear,)
_ADDMM_CALLS = (torch.addmm, torch.Tensor.addmm)
_PRODUCT_CALLS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm)


def _operand(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str) -> Any:
    return args[position] if len(args) > position else kwargs.get(name)


class LinearCall(NamedTuple):
    """A linear call on parameters alone as read: its input, weight and bias (or None), whether W is (n_in, n_out) as
    addmm's (``layout``), α and β."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: Any
    layout: bool
    alpha: float
    beta: float


def _read(node: Derived) -> LinearCall | None:
    """The call of ``node`` read as a linear call on parameters alone; None where it is no such call or cannot be read
    so (the module docstring)."""
    func, args, kwargs = node.call
    if func in _LINEAR_CALLS:
        x, weight, bias = (_operand(args, kwargs, k, n) for k, n in enumerate(("input", "weight", "bias")))
        layout, alpha, beta = False, 1.0, 1.0
    elif func in _ADDMM_CALLS:
        bias, x, weight = (_operand(args, kwargs, k, n) for k, n in enumerate(("input", "mat1", "mat2")))
        layout, alpha, beta = True, float(kwargs.get("alpha", 1.0)), float(kwargs.get("beta", 1.0))
    elif func in _PRODUCT_CALLS or func is torch.Tensor.__rmatmul__:  # x @ W: as addmm without a bias
        first, second = _operand(args, kwargs, 0, "input"), _operand(args, kwargs, 1, "other")
        second = kwargs.get("mat2") if second is None else second
        x, weight = (second, first) if func is torch.Tensor.__rmatmul__ else (first, second)
        bias, layout, alpha, beta = None, True, 1.0, 1.0
    else:
        return None
    operands = [t for t in (x, weight, bias) if isinstance(t, torch.Tensor)]
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 2 or x.dim() < 1:
        return None
    if len({id(t) for t in operands}) != len(operands):
        return None
    if not weight.is_floating_point() or any(t.dtype != weight.dtype for t in (x, node.output)):
        return None
    if any(t.layout != torch.strided for t in operands):
        return None
    if not node.again.unwritten():
        return None
    if not any(t is weight and isinstance(view.param, nn.Parameter) for t, view in node.sources):
        return None  # (a weight computed from parameters: left to the chain run as one graph, HRA's products of many)
    return LinearCall(x, weight, bias, layout, alpha, beta)


def linear_call(node: Derived, batch: int, limit: int) -> LinearCall | None:
    """The call as :func:`linear_uses` takes it, where its per-example gradients of output and input (and of W where
    they are formed) are within ``limit`` numbers for ``batch`` examples; None otherwise (the generic pull-back takes
    it, a slice of examples at a time)."""
    read = _read(node)
    if read is None:
        return None
    formed = 0 if _factored_is_smaller(read.x.numel() // read.x.shape[-1], read.weight) else read.weight.numel()
    return read if batch * max(node.output.numel(), read.x.numel(), formed) <= limit else None


def _factored_is_smaller(positions: int, weight: torch.Tensor) -> bool:
    """Whether the factored form's numbers an example, x's and δ's T·(n_in + n_out), are no more than the formed
    gradient's n_in·n_out: x is repeated for every example once the form joins the weight's other uses."""
    return positions * (weight.shape[0] + weight.shape[1]) <= weight.numel()


def linear_uses(node: Derived, call: LinearCall, gradients: torch.Tensor) -> list[Use]:
    """The uses a linear call on parameters alone (``node``, read as ``call``: :func:`linear_call`) hands on (its
    weight's factored or formed, its bias's and its input's materialised, each for the operands that are tracked) from
    each example's gradients of its output, ``gradients`` (B, *output.shape)."""
    x, weight, bias, layout, alpha, beta = call
    batch, dtype = gradients.shape[0], gradients.dtype
    tracked = {id(t): view for t, view in node.sources}
    d = gradients.reshape(batch, -1, gradients.shape[-1])  # (B, T, n_out): the positions t
    rows = x.detach().reshape(-1, x.shape[-1]).to(dtype)  # (T, n_in), the same for every example
    live = _live_positions(d)
    d_live, rows_live = (d, rows) if live is None else (d.index_select(1, live), rows.index_select(0, live))
    w = weight.detach().to(dtype)
    d_scaled = d_live * alpha if layout and alpha != 1.0 else d_live
    form: Form
    if not _factored_is_smaller(d_live.shape[1], w):  # factored, x and δ would weigh more than ∇_W itself
        total = torch.matmul(rows_live.t(), d_scaled) if layout else torch.matmul(d_live.transpose(1, 2), rows_live)
        form = Dense(total)  # (B, n_in, n_out) for addmm, (B, n_out, n_in) for F.linear: W's shape
    elif layout:  # addmm: W (n_in, n_out), ∇_W = α Σ_t x_t δ_tᵀ
        form = Factored(rows_live.expand(batch, *rows_live.shape), d_scaled, w.shape[0], w.shape[1])
    else:  # F.linear: W (n_out, n_in), ∇_W = Σ_t δ_t x_tᵀ
        form = Factored(d_live, rows_live.expand(batch, *rows_live.shape), w.shape[0], w.shape[1])
    found: list[Use] = [(tracked[id(weight)], form)]
    if isinstance(bias, torch.Tensor) and id(bias) in tracked:
        found.append((tracked[id(bias)], Dense(_summed_to(gradients * beta if beta != 1.0 else gradients, bias))))
    if id(x) in tracked:  # (on the live positions' rows of x only: the others' are zero)
        back = d_live @ (w.t() if layout else w)  # (B, T', n_in): α δ Wᵀ (addmm) or δ W (F.linear)
        back = back * alpha if layout and alpha != 1.0 else back
        view = tracked[id(x)]
        if live is None:
            found.append((view, Dense(back.reshape(batch, *x.shape))))
        else:
            index = view.flat_index().reshape(-1, x.shape[-1]).index_select(0, live)
            found.append((Tracked(view.param, index, view.shared), Dense(back)))
    return found


def _live_positions(d: torch.Tensor) -> torch.Tensor | None:
    """The positions t at which some example's δ_t is not zero, where there are fewer than all of them, on a CPU
    (a sync on a GPU); None otherwise. At least one (a call none of whose positions reach the loss: one zero row)."""
    if d.device.type != "cpu" or d.shape[1] <= 1:
        return None
    live = d.ne(0).any(2).any(0)
    count = int(live.sum())
    if count == d.shape[1]:
        return None
    return live.nonzero().squeeze(1) if count else live.new_zeros(1, dtype=torch.int64)


def _summed_to(gradients: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Each example's gradient of a bias broadcast over the output: (B, *out) summed to (B, *bias.shape)."""
    batch, lead = gradients.shape[0], gradients.dim() - 1 - bias.dim()
    target = (batch, *([1] * lead), *bias.shape)
    return gradients.sum_to_size(target).reshape(batch, *bias.shape)
