"""The exact path of the clipping engine: each example's gradient by autograd itself, for the parameters no
layer shortcut or operation rule covers, and the parameters a pass's loss never reaches (whose per-example
gradients are zero without any backward pass)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from dpml.train.keep_budget import BEYOND_KEEP_LIMIT


def exact_per_example_gradients(losses: torch.Tensor, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """∇_p ℓ_i for every example i and named parameter p, each (B, *p.shape), from one forward pass.

    The B rows of the identity are backpropagated at once (a vmap over the backward pass); where an
    operator has no batching rule torch loops internally, and where the batched pass fails altogether
    the examples are taken one by one. Either way each row is exactly autograd's ∂ℓ_i/∂p. The graph is
    kept (the fast layers' backward pass follows)."""
    if not params:
        return {}
    batch, tensors = losses.shape[0], list(params.values())
    if batch == 0:
        return {name: p.new_zeros((0, *p.shape)) for name, p in params.items()}
    grads = batched_vjp(losses, tensors, torch.eye(batch, dtype=losses.dtype, device=losses.device))
    return dict(zip(params, grads, strict=True))


def batched_vjp(output: torch.Tensor, inputs: list[torch.Tensor], cotangents: torch.Tensor) -> list[torch.Tensor]:
    """(∂output/∂x)ᵀ c_b for each row c_b of ``cotangents`` (B, *output.shape) and each input x: (B, *x.shape),
    zeros where the output does not reach x. One backward pass over the B rows at once (a vmap over it); where
    it fails altogether (an operator with no batching rule), one pass per row. The graph is kept."""
    return batched_vjps([output], inputs, [cotangents])


def batched_vjps(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], cotangents: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Σ_o (∂o/∂x)ᵀ c_{o,b} for each row b of the ``cotangents`` (each (B, *o.shape), one for each of the
    ``outputs``) and each input x: (B, *x.shape), as :func:`batched_vjp`, all outputs in one backward pass."""
    batch = cotangents[0].shape[0]
    try:
        found = torch.autograd.grad(
            outputs, inputs, grad_outputs=cotangents, is_grads_batched=True, retain_graph=True, allow_unused=True
        )
    except RuntimeError:
        rows = [
            torch.autograd.grad(
                outputs, inputs, grad_outputs=[c[i] for c in cotangents], retain_graph=True, allow_unused=True
            )
            for i in range(batch)
        ]
        found = tuple(
            torch.stack([torch.zeros_like(x) if row[k] is None else row[k] for row in rows])
            for k, x in enumerate(inputs)
        )
    return [x.new_zeros((batch, *x.shape)) if g is None else g for x, g in zip(inputs, found, strict=True)]


def unreached_parameters(losses: torch.Tensor, params: dict[str, nn.Parameter]) -> list[str]:
    """The named parameters the losses' autograd graph does not reach (a mask token used only when a mask is
    passed, a head this forward pass skips): their per-example gradients are exactly zero."""
    if not params or losses.grad_fn is None:
        return list(params)
    reached: set[int] = set()
    stack: list[Any] = [losses.grad_fn]  # autograd nodes, and None where an input needs no gradient
    visited: set[Any] = set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf tensor of the graph
        if variable is not None:
            reached.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return [n for n, p in params.items() if id(p) not in reached]


LOG = logging.getLogger("dpml.clipping")
_SAID: weakref.WeakKeyDictionary[nn.Module, set[frozenset[str]]] = weakref.WeakKeyDictionary()


def say_unplanned_exact(model: nn.Module, reasons: Mapping[str, str], planned: Collection[str], batch: int) -> None:
    """Log, once per model for each set of names, the parameters a pass took exactly (``reasons``: each one's why)
    because their per-example gradients pass the keep limit at this batch, where the plan (``planned``, made at the
    probe's smaller batch) did not send them: a weight standardised before its convolution, as BiT's, at batch 64.
    Slower, never less exact; the plan's log line named none of them."""
    unplanned = frozenset(n for n, why in reasons.items() if BEYOND_KEEP_LIMIT in why) - frozenset(planned)
    if not unplanned or unplanned in _SAID.get(model, ()):
        return
    said = _SAID.setdefault(model, set())
    said.add(unplanned)
    LOG.warning(
        "per-example clipping: %d parameter(s) took exact per-example autograd at a physical batch of %d, which the "
        "plan did not send there (a smaller physical_batch_size keeps them off it): %s",
        len(unplanned),
        batch,
        "; ".join(f"{name}: {reasons[name]}" for name in sorted(unplanned)),
    )


class PlannedExact(frozenset[str]):
    """The clipping plan's ``exact`` parameter names, as every trainer passes them on to :func:`engine_pass`, carrying
    what else the plan's probe confirmed: ``constant_reads`` ((name, dimension), …), the parameters whose einsum
    rule read a constant operand's dimension as the batch's (XLNet's position table expanded over the batch:
    :func:`dpml.train.rules.einsum._constant_batch_axis`). A pass reads no other constant so: a table whose size
    happens to equal a training batch's is never taken for the batch."""

    constant_reads: tuple[tuple[str, int], ...]

    def __new__(cls, names: Iterable[str] = (), constant_reads: Iterable[tuple[str, int]] = ()) -> PlannedExact:
        plan = super().__new__(cls, names)
        plan.constant_reads = tuple(sorted(constant_reads))
        return plan
