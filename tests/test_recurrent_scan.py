"""The recurrence as one operation (dpml.train.rules.recurrent_scan): its forward pass equals the step-by-step cells of
dpml.train.rules.recurrent, its hand-written backward pass equals autograd's through them and finite differences
(every kind, padded and packed steps, forward and reversed, with and without biases), and a recorded LSTM, GRU or RNN
layer is two recorded operations whatever its length, not T steps of a dozen. Every test runs twice: with the LSTM's
compiled step (dpml.train.rules.scan_steps) and with torch's operations in its place."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from test_op_rules import assert_exact_without_the_exact_path
from test_recurrent_rules import Recurrent, ragged_tokens, tokens
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils._python_dispatch import TorchDispatchMode

from dpml.train.clipping import engine_pass
from dpml.train.clipping_check import ClippingUnsupported, plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy
from dpml.train.rules.recorder import Recorder
from dpml.train.rules.recurrent import STEPS
from dpml.train.rules.recurrent_scan import KINDS, scan, step_rows
from dpml.train import kernels
from dpml.train.rules import scan_steps
from dpml.train.rules.registry import function_name

SIZES = {"padded": (3, 3, 3, 3), "packed": (4, 3, 3, 1), "one step": (2,)}


@pytest.fixture(params=["compiled step", "torch's operations"], autouse=True)
def fused_steps(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, str], int]:
    """The LSTM's and the GRU's steps by the compiled kernels (skipped where no C compiler builds them) or by torch's
    operations; the kernels' steps counted by (kind, direction)."""
    counted = {(kind, way): 0 for kind in ("lstm", "gru") for way in ("forward", "backward")}
    if request.param == "torch's operations":
        monkeypatch.setattr(scan_steps, "compiled_scan_steps", lambda: None)
    elif kernels.c_compiler() is None:
        pytest.skip("no C compiler here: the compiled LSTM and GRU steps are not built (torch's operations are tested)")
    else:
        assert scan_steps.compiled_scan_steps() is not None, (
            "the C compiler failed on _scan_steps.c, or it did not load"
        )
    for kind, steps in (("lstm", scan_steps.FusedLstmSteps), ("gru", scan_steps.FusedGruSteps)):
        for way in ("forward", "backward"):
            original = getattr(steps, way)

            def counting(self, *args, key=(kind, way), original=original):  # type: ignore[no-untyped-def]
                counted[key] += 1
                return original(self, *args)

            monkeypatch.setattr(steps, way, counting)
    return counted


GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}  # the gates of each kind, side by side in x̃


