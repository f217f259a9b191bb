"""exp(A) of a parameter pulled back through iA's eigendecomposition (:mod:`dpml.train.rules.matrix_exp`): the
stand-in's backward is torch's own, per example under ``vmap`` as the pull-back runs it, for skew-symmetric and
skew-Hermitian A (eigenvalues repeated or zero too) and, through torch's own call, for any other A (symmetric,
Hermitian, skew but for one ulp: each case checked to take the path it should); in half precision within that
precision of float64 (torch's own backward gives NaN there); and
``orthogonal``'s weights, away from the identity they start at, train with clipped sums and norms equal to a float64
per-example loop, nothing on the exact path."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from conftest import assert_clips_as_a_per_example_loop
from dpml.train.clipping_check import _PLANS, plan_clipping
from dpml.train.rules.matrix_exp import exp_of_skew_hermitian
from dpml.train.rules.rerun import run_as


def _skew(n: int, dtype: torch.dtype, scale: float = 1.0, batch: tuple[int, ...] = ()) -> torch.Tensor:
    x = torch.randn(*batch, n, n, dtype=dtype) * scale
    return x - x.mH


def _rotation_generator_with_repeated_angles() -> torch.Tensor:
    """Block-diagonal 2 × 2 rotation generators with angles 0.7, 0.7, 0 (iA's eigenvalues ±0.7 twice, 0 twice)."""
    a = torch.zeros(6, 6, dtype=torch.float64)
    for k, angle in enumerate([0.7, 0.7, 0.0]):
        a[2 * k, 2 * k + 1], a[2 * k + 1, 2 * k] = angle, -angle
    q = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64))[0]
    rotated = q @ a @ q.T
    return (rotated - rotated.T) / 2  # (exactly skew-symmetric again after the products' rounding)


def _one_ulp_off(a: torch.Tensor) -> torch.Tensor:
    a[0, 1] = torch.nextafter(a[0, 1], torch.tensor(torch.inf, dtype=a.dtype))
    return a


CASES = {
    "skew-symmetric": lambda: _skew(7, torch.float64),
    "skew-symmetric-large-angles": lambda: _skew(5, torch.float64, scale=3.0),
    "skew-hermitian": lambda: _skew(6, torch.complex128),
    "batched": lambda: _skew(4, torch.float64, batch=(3,)),
    "zero": lambda: torch.zeros(5, 5, dtype=torch.float64),
    "repeated-eigenvalues": _rotation_generator_with_repeated_angles,
    "not-skew (torch's own)": lambda: torch.randn(5, 5, dtype=torch.float64) * 0.5,
    "symmetric (torch's own)": lambda: -_skew(5, torch.float64) @ _skew(5, torch.float64).mT / 4,
    "hermitian (torch's own)": lambda: 1j * _skew(4, torch.complex128) / 2,
    "skew but for one ulp (torch's own)": lambda: _one_ulp_off(_skew(4, torch.float64)),
}
TORCH_S_OWN = {case for case in CASES if "torch's own" in case}


def _per_example_backwards(function: object, a: torch.Tensor, cotangents: torch.Tensor) -> torch.Tensor:
    leaf = a.clone().requires_grad_(True)
    out = function(leaf)  # type: ignore[operator]

    def one(g: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(out, leaf, g, retain_graph=True)[0]

    return torch.func.vmap(one)(cotangents)


@pytest.mark.parametrize("case", list(CASES))
def test_the_stand_in_gives_torch_s_exp_and_torch_s_per_example_backward(case: str) -> None:
    torch.manual_seed(0)
    a = CASES[case]()
    cotangents = torch.randn(4, *a.shape, dtype=a.dtype)
    assert torch.equal(exp_of_skew_hermitian(a), torch.matrix_exp(a))
    backward = type(exp_of_skew_hermitian(a.clone().requires_grad_(True)).grad_fn).__name__
    assert backward == ("LinalgMatrixExpBackward0" if case in TORCH_S_OWN else "_ExpOfSkewHermitianBackward")
    found = _per_example_backwards(exp_of_skew_hermitian, a, cotangents)
    expected = _per_example_backwards(torch.matrix_exp, a, cotangents)
    assert found.dtype == expected.dtype and found.shape == expected.shape
    torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_in_lower_precisions_the_stand_in_s_backward_is_within_that_precision_of_float64(dtype: torch.dtype) -> None:
    """A half-precision A is decomposed in complex64 and its gradient given back in A's dtype (torch's own backward
    gives NaN in float16 and bfloat16 here)."""
    torch.manual_seed(2)
    a = _skew(5, torch.float64)
    cotangents = torch.randn(3, 5, 5, dtype=torch.float64)
    found = _per_example_backwards(exp_of_skew_hermitian, a.to(dtype), cotangents.to(dtype))
    expected = _per_example_backwards(torch.matrix_exp, a, cotangents)
    assert found.dtype == dtype
    scale = expected.abs().amax().item()
    torch.testing.assert_close(found.double(), expected, rtol=0, atol=8 * torch.finfo(dtype).eps * scale)


def test_the_stand_in_is_what_a_rerun_of_matrix_exp_runs() -> None:
    for function in (torch.matrix_exp, torch.linalg.matrix_exp, torch.Tensor.matrix_exp):
        assert run_as(function) is exp_of_skew_hermitian
    assert run_as(torch.mm) is torch.mm


def _orthogonal_classifier(square: bool) -> nn.Module:
    first = nn.Linear(6, 6) if square else nn.Linear(6, 4)
    body = parametrizations.orthogonal(first, orthogonal_map="matrix_exp")
    with torch.no_grad():  # away from the identity orthogonal starts at (A = 0 there: every angle equal)
        body.parametrizations.weight.original.add_(torch.randn_like(body.parametrizations.weight.original) * 0.8)
    return nn.Sequential(body, nn.Tanh(), nn.Linear(first.out_features, 3))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("square", [True, False], ids=["square", "rectangular"])
def test_orthogonal_weights_clip_as_a_float64_per_example_loop_with_nothing_exact(square: bool) -> None:
    torch.manual_seed(1)
    model = _orthogonal_classifier(square).double()
    _PLANS.clear()
    plan = plan_clipping(model, _loss, (6,), torch.float64)
    assert plan.exact_parameters == ()
    x, y = torch.randn(9, 6, dtype=torch.float64), torch.randint(0, 3, (9,))
    assert_clips_as_a_per_example_loop(model, _loss, x, y, 0.5, plan.exact)
