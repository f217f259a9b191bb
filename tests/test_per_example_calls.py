"""Operations no rule knows, called with a parameter and the batch, run again example by example
(:mod:`dpml.train.rules.per_example_calls`): their parameters' clipped sums and norms equal a float64 per-example loop's
without the exact path, wherever the batch's examples lie in the operands (batch-first, time-major, in windows); an
operation that draws random numbers, or whose operands do not hold the examples along one axis, takes the exact path
and the plan names it; and training with one moves the parameters as the per-example loop says."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from test_op_rules import (
    assert_clipped_like_the_loop,
    assert_exact_without_the_exact_path,
    generator,
    loop_reference,
)
from torch import nn

from dpml.train.clipping import clipped_gradient_sum, engine_pass
from dpml.train.clipping_check import plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy


class Prototypes(nn.Module):
    """Distances to learned prototypes (``torch.cdist``), a radial-basis layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 5)
        self.centres = nn.Parameter(torch.randn(3, 5))
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.exp(-torch.cdist(torch.tanh(self.embed(x)), self.centres)))


class AngleToComputedOffset(nn.Module):
    """``torch.atan2`` of the batch and a computation on a parameter (a cumulative sum plus a constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.offset = nn.Parameter(torch.randn(4))
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.atan2(torch.tanh(self.embed(x)), torch.cumsum(self.offset, 0) + 2))


class LearnedSamplingGrid(nn.Module):
    """A learned sampling grid expanded over the batch (``F.grid_sample``, a spatial transformer's fixed warp)."""

    def __init__(self) -> None:
        super().__init__()
        self.grid = nn.Parameter(torch.rand(1, 3, 3, 2) * 2 - 1)
        self.out = nn.Linear(18, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images = x.view(-1, 2, 4, 4)
        sampled = F.grid_sample(images, self.grid.expand(images.shape[0], 3, 3, 2), align_corners=False)
        return self.out(sampled.flatten(1))


class TimeMajor(nn.Module):
    """``torch.hypot`` of time-major activations (T, B, d) and a parameter per feature, then a mean over time."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 3)
        self.floor = nn.Parameter(torch.rand(3) + 0.1)
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T·4)
        steps = self.embed(x.view(x.shape[0], -1, 4)).transpose(0, 1)  # (T, B, 3)
        return self.out(torch.hypot(steps, self.floor).mean(0))


class Windows(nn.Module):
    """Each example's rows as windows of their own ((B·2, 2, d), as Swin lays them out), through ``torch.lerp``
    towards a learned target by a learned weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 3)
        self.target = nn.Parameter(torch.randn(3))
        self.weight = nn.Parameter(torch.rand(3))
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 4·4)
        rows = torch.tanh(self.embed(x.view(x.shape[0], 4, 4)))  # (B, 4, 3)
        windows = rows.reshape(-1, 2, 3)  # (B·2, 2, 3), example i's windows 2i and 2i + 1
        moved = torch.lerp(windows, self.target, self.weight)
        return self.out(moved.reshape(x.shape[0], 4, 3).mean(1))


class TimeBatchChannel(nn.Module):
    """fairseq's time-major convolution, ``torch.conv_tbc`` on (T, B, C) with its kernel and bias."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.kernel = nn.Parameter(torch.randn(3, 4, 4) * 0.3)
        self.bias = nn.Parameter(torch.randn(4) * 0.1)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T·4)
        steps = torch.tanh(self.embed(x.view(x.shape[0], -1, 4))).transpose(0, 1).contiguous()  # (T, B, 4)
        return self.out(torch.conv_tbc(steps, self.kernel, self.bias, 1).mean(0))


class Through(nn.Module):
    """The batch's activations (B, 4) and a parameter (4,) through ``op``, with outputs (B, 4)."""

    def __init__(self, op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4) * 0.5 + 0.2)
        self.out = nn.Linear(4, 2)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.op(torch.tanh(self.embed(x)), self.w)))


