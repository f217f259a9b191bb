"""Complex parameters (a Fourier neural operator's spectral weights): refused before any work, naming the parameter
and the real form that trains; the real form, read through ``torch.view_as_complex``, and a long convolution by FFT
with a learned kernel clip exactly without the exact path; and complex noise is never drawn (cast to complex, real
noise would leave the imaginary parts without any)."""

from __future__ import annotations

import pytest
import torch
from test_op_rules import assert_exact_without_the_exact_path, generator
from torch import nn

from dpml.train.clipping_check import plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy
from dpml.train.noise import gaussian
from dpml.train.probe_checks import ClippingUnsupported


class SpectralConvolution(nn.Module):
    """FNO's 1-D spectral convolution (Li et al. 2021): the lowest modes of the lifted signal's FFT multiplied by
    complex weights per channel pair, back by the inverse FFT, plus the signal itself."""

    def __init__(self, complex_weights: bool, channels: int = 4, modes: int = 3) -> None:
        super().__init__()
        self.modes = modes
        shape = (channels, channels, modes)
        if complex_weights:
            self.w = nn.Parameter(0.3 * torch.rand(shape, dtype=torch.cfloat))
        else:  # the same weights as real pairs
            self.w_pair = nn.Parameter(0.3 * torch.rand(*shape, 2))
        self.lift = nn.Linear(1, channels)
        self.out = nn.Linear(channels, 2)

    def weights(self) -> torch.Tensor:
        return self.w if hasattr(self, "w") else torch.view_as_complex(self.w_pair)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, L)
        h = self.lift(x.unsqueeze(-1)).transpose(1, 2)  # (B, channels, L)
        spectrum = torch.fft.rfft(h)
        mixed = torch.zeros_like(spectrum)
        mixed[:, :, : self.modes] = torch.einsum("bix,iox->box", spectrum[:, :, : self.modes], self.weights())
        return self.out(torch.tanh(torch.fft.irfft(mixed, n=h.shape[-1]) + h).mean(2))


def test_a_complex_parameter_is_refused_before_any_work_naming_it_and_the_real_form() -> None:
    model = SpectralConvolution(complex_weights=True)
    with pytest.raises(ClippingUnsupported) as refused:
        plan_clipping(model, per_example_cross_entropy, (8,), torch.float32)
    message = str(refused.value)
    assert "model parameter 'w' is complex (torch.complex64)" in message, message
    assert "shape (4, 4, 3, 2)" in message and "torch.view_as_complex" in message, message


def test_the_real_form_read_through_view_as_complex_clips_exactly_without_the_exact_path() -> None:
    """(At 6870e29 its complex factors were read as integer indices, and the plan failed: a recursion without end;
    at f76ecb9 the einsum's rule, which does not conjugate, was off and the probe sent the weights to the exact
    path. Complex calls now run example by example, through autograd's own convention.)"""
    torch.manual_seed(3)
    x = torch.randn(6, 8, dtype=torch.float64, generator=generator(4))
    y = torch.randint(0, 2, (6,), generator=generator(5))
    assert_exact_without_the_exact_path(SpectralConvolution(complex_weights=False), per_example_cross_entropy, x, y)


class LongConvolution(nn.Module):
    """A long convolution by FFT with a learned kernel (S4's and Hyena's form): irfft(rfft(h) · rfft(k))."""

    def __init__(self, length: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(length, length)
        self.kernel = nn.Parameter(torch.randn(length) * 0.5)
        self.out = nn.Linear(length, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        return self.out(torch.fft.irfft(torch.fft.rfft(h) * torch.fft.rfft(self.kernel), n=h.shape[-1]))


def test_a_long_convolution_by_fft_with_a_learned_kernel_clips_exactly_without_the_exact_path() -> None:
    """(At f76ecb9 the kernel's complex per-example gradients were cast to real on their way back
    through the FFT: 92 % off, and the probe sent the kernel to the exact path.)"""
    torch.manual_seed(6)
    x = torch.randn(6, 8, dtype=torch.float64, generator=generator(7))
    y = torch.randint(0, 2, (6,), generator=generator(8))
    assert_exact_without_the_exact_path(LongConvolution(), per_example_cross_entropy, x, y)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_noise_is_never_drawn(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="noise is not drawn"):
        gaussian((3, 2), 1.0, torch.Generator().manual_seed(0), dtype)
