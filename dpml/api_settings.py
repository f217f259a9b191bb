"""The settings of one :func:`dpml.train_private` call, held in the pipeline's own section models.

``train_private`` takes its settings as the objects that validate ``params.yaml``: ``dp=`` a
:class:`~dpml.sections.DpConfig` and ``train=`` a :class:`~dpml.train.trainers.dpsgd.DpSgdSettings`
(``train.algorithm: dpsgd``), so each setting is declared, defaulted and checked in one place for both
front doors, and a setting added to a section reaches the library with nothing else to change.

Its keyword arguments (``delta=``, ``learning_rate=`` …) are the same settings in a flatter spelling:
each keyword names a field of one of the two sections and is validated by it, and a setting given both
ways is refused. What only a library call has — a callable optimizer or loss, ``expected_batch_size``,
``privacy_units``, a ledger given as a path — is checked here too. Everything is checked before any
record is read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from pydantic import ValidationError
from torch import nn

from dpml.config import ConfigError, format_errors
from dpml.devices import pick_device
from dpml.sections import DpConfig, TrainSettings
from dpml.sections_stores import LedgerConfig
from dpml.train.clipping import LossFn
from dpml.train.distributed import check_world_size
from dpml.train.dpsgd import loss_function
from dpml.train.trainers.dpsgd import DpSgdSettings

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
OptimizerChoice = Union[str, OptimizerFactory]

DP_KEYS = tuple(DpConfig.model_fields)
"""The keywords that are ``dp`` settings."""
TRAIN_KEYS = tuple(k for k in DpSgdSettings.model_fields if k not in ("algorithm", "seed"))
"""The keywords that are ``train`` settings. ``train.algorithm`` is DP-SGD here, and ``train.seed`` (the
pipeline's initialisation of a model it builds) has no meaning for a model passed in: ``seed=`` is the
library's seed of batches and noise."""
ORIGIN = "dpml.train_private's settings"


@dataclass(frozen=True)
class LibrarySettings:
    """The checked settings of one call: the two sections, what the library adds to them, and q."""

    dp: DpConfig
    train: DpSgdSettings
    sample_rate: float
    loss: LossFn
    optimizer: OptimizerChoice


def _problem(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{key} = {value!r}: {allowed}")


def _section(kind: type[Any], given: Any, keywords: dict[str, Any], name: str) -> Any:
    """``given`` (a section object) or the section built from ``keywords``, never both; validated by it."""
    if given is not None and keywords:
        key, value = next(iter(keywords.items()))
        raise _problem(
            key,
            value,
            f"also given in {name}= ({name}.{key} = {getattr(given, key)!r}); give each "
            "setting once, as a keyword or in the section object",
        )
    try:  # a keyword is a Python value: strictly its field's type ('yes' is no boolean, 7.0 no count)
        if given is not None:
            return kind.model_validate(given.model_dump(exclude_unset=True))  # what was set stays set
        return kind.model_validate(keywords, strict=True)
    except ValidationError as error:
        raise ConfigError(format_errors(error, ORIGIN)) from None


def train_section(train: TrainSettings | None) -> TrainSettings | None:
    """``train=`` as given: a :class:`TrainSettings` of the DP-SGD trainer, without a ``seed``."""
    if train is None:
        return None
    if not isinstance(train, TrainSettings):  # another trainer's settings fail DpSgdSettings' own validation
        raise _problem(
            "train",
            type(train).__name__,
            "must be the DP-SGD trainer's settings (dpml.DpSgdSettings, "
            "or a TrainSettings of algorithm dpsgd); other trainers run in the pipeline",
        )
    if "seed" in train.model_fields_set:
        raise _problem(
            "train.seed",
            train.seed,
            "initialises a model the pipeline builds; train_private trains "
            "the model passed in (seed= fixes its batches and noise)",
        )
    return train


def library_settings(
    n: int, dp: DpConfig | None, train: TrainSettings | None, keywords: dict[str, Any], expected_batch_size: int | None
) -> LibrarySettings:
    """Every setting of the call checked, before any work; refusals name the key, the value and what is
    allowed. ``keywords``: the call's setting keywords (each a field of ``dp`` or ``train``)."""
    unknown = [k for k in keywords if k not in DP_KEYS + TRAIN_KEYS]
    if unknown:
        raise TypeError(
            f"dpml.train_private got an unknown setting {unknown[0]!r}; its settings are the dp "
            f"section's ({', '.join(DP_KEYS)}) and the train section's ({', '.join(TRAIN_KEYS)})"
        )
    if n == 0:
        raise _problem("dataset", "empty", "needs at least one record")
    given = {k: v for k, v in keywords.items() if v is not None}
    loss, optimizer = given.pop("loss", None), given.pop("optimizer", None)
    named = {
        k: v for k, v in (("loss", loss), ("optimizer", optimizer)) if v is not None and not callable(v)
    }  # a name goes to the section; a function is the library's own
    dp_section: DpConfig = _section(DpConfig, dp, {k: v for k, v in given.items() if k in DP_KEYS}, "dp")
    train_settings: DpSgdSettings = _section(
        DpSgdSettings, train_section(train), {k: v for k, v in {**given, **named}.items() if k in TRAIN_KEYS}, "train"
    )
    check_noise_and_delta(dp_section, n)
    sample_rate = check_sample_rate(train_settings, expected_batch_size, n)
    check_world(train_settings)
    loss_fn = (
        loss
        if callable(loss)
        else loss_function(train_settings.loss, train_settings.loss_tau, train_settings.loss_alpha)
    )
    return LibrarySettings(
        dp_section, train_settings, sample_rate, loss_fn, optimizer if callable(optimizer) else train_settings.optimizer
    )


def check_noise_and_delta(dp: DpConfig, n: int) -> None:
    """Exactly one of ``target_epsilon`` and ``noise_multiplier``; δ < 1/n unless allowed (a δ ≥ 1/n
    permits mechanisms that publish some record outright)."""
    if (dp.target_epsilon is None) == (dp.noise_multiplier is None):
        raise ValueError(
            f"give exactly one of target_epsilon and noise_multiplier (got target_epsilon="
            f"{dp.target_epsilon!r}, noise_multiplier={dp.noise_multiplier!r})"
        )
    if dp.delta >= 1.0 / n and not dp.allow_delta_above_inverse_n:
        raise _problem(
            "delta",
            dp.delta,
            f"is ≥ 1/n = {1.0 / n:.3g} for n = {n} records, which permits releasing "
            "some record outright; use δ ≪ 1/n (or allow_delta_above_inverse_n=True)",
        )


def check_sample_rate(train: DpSgdSettings, expected_batch_size: int | None, n: int) -> float:
    """The Poisson rate q: ``train.sample_rate``, or ``expected_batch_size`` / n — one of the two (a rate given
    as a keyword or in the section object is in the section's set fields either way)."""
    if expected_batch_size is None:
        return train.sample_rate
    if "sample_rate" in train.model_fields_set:
        raise ValueError(
            f"give exactly one of sample_rate and expected_batch_size (got sample_rate="
            f"{train.sample_rate!r}, expected_batch_size={expected_batch_size!r})"
        )
    if (
        isinstance(expected_batch_size, bool)
        or not isinstance(expected_batch_size, int)
        or not 1 <= expected_batch_size <= n
    ):
        raise _problem("expected_batch_size", expected_batch_size, f"must be an integer in [1, n = {n}]")
    return expected_batch_size / n


def check_world(train: DpSgdSettings) -> None:
    """The device and the processes the settings ask for exist here."""
    if train.device == "cuda" and not torch.cuda.is_available():
        raise _problem("device", train.device, "no CUDA device is available here")
    if train.world_size > 1:
        check_world_size(train.world_size, str(pick_device(train.device)), "world_size")


def check_workers(num_workers: int) -> None:
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise _problem("num_workers", num_workers, "must be an integer ≥ 0")


def ledger_terms(
    ledger: Any, epsilon_budget: float | None, lineage: str | None, privacy_units: Sequence[object] | None, n: int
) -> tuple[float | None, str | None]:
    """The budget each unit may spend and the lineage the run charges: from ``ledger=`` when it is the
    pipeline's :class:`~dpml.sections_stores.LedgerConfig` (``epsilon_budget``, ``dataset``), else the
    keywords; both checked (:func:`check_ledger`)."""
    if isinstance(ledger, LedgerConfig):
        for key, value in (("epsilon_budget", epsilon_budget), ("lineage", lineage)):
            if value is not None:
                raise _problem(
                    key,
                    value,
                    "also given in ledger= (a LedgerConfig holds epsilon_budget, and the "
                    "lineage as dataset); give each once",
                )
        if ledger.on_exhausted != "refuse":
            raise _problem(
                "ledger.on_exhausted",
                ledger.on_exhausted,
                "train_private trains on every record it is "
                "given, so only 'refuse' (leave people without budget out of the dataset yourself)",
            )
        epsilon_budget, lineage = ledger.epsilon_budget, ledger.dataset
    check_ledger(ledger, epsilon_budget, lineage, privacy_units, n)
    return epsilon_budget, lineage


def check_ledger(
    ledger: Any, epsilon_budget: float | None, lineage: str | None, privacy_units: Sequence[object] | None, n: int
) -> None:
    """A ledger needs the budget each unit may spend and the lineage it charges; ``privacy_units`` only
    with a ledger, one id per record, each unit at most once."""
    if ledger is not None:
        if epsilon_budget is None:
            raise _problem("epsilon_budget", None, "a ledger needs the budget each privacy unit may spend")
        if (
            isinstance(epsilon_budget, bool)
            or not isinstance(epsilon_budget, (int, float))
            or not math.isfinite(epsilon_budget)
            or epsilon_budget <= 0
        ):
            raise _problem("epsilon_budget", epsilon_budget, "must be a finite number > 0")
        if not lineage:
            raise _problem(
                "lineage",
                lineage,
                "a ledger needs the name of the data set's account (its lineage: "
                "lineage=, or dataset in a LedgerConfig)",
            )
    if privacy_units is not None:
        if ledger is None:
            raise _problem("privacy_units", "…", "only used to charge a ledger; pass ledger= too")
        check_privacy_units(privacy_units, n)


def check_privacy_units(privacy_units: Sequence[object], n: int) -> None:
    """One id per record, each unit at most once: DP-SGD bounds the influence of one record, so a person
    with two records would have twice the sensitivity the certificate assumes."""
    if len(privacy_units) != n:
        raise _problem("privacy_units", f"{len(privacy_units)} ids", f"must give one id per record (n = {n})")
    seen: dict[str, int] = {}
    for index, unit in enumerate(privacy_units):
        text = str(unit)
        if text in seen:
            raise _problem(
                "privacy_units",
                unit,
                f"appears at records {seen[text]} and {index}: keep one record per "
                "unit (the certificate bounds one record's influence)",
            )
        seen[text] = index
