"""Before the first private step: check, on a probe batch, that the clipping engine computes exactly
the per-example gradients autograd defines for *this* model, and plan where it must not take a shortcut.

The engine's layer shortcuts (:mod:`dpml.train.clipping_layers`) and operation rules
(:mod:`dpml.train.rules`) see a parameter only where a module call or a torch function shows it. A
weight that also reaches the loss where neither does — inside a custom autograd Function — would get a
silently wrong gradient (still of norm ≤ C, so private, but not the gradient of the model). So every
shortcut and rule is tested, on a deep copy of the model in float64 on the CPU (a model that fails there — an error,
or losses or gradients that are not finite in float64 alone — is checked in its own dtype on its device, to a
relative 1e-3):

1. **Reference.** ℓ_i for a probe batch of B examples and, for each i, g_i = ∂ℓ_i/∂θ by plain autograd
   (one backward pass per example: the definition, for any module), kept as its norms and added into the
   weighted sums Σ_i c_i g_i the checks need (each g_i formed twice, to hold one at a time).
2. **Independence.** Replacing example 0 (its input and its label: a record is both) must leave ℓ_1 … ℓ_{B−1}
   unchanged, and the gradient of
   Σ_{i≥1} c_i ℓ_i too (a model that mixes the examples only where a parameter is still zero), and under add-remove
   neighbours removing it must leave those losses as well (a model scaled by the batch's size:
   :mod:`dpml.train.probe_checks`). A model whose output for one example depends on another (batch
   statistics, attention across the batch) is refused: per-example clipping bounds an example's influence
   only through its own gradient.
   **No data in the state.** Replacing example 0 must also leave every buffer the training-mode forward
   pass writes as it was. DP-SGD's guarantee covers the parameters (θ_{t+1} is post-processing of the
   noisy sums); a buffer written from the examples (InstanceNorm's running statistics with
   ``track_running_stats=True``, a module's own running average) would be released with the model
   without noise, so such a model is refused, naming the buffer. Buffers written from the parameters
   or a counter alone (spectral norm's power iteration, ``num_batches_tracked``) pass. A parameter that every
   training pass writes into (``nn.Embedding(max_norm=…)``) is refused whatever the values written, and so is one
   the first pass writes from the examples (an initialisation from the first batch); a write made once and alike
   for any batch (a switch between evaluation and training) passes (:mod:`dpml.train.probe_checks`). Nor may a
   pass's losses depend on the batch of the pass before (something of a batch kept in a plain attribute).
3. **Each fast unit** — a hooked layer, or a parameter covered by operation rules. Its ‖g_i‖² and
   Σ_i c_i g_i (random c ∈ [0.2, 1]) over its own parameters must equal the reference's to a relative
   1e-6. A unit that fails takes the exact path (its parameters' per-example gradients by batched
   autograd), and the plan says which and why; so does every parameter no rule covers, with the
   operation that sent it there (``offset: torch.atan2: no rule, and an operand from the batch (shape (6, 4)) not
   laid out example by example along one axis``). A rule that read a constant's
   dimension as the batch's (XLNet's position table expanded over the batch,
   :func:`dpml.train.rules.einsum._constant_batch_axis`) and failed is run again without that reading; the
   readings that pass travel with the plan (:class:`~dpml.train.exact_path.PlannedExact`), the only ones a
   training pass makes.
4. **The whole engine** with that plan, at C = the median reference norm: every parameter's clipped
   sum and every norm must equal the reference's; otherwise the model is refused, naming the
   parameter, before any ε is spent.

The probe batch is synthetic (from a fixed public seed, so the plan is the same every time): standard
normal inputs of the model's input shape (integer inputs: token ids below the smallest embedding's
vocabulary; token inputs with a mask: the adapter's, laid out as the model's tokenizer would from the special ids
its config names, :func:`dpml.models.library.probe_tokens`) and uniform labels.
It is not a record and nothing about the data enters the plan.
Each forward pass of the check restores the copy's buffers and the random state first (torch's, NumPy's and Python's
global generators, each seeded alike: ``transformers``' wav2vec2 draws its feature masks from NumPy's), so dropout
masks and power-iteration state (spectral norm) are the same in every pass; training's own generators are left as
they were.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dpml.devices import forked_generators
from dpml.models.batch_norm import reject_batch_norm
from dpml.train.clipping import LossFn, clipped_gradient_sum, engine_dtype, engine_pass
from dpml.train.engine_units import RuleUnit, Unit, unit_parameters
from dpml.train.clipping_reference import Reference, per_example_reference
from dpml.accounting.mechanism import Neighbouring
from dpml.train.exact_path import PlannedExact
from dpml.train.probe_precision import narrowest_precision
from dpml.train.probe_checks import (
    PROBE_SEED,
    ClippingUnsupported,
    Probe,
    check_independent,
    check_no_data_in_buffers,
    check_nothing_carried,
    check_no_writes_to_parameters,
    parameter_identities,
    reject_complex_parameters,
    reject_low_precision_parameters,
)

PROBE_BATCH = 6
FLOAT64_TOLERANCE = 1e-6  # relative: the engine against autograd's per-example gradients, both in float64
OWN_DTYPE_TOLERANCE = 1e-3  # the same in the model's own (lower) precision, or where its pass narrows to one
LOG = logging.getLogger("dpml.clipping")
T = TypeVar("T")


class NotFinite(ClippingUnsupported):
    """The probe's losses or per-example gradients are nan or infinite: in float64 a model may overflow where it
    does not in its own dtype (``(1 - mask.float()) * torch.finfo(torch.float64).min`` is 0·(−inf) in float32), so
    the check is then tried in the model's own dtype."""


