"""Custom autograd Functions (``F.apply``) on parameters: seen by the recording pass
(:mod:`dpml.train.rules.custom_functions`), their own backward used for the pull-back, run example by example where
they meet the batch (:mod:`dpml.train.rules.per_example_calls`), and ``Function.apply`` left as torch's outside a
recording."""

from __future__ import annotations

import threading

import pytest
import torch
from test_model_zoo import Logits
from test_per_example_calls import ScaledBy
from test_op_rules import (
    assert_exact_without_the_exact_path,
    generator,
)
from torch import nn
from torch.autograd.function import once_differentiable

from dpml.train.clipping import engine_pass
from dpml.train.dpsgd import per_example_cross_entropy
from dpml.train.rules import custom_functions

ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]


class MaskedDropout(torch.autograd.Function):
    """transformers' ``XDropout``: a mask drawn inside ``forward`` (a random state to replay), kept for ``backward``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:  # type: ignore[no-untyped-def,override]
        mask = torch.rand(x.shape, dtype=x.dtype) < p
        ctx.save_for_backward(mask)
        ctx.scale = 1.0 / (1.0 - p)
        return x.masked_fill(mask, 0) * ctx.scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[no-untyped-def,override]
        (mask,) = ctx.saved_tensors
        return grad.masked_fill(mask, 0) * ctx.scale, None


class StraightThroughRound(torch.autograd.Function):
    """A backward that is not the derivative of the forward (rounding, passed straight through): the per-example
    gradient autograd gives goes through this backward, which no rule could derive from the forward's operations."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def,override]
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def,override]
        return grad


class ProductAndRatio(torch.autograd.Function):
    """Two tensor operands and two outputs, a hand-written backward for both."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def,override]
        ctx.save_for_backward(a, b)
        return a * b, a / (1 + b * b)

    @staticmethod
    def backward(ctx, g_product: torch.Tensor, g_ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def,override]
        a, b = ctx.saved_tensors
        d = 1 + b * b
        return g_product * b + g_ratio / d, g_product * a - g_ratio * a * 2 * b / (d * d)


class Swish(torch.autograd.Function):
    """A custom activation on the batch's activations alone."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def,override]
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def,override]
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s + x * s * (1 - s))


class TablesThroughFunctions(nn.Module):
    """Parameters passed through custom Functions before they meet the batch (SEW-D's dropout of its relative
    position table, a quantised weight, a pair of tables mixed by hand), a custom activation on the batch, and a
    weight used both through a Function and directly."""

    def __init__(self, length: int = 5, width: int = 4) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(length, width) * 0.5)
        self.norm = nn.LayerNorm(width)
        self.inner = nn.Linear(width, width)
        self.a, self.b = nn.Parameter(torch.randn(width) * 0.5), nn.Parameter(torch.randn(width) * 0.5)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = MaskedDropout.apply(self.norm(self.table), 0.3)
        keys = self.inner(table)  # (length, width): computed from parameters alone, through the Function
        h = torch.tanh(self.inner(x) + keys)  # the same Linear on the batch
        weight = StraightThroughRound.apply(self.inner.weight)
        h = Swish.apply(h @ weight.t() + self.inner.weight.sum(0))
        product, ratio = ProductAndRatio.apply(self.a, self.b)
        return self.out((h * product + ratio).mean(1))


def test_parameters_through_custom_functions_are_exact_without_the_exact_path() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 5, 4, generator=generator(1), dtype=torch.float64)
    assert_exact_without_the_exact_path(
        TablesThroughFunctions(), per_example_cross_entropy, x, torch.randint(0, 3, (6,), generator=generator(2))
    )


class OnceDifferentiableScale(torch.autograd.Function):
    """A backward under ``once_differentiable`` (run without autograd: no batched backward through it)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[no-untyped-def,override]
        ctx.scale = scale
        return w * scale

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[no-untyped-def,override]
        return grad * ctx.scale, None


class SeparateContextSine(torch.autograd.Function):
    """The newer style: ``forward`` without ``ctx``, ``setup_context``, a generated vmap rule."""

    generate_vmap_rule = True

    @staticmethod
    def forward(w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.sin(w)

    @staticmethod
    def setup_context(ctx, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:  # type: ignore[no-untyped-def,override]
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def,override]
        (w,) = ctx.saved_tensors
        return grad * torch.cos(w)


class RowMaximum(torch.autograd.Function):
    """Two outputs, one of them marked non-differentiable (the index of each row's maximum)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def,override]
        values, index = w.max(1)
        ctx.mark_non_differentiable(index)
        ctx.save_for_backward(index)
        ctx.shape = w.shape
        return values, index

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def,override]
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).scatter_(1, index[:, None], grad[:, None])


class FunctionsOfEveryStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.u = nn.Parameter(torch.randn(4, 4) * 0.5), nn.Parameter(torch.randn(4))
        self.v = nn.Parameter(torch.randn(4, 3))
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, index = RowMaximum.apply(self.v)
        h = x @ OnceDifferentiableScale.apply(self.w, 1.5).t() + SeparateContextSine.apply(self.u) + values
        return self.out(torch.tanh(h) * (1 + index))


def test_functions_of_every_style_on_parameters_are_exact_without_the_exact_path() -> None:
    torch.manual_seed(11)
    x = torch.randn(6, 4, generator=generator(12), dtype=torch.float64)
    assert_exact_without_the_exact_path(
        FunctionsOfEveryStyle(), per_example_cross_entropy, x, torch.randint(0, 3, (6,), generator=generator(13))
    )


class ParameterWithTheBatch(nn.Module):
    """A Function called with a parameter and the batch: no rule knows it, so it is run example by example
    (:mod:`dpml.train.rules.per_example_calls`), one use of the parameter through each of its two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.rand(4) + 0.5)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product, _ = ProductAndRatio.apply(torch.tanh(self.first(x)), self.scale)
        return self.out(product)


def test_a_function_of_a_parameter_and_the_batch_with_two_outputs_is_run_example_by_example() -> None:
    torch.manual_seed(3)
    x, y = torch.randn(7, 4, dtype=torch.float64, generator=generator(4)), torch.randint(0, 2, (7,))
    assert_exact_without_the_exact_path(ParameterWithTheBatch(), per_example_cross_entropy, x, y)


class Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        StraightThroughRound.apply(self.weight)
        raise RuntimeError("the model's own error")


def test_function_apply_is_torchs_own_after_a_recording_and_on_other_threads() -> None:
    """Outside a recording, and on a thread that is not recording while another one is, ``Function.apply`` is not
    routed anywhere: after a pass, after one the model broke, and during one."""
    model = TablesThroughFunctions().double()
    x, y = torch.randn(3, 5, 4, dtype=torch.float64), torch.tensor([0, 1, 2])
    engine_pass(model, per_example_cross_entropy, x, y, frozenset())
    assert torch.autograd.Function.__dict__["apply"] is ORIGINAL_APPLY
    with pytest.raises(RuntimeError, match="the model's own error"):
        engine_pass(Failing().double(), per_example_cross_entropy, x[:, 0, :3], y, frozenset())
    assert torch.autograd.Function.__dict__["apply"] is ORIGINAL_APPLY

    seen: list[object] = []
    recording, done = threading.Event(), threading.Event()

    class Waits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 2, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            recording.set()
            assert done.wait(30)
            return x.mean(1) @ self.weight

    def elsewhere() -> None:  # the same Function, on a parameter, on a thread that records nothing
        assert recording.wait(30)
        weight = nn.Parameter(torch.randn(3, dtype=torch.float64))
        out = StraightThroughRound.apply(weight)
        seen.append(getattr(custom_functions._active, "recorder", None))
        seen.append(out.grad_fn.__class__.__name__)
        done.set()

    thread = threading.Thread(target=elsewhere)
    thread.start()
    engine_pass(Waits(), per_example_cross_entropy, x, y[:3] % 2, frozenset())
    thread.join(30)
    assert seen == [None, "StraightThroughRoundBackward"]


def test_sew_d_with_its_stable_dropout_is_exact_without_the_exact_path() -> None:
    """transformers' SEW-D passes its relative-position table through ``XDropout`` (a custom Function) in training."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config = transformers.SEWDConfig(
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=16,
        conv_dim=(8, 8),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        squeeze_factor=2,
        num_labels=3,
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        position_buckets=4,
        max_position_embeddings=16,
        activation_dropout=0.2,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        mask_time_prob=0.0,  # (SpecAugment's and LayerDrop's draws come from numpy's and Python's random state)
        layerdrop=0.0,
    )
    torch.manual_seed(7)
    model = transformers.SEWDForSequenceClassification(config).train()

    x = torch.randn(4, 120, generator=generator(8), dtype=torch.float64)
    assert_exact_without_the_exact_path(
        Logits(model, "input_values"),
        per_example_cross_entropy,
        x,
        torch.randint(0, 3, (4,), generator=generator(9)),
        seed=10,
    )


