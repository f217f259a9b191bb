"""One run's spend in the ledger, the same for both front doors (the pipeline's train and tune stages,
:func:`dpml.train_private`): **reserved → started → trained**, or **failed**.

- :func:`reserve_and_start` reserves the planned mechanism's spend (refused over budget: the ledger is then
  unchanged), runs the front door's own bookkeeping (the pipeline notes the spend's id beside the model),
  and records ``started``: the moment the records are handed to the trainer. A failure before
  ``started`` cancels the spend (:meth:`dpml.ledger.ledger.Ledger.cancel`): nothing about the data can
  have left the process.
- :func:`training_recorded` wraps the training: an exception (a kill, a Ctrl-C, a bug) records ``failed``
  with the error and propagates, and the spend keeps counting (the trainer saw the data); a normal end
  records ``trained`` with the details the caller filled in.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np

from dpml.ledger.ledger import Ledger, Spend
from dpml.accounting.mechanism import MechanismDescription


def reserve_and_start(
    ledger: Ledger,
    dataset_version: str,
    mechanism: MechanismDescription | None,
    purpose: str,
    budget: float,
    *,
    kl_budget: float | None = None,
    lineage: str | None = None,
    units: np.ndarray | None = None,
    mode: Literal["refuse", "exclude"] = "refuse",
    before_start: Callable[[Spend], None] = lambda spend: None,
) -> Spend:
    """Reserve the spend (:meth:`Ledger.reserve`; :class:`dpml.ledger.ledger.BudgetExceeded` over budget), call
    ``before_start`` with it, and mark it ``started``; a failure in between cancels it and propagates."""
    spend = ledger.reserve(
        dataset_version, mechanism, purpose, budget, kl_budget, lineage=lineage, units=units, mode=mode
    )
    try:
        before_start(spend)
        ledger.record_event(spend.id, "started", {"pid": os.getpid()})
    except BaseException as error:
        ledger.cancel(spend.id, f"failed before training: {type(error).__name__}: {error}")
        raise
    return spend


@contextmanager
def training_recorded(ledger: Ledger, spend: Spend) -> Iterator[dict[str, Any]]:
    """Record how the training of a started spend ended: ``failed`` (with the error, which propagates) or
    ``trained`` with the details the block put in the dict it was given."""
    details: dict[str, Any] = {}
    try:
        yield details
    except BaseException as error:
        ledger.record_event(spend.id, "failed", {"error": f"{type(error).__name__}: {error}"})
        raise
    ledger.record_event(spend.id, "trained", details)