@dataclass(frozen=True)
class ClippingPlan:
    """What the probe decided: the parameters the engine must take exactly, and why (one line each); ``exact`` is a
    :class:`~dpml.train.exact_path.PlannedExact` carrying the constants the probe confirmed read as the batch."""

    exact: frozenset[str] = frozenset()
    notes: tuple[str, ...] = ()
    fast_layers: tuple[str, ...] = ()
    exact_parameters: tuple[str, ...] = ()  # every parameter the engine takes exactly
    rule_parameters: tuple[str, ...] = ()  # parameters covered by operation rules (dpml.train.rules)
    exact_reasons: tuple[str, ...] = ()  # "name: the operation that sent it to the exact path", one per exact parameter

    def lines(self) -> list[str]:
        head = (
            f"per-example clipping: {len(self.fast_layers)} layer(s) by their shortcut, "
            f"{len(self.rule_parameters)} parameter(s) by operation rules, "
            f"{len(self.exact_parameters)} parameter(s) by exact per-example autograd"
            + (f" ({', '.join(self.exact_parameters)})" if self.exact_parameters else "")
        )
        return [head, *self.notes, *self.exact_reasons]


def probe_batch(
    model: nn.Module, input_shape: tuple[int, ...], input_dtype: torch.dtype, size: int = PROBE_BATCH
) -> torch.Tensor:
    """``size`` + 1 synthetic inputs (the last one replaces example 0 in the independence check). A model
    that draws its own (token inputs: valid ids and masks, :meth:`dpml.models.library.LibraryModel.probe_input`)
    gets those."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    own = getattr(model, "probe_input", None)
    drawn: torch.Tensor | None = own(tuple(input_shape), input_dtype, size + 1, generator) if callable(own) else None
    if drawn is not None:
        return drawn
    shape = (size + 1, *input_shape)
    if input_dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=torch.float64)
    vocabularies = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return torch.randint(0, min(vocabularies, default=2), shape, generator=generator, dtype=input_dtype)


def probe_labels(outputs: torch.Tensor, size: int) -> torch.Tensor:
    """Uniform class labels for the model's (B, classes) outputs."""
    generator = torch.Generator().manual_seed(PROBE_SEED + 1)
    return torch.randint(0, max(1, outputs.shape[-1]), (size,), generator=generator)