def _operands(kind: str, sizes: tuple[int, ...], bias: bool, seed: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    width, rows = 3, sum(sizes)
    gates = GATES[kind] * width

    def draw(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * 0.8).requires_grad_()

    return [
        draw(rows, gates),
        draw(sizes[0], width),
        draw(sizes[0], width) if kind == "lstm" else None,
        draw(gates, width),
        draw(gates) if bias else None,
    ]


def _stepwise(kind: str, sizes, reverse: bool, gates_in, h0, c0, w_hh, b_hh):  # noqa: ANN001, ANN202
    """The same recurrence by the cells of dpml.train.rules.recurrent, one step at a time, by autograd: each row's h
    (and c) after its step."""
    starts = list(itertools.accumulate(sizes[:-1], initial=0))
    h = [None] * sum(sizes)
    c = [None] * sum(sizes)
    state = [h0[s] for s in range(sizes[0])], [c0[s] for s in range(sizes[0])] if c0 is not None else None
    for t in range(len(sizes) - 1, -1, -1) if reverse else range(len(sizes)):
        n = sizes[t]
        hs = torch.stack(state[0][:n])
        before = (torch.stack(state[0][:n]),) if c0 is None else (hs, torch.stack(state[1][:n]))
        after = STEPS[kind](gates_in[starts[t] : starts[t] + n], before, w_hh, b_hh, None)
        for s in range(n):
            h[starts[t] + s] = after[0][s]
            state[0][s] = after[0][s]
            if c0 is not None:
                c[starts[t] + s] = after[1][s]
                state[1][s] = after[1][s]
    return torch.stack(h), (torch.stack(c) if c0 is not None else None)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("layout", list(SIZES))
@pytest.mark.parametrize("kind", KINDS)
def test_the_scan_is_the_cells_step_by_step_forward_and_backward(kind: str, layout: str, reverse: bool) -> None:
    sizes = SIZES[layout]
    operands = _operands(kind, sizes, bias=True, seed=len(kind) + 7 * len(layout))
    h, c, h_prev, r = scan(kind, operands[0], sizes, operands[1], operands[2], operands[3], operands[4], reverse)
    h_ref, c_ref = _stepwise(kind, sizes, reverse, *operands)
    torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-14)
    entering = torch.cat([h_ref, operands[1]]).index_select(0, step_rows(sizes, reverse)[1])
    torch.testing.assert_close(h_prev, entering.detach(), rtol=1e-12, atol=1e-14)
    g = torch.Generator().manual_seed(3)
    weights = torch.randn(h.shape, generator=g, dtype=torch.float64)
    c_weights = torch.randn(h.shape, generator=g, dtype=torch.float64)
    loss = (h * weights).sum() + ((c * c_weights).sum() if c is not None else 0)
    loss_ref = (h_ref * weights).sum() + ((c_ref * c_weights).sum() if c_ref is not None else 0)
    inputs = [t for t in operands if t is not None]
    for found, expected in zip(torch.autograd.grad(loss, inputs), torch.autograd.grad(loss_ref, inputs), strict=True):
        torch.testing.assert_close(found, expected, rtol=1e-10, atol=1e-12)
    if kind == "gru":  # the r gate, read by the rule: σ(x̃_r + q_r)
        q = F.linear(h_prev, operands[3], operands[4])
        torch.testing.assert_close(r, torch.sigmoid(operands[0][:, :3] + q[:, :3]).detach())
    else:
        assert r is None


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_step_in_float32_is_the_float64_step_to_float32s_rounding(
    kind: str, layout: str, fused_steps: dict[tuple[str, str], int]
) -> None:
    """The scan in float32 (the compiled steps' other kind: the tests above run float64), outputs and every operand's
    gradient, against the same scan in float64, the loss reading h alone (autograd's gradient of a sum, one row
    expanded) and h and c with weights; the compiled steps run once per step each way where they are built."""
    sizes = SIZES[layout]
    wide = _operands(kind, sizes, bias=True, seed=11)
    narrow = [None if t is None else t.detach().float().requires_grad_() for t in wide]
    g = torch.Generator().manual_seed(4)
    weights, c_weights = (torch.randn(sum(sizes), 3, generator=g, dtype=torch.float64) for _ in range(2))

    def run(operands: list[torch.Tensor | None], weighted: bool) -> list[torch.Tensor]:
        h, c, _, _ = scan(kind, operands[0], sizes, operands[1], operands[2], operands[3], operands[4], False)
        loss = (h * weights.to(h.dtype)).sum() + (0 if c is None else (c * c_weights.to(c.dtype)).sum())
        loss = loss if weighted else h.sum()
        states = [h.detach()] + ([] if c is None else [c.detach()])
        return [*states, *torch.autograd.grad(loss, [t for t in operands if t is not None])]

    for weighted in (True, False):
        expected = run(wide, weighted)
        before = dict(fused_steps)
        found = run(narrow, weighted)
        for a, b in zip(found, expected, strict=True):
            torch.testing.assert_close(a.double(), b, rtol=2e-6, atol=2e-6)
        built = scan_steps.compiled_scan_steps() is not None
        for way in ("forward", "backward"):
            assert fused_steps[(kind, way)] - before[(kind, way)] == (len(sizes) if built else 0), way


