"""The registry of per-operation rules, and what a rule sees and returns.

A *rule* is registered for one or more torch functions (``@rule(F.linear, torch.addmm)``). While the
engine records the forward pass (:mod:`dpml.train.rules.recorder`), every call of a registered function
that has a trainable parameter — or a tracked view of one — among its operands is handed to its rule
as a :class:`Call`. The rule returns one of:

- a :class:`Pending`: the call's output z, the parameters it covers, and ``finish``, which maps the output
  gradient δ = ∂(Σ_j ℓ_j)/∂z (one backward pass for all rules) to each parameter's per-example
  gradient in a :class:`Factored`, :class:`Dense` or :class:`Computed` form;
- a :class:`Shared`: the output is itself a view of a parameter that every example shares (an embedding
  looked up with position ids (1, T) or (T,)): it is tracked like ``w.t()``, and the operation that
  meets the batch (``h + pos``) is the one whose rule forms the per-example gradient;
- a string: why the rule does not apply to this call (the parameter then takes the exact path, and
  the plan says so).

Per-example gradients are written in the coordinates of the tensor the operation used (V = the
parameter or a view of it); :class:`Tracked` maps them back: ``index`` holds, for each element of V,
its flat position in the parameter (``None``: V is the parameter itself).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import nn

from dpml.train.keep_budget import BEYOND_KEEP_LIMIT, keep_limit
from dpml.train.rules.flat_indices import counting, same_along
from dpml.train.rules.outputs import Recorded

if TYPE_CHECKING:  # annotations only: .ragged builds on this module's Factored and Rows
    from dpml.train.rules.ragged import Ragged


@dataclass(frozen=True, eq=False)
class Tracked:
    """A tensor V that is the parameter ``param`` or a view of it:
    V.flatten()[j] = param.flatten()[index.flatten()[j]]."""

    param: nn.Parameter
    index: torch.Tensor | None = None  # int64, V's shape; None: V is the parameter
    shared: bool = False  # the output of an operation (a lookup with shared ids), not the parameter's own view

    def flat_index(self) -> torch.Tensor:
        if self.index is not None:
            return self.index
        return counting(self.param.numel(), self.param.device).view(self.param.shape)

    def shape(self) -> torch.Size:
        return self.param.shape if self.index is None else self.index.shape


@dataclass
class Factored:
    """Per-example gradient of a 2-D V (rows × cols) as Σ_t u_t v_tᵀ over positions t (Goodfellow 2015):
    ``u`` (B, T, rows) and ``v`` (B, T, cols) — or, for a one-hot factor (an embedding's rows e_{k_t}),
    integer indices (B, T) whose entries are the k_t. ``applied`` (B, T, rows), where the rule has it: V's product
    with each v_t, the operation's own output without its bias (a convolution's), which a weight standardised
    before its use reads (:mod:`dpml.train.rules.standardised`, :mod:`dpml.train.rules.row_jacobian`). ``lengths``,
    where the rule has them: ragged rows padded (:class:`Rows`), each example's real positions first, the rest zero
    rows — its norm and clipped sum then skip the padding (:mod:`dpml.train.ragged_norms`)."""

    u: torch.Tensor
    v: torch.Tensor
    rows: int
    cols: int
    applied: torch.Tensor | None = None
    lengths: torch.Tensor | None = None  # (B,) on the CPU: example i's positions from lengths[i] on are zero rows

    def transposed(self) -> Factored:
        return Factored(self.v, self.u, self.cols, self.rows, lengths=self.lengths)


@dataclass
class Dense:
    """Per-example gradient of V materialised: (B, *V.shape)."""

    grads: torch.Tensor


@dataclass(eq=False)
class Computed:
    """Per-example gradients of V that the operation's own kernels form on demand (a convolution's weight gradient):
    ``gradients(s)`` the examples of slice s materialised, (|s|, *V.shape); ``weighted_sum(c)`` Σ_i c_i G_i without
    them (one weight gradient of the clip-weighted output gradient); ``cast(dtype)`` the same in another dtype;
    ``squared_norms()``, where the operation has a closed form cheaper than forming them (a bilinear form's ghost
    norm), ‖G_i‖² (B,) without them — for G itself only: a sum of uses, or a map of G, forms them."""

    batch: int
    shape: tuple[int, ...]  # V's
    device: torch.device
    gradients: Callable[[slice], torch.Tensor]
    weighted_sum: Callable[[torch.Tensor], torch.Tensor]
    cast: Callable[[torch.dtype], Computed]
    squared_norms: Callable[[], torch.Tensor] | None = None


Form = Union[Factored, Dense, Computed, "Ragged"]
Use = tuple[Tracked, Form]


@dataclass
class Pending:
    """A recorded call: its output (once recorded, what stands for it: :mod:`.outputs`), the parameters its rule
    covers, and δ ↦ their per-example gradients."""

    output: Recorded
    params: list[nn.Parameter]
    finish: Callable[[torch.Tensor], list[Use]]
    operation: str = ""  # the function's name (set by the recorder)
    taken_as_batch: tuple[torch.Tensor, int] | None = None  # a constant operand read as the batch's along a dimension


@dataclass
class Shared:
    """The call's outputs are views of a parameter shared by every example (tracked, not yet a use)."""

    outputs: list[tuple[torch.Tensor, Tracked]] = field(default_factory=list)


