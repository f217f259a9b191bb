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
:func:`dpml.train.clipping_norms.without_silent_positions`). They are told from the uses before δ is formed
(:func:`gradients_on_reached_rows`): a factored use Σ_s u_s v_sᵀ of a view V is zero for every example outside the rows
r of V where some u_{i,s,r} ≠ 0 and the columns c where some v_{i,s,c} ≠ 0, a materialised one outside its non-zero
entries; δ is formed on the positions those entries reach only (each factored use's product on its reached rows and
columns: DeBERTa's heads' products on 255 of the 512 relative positions).

Taken only where the call can be read so: a real floating weight of two dimensions, a parameter or its view; input,
weight and output of one dtype (no autocast), strided; no operand written in place since the call (the values read now
are those it read); no operand passed twice. Otherwise the generic pull-back takes the call."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dpml.train.rules.combine import per_example_gradients_of
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


def linear_uses(node: Derived, call: LinearCall, uses: list[Use], batch: int, dtype: torch.dtype) -> list[Use]:
    """The uses a linear call on parameters alone (``node``, read as ``call``: :func:`linear_call`) hands on (its
    weight's factored or formed, its bias's and its input's materialised, each for the operands that are tracked) from
    the ``uses`` of its output (each a form of all ``batch`` examples)."""
    x, weight, bias, layout, alpha, beta = call
    tracked = {id(t): view for t, view in node.sources}
    d_live, live = gradients_on_reached_rows(uses, node.output, batch, dtype)  # (B, T', n_out): the positions t
    rows = x.detach().reshape(-1, x.shape[-1]).to(dtype)  # (T, n_in), the same for every example
    rows_live = rows if live is None else rows.index_select(0, live)
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
        summed = _bias_gradients(d_live, live, node.output.shape, bias)
        found.append((tracked[id(bias)], Dense(summed * beta if beta != 1.0 else summed)))
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


def gradients_on_reached_rows(
    uses: list[Use], output: torch.Tensor, batch: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each example's gradients of ``output`` (the sum of its ``uses``) on the rows some use reaches, (B, L, n_out),
    and those rows' positions among the output's (P, n_out) rows (the module docstring); on a GPU, or where every row
    is reached, (B, P, n_out) and None. Where a use's zeros cannot be told from its form, the rows on which δ is zero
    for every example are found on δ formed (:func:`_live_positions`)."""
    width = output.shape[-1] if output.dim() else 1
    reached = _reached(uses, output, batch) if output.device.type == "cpu" and output.numel() > width else None
    if reached is None:
        d = per_example_gradients_of(uses, output, batch, dtype).reshape(batch, -1, width)
        live = _live_positions(d)
        return (d, None) if live is None else (d.index_select(1, live), live)
    rows = reached.mask.view(-1, width).any(1)
    if bool(rows.all()):
        return per_example_gradients_of(uses, output, batch, dtype).reshape(batch, -1, width), None
    live = rows.nonzero().squeeze(1) if bool(rows.any()) else rows.new_zeros(1, dtype=torch.int64)
    here = output.device
    count = torch.arange(live.shape[0], device=here)
    lookup = torch.full((rows.shape[0],), -1, dtype=torch.int64, device=here).index_copy_(0, live, count)
    total = torch.zeros(batch, live.shape[0] * width, dtype=dtype, device=here)
    for (_, form), (positions, taken) in zip(uses, reached.entries, strict=True):
        if isinstance(form, Factored):  # (the products on the columns taken: Σ_s u_s v_sᵀ there)
            u, v = (_columns(factor, chosen) for factor, chosen in zip((form.u, form.v), taken, strict=True))
            values = torch.bmm(u.transpose(1, 2), v).reshape(batch, -1)
        else:
            assert isinstance(form, Dense)
            values = form.grads.reshape(batch, -1)[:, taken]
        compact = lookup[positions.div(width, rounding_mode="floor")] * width + positions.remainder(width)
        total.index_add_(1, compact, values.to(dtype))
    return total.view(batch, -1, width), live


class _Reached(NamedTuple):
    """The output's entries some use reaches (``mask``, flat), and, for each use, the entries of the output it reaches
    (flat) with what of its view they are: a factored one's columns taken of each factor (:func:`_taken`), a
    materialised one's entries (a mask, flat)."""

    mask: torch.Tensor
    entries: list[tuple[torch.Tensor, Any]]


def _reached(uses: list[Use], output: torch.Tensor, batch: int) -> _Reached | None:
    """The entries of ``output`` that some example's gradient may reach, told from the uses' forms (a superset: a
    product of non-zero factors may still add up to zero); None where a use's form does not tell them (a one-hot
    factor, one formed on demand)."""
    mask = torch.zeros(output.numel(), dtype=torch.bool, device=output.device)
    entries: list[tuple[torch.Tensor, Any]] = []
    for tracked, form in uses:
        index = tracked.flat_index().reshape(-1)
        if isinstance(form, Dense) and form.grads.numel() == batch * index.numel():
            kept = form.grads.reshape(batch, -1).ne(0).any(0)
            entries.append((index[kept], kept))
        elif (
            isinstance(form, Factored)
            and form.u.dim() == form.v.dim() == 3
            and form.u.is_floating_point()
            and form.v.is_floating_point()
        ):
            r, c = (_taken(factor.any(dim=(0, 1))) for factor in (form.u, form.v))
            entries.append((index.view(form.rows, form.cols)[r][:, c].reshape(-1), (r, c)))
        else:
            return None
        mask[entries[-1][0]] = True
    return _Reached(mask, entries)


def _taken(reached: torch.Tensor) -> torch.Tensor:
    """The columns of a factor worth taking, given those that are not zero for every example (``reached``): those
    from the first reached to the last where they hold at least half of them (a run, read as a view: DeBERTa's 2T − 1
    relative positions), else the reached ones where they are fewer than half of all (gathered), else all (a gathered
    copy costs more than the products it saves). A column taken may be zero for every example: the entries it reaches
    are formed, as zeros."""
    found = reached.nonzero().squeeze(1)
    if found.numel() == 0:
        return found
    first, last = int(found[0]), int(found[-1]) + 1
    if 2 * found.numel() >= last - first and last - first < reached.numel():
        return torch.arange(first, last, device=reached.device)
    if 2 * found.numel() < reached.numel():
        return found
    return torch.arange(reached.numel(), device=reached.device)


def _columns(factor: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
    """The columns ``taken`` (:func:`_taken`) of a factor (B, T, n): a view where they are a run, else gathered."""
    count = taken.numel()
    if count == 0 or int(taken[-1]) - int(taken[0]) + 1 == count:
        return factor.narrow(2, int(taken[0]) if count else 0, count)
    return factor.index_select(2, taken)


def _bias_gradients(d: torch.Tensor, live: torch.Tensor | None, shape: torch.Size, bias: torch.Tensor) -> torch.Tensor:
    """Each example's gradient of a bias broadcast over the output (of ``shape``) from δ on the positions ``live``
    (all where None), (B, *bias.shape): summed over the positions where the bias is the same at each of them, else
    δ laid out on all positions first (the others' are zero)."""
    batch = d.shape[0]
    if live is None:
        return _summed_to(d.reshape(batch, *shape), bias)
    if bias.dim() <= 1 or all(s == 1 for s in bias.shape[:-1]):
        return _summed_to(d.sum(1), bias.reshape(-1)).reshape(batch, *bias.shape)
    full = d.new_zeros(batch, math.prod(shape) // d.shape[2], d.shape[2]).index_copy_(1, live, d)
    return _summed_to(full.reshape(batch, *shape), bias)


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
