"""The probe's checks that the model may be trained with per-example clipping at all, before the engine is judged
(:mod:`dpml.train.clipping_check`, step 2): each example's loss and gradient depend on that example alone, no
buffer keeps the data, and no parameter is written by the passes themselves.

**Independence.** DP-SGD's sensitivity bound holds when removing or replacing example j changes only the j-th term
of the clipped sum. So replacing example 0 of the probe batch — its input and its label, another class: a loss
weighted by the batch's label counts moves the others' terms with a label alone — must leave, for the other examples,

- their losses ℓ_1 … ℓ_{B−1} unchanged, and
- the gradient of Σ_{i≥1} c_i ℓ_i (random c) with respect to every trainable parameter unchanged.

The second catches a model that mixes the examples only where a parameter is still zero: peft's Lily averages the
routing of every token of the batch into one mixture of its adapters, whose factor B starts at zero, so at the
probe's parameters each example's loss ignores the others while its gradient does not — and after one step its
loss would not either. Without mixing both are the same numbers up to rounding (the other examples' rows are
computed from their own inputs; example 0's loss is not in the sum). Each parameter's change is judged relative to
its gradient, or to ``tolerance`` × the whole gradient's norm where its own is smaller: a gradient that is 0 up to
rounding (an attention key's bias) is not judged by the rounding of a float32 pass on a GPU.

And removing example 0 (the add/remove neighbours' relation) must leave ℓ_1 … ℓ_{B−1} unchanged: a model may
depend on the batch's size alone (``h / len(h)``) or on each example's place in it (a sum along the batch of rows
computed from parameters), which replacing an example does not show. Under replace-one neighbours the other examples
keep their places and the batch its size (Poisson sampling draws the same indices for both data sets), so that check
is not asked for there.

**Nothing carried to the next pass.** Each step's sum must depend on that step's batch and the noisy parameters alone
(adaptive composition: step t+1 may read the released θ_{t+1}, never step t's records). A module that keeps
something of a batch in a plain attribute (a tensor or a number, not a buffer) and reads it in the next pass lets a
record move every later step's sum, outside the sensitivity C. So the probe batch's losses are computed after a pass
on the probe batch and after a pass on it with example 0 replaced (buffers and random state restored before each
pass, as for every probe pass): they must be the same. A model whose losses change from pass to pass with nothing
changed (a count of its passes) cannot be judged by the probe and is refused, saying so. These run before the
independence checks, whose passes follow one another: carried state would show there as mixing.

**No writes to parameters.** DP-SGD's guarantee covers parameters that change by the noisy step alone:
θ_{t+1} = θ_t − η (Σ_i clip_C(g_i) + N(0, σ²C²I)) / B is post-processing of the Gaussian mechanism (Abadi et al.
2016, Algorithm 1). A forward or backward pass that writes into a parameter changes it from the batch with no noise:
``nn.Embedding(max_norm=…)`` renormalises in place the rows the batch looks up, so the released table shows which
tokens the private records hold (rows of the absent ones keep their norms). A parameter whose version counter,
storage or values moved during the probe's reference passes (:func:`parameter_identities`) is refused, named,
before any ε is spent, where

- one more training pass writes it again: whatever the values (a bound the probe's rows stay within may be crossed
  by the records'), since the probe cannot tell such a write from one that reads the examples; or
- the first training pass of two fresh copies of the model writes it differently for the probe batch and for it
  with example 0 replaced (an initialisation from the first batch, as Glow's ActNorm).

A write made once and alike for any batch passes, logged: ``transformers``' RWKV rescales two weights of each block
when it switches between evaluation and training.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from dpml.devices import forked_generators
from dpml.train.clipping import LossFn, per_example_losses
from dpml.train.clipping_reference import Reference

PROBE_SEED = 20_261_125
LOG = logging.getLogger("dpml.clipping")


class ClippingUnsupported(ValueError):
    """The engine cannot compute this model's per-example gradients exactly (raised before any ε is spent)."""


@dataclass
class Probe:
    """The model's copy, the probe batch, and the copy's buffers when the check began."""

    model: nn.Module
    loss_fn: LossFn
    x: torch.Tensor
    y: torch.Tensor
    replacement: torch.Tensor
    replacement_label: torch.Tensor
    buffers: dict[str, torch.Tensor]

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The probe batch: inputs and labels."""
        return self.x, self.y

    def replaced(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The probe batch with record 0 replaced, its input and its label (a record is both: a loss weighted by
        the batch's label counts moves the others' terms with a label alone)."""
        inputs, labels = self.x.clone(), self.y.clone()
        inputs[0], labels[0] = self.replacement, self.replacement_label
        return inputs, labels

    @contextmanager
    def same_state(self) -> Iterator[None]:
        """Every pass starts from the starting buffers and the same random state (dropout masks, spectral
        norm's power iteration). Buffers are reset *before* a pass: resetting them after would modify
        tensors that the pass's graph may still need (``orthogonal``'s base)."""
        with torch.no_grad():
            for name, b in self.model.named_buffers():
                b.copy_(self.buffers[name])
        with forked_generators(next(self.model.parameters()).device, PROBE_SEED):
            yield


