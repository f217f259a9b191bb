"""The audit's gradient canaries as extra examples of the clipped sum: Dirac gradients, clipped by the records' own
factor line (:func:`dpml.train.clipping.clipped_gradient_sum`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class DiracGradients:
    """Extra examples whose whole gradient is a Dirac: example j has gradient ``norm``·e_{k_j}, where k_j
    (``coordinates[j]``) is a flat index over the model's trainable parameters in ``named_parameters``
    order. The audit's gradient canaries enter the engine this way: *before* clipping, with a norm well
    above C, so that they are clipped by the same factor line as the records (and a trainer that does
    not clip shows it: their contribution is then ``norm``, not C)."""

    coordinates: torch.Tensor  # (b,) int64
    norm: float

    def squared_norms(self, like: torch.Tensor) -> torch.Tensor:
        """‖g_j‖² = ``norm``² of each canary, (b,), in ``like``'s dtype and device."""
        return torch.full((self.coordinates.numel(),), float(self.norm) ** 2, device=like.device, dtype=like.dtype)

    def add_clipped(self, sums: dict[str, torch.Tensor], model: nn.Module, factors: torch.Tensor) -> None:
        """Σ_j c_j ``norm`` e_{k_j} added into ``sums`` (by parameter name, in place), c_j = ``factors[j]``."""
        if not self.coordinates.numel():
            return
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        coordinates = self.coordinates.to(factors.device)
        slots = _flat_slots([n for n, _ in trainable], [p.shape for _, p in trainable], coordinates)
        for name, positions, flat in slots:
            contribution = factors[positions] * float(self.norm)
            sums[name] = (
                sums[name].reshape(-1).index_add(0, flat, contribution.to(sums[name].dtype)).reshape(sums[name].shape)
            )


def _flat_slots(
    names: list[str], shapes: list[torch.Size], coordinates: torch.Tensor
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(parameter name, positions in ``coordinates``, flat index inside that parameter) for each parameter hit."""
    out, offset = [], 0
    for name, shape in zip(names, shapes, strict=True):
        size = int(torch.Size(shape).numel())
        inside = (coordinates >= offset) & (coordinates < offset + size)
        if bool(inside.any()):
            positions = torch.nonzero(inside).flatten()
            out.append((name, positions, coordinates[positions] - offset))
        offset += size
    if bool(((coordinates < 0) | (coordinates >= offset)).any()):
        raise ValueError(f"Dirac gradient coordinates must lie in [0, {offset}) (the trainable parameters)")
    return out
