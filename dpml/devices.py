"""Where training runs: choosing the device, and moving host tensors to it without waiting."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """TF32 off for matrix products and cuDNN convolutions inside the block (restored after).

    On a GPU, TF32 (10-bit mantissas; torch's default for cuDNN convolutions, and for matrix products
    under ``torch.set_float32_matmul_precision("high")``) would let two computations of the same
    gradient differ by ~1e-3 relative: an example's norm and its clipped contribution to the sum would
    no longer come from the same numbers, and ‖c_i g_i‖ could exceed C by that much. The clipping
    engine forms norms and sums inside this block; the audit's recomputation does too."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn
