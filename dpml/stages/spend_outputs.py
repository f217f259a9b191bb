"""Every output of a run is tied to the spend that paid for it; registration releases nothing else.

The train stage records, with the spend's ``trained`` event in the ledger, the digest of what it
wrote (:func:`trained_outputs_digest`: the weights, the model spec and the mechanism). The audit and
the gate stamp that digest into their own outputs (``trained_outputs``) — the model they attacked and
judged. Before the register stage releases anything, :func:`check_outputs_of_spend` holds the files
against the ledger: the spend named by ``artifacts/train/spend.json`` must have finished training, the
training outputs must be the ones it recorded, the audit and the gate must be of that model, and the
certificate must price that mechanism. A run killed mid-training (its spend reserved, the previous
run's model still in place), a stage re-run by hand, or another run's outputs written between the
stages of a ``dvc repro`` are all refused with one line saying which file is not the spend's and what
to re-run — never registered under the wrong spend.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from dpml import io
from dpml.stages.layout import Layout

if TYPE_CHECKING:
    from dpml.ledger.ledger import Ledger

STAMP = "trained_outputs"
"""The key under which the audit and the gate record the digest of the training outputs they used."""


class NotTheSpendsOutputs(RuntimeError):
    """The stage outputs in place are not those of the spend they would be released under."""


def trained_outputs_digest(layout: Layout) -> str:
    """SHA-256 over the training outputs a release is made of: weights, model spec and mechanism."""
    digest = hashlib.sha256()
    for path in (layout.model, layout.model_spec, layout.mechanism):
        digest.update(path.name.encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def recorded_digest(ledger: Ledger, spend_id: int, spend_file: str) -> str:
    """The training-output digest the ledger recorded for ``spend_id`` when it finished training."""
    events = ledger.events(spend_id)
    if not events:
        raise NotTheSpendsOutputs(
            f"{spend_file} names spend {spend_id}, which is not in the ledger at "
            f"{ledger.location}: these outputs are not this ledger's; run the train stage"
        )
    trained = [detail for kind, detail in events if kind == "trained"]
    if not trained:
        seen = ", ".join(kind for kind, _ in events)
        raise NotTheSpendsOutputs(
            f"{spend_file} names spend {spend_id}, which never finished training (its "
            f"events: {seen}); the training outputs in place are not its model. Run the "
            "train stage (or the whole pipeline) again; the spend stays counted"
        )
    digest = trained[-1].get(STAMP)
    if not digest:
        raise NotTheSpendsOutputs(
            f"spend {spend_id} was trained by a dpml that did not record its outputs; run "
            "the train stage again to release a model"
        )
    return str(digest)


def check_outputs_of_spend(layout: Layout, ledger: Ledger) -> int:
    """Refuse (:class:`NotTheSpendsOutputs`, one line naming the file) unless every output the register
    stage releases belongs to the spend of ``spend.json`` (module docstring); return that spend's id."""
    spend_id = int(io.read_json(layout.spend)["spend_id"])
    expected = recorded_digest(ledger, spend_id, str(layout.spend))
    if trained_outputs_digest(layout) != expected:
        raise NotTheSpendsOutputs(
            f"{layout.model.parent}: the model, spec or mechanism there is not what spend "
            f"{spend_id} trained (another run or stage replaced it); run the train stage "
            "(or the whole pipeline) again"
        )
    for name, path in (("audit", layout.audit), ("gate", layout.gate)):
        stamped = _stamp_of(io.read_json(path))
        if stamped != expected:
            raise NotTheSpendsOutputs(
                f"{path}: the {name} stage judged another model than spend {spend_id}'s "
                f"({'no record of which' if stamped is None else 'another run'}); run "
                f"`dpml stage {name}` and the stages after it again"
            )
    certificate = io.read_json(layout.certificate)
    mechanism = io.read_json(layout.mechanism)
    if (certificate or {}).get("mechanism") != mechanism:
        raise NotTheSpendsOutputs(
            f"{layout.certificate}: it prices another mechanism than spend {spend_id}'s; run "
            "`dpml stage certify` and the stages after it again"
        )
    return spend_id


def _stamp_of(payload: Any) -> str | None:
    return payload.get(STAMP) if isinstance(payload, dict) else None


def stamp_for(layout: Layout) -> dict[str, str]:
    """``{"trained_outputs": digest}`` of the training outputs in place, for the audit and the gate."""
    return {STAMP: trained_outputs_digest(layout)}