def check_independent(probe: Probe, reference: Reference, tolerance: float, removal: bool = True) -> None:
    """Replacing example 0 leaves the other examples' losses and their losses' gradient as they were, and
    (``removal``: add-remove neighbours) removing it leaves their losses (module docstring); otherwise
    :class:`ClippingUnsupported`, saying what moved."""
    with probe.same_state(), torch.no_grad():
        losses = per_example_losses(probe.model, probe.loss_fn, *probe.replaced())
    k = _first_moved(losses[1:], reference.losses[1:], tolerance, reference.losses)
    if k is not None:
        k += 1
        raise ClippingUnsupported(
            f"model: replacing example 0 of a probe batch changed the loss of example {k} "
            f"({float(reference.losses[k]):.6g} → {float(losses[k]):.6g}): the model or its loss mixes the examples of "
            "a batch (batch statistics, attention or pooling across the batch, a loss weighted by the batch's label "
            "counts), so clipping each example's gradient does not bound its influence; make each example's loss "
            "depend on that record alone"
        )
    before, after = _others_gradient(probe, probe.batch()), _others_gradient(probe, probe.replaced())
    total = float(torch.stack([g.norm() for g in before.values()]).norm()) if before else 0.0
    errors = {
        name: float((after[name] - g).norm() / (g.norm() + tolerance * total + 1e-300)) for name, g in before.items()
    }
    worst = max(errors, key=errors.__getitem__, default=None)
    if worst is not None and not errors[worst] <= tolerance:
        raise ClippingUnsupported(
            f"model: replacing example 0 of a probe batch changed the gradient of the other examples' losses with "
            f"respect to '{worst}' ({errors[worst]:.2g} relative), though not the losses: the model mixes the examples "
            "of a batch where a parameter is still zero (a mixture or routing averaged over the batch) or in its "
            "backward pass alone (nn.Embedding's scale_grad_by_freq divides each row's gradient by how often the "
            "batch holds its token), so clipping each example's gradient does not bound its influence; make each "
            "example's gradient depend on that example alone"
        )
    if removal:
        _check_size_free(probe, tolerance)


def _check_size_free(probe: Probe, tolerance: float) -> None:
    """Removing example 0 leaves the other examples' losses as they were (module docstring). In evaluation mode, where
    no dropout mask is drawn (one row fewer would draw the others' anew); a model that cannot run in evaluation mode,
    or draws at random there too (two passes differ), is not judged here (its training-mode checks above stand)."""
    was_training = probe.model.training
    probe.model.eval()
    try:
        with probe.same_state(), torch.no_grad():
            whole = per_example_losses(probe.model, probe.loss_fn, probe.x, probe.y)
            again = per_example_losses(probe.model, probe.loss_fn, probe.x, probe.y)  # (the generators moved on)
            fewer = per_example_losses(probe.model, probe.loss_fn, probe.x[1:], probe.y[1:])
    except Exception as error:  # noqa: BLE001 (a user's module: its evaluation mode is not what is checked)
        LOG.info("the batch-size check did not run: the model failed in evaluation mode (%s)", type(error).__name__)
        return
    finally:
        probe.model.train(was_training)
    if _first_moved(again, whole, tolerance, whole) is not None:
        LOG.info("the batch-size check did not run: the model draws at random in evaluation mode too")
        return
    k = _first_moved(fewer, whole[1:], tolerance, whole)
    if k is not None:
        k += 1
        raise ClippingUnsupported(
            f"model: removing example 0 of a probe batch changed the loss of example {k} ({float(whole[k]):.6g} → "
            f"{float(fewer[k - 1]):.6g}): the model depends on how many examples a batch holds (it divides by the "
            "batch's size, say), so adding or removing one example moves the others' terms and clipping each "
            "example's gradient does not bound its influence; make each example's output depend on that example alone"
        )


def _first_moved(found: torch.Tensor, expected: torch.Tensor, tolerance: float, scale: torch.Tensor) -> int | None:
    """The index of the first loss in ``found`` more than ``tolerance`` × the largest of the losses ``scale`` away
    from ``expected``'s; None where none is."""
    limit = tolerance * (scale.abs().max() + 1e-30)
    moved = ((found - expected).abs() > limit).nonzero().flatten()
    return int(moved[0]) if moved.numel() else None


