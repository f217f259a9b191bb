"""Membership-inference attacks. Each maps (model, records, labels) to scores: higher = member.

Registered in :data:`ATTACKS`; the audit stage runs every attack named in ``audit.attacks``
against train members and audit-population non-members.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from torch import nn

from dpml.audit.signals import cross_entropy_losses, logits_of

Attack = Callable[[nn.Module, np.ndarray, np.ndarray], np.ndarray]


def loss_attack(model: nn.Module, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """LOSS (Yeom et al. 2018): score = −ℓ(θ; x, y); members tend to have lower loss."""
    return -cross_entropy_losses(logits_of(model, x), y)


ATTACKS: dict[str, Attack] = {"loss": loss_attack}
