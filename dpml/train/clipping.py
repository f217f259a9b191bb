"""Per-example clipped gradient sums: Σ_i clip_C(∇_θ ℓ(θ; x_i, y_i)), clip_C(g) = g·min(1, C/‖g‖).

One forward pass records every *fast* layer's calls (forward hooks on their input and output) and,
through a ``TorchFunctionMode`` (:mod:`dpml.train.rules`), every torch operation a trainable parameter
enters; the per-example losses ℓ_i then give two things by backpropagation:

- the output gradients δ_{i,t} = ∂ℓ_i/∂z_{i,t} of the fast layers and of the recorded operations (one backward pass of
  Σ_j ℓ_j: ℓ_i depends on example i's rows only, so ∂(Σ_j ℓ_j)/∂z_i = ∂ℓ_i/∂z_i), from which each layer's per-example
  gradient norms and clipped sums follow in closed form (:mod:`dpml.train.clipping_layers`; formed as the backward
  pass reaches each layer, so that what a layer's piece no longer reads is freed then, :mod:`.streamed`), and each other
  parameter's from the rules of the operations it enters — a linear map (``F.linear``, ``torch.addmm``, a matmul on
  either side, of the parameter or a view of it), an embedding lookup (indices per example or shared by the batch), a
  normalisation's affine, an elementwise affine or a concatenation broadcast over the batch —, its uses added up with
  their cross terms (a tied embedding: ‖Σ_u G_u‖², :mod:`dpml.train.rules.combine`); a weight computed from parameters
  alone (a parametrization W = g(W₀)) gets its uses' per-example gradients pulled back through that computation's
  Jacobian, ∇_{W₀} ℓ_i = (∂W/∂W₀)ᵀ ∇_W ℓ_i (:mod:`dpml.train.rules.derived`), also where the computation is a custom
  autograd Function's, through its own backward (:mod:`dpml.train.rules.custom_functions`);
- the **exact** per-example gradients ∇_p ℓ_i of every other trainable parameter p (an operation with no rule, a
  custom autograd Function called with the batch and a parameter), by backpropagating the B rows of the identity
  through the same graph at once (``autograd.grad(..., is_grads_batched=True)``, i.e. a vmap over the backward pass; a
  plain loop over examples where an operator has no batching rule).

Their squared norms add up to ‖∇ℓ_i‖², the clip factor is c_i = min(1, C/(‖∇ℓ_i‖ + 1e-6)), so
‖c_i ∇ℓ_i‖ < C strictly (the 1e-6 guards rounding and ∇ℓ_i = 0): the sum's sensitivity is C.

A fast layer's hook is used only when every operation on its parameters ran inside its own calls and
its inputs are batch-first and computed from the batch (or, for a layer that treats every other dimension
as positions, hold each example's slices in one run, as Swin's windows (B·windows, …) do); otherwise (tied
weights, weights used by another module as ``nn.MultiheadAttention`` uses ``out_proj``'s, position ids shared
by the batch) its parameters go to the rules. The pre-flight probe (:mod:`dpml.train.clipping_check`) checks
every layer's and every ruled parameter's numbers against autograd and names in ``exact`` those that differ (a use
no operation shows, such as inside a custom autograd Function). A recorded output changed in
place later in the forward pass (``ReLU(inplace=True)``) would no longer be the point where δ is
taken: the forward is then run again (with the same random state, so dropout draws the same
masks) with the hooks and rules handing on copies of the outputs.

BatchNorm is refused: its batch statistics make each example's output depend on the whole batch,
so per-example clipping would not bound one example's influence (use GroupNorm or LayerNorm).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from dpml.devices import (
    HostGenerators,
    RngState,
    full_float32,
    host_generators_state,
    rng_state_to_replay,
    set_host_generators_state,
    set_rng_state,
)
from dpml.models.batch_norm import reject_batch_norm
from dpml.train.clipping_candidates import Call, fast_candidates, shortcut_input, usable
from dpml.train.clipping_layers import Piece, layer_parameters
from dpml.train.clipping_norms import shared_grams
from dpml.train.diracs import DiracGradients
from dpml.train.engine_units import EnginePass, RuleUnit, Unit
from dpml.train.exact_path import PlannedExact, exact_per_example_gradients, say_unplanned_exact, unreached_parameters
from dpml.train.keep_budget import keep_limit, pass_budget
from dpml.train.nonfinite import refuse_non_finite_parameters, say_left_out
from dpml.train.released import Targets
from dpml.train.streamed import layer_pieces
from dpml.train.rules import Recorder, Use, cast_form, custom_functions_seen_by, parameter_piece
from dpml.train.rules.pull_backs import pull_back_all
from dpml.train.rules.row_jacobian import row_map_pieces
from dpml.train.rules.scattered_rows import scattered_row_uses
from dpml.train.rules.standardised import standardised_pieces
from dpml.train.rules.outputs import LetGo, Recorded, RecordedOutputs
from dpml.train.rules.ragged import Ragged
from dpml.train.rules.flat_indices import counting_for

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, y) -> per-example losses


def clip_factors(norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
    return torch.clamp(clip_norm / (norms + 1e-6), max=1.0)


@dataclass
class _Recording:
    """One forward pass with every call of the hooked layers and every operation on a parameter recorded."""

    losses: torch.Tensor
    calls: dict[nn.Module, list[Call]]
    recorder: Recorder
    overwritten: frozenset[tuple[str, int]]  # the recorded views modified in place after they were made
    kept: RecordedOutputs  # the hooked calls' outputs

    def gradient_target(self, output: Recorded) -> torch.Tensor | GradientEdge:
        """What to ask autograd for a recorded output's δ: its edge as it was kept, else the tensor."""
        if isinstance(output, LetGo):
            return output.edge
        return self.kept.edge(output) or self.recorder.kept.edge(output) or output

    def let_go(self) -> None:
        """Drop every reference to the recorded outputs (:mod:`dpml.train.released`): the layers' inputs stay."""
        self.calls.clear()
        self.kept = RecordedOutputs()
        self.recorder.let_go()


