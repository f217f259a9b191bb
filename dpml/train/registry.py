"""The trainer registry: ``train.algorithm`` → the :class:`~dpml.train.protocol.Trainer` that runs it.

Adding a trainer is adding one module under :mod:`dpml.train.trainers` and one line here (or a call
to :func:`register` from a plugin). Everything else — the configuration schema, the stages, the
audit, the tuner and the CLI — asks this registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpml.definitions import same_definition
from dpml.train.protocol import Trainer
from dpml.train.trainers.clipless import CLIPLESS
from dpml.train.trainers.dpsgd import DpGd, DpSgd
from dpml.train.trainers.noisycgd import NoisyCgd
from dpml.train.trainers.noisygd import NoisyGd
from dpml.train.trainers.nonprivate import NonPrivate
from dpml.train.trainers.onepass import OnePass

if TYPE_CHECKING:
    from dpml.config import Config

TRAINERS: dict[str, Trainer] = {}


def register(trainer: Trainer) -> Trainer:
    """Add ``trainer`` under its name (refusing a second trainer of the same name); the configuration schema
    is composed again from the registry when it next validates (:func:`dpml.config.config_model`), so that
    ``train.algorithm: <name>`` validates."""
    if trainer.name in TRAINERS and not (
        TRAINERS[trainer.name] is trainer or same_definition(type(TRAINERS[trainer.name]), type(trainer))
    ):
        raise ValueError(f"a trainer named {trainer.name!r} is already registered")
    TRAINERS[trainer.name] = trainer
    return trainer


def trainer_named(name: str) -> Trainer:
    try:
        return TRAINERS[name]
    except KeyError:
        raise ValueError(f"train.algorithm = {name!r}: unknown trainer; registered: {', '.join(TRAINERS)}") from None


def trainer_for(config: Config) -> Trainer:
    """The trainer ``config.train.algorithm`` selects."""
    return trainer_named(config.train.algorithm)


NONPRIVATE = NonPrivate()

for _trainer in (DpSgd(), DpGd(), CLIPLESS, NoisyCgd(), NoisyGd(), OnePass(), NONPRIVATE):
    register(_trainer)
