"""Records whose gradients are not finite, as the clipped sum leaves them out
(:func:`dpml.train.clipping.clipped_gradient_sum`): the log line that says so, and the check that tells a diverged
model (every record's gradient then non-finite for the parameters' sake) from records of their own."""

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


def refuse_non_finite_parameters(model: nn.Module) -> None:
    """Raise ``FloatingPointError`` where a trainable parameter is not finite: then no record's gradient is."""
    named = [n for n, p in model.named_parameters() if p.requires_grad and not bool(torch.isfinite(p).all())]
    if named:
        raise FloatingPointError(
            f"the model's parameters are not finite (nan or inf: {', '.join(named[:3])}"
            f"{', …' if len(named) > 3 else ''}): the training diverged (a smaller learning_rate keeps the update "
            "bounded); no record's gradient can be taken"
        )