def _guarded(what: str, step: Callable[[], T]) -> T:
    try:
        return step()
    except ClippingUnsupported:
        raise
    except Exception as error:  # a user's module: name the failing step, not a bare KeyError
        raise ClippingUnsupported(
            f"model: {what} failed on a synthetic probe batch: {type(error).__name__}: {error}"
        ) from error


def _check_finite(reference: Reference) -> None:
    """A loss or per-example gradient that is nan or infinite on the probe batch compares as neither equal nor
    different: no check could judge the engine on it, and training would only spread it into every parameter."""
    bad = reference.not_finite
    if not bool(torch.isfinite(reference.losses).all()) or bad:
        where = f"the per-example gradient of '{bad[0]}'" if bad else "the per-example losses"
        raise NotFinite(
            f"model: {where} on a synthetic probe batch {'is' if bad else 'are'} not finite (nan or inf); "
            "dpml cannot check its per-example gradients, and training would spread the nan into every parameter: "
            "make the forward pass finite (a fully masked attention row, a log or division of zero)"
        )


def _relative(found: torch.Tensor, expected: torch.Tensor, scale: float) -> float:
    """‖found − expected‖ / ‖expected‖, the denominator at least 1e-9 · ``scale`` (a gradient that is 0 up to
    rounding, such as an attention key's bias, is not judged by its rounding alone)."""
    return float((found - expected).norm() / (expected.norm() + 1e-9 * scale + 1e-300))


def _unit_errors(
    probe: Probe, reference: Reference, factors: torch.Tensor, scale: float, reads: PlannedExact | None
) -> tuple[list[tuple[Unit, list[str], float]], dict[str, str], dict[str, int]]:
    """(unit, its trainable parameter names, relative error of its norms and clipped sums) for each fast unit —
    a hooked layer or a parameter covered by operation rules —, why each other parameter went exact, and the
    constants rules read as the batch (``reads``: only those; None: wherever a rule finds one)."""
    with probe.same_state():
        found = engine_pass(probe.model, probe.loss_fn, probe.x, probe.y, reads or (), any_constant_reads=reads is None)
    out = []
    for unit, piece in found.fast:
        names = [found.names[id(p)] for p in unit_parameters(unit) if id(p) in found.names]
        error = _relative(piece.squared, reference.squared(names), scale**2)
        for p, total in piece.sums(factors):
            error = max(error, _relative(total, reference.weighted[found.names[id(p)]], scale))
        out.append((unit, names, error))
    return out, found.reasons, found.constants_read


def _confirm(probe: Probe, reference: Reference, exact: frozenset[str], tolerance: float, scale: float) -> None:
    """The whole engine under the plan, at the reference's C, reproduces the reference's clipped sums and norms."""
    norms = reference.norms()
    with probe.same_state():
        sums, found_norms = clipped_gradient_sum(
            probe.model, probe.loss_fn, probe.x, probe.y, reference.clip, exact=exact
        )
    errors = {name: _relative(sums[name], total, scale) for name, total in reference.clipped.items()}
    worst = max(errors, key=errors.__getitem__, default=None)
    if worst is not None and not errors[worst] <= tolerance:  # (nan: not within it either)
        raise ClippingUnsupported(
            f"model parameter '{worst}': dpml's clipped per-example gradient sum differs from autograd's by "
            f"{errors[worst]:.2g} (relative) on a synthetic probe batch; dpml cannot train this model exactly — "
            "write the layer with standard torch.nn modules or report the module"
        )
    if not _relative(found_norms, norms, float(norms.norm())) <= tolerance:
        raise ClippingUnsupported(
            "model: dpml's per-example gradient norms differ from autograd's on a synthetic "
            "probe batch; dpml cannot train this model exactly"
        )


def _module_names(model: nn.Module) -> dict[nn.Module, str]:
    names: dict[nn.Module, str] = {}
    for name, module in model.named_modules():
        names.setdefault(module, name or "<model>")
    return names


def _plan_on(
    reference_model: nn.Module,
    fresh: Callable[[], nn.Module],
    loss_fn: LossFn,
    x_all: torch.Tensor,
    labels_all: torch.Tensor | None,
    tolerance: float,
    removal: bool,
) -> ClippingPlan:
    x = x_all[:-1]
    reference_model.train()
    unwritten = parameter_identities(reference_model)
    buffers = {name: b.detach().clone() for name, b in reference_model.named_buffers()}
    if labels_all is None:
        with torch.no_grad():
            outputs = _guarded("the forward pass", lambda: reference_model(x))
        labels = probe_labels(outputs, x.shape[0])
        replacement_label = (labels[0] + 1) % max(1, outputs.shape[-1])  # the replaced record's label changes too
    else:
        labels, replacement_label = labels_all[:-1], labels_all[-1]
    probe = Probe(reference_model, loss_fn, x, labels, x_all[-1], replacement_label, buffers)
    factors = 0.2 + 0.8 * torch.rand(  # in the parameters' dtype, as the engine's (a model may return float32 logits)
        x.shape[0], generator=torch.Generator().manual_seed(PROBE_SEED + 2), dtype=engine_dtype(reference_model)
    )
    reference = _guarded(
        "per-example autograd",
        lambda: per_example_reference(probe.model, probe.loss_fn, probe.x, probe.y, factors, probe.same_state),
    )
    _guarded("the parameter check", lambda: check_no_writes_to_parameters(probe, unwritten, fresh))
    _check_finite(reference)
    _guarded("the carry-over check", lambda: check_nothing_carried(probe, tolerance))
    _guarded("the independence check", lambda: check_independent(probe, reference, tolerance, removal))
    _guarded("the buffer check", lambda: check_no_data_in_buffers(probe, tolerance))
    scale = float(reference.norms().max()) or 1.0
    engine = "the clipping engine"
    errors, reasons, reads = _guarded(engine, lambda: _unit_errors(probe, reference, factors, scale, None))
    wrong = {n for _, names, error in errors if error > tolerance for n in names}
    if wrong & set(reads):  # a constant read as the batch where it is not: the pass again, without those readings
        kept = PlannedExact((), [(n, d) for n, d in reads.items() if n not in wrong])
        errors, reasons, reads = _guarded(engine, lambda: _unit_errors(probe, reference, factors, scale, kept))
    module_names = _module_names(reference_model)
    exact: set[str] = set()
    notes, fast, ruled = [], [], []
    for unit, names, error in errors:
        if error <= tolerance:
            (ruled.extend(names) if isinstance(unit, RuleUnit) else fast.append(module_names[unit]))
            continue
        exact.update(names)
        notes.append(_off_note(unit, module_names, names, error))
    covered = {n for _, names, error in errors if error <= tolerance for n in names}
    plan = PlannedExact(exact, [(n, d) for n, d in reads.items() if n in covered])
    _guarded("the clipping engine", lambda: _confirm(probe, reference, plan, tolerance, scale))
    exact_parameters = tuple(n for n in reference.squares if n not in covered)
    return ClippingPlan(
        plan,
        tuple(notes),
        tuple(fast),
        exact_parameters,
        tuple(ruled),
        tuple(f"{n}: {reasons[n]}" for n in exact_parameters if n in reasons),
    )


def _off_note(unit: Unit, module_names: dict[nn.Module, str], names: list[str], error: float) -> str:
    if isinstance(unit, RuleUnit):
        return (
            f"model parameter '{unit.name}' ({', '.join(unit.operations)}): its rules are {error:.1%} off autograd's "
            "per-example gradient on the probe batch (it also reaches the loss where no operation is seen, such as "
            "a custom autograd Function); exact per-example gradients for it"
        )
    return (
        f"model layer '{module_names[unit]}' ({type(unit).__name__}): its shortcut is {error:.1%} off "
        "autograd's per-example gradient on the probe batch (its weights also reach the loss outside its "
        f"own forward where no operation is seen); exact per-example gradients for {', '.join(names)}"
    )