def per_example_losses(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """ℓ_i for the batch, checked to be one loss per example (shape (B,))."""
    losses = loss_fn(model(x), y)
    if losses.shape != (x.shape[0],):
        raise ValueError(
            f"the loss function must return one loss per example, shape ({x.shape[0]},); "
            f"got shape {tuple(losses.shape)} (use reduction='none')"
        )
    return losses


def _record_forward(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    layers: list[nn.Module],
    ruled: list[nn.Parameter],
    copies: frozenset[tuple[str, int]] | None,
    constant_reads: Mapping[int, int] | None = None,
    trusted: Collection[nn.Module] = (),
) -> _Recording:
    """Per-example losses, with forward hooks on ``layers`` and the operations on the parameters ``ruled``
    recorded (:class:`dpml.train.rules.Recorder`), each output kept with its gradient edge
    (:mod:`dpml.train.rules.outputs`). A view's edge does not survive an in-place rewrite, so the hooks and the
    rules pass a copy of the outputs named in ``copies`` on (``("layer", k)``: the k-th hooked call's output;
    ``("rule", j)``: the j-th ruled call's; None: every output), and the recording says which recorded views
    were modified in place all the same. The ``trusted`` layers' calls on their own parameters run without their
    rules (:mod:`dpml.train.rules.recorder`)."""
    calls: dict[nn.Module, list[Call]] = {}
    kept = RecordedOutputs()  # the hooked calls' outputs
    owners = {id(p): m for m in layers for p in layer_parameters(m)}
    recorder = Recorder(
        ruled,
        x.shape[0],
        None if copies is None else {j for kind, j in copies if kind == "rule"},
        owners,
        x.device,
        x,
        constant_reads,
        trusted,
    )

    def enter(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        recorder.stack.append(module)

    def remember(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor | None:
        recorder.stack.pop()
        with torch._C.DisableTorchFunction():  # bookkeeping, not the model's computation: not recorded
            taken = shortcut_input(module, inputs[0], recorder)
            if taken is None:
                recorder.unbatched.add(module)
            place = kept.keep(output, let_go=True)  # (not held: its edge stands for it)
            calls.setdefault(module, []).append(
                ((inputs[0] if taken is None else taken).detach(), kept.recorded(place))
            )
        return output.clone() if copies is None or ("layer", place) in copies else None  # (the copy is recorded)

    handles = [m.register_forward_pre_hook(enter) for m in layers] + [m.register_forward_hook(remember) for m in layers]
    try:
        with recorder, custom_functions_seen_by(recorder), counting_for(model):
            losses = per_example_losses(model, loss_fn, x, y)
    finally:
        for handle in handles:
            handle.remove()
    hooked = {id(output) for output, _ in kept.versions}  # a ruled output that is a layer's: the layer's copy suffices
    overwritten = {("layer", k) for k in kept.rewritten_views()}
    overwritten |= {recorder.place_key(j) for j, t in recorder.kept.rewritten_views().items() if id(t) not in hooked}
    return _Recording(losses, calls, recorder, frozenset(overwritten), kept)


# The recorded views a model's forward pass modified in place (:meth:`RecordedOutputs.rewritten_views`), a hooked
# call's by its place, a ruled call's by its number (:meth:`Recorder.place_key`): its later passes copy those from the
# start instead of running the forward pass again with a copy of every output.
_OVERWRITTEN_OUTPUTS: weakref.WeakKeyDictionary[nn.Module, frozenset[tuple[str, int]]] = weakref.WeakKeyDictionary()
# The hooked layers whose shortcut a model's last pass took: its next pass records their own calls without rules.
_TRUSTED_LAYERS: weakref.WeakKeyDictionary[nn.Module, frozenset[nn.Module]] = weakref.WeakKeyDictionary()


def _usable_layers(recording: _Recording, candidates: list[nn.Module], batch: int) -> list[nn.Module]:
    """The hooked layers that take their shortcut: called, on batch-first inputs computed from the batch, their
    parameters used in no other call."""
    recorder = recording.recorder
    return [
        m
        for m in candidates
        if m in recording.calls
        and usable(m, recording.calls[m], batch)
        and not any(id(p) in recorder.outside for p in layer_parameters(m))
        and m not in recorder.unbatched
    ]


def _finished_uses(
    called: list[str], finished: list[list[Use]], ruled: dict[int, str], relevant: set[int], dtype: torch.dtype
) -> tuple[dict[int, list[Use]], dict[int, list[str]], dict[int, nn.Parameter]]:
    """The uses of the ``relevant`` parameters and computations (each ruled call's, its operation among ``called``,
    formed in the backward pass: :func:`dpml.train.streamed.layer_pieces`), the operations they came from and the
    parameters."""
    uses: dict[int, list[Use]] = {key: [] for key in relevant}
    operations: dict[int, list[str]] = {key: [] for key in relevant}
    params: dict[int, nn.Parameter] = {}
    for operation, found in zip(called, finished, strict=True):
        for tracked, form in found:
            key = id(tracked.param)
            if key in relevant:
                form = cast_form(form, dtype)  # (packed ragged rows: padded for a computation's pull-back)
                uses[key].append((tracked, form.padded() if isinstance(form, Ragged) and key not in ruled else form))
                params[key] = tracked.param
                operations[key].append(operation)
    finished.clear()
    return uses, operations, params


def _rule_pieces(
    recording: _Recording,
    called: list[str],
    finished: list[list[Use]],
    ruled: dict[int, str],
    relevant: set[int],
    batch: int,
    dtype: torch.dtype,
    limit: int,
) -> tuple[list[tuple[Unit, Piece]], dict[int, str]]:
    """The ruled parameters' pieces from their uses (``relevant``: their ids and those of the computations on
    them, :class:`dpml.train.rules.registry.Derived`, whose uses are pulled back to theirs first); a parameter
    whose uses cannot be combined, with why. Each parameter's uses are dropped once its piece is formed: what a piece
    does not read is let go (:func:`.rules.combine.letting_go`)."""
    if not relevant:  # (nothing ruled: every parameter a hooked layer's, or exact)
        return [], {}
    uses, operations, params = _finished_uses(called, finished, ruled, relevant, dtype)
    nodes = recording.recorder.computations.nodes
    standardised = standardised_pieces(nodes, uses, ruled, params)  # {id(W): (steps, piece)}: W standardised first
    standardised |= row_map_pieces(nodes, uses, ruled, params, standardised.keys())
    done = relevant - {id(node.output) for steps, _ in standardised.values() for node in steps}
    done -= scattered_row_uses(nodes, uses, done, params)  # (rows of a frozen table replaced by a parameter's)
    pulled, failed, recomputed = pull_back_all(nodes, uses, done, batch, dtype, limit, params)
    failed = {key: reason for key, reason in failed.items() if key in ruled}
    for node in reversed(nodes):  # later ones first, as the pull-back
        for _, tracked in node.sources:
            if id(node.output) in relevant and id(tracked.param) in relevant:
                operations[id(tracked.param)] += operations[id(node.output)] + [node.operation]
    for tracked, form in pulled:
        uses[id(tracked.param)].append((tracked, form))
        params[id(tracked.param)] = tracked.param
    ready = {key: piece for key, (_, piece) in standardised.items()} | recomputed
    pieces: list[tuple[Unit, Piece]] = []
    for key, name in ruled.items():
        if key in failed:
            continue
        piece = ready[key] if key in ready else parameter_piece(params[key], uses.pop(key), batch, limit)
        if isinstance(piece, str):
            failed[key] = piece
        else:
            pieces.append((RuleUnit(name, params[key], tuple(dict.fromkeys(operations[key]))), piece))
    return pieces, failed


def engine_pass(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    exact: Collection[str] = (),
    autocast: torch.dtype | None = None,
    any_constant_reads: bool = False,
) -> EnginePass:
    """Record the forward pass and take each trainable parameter's per-example gradient by its layer's shortcut, by the
    rules of the operations it enters (:mod:`dpml.train.rules`) or, for the parameters named in ``exact`` and any
    neither covers, exactly.

    A hooked layer's shortcut is used when every operation on its parameters ran inside its own (batch-first) calls,
    else its parameters go to the rules; kept per-example gradients are bounded per pass (:mod:`.keep_budget`).

    ``autocast`` (``torch.bfloat16``): the forward pass runs under ``torch.autocast``; the recorded bf16 activations
    and output gradients are cast back to the parameters' dtype before any norm or sum, so each example's norm and
    its clipped contribution come from one gradient, in float32 (the noise too): ‖c_i g_i‖ < C.

    A rule may read a constant operand's dimension as the batch's only as the plan's probe confirmed
    (:class:`PlannedExact`), or, on the probe itself (``any_constant_reads``), wherever it finds one."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    names = {id(p): n for n, p in params.items()}
    reads = dict(exact.constant_reads) if isinstance(exact, PlannedExact) else {}
    constant_reads = None if any_constant_reads else {id(params[n]): d for n, d in reads.items() if n in params}
    batch = x.shape[0]
    zeros = torch.zeros(batch, device=x.device, dtype=engine_dtype(model, params.values()))
    if batch == 0:
        return EnginePass(0, [], {n: p.new_zeros((0, *p.shape)) for n, p in params.items()}, names, zeros)
    candidates = fast_candidates(model, names, exact)
    watched = [p for n, p in params.items() if n not in exact]
    state = rng_state_to_replay(x.device)  # (None inside a CUDA graph's capture)
    first = model not in _OVERWRITTEN_OUTPUTS  # (NumPy's and Python's generators are slow to read: first passes only)
    host = host_generators_state() if first else None
    trusted = _TRUSTED_LAYERS.get(model, frozenset())
    with _precision(x.device, autocast):
        copies = _OVERWRITTEN_OUTPUTS.get(model, frozenset())  # learnt from earlier passes: one forward pass
        recording = _record_forward(model, loss_fn, x, y, candidates, watched, copies, constant_reads, trusted)
        if first or recording.overwritten:  # (a model's first pass marks it seen, even with nothing overwritten)
            _OVERWRITTEN_OUTPUTS[model] = copies | recording.overwritten
        if recording.overwritten:  # (a first pass, or one that goes another way than the earlier ones)
            _replay_draws(state, host, x.device)  # the same dropout masks in the forward pass that counts
            recording = _record_forward(model, loss_fn, x, y, candidates, watched, None, constant_reads, trusted)
        used = _usable_layers(recording, candidates, batch)
        if recording.recorder.unrecorded.difference(used):  # a trusted layer's shortcut did not apply: its rules
            _replay_draws(state, host, x.device)
            recording = _record_forward(model, loss_fn, x, y, candidates, watched, None, constant_reads)
            used = _usable_layers(recording, candidates, batch)
    _TRUSTED_LAYERS[model] = frozenset(used)
    recorder = recording.recorder
    constants_read = {names[key]: dim for key, dim in recorder.constants_read.items() if key in names}
    covered = {id(p) for m in used for p in layer_parameters(m)}
    seen = {id(p) for pending in recorder.pending for p in pending.params}
    seen |= {id(p) for node in recorder.computations.nodes for p in node.params}
    ruled = {
        id(p): n
        for n, p in params.items()
        if id(p) not in covered and n not in exact and id(p) in seen and id(p) not in recorder.refused
    }
    relevant = set(ruled) | {
        id(node.output) for node in recorder.computations.nodes if any(id(p) in ruled for p in node.params)
    }
    targets = Targets()  # the recorded outputs let go before the backward pass (:mod:`dpml.train.released`)
    layer_calls = {m: [(a, targets.slot(o, recording.gradient_target(o))) for a, o in recording.calls[m]] for m in used}
    ruled_calls = [
        targets.ruled(pending, recording.gradient_target(pending.output))
        for pending in recorder.pending
        if any(id(p) in relevant for p in pending.params)
    ]
    recording.let_go()
    held = targets.numbers() + sum(a.numel() for calls in layer_calls.values() for a, _ in calls)  # δ and inputs
    slow = {n: p for n, p in params.items() if id(p) not in covered and id(p) not in ruled}
    fast: list[tuple[Unit, Piece]] = []
    for name in unreached_parameters(recording.losses, slow):  # ∇_p ℓ_i = 0 for every i: nothing to take exactly
        fast.append((RuleUnit(name, slow[name], (UNUSED,)), _zero_piece(slow.pop(name), zeros)))
    called = [call.operation for call in ruled_calls]
    with pass_budget(x.device, held), shared_grams():  # norms and sums from the same numbers (no TF32)
        layers, finished = layer_pieces(
            targets.edges, layer_calls, ruled_calls, recording.losses, bool(slow), zeros.dtype
        )
        fast += layers
        with full_float32():
            pieces, failed = _rule_pieces(
                recording, called, finished, ruled, relevant, batch, zeros.dtype, keep_limit(x.device)
            )
    fast += pieces
    reasons = {n: recorder.why_exact(p, n, exact) for n, p in slow.items()}
    per_example = exact_per_example_gradients(recording.losses, slow)
    if failed:  # ruled parameters whose uses did not combine: exactly, from the forward pass again (its graph is freed)
        reasons.update({ruled[key]: reason for key, reason in failed.items()})
        _replay_draws(state, host, x.device)  # the same dropout masks
        with _precision(x.device, autocast):
            per_example.update(per_example_gradients(model, loss_fn, x, y, [ruled[key] for key in failed]))
    return EnginePass(batch, fast, per_example, names, zeros, reasons, constants_read)


def engine_dtype(model: nn.Module, trainable: Iterable[torch.Tensor] | None = None) -> torch.dtype:
    """The dtype of a pass's per-example norms and of the clip factors its sums take: the widest of the trainable
    parameters' (whatever dtype the loss comes in: a model may return float32 logits from float64 parameters; and a
    frozen low-precision body before float32 adapters does not narrow them), else the first parameter's.
    ``trainable``: the model's trainable parameters, where the caller holds them already (a pass: no second walk)."""
    widest = None
    for p in model.parameters() if trainable is None else trainable:
        if p.requires_grad and p.is_floating_point() and (widest is None or p.element_size() > widest.itemsize):
            widest = p.dtype
    return widest if widest is not None else next(model.parameters()).dtype


def _replay_draws(state: RngState | None, host: HostGenerators | None, device: torch.device) -> None:
    """The generators as a pass found them, for its forward pass run again to draw what it drew: torch's, and on a
    model's first pass (whose forward pass runs twice where it writes a recorded output in place, as the probe's
    check makes every pass a first one) NumPy's and Python's too. Not inside a CUDA graph's capture (no state)."""
    if state is None:
        raise RuntimeError("a pass captured into a CUDA graph cannot run its forward pass again")
    set_rng_state(state, device)
    if host is not None:
        set_host_generators_state(host)


UNUSED = "not reached by this batch's loss"


def _precision(device: torch.device, autocast: torch.dtype | None) -> contextlib.AbstractContextManager[object]:
    """The forward pass's precision: ``torch.autocast`` to ``autocast``, or switched off (an outer autocast of the
    caller's does not reach the engine); nothing to switch off where no autocast is on (or known: ``meta``)."""
    if autocast is None and not (
        torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)
    ):  # (nothing to switch on or off)
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None)


