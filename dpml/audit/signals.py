"""Per-example signals of a classifier that membership-inference attacks score."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def logits_of(model: nn.Module, x: np.ndarray, batch_size: int = 4096) -> np.ndarray:
    device = next(model.parameters()).device
    model.eval()
    parts = [model(torch.as_tensor(x[i:i + batch_size], dtype=torch.float32, device=device)).double().cpu()
             for i in range(0, x.shape[0], batch_size)]
    return torch.cat(parts).numpy() if parts else np.zeros((0, 0))


def cross_entropy_losses(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """ℓ_i = −log softmax(logits_i)[y_i], computed with log-sum-exp (no overflow)."""
    t = torch.as_tensor(logits, dtype=torch.float64)
    return F.cross_entropy(t, torch.as_tensor(y, dtype=torch.long), reduction="none").numpy()
