"""The one schema for ``params.yaml``.

Every parameter of a run lives in ``params.yaml`` (read by DVC for dependency tracking and by
Prefect / the CLI for execution). It is validated once, here, before any work starts. An invalid
value is rejected with a :class:`ConfigError` that names the key, the value and what is allowed.

Overrides use dotted keys (``dp.target_epsilon=2``); the value is parsed as YAML, so numbers,
booleans, ``null`` and lists work as they do in the file.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


SKLEARN_BUNDLED = ("digits", "iris", "wine", "breast_cancer")


class ConfigError(ValueError):
    """An invalid configuration: names each offending key, its value and what is allowed."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataConfig(_Section):
    """Where the raw records come from.

    ``source`` is one of ``sklearn:NAME`` (a scikit-learn *bundled* set: digits, iris, wine,
    breast_cancer), ``idx:DIR`` (MNIST-format IDX files), ``csv:PATH`` or ``parquet:PATH``.
    Tabular sources need ``label_column`` and ``feature_columns`` and, because the label set is a
    constant that must not be read off the private data, the list of ``classes``.
    """

    source: str = "sklearn:digits"
    label_column: str | None = None
    feature_columns: list[str] | None = None
    classes: list[str | int] | None = None

    @field_validator("source")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        scheme, sep, rest = value.partition(":")
        allowed = ("sklearn", "idx", "csv", "parquet")
        if not sep or scheme not in allowed or not rest:
            raise ValueError(f"must look like one of {', '.join(s + ':…' for s in allowed)}")
        if scheme == "sklearn" and rest not in SKLEARN_BUNDLED:
            raise ValueError(f"unknown bundled scikit-learn set; allowed: {', '.join(SKLEARN_BUNDLED)}")
        if scheme == "idx" and not Path(rest).is_dir():
            raise ValueError(f"directory {rest} does not exist")
        if scheme in ("csv", "parquet") and not Path(rest).is_file():
            raise ValueError(f"file {rest} does not exist")
        return value

    @model_validator(mode="after")
    def _tabular_needs_columns(self) -> "DataConfig":
        scheme = self.source.partition(":")[0]
        if scheme in ("csv", "parquet"):
            missing = [
                k for k in ("label_column", "feature_columns", "classes") if getattr(self, k) in (None, [])
            ]
            if missing:
                raise ValueError(f"a {scheme} source needs data.{', data.'.join(missing)}")
        return self


class SplitConfig(_Section):
    """Deterministic, seeded, stratified split into train / test / audit population.

    Sources with a predefined test part (IDX ``t10k``) keep it as the test set and ignore
    ``test_fraction``. The audit population is never trained on: it supplies the attacks'
    non-members.
    """

    seed: int = 0
    test_fraction: float = Field(0.2, gt=0, lt=1)
    audit_fraction: float = Field(0.2, gt=0, lt=1)
    max_train: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _fractions_leave_training_data(self) -> "SplitConfig":
        if self.test_fraction + self.audit_fraction >= 0.9:
            raise ValueError(
                f"split.test_fraction + split.audit_fraction = "
                f"{self.test_fraction + self.audit_fraction:g}: must be < 0.9 to leave training data"
            )
        return self


class PreprocessConfig(_Section):
    """Public scaling and input norm clipping.

    Features are mapped with *public* constants: x' = (clip(x, lower, upper) − lower) / (upper −
    lower); with ``features: scatternet`` each image (``image_shape``) becomes its ScatterNet
    features, normalised per example (:mod:`dpml.data.features`); then each record is projected
    onto the L2 ball of radius ``clip_norm`` (X0), or scaled onto its sphere with ``clip_mode:
    sphere``. No statistic of the private data is used.
    """

    lower: float = 0.0
    upper: float = 16.0
    clip_norm: float = Field(8.0, gt=0)
    clip_mode: Literal["project", "sphere"] = "project"
    features: Literal["none", "scatternet"] = "none"
    image_shape: list[int] | None = None
    scatter_groups: int = Field(27, gt=0)

    @model_validator(mode="after")
    def _bounds_ordered(self) -> "PreprocessConfig":
        if not self.upper > self.lower:
            raise ValueError(f"preprocess.upper = {self.upper}: must be > preprocess.lower = {self.lower}")
        if self.features == "scatternet":
            if self.image_shape is None or len(self.image_shape) != 2 or min(self.image_shape) < 4:
                raise ValueError(f"preprocess.image_shape = {self.image_shape}: ScatterNet features need the "
                                 "image's [height, width] (each ≥ 4)")
            if 81 % self.scatter_groups:
                raise ValueError(f"preprocess.scatter_groups = {self.scatter_groups}: must divide 81")
        return self


