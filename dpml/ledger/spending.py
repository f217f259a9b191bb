"""One run's spend in the ledger, the same for both front doors (the pipeline's train and tune stages,
:func:`dpml.train_private`): **reserved → started → trained**, or **failed**.

:func:`charged_run` is the run core both front doors call: each only adapts its inputs (the pipeline's files and
``params.yaml``, or Python objects) into a :class:`Charge` and a training function. Its parts:

- :func:`reserve_and_start` reserves the planned mechanism's spend (refused over budget: the ledger is then
  unchanged), runs the front door's own bookkeeping (the pipeline notes the spend's id beside the model),
  and records ``started``: the moment the records are handed to the trainer. A failure before
  ``started`` cancels the spend (:meth:`dpml.ledger.ledger.Ledger.cancel`): nothing about the data can
  have left the process.
- :func:`training_recorded` wraps the training: an exception (a kill, a Ctrl-C, a bug) records ``failed``
  with the error and propagates, and the spend keeps counting (the trainer saw the data); a normal end
  records ``trained`` with the details the caller filled in.

Certification is not a step of the core: the certificate is a function of the planned mechanism alone
(:func:`dpml.accounting.accountants.certify`), which the library computes before training and the pipeline in its
own ``certify`` stage (re-run by ``dvc repro`` only when the mechanism changes).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np

from dpml.ledger.ledger import Ledger, Spend
from dpml.accounting.mechanism import MechanismDescription

T = TypeVar("T")


def _nothing(spend: Spend) -> None:
    """No bookkeeping of the front door's own between the reservation and the start."""


@dataclass(frozen=True)
class Charge:
    """What one run asks of a ledger, all known before any record is read (:meth:`Ledger.reserve`'s terms).

    ``dataset_version``: the data the spend is for; ``mechanism``: the planned mechanism (``None``: a
    non-private run, recorded at ε = ∞); ``budget``/``kl_budget``: the per-unit limits; ``lineage``: the
    account charged; ``units``: the privacy units' digests (``None``: every unit of the lineage);
    ``mode``: ``refuse`` the run when a unit would go over budget, or ``exclude`` such units;
    ``before_start``: the front door's bookkeeping once the spend has its id (a failure there cancels it).
    """

    ledger: Ledger
    dataset_version: str
    mechanism: MechanismDescription | None
    purpose: str
    budget: float
    kl_budget: float | None = None
    lineage: str | None = None
    units: np.ndarray | None = None
    mode: Literal["refuse", "exclude"] = "refuse"
    before_start: Callable[[Spend], None] = _nothing


def reserve_and_start(charge: Charge) -> Spend:
    """Reserve the spend (:meth:`Ledger.reserve`; :class:`dpml.ledger.ledger.BudgetExceeded` over budget), call
    ``charge.before_start`` with it, and mark it ``started``; a failure in between cancels it and propagates."""
    ledger = charge.ledger
    spend = ledger.reserve(
        charge.dataset_version,
        charge.mechanism,
        charge.purpose,
        charge.budget,
        charge.kl_budget,
        lineage=charge.lineage,
        units=charge.units,
        mode=charge.mode,
    )
    try:
        charge.before_start(spend)
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


def refuse_if_refused(refusal: BaseException | None) -> None:
    """One process decides alone: a refused reservation stops the run."""
    if refusal is not None:
        raise refusal


def charged_run(
    charge: Charge | None,
    train: Callable[[dict[str, Any]], T],
    agree: Callable[[BaseException | None], None] = refuse_if_refused,
) -> tuple[T, Spend | None]:
    """The run core: reserve → start → train → record, for both front doors. Returns what ``train`` returned and
    the spend (``None`` for an uncharged run).

    ``charge``: ``None`` trains without a ledger (no ledger given, or a process of a distributed run other than
    the one that keeps the books). ``train(details)`` does the training; what it puts in ``details`` is recorded
    with the ``trained`` event. ``agree(refusal)`` is called with the reservation's error (or ``None``) before
    any training, in every process: a distributed run's processes agree there, so that none trains when the
    lead's reservation was refused; it must raise when any process was refused (a refusal it lets through is
    raised here).
    """
    spend, refusal = None, None
    if charge is not None:
        try:
            spend = reserve_and_start(charge)
        except BaseException as error:
            refusal = error
    if charge is None or spend is None:
        agree(refusal)
        if refusal is not None:
            raise refusal
        return train({}), None
    with training_recorded(charge.ledger, spend) as details:
        agree(None)  # a failure to agree after the start is recorded as the run's failure; the spend counts
        return train(details), spend
