"""A weight computed from one parameter as each row's affine map of itself, read off the recorded operations: the
closed form behind :mod:`.row_jacobian`, without its probes, for the operations weight standardisation is written
with (``mean``, ``var``, ``std``, ``var_mean``, ``sum``, ``norm`` over a row; adding, subtracting, multiplying and
dividing rows by per-row values and constants; ``sqrt``, ``rsqrt``, ``pow`` and other elementwise functions of
per-row values).

Every tensor on the way from W to T is, for each row c of W (W_c, n numbers, mean m_c, biased variance v_c =
mean((W_c − m_c)²)), either a value per row or the affine map A_c W_c + B_c·1, where A_c and B_c are computed from
(m_c, v_c) by the operations as recorded (autograd records that on C numbers, not C·n). The reductions of A W_c + B:

    mean = A m + B,   sum = n (A m + B),   var with correction k = A² v n / (n − k),
    ‖·‖₂ = (n (A² v + (A m + B)²))^½,

and T_c = A_c W_c + B_c·1, checked against T's recorded values. With ∂m/∂W_c = 1/n and ∂v/∂W_c = (2/n) z_c,
z_c = W_c − m_c·1, T's Jacobian is J_c = A I + W_c ∇Aᵀ + 1 ∇Bᵀ, ∇A = (A_m/n)·1 + (2A_v/n)·z_c (A_m = ∂A/∂m, A_v =
∂A/∂v; B's alike), so that, with p = ⟨1, g⟩ and s_z = ⟨z_c, g⟩ (⟨W_c, g⟩ = s_z + m p),

    J_cᵀ g = A g + [1, z_c] M_z (p, s_z)ᵀ,   M_z = (1/n) [[A_m m + B_m, A_m], [2 (A_v m + B_v), 2 A_v]],

which is :mod:`.row_jacobian`'s (1) with α = A, in the basis U_z = [1, z_c]. T_c = A z_c + D·1, D = A m + B, so
[1, T_c] = [1, z_c] R with R = [[1, D], [0, A]], and M in the basis [1, T_c] is R⁻¹ M_z R⁻ᵀ (A ≠ 0 in every row;
else the operations' form is not taken). Anything else on the way (an operation not listed, a view that moves a
row's numbers, a value that is not per row) leaves the weight to the probes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpml.train.rules.derived import Derived
from dpml.train.rules.rerun import ThroughView
from dpml.train.rules.flat_indices import in_order, rows_within
from dpml.train.rules.registry import Tracked


@dataclass
class RowMap:
    """(1) of :mod:`.row_jacobian` for each of the C rows: ``alpha`` (C,) and ``mix`` M (C, 2, 2) in float64, T's
    rows ``rows`` (C, n), and their sums and squared norms."""

    alpha: torch.Tensor
    mix: torch.Tensor
    rows: torch.Tensor
    sums: torch.Tensor  # ΣT_c (C,), float64
    squares: torch.Tensor  # ‖T_c‖² (C,), float64


@dataclass
class Rows:
    """A tensor of ``shape`` (C first) that is ``scale`` (C,) · W_c + ``shift`` (C,) in each row c (``scale`` None:
    the row's one value ``shift``, broadcast); with ``averaged``, that affine row (then of ``shape`` but for 1 in
    those dimensions) averaged over those dimensions, keeping them (the Qiao et al. form, ``w.mean(1, keepdim=True)
    .mean(2, keepdim=True).mean(3, keepdim=True)``), a step on the way to the row's mean and nothing else."""

    scale: torch.Tensor | None
    shift: torch.Tensor
    shape: torch.Size
    averaged: frozenset[int] = frozenset()
    full: torch.Size | None = None  # (the shape before those means)


_POINTWISE = frozenset(
    {"sqrt", "rsqrt", "exp", "log", "abs", "square", "reciprocal", "clamp", "clamp_min", "clamp_max", "sigmoid"}
    | {"tanh", "pow", "__pow__", "__rpow__", "maximum", "minimum", "relu", "softplus"}
)
_REDUCTIONS = frozenset({"mean", "sum", "var", "std", "var_mean", "std_mean", "norm", "vector_norm"})