class ModelConfig(_Section):
    """The classifier.

    ``kind: mlp``: fully connected, ``hidden`` widths and ``activation`` ([] gives a linear model).
    ``kind: gated``: seed 001's convex gated-ReLU model — ``gates`` random hyperplanes drawn from
    ``gate_seed`` (public, stored with the model) and a linear model on the gated features.
    ``kind: lipschitz``: seed 004's Lipschitz network — an input bound at X0 (``preprocess.clip_norm``),
    spectrally normalised dense layers of the (even) ``hidden`` widths with GroupSort2 between them,
    biases in a ball of radius ``bias_bound`` (``null``: no biases); ``dense_layer: bjorck`` makes the
    dense layers gradient-norm preserving (Björck orthogonalisation); ``conv`` (even channel counts)
    puts 3×3 spectrally normalised convolutions, each followed by GroupSort2 and 2×2 L2-norm pooling,
    before them, on images of ``input_shape`` [C, H, W].
    ``kind: bias_free_relu``: seed 000's network — bias-free linear layers of the ``hidden`` widths with
    ReLU between them, initialised by ``init`` (Eq. 5: ``lecun`` β = 1/fan-in, ``he`` 2/fan-in,
    ``ntk`` 2/fan-out (1/o for the last layer), ``xavier`` 2/(fan-in + fan-out)).
    ``kind: random_features``: seed 002's f(x) = φ(Vx)ᵀθ with ``features`` = p random directions
    V ~ N(0, 1/d) from the public ``feature_seed`` (stored with the model), θ from 0, and φ =
    ``feature_activation`` (tanh, or ``tanh_even`` whose even part lets a reconstruction recover signs;
    both satisfy the Hermite conditions φ0 = φ2 = 0, φ1 ≠ 0). Train it with ``train.loss: squared``
    (``dpgd`` for seed 002's DP-GD); the audit then also runs the reconstruction attack.
    """

    kind: Literal["mlp", "gated", "lipschitz", "bias_free_relu", "random_features"] = "mlp"
    init: Literal["lecun", "he", "ntk", "xavier"] = "he"
    features: int = Field(1000, gt=0)
    feature_activation: Literal["tanh", "tanh_even"] = "tanh"
    feature_seed: int = 0
    hidden: list[int] = Field(default_factory=lambda: [64])
    activation: Literal["relu", "tanh"] = "tanh"
    gates: int = Field(64, gt=0)
    gate_seed: int = 0
    bias_bound: float | None = Field(1.0, ge=0)
    conv: list[int] = Field(default_factory=list)
    input_shape: list[int] | None = None
    dense_layer: Literal["spectral", "bjorck"] = "spectral"

    @field_validator("hidden")
    @classmethod
    def _positive_widths(cls, value: list[int]) -> list[int]:
        if any(w <= 0 for w in value):
            raise ValueError("every width must be a positive integer")
        return value


