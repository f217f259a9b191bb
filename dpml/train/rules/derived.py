"""Computations on parameters alone: a weight formed from parameters before it meets the batch (a
parametrization's g·v/‖v‖, ``cat((q_bias, zeros, v_bias))``, ``A @ B``). The recorder tracks such an output as
if it were a parameter (:class:`Derived`); the engine then carries the per-example gradients of its uses back to
the parameters it came from through the operation's own Jacobian (:func:`pull_back`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpml.train.exact_path import batched_vjp
from dpml.train.rules.operands import outputs, substituted
from dpml.train.rules.registry import Tracked


@dataclass(eq=False)
class Derived:
    """The output of a computation on parameters alone (no operand from the batch): a weight formed by its
    parametrization (``weight_norm``'s g·v/‖v‖), a bias concatenated with constants, a position table
    interpolated. The recorder tracks ``output`` as if it were a parameter; the per-example gradients its
    uses give, (B, *output.shape), are pulled back to ``sources`` through the operation's own Jacobian (one
    batched vector-Jacobian product on ``local``, the operation run again on detached copies of the sources,
    ``leaves``: the local derivative, so that a source computed from another source of the same operation is
    not counted twice), and become uses of the parameters — or of the Derived outputs the sources are."""

    output: torch.Tensor
    sources: list[tuple[torch.Tensor, Tracked]]  # the operands that are parameters or their views (or Derived outputs)
    params: list[nn.Parameter]  # the parameters it depends on, through other Derived outputs too
    local: torch.Tensor  # the same output from ``leaves`` (checked equal to ``output`` when recorded)
    leaves: list[torch.Tensor]  # detached copies of the sources' tensors, requiring gradient
    operation: str = ""


def run_on_leaves(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, sources: dict[int, torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """The call run again with each source operand (by id) replaced by a detached copy that requires gradient:
    its outputs, now functions of those copies alone (the operation's *local* Jacobian, so that a source
    computed from another source of the same call is not counted twice), and the copies; None when the
    outputs differ from the recorded ``out`` (the operation draws random numbers)."""
    leaves = {key: t.detach().requires_grad_(True) for key, t in sources.items()}
    args, kwargs = substituted(args, kwargs, {key: (sources[key], leaf) for key, leaf in leaves.items()})
    with torch.enable_grad():
        local = outputs(func(*args, **kwargs))
    recorded = outputs(out)
    if len(local) != len(recorded) or not all(
        torch.equal(a.detach(), b.detach()) for a, b in zip(local, recorded, strict=True)
    ):
        return None
    return local, list(leaves.values())


def pull_back(node: Derived, gradients: torch.Tensor) -> list[torch.Tensor]:
    """Each example's gradient of a :class:`Derived` output, (B, *output.shape), as the gradients of its sources,
    each (B, *source.shape): B vector-Jacobian products of the operation alone at once (a loop where an
    operator has no batching rule), the chain rule's step ∂ℓ_i/∂s = (∂o/∂s)ᵀ ∂ℓ_i/∂o with the sources
    independent (a source that is itself a Derived output passes its share on when its own turn comes)."""
    return batched_vjp(node.local, node.leaves, gradients.to(node.local.dtype))
