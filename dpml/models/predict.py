"""A model's outputs on records: the one way every stage (the search's validation score, the audit's signals,
the released model's accuracy) evaluates a trained classifier."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


@torch.no_grad()
def logits_of(model: nn.Module, x: np.ndarray, batch_size: int = 4096) -> np.ndarray:
    device = next(model.parameters()).device
    try:
        model.eval()
    except NotImplementedError:  # a torch.export (pt2) module loaded from MLflow is always in eval mode
        pass
    parts = [
        model(torch.as_tensor(x[i : i + batch_size], dtype=torch.float32, device=device)).double().cpu()
        for i in range(0, x.shape[0], batch_size)
    ]
    return torch.cat(parts).numpy() if parts else np.zeros((0, 0))
