"""Weights built by many computations on parameters are carried back to them by one batched backward pass through
the computations run again as one graph (dpml.train.rules.stitched): a product of Householder reflections (peft's
HRA), views of computed weights taken by strides and by a shared index, a call with two outputs, sums written in
place (peft's OFT). Clipped sums and
norms equal a float64 per-example loop either way; the graph is not taken where a constant the computations read was
written in place after they ran (a zero-initialised factor hides the write from the numbers, not from the
Jacobian)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_op_rules import assert_exact_without_the_exact_path, generator
from torch import nn

import dpml.train.rules.pull_backs as pull_backs
from dpml.train.dpsgd import per_example_cross_entropy


class Householder(nn.Module):
    """A frozen weight times the product of ``rank`` Householder reflections of normalised trained columns,
    W₀ · Π_k (I − 2 u_k u_kᵀ), written as peft's HRA writes it (one small computation at a time), then a head."""

    def __init__(self, width: int = 6, rank: int = 3) -> None:
        super().__init__()
        self.frozen = nn.Parameter(torch.randn(width, width) * 0.3, requires_grad=False)
        self.u = nn.Parameter(torch.randn(width, rank))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.u / self.u.norm(dim=0)
        weight = torch.eye(u.shape[0], dtype=u.dtype, device=u.device)
        for k in range(u.shape[1]):
            column = u[:, k].view(-1, 1)
            weight = weight - 2 * weight @ column @ column.t()
        weight = torch.mm(self.frozen, weight)
        return self.head(torch.tanh(F.linear(x, weight)).mean(1))


class ViewsOfComputedWeights(nn.Module):
    """Computed weights read through views: a transposed block of a scaled table (its strides), the rows a position
    tensor shared by the batch picks from a computed table and summed (an index), and QR's two outputs of one
    call, both used."""

    def __init__(self, width: int = 6, length: int = 5) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * width, width) * 0.3)
        self.positions = nn.Parameter(torch.randn(length + 2, width) * 0.3)
        self.square = nn.Parameter(torch.randn(width, width) + 2 * torch.eye(width))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = torch.tanh(self.table) * 1.5
        block = scaled[1 : 1 + x.shape[-1]].t() * 0.5
        ids = torch.tensor([0, 2, 2, 4, 1])[: x.shape[1]]
        shift = (self.positions * 2)[ids].sum(0) * 0.1
        q, r = torch.linalg.qr(self.square)
        rotation = q * torch.sign(r.diagonal()) + r.triu(1) * 0.01
        h = torch.tanh(x @ block + shift) @ rotation
        return self.head(h.mean(1))


class AccumulatedInPlace(nn.Module):
    """Blocks of a weight summed in place from powers of a skew-symmetric matrix of a parameter, as peft's OFT writes
    its Cayley–Neumann series (``R = I.repeat(…); R.add_(Q, alpha=2.0); R.add_(Q @ Q, alpha=2.0); …``): each sum
    overwrites the one before, so the graph checks each against the sum's own run made before the next write."""

    def __init__(self, width: int = 6, block: int = 3) -> None:
        super().__init__()
        self.block = block
        self.q = nn.Parameter(torch.randn(width // block, block, block) * 0.3)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skew = self.q - self.q.transpose(1, 2)
        rotation = torch.eye(self.block, dtype=x.dtype, device=x.device).repeat(skew.shape[0], 1, 1)
        rotation.add_(skew, alpha=2.0)
        power = torch.bmm(skew, skew)
        rotation.add_(power, alpha=2.0)
        rotation.add_(torch.bmm(power, skew))
        weight = torch.block_diag(*rotation.unbind(0))
        return self.head(torch.tanh(x @ weight).mean(1))


class ScaledByACopy(torch.autograd.Function):
    """p · c whose backward reads a copy of c kept on the context (not saved for backward, so no version check of
    PyTorch's own protects c: a write to c after the call changes what the call run again gives, not the recorded
    backward)."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:  # noqa: ANN401
        ctx.c = c.clone()
        return p * c

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN401
        return gradient * ctx.c, None


class WrittenConstant(nn.Module):
    """A zero-initialised factor times a constant that the forward pass doubles in place after the product ran (as a
    buffer written after its use): the product's values do not show the write (zeros either way), its Jacobian
    does (run again after the write, it would be twice the recorded one), and only the constant's version counter
    tells."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.factor = nn.Parameter(torch.zeros(width))
        self.other = nn.Parameter(torch.randn(width) * 0.3)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        constant = torch.linspace(0.5, 1.5, x.shape[-1], dtype=x.dtype)
        scale = ScaledByACopy.apply(self.factor, constant)
        constant.mul_(2.0)
        gate = scale + self.other * 0.5
        return self.head(torch.tanh(x * (gate + 1.0)).mean(1))


class Counted:
    """How often the stitched graph was taken, and how often a computation was pulled back on its own."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.stitched = self.refused = self.one_by_one = 0
        stitch, pull_back = pull_backs.stitch, pull_backs.pull_back

        def counted_stitch(chain: list[Any]) -> Any:  # noqa: ANN401
            found = stitch(chain)
            self.stitched += found is not None
            self.refused += found is None
            return found

        def counted_pull_back(node: Any, gradients: torch.Tensor) -> list[torch.Tensor]:  # noqa: ANN401
            self.one_by_one += 1
            return pull_back(node, gradients)

        monkeypatch.setattr(pull_backs, "stitch", counted_stitch)
        monkeypatch.setattr(pull_backs, "pull_back", counted_pull_back)


def batch(count: int = 7, length: int = 5, width: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(count, length, width, generator=generator(3), dtype=torch.float64)
    return x, torch.randint(0, 3, (count,), generator=generator(4))


@pytest.mark.parametrize(
    "model", [Householder, ViewsOfComputedWeights, AccumulatedInPlace], ids=["householder", "views", "in place"]
)
def test_a_chain_of_computations_on_parameters_is_pulled_back_as_one_graph_exactly(
    model: type[nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = Counted(monkeypatch)
    torch.manual_seed(0)
    assert_exact_without_the_exact_path(model(), per_example_cross_entropy, *batch(), planned=False)
    assert counted.stitched > 0 and counted.refused == 0
    assert counted.one_by_one == 0  # no computation pulled back on its own


def test_a_constant_written_after_its_computation_ran_is_pulled_back_one_by_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counted = Counted(monkeypatch)
    torch.manual_seed(0)
    assert_exact_without_the_exact_path(WrittenConstant(), per_example_cross_entropy, *batch(), planned=False)
    assert counted.refused > 0 and counted.stitched == 0
    assert counted.one_by_one > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine: the GPU check did not run")
def test_a_chain_on_the_gpu_is_pulled_back_as_one_graph_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on a CUDA device (float64): the graph's check of its numbers there is one read by the host, and the
    batched backward is torch.func's on CUDA tensors."""
    counted = Counted(monkeypatch)
    torch.manual_seed(0)
    x, y = batch()
    assert_exact_without_the_exact_path(
        Householder().cuda(), per_example_cross_entropy, x.cuda(), y.cuda(), planned=False
    )
    assert counted.stitched > 0 and counted.refused == 0 and counted.one_by_one == 0
