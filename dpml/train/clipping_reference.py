"""The float64 reference the pre-flight probe judges the clipping engine by (:mod:`dpml.train.clipping_check`,
step 1): each example's gradient by plain autograd, one backward pass per example, the definition for any module."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from dpml.train.clipping import LossFn, clip_factors, per_example_losses

Fresh = Callable[[], AbstractContextManager[None]]
"""Enters the state every pass of the probe starts from (its buffers and random state)."""


@dataclass
class Reference:
    """What the probe's checks compare the engine with, for each trainable parameter p: the per-example squared
    norms ‖∂ℓ_i/∂p‖² (B,), and the weighted sums Σ_i c_i ∂ℓ_i/∂p for the random weights c of the check of each fast
    unit and for the clip factors c_i = min(1, C/‖g_i‖) at C = the median norm of the check of the whole engine
    (:mod:`dpml.train.clipping_check`'s steps 3 and 4)."""

    losses: torch.Tensor
    squares: dict[str, torch.Tensor]  # name -> (B,)
    weighted: dict[str, torch.Tensor]  # name -> Σ_i c_i g_i, c the random weights
    clipped: dict[str, torch.Tensor]  # name -> Σ_i min(1, C/‖g_i‖) g_i
    clip: float  # C
    not_finite: tuple[str, ...]  # the parameters with a per-example gradient that is nan or infinite

    def squared(self, names: list[str]) -> torch.Tensor:
        return _added((self.squares[n] for n in names), self.losses)

    def norms(self) -> torch.Tensor:
        """‖g_i‖ over every trainable parameter, (B,)."""
        return _added(self.squares.values(), self.losses).sqrt()


def _added(squares: Iterable[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Σ of per-example squared norms (B,), from zeros like the losses ``like``."""
    return sum(squares, torch.zeros_like(like))


def _finite(square: torch.Tensor, gradient: torch.Tensor) -> bool:
    """Whether every entry of ``gradient`` is finite, from its sum of squares ``square`` (a nan or infinite entry
    makes it nan or infinite) and, only where that overflowed, from the entries themselves."""
    return bool(torch.isfinite(square)) or bool(torch.isfinite(gradient).all())


def per_example_reference(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, fresh: Fresh
) -> Reference:
    """The reference in 2B backward passes through one forward pass's graph, holding one example's gradient at a
    time (memory of four copies of the parameters, not B + 1: a BERT-base's six float64 gradients are 5 GB):
    ``g_i = ∂ℓ_i/∂θ`` for each i, one backward pass each (the definition), kept as its squared norms and added into
    Σ_i c_i g_i with ``c`` = ``weights``; then each g_i again, added into Σ_i min(1, C/‖g_i‖) g_i once C is known.
    (∂(Σ_i c_i ℓ_i)/∂θ in one pass is the same sum in exact arithmetic, but its rounding differs from that of the
    per-example gradients the engine's exact path forms: on a parameter whose gradient is 0 up to rounding, such as
    an attention key's bias, the two would differ by all of it.)"""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with fresh():
        losses = per_example_losses(model, loss_fn, x, y)
    count = losses.shape[0]

    def example_gradients() -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Example i's gradient of each parameter its loss reaches; one it does not reach (an entity table a text
        does not look up, a pooler the head skips) is 0, and left out rather than made and added as zeros."""
        for i in range(count):
            row = torch.autograd.grad(losses[i], list(params.values()), retain_graph=True, allow_unused=True)
            yield i, {n: g.detach() for n, g in zip(params, row, strict=True) if g is not None}

    squares = {n: torch.zeros(count, dtype=losses.dtype, device=losses.device) for n in params}
    weighted = {n: torch.zeros_like(p) for n, p in params.items()}
    not_finite: set[str] = set()
    weights = weights.to(losses.device)
    for i, gradients in example_gradients():
        for n, g in gradients.items():
            square = g.pow(2).sum()
            squares[n][i] = square
            weighted[n].add_(g, alpha=float(weights[i]))
            if not _finite(square, g):
                not_finite.add(n)
    norms = _added(squares.values(), losses).sqrt()
    clip = float(norms.median()) or 1.0
    factors = clip_factors(norms, clip).detach()
    clipped = {n: torch.zeros_like(p) for n, p in params.items()}
    for i, gradients in example_gradients():
        for n, g in gradients.items():
            clipped[n].add_(g, alpha=float(factors[i]))
    bad = tuple(n for n in params if n in not_finite)
    return Reference(losses.detach(), squares, weighted, clipped, clip, bad)