def _solved(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each example's 2 × 2 system solved against a learned matrix (batched linear algebra)."""
    matrix = w.view(2, 2) + 3 * torch.eye(2, dtype=h.dtype)
    return torch.linalg.solve(matrix, h.view(-1, 2, 2)).reshape(-1, 4)


CASES: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "cdist": (Prototypes, 4),
    "atan2 of a computation": (AngleToComputedOffset, 4),
    "grid_sample expanded": (LearnedSamplingGrid, 32),
    "hypot time-major": (TimeMajor, 12),
    "lerp in windows": (Windows, 16),
    "conv_tbc time-major": (TimeBatchChannel, 20),
    "pow, a learned exponent": (lambda: Through(lambda h, w: torch.pow(h.abs() + 1, w)), 4),
    "clamp, a learned bound": (lambda: Through(lambda h, w: torch.clamp(h, -w.abs(), w.abs())), 4),
    "cosine_similarity": (lambda: Through(lambda h, w: F.cosine_similarity(h, w.expand_as(h)).unsqueeze(1) * h), 4),
    "addcdiv": (lambda: Through(lambda h, w: torch.addcdiv(h, h, w.abs() + 1)), 4),
    "tensordot": (lambda: Through(lambda h, w: torch.tensordot(h, w.diag(), dims=1)), 4),
    "linalg.solve": (lambda: Through(_solved), 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_operation_without_a_rule_is_run_example_by_example_exactly(case: str) -> None:
    module, width = CASES[case]
    torch.manual_seed(1)
    x = torch.randn(6, width, dtype=torch.float64, generator=generator(2))
    y = torch.randint(0, 2, (6,), generator=generator(3))
    assert_exact_without_the_exact_path(module(), per_example_cross_entropy, x, y)


class NoisyScale(torch.autograd.Function):
    """A learned scale under multiplicative noise drawn inside the Function (its backward by hand)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def,override]
        noise = 1 + 0.5 * torch.rand_like(x)
        ctx.save_for_backward(x, scale, noise)
        return x * scale * noise

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def,override]
        x, scale, noise = ctx.saved_tensors
        return g * scale * noise, (g * x * noise).sum(0)


class ScaledBy(nn.Module):
    """The batch's activations and a learned scale through a custom Function (``function.apply(h, scale)``)."""

    def __init__(self, function: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.rand(4) + 0.5)
        self.out = nn.Linear(4, 2)
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.function.apply(torch.tanh(self.embed(x)), self.scale))


def test_an_operation_that_draws_random_numbers_takes_the_exact_path_named_and_clips_exactly() -> None:
    """Run again example by example it draws other noise, so its rows differ from the batch's call: (1) of the
    rule fails, and the scale takes the exact path (every other parameter its rule), the plan saying why."""
    torch.manual_seed(4)
    model = ScaledBy(NoisyScale).double()
    plan = plan_clipping(model, per_example_cross_entropy, (4,))
    assert plan.exact_parameters == ("scale",), plan.lines()
    (line,) = [line for line in plan.lines() if line.startswith("scale: ")]
    assert "NoisyScale.apply: no rule" in line and "draws random numbers" in line, line
    x, y = torch.randn(7, 4, dtype=torch.float64, generator=generator(5)), torch.randint(0, 2, (7,))
    reference, norms = loop_reference(model, per_example_cross_entropy, x, y, 0.3, seed=6)
    torch.manual_seed(6)
    sums, found_norms = clipped_gradient_sum(model, per_example_cross_entropy, x, y, 0.3, exact=plan.exact)
    torch.testing.assert_close(found_norms, norms, rtol=1e-10, atol=0)
    for name, expected in reference.items():
        torch.testing.assert_close(sums[name], expected, rtol=1e-10, atol=1e-12, msg=name)


class Reversed(AngleToComputedOffset):
    """The batch's rows in reverse order meet a parameter in an operation with no rule: no example-by-example layout
    of the operand along one axis (each example's row is still its own)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.atan2(torch.tanh(self.embed(x)).flip(0), self.offset + 2).flip(0))


def test_an_operand_without_the_examples_along_one_axis_takes_the_exact_path_named() -> None:
    torch.manual_seed(7)
    x, y = torch.randn(5, 4, dtype=torch.float64, generator=generator(8)), torch.randint(0, 2, (5,))
    model = Reversed().double()
    found = engine_pass(model, per_example_cross_entropy, x, y, ())
    assert set(found.exact) == {"offset"}
    assert found.reasons["offset"].startswith("torch.atan2: no rule, and an operand from the batch"), found.reasons
    assert_clipped_like_the_loop(model, x, y, exact={"offset"})


class BatchOfRows(torch.autograd.Function):
    """A Function whose code asserts a batch of rows (as a library's own checks do): it fails on one example's row."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def,override]
        assert x.shape[0] > 1, "expects a batch of rows"
        ctx.save_for_backward(x, scale)
        return x * scale

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def,override]
        x, scale = ctx.saved_tensors
        return g * scale, (g * x).sum(0)


def test_a_call_that_fails_on_one_examples_slices_takes_the_exact_path_named_not_a_crash() -> None:
    torch.manual_seed(9)
    model = ScaledBy(BatchOfRows).double()
    x, y = torch.randn(5, 4, dtype=torch.float64, generator=generator(10)), torch.randint(0, 2, (5,))
    found = engine_pass(model, per_example_cross_entropy, x, y, ())
    assert set(found.exact) == {"scale"}
    assert "fails (AssertionError: expects a batch of rows" in found.reasons["scale"], found.reasons
    assert_clipped_like_the_loop(model, x, y, exact={"scale"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine: the GPU check did not run")
@pytest.mark.parametrize("case", ["cdist", "conv_tbc time-major", "pow, a learned exponent", "lerp in windows"])
def test_on_the_gpu_an_operation_without_a_rule_is_run_example_by_example_exactly(case: str) -> None:
    """The same on a GPU (``scripts/gpu_session.sh`` runs this file): the example calls, their check against the
    batch's call and the copies' gradients on the batch's device."""
    module, width = CASES[case]
    torch.manual_seed(1)
    model = module().double().cuda()
    x = torch.randn(6, width, dtype=torch.float64, generator=generator(2)).cuda()
    y = torch.randint(0, 2, (6,), generator=generator(3)).cuda()
    found = engine_pass(model, per_example_cross_entropy, x, y, ())
    assert found.exact == {}, found.reasons
    assert_clipped_like_the_loop(model, x, y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine: the GPU check did not run")
def test_on_the_gpu_an_operation_that_draws_random_numbers_takes_the_exact_path() -> None:
    torch.manual_seed(4)
    model = ScaledBy(NoisyScale).double().cuda()
    x, y = torch.randn(7, 4, dtype=torch.float64).cuda(), torch.randint(0, 2, (7,)).cuda()
    found = engine_pass(model, per_example_cross_entropy, x, y, ())
    assert set(found.exact) == {"scale"} and "draws random numbers" in found.reasons["scale"], found.reasons
