"""The auditor's own recomputation of a DP-SGD step (:mod:`dpml.audit.conformance`), independent of the
training engine: the clipped sum of a batch from exact per-example gradients, and the two conditions under
which it matches what the trainer computed — full float32 arithmetic on a GPU (no TF32) and a forward pass
without randomness.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dpml.train.clipping import LossFn


def forward_is_random(model: nn.Module, x: torch.Tensor) -> bool:
    """Whether two training-mode forward passes of the same records differ (dropout, a random layer).

    The auditor recomputes the trainer's clipped sums with forward passes of its own; with a random
    forward pass they differ from the trainer's by more than the noise, so the checks cannot run. The
    global random state is left as it was."""
    with torch.random.fork_rng(devices=[x.device] if x.is_cuda else []), torch.no_grad():
        was_training = model.training
        model.train()
        first, second = model(x), model(x)
        model.train(was_training)
    return not torch.equal(first, second)


def trainable_size(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def reference_clipped_sum(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, clip_norm: float, chunk: int = 256
) -> torch.Tensor:
    """Σ_i g_i·min(1, C/(‖g_i‖ + 1e-6)), g_i = ∇_θ ℓ(θ; x_i, y_i) over the trainable parameters, flat, float64.

    The auditor's own computation, independent of the training engine (:mod:`dpml.train.clipping`):

    1. the norms ‖g_i‖ from exact per-example gradients of every trainable parameter by
       ``torch.func.vmap(grad(·))`` (each example alone through the model), accumulated in float64;
    2. the clipped sum as one ordinary backward pass of the reweighted loss: by linearity of the gradient,
       ∇_θ Σ_i f_i·ℓ(θ; x_i, y_i) = Σ_i f_i·g_i with the factors f_i = min(1, C/(‖g_i‖ + 1e-6)) held constant.

    Step 2 is exact for any model whose examples do not interact in a batch (the pre-flight probe of
    :mod:`dpml.train.clipping_check` refuses the others) and spares the (B, D) matrix of step 1 a second
    pass: the per-example gradients are only reduced to norms, chunk by chunk."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    detached = {n: p.detach() for n, p in trainable.items()}
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    size = sum(p.numel() for p in trainable.values())
    if x.shape[0] == 0:
        return torch.zeros(size, device=x.device, dtype=torch.float64)

    def one_loss(theta: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, ({**frozen, **theta, **buffers}), (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0)).sum()

    chunk = max(1, min(chunk, 2**25 // max(size, 1)))  # bounded memory for the (chunk, D) gradients
    squared = []
    for start in range(0, x.shape[0], chunk):
        per_example = vmap(grad(one_loss), in_dims=(None, 0, 0))(
            detached, x[start : start + chunk], y[start : start + chunk]
        )
        squared.append(
            sum(torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1).double() ** 2 for g in per_example.values())
        )
    factors = torch.clamp(clip_norm / (torch.cat(squared).sqrt() + 1e-6), max=1.0)
    weighted = (loss_fn(model(x), y).double() * factors).sum()
    sums = torch.autograd.grad(weighted, list(trainable.values()), allow_unused=True)
    return torch.cat(
        [
            (g if g is not None else torch.zeros_like(p)).reshape(-1).double()
            for g, p in zip(sums, trainable.values(), strict=True)
        ]
    )