def _name(func: Any) -> str:
    """The operation's name, in-place forms as their out-of-place ones (``__itruediv__``, ``div_``: ``div``)."""
    name = str(getattr(func, "__name__", ""))
    if name.startswith("__i") and name.endswith("__") and name != "__invert__":
        name = "__" + name[3:]
    name = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    aliases = {"__truediv__": "div", "true_divide": "div", "__mul__": "mul", "__add__": "add", "__sub__": "sub"}
    return aliases.get(name, "vector_norm" if name == "linalg_vector_norm" else name)


class _Reader:
    """The operations from W to T read as :class:`Rows`, on W's row statistics (``mean``, ``var``: float64 leaves)."""

    def __init__(self, param: nn.Parameter, rows: int) -> None:
        self.param, self.rows = param, rows
        self.n = param.numel() // rows
        mean, var = row_moments(param.detach().reshape(rows, self.n))
        self.mean, self.var = mean.requires_grad_(), var.requires_grad_()
        self.read: dict[int, list[Rows]] = {}  # id(node output) -> its call's outputs, read

    def operand(self, t: Any, views: dict[int, Tracked]) -> Rows | float | None:
        """An operand as :class:`Rows`, a constant number (a Python number, or a tensor of one element that is no
        source), or None where it is neither."""
        if not isinstance(t, torch.Tensor):
            return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None
        tracked = views.get(id(t))
        if tracked is None:
            return float(t.detach().reshape(())) if t.numel() == 1 and not t.requires_grad else None
        base: Rows | None = Rows(torch.ones_like(self.mean), torch.zeros_like(self.mean), self.param.shape)
        if tracked.param is not self.param:
            base = self._output(tracked.param)
        viewed = None if base is None else self._viewed(base, tracked)
        return None if viewed is None else self._valued(viewed, t, tracked)

    def _valued(self, rows: Rows, t: torch.Tensor, tracked: Tracked) -> Rows | None:
        """``rows`` with its shift set from t's own values. A tracked view says where t's gradient goes, not what t
        holds: t may be its source plus a constant (``std + ε`` is tracked as std, its Jacobian being the
        identity). A per-row value is read from t (its rows must hold one value each); an affine row from t less
        A W_c, which must be one number per row within rounding (a view of the source itself: nothing to read)."""
        values = t.detach().reshape(self.rows, -1)
        if rows.scale is None:
            if not (_one_per_row(values) or torch.equal(values, values[:, :1].expand_as(values))):
                return None
            return Rows(None, rows.shift + (values[:, 0].double() - rows.shift.detach()), rows.shape)
        if _same_numbers(t, tracked):
            return rows
        offset = self._offsets(values, rows.scale.detach())
        return None if offset is None else Rows(rows.scale, rows.shift + (offset - rows.shift.detach()), rows.shape)

    def _offsets(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
        """B_c where ``values`` (C, n) = A_c W_c + B_c·1 in each row (A = ``scale``), float64; None where not. Every
        row's mean and variance are compared (a norm and a mean: cheap), and a sample of rows number by number (the
        same operations made every row, so a form that holds for all rows' moments and these rows' numbers holds)."""
        tolerance = 1000 * torch.finfo(values.dtype).eps
        mean, var = row_moments(values)
        expected = scale.square() * self.var.detach()
        floor = (mean.square() + var) * torch.finfo(values.dtype).eps  # (a row of one value: variance 0 up to rounding)
        if not bool(((var - expected).abs() <= tolerance * (expected + var + floor)).all()):
            return None
        offset = mean - scale * self.mean.detach()
        some = torch.linspace(0, self.rows - 1, min(self.rows, 8), device=values.device).long()
        w = self.param.detach().reshape(self.rows, self.n)[some].double()
        again = scale[some, None] * w + offset[some, None]
        size = values[some].abs().amax(1).double() + (scale[some].abs() * w.abs().amax(1))
        return offset if bool(((again - values[some]).abs().amax(1) <= tolerance * size).all()) else None

    def _output(self, key: torch.Tensor) -> Rows | None:
        read = self.read.get(id(key))
        return None if not read else read[0]

    def _viewed(self, base: Rows, tracked: Tracked) -> Rows | None:
        """``base`` seen through the view ``tracked`` (its index into the base's elements): kept where each row's
        numbers stay in its row, in order (an affine row), or where each element reads its row's value."""
        if tracked.index is None:
            return base
        index, c = tracked.index, self.rows
        if index.dim() < 1 or index.shape[0] != c:
            return None
        if base.averaged:
            return None
        if base.scale is not None:
            return Rows(base.scale, base.shift, index.shape) if in_order(index, c * self.n) else None
        width = max(1, math.prod(base.shape) // c)  # (each row's one value repeated over its elements in the base)
        return Rows(None, base.shift, index.shape) if rows_within(index, width) else None

    def call(self, node: Derived) -> list[Rows] | None:
        """The node's call read: its outputs as :class:`Rows`; None where it is not of the form."""
        if isinstance(node.call[0], ThroughView):
            return None
        func, args, kwargs = node.call
        views = {id(t): tracked for t, tracked in node.sources}
        name = _name(func)
        operands = [self.operand(a, views) for a in args]
        if any(o is None for o in operands[:1]):
            return None
        if name in _REDUCTIONS:
            first = operands[0]
            return self._reduced(name, first, args, kwargs) if isinstance(first, Rows) else None
        if any(o is None for o in operands) or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return None
        if any(isinstance(o, Rows) and o.averaged for o in operands):
            return None
        shape = broadcast(*(o.shape for o in operands if isinstance(o, Rows)))
        if shape is None:
            return None
        if any(isinstance(o, Rows) and len(o.shape) != len(shape) for o in operands) or shape[0] != self.rows:
            return None  # (rows must meet rows: a per-row value of shape (C,) against (C, n) would not)
        found = self._arithmetic(name, operands, kwargs, shape)
        if found is None and name in _POINTWISE and all(not isinstance(o, Rows) or o.scale is None for o in operands):
            found = Rows(None, func(*[o.shift if isinstance(o, Rows) else o for o in operands], **kwargs), shape)
        return None if found is None else [found]

    def _arithmetic(
        self, name: str, operands: list[Rows | float | None], kwargs: dict[str, Any], shape: torch.Size
    ) -> Rows | None:
        """Sums, differences, products and quotients that keep each row affine."""
        alpha = kwargs.get("alpha", 1)
        if name in ("add", "sub", "__radd__", "__rsub__", "rsub") and len(operands) == 2:
            a, b = operands
            if name in ("__rsub__", "rsub"):
                a, b = b, a
            sign = -float(alpha) if name in ("sub", "__rsub__", "rsub") else float(alpha)
            return _plus(_as_rows(a, shape, self.mean.device), _times(_as_rows(b, shape, self.mean.device), sign))
        if name in ("mul", "__rmul__") and len(operands) == 2:
            a, b = (_as_rows(o, shape, self.mean.device) for o in operands)
            if a.scale is not None and b.scale is not None:
                return None
            affine, factor = (a, b) if b.scale is None else (b, a)
            return _times(affine, factor.shift, shape)
        if name in ("div", "__rtruediv__") and len(operands) == 2 and "rounding_mode" not in kwargs:
            a, b = (_as_rows(o, shape, self.mean.device) for o in operands)
            if name == "__rtruediv__":
                a, b = b, a
            return None if b.scale is not None else _times(a, 1 / b.shift, shape)
        if name in ("neg", "__neg__", "negative") and len(operands) == 1:
            return _times(_as_rows(operands[0], shape, self.mean.device), -1.0)
        return None

    def _reduced(self, name: str, x: Rows, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Rows] | None:
        """A reduction over every number of each row (and nothing else) of an affine row; or a mean over some of a
        row's dimensions, kept (:class:`Rows`' ``averaged``)."""
        if x.scale is None:
            return None
        bound = _reduction_arguments(name, args, kwargs)
        dims, ndim, keep = bound.get("dim"), len(x.shape), bool(bound.get("keepdim"))
        listed = [dims] if isinstance(dims, int) else list(dims) if isinstance(dims, (tuple, list)) else None
        every = frozenset(range(1, ndim))
        chosen = frozenset(d % ndim for d in listed) if listed is not None and ndim > 1 else None
        if chosen is None or len(chosen) != len(listed or ()) or not chosen <= every or chosen & x.averaged:
            return None
        whole = math.prod(x.full or x.shape) == self.rows * self.n
        if not whole or (x.averaged and name != "mean"):
            return None
        if chosen | x.averaged != every:  # (a mean over some of the row's dimensions)
            if name != "mean" or not keep:
                return None
            shape = torch.Size([1 if d in chosen else size for d, size in enumerate(x.shape)])
            return [Rows(x.scale, x.shift, shape, chosen | x.averaged, x.full or x.shape)]
        shape = torch.Size([self.rows, *([1] * (ndim - 1))]) if keep else torch.Size([self.rows])
        a, b, n = x.scale, x.shift, self.n
        mean = a * self.mean + b
        if name == "mean":
            return [Rows(None, mean, shape)]
        if name == "sum":
            return [Rows(None, n * mean, shape)]
        if name in ("norm", "vector_norm"):
            if bound.get("p", bound.get("ord", 2)) not in (2, 2.0, "fro"):
                return None
            return [Rows(None, (n * (a.square() * self.var + mean.square())).sqrt(), shape)]
        correction = _correction(bound)
        if correction is None or n - correction <= 0:
            return None
        var = a.square() * self.var * (n / (n - correction))
        spread = var.sqrt() if name.startswith("std") else var
        return [Rows(None, spread, shape)] + ([Rows(None, mean, shape)] if name.endswith("_mean") else [])

    def map_of(self, output: torch.Tensor, chain: list[Derived]) -> RowMap | None:
        """Each node of ``chain`` read in turn; T's :class:`RowMap` where T is read as an affine row and checked."""
        for node in chain:
            read = self.call(node)
            if read is None:
                return None
            match = _matching(read, node.output)
            if match is None:
                return None
            self.read[id(node.output)] = [match]
        found = self._output(output)
        if found is None or found.scale is None or found.averaged or found.shape != output.shape:
            return None
        return self._checked(found, output)

    def _checked(self, found: Rows, output: torch.Tensor) -> RowMap | None:
        """T = A W + B·1 checked against T's recorded values (:meth:`_offsets`), then M (module docstring)."""
        a, b = found.scale, found.shift
        assert a is not None
        t = output.detach().reshape(self.rows, self.n)
        if not bool((a != 0).all()) or not bool(torch.isfinite(a).all() & torch.isfinite(b).all()):
            return None
        offset = self._offsets(t, a.detach())
        scale = (a.detach() * self.mean.detach() + b.detach()).abs() + a.detach().abs() * self.var.detach().sqrt()
        if offset is None or not bool(((offset - b.detach()).abs() <= 1000 * torch.finfo(t.dtype).eps * scale).all()):
            return None
        partials = [_partials(q, (self.mean, self.var)) for q in (a, b)]
        (a_m, a_v), (b_m, b_v) = partials
        m, n = self.mean.detach(), self.n
        mix_z = (
            torch.stack([torch.stack([a_m * m + b_m, a_m], 1), torch.stack([2 * (a_v * m + b_v), 2 * a_v], 1)], 1) / n
        )
        a, d = a.detach(), (a * self.mean + b).detach()
        back = torch.stack(
            [torch.stack([torch.ones_like(a), -d / a], 1), torch.stack([torch.zeros_like(a), 1 / a], 1)], 1
        )
        centred = (
            a.square() * self.var.detach()
        )  # (T_c's sum and square from the moments: ΣT = n D, ‖T‖² = n (A² v + D²))
        return RowMap(a, back @ mix_z @ back.transpose(1, 2), t, n * d, n * (centred + d.square()))


def _one_per_row(values: torch.Tensor) -> bool:
    """Each row of ``values`` (C, n) is one number repeated by its layout (a per-row value expanded: stride 0)."""
    return values.shape[1] <= 1 or values.stride(1) == 0


def _same_numbers(t: torch.Tensor, tracked: Tracked) -> bool:
    """t holds its source's own numbers in the source's order: the source itself, or a view of it (its index in
    order) over the same memory laid out alike (``w.view(C, -1)`` of a contiguous w), so nothing is added to them."""
    source = tracked.param
    if tracked.index is None and t.shape == source.shape and t.data_ptr() == source.data_ptr():
        return True
    if tracked.index is None or not in_order(tracked.index, source.numel()):
        return False
    return (
        t.numel() == source.numel()
        and t.data_ptr() == source.data_ptr()
        and t.is_contiguous()
        and source.is_contiguous()
        and t.dtype == source.dtype
    )


def row_moments(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's mean m and biased variance v, float64: v = ‖w‖²/n − m² from one mean and one norm (both a small
    fraction of ``torch.var_mean``'s time on a CPU), or from the centred rows where the mean carries more than half
    of the rows' square (there the difference would lose digits)."""
    n = w.shape[1]
    mean = w.mean(1).double()  # (in w's dtype, then float64: a float64 reduction of float32 rows is slow)
    square = torch.linalg.vector_norm(w, dim=1).double().square() / n
    if bool((mean.square() > square / 2).any()):
        return mean, (w.double() - mean[:, None]).square().mean(1)
    return mean, square - mean.square()


def _partials(q: torch.Tensor, leaves: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """∂q_c/∂(m_c, v_c) per row (q is computed row by row: the gradient of Σ q holds each row's own)."""
    if not q.requires_grad:
        return torch.zeros_like(leaves[0]), torch.zeros_like(leaves[1])
    found = torch.autograd.grad(q.sum(), leaves, retain_graph=True, allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(leaves, found, strict=True))  # type: ignore[return-value]


def _reduction_arguments(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A reduction's arguments by name: ``mean(x, dim, keepdim)``, ``var(x, dim, unbiased, keepdim)`` (or
    ``correction=``), ``norm(x, p, dim, keepdim)``, ``vector_norm(x, ord, dim, keepdim)``."""
    if name in ("norm", "vector_norm"):
        keys: tuple[str, ...] = ("p" if name == "norm" else "ord", "dim", "keepdim")
    elif name in ("var", "std", "var_mean", "std_mean"):
        keys = ("dim", "unbiased", "keepdim")
    else:
        keys = ("dim", "keepdim")
    return dict(zip(keys, args[1:], strict=False)) | kwargs


def _correction(bound: dict[str, Any]) -> float | None:
    """var's and std's correction (``unbiased``, ``correction``; 1 by default)."""
    if bound.get("correction") is not None:
        return float(bound["correction"])
    unbiased = bound.get("unbiased", True)
    return (1.0 if unbiased else 0.0) if isinstance(unbiased, bool) else None


def _as_rows(o: Rows | float | None, shape: torch.Size, device: torch.device) -> Rows:
    """A constant number as a per-row value."""
    if isinstance(o, Rows):
        return o
    assert o is not None
    return Rows(None, torch.full((shape[0],), float(o), dtype=torch.float64, device=device), shape)


def _plus(a: Rows, b: Rows) -> Rows:
    scale = a.scale if b.scale is None else b.scale if a.scale is None else a.scale + b.scale
    shape = broadcast(a.shape, b.shape)
    if shape is None:  # (never: the call's operands were broadcast together first, :meth:`_Reader.call`)
        raise ValueError(f"shapes {tuple(a.shape)} and {tuple(b.shape)} do not broadcast")
    return Rows(scale, a.shift + b.shift, shape)


def broadcast(*shapes: torch.Size) -> torch.Size | None:
    """The shapes broadcast together (``torch.broadcast_shapes``' rule, which costs 60 µs a call on a CPU), or None
    where they do not broadcast."""
    length = max((len(shape) for shape in shapes), default=0)
    out = [1] * length
    for shape in shapes:
        for place, size in enumerate(shape, length - len(shape)):
            if size != out[place] and size != 1 and out[place] != 1:
                return None
            out[place] = size if size != 1 else out[place]
    return torch.Size(out)


def _times(a: Rows, factor: torch.Tensor | float, shape: torch.Size | None = None) -> Rows:
    return Rows(None if a.scale is None else a.scale * factor, a.shift * factor, shape or a.shape)


def _matching(read: list[Rows], output: torch.Tensor) -> Rows | None:
    """The read output whose shape is the node's (of a call with several outputs, the one whose values are; a value
    per row compared row by row)."""
    fitting = [r for r in read if r.shape == output.shape]
    if len(fitting) <= 1:
        return fitting[0] if fitting else None
    values = output.detach().reshape(output.shape[0], -1)[:, 0].double()
    close = [r for r in fitting if r.scale is None and torch.allclose(r.shift.detach(), values, rtol=1e-4)]
    return close[0] if len(close) == 1 else None


def read_row_map(chain: list[Derived], param: nn.Parameter, output: torch.Tensor) -> RowMap | None:
    """T's :class:`RowMap` read off the operations of ``chain`` (module docstring); None where they are not of the
    form."""
    if output.dim() < 1 or param.shape[0] != output.shape[0] or param.numel() != output.numel():
        return None
    with torch.enable_grad():
        return _Reader(param, output.shape[0]).map_of(output, chain)