def plan_clipping(
    model: nn.Module,
    loss_fn: LossFn,
    input_shape: tuple[int, ...],
    input_dtype: torch.dtype = torch.float32,
    probe: tuple[torch.Tensor, torch.Tensor] | None = None,
    neighbouring: Neighbouring = "add-remove",
) -> ClippingPlan:
    """Check the engine on ``model`` (module docstring) and return its plan, or raise
    :class:`ClippingUnsupported` naming the layer. ``probe``: a public batch (x, y) to use instead of the
    synthetic one (x's first row is the replacement of the independence check, the rest the batch).
    ``neighbouring``: the relation the run is certified under; under add-remove the other examples' losses must
    not move when one is removed either (:mod:`dpml.train.probe_checks`)."""
    reject_batch_norm(model)
    reject_complex_parameters(model)
    reject_low_precision_parameters(model)
    if not any(p.requires_grad for p in model.parameters()):
        raise ClippingUnsupported("model: it has no trainable parameter")
    key = None if probe is not None else (*architecture_key(model, loss_fn, input_shape, input_dtype), neighbouring)
    if key is not None and key in _PLANS:
        return _PLANS[key]
    device = next(model.parameters()).device
    with forked_generators(device):  # training's random state untouched
        plan = _plan(model, loss_fn, input_shape, input_dtype, probe, neighbouring != "replace-one")
    if key is not None:
        _PLANS[key] = plan
        while len(_PLANS) > 64:
            _PLANS.pop(next(iter(_PLANS)))
    return plan


_PLANS: dict[tuple[Any, ...], ClippingPlan] = {}


def architecture_key(
    model: nn.Module, loss_fn: LossFn, input_shape: tuple[int, ...], input_dtype: torch.dtype
) -> tuple[Any, ...]:
    """What the plan depends on: the module classes (their code), the model's structure, attributes and
    parameter shapes, the loss and the input. The audit trains many models of one architecture: one probe."""
    attributes = tuple(
        tuple(sorted((k, repr(v)[:200]) for k, v in vars(m).items() if not k.startswith("_"))) for m in model.modules()
    )  # flags a forward may branch on (not all are in repr)
    return (
        tuple(type(m) for m in model.modules()),
        repr(model),
        attributes,
        tuple((n, tuple(p.shape), p.requires_grad, p.dtype) for n, p in model.named_parameters()),
        loss_fn,
        tuple(input_shape),
        input_dtype,
    )


