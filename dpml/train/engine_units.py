"""What one engine pass gives (:func:`dpml.train.clipping.engine_pass`): the fast units (hooked layers, parameters the
operation rules cover) with their pieces, and the exact per-example gradients; their norms and clipped sums."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Union

import torch
from torch import nn

from dpml.devices import full_float32
from dpml.train.clipping_layers import Piece, added_up, layer_parameters
from dpml.train.clipping_norms import row_norms_squared


@dataclass(frozen=True, eq=False)
class RuleUnit:
    """A parameter covered by operation rules (:mod:`dpml.train.rules`): its name and the operations it went through."""

    name: str
    param: nn.Parameter
    operations: tuple[str, ...]


Unit = Union[nn.Module, RuleUnit]


def unit_parameters(unit: Unit) -> list[nn.Parameter]:
    """The parameters a fast unit accounts for: a hooked layer's weight and bias, or a ruled parameter."""
    return [unit.param] if isinstance(unit, RuleUnit) else layer_parameters(unit)


@dataclass
class EnginePass:
    """One batch through the engine: the fast units' pieces (hooked layers and ruled parameters) and the
    exact per-example gradients, with the reason each exact parameter took that path."""

    batch: int
    fast: list[tuple[Unit, Piece]]
    exact: dict[str, torch.Tensor]  # name -> (B, *p.shape)
    names: dict[int, str]
    zeros: torch.Tensor  # (B,) on the batch's device, in the parameters' dtype
    reasons: dict[str, str] = field(default_factory=dict)  # exact parameter -> why
    constants_read: dict[str, int] = field(default_factory=dict)  # ruled parameter -> the constant's batch dimension

    def squared(self) -> torch.Tensor:
        """‖∇ℓ_i‖² (B,): the fast units' squared norms plus the exact gradients'."""
        terms = [piece.squared for _, piece in self.fast]
        return added_up(terms + [row_norms_squared(g) for g in self.exact.values() if g.numel()], self.zeros)

    def sums(self, factors: torch.Tensor, spent: bool = False) -> dict[str, torch.Tensor]:
        """{name: Σ_i c_i ∇ℓ_i} for every trainable parameter. ``spent``: the pass is not read again, and each unit's
        piece (each exact gradient) is dropped once its sums are formed: what it held (a layer's input and δ, kept
        per-example gradients) goes before the next unit's sums are formed, not with the pass."""
        out: dict[str, torch.Tensor] = {}
        with full_float32():  # the same arithmetic as the norms (engine_pass): no TF32 on a GPU
            for piece in self._pieces(spent):
                for p, total in piece.sums(factors):
                    out[self.names[id(p)]] = total
            for name in list(self.exact):
                g = self.exact.pop(name) if spent else self.exact[name]
                out[name] = torch.einsum("b,b...->...", factors.to(g.dtype), g)
        return out

    def _pieces(self, spent: bool) -> Iterator[Piece]:
        if not spent:
            yield from (piece for _, piece in self.fast)
            return
        self.fast.reverse()
        while self.fast:
            yield self.fast.pop()[1]
