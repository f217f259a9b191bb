"""Data-independent feature extractors: a fixed function of each record, hence free of privacy cost.

**ScatterNet** (Oyallon & Mallat 2015; used for DP by Tramèr & Boneh 2021, "Differentially Private
Learning Needs Better Features"): the 2-D scattering transform with J = 2 scales and L = 8
orientations maps an H×W image (values in [0, 1]) to 81 channels of (H/4)×(W/4) — for 28×28,
81·7·7 = 3,969 features — built from fixed Morlet wavelets (kymatio). Each example's
channels are then normalised on their own (GroupNorm without affine parameters, G groups:
every group of channels is centred and scaled by that example's own mean and standard
deviation), the "data normalisation" of Tramèr & Boneh *without* any statistic of the data set.
Nothing here looks at another record, so neighbouring data sets are transformed record by record
by the same function and the DP analysis of the training that follows is unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

SCATTER_CHANNELS = 81  # 1 + J·L + L²·J(J−1)/2 for J = 2, L = 8


def _scattering(shape: tuple[int, int]):  # noqa: ANN202
    # kymatio.torch also imports its 3-D code, which needs scipy.special.sph_harm (gone in SciPy 1.17);
    # the 2-D frontend alone is all we use.
    from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D  # lazy: optional dependency

    return ScatteringTorch2D(J=2, L=8, shape=shape)


def scatter_features(images: np.ndarray, shape: tuple[int, int], groups: int, batch: int = 1000) -> np.ndarray:
    """ScatterNet features of flattened images in [0, 1]: (n, H·W) → (n, 81·(H/4)·(W/4)), float32."""
    height, width = shape
    if images.ndim != 2 or images.shape[1] != height * width:
        raise ValueError(
            f"preprocess.image_shape = {list(shape)}: records have {images.shape[1]} features, "
            f"not {height}·{width} = {height * width}"
        )
    if height % 4 or width % 4:
        raise ValueError(f"preprocess.image_shape = {list(shape)}: ScatterNet (J = 2) needs sides divisible by 4")
    if SCATTER_CHANNELS % groups:
        raise ValueError(f"preprocess.scatter_groups = {groups}: must divide the {SCATTER_CHANNELS} channels")
    transform = _scattering(shape)
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # kymatio's many small FFTs run 5× slower with 2 intra-op threads here
    try:
        with torch.no_grad():
            for start in range(0, images.shape[0], batch):
                chunk = torch.from_numpy(np.ascontiguousarray(images[start : start + batch], dtype=np.float32))
                coefficients = transform(chunk.reshape(-1, height, width))  # (b, 81, H/4, W/4)
                out.append(per_example_group_norm(coefficients.reshape(coefficients.shape[0], -1).numpy(), groups))
    finally:
        torch.set_num_threads(threads)
    if not out:
        return np.zeros((0, SCATTER_CHANNELS * (height // 4) * (width // 4)), dtype=np.float32)
    return np.concatenate(out)


def per_example_group_norm(x: np.ndarray, groups: int, eps: float = 1e-5) -> np.ndarray:
    """Centre and scale each example's groups of features by that example's own statistics."""
    grouped = x.reshape(x.shape[0], groups, -1).astype(np.float64)
    grouped = (grouped - grouped.mean(2, keepdims=True)) / np.sqrt(grouped.var(2, keepdims=True) + eps)
    return grouped.reshape(x.shape[0], -1).astype(np.float32)