def _zero_piece(param: nn.Parameter, zeros: torch.Tensor) -> Piece:
    """The piece of a parameter the loss does not reach: ‖∇_p ℓ_i‖² = 0 and Σ_i c_i ∇_p ℓ_i = 0."""
    return Piece(zeros, lambda factors: [(param, torch.zeros_like(param))])


def per_example_gradients(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, names: list[str]
) -> dict[str, torch.Tensor]:
    """Exact per-example gradients ∇_p ℓ_i (B, *p.shape) of the named parameters (one forward pass)."""
    params = dict(model.named_parameters())
    losses = per_example_losses(model, loss_fn, x, y)
    return {n: g.detach() for n, g in exact_per_example_gradients(losses, {n: params[n] for n in names}).items()}


def clipped_gradient_sum(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    clip_norm: float,
    diracs: DiracGradients | None = None,
    exact: Collection[str] = (),
    autocast: torch.dtype | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Σ_i clip_C(g_i) per parameter name (trainable parameters only), and the unclipped norms ‖∇ℓ_i‖ of the records.

    The examples i are the records (g_i = ∇ℓ_i) and, with ``diracs``, the Dirac gradients of
    :class:`DiracGradients`; both are clipped by one factor line, c_i = min(1, C/(‖g_i‖ + 1e-6)).
    ``exact``: parameter names whose per-example gradients must be taken exactly (the plan of
    :func:`dpml.train.clipping_check.plan_clipping`). ``autocast``: see :func:`engine_pass`.

    A record whose own gradient is not finite (nan or inf: a log or division of zero, an overflow) is left out: its
    share is 0, within the sensitivity C, where c_i·g_i would put nan into every coordinate of the sum (and a nan
    model would say that the record was sampled). Only then, :func:`_without_non_finite` sums the others again; a
    backward pass over the batch at once (the exact path) multiplies one record's nan by the others' zero cotangents,
    so records of non-finite norm are taken again in halves, down to one alone, and no share depends on another
    record's values. On a CPU one host read per call (is every norm finite?); on a GPU none (the step loop never waits
    for the host): the record reaches the model, which the trainers refuse at the run's end (:mod:`.nonfinite`)."""
    reject_batch_norm(model)
    found = engine_pass(model, loss_fn, x, y, exact, autocast)
    say_unplanned_exact(model, found.reasons, exact, found.batch)
    squared = found.squared()
    records = squared.shape[0]
    if diracs is not None:
        squared = torch.cat([squared, diracs.squared_norms(squared)])
    norms = squared.sqrt()
    factors = clip_factors(norms, clip_norm)
    sums = found.sums(factors[:records], spent=True)
    if diracs is not None:
        diracs.add_clipped(sums, model, factors[records:])
    norms = norms[:records].detach()
    if norms.device.type != "cpu" or bool(torch.isfinite(norms).all()):
        return sums, norms
    return _without_non_finite(model, loss_fn, x, y, clip_norm, diracs, exact, autocast, norms)


def _without_non_finite(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    clip_norm: float,
    diracs: DiracGradients | None,
    exact: Collection[str],
    autocast: torch.dtype | None,
    norms: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """:func:`clipped_gradient_sum` again (``norms``: its first pass's) without the records whose own gradients are not
    finite: those of finite norm in one pass (with the canaries), the others in halves, each alone if need be."""
    refuse_non_finite_parameters(model)
    finite = torch.isfinite(norms)
    kept, left = finite.nonzero().squeeze(1), (~finite).nonzero().squeeze(1)
    sums, _ = clipped_gradient_sum(model, loss_fn, x[kept], y[kept], clip_norm, diracs, exact, autocast)
    if x.shape[0] == 1:  # the record alone: its own gradient is not finite
        say_left_out(model)
        return sums, norms
    for half in left.tensor_split(min(2, left.numel())):
        more, norms[half] = clipped_gradient_sum(model, loss_fn, x[half], y[half], clip_norm, None, exact, autocast)
        for name, value in more.items():
            sums[name] += value
    return sums, norms
