"""What the recorder does with an operation no rule knows, called with a parameter and the batch: the call run again
example by example, each example's gradient of the parameter taken through that one operation alone.

Let z = f(x, w) be the call, x its operands from the batch (each holding example i's elements as one slice along
one axis, :class:`Place`: batch-first, time-major, or a run of Swin's windows), w its parameter operands
(parameters, their views, computations on parameters alone), z its output, laid out the same way. If f on example
i's slices alone gives example i's slice of z,

    f(x_i, w) = z_i  for every example i,                                                              (1)

then example i's loss reaches w through this call only by z_i (the probe checks that each example's loss depends on
its own values alone), and its gradient is one vector-Jacobian product through f alone,

    ∇_w ℓ_i = J_w f(x_i, w)ᵀ δ_i,   δ_i = example i's slice of δ = ∂(Σ_j ℓ_j)/∂z                       (2)

(the one backward pass every rule reads δ from). Each example's call reads its own copy W_i of w, a leaf (B,
*w.shape), so that one backward pass over the B calls gives every (2) at once, materialised within the keep limit;
the calls run as one ``torch.func.vmap`` where the function allows (the operation's own cost, batched), a custom
autograd Function's as one vmap of its own forward and backward (:mod:`.function_calls`: (2) is then that backward
on δ_i, no graph kept), else one call per example. (1) is checked when the call is recorded: the calls' outputs
against z's slices up to rounding (√ε of z's dtype relative to z's largest entry). The exact path instead
backpropagates B rows through the whole graph from the loss. A call that draws random numbers (its values differ
when run again), or whose slices read other examples' values, fails (1): its parameters take the exact path, the
reason saying so. The probe then judges (2) against autograd's per-example gradients, as it judges every rule. (1)
is checked at every call, in training too, not only on the probe's batch: it reads the outputs' values, one wait for
a GPU per such call, the price of never clipping by a per-example gradient that is not one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dpml.train.rules.function_calls import autograd_function, backward_from, forward_with_context
from dpml.train.rules.operands import outputs, substituted, tensors
from dpml.train.rules.registry import (
    Call,
    Dense,
    Pending,
    Tracked,
    Use,
    beyond_keep_limit,
    example_runs,
    view_per_example,
)
from dpml.train.rules.rerun import random_state, replayed, writes_first_operand


@dataclass(frozen=True)
class Place:
    """Where a tensor holds each example: example i's elements are its slice [i·run, (i + 1)·run) along ``axis``
    (batch-first: axis 0, run 1; time-major: axis 1; Swin's windows: axis 0, a run of windows per example)."""

    axis: int
    run: int
    batch: int

    def by_example(self, t: torch.Tensor) -> torch.Tensor:
        """t as (B, *example i's slice's shape), a view: entry i is t's slice [i·run, (i + 1)·run) along ``axis``."""
        split: torch.Tensor = t.unflatten(self.axis, (self.batch, self.run))
        return split.movedim(self.axis, 0)


@dataclass(frozen=True)
class _Copies:
    """A parameter operand's per-example copies, W (B, *w.shape), a leaf: copy i is what example i's call reads. An
    operand expanded over the batch (``w.expand(B, …)``, every example's slice the same view: ``tracked`` is that
    slice) has copies of its slice, and example i's call reads copy i with a batch dimension of one."""

    operand: torch.Tensor
    tracked: Tracked
    copies: torch.Tensor
    expanded: bool = False

    def as_read(self, copy: torch.Tensor) -> torch.Tensor:
        """One example's copy as its call reads it."""
        return copy.unsqueeze(0) if self.expanded else copy


def per_example_calls(call: Call, because: str = "no rule") -> list[Pending] | str:
    """The call's per-example gradients by (2) of the module docstring, one pending use for each of its outputs that
    carries a gradient (their uses of a parameter add up), or why (1) cannot be used, after ``because``: why the
    call came here rather than to a rule."""
    found = _uses(call)
    return found if isinstance(found, list) else f"{because}, and {found}"


def _uses(call: Call) -> list[Pending] | str:
    """:func:`per_example_calls`' uses, or why not (its reason's second half)."""
    if call.kwargs.get("out") is not None or writes_first_operand(call.func, call.kwargs):
        return "it writes in place"
    out = [z for z in outputs(call.output) if z.requires_grad]
    if any(z.layout != torch.strided or not (z.is_floating_point() or z.is_complex()) for z in out):
        return "an output is not a dense floating-point or complex tensor"
    places = _places(call, [t for t in tensors(call.args, call.kwargs) if call.tracked(t) is None], out)
    if isinstance(places, str):
        return places
    copies = _copies(call)
    if isinstance(copies, str):
        return copies
    function = autograd_function(call.func)
    if function is not None and (by_backward := _function_calls(call, function, out, places, copies)) is not None:
        return by_backward
    found = _called_per_example(call, out, places, copies)
    if isinstance(found, str):
        return f"run example by example it {found}"
    uses = []
    for z, stacked in zip(out, found, strict=True):
        place = places[id(z)]
        assert place is not None
        uses.append(_pending(z, stacked, place, copies))
    return uses


def _pending(z: torch.Tensor, stacked: torch.Tensor, place: Place, copies: list[_Copies]) -> Pending:
    """The use of every parameter operand through output z: (2) for every example at once, from ``stacked``, the
    example calls' outputs (B, *example i's slice of z), functions of the copies."""

    def finish(d: torch.Tensor) -> list[Use]:
        cotangent = place.by_example(d).to(stacked.dtype)
        found = torch.autograd.grad(
            stacked, [c.copies for c in copies], cotangent, retain_graph=True, allow_unused=True
        )
        return [
            (c.tracked, Dense(torch.zeros_like(c.copies) if g is None else g))
            for c, g in zip(copies, found, strict=True)
        ]

    return Pending(z, [c.tracked.param for c in copies], finish)


def _places(call: Call, operands: list[torch.Tensor], out: list[torch.Tensor]) -> dict[int, Place | None] | str:
    """Each operand's and output's :class:`Place` of the examples (None: an operand not from the batch, read whole by
    every example's call); or why the examples are not found that way."""
    found: dict[int, Place | None] = {}
    for t in [*operands, *out]:
        if not call.from_batch(t):
            if any(t is z for z in out):
                return "an output that is not the batch's"
            found[id(t)] = None
            continue
        axis = call.example_axis(t)
        run = None if axis is None else example_runs(axis[1], call.batch)
        if axis is None or run is None:
            return f"an operand from the batch (shape {tuple(t.shape)}) not laid out example by example along one axis"
        found[id(t)] = Place(axis[0], run, call.batch)
    return found


def _copies(call: Call) -> list[_Copies] | str:
    """A leaf of B copies of each parameter operand (within the keep limit, as its per-example gradients will be)."""
    made: dict[int, _Copies] = {}
    for t in tensors(call.args, call.kwargs):
        tracked = call.tracked(t)
        if tracked is None or id(t) in made:
            continue
        slice_ = view_per_example(tracked, tuple(t.shape), call.batch) if call.batch > 1 and t.dim() else None
        expanded = slice_ is not None and t.shape[0] == call.batch
        one = t.detach()[0] if expanded else t.detach()
        beyond = beyond_keep_limit(call.batch, tuple(one.shape), t.device)
        if beyond is not None:
            return beyond
        copies = one.unsqueeze(0).expand(call.batch, *one.shape).clone().requires_grad_(True)
        made[id(t)] = _Copies(t, slice_ if slice_ is not None and expanded else tracked, copies, expanded)
    return list(made.values())


def _example_operands(
    call: Call, places: dict[int, Place | None], copies: list[_Copies]
) -> tuple[list[torch.Tensor], Callable[[tuple[torch.Tensor, ...]], tuple[tuple[Any, ...], dict[str, Any]]]]:
    """The operands from the batch (each a view of it, its examples along the first dimension: ``by_example``), and
    the call's (args, kwargs) for one example's slices of them followed by its copies of the parameter operands."""
    batched = [t for t in tensors(call.args, call.kwargs) if places.get(id(t)) is not None]

    def arguments(slices: tuple[torch.Tensor, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        swap = {id(t): (t, s) for t, s in zip(batched, slices, strict=False)}
        swap |= {id(c.operand): (c.operand, c.as_read(w)) for c, w in zip(copies, slices[len(batched) :], strict=True)}
        return substituted(call.args, call.kwargs, swap)

    return [places[id(t)].by_example(t.detach()) for t in batched], arguments  # type: ignore[union-attr]


def _first_difference(
    out: list[torch.Tensor], found: list[torch.Tensor], places: dict[int, Place | None]
) -> str | None:
    """How the example calls' outputs ``found`` differ from the call's ``out``, checking (1); None where they agree."""
    for z, stacked in zip(out, found, strict=True):
        place = places[id(z)]
        assert place is not None
        if not _same_values(stacked, z.detach(), place):
            return _why_other_values(stacked, z, place)
    return None


def _called_per_example(
    call: Call, out: list[torch.Tensor], places: dict[int, Place | None], copies: list[_Copies]
) -> list[torch.Tensor] | str:
    """The call on each example's slices and its own copy of each parameter operand, with autograd on (the graphs
    (2) is read from): for each output that carries a gradient, the example calls' outputs stacked, (B, *example i's
    slice); or how they differ from the call's, checking (1). The calls run as one ``torch.func.vmap`` where the
    function allows it (no random draw, no data-dependent branch, a custom Function with a vmap rule), else one
    call per example. The random state is left as the call left it: running it again draws nothing the model's
    later operations would miss."""
    wanted = [k for k, z in enumerate(outputs(call.output)) if z.requires_grad]  # (the places of ``out``)
    split, arguments = _example_operands(call, places, copies)

    def on_example(*slices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = arguments(slices)
        results = outputs(call.func(*args, **kwargs))
        return tuple(results[k] for k in wanted) if len(results) == len(outputs(call.output)) else ()

    operands = [*split, *(c.copies for c in copies)]
    try:
        with torch.enable_grad(), replayed(random_state(out)), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the call's own warnings came with the batch's call; vmap's are ours)
            try:
                found = list(torch.func.vmap(on_example)(*operands))
            except Exception:  # noqa: BLE001 (whatever vmap cannot batch: one call per example instead)
                rows = [on_example(*(t[i] for t in operands)) for i in range(call.batch)]
                found = [torch.stack(r) for r in zip(*rows, strict=True)] if all(rows) else []
    except Exception as error:  # noqa: BLE001 (a model's own code may assert a shape: the call is refused, not the run)
        return f"fails ({type(error).__name__}: {' '.join(str(error).split())})"
    if len(found) != len(out):
        return "gives other outputs"
    differs = _first_difference(out, found, places)
    return found if differs is None else differs


def _function_calls(
    call: Call,
    function: type[torch.autograd.Function],
    out: list[torch.Tensor],
    places: dict[int, Place | None],
    copies: list[_Copies],
) -> list[Pending] | str | None:
    """A custom Function's calls example by example as one vmap of its own forward and backward
    (:mod:`.function_calls`): run once when recorded, with zero gradients (checking (1), and that its backward runs
    and gives each parameter operand a gradient autograd would take), and again once δ is known, on each example's
    slice of δ: one pending use per output that carries a gradient, or why (1) fails; None where vmap cannot run the
    Function's code, or an operand is passed by keyword (the caller then runs ``F.apply`` example by example)."""
    found_at = [next((k for k, a in enumerate(call.args) if a is c.operand), None) for c in copies]
    positions = [k for k in found_at if k is not None]
    if call.kwargs or len(positions) < len(copies):
        return None
    wanted = [k for k, z in enumerate(outputs(call.output)) if z.requires_grad]
    split, arguments = _example_operands(call, places, copies)
    operands = [t.clone() for t in split]  # (copies: what the Function's forward may write is its own)
    operands += [c.copies.detach() for c in copies]
    needs = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in call.args)

    def example(k: int | None, *pieces: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Example's outputs and the gradients of its parameter operands from its slice of output k's δ (the last of
        ``pieces``; zeros for every output where k is None)."""
        slices = pieces if k is None else pieces[:-1]
        args = arguments(slices)[0]
        output, ctx = forward_with_context(function, args, needs)
        found = backward_from(function, ctx, output, {} if k is None else {k: pieces[-1]})
        grads = tuple(_as_operand(found[j], args[j]) for j in positions)
        return tuple(outputs(output)[w] for w in wanted), grads

    try:
        with torch.no_grad(), replayed(random_state(out)), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stacked, _ = torch.func.vmap(lambda *pieces: example(None, *pieces))(*operands)
    except Exception:  # noqa: BLE001 (whatever vmap cannot batch: F.apply example by example instead)
        return None
    differs = _first_difference(out, list(stacked), places)
    if differs is not None:
        return f"run example by example it {differs}"

    def finish(k: int) -> Callable[[torch.Tensor], list[Use]]:
        place = places[id(outputs(call.output)[k])]
        assert place is not None

        def gradients(d: torch.Tensor) -> list[Use]:
            cotangent = place.by_example(d).to(stacked[wanted.index(k)].dtype)
            with torch.no_grad():
                found = torch.func.vmap(lambda *pieces: example(k, *pieces)[1])(*operands, cotangent)
            return [(c.tracked, Dense(g.reshape(c.copies.shape))) for c, g in zip(copies, found, strict=True)]

        return gradients

    params = [c.tracked.param for c in copies]
    return [Pending(z, params, finish(k)) for k, z in zip(wanted, out, strict=True)]


def _as_operand(gradient: torch.Tensor | None, operand: torch.Tensor) -> torch.Tensor:
    """A Function's gradient for an operand as autograd takes it: zeros for None, summed to the operand's shape where
    that shape expands to the gradient's (an error otherwise, as autograd's)."""
    if gradient is None:
        return torch.zeros_like(operand)
    return gradient if gradient.shape == operand.shape else gradient.sum_to_size(operand.shape)


def _same_values(stacked: torch.Tensor, z: torch.Tensor, place: Place) -> bool:
    """Whether the example calls' outputs are z's slices up to rounding: |Δ| ≤ √ε · max |z| (ε of z's dtype)."""
    if stacked.shape != place.by_example(z).shape:
        return False
    scale = float(z.abs().nan_to_num(0.0, 0.0, 0.0).max()) if z.numel() else 0.0
    tolerance = torch.finfo(z.dtype).eps ** 0.5 * max(scale, torch.finfo(z.dtype).tiny)
    return torch.allclose(stacked.detach().to(z.dtype), place.by_example(z), rtol=0.0, atol=tolerance, equal_nan=True)


def _why_other_values(stacked: torch.Tensor, z: torch.Tensor, place: Place) -> str:
    if stacked.shape != place.by_example(z).shape:
        return f"gives slices of another shape ({tuple(stacked.shape[1:])}, not {tuple(place.by_example(z).shape[1:])})"
    return "gives other values than the batch's call (it draws random numbers, or reads other examples' values)"
