"""Where training runs: choosing the device, and moving host tensors to it without waiting."""

from __future__ import annotations

import torch


def pick_device(preference: str = "auto") -> torch.device:
    """``cuda`` when asked for or available (``auto``), else CPU."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device = 'cuda' but no CUDA device is available")
    if preference == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` without making the host wait for the GPU.

    A copy from ordinary (pageable) host memory to CUDA blocks the host until the GPU has drained its
    queue, which would synchronise every training step; from pinned memory with ``non_blocking`` the copy
    is queued on the stream like any kernel (torch keeps the pinned block alive until the copy has run)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)
