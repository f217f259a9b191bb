"""What a stopped run spent, in one line, and the ledger event that settles its spend.

A run stopped from outside (Ctrl-C, SIGTERM, a Prefect cancellation: :mod:`dpml.interrupts`) has spent
ε exactly when its train stage reserved a spend and reached ``started`` (the trainer was handed the
records); a spend reserved and stopped before ``started`` was cancelled by the train stage itself and
counts for no one. Which spend is this run's: the train stage notes its spend in ``spend.json`` beside
the model, so the run compares that note with the one it found when it started (:func:`spend_note`),
and the spend's ``started`` event names the process that trained (another run in the same folders may
have written the note while this one waited for its turn).

:func:`settle_stopped_run` records the ``interrupted`` event on this run's spend when the run stopped
before registration began (nothing can have been released, so the spend is settled — the event is in
:data:`dpml.stages.register.RESOLVED`); a run stopped inside registration is left to the next run's
reconciliation, which finds whether its model version was completed (``released``) or not
(``release_abandoned``). Either way the spend stays counted: a started spend is never forgotten.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from dpml import io
from dpml.formatting import format_epsilon
from dpml.stages.layout import Layout
from dpml.stages.train import open_ledger

if TYPE_CHECKING:
    from dpml.config import Config

STOPPED_EVENT = "interrupted"
"""The ledger event of a spend whose run was stopped from outside before registration."""

BEFORE_REGISTRATION = ("ingest", "split", "preprocess", "train", "tune", "certify", "audit", "gate")
"""Stages after which a stop leaves nothing registered."""


SpendNote = tuple[int, int, int]
"""The identity of ``spend.json`` as a file (device, inode, modification time): the train stage writes it
by an atomic rename, so every new spend is a new file, even when a fresh ledger reuses a spend id."""


def spend_note(config: Config) -> SpendNote | None:
    """The identity of the spend note beside the trained model (``spend.json``), or None when there is none."""
    try:
        found = os.stat(Layout(config).spend)
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_mtime_ns


def noted_spend(config: Config) -> int | None:
    """The ledger spend noted beside the trained model (``spend.json``), or None."""
    try:
        return int(io.read_json(Layout(config).spend)["spend_id"])
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
        return None


def settle_stopped_run(config: Config, note_before: SpendNote | None, reason: str, stage: str | None = None) -> str:
    """Say what the stopped run spent: ``<reason> …: nothing was spent`` or ``… ε = 1.99 was spent
    (ledger spend 7 …)``. ``note_before``: :func:`spend_note` when the run started. ``stage``: the stage
    that was running when it stopped, where the caller knows it; before registration, the spend gets the
    ``interrupted`` event (once)."""
    where = f" during {stage}" if stage else ""
    spend_id = noted_spend(config)
    if spend_id is None or spend_note(config) == note_before:
        return f"{reason}{where}: nothing was spent"
    ledger = open_ledger(config)
    counted = {s.id: s for s in ledger.spends()}
    if spend_id not in counted:
        return (
            f"{reason}{where}: nothing was spent (ledger spend {spend_id} was reserved and cancelled before "
            "training began)"
        )
    spend, events = counted[spend_id], ledger.events(spend_id)
    started_by = next((detail.get("pid") for kind, detail in events if kind == "started"), None)
    if started_by is not None and started_by != os.getpid():  # another run's, written while this one waited
        return f"{reason}{where}: nothing was spent"
    if stage in BEFORE_REGISTRATION and STOPPED_EVENT not in {kind for kind, _ in events}:
        ledger.record_event(spend_id, STOPPED_EVENT, {"reason": reason, "stage": stage})
    if spend.mechanism is None:
        what = "a non-private run was recorded"
    elif spend.mechanism.guarantee == "kl":
        what = "a KL-private spend was made"
    else:
        what = f"ε = {format_epsilon(spend.epsilon_alone)} was spent"
    return f"{reason}{where}: {what} (ledger spend {spend_id}, lineage {spend.lineage!r}; it stays counted)" + (
        "; nothing was registered" if stage in BEFORE_REGISTRATION else ""
    )