def working_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` for dpml's own passes (the plan's probe, the chunk timing), by ``copy.deepcopy``, with
    each tensor a forward pass left on its modules with a graph attached (a recurrent block's cached states, set in
    ``forward``) copied detached: deepcopy refuses tensors that are not graph leaves, and the copy has no use for
    the user's graph. The model itself is not touched."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for t in tree_leaves(list(vars(module).values())):  # (inside lists, tuples and dicts too)
            if isinstance(t, torch.Tensor) and not t.is_leaf and id(t) not in memo:
                memo[id(t)] = t.detach().clone()
    return copy.deepcopy(model, memo)


def _fresh_copy(model: nn.Module, where: Any, dtype: torch.dtype | None) -> nn.Module:
    """A working copy of ``model`` on ``where``, every floating tensor in ``dtype`` (None: each keeps its own, as a
    frozen low-precision body beside float32 adapters)."""
    copied = working_copy(model)
    return copied.to(device=where) if dtype is None else copied.to(device=where, dtype=dtype)


def _plan(
    model: nn.Module,
    loss_fn: LossFn,
    input_shape: tuple[int, ...],
    input_dtype: torch.dtype,
    probe: tuple[torch.Tensor, torch.Tensor] | None,
    removal: bool,
) -> ClippingPlan:
    attempts: list[tuple[Any, torch.dtype | None, float]] = [("cpu", torch.float64, FLOAT64_TOLERANCE)]
    device = next(model.parameters()).device
    attempts.append((device, None, OWN_DTYPE_TOLERANCE))  # a model that only runs as it is, each dtype its own
    failure: ClippingUnsupported | None = None
    for where, dtype, tolerance in attempts:
        try:
            reference_model = _fresh_copy(model, where, dtype)
        except Exception as error:
            raise ClippingUnsupported(
                f"model: copy.deepcopy failed ({type(error).__name__}: {error}); dpml checks "
                "the clipping on a copy before training"
            ) from error
        if probe is None:
            x_all, labels = probe_batch(model, input_shape, input_dtype), None
        else:
            x_all, labels = torch.cat([probe[0][1:], probe[0][:1]]), torch.cat([probe[1][1:], probe[1][:1]]).to(where)
        if x_all.is_floating_point():
            x_all = x_all.to(dtype or next(model.parameters()).dtype)  # (as the trainer feeds the records)
        if dtype == torch.float64:
            tolerance = _float64_tolerance(reference_model, x_all.to(where)[:-1])
        try:
            fresh = functools.partial(_fresh_copy, model, where, dtype)
            plan = _plan_on(reference_model, fresh, loss_fn, x_all.to(where), labels, tolerance, removal)
        except ClippingUnsupported as error:
            failure = error
            if dtype == torch.float64 and (error.__cause__ is not None or isinstance(error, NotFinite)):
                LOG.info("the clipping check in float64 failed (%s); checking the model in its own dtype", error)
                continue  # the model may not run in float64: try it as it is
            raise
        for line in plan.lines():
            LOG.info("%s", line)
        return plan
    assert failure is not None
    raise failure


def _float64_tolerance(model: nn.Module, x: torch.Tensor) -> float:
    """The float64 check's tolerance: 1e-6, or where the model's forward pass narrows a float64 operand to a lower
    precision (:mod:`dpml.train.probe_precision`), whose rounding then bounds how closely autograd's reference and
    the engine's pass can agree, a thousand times that precision's ε (float32: 1.2e-4), at most the own-dtype
    check's 1e-3."""
    was_training = model.training
    model.eval()  # (no power iteration or running statistic moved by this look)
    try:
        narrowed = narrowest_precision(model, x)
    finally:
        model.train(was_training)
    if narrowed is None:
        return FLOAT64_TOLERANCE
    tolerance = min(OWN_DTYPE_TOLERANCE, max(FLOAT64_TOLERANCE, 1000 * torch.finfo(narrowed).eps))
    LOG.info(
        "the model computes in %s in places (an operation narrows a float64 operand to it): the clipping check in "
        "float64 holds the engine to %.2g",
        str(narrowed).removeprefix("torch."),
        tolerance,
    )
    return tolerance


def check_autocast(
    model: nn.Module,
    loss_fn: LossFn,
    input_shape: tuple[int, ...],
    input_dtype: torch.dtype,
    device: torch.device | str,
    autocast: torch.dtype | None,
) -> None:
    """With ``autocast`` (``train.autocast: bf16``), one engine pass of a copy of the model on ``device`` under
    it, on the synthetic probe batch: an operator without a kernel for that precision on that device (an
    LSTM in bf16 on some CPUs) is refused here, before any spend, not in the middle of training."""
    if autocast is None:
        return
    device = torch.device(device)
    trial = working_copy(model).to(device)
    x = probe_batch(trial, input_shape, input_dtype, size=3)[:3]
    x = x.to(device=device, dtype=next(trial.parameters()).dtype if x.is_floating_point() else x.dtype)
    with forked_generators(device):
        try:
            y = probe_labels(trial(x), 3).to(device)
            clipped_gradient_sum(trial, loss_fn, x, y, 1.0, autocast=autocast)
        except Exception as error:
            raise ClippingUnsupported(
                f"train.autocast = {str(autocast).removeprefix('torch.')}: the model fails under "
                f"autocast on {device.type}: {type(error).__name__}: {str(error)[:300]}; "
                "use train.autocast: none"
            ) from error
