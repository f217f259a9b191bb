"""Complex parameters (a Fourier neural operator's spectral weights): refused before any work, naming the parameter
and the real form that trains; the real form, read through ``torch.view_as_complex``, clips exactly; and complex
noise is never drawn (cast to complex, real noise would leave the imaginary parts without any)."""

from __future__ import annotations

import pytest
import torch
from test_op_rules import assert_clipped_like_the_loop, generator
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


def test_the_real_form_read_through_view_as_complex_clips_exactly() -> None:
    """(At 6870e29 its complex factors were read as integer indices, and the plan failed: a recursion without end.)"""
    torch.manual_seed(3)
    model = SpectralConvolution(complex_weights=False).double()
    x = torch.randn(6, 8, dtype=torch.float64, generator=generator(4))
    y = torch.randint(0, 2, (6,), generator=generator(5))
    plan = plan_clipping(model, per_example_cross_entropy, (8,), torch.float64, probe=(x, y))
    assert_clipped_like_the_loop(model, x, y, exact=plan.exact)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_noise_is_never_drawn(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="noise is not drawn"):
        gaussian((3, 2), 1.0, torch.Generator().manual_seed(0), dtype)