class TrainConfig(_Section):
    """The optimiser loop. ``algorithm``: ``dpsgd`` (Poisson-sampled DP-SGD, every iterate covered),
    ``dpgd`` (full-batch DP-GD, seed 002: ``sample_rate`` must be 1, one step per epoch),
    ``clipless`` (seed 004: no clipping, sensitivity from the Lipschitz model's bounds; ``loss`` must
    be ``tau_cross_entropy`` (CE(τz)/τ, τ = ``loss_tau``), ``multiclass_hinge``, ``kantorovich_rubinstein``
    or ``hinge_kantorovich_rubinstein`` (α = ``loss_alpha``), each with its proven constant; noise
    ``clipless_noise`` global or per layer; ``loss_clip_quantile`` γ turns on loss-gradient clipping at
    a private γ-quantile threshold (start ``loss_clip_initial``, geometric rate ``loss_clip_rate``, noise
    std ``loss_clip_count_noise`` on each step's count, charged in the certificate)),
    ``noisycgd`` (seed 001's noisy cyclic GD on the gated model, final model only; settings in the
    ``noisycgd`` section), ``noisygd`` (seed 000's noisy GD without clipping on the bias-free ReLU
    network: KL privacy, not (ε, δ)-DP; settings in the ``noisygd`` section; one full-batch step per
    epoch), ``onepass`` (seed 002's one-pass DP-SGD with aggressive clipping on a linear model,
    final model only, (ρ²/2)-zCDP by privacy amplification by iteration; settings in the ``onepass``
    section) or ``nonprivate`` (the baseline). ``loss``: cross-entropy, or the squared
    loss ½‖z − e_y‖² on the logits."""

    algorithm: Literal["dpsgd", "dpgd", "noisycgd", "noisygd", "onepass", "clipless", "nonprivate"] = "dpsgd"
    loss: Literal["cross_entropy", "squared", "tau_cross_entropy", "multiclass_hinge", "kantorovich_rubinstein",
                  "hinge_kantorovich_rubinstein"] = "cross_entropy"
    loss_tau: float = Field(1.0, gt=0)
    loss_alpha: float = Field(1.0, gt=0)
    clipless_noise: Literal["global", "per_layer"] = "global"
    loss_clip_quantile: float | None = Field(None, gt=0, lt=1)
    loss_clip_initial: float = Field(1.0, gt=0)
    loss_clip_count_noise: float = Field(50.0, gt=0)
    loss_clip_rate: float = Field(0.2, gt=0)
    epochs: float = Field(20.0, gt=0)
    sample_rate: float = Field(0.05, gt=0, le=1)
    optimizer: Literal["sgd", "adam"] = "sgd"
    learning_rate: float = Field(0.5, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    physical_batch_size: int = Field(1024, gt=0)


class DpConfig(_Section):
    """The privacy parameters.

    Exactly one of ``noise_multiplier`` (σ, the noise std divided by the clip norm) and
    ``target_epsilon`` (σ is then calibrated) must be given.
    """

    delta: float = Field(1e-5, gt=0, lt=1)
    clip_norm: float = Field(1.0, gt=0)
    noise_multiplier: float | None = Field(None, gt=0)
    target_epsilon: float | None = Field(None, gt=0)
    neighbouring: Literal["add-remove", "replace-one"] = "add-remove"
    allow_delta_above_inverse_n: bool = False


class NoisyCgdConfig(_Section):
    """NoisyCGD (``train.algorithm: noisycgd``; seed 001 Eq. 2.4, Theorem 2.8).

    ``batch_size`` b: the data are split once into ⌈n/b⌉ disjoint batches visited cyclically for
    ``train.epochs`` (an integer) epochs with step size ``train.learning_rate`` η. ``l2`` is λ;
    leave it ``null`` to calibrate it so that ε = ``dp.target_epsilon`` at the given
    ``dp.noise_multiplier``. The certificate is exact when ``dp.clip_norm`` ≥ the cross-entropy's
    gradient bound √(2P)·X0 (clipping never acts); a smaller clip norm relies on the paper's claim that
    clipping keeps the loss strongly convex and smooth, and needs
    ``assume_clipping_preserves_convexity: true`` (recorded in the certificate).
    """

    batch_size: int = Field(1000, gt=0)
    l2: float | None = Field(None, ge=0)
    assume_clipping_preserves_convexity: bool = False


class NoisyGdConfig(_Section):
    """Noisy GD without clipping (``train.algorithm: noisygd``; seed 000, App. E).

    ``train.epochs`` (an integer) full-batch steps W ← W − η∇L + sqrt(2ησ²)·Z, η =
    ``train.learning_rate``. Give exactly one of ``sigma`` (σ) and ``kl_target`` (σ² = 2BT/(KL n²),
    Cor. 6.4). The guarantee is **KL privacy** (replace-one), certified by Cor. 4.2 only for the
    ``linearised`` network (first-order expansion at the random initialisation); with
    ``linearised: false`` training runs but there is no certificate (the gate fails), only the
    estimated KL. ``kl_probes``: records used for that estimate (training records for remove-one,
    audit-population records for add-one); 0 turns it off.
    """

    sigma: float | None = Field(None, gt=0)
    kl_target: float | None = Field(None, gt=0)
    linearised: bool = True
    kl_probes: int = Field(8, ge=0)


class OnePassConfig(_Section):
    """One-pass DP-SGD with aggressive clipping (``train.algorithm: onepass``; seed 002).

    Each training record is used once, in a secret random order, by a linear model (``model.kind:
    mlp`` with ``hidden: []``) with the squared loss on one-hot targets; per-example gradients are
    clipped to C = ``clip_constant``·√d; learning rates η_k = η̃(k/n)/n with η̃(0) = ``eta0`` and
    ``schedule`` ``out`` (constant: all the noise on the last step) or ``const`` (η̃(t) = η̃(0)·√(1 − t):
    constant noise); the noise schedule is the least that makes the last iterate meet
    ``dp.target_epsilon`` (only the final model is released). Requires η_k ≤ 2/(X0² + 1).
    """

    schedule: Literal["out", "const"] = "out"
    eta0: float = Field(1.0, gt=0)
    clip_constant: float = Field(1.0, gt=0)


AttackName = Literal["loss", "lira-online", "lira-offline", "lira-online-per-example", "rmia-online", "rmia-offline"]


class AuditConfig(_Section):
    """Membership-inference audit of the trained model, its positive control and one-run audits.

    The positive control is the same model trained without DP on the same split, with its own
    (non-private) optimiser settings ``control_*`` so that it is trained the way a non-private
    model would be; its reference models use the same settings.

    Candidates: up to ``max_records`` members (training records) and as many non-members (audit
    population); the rest of the audit population is RMIA's population z. ``references``
    reference models per target (DP and non-private control) train on random halves of train ∪
    audit population. Empirical ε lower bounds are computed at ``confidence`` (Bonferroni-split
    over the bounds the gate uses). For a ``random_features`` model the audit also runs seed 002's
    reconstruction attack on the target and the control, when the training set has at most
    ``reconstruction_max_train`` records (``reconstruction_restarts`` random starts of
    ``reconstruction_steps`` projected Adam steps each).
    """

    reconstruction_max_train: int = Field(300, gt=0)
    reconstruction_restarts: int = Field(8, gt=0)
    reconstruction_steps: int = Field(500, gt=0)
    attacks: list[AttackName] = Field(default_factory=lambda: ["loss", "lira-online", "lira-offline",
                                                                 "rmia-online", "rmia-offline"])
    references: int = Field(4, ge=0, le=256)
    max_records: int = Field(2000, gt=0)
    seed: int = 0
    rmia_a: float = Field(0.3, ge=0, le=1)
    rmia_gamma: float = Field(1.0, gt=0)
    confidence: float = Field(0.95, gt=0.5, lt=1)
    bound_correction: Literal["split", "bonferroni"] = "split"
    bootstrap: int = Field(200, ge=0)
    control: bool = True
    control_optimizer: Literal["sgd", "adam"] = "adam"
    control_learning_rate: float = Field(1e-3, gt=0)
    control_epochs: float = Field(30.0, gt=0)
    control_min_tpr_at_1pct_fpr: float = Field(0.01, ge=0, le=1)
    require_control_power: bool = False
    white_box_canaries: int = Field(1000, ge=0)
    black_box_canaries: int = Field(500, ge=0)
    one_run_guess_fraction: float = Field(0.2, gt=0, le=1)
    workers: int = Field(2, ge=1)
    dask_address: str | None = None

    @model_validator(mode="after")
    def _attacks_have_references(self) -> "AuditConfig":
        if not self.attacks:
            raise ValueError("audit.attacks: name at least one attack")
        needing = [a for a in self.attacks if a != "loss"]
        if needing and self.references < 1:
            raise ValueError(f"audit.references = 0 but attacks {needing} need reference models (use ≥ 1, or only loss)")
        return self


TUNABLE_KEYS = ("train.learning_rate", "train.momentum", "train.optimizer", "model.hidden", "model.activation",
                "model.gates")


class TuneConfig(_Section):
    """``dpml tune``: a private hyperparameter search (Papernot & Steinke 2022).

    K candidates run, K drawn from ``distribution`` (``poisson`` with E[K] = ``mean``;
    ``truncated_negative_binomial`` with shape η = ``shape`` and E[K] = ``mean``; ``fixed``: K =
    ``mean``). Each draws its hyperparameters uniformly from ``space`` (keys from
    :data:`TUNABLE_KEYS`: none of them changes the mechanism's σ, q or steps), trains with the
    configured private trainer (DP-SGD, or NoisyCGD with λ calibrated per candidate) on the
    training part minus a validation part of ``validation_fraction``, and is scored by its
    validation accuracy with Gaussian noise of std ``score_noise`` on the count of correct answers.
    Only the best candidate is released; the certificate charges the whole search.
    """

    distribution: Literal["poisson", "truncated_negative_binomial", "fixed"] = "truncated_negative_binomial"
    mean: float = Field(3.0, ge=1)
    shape: float = Field(1.0, ge=0)
    validation_fraction: float = Field(0.15, gt=0, lt=1)
    score_noise: float = Field(5.0, gt=0)
    seed: int = 0
    space: dict[str, list[Any]] = Field(default_factory=lambda: {"train.learning_rate": [0.5, 1.0, 2.0]})

    @model_validator(mode="after")
    def _valid_search(self) -> "TuneConfig":
        if self.distribution == "fixed" and self.mean != int(self.mean):
            raise ValueError(f"tune.mean = {self.mean}: a fixed number of candidates must be an integer")
        if self.distribution == "truncated_negative_binomial" and self.mean <= 1:
            raise ValueError(f"tune.mean = {self.mean}: a truncated negative binomial needs E[K] > 1")
        if not self.space:
            raise ValueError("tune.space: name at least one hyperparameter to search")
        for key, values in self.space.items():
            if key not in TUNABLE_KEYS:
                raise ValueError(f"tune.space key {key!r}: not tunable; allowed: {', '.join(TUNABLE_KEYS)} "
                                 "(the others change the privacy mechanism or the data)")
            if not isinstance(values, list) or not values:
                raise ValueError(f"tune.space[{key!r}] = {values!r}: must be a non-empty list of values")
        return self


class GateConfig(_Section):
    """Release gate: the model becomes ``champion`` only when certified ε ≤ ``epsilon_budget``.

    A KL-private model (``train.algorithm: noisygd``) has no finite ε; it passes only when
    ``kl_budget`` is set and its certified KL ≤ ``kl_budget`` (the report says it is not (ε, δ)-DP).
    """

    epsilon_budget: float = Field(4.0, gt=0)
    kl_budget: float | None = Field(None, gt=0)


class LedgerConfig(_Section):
    """The privacy budget ledger: composed ε of every run on a dataset version, at ``delta``.

    KL-private runs (seed 000) are summed in KL (the chain rule composes adaptively) against
    ``kl_budget`` (``null``: refused). A dataset with a KL-only release has no finite (ε, δ) total,
    and (ε, δ)-DP runs have no KL bound, so the two kinds exclude each other on one dataset version.
    """

    path: str = "ledger.db"
    epsilon_budget: float = Field(10.0, gt=0)
    delta: float = Field(1e-5, gt=0, lt=1)
    kl_budget: float | None = Field(None, gt=0)


class TrackingConfig(_Section):
    """MLflow. ``MLFLOW_TRACKING_URI`` in the environment overrides ``uri``."""

    uri: str = "sqlite:///mlflow.db"
    artifact_root: str = "mlartifacts"
    experiment: str = "dpml"
    registered_model: str = "dpml-model"


class PathsConfig(_Section):
    """Where stage outputs go (relative paths are relative to the working directory)."""

    data: str = "data"
    artifacts: str = "artifacts"
    cache: str = ".dpml-cache"


class Config(_Section):
    data: DataConfig = Field(default_factory=DataConfig)
    split: SplitConfig = Field(default_factory=SplitConfig)
    preprocess: PreprocessConfig = Field(default_factory=PreprocessConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    dp: DpConfig = Field(default_factory=DpConfig)
    noisycgd: NoisyCgdConfig = Field(default_factory=NoisyCgdConfig)
    noisygd: NoisyGdConfig = Field(default_factory=NoisyGdConfig)
    onepass: OnePassConfig = Field(default_factory=OnePassConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    tune: TuneConfig = Field(default_factory=TuneConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    ledger: LedgerConfig = Field(default_factory=LedgerConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    paths: PathsConfig = Field(default_factory=PathsConfig)

    @model_validator(mode="after")
    def _privacy_settings_consistent(self) -> "Config":
        dp = self.dp
        if self.train.algorithm == "noisycgd":
            _check_noisycgd(self)
        if self.train.algorithm == "clipless":
            _check_clipless(self)
        if self.train.algorithm == "noisygd":
            _check_noisygd(self)
        if self.train.algorithm == "onepass":
            _check_onepass(self)
        if self.model.kind == "lipschitz" and any(width % 2 for width in self.model.hidden):
            raise ValueError(f"model.hidden = {self.model.hidden}: a lipschitz model needs even widths (GroupSort2)")
        if self.train.algorithm == "dpgd" and self.train.sample_rate != 1.0:
            raise ValueError(f"train.sample_rate = {self.train.sample_rate:g}: DP-GD (train.algorithm = 'dpgd') uses the "
                             "full batch at every step; set train.sample_rate: 1")
        elif (self.train.algorithm in ("dpsgd", "dpgd", "clipless")
              and (dp.noise_multiplier is None) == (dp.target_epsilon is None)):
            raise ValueError(
                "give exactly one of dp.noise_multiplier and dp.target_epsilon "
                f"(got noise_multiplier={dp.noise_multiplier}, target_epsilon={dp.target_epsilon})"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def flat(self) -> dict[str, Any]:
        """``{"dp.delta": 1e-5, …}``: the form logged as MLflow params."""
        out: dict[str, Any] = {}
        for section, values in self.to_dict().items():
            for key, value in values.items():
                out[f"{section}.{key}"] = value
        return out


LIPSCHITZ_LOSSES = ("tau_cross_entropy", "multiclass_hinge", "kantorovich_rubinstein", "hinge_kantorovich_rubinstein")


def _lipschitz_spec_problems(config: Config) -> list[str]:
    """The Lipschitz network's own checks (even widths, conv shapes), reported with model.* keys."""
    from dpml.models.lipschitz import LipschitzSpec

    model = config.model
    shape = None if model.input_shape is None else tuple(model.input_shape)
    if shape is not None and len(shape) != 3:
        return [f"model.input_shape = {model.input_shape}: give [channels, height, width]"]
    in_features = 1 if shape is None else shape[0] * shape[1] * shape[2]
    spec = LipschitzSpec(in_features, tuple(model.hidden), 2, config.preprocess.clip_norm, model.bias_bound,
                         conv=tuple(model.conv), input_shape=shape, dense_layer=model.dense_layer)  # type: ignore[arg-type]
    try:
        spec.validate()
    except ValueError as error:
        return [f"model: {error}"]
    return []


def _check_clipless(config: Config) -> None:
    """Clipless DP-SGD needs the bounds' ingredients: a Lipschitz model and a Lipschitz loss."""
    problems = []
    if config.model.kind != "lipschitz":
        problems.append(f"model.kind = {config.model.kind!r}: clipless DP-SGD bounds gradients through a Lipschitz "
                        "network; use model.kind: lipschitz")
    if config.train.loss not in LIPSCHITZ_LOSSES:
        problems.append(f"train.loss = {config.train.loss!r}: clipless DP-SGD needs a Lipschitz loss "
                        f"({', '.join(LIPSCHITZ_LOSSES)})")
    if config.model.kind == "lipschitz":
        problems += _lipschitz_spec_problems(config)
    if config.train.loss_clip_quantile is not None and config.dp.target_epsilon is None:
        problems.append("train.loss_clip_quantile: loss clipping needs dp.target_epsilon (σ is then calibrated for the "
                        "gradient and the quantile's count together)")
    if problems:
        raise ValueError("train.algorithm = 'clipless':\n    " + "\n    ".join(problems))


def _check_onepass(config: Config) -> None:
    """What privacy amplification by iteration needs, checked before any work (each message names the key)."""
    train, dp, model = config.train, config.dp, config.model
    problems = []
    if model.kind != "mlp" or model.hidden:
        problems.append(f"model.kind = {model.kind!r}, model.hidden = {model.hidden}: one-pass DP-SGD trains a linear "
                        "model (its loss must be convex); use model.kind: mlp with hidden: []")
    if train.loss != "squared":
        problems.append(f"train.loss = {train.loss!r}: one-pass DP-SGD is analysed for the squared loss (clipped: Huber)")
    if dp.neighbouring != "replace-one":
        problems.append(f"dp.neighbouring = {dp.neighbouring!r}: the analysis replaces one record; set replace-one")
    if dp.target_epsilon is None or dp.noise_multiplier is not None:
        problems.append("dp.target_epsilon: required (it fixes ρ and so the noise schedule); dp.noise_multiplier must be null")
    if train.epochs != 1:
        problems.append(f"train.epochs = {train.epochs:g}: one-pass DP-SGD uses each record once; set train.epochs: 1")
    if problems:
        raise ValueError("train.algorithm = 'onepass':\n    " + "\n    ".join(problems))


def _check_noisygd(config: Config) -> None:
    """What Cor. 4.2's certificate assumes, checked before any work (each message names the key)."""
    train, dp, gd = config.train, config.dp, config.noisygd
    problems = []
    if config.model.kind != "bias_free_relu":
        problems.append(f"model.kind = {config.model.kind!r}: seed 000's bound is for the bias-free ReLU network; "
                        "use model.kind: bias_free_relu (with model.init)")
    if dp.neighbouring != "replace-one":
        problems.append(f"dp.neighbouring = {dp.neighbouring!r}: the KL bound is stated for replace-one neighbours; "
                        "set dp.neighbouring: replace-one")
    if train.loss != "cross_entropy":
        problems.append(f"train.loss = {train.loss!r}: the bound uses the cross-entropy's ‖softmax − e_y‖² ≤ 2")
    if train.sample_rate != 1.0:
        problems.append(f"train.sample_rate = {train.sample_rate:g}: noisy GD uses the full batch; set train.sample_rate: 1")
    if train.optimizer != "sgd" or train.momentum != 0:
        problems.append(f"train.optimizer = {train.optimizer!r}, train.momentum = {train.momentum:g}: noisy GD takes "
                        "plain gradient steps (sgd, momentum 0)")
    if train.epochs != int(train.epochs):
        problems.append(f"train.epochs = {train.epochs:g}: noisy GD takes one full-batch step per epoch (an integer)")
    if (gd.sigma is None) == (gd.kl_target is None):
        problems.append(f"give exactly one of noisygd.sigma and noisygd.kl_target (got sigma={gd.sigma}, "
                        f"kl_target={gd.kl_target})")
    if dp.noise_multiplier is not None or dp.target_epsilon is not None:
        problems.append("dp.noise_multiplier / dp.target_epsilon: not used by noisy GD (its noise is noisygd.sigma or "
                        "noisygd.kl_target); remove them")
    if problems:
        raise ValueError("train.algorithm = 'noisygd':\n    " + "\n    ".join(problems))


def _check_noisycgd(config: Config) -> None:
    """Everything Theorem 2.8 needs, checked before any work (each message names the key)."""
    from dpml.models.gated import lipschitz_bound, smoothness_bound

    train, dp, cgd, model = config.train, config.dp, config.noisycgd, config.model
    problems = []
    if model.kind != "gated":
        problems.append(f"model.kind = {model.kind!r}: NoisyCGD's hidden-state bound needs a strongly convex loss; "
                        "use model.kind: gated (or train.algorithm: dpsgd)")
    if dp.neighbouring != "replace-one":
        problems.append(f"dp.neighbouring = {dp.neighbouring!r}: NoisyCGD's fixed partition is analysed under "
                        "replace-one only; set dp.neighbouring: replace-one")
    if dp.noise_multiplier is None:
        problems.append("dp.noise_multiplier: required for NoisyCGD (dp.target_epsilon then calibrates noisycgd.l2)")
    if (dp.target_epsilon is None) == (cgd.l2 is None):
        problems.append(f"give exactly one of dp.target_epsilon and noisycgd.l2 (got target_epsilon={dp.target_epsilon}, "
                        f"l2={cgd.l2})")
    if train.optimizer != "sgd" or train.momentum != 0:
        problems.append(f"train.optimizer = {train.optimizer!r}, train.momentum = {train.momentum:g}: NoisyCGD takes "
                        "plain gradient steps (sgd, momentum 0); the bound does not cover other optimisers")
    if train.epochs != int(train.epochs):
        problems.append(f"train.epochs = {train.epochs:g}: NoisyCGD runs whole epochs (an integer)")
    smoothness = smoothness_bound(model.gates, config.preprocess.clip_norm, train.loss, cgd.l2 or 0.0)
    if train.learning_rate >= 2.0 / smoothness:
        problems.append(f"train.learning_rate = {train.learning_rate:g}: must be < 2/β = {2.0 / smoothness:.6g} "
                        f"(β = κ·P·X0² + λ = {smoothness:.6g} for {model.gates} gates, X0 = preprocess.clip_norm = "
                        f"{config.preprocess.clip_norm:g}, {train.loss}); lower it, or lower X0 or the number of gates")
    bound = lipschitz_bound(model.gates, config.preprocess.clip_norm, train.loss)
    if (bound is None or dp.clip_norm < bound) and not cgd.assume_clipping_preserves_convexity:
        limit = "the squared loss has no gradient bound" if bound is None else f"below √(2P)·X0 = {bound:.6g}"
        problems.append(f"dp.clip_norm = {dp.clip_norm:g}: {limit}, so clipping would act and Theorem 2.8's convexity "
                        "hypotheses are not proven for the clipped multi-class update; raise dp.clip_norm to the bound, "
                        "or set noisycgd.assume_clipping_preserves_convexity: true (recorded in the certificate)")
    if problems:
        raise ValueError("train.algorithm = 'noisycgd':\n    " + "\n    ".join(problems))


def _format_errors(error: ValidationError, origin: str) -> str:
    lines = [f"invalid configuration ({origin}):"]
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"])
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            lines.append(f"  {key} = {item['input']!r}: unknown key")
        elif item["type"] == "missing":
            lines.append(f"  {key}: required")
        elif key and "input" in item and not isinstance(item["input"], dict):
            lines.append(f"  {key} = {item['input']!r}: {msg}")
        else:
            lines.append(f"  {key or '(top level)'}: {msg}")
    return "\n".join(lines)


def _check_finite(raw: Any, prefix: str = "") -> None:
    if isinstance(raw, dict):
        for k, v in raw.items():
            _check_finite(v, f"{prefix}{k}.")
    elif isinstance(raw, float) and not math.isfinite(raw):
        raise ConfigError(f"invalid configuration:\n  {prefix[:-1]} = {raw}: must be a finite number")


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (value parsed as YAML) to a raw config mapping."""
    result = copy.deepcopy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) != 2 or not all(parts):
            raise ConfigError(f"invalid override {item!r}: expected section.key=value, e.g. dp.target_epsilon=2")
        section, name = parts
        value = yaml.safe_load(text) if text.strip() else None
        target = result.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"invalid override {item!r}: {section} is not a section")
        target[name] = value
    return result


def validate(raw: Any, origin: str = "params") -> Config:
    """Validate a raw mapping into a :class:`Config`, or raise :class:`ConfigError`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"invalid configuration ({origin}): expected a mapping of sections, got {type(raw).__name__}")
    _check_finite(raw)
    try:
        return Config.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(_format_errors(error, origin)) from None


def with_hyperparameters(config: Config, chosen: dict[str, Any]) -> Config:
    """``config`` with ``{"train.learning_rate": 0.5, …}`` applied and validated again."""
    overrides = [f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
                 for key, value in chosen.items()]
    return validate(apply_overrides(config.to_dict(), overrides), origin=f"hyperparameters {chosen}")


def check_tunable(config: Config) -> None:
    """Reject a search that cannot run, before any work: every candidate must be a valid config."""
    problems = []
    if config.train.algorithm in ("nonprivate", "noisygd"):
        problems.append(f"  train.algorithm = {config.train.algorithm!r}: dpml tune searches (ε, δ)-DP runs only; "
                        "a search over KL-private runs has no selection theorem here")
    if config.train.algorithm == "noisycgd" and config.dp.target_epsilon is None:
        problems.append("  dp.target_epsilon: required for a NoisyCGD search (it fixes every candidate's μ, and so its λ; "
                        "noisycgd.l2 must then be null)")
    if (config.tune.distribution != "fixed" and config.dp.neighbouring != "add-remove"
            and config.train.algorithm != "noisycgd"):
        problems.append(f"  dp.neighbouring = {config.dp.neighbouring!r}: a random-count search "
                        f"(tune.distribution = {config.tune.distribution}) is certified for add-remove only; "
                        "use add-remove or tune.distribution: fixed")
    for key, values in config.tune.space.items():
        for value in values:
            try:
                with_hyperparameters(config, {key: value})
            except ConfigError as error:
                problems.append(f"  tune.space[{key!r}] value {value!r}: " + str(error).splitlines()[-1].strip())
    if problems:
        raise ConfigError("invalid configuration for dpml tune:\n" + "\n".join(problems))


def load(path: str | Path = "params.yaml", overrides: list[str] | None = None) -> Config:
    """Read, override and validate ``params.yaml``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"configuration file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    if overrides:
        raw = apply_overrides(raw or {}, overrides)
    return validate(raw, origin=str(path))