def _others_gradient(probe: Probe, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """∂(Σ_{i≥1} c_i ℓ_i)/∂θ on ``batch`` (inputs, labels), c fixed random weights in [0.5, 1]: the examples other
    than 0."""
    params = {n: p for n, p in probe.model.named_parameters() if p.requires_grad}
    with probe.same_state():
        losses = per_example_losses(probe.model, probe.loss_fn, *batch)
        weights = 0.5 + 0.5 * torch.rand(losses.shape[0] - 1, generator=torch.Generator().manual_seed(PROBE_SEED + 3))
        total = (losses[1:] * weights.to(losses)).sum()
        grads = torch.autograd.grad(total, list(params.values()), allow_unused=True)
    return {n: g.detach() for n, g in zip(params, grads, strict=True) if g is not None}


def _differs(value: torch.Tensor, other: torch.Tensor, tolerance: float) -> bool:
    """Floating buffers: apart by more than ``tolerance`` relative to the largest entry; others: not equal."""
    if not value.is_floating_point():
        return not torch.equal(value, other)
    return value.numel() > 0 and bool((value - other).abs().max() > tolerance * (value.abs().max() + 1e-30))


def _losses_after_a_pass_on(probe: Probe, before: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The probe batch's losses in a pass that follows one on ``before`` (buffers and random state restored)."""
    with torch.no_grad():
        with probe.same_state():
            per_example_losses(probe.model, probe.loss_fn, *before)
        with probe.same_state():
            return per_example_losses(probe.model, probe.loss_fn, probe.x, probe.y)


def check_nothing_carried(probe: Probe, tolerance: float) -> None:
    """A pass's losses do not depend on the batch of the pass before (module docstring, **Nothing carried to the
    next pass**), else :class:`ClippingUnsupported`; nor, first, on how many passes came before."""
    first = _losses_after_a_pass_on(probe, probe.batch())
    again = _losses_after_a_pass_on(probe, probe.batch())
    k = _first_moved(again, first, tolerance, first)
    if k is not None:
        raise ClippingUnsupported(
            f"model: the loss of example {k} of the probe batch changed from one pass to the next "
            f"({float(first[k]):.6g} → {float(again[k]):.6g}) with the same batch, buffers and random state: the "
            "model keeps state across passes outside its parameters and buffers (a count of its passes, an "
            "attribute its forward pass sets), which the probe cannot judge; compute each pass from its own batch "
            "and the parameters alone"
        )
    other = _losses_after_a_pass_on(probe, probe.replaced())
    k = _first_moved(other, again, tolerance, again)
    if k is not None:
        raise ClippingUnsupported(
            f"model: replacing example 0 of one probe batch changed the loss of example {k} of the next batch "
            f"({float(again[k]):.6g} → {float(other[k]):.6g}): the model keeps something of a batch "
            "outside its parameters and buffers (an attribute its forward pass sets) and reads it in the next pass, "
            "so a record would move every later step's sum beyond its clipped gradient; compute each pass from its "
            "own batch and the parameters alone"
        )


def _buffers_after_forward(probe: Probe, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    with probe.same_state(), torch.no_grad():
        per_example_losses(probe.model, probe.loss_fn, *batch)
        return {name: b.detach().clone() for name, b in probe.model.named_buffers()}


def check_no_data_in_buffers(probe: Probe, tolerance: float) -> None:
    """The buffers a training-mode forward pass writes do not depend on the examples
    (:mod:`dpml.train.clipping_check`'s docstring, step 2)."""
    if not probe.buffers:
        return
    before, after = _buffers_after_forward(probe, probe.batch()), _buffers_after_forward(probe, probe.replaced())
    for name, value in before.items():
        if _differs(value, after[name], tolerance):
            raise ClippingUnsupported(
                f"model buffer '{name}': the training-mode forward pass writes the examples into it (replacing one "
                "example of a probe batch changed it), and it would be released with the model without noise, "
                "outside the DP guarantee; keep no statistics of the data in buffers (nn.InstanceNorm: "
                "track_running_stats=False; use nn.GroupNorm or nn.LayerNorm for normalisation)"
            )


def _digest(p: torch.Tensor) -> bytes:
    """A digest of the parameter's bytes (BLAKE2b, 16 bytes): any change of value changes it."""
    raw = p.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.blake2b(raw.data, digest_size=16).digest()


def parameter_identities(model: nn.Module) -> dict[str, tuple[int, int, bytes]]:
    """Each parameter's version counter, storage address and a digest of its values: an in-place write moves the
    first, a ``.data`` swap the second, a write through ``.data`` (which bypasses the counter) the third."""
    return {name: (p._version, p.data_ptr(), _digest(p)) for name, p in model.named_parameters()}


def _training_pass(probe: Probe, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One forward and backward pass in training mode from the probe's random state (no ``.grad`` written)."""
    params = [p for p in model.parameters() if p.requires_grad]
    with probe.same_state() if model is probe.model else forked_generators(batch[0].device, PROBE_SEED):
        losses = per_example_losses(model, probe.loss_fn, *batch)
        torch.autograd.grad(losses.sum(), params, allow_unused=True)


def _moved(before: dict[str, tuple[int, int, bytes]], model: nn.Module) -> list[str]:
    after = parameter_identities(model)
    return [name for name, state in before.items() if after.get(name) != state]


def _refuse_writes(names: list[str], why: str) -> ClippingUnsupported:
    return ClippingUnsupported(
        f"model parameter(s) {', '.join(repr(n) for n in names)}: {why}; a change of a parameter made from the "
        "examples without noise would be released with the model, outside the DP guarantee (which covers parameters "
        "changed by the noisy step alone): build the layer without it (nn.Embedding: max_norm=None) or make such a "
        "change from the parameters alone, between steps"
    )


def check_no_writes_to_parameters(
    probe: Probe, before: dict[str, tuple[int, int, bytes]], fresh: Callable[[], nn.Module]
) -> None:
    """Where the probe's passes since ``before`` (:func:`parameter_identities`) wrote a parameter, refuse
    (:class:`ClippingUnsupported`, naming each) a write that a further training pass makes again (whatever its
    values: ``nn.Embedding(max_norm=…)``), or one that the first training pass of two ``fresh`` copies of the model
    makes differently for the probe batch and for it with example 0 replaced (an initialisation from the first
    batch). A write made once and alike for any batch (``transformers``' RWKV rescales its layers when it switches
    between evaluation and training) passes, logged (module docstring, **No writes to parameters**)."""
    written = _moved(before, probe.model)
    if not written:
        return
    now = parameter_identities(probe.model)
    _training_pass(probe, probe.model, probe.batch())
    again = _moved(now, probe.model)
    if again:
        raise _refuse_writes(
            again,
            "every training-mode pass writes into them in place (nn.Embedding's max_norm "
            "renormalises the rows a batch looks up), which the probe cannot tell from the examples",
        )
    first, second = fresh().train(), fresh().train()
    _training_pass(probe, first, probe.batch())
    _training_pass(probe, second, probe.replaced())
    values = dict(second.named_parameters())
    differ = [n for n, p in first.named_parameters() if n in written and not torch.equal(p, values[n])]
    if differ:
        raise _refuse_writes(
            differ,
            "the first training-mode pass writes the examples into them (replacing one "
            "example of a probe batch changed what it wrote)",
        )
    LOG.info("model parameter(s) %s: written once by the first training-mode pass, alike for any batch", written)


LOW_PRECISION = (torch.bfloat16, torch.float16)


def reject_low_precision_parameters(model: nn.Module) -> None:
    """A trainable parameter in bfloat16 or float16 is refused before any work. DP-SGD's sensitivity is C only if
    each example moves the released sum by its clipped gradient, ‖c_i g_i‖ ≤ C (Abadi et al. 2016, Algorithm 1); the
    engine forms norms and sums in the parameter's dtype, and with 8 (bfloat16) or 11 (float16) bits of mantissa the
    rounding of the norm and of the sum breaks that: a bfloat16 MLP's clipped gradient of one example measured
    1.010 C, two neighbouring sums 1.010 C apart (float16: 1.001 C; float32: 1 + 2e-7), so the certified ε would
    not hold. Float32 parameters with a bf16 forward pass (``train.autocast: bf16``) form norms, sums and noise in
    float32; frozen parameters may be of any dtype (no gradient of theirs is released)."""
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype in LOW_PRECISION:
            raise ClippingUnsupported(
                f"model parameter {name!r} is trainable in {p.dtype}: dpml clips and sums each parameter's "
                f"gradient in its dtype, and {p.dtype}'s rounding lets one example move the clipped sum by more than "
                "the clip norm C (an MLP: 1.010 C in bfloat16, 1.001 C in float16), so the certified ε would not "
                "hold; keep the trainable parameters in float32 (frozen ones may stay as they are) and run the "
                "forward pass in bf16 with train.autocast: bf16 (autocast='bf16'), which forms norms, sums and noise "
                "in float32"
            )


def reject_complex_parameters(model: nn.Module) -> None:
    """A complex trainable parameter is refused before any work: its per-example norm, clipped sum and noise would
    each have to treat the real and imaginary parts as two real coordinates, and the engine does not. Held as a real
    parameter of shape (…, 2) and read through ``torch.view_as_complex``, each part is a real coordinate of its own."""
    for name, p in model.named_parameters():
        if p.requires_grad and p.is_complex():
            raise ClippingUnsupported(
                f"model parameter {name!r} is complex ({p.dtype}); dpml clips and noises real parameters: hold it as "
                f"a real parameter of shape {(*p.shape, 2)} and read it through torch.view_as_complex"
            )