class CountedScaleAndShift(torch.autograd.Function):
    """``x * scale + shift`` and ``x * shift``, old style, its backward under ``once_differentiable`` and forming only
    the gradients ``ctx.needs_input_grad`` asks for: counts how many times its forward runs (a loop over the examples
    would run it once per example)."""

    runs = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def,override]
        CountedScaleAndShift.runs += 1
        ctx.save_for_backward(x, scale, shift)
        return x * scale + shift, x * shift

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[no-untyped-def,override]
        x, scale, shift = ctx.saved_tensors
        batch_dims = tuple(range(g.dim() - scale.dim()))
        needs = ctx.needs_input_grad  # (as hand-written backwards do: only the gradients some input needs)
        return (
            g * scale + h * shift if needs[0] else None,
            (g * x).sum(batch_dims) if needs[1] else None,
            (g + h * x).sum(batch_dims) if needs[2] else None,
        )


class SeparateContextGate(torch.autograd.Function):
    """The newer style (``setup_context``) without a vmap rule of its own: ``x · sigmoid(gate)``, the gate expanded
    over the batch by the caller (each example reads a slice of one row)."""

    @staticmethod
    def forward(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * torch.sigmoid(gate)

    @staticmethod
    def setup_context(ctx, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:  # type: ignore[no-untyped-def,override]
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def,override]
        x, gate = ctx.saved_tensors
        s = torch.sigmoid(gate)
        return g * s, (g * x * s * (1 - s)).sum(tuple(range(1, g.dim() - 1)), keepdim=True)


class FunctionsOnTheBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.scale, self.shift = nn.Parameter(torch.rand(4) + 0.5), nn.Parameter(torch.randn(4) * 0.3)
        self.gate = nn.Parameter(torch.randn(1, 1, 4))
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, 4)
        h = torch.tanh(self.embed(x))
        moved, product = CountedScaleAndShift.apply(h, self.scale, self.shift)
        gated = SeparateContextGate.apply(torch.tanh(moved) + product, self.gate.expand(x.shape[0], -1, -1))
        return self.out(gated.mean(1))


def test_functions_on_the_batch_run_as_one_batched_call_of_their_own_forward_and_backward() -> None:
    """Old and new styles, two outputs, a parameter expanded over the batch: exact, and the Function's forward runs a
    fixed number of times whatever the batch (the recorded call, the check of its rows, the gradients), not once per
    example."""
    torch.manual_seed(5)
    x = torch.randn(9, 3, 4, dtype=torch.float64, generator=generator(6))
    y = torch.randint(0, 3, (9,), generator=generator(7))
    model = FunctionsOnTheBatch().double()
    CountedScaleAndShift.runs = 0
    found = engine_pass(model, per_example_cross_entropy, x, y, ())
    assert found.exact == {}, found.reasons
    assert CountedScaleAndShift.runs == 4, CountedScaleAndShift.runs  # the call, its check, one backward an output
    assert_exact_without_the_exact_path(model, per_example_cross_entropy, x, y)


class KeptDimensionScale(torch.autograd.Function):
    """A backward that gives the scale's gradient with a leading dimension of one kept, (1, d) for a scale (d,):
    autograd sums such a gradient to the operand's shape, and the batched backward must too."""

    runs = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def,override]
        KeptDimensionScale.runs += 1
        ctx.save_for_backward(x, scale)
        return x * scale

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def,override]
        x, scale = ctx.saved_tensors
        return g * scale, (g * x).reshape(-1, x.shape[-1]).sum(0, keepdim=True)


def test_a_functions_gradient_is_taken_as_autograd_takes_it() -> None:
    x = torch.randn(6, 4, dtype=torch.float64, generator=generator(8))
    y = torch.randint(0, 2, (6,), generator=generator(9))
    KeptDimensionScale.runs = 0
    found = engine_pass(ScaledBy(KeptDimensionScale).double(), per_example_cross_entropy, x, y, ())
    assert found.exact == {} and KeptDimensionScale.runs == 3, (found.reasons, KeptDimensionScale.runs)
    assert_exact_without_the_exact_path(ScaledBy(KeptDimensionScale), per_example_cross_entropy, x, y)
