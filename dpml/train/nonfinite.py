"""Records whose gradients are not finite, as the clipped sum leaves them out
(:func:`dpml.train.clipping.clipped_gradient_sum`): the log line that says so, the check that tells a diverged
model (every record's gradient then non-finite for the parameters' sake) from records of their own, and the check
a trainer makes at the end of a run on a GPU, whose step loop does not read the norms (it never waits for the host),
so that such a record reaches the model there: a model that is not finite is refused before anything is released
(a nan model would say that the record was sampled)."""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

LOG = logging.getLogger("dpml.clipping")
_SAID: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # the models whose left-out records were logged


def say_left_out(model: nn.Module) -> None:
    """Log, the first time for each model, that a record was left out of a clipped sum: its own gradient, taken
    alone, was not finite."""
    if model in _SAID:
        return
    _SAID.add(model)
    LOG.warning(
        "per-example clipping: a record's gradient is not finite (nan or inf), taken alone: it was left out of the "
        "clipped sum (a share of 0, within the sensitivity C). Its values make the model's loss or gradient "
        "non-finite (a log or division of zero, an overflow); logged once per model, and the history's "
        "clipped_fraction counts each such record as clipped"
    )


def non_finite_parameters(model: nn.Module) -> list[str]:
    """The names of the trainable parameters that hold a nan or an inf, with one host read for all of them."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        return []
    finite = torch.stack([torch.isfinite(p).all() for _, p in trainable]).tolist()
    return [name for (name, _), ok in zip(trainable, finite, strict=True) if not ok]


def _listed(names: list[str]) -> str:
    return f"{', '.join(names[:3])}{', …' if len(names) > 3 else ''}"


def refuse_non_finite_parameters(model: nn.Module) -> None:
    """Raise ``FloatingPointError`` where a trainable parameter is not finite: then no record's gradient is."""
    named = non_finite_parameters(model)
    if named:
        raise FloatingPointError(
            f"the model's parameters are not finite (nan or inf: {_listed(named)}): the training diverged (a smaller "
            "learning_rate keeps the update bounded); no record's gradient can be taken"
        )


def refuse_non_finite_model(model: nn.Module) -> None:
    """At the end of a run on a device other than the CPU: raise ``FloatingPointError`` where a trainable parameter is
    not finite, with one host read for all of them (a fixed number per run, however many steps it took). There the
    step loop does not leave out a record whose gradient is not finite (:mod:`dpml.train.clipping` reads the norms on
    a CPU only), so a non-finite model is either diverged or such a record's doing; either way it is not released."""
    device = next((p.device for p in model.parameters() if p.requires_grad), None)
    if device is None or device.type == "cpu":
        return
    named = non_finite_parameters(model)
    if named:
        raise FloatingPointError(
            f"the model's parameters are not finite after training on {device} (nan or inf: {_listed(named)}): on a "
            "GPU the step loop does not read the per-example norms, so a record whose gradient is not finite (a log "
            "or division of zero, an overflow) is not left out as it is on the CPU, or the training diverged (a "
            "smaller learning_rate keeps the update bounded); nothing is released. On the CPU (device: cpu) such "
            "records are left out (a share of 0)"
        )
