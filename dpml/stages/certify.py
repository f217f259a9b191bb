"""Stage certify: price the trainer's mechanism with every accountant; certify the smallest valid ε."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dpml import io
from dpml.accounting.mechanism import MechanismDescription
from dpml.stages.layout import Layout
from dpml.train.registry import trainer_for

if TYPE_CHECKING:
    from dpml.config import Config


def certify(config: Config) -> dict[str, Any]:
    """The certificate of the mechanism the trainer recorded (none for a non-private model).

    The trainer makes it (:meth:`Trainer.certify`): by default every accountant is asked and the
    smallest valid ε is kept; a trainer whose sensitivity is an analytic bound voids the certificate
    when its soundness check found the bound violated.
    """
    layout = Layout(config)
    payload = io.read_json(layout.mechanism)
    if payload is None:
        certificate = None
        metrics: dict[str, Any] = {"epsilon": float("inf"), "delta": config.dp.delta, "private": False}
    else:
        certificate = trainer_for(config).certify(
            MechanismDescription.from_dict(payload), config.dp.delta, io.read_json(layout.train_metrics)
        )
        metrics = {"epsilon": certificate["epsilon"], "delta": certificate["delta"], "private": True}
    io.write_json(layout.certificate, certificate)
    io.write_json(layout.certify_metrics, {k: (v if v != float("inf") else "inf") for k, v in metrics.items()})
    return {"certificate": certificate, **metrics}
