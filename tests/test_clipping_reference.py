"""The probe's reference (:func:`dpml.train.clipping_reference.per_example_reference`) against each example's
gradient from a forward pass of that example alone: a parameter the loss never reaches (a lookup table the inputs
do not touch) adds nothing and is not made as zeros example by example; an entry that is nan marks its parameter
not finite, and one whose square overflows (finite, 1e20 in float32) does not."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from dpml.train.clipping import clip_factors
from dpml.train.clipping_reference import per_example_reference
from dpml.train.dpsgd import per_example_cross_entropy


class WithAnUnusedTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.table = nn.Embedding(1000, 8)  # never looked up: its gradient is None for every example

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@contextlib.contextmanager
def _same() -> Iterator[None]:
    yield


def _loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Each example's gradient from its own forward pass (1 row), every parameter (zeros where unused)."""
    out = []
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        per_example_cross_entropy(model(x[i : i + 1]), y[i : i + 1]).sum().backward()
        out.append({n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
    return out


def test_the_reference_equals_a_loop_of_single_example_passes_and_an_unused_table_adds_nothing() -> None:
    torch.manual_seed(0)
    model = WithAnUnusedTable().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    weights = torch.linspace(0.2, 1.0, 6, dtype=torch.float64)
    reference = per_example_reference(model, per_example_cross_entropy, x, y, weights, _same)
    loop = _loop(model, x, y)
    norms = torch.stack([sum((g**2).sum() for g in row.values()) for row in loop]).sqrt()
    assert reference.clip == float(norms.median()) and reference.not_finite == ()
    factors = clip_factors(norms, reference.clip)
    assert 0 < int((factors < 1).sum()) < 6  # some examples clipped, some not
    for name in dict(model.named_parameters()):
        squares = torch.stack([(row[name] ** 2).sum() for row in loop])
        torch.testing.assert_close(reference.squares[name], squares, rtol=1e-12, atol=0, msg=name)
        weighted = sum(w * row[name] for w, row in zip(weights, loop, strict=True))
        torch.testing.assert_close(reference.weighted[name], weighted, rtol=1e-12, atol=1e-15, msg=name)
        clipped = sum(f * row[name] for f, row in zip(factors, loop, strict=True))
        torch.testing.assert_close(reference.clipped[name], clipped, rtol=1e-12, atol=1e-15, msg=name)
    assert not reference.squares["table.weight"].any() and not reference.clipped["table.weight"].any()


class Amplified(torch.autograd.Function):
    """The identity forward; its backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, t: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor  # type: ignore[attr-defined]
        return t.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None  # type: ignore[attr-defined]


class Scaled(nn.Module):
    """Logits times a scale of 1 (finite outputs), whose gradient alone is multiplied by ``factor``."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(()))
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * Amplified.apply(self.scale, self.factor)


def test_a_nan_entry_marks_its_parameter_not_finite_and_a_square_that_overflows_does_not() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    weights = torch.ones(4)
    huge = per_example_reference(Scaled(1e20), per_example_cross_entropy, x, y, weights, _same)
    assert math.isinf(float(huge.squares["scale"].max())) and torch.isfinite(huge.weighted["scale"]).all()
    assert huge.not_finite == ()  # entries of about 1e20: finite, though their squares overflow float32
    broken = per_example_reference(Scaled(float("nan")), per_example_cross_entropy, x, y, weights, _same)
    assert broken.not_finite == ("scale",)