@dataclass
class Decomposed:
    """The call's value as other calls give it, run under the recorder in its place (their operations seen one by one,
    as a composite's): a computation on parameters made narrower than the call (a lookup at shared indices read on
    the rows it reaches alone, :func:`dpml.train.rules.embedding.embedding`); ``views``: the operands it made of the
    call's, tracked as the parameters' views they are before it runs."""

    run: Callable[[], Any]
    views: list[tuple[torch.Tensor, Tracked]] = field(default_factory=list)


def example_runs(owners: torch.Tensor | None, batch: int) -> int | None:
    """k where ``owners`` (N,), the example of each index of a tensor's first dimension, holds each example's
    indices in one run of k, in batch order (index j of example ⌊j/k⌋: Swin's windows (B·windows, …), a batched
    product's heads example by example (B·H, …)); None otherwise."""
    if owners is None or owners.shape[0] % batch:
        return None
    k = owners.shape[0] // batch
    return k if torch.equal(owners.cpu(), torch.arange(batch).repeat_interleave(k)) else None


@dataclass
class Rows:
    """Where each example's rows are in a tensor whose leading dimensions hold the batch (all but the last):
    ``order`` lists the flattened leading positions example by example (None: already example-major). Examples with
    different numbers of rows (the tokens a mixture of experts routes to one expert) are *ragged*: each example's
    rows are then padded with zero rows to the largest number, ``width``; ``slots`` gives each row, in example
    order, its place among the B·width. A zero row adds nothing to a sum over rows of products or of rows."""

    batch: int
    order: torch.Tensor | None
    slots: torch.Tensor | None = None  # (N,) on the CPU; None: every example has N / B rows
    width: int = 0
    counts: torch.Tensor | None = None  # (B,) on the CPU: each example's rows (ragged only)
    interleaved: bool = False  # row j is example j mod B's (time-major rows): read as a strided view, not gathered

    @staticmethod
    def of_map(examples: torch.Tensor, batch: int, ragged: bool = True) -> Rows | None:
        """The rows of a tensor whose example map (the example of each element) is ``examples``; None where a row
        holds several examples, or (``ragged`` False) where the examples hold different numbers of rows."""
        if examples.stride(-1) != 0 and not torch.equal(examples, examples[..., :1].expand_as(examples)):
            return None  # a row that holds several examples
        lead = examples[..., 0].reshape(-1).to(torch.int64)
        counts = torch.bincount(lead, minlength=batch)
        if counts.numel() != batch:
            return None
        order = None if bool((lead[1:] >= lead[:-1]).all()) else torch.argsort(lead, stable=True)
        if lead.numel() % batch == 0 and bool((counts == lead.numel() // batch).all()):
            steps = lead.view(-1, batch) if order is not None else None
            if steps is not None and torch.equal(steps, torch.arange(batch).expand_as(steps)):
                return Rows(batch, order, interleaved=True)
            return Rows(batch, order)
        if not ragged:
            return None
        by_example = lead if order is None else lead[order]
        width = int(counts.max())
        starts = torch.cumsum(counts, 0) - counts
        slots = by_example * width + torch.arange(lead.numel()) - starts[by_example]
        return Rows(batch, order, slots, width, counts)

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """t (…, n) with the rows of ``Rows``' layout, as (B, k, n) example by example (ragged: zero rows padding
        each example's to ``width``; interleaved rows: a strided view of t, not a copy)."""
        flat = t.reshape(-1, t.shape[-1])
        if self.interleaved:  # (k·B, n) step by step: (B, k, n) as a view
            return flat.view(-1, self.batch, flat.shape[-1]).transpose(0, 1)
        if self.order is not None:
            flat = flat[self.order.to(flat.device)]
        if self.slots is None:
            return flat.reshape(self.batch, -1, t.shape[-1])
        padded = flat.new_zeros(self.batch * self.width, flat.shape[-1])
        return padded.index_copy_(0, self.slots.to(flat.device), flat).reshape(self.batch, self.width, -1)


def by_example(t: torch.Tensor, rows: Rows | None) -> torch.Tensor:
    """(N, c, T) per image as (B, c, k·T) per example: an example's k images (``rows``: the input's images grouped by
    example, B·k of them, as MViT pools each head's map) side by side as one image's positions, whose products with
    the output gradient add up over them; a batch-first t as it is."""
    if rows is None:
        return t
    channels, positions = t.shape[1], t.shape[2]
    t = rows.of(t.reshape(t.shape[0], -1))  # (B, k, c·T), example by example
    return t.reshape(rows.batch, -1, channels, positions).transpose(1, 2).reshape(rows.batch, channels, -1)


@dataclass
class Call:
    """One call of a registered function, as its rule sees it."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    batch: int
    tracked_of: Callable[[Any], Tracked | None]
    rows_of: Callable[[torch.Tensor], Rows | None]
    batch_first_of: Callable[[torch.Tensor], bool]
    leading_examples_of: Callable[[torch.Tensor], torch.Tensor | None]
    from_batch_of: Callable[[torch.Tensor], bool]
    example_axis_of: Callable[[torch.Tensor], tuple[int, torch.Tensor] | None]
    constant_as_batch_of: Callable[[nn.Parameter, int], bool] = lambda param, dim: False

    def arg(self, position: int, name: str, default: Any = None) -> Any:
        if len(self.args) > position:
            return self.args[position]
        return self.kwargs.get(name, default)

    def tracked(self, value: Any) -> Tracked | None:
        return self.tracked_of(value)

    def rows(self, t: torch.Tensor) -> Rows | None:
        """t's leading dimensions as example-major rows (a batch-first tensor, or one whose batch dimension
        the recorder followed through transposes and reshapes); None when that is not known."""
        return self.rows_of(t)

    def from_batch(self, t: Any) -> bool:
        """t was computed from the batch's inputs (position ids and masks built from constants were not)."""
        return isinstance(t, torch.Tensor) and self.from_batch_of(t)

    def batch_first(self, t: Any) -> bool:
        """t is an activation whose first dimension is the batch."""
        return isinstance(t, torch.Tensor) and self.batch_first_of(t)

    def leading_examples(self, t: Any) -> torch.Tensor | None:
        """The example of each index of t's first dimension (N,) when each of its slices belongs to one example: 0 …
        B − 1 for a batch-first activation, each window's example for Swin's (B·windows, …); else None."""
        return self.leading_examples_of(t) if isinstance(t, torch.Tensor) else None

    def slices_by_example(self, t: Any) -> tuple[bool, Rows | None]:
        """Whether t's first dimension holds whole examples' slices, and how: (True, None) for a batch-first t;
        (True, rows) where it holds B·k slices, k of each example's, in any order (Swin's windows, LeViT's tokens
        flattened to (B·N, C), MViT's per-head maps): ``rows`` groups them (:func:`by_example`); else (False, None)."""
        if self.batch_first(t):
            return True, None
        merged = self.leading_examples(t)
        rows = None if merged is None else Rows.of_map(merged.unsqueeze(1), self.batch)
        return rows is not None, rows

    def may_read_constant_as_batch(self, param: nn.Parameter, dim: int) -> bool:
        """Whether a rule of ``param`` may read a constant operand's dimension ``dim`` as the batch's: on the plan's
        probe, any (the probe judges each reading); in training, the one the probe confirmed for ``param``."""
        return self.constant_as_batch_of(param, dim)

    def example_axis(self, t: Any) -> tuple[int, torch.Tensor] | None:
        """(k, the example of each index of dimension k (a CPU tensor)) where the activation t's examples vary along
        its dimension k alone (batch-first, time-major, or the rows of all examples moved off the first dimension:
        (H, B·T, d) for per-head products written heads first); None otherwise."""
        return self.example_axis_of(t) if isinstance(t, torch.Tensor) else None


def per_example(rows: torch.Tensor, owners: torch.Tensor, batch: int) -> torch.Tensor:
    """(N, …) per-row gradients added up per example, (B, …): ``owners`` (N,) the example of each row (an
    example map of the recorder's, on the CPU: read there, moved to the rows' device only to be used)."""
    if owners.numel() == batch and bool((owners == torch.arange(batch, device=owners.device)).all()):
        return rows
    return rows.new_zeros(batch, *rows.shape[1:]).index_add_(0, owners.to(rows.device), rows)


def view_per_example(s: Tracked, padded: tuple[int, ...], batch: int) -> Tracked | None:
    """S' (S with leading 1s, ``padded``) as one example's view of the parameter: its slice for any example, or
    None when the slices differ (S is then not broadcast over the batch)."""
    index = s.flat_index().reshape(padded)
    if padded[0] == 1:
        return Tracked(s.param, index[0])
    if padded[0] == batch and same_along(index, 0):
        return Tracked(s.param, index[0])
    return None


def beyond_keep_limit(batch: int, shape: tuple[int, ...] | torch.Size, device: torch.device) -> str | None:
    """Why a rule that materialises B × |S| per-example numbers for a parameter (view) of ``shape`` refuses: they pass
    the device's keep limit (:func:`dpml.train.keep_budget.keep_limit`); None when they fit."""
    if batch * math.prod(shape) <= keep_limit(device):
        return None
    return f"its per-example gradients ({batch} × {tuple(shape)}) {BEYOND_KEEP_LIMIT}"


Gather = Callable[[torch.Tensor], torch.Tensor]
"""(N, …) gradients of a parameter operand's rows (after the broadcast sums) ↦ its view's per-example gradients."""


def broadcast_view(
    call: Call, s: torch.Tensor, owners: torch.Tensor, at: int = 0
) -> tuple[Tracked, tuple[int, ...], tuple[int, ...], Gather] | str:
    """The parameter operand s of an elementwise call as one example's view of its parameter, its shape padded to the
    output z's rank, the dimensions of z it is broadcast over (summed in its gradient), and how its rows' gradients
    become per-example ones (``owners``: the example of each index of z's dimension ``at``, its batch: shapes,
    dimensions and rows are then those of z with that dimension moved first, a time-major z read batch-first); or why
    not. Either every example shares S's slice (:func:`view_per_example`: rows added up per example), or S has one
    slice per row and every example's k rows use the same k slices (WavLM's relative position bias repeated over the
    batch, a slice per head: the example's view is those k slices)."""
    z_shape, tracked = list(call.output.shape), call.tracked(s)
    if s.dim() > len(z_shape):
        return "a parameter with more dimensions than the result"
    padded = (1,) * (len(z_shape) - s.dim()) + tuple(s.shape)
    if at:
        moved = tracked.flat_index().reshape(padded).movedim(at, 0)  # type: ignore[union-attr]
        tracked = Tracked(tracked.param, moved, tracked.shared)  # type: ignore[union-attr]
        padded, z_shape = tuple(moved.shape), [z_shape[at], *z_shape[:at], *z_shape[at + 1 :]]
    reduce = tuple(d for d in range(1, len(z_shape)) if padded[d] == 1 and z_shape[d] != 1)
    rows, batch = z_shape[0], call.batch
    view = view_per_example(tracked, padded, rows)  # type: ignore[arg-type]
    if view is not None:
        return view, padded, reduce, lambda g: per_example(g.reshape(rows, *padded[1:]), owners, batch)
    grouped = Rows.of_map(owners.unsqueeze(1), batch, ragged=False) if padded[0] == rows and rows > batch else None
    index = None if grouped is None else grouped.of(tracked.flat_index().reshape(rows, -1))  # type: ignore[union-attr]
    if grouped is None or index is None or not same_along(index, 0):
        if padded[0] == rows:
            return _slice_per_row(call, tracked, padded, reduce, owners)  # type: ignore[arg-type]
        return f"an operand (shape {tuple(s.shape)}) that is not broadcast over the batch"
    view = Tracked(tracked.param, index[0].reshape(-1, *padded[1:]), tracked.shared)  # type: ignore[union-attr]
    beyond = beyond_keep_limit(batch, view.shape(), call.output.device)
    if beyond is not None:
        return f"an operand with a slice per row: {beyond}"
    return view, padded, reduce, lambda g: grouped.of(g.reshape(rows, -1)).reshape(batch, *view.shape())


def _slice_per_row(
    call: Call, tracked: Tracked, padded: tuple[int, ...], reduce: tuple[int, ...], owners: torch.Tensor
) -> tuple[Tracked, tuple[int, ...], tuple[int, ...], Gather] | str:
    """S with a slice of the parameter per row of z, chosen row by row (a mixture of experts' biases gathered by each
    token's expert, ``bias[expert_ids]``), the rows' examples ``owners``: example i's gradient of the whole parameter
    is Σ over its rows r of the row's gradient scattered to the positions its slice reads, ∇ℓ_i = Σ_{r: owner(r) = i}
    Σ_j e_{index(r, j)} g_{r,j} (B × |parameter| numbers, within the keep limit)."""
    batch, whole = call.batch, Tracked(tracked.param)
    beyond = beyond_keep_limit(batch, whole.shape(), call.output.device)
    if beyond is not None:
        return f"an operand with a slice of the parameter per row: {beyond}"
    size = tracked.param.numel()
    places = tracked.flat_index().reshape(padded[0], -1) + owners.to(tracked.param.device).unsqueeze(1) * size

    def scattered(g: torch.Tensor) -> torch.Tensor:
        flat = g.new_zeros(batch * size).index_add_(0, places.reshape(-1), g.reshape(-1))
        return flat.view(batch, *whole.shape())

    return whole, padded, reduce, scattered


RuleFunction = Callable[[Call], Union[Pending, list[Pending], Shared, Decomposed, str]]
RULES: dict[Any, RuleFunction] = {}
BROADCASTING: set[Any] = set()  # functions that broadcast a shared operand over the batch: per-example copies
INDEX_VIEWS: set[Any] = set()  # value-selecting ops: applied to the index tensors (w.t(), w.chunk(3), w[:k], …)
IDENTITY_VIEWS: set[Any] = set()  # value-preserving ops: the index passes through (contiguous, clone, casts)
SHAPE_ONLY: set[Any] = set()  # views whose other tensor operands give a shape or a dtype, not values (view_as)
METADATA: set[Any] = set()  # what a tensor is, not its values (w.dtype, w.shape): no use of the parameter
VALUE_OF_FIRST: set[Any] = set()  # the first operand's values alone; another only gives a dtype, device (p.to(x))


def rule(*functions: Any) -> Callable[[RuleFunction], RuleFunction]:
    """Register a rule for the given torch functions (one registration per rule; one file per rule)."""

    def register(fn: RuleFunction) -> RuleFunction:
        for f in functions:
            if f in RULES:
                raise ValueError(f"{function_name(f)} has two rules")
            RULES[f] = fn
        return fn

    return register


def function_name(func: Any) -> str:
    """``torch.addmm``, ``F.linear``, ``Tensor.cumsum``: how the plan names an operation."""
    name = getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None) or ""
    qualified = getattr(func, "__qualname__", name)
    if module == "torch.nn.functional" or module == "torch._C._nn":
        return f"F.{name}"
    if qualified.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + qualified.split(".", 1)[1]
    if qualified.startswith("_VariableFunctionsClass.") or module in ("torch", "torch.functional"):
        return f"torch.{name}"
    if name == "__get__":
        return "Tensor attribute"
    return f"{module}.{name}" if module else name
