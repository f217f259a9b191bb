"""A weight divided by a scalar function of itself, T = W / s(W) (:mod:`dpml.train.rules.scaled_weight`):
``spectral_norm``'s W / σ on linear and convolutional layers and a whole-tensor W / ‖W‖ written by hand take the
closed form ∇_W ℓ_i = α G_i + ⟨T, G_i⟩ E, fitted at the current W (spectral norm: α = 1/σ, E = −u vᵀ / σ), as do
W / max|W| and W · tanh(mean W), and clip as a float64 per-example loop with nothing on the exact path; a map of
another kind (W − mean W, whose functional is ⟨1, ·⟩) fails the fit's check and takes the generic pull-back, exact all
the same; a row-wise normalisation stays the row map's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from conftest import assert_clips_as_a_per_example_loop
from dpml.train.clipping_check import _PLANS, plan_clipping
from dpml.train.rules import row_jacobian, scaled_weight


class ComputedWeight(nn.Module):
    """A linear layer whose weight is ``compute(W)`` before ``F.linear``."""

    def __init__(self, compute: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 5))
        self.bias = nn.Parameter(torch.randn(6))
        self.compute = compute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.compute(self.weight), self.bias)


class Sequence(nn.Module):
    """``body`` over (B, 7, 5) sequences (or their (B, 5, 7) transpose for a convolution), tanh, mean, a head."""

    def __init__(self, body: nn.Module, convolution: bool = False) -> None:
        super().__init__()
        self.body, self.convolution = body, convolution
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x.transpose(1, 2)).transpose(1, 2) if self.convolution else self.body(x)
        return self.head(torch.tanh(h).mean(1))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "spectral-norm-linear": lambda: Sequence(parametrizations.spectral_norm(nn.Linear(5, 6))),
    "spectral-norm-conv1d": lambda: Sequence(parametrizations.spectral_norm(nn.Conv1d(5, 6, 3, padding=1)), True),
    "spectral-norm-dim-1": lambda: Sequence(parametrizations.spectral_norm(nn.Linear(5, 6), dim=1)),
    "frobenius": lambda: Sequence(ComputedWeight(lambda w: w / w.norm())),
    "frobenius-written-out": lambda: Sequence(ComputedWeight(lambda w: w / (torch.sqrt((w * w).sum()) + 1e-3))),
    "largest-entry": lambda: Sequence(ComputedWeight(lambda w: w / w.abs().amax())),  # (∇s at one entry)
    "times-a-scalar": lambda: Sequence(ComputedWeight(lambda w: w * torch.tanh(w.mean()))),
}


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


def _fits(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[bool]:
    """Whether each call of ``module.name`` (a fit) found its map, as the pass calls it."""
    found: list[bool] = []
    fit = getattr(module, name)

    def watched(*args: object) -> object:
        result = fit(*args)
        found.append(result is not None)
        return result

    monkeypatch.setattr(module, name, watched)
    return found


@pytest.mark.parametrize("name", list(MODELS))
def test_a_weight_over_a_scalar_of_itself_clips_as_a_float64_per_example_loop(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = MODELS[name]().double()
    scaled = _fits(monkeypatch, scaled_weight, "fitted_scaled_map")
    _PLANS.clear()
    plan = plan_clipping(model, _loss, (7, 5), torch.float64)
    assert plan.exact_parameters == () and scaled and all(scaled)
    x, y = torch.randn(8, 7, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    assert_clips_as_a_per_example_loop(model, _loss, x, y, 0.3, plan.exact)


def test_spectral_norm_s_map_is_one_over_sigma_and_minus_u_v_over_sigma() -> None:
    torch.manual_seed(1)
    layer = parametrizations.spectral_norm(nn.Linear(5, 6)).double()
    layer.eval()  # (u and v as they stand: no power iteration)
    parametrization = layer.parametrizations.weight[0]
    u, v, w = parametrization._u, parametrization._v, layer.parametrizations.weight.original
    sigma = torch.vdot(u, torch.mv(w, v)).detach()
    copy = w.detach().clone().requires_grad_(True)
    t = copy / torch.vdot(u, torch.mv(copy, v))

    def pull_back(probes: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.autograd.grad(t, copy, p, retain_graph=True)[0].reshape(-1) for p in probes])

    found = scaled_weight.scaled_map_of(pull_back, t.detach())
    assert found is not None
    assert found.alpha == pytest.approx(float(1 / sigma), rel=1e-12)
    torch.testing.assert_close(found.direction, (-torch.outer(u, v) / sigma).detach(), rtol=1e-9, atol=1e-12)


def test_a_map_of_another_kind_fails_the_check_and_is_exact_through_the_generic_pull_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(2)
    model = Sequence(ComputedWeight(lambda w: w - w.mean())).double()  # J g = g − mean(g)·1: ⟨1, g⟩, not ⟨T, g⟩
    scaled = _fits(monkeypatch, scaled_weight, "fitted_scaled_map")
    _PLANS.clear()
    plan = plan_clipping(model, _loss, (7, 5), torch.float64)
    assert plan.exact_parameters == () and scaled and not any(scaled)
    x, y = torch.randn(8, 7, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    assert_clips_as_a_per_example_loop(model, _loss, x, y, 0.3, plan.exact)


def test_a_row_wise_normalisation_stays_the_row_map_s(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(3)
    model = Sequence(ComputedWeight(lambda w: w / w.norm(dim=1, keepdim=True))).double()
    scaled = _fits(monkeypatch, scaled_weight, "fitted_scaled_map")
    rows = _fits(monkeypatch, row_jacobian, "fitted_row_map")
    _PLANS.clear()
    plan = plan_clipping(model, _loss, (7, 5), torch.float64)
    assert plan.exact_parameters == () and not scaled and (rows == [] or all(rows))  # (or read off the operations)
