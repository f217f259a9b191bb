"""The matrix exponential of a parameter, Q = exp(A), pulled back example by example through one
eigendecomposition instead of one exponential of a 2n × 2n matrix for each example.

The per-example gradients G_i of Q reach A through the adjoint of exp's Fréchet derivative at A (Higham 2008,
*Functions of Matrices*, ch. 3; the form torch's backward takes):

    ∇_A ℓ_i = L_exp(Aᴴ)[G_i],

which torch forms as the upper-right block of exp([[Aᴴ, G_i], [0, Aᴴ]]) — for the pull-back of B examples, B
exponentials of twice the size, each some ten products of 2n × 2n matrices (``orthogonal``'s weight, n = 128, batch
64: 0.07 of the non-private step's throughput). Where A is skew-Hermitian (Aᴴ = −A: ``torch.nn.utils.
parametrizations.orthogonal``'s A = X − Xᴴ, the Lie algebra of SO(n) and U(n) that exp maps onto them), A is normal:
iA is Hermitian, iA = V diag(θ) Vᴴ with θ real and V unitary, so Aᴴ = V diag(iθ) Vᴴ, and the Daleckiĭ–Kreĭn
theorem (Higham 2008, §3.2) gives the derivative in that basis as a Hadamard product with exp's divided differences:

    L_exp(Aᴴ)[G] = V ((Vᴴ G V) ∘ Φ) Vᴴ,   Φ_jk = (e^{iθ_j} − e^{iθ_k}) / (iθ_j − iθ_k)
                                              = e^{i(θ_j + θ_k)/2} · sin((θ_j − θ_k)/2) / ((θ_j − θ_k)/2),

the second form exact where θ_j = θ_k (Φ_jj = e^{iθ_j}) and free of the first's cancellation where they are close.
One eigendecomposition for the batch, then four n × n complex products an example (real A: the real part).

:func:`exp_of_skew_hermitian` is the stand-in :mod:`.rerun` runs in place of ``torch.matrix_exp`` when it runs a
computation on parameters again for its pull-back: its output is torch's own exp(A) (the run is checked equal to
the recorded one); its backward is the form above where A is exactly skew-Hermitian; any other A runs torch's own
``matrix_exp`` and backward. The probe judges it, as every pull-back, against per-example
autograd."""

from __future__ import annotations

from typing import Any

import torch

from dpml.train.rules.rerun import stand_in


def _is_skew_hermitian(a: torch.Tensor) -> bool:
    """Aᴴ = −A exactly (X − Xᴴ is, in floating point: x − y = −(y − x)); a non-square A is not (``torch.equal`` of
    tensors of other shapes is False)."""
    return bool(torch.equal(a.mH, -a))


def _divided_differences(theta: torch.Tensor) -> torch.Tensor:
    """Φ_jk = e^{i(θ_j + θ_k)/2} · sinc((θ_j − θ_k)/2) for real θ (..., n): exp's divided differences at iθ."""
    half_sum = (theta[..., :, None] + theta[..., None, :]) / 2
    half_gap = (theta[..., :, None] - theta[..., None, :]) / 2
    return torch.sinc(half_gap / torch.pi) * torch.exp(1j * half_sum)  # (torch.sinc(x) = sin(πx) / (πx))


class _ExpOfSkewHermitian(torch.autograd.Function):
    """exp(A) by ``torch.matrix_exp`` for a skew-Hermitian A; its backward by iA's eigendecomposition."""

    @staticmethod
    def forward(a: torch.Tensor) -> torch.Tensor:
        return torch.matrix_exp(a)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:  # noqa: ANN401
        (a,) = inputs  # (a half-precision A is decomposed in complex64: eigh takes no complex32)
        theta, vectors = torch.linalg.eigh(1j * a.detach().to(torch.promote_types(a.dtype, torch.complex64)))
        ctx.save_for_backward(_divided_differences(theta), vectors)  # (Φ: the eigenvectors' complex dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN401
        phi, vectors = ctx.saved_tensors
        found = vectors @ ((vectors.mH @ g.to(vectors.dtype) @ vectors) * phi) @ vectors.mH
        # g has exp(A)'s dtype, so A's: complex exactly where A is (autograd casts the result to A's dtype)
        result: torch.Tensor = found if g.is_complex() else found.real
        return result


@stand_in(torch.matrix_exp, torch.linalg.matrix_exp, torch.Tensor.matrix_exp)
def exp_of_skew_hermitian(a: torch.Tensor) -> torch.Tensor:
    """``torch.matrix_exp(a)``, the same numbers: with the backward of :class:`_ExpOfSkewHermitian` where A is exactly
    skew-Hermitian, else torch's own call and backward."""
    if not _is_skew_hermitian(a.detach()):
        return torch.matrix_exp(a)
    result: torch.Tensor = _ExpOfSkewHermitian.apply(a)  # type: ignore[no-untyped-call]
    return result