@pytest.mark.parametrize("kind", KINDS)
def test_the_scan_backward_against_finite_differences(kind: str) -> None:
    """gradcheck of every operand, biases absent, packed steps reversed (sequences join from their initial states)."""
    sizes = (3, 2, 2, 1)
    operands = _operands(kind, sizes, bias=False, seed=1)

    def outputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        found = scan(
            kind, tensors[0], sizes, tensors[1], tensors[2] if kind == "lstm" else None, tensors[-1], None, True
        )
        return tuple(t for t in found[:2] if t is not None)

    assert torch.autograd.gradcheck(outputs, tuple(t for t in operands if t is not None))


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN])
def test_a_recorded_recurrent_layer_is_two_operations_whatever_its_length(
    cell: type[nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each layer and direction: its input product (F.linear) and one scan, so the recording hands its rules as many
    calls for 40 steps as for 4 (stepping through the cells would hand them one W_hh product per step)."""
    handed: list[str] = []
    apply = Recorder._apply

    def seen(self, func, *args):  # noqa: ANN001, ANN002, ANN202
        handed.append(function_name(func))
        return apply(self, func, *args)

    monkeypatch.setattr(Recorder, "_apply", seen)
    counts = []
    for length in (4, 40):
        torch.manual_seed(2)
        model = Recurrent(cell(5, 4, num_layers=2, bidirectional=True)).double()
        x, y = tokens(3, length, 5)
        handed.clear()
        found = engine_pass(model, per_example_cross_entropy, x, y)
        assert found.exact == {}, found.reasons
        assert handed.count("dpml.train.rules.recurrent_scan.scan") == 4, handed
        assert handed.count("F.linear") == 4 + 1, handed  # the input products, the head
        counts.append(len(handed))
    assert counts[0] == counts[1]


class PackedFromState(nn.Module):
    """Packed sequences (unsorted lengths) through a GRU whose initial state is computed from each example's tokens:
    nn.GRU sorts the state's rows with the sequences, so row s of the scan's initial state is sequence s's example."""

    def __init__(self, swap: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 5)
        self.start = nn.Linear(5, 4)
        self.rnn = nn.GRU(5, 4, batch_first=True)
        self.head = nn.Linear(4, 3)
        self.swap = swap

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h0 = torch.tanh(self.start(h.mean(1)))
        if self.swap:  # another example's state: rows no longer the sequences' examples
            h0 = h0.roll(1, 0)
        lengths = (ids != 0).sum(1).clamp(min=1).cpu()
        _, final = self.rnn(pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False), h0[None])
        return self.head(final[-1])


def test_an_initial_state_from_the_batch_with_packed_unsorted_sequences() -> None:
    torch.manual_seed(12)
    x, y = ragged_tokens(6, 7, 19)
    assert_exact_without_the_exact_path(PackedFromState(), per_example_cross_entropy, x, y, planned=False)


def test_an_initial_state_of_other_examples_is_refused() -> None:
    """An initial state whose row s comes from another example than sequence s: the scan's rule refuses, naming why
    (W_hh and b_hh would take the exact path), and the plan refuses the model, which mixes the batch's examples."""
    torch.manual_seed(12)
    x, y = ragged_tokens(6, 7, 19)
    model = PackedFromState(swap=True).double()
    found = engine_pass(model, per_example_cross_entropy, x, y)
    assert set(found.exact) == {"rnn.weight_hh_l0", "rnn.bias_hh_l0"}, found.reasons
    assert "an initial state whose rows are not the examples of its sequences" in found.reasons["rnn.weight_hh_l0"]
    with pytest.raises(ClippingUnsupported, match="mixes the examples"):
        plan_clipping(model, per_example_cross_entropy, tuple(x.shape[1:]), x.dtype, probe=(x, y))


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_an_lstm_with_a_projection_scans_as_its_cells_step(layout: str, reverse: bool) -> None:
    """proj_size: the states passed on are W_hr h (P = 2 of H = 3), the scan's h rows those before the projection;
    projected as the decomposition projects them (one product after the scan), the outputs, the cell states and
    every operand's gradient (W_hr's included) equal the cells' step by step."""
    sizes = SIZES[layout]
    g = torch.Generator().manual_seed(5)

    def draw(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * 0.8).requires_grad_()

    gates_in, h0, c0 = draw(sum(sizes), 12), draw(sizes[0], 2), draw(sizes[0], 3)
    w_hh, b_hh, w_hr = draw(12, 2), draw(12), draw(2, 3)
    h, c, h_prev, _ = scan("lstm", gates_in, sizes, h0, c0, w_hh, b_hh, reverse, w_hr)
    out = F.linear(h, w_hr)
    step = STEPS["lstm"]
    starts = list(itertools.accumulate(sizes[:-1], initial=0))
    state_h, state_c = list(h0), list(c0)
    ref_h, ref_c = [None] * sum(sizes), [None] * sum(sizes)
    for t in range(len(sizes) - 1, -1, -1) if reverse else range(len(sizes)):
        n = sizes[t]
        after = step(
            gates_in[starts[t] : starts[t] + n], (torch.stack(state_h[:n]), torch.stack(state_c[:n])), w_hh, b_hh, w_hr
        )
        for s in range(n):
            ref_h[starts[t] + s], ref_c[starts[t] + s] = after[0][s], after[1][s]
            state_h[s], state_c[s] = after[0][s], after[1][s]
    ref_out, ref_cells = torch.stack(ref_h), torch.stack(ref_c)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(c, ref_cells, rtol=1e-12, atol=1e-14)
    entering = torch.cat([ref_out, h0]).index_select(0, step_rows(sizes, reverse)[1])
    torch.testing.assert_close(h_prev, entering.detach(), rtol=1e-12, atol=1e-14)
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64)
    inputs = [gates_in, h0, c0, w_hh, b_hh, w_hr]
    found = torch.autograd.grad((out * weights).sum() + (c * c).sum(), inputs)
    expected = torch.autograd.grad((ref_out * weights).sum() + (ref_cells * ref_cells).sum(), inputs)
    for name, a, b in zip(["x̃", "h0", "c0", "W_hh", "b_hh", "W_hr"], found, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)

    def projected(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows, cells, _, _ = scan(
            "lstm", tensors[0], sizes, tensors[1], tensors[2], tensors[3], None, reverse, tensors[4]
        )
        return rows, cells

    assert torch.autograd.gradcheck(projected, (gates_in, h0, c0, w_hh, w_hr))


@pytest.mark.parametrize("kind", KINDS)
def test_input_terms_in_bfloat16_run_the_recurrence_in_float32(kind: str) -> None:
    """Under autocast the input product's x̃ is bfloat16: the scan runs in float32 (its outputs, cast back to bfloat16,
    equal float32's on the same bfloat16 inputs, so no rounding adds up over the steps), and its gradients come back
    in each operand's own dtype (x̃'s bfloat16, the weights' and states' float32), equal to float32's within bfloat16's
    resolution."""
    sizes = (3, 3, 2, 2, 1)
    operands = _operands(kind, sizes, bias=True, seed=4)
    half = operands[0].detach().to(torch.bfloat16).requires_grad_()
    rest = [None if t is None else t.detach().float().requires_grad_() for t in operands[1:]]
    full = half.detach().float().requires_grad_()
    found = scan(kind, half, sizes, rest[0], rest[1], rest[2], rest[3], False)
    expected = scan(kind, full, sizes, rest[0], rest[1], rest[2], rest[3], False)
    assert found[0].dtype == torch.bfloat16
    torch.testing.assert_close(found[0], expected[0].to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(found[2], expected[2], rtol=0, atol=0)  # h_prev, for the rule, in float32
    inputs = [half] + [t for t in rest if t is not None]
    grads = torch.autograd.grad(found[0].float().sum(), inputs)
    reference = torch.autograd.grad(expected[0].sum(), [full] + [t for t in rest if t is not None])
    assert grads[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads[1:])
    for g, r in zip(grads, reference, strict=True):
        torch.testing.assert_close(g.float(), r, rtol=2e-2, atol=2e-2)


class _WeightProducts(TorchDispatchMode):
    """Counts the products dispatched whose result has a weight's shape (the batch gradient Σ_rows δ h_prevᵀ)."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape == self.shape:
            self.count += 1
        return out


@pytest.mark.parametrize("kind", KINDS)
def test_the_backward_forms_a_weights_gradient_only_where_the_pass_asks_for_it(kind: str) -> None:
    """The engine's pass asks autograd for the gradient of x̃ (a recorded output) only: W_hh's batch gradient, a
    product as large as the input product's, is not formed there (W_hh's gradient comes from the rule). Asked for by
    ``backward()`` (into ``.grad``) or by ``torch.autograd.grad`` of W_hh itself, it is formed and equals the cells'."""
    sizes = SIZES["packed"]
    operands = _operands(kind, sizes, bias=True, seed=5)
    gates_in = operands[0] * 1  # a layer's input terms come from its input product: not a leaf
    weights = torch.randn(sum(sizes), 3, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    h = scan(kind, gates_in, sizes, *operands[1:], False)[0]
    with _WeightProducts(operands[3].shape) as products:
        (found,) = torch.autograd.grad((h * weights).sum(), [gates_in], retain_graph=True)
    assert products.count == 0
    h_ref = _stepwise(kind, sizes, False, gates_in, *operands[1:])[0]
    expected = torch.autograd.grad((h_ref * weights).sum(), [gates_in, operands[3]], retain_graph=True)
    torch.testing.assert_close(found, expected[0], rtol=1e-10, atol=1e-12)
    with _WeightProducts(operands[3].shape) as products:
        (asked,) = torch.autograd.grad((h * weights).sum(), [operands[3]], retain_graph=True)
    assert products.count == 1
    torch.testing.assert_close(asked, expected[1], rtol=1e-10, atol=1e-12)
    (h * weights).sum().backward()
    torch.testing.assert_close(operands[3].grad, expected[1], rtol=1e-10, atol=1e-12)
