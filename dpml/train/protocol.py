"""The trainer protocol: everything the pipeline needs to know about one trainer, in one class.

A trainer is one module under :mod:`dpml.train.trainers` holding one subclass of :class:`Trainer`
and one line in :mod:`dpml.train.registry`. It declares

- ``name`` — the value of ``train.algorithm`` that selects it;
- ``settings`` — its member of the ``train`` section's discriminated union (a subclass of
  :class:`~dpml.sections.TrainSettings` whose ``algorithm`` is ``Literal[name]``), and
  ``sections`` — any top-level section of its own (``noisycgd:`` …);
- ``model_kinds`` — the model kinds it accepts, with the reason;
- :meth:`Trainer.check` — its cross-section rules (run once, when the configuration is validated);
- :meth:`Trainer.plan` — its mechanism description, known before training (the ledger reserves it);
- :meth:`Trainer.check_model` — checks of its model before any spend (the clipping probe);
- :meth:`Trainer.fit` — how it trains;
- :meth:`Trainer.certify` — how its certificate is made (by default: every accountant, smallest ε);
- ``gradient_canaries`` / :meth:`Trainer.audit_with_gradient_canaries` — what the audit may assume
  (white-box Dirac gradient canaries need a trainer that releases every iterate of clipped steps);
- :meth:`Trainer.search_problems`, :meth:`Trainer.search_plan`, :meth:`Trainer.candidate_config` —
  how ``dpml tune`` varies it.

Stages, audit, tuner and CLI ask the registry; none compares algorithm names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, get_args

import numpy as np
import torch

from dpml.models import ModelSpec, build_model, spec_for
from dpml.devices import pick_device
from dpml.accounting.accountants import certify
from dpml.accounting.mechanism import Event, MechanismDescription, PoissonGaussianSteps
from dpml.sections import ModelConfig, Section, TrainSettings
from dpml.train.dpsgd import GradientCanaries, TrainResult

if TYPE_CHECKING:
    from dpml.config import Config

MODEL_KINDS: tuple[str, ...] = get_args(ModelConfig.model_fields["kind"].annotation)


@dataclass(frozen=True)
class SearchPlan:
    """What a private hyperparameter search will do, fixed before the first candidate trains.

    ``mechanism``: the whole search's mechanism (candidates, noisy score, random count), reserved in
    the ledger. ``noise_multiplier``: σ every candidate trains with (None when the trainer has none).
    ``base_mu``: NoisyCGD's per-candidate GDP μ (each candidate's λ is calibrated to it).
    """

    mechanism: MechanismDescription
    noise_multiplier: float | None
    base_mu: float | None = None


class Trainer:
    """Base class of every trainer; the defaults describe a trainer with no special needs."""

    name: ClassVar[str]
    settings: ClassVar[type[TrainSettings]]
    sections: ClassVar[dict[str, type[Section]]] = {}
    model_kinds: ClassVar[tuple[str, ...]] = MODEL_KINDS
    model_kind_reason: ClassVar[str] = ""
    private: ClassVar[bool] = True
    guarantee: ClassVar[str] = "dp"  # "dp": (ε, δ) certificate; "kl": KL privacy; "none"
    gradient_canaries: ClassVar[bool] = False
    distributed: ClassVar[bool] = False  # runs across train.world_size processes (torch.distributed)
    summary: ClassVar[str] = ""

    # --- configuration -------------------------------------------------------------------------
    def check(self, config: Config) -> list[str]:
        """Cross-section problems of ``config`` for this trainer, one message per problem (each names its key)."""
        return []

    # --- before training -----------------------------------------------------------------------
    def noise_multiplier(self, config: Config) -> float | None:
        """σ the trainer will use (calibrated when the configuration gives a target ε); None if it has none."""
        return None

    def plan(self, config: Config, n: int, in_features: int, n_classes: int) -> MechanismDescription | None:
        """The mechanism this trainer will run on n records: known before training, for the ledger."""
        raise NotImplementedError

    def model_spec(self, config: Config, in_features: int, n_classes: int) -> ModelSpec:
        """The model this trainer trains (by default the configured kind, as configured)."""
        return spec_for(config.model, config.preprocess.clip_norm, in_features, n_classes)

    def check_model(self, config: Config, in_features: int, n_classes: int) -> list[str]:
        """Checks of the model this trainer will train, run before any spend; raises on a model it cannot
        train exactly and returns what the run's log should say (by default: nothing to check)."""
        return []

    def build_model(self, config: Config, in_features: int, n_classes: int, seed: int) -> torch.nn.Module:
        """A fresh model on the configured device, initialised from the public ``seed``."""
        torch.manual_seed(seed)
        return build_model(self.model_spec(config, in_features, n_classes)).to(pick_device(config.train.device))

    # --- training ------------------------------------------------------------------------------
    def fit(
        self,
        config: Config,
        x: np.ndarray,
        y: np.ndarray,
        n_classes: int,
        *,
        noise_multiplier: float | None,
        seed: int,
        noise_seed: int,
        canaries: GradientCanaries | None = None,
        progress: bool = False,
        held_out: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> TrainResult:
        """Train a fresh model on (x, y). ``seed`` fixes the initialisation (public); batches and noise come
        from ``noise_seed`` (secret for a released model). ``held_out``: records never trained on."""
        raise NotImplementedError

    # --- after training ------------------------------------------------------------------------
    def certify(self, mechanism: MechanismDescription, delta: float, train_metrics: dict[str, Any]) -> dict[str, Any]:
        """The certificate of the mechanism that ran: every accountant asked, the smallest valid ε kept."""
        return certify(mechanism, delta)

    def released_noise_multiplier(self, config: Config, mechanism: dict[str, Any]) -> float | None:
        """σ the released model was trained with (the audit's reference models train with the same)."""
        return float(mechanism["events"][0]["noise_multiplier"])

    def release_config(self, config: Config, train_metrics: dict[str, Any]) -> Config:
        """The configuration that reproduces the released model (for the audit's reference models)."""
        return config

    def audit_with_gradient_canaries(self, config: Config) -> bool:
        """Whether the audit may add white-box Dirac gradient canaries to a run of this trainer."""
        return self.gradient_canaries

    # --- private hyperparameter search ---------------------------------------------------------
    def search_problems(self, config: Config) -> list[str]:
        """Why ``dpml tune`` cannot search this configuration (empty: it can)."""
        return [f"train.algorithm = {self.name!r}: dpml tune cannot search this trainer"]

    def search_plan(self, config: Config, n_fit: int, n_total: int) -> SearchPlan:
        """σ (or μ) for the candidates and the whole search's mechanism, before the first candidate trains."""
        raise NotImplementedError

    def score_event(self, config: Config) -> Event:
        """The search's noisy validation count (sensitivity 1) as an event: by default a Gaussian with
        noise multiplier τ = ``tune.score_noise``, over-counted as sensitivity 2 under replace-one."""
        return PoissonGaussianSteps(1.0, config.tune.score_noise, 1)

    def candidate_config(self, config: Config, chosen: dict[str, Any], plan: SearchPlan, n_fit: int) -> Config:
        """The configuration one search candidate trains with."""
        return config.with_hyperparameters(chosen)


def make_tensors(config: Config, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The training records as tensors on the configured device."""
    device = pick_device(config.train.device)
    return torch.as_tensor(x, dtype=torch.float32, device=device), torch.as_tensor(y, device=device)


def refuse_canaries(trainer: str, canaries: GradientCanaries | None, why: str) -> None:
    """White-box gradient canaries are an audit of every clipped step: refuse them where that is not what ran."""
    if canaries is not None:
        raise ValueError(f"{trainer}: white-box gradient canaries {why}")
