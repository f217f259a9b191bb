"""The common sections of ``params.yaml``: every section that is not a trainer's own.

Each trainer declares its own settings (its member of the ``train`` union and any section of its
own) in its module under :mod:`dpml.train.trainers`; :mod:`dpml.config` composes them with these
into the one validated :class:`~dpml.config.Config`. They live in their own module so that trainer
modules can import them without importing the composed configuration (which imports the trainers).
"""

from __future__ import annotations

import math
import sys
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from dpml.audit.attacks import ATTACKS
from dpml.models.custom import load_factory


class Section(BaseModel):
    """A frozen section that rejects unknown keys, and numbers that are not numbers.

    Every number of every section (budgets, ε, δ, σ, clip norms, bounds …) must be finite whatever its
    spelling: ``allow_inf_nan=False`` refuses ``inf``/``nan`` given as numbers and as the text pydantic
    would otherwise coerce (``"inf"``, ``"-Infinity"``, ``"nan"``, ``"1e999"``). A boolean is not a number:
    ``epsilon_budget: yes`` (YAML 1.1's ``yes``, ``on`` …) is refused instead of read as 1.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        for name, item in value.items():
            field = cls.model_fields.get(name) if isinstance(name, str) else None
            kind = _number_kind(field.annotation) if field is not None else None
            flags = [item] if kind == "number" else list(item) if kind == "list" and isinstance(item, list) else []
            if any(isinstance(flag, bool) for flag in flags):
                raise PydanticCustomError(
                    BOOLEAN_FOR_NUMBER,
                    "a boolean (YAML reads yes/no/on/off/true/false as booleans), not a number",
                    {"field": name, "value": repr(item)},
                )
        return value


BOOLEAN_FOR_NUMBER = "boolean_for_number"  # the error type :func:`dpml.config.format_errors` places at its key


def _number_kind(annotation: Any) -> str | None:
    """``"number"`` for an ``int``/``float`` field (optionally ``None``), ``"list"`` for a list of them."""
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    members = tuple(m for m in members if m is not type(None))
    if members and all(m in (int, float) for m in members):
        return "number"
    if len(members) == 1 and get_origin(members[0]) is list and _number_kind(get_args(members[0])[0]) == "number":
        return "list"
    return None


def check_scalable(prefix: str, lower: float, upper: float) -> None:
    """Bounds a feature can be scaled by: (x − lower)/(upper − lower) needs a finite, positive width. Bounds
    such as ±1e308 are finite, but their width overflows to infinity and scaled values become 0 or NaN:
    refused at validation, before any ε is spent (:mod:`dpml.data.preprocess`)."""
    width = upper - lower
    if not math.isfinite(width) or width <= 0 or not math.isfinite(1.0 / width):
        raise ValueError(
            f"{prefix}lower = {lower:g}, {prefix}upper = {upper:g}: upper − lower = {width:g} cannot "
            "scale a value into [0, 1] (it overflows a 64-bit float); declare bounds whose difference "
            f"is finite, below {sys.float_info.max:.3g}"
        )


class SplitConfig(Section):
    """Deterministic, seeded split of the privacy units into train / test / audit population: each unit
    keeps one row and is placed by its own seeded draw, so it stays in its part as the table grows
    (:mod:`dpml.data.split`).

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


class PreprocessConfig(Section):
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
        check_scalable("preprocess.", self.lower, self.upper)
        if self.features == "scatternet":
            if self.image_shape is None or len(self.image_shape) != 2 or min(self.image_shape) < 4:
                raise ValueError(
                    f"preprocess.image_shape = {self.image_shape}: ScatterNet features need the "
                    "image's [height, width] (each ≥ 4)"
                )
            if 81 % self.scatter_groups:
                raise ValueError(f"preprocess.scatter_groups = {self.scatter_groups}: must divide 81")
        return self


class ModelConfig(Section):
    """The classifier.

    ``kind: mlp``: fully connected, ``hidden`` widths and ``activation`` ([] gives a linear model).
    ``kind: gated``: Koskela's convex gated-ReLU model — ``gates`` random hyperplanes drawn from
    ``gate_seed`` (public, stored with the model) and a linear model on the gated features.
    ``kind: lipschitz``: the Lipschitz network of Béthune et al. — an input bound at X0 (``preprocess.clip_norm``),
    spectrally normalised dense layers of the (even) ``hidden`` widths with GroupSort2 between them,
    biases in a ball of radius ``bias_bound`` (``null``: no biases); ``dense_layer: bjorck`` makes the
    dense layers gradient-norm preserving (Björck orthogonalisation); ``conv`` (even channel counts)
    puts 3×3 spectrally normalised convolutions, each followed by GroupSort2 and 2×2 L2-norm pooling,
    before them, on images of ``input_shape`` [C, H, W].
    ``kind: bias_free_relu``: the network of Ye et al. (*Initialization Matters*) — bias-free linear layers of the
    ``hidden`` widths with ReLU between them, initialised by ``init`` (Eq. 5: ``lecun`` β = 1/fan-in, ``he`` 2/fan-in,
    ``ntk`` 2/fan-out (1/o for the last layer), ``xavier`` 2/(fan-in + fan-out)).
    ``kind: random_features``: Mondelli's random-features model f(x) = φ(Vx)ᵀθ with ``features`` = p random
    directions V ~ N(0, 1/d) from the public ``feature_seed`` (stored with the model), θ from 0, and φ =
    ``feature_activation`` (tanh, or ``tanh_even`` whose even part lets a reconstruction recover signs;
    both satisfy the Hermite conditions φ0 = φ2 = 0, φ1 ≠ 0). Train it with ``train.loss: squared``
    (``dpgd`` for its DP-GD with the 'privacy for free' hyperparameters); the audit then also runs the
    reconstruction attack.
    ``kind: cnn``: ``channels`` blocks of 3×3 convolution → GroupNorm (``norm_groups``) → ``activation`` →
    2×2 average pooling on images of ``input_shape`` [C, H, W], then dense layers of the ``hidden`` widths.
    ``kind: wide_resnet``: WRN-``depth``-``widen`` with GroupNorm of ``norm_groups`` groups (WRN-16-4 is the
    standard DP-SGD image model) on images of ``input_shape``.
    ``kind: custom``: the user's module, ``factory: package.module:function`` called as
    ``function(input_shape, n_classes, **options)`` (:mod:`dpml.models.custom`); ``inputs``: how it is
    called (``auto``: with ``input_ids`` and ``attention_mask`` keywords when its forward names them, else
    with one tensor; ``tokens`` or ``tensor`` insist), :mod:`dpml.models.library`.
    """

    kind: Literal["mlp", "gated", "lipschitz", "bias_free_relu", "random_features", "cnn", "wide_resnet", "custom"] = (
        "mlp"
    )
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
    channels: list[int] = Field(default_factory=lambda: [16, 32])
    norm_groups: int = Field(4, gt=0)
    depth: int = Field(16, ge=10)
    widen: int = Field(4, gt=0)
    factory: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    inputs: Literal["auto", "tensor", "tokens"] = "auto"

    @field_validator("hidden", "channels")
    @classmethod
    def _positive_widths(cls, value: list[int]) -> list[int]:
        if any(w <= 0 for w in value):
            raise ValueError("every width must be a positive integer")
        return value

    @model_validator(mode="after")
    def _kind_rules(self) -> "ModelConfig":
        image_kind = self.kind in ("cnn", "wide_resnet")
        if image_kind and (self.input_shape is None or len(self.input_shape) != 3 or min(self.input_shape) <= 0):
            raise ValueError(
                f"model.input_shape = {self.input_shape}: model.kind = {self.kind!r} needs "
                "[channels, height, width] (positive)"
            )
        if self.kind == "cnn":
            for width in self.channels:
                if width % min(self.norm_groups, width):
                    raise ValueError(
                        f"model.channels = {self.channels}: {width} channels do not split into "
                        f"model.norm_groups = {self.norm_groups} GroupNorm groups"
                    )
        if self.kind == "wide_resnet":
            if (self.depth - 4) % 6:
                raise ValueError(f"model.depth = {self.depth}: a wide ResNet has depth 6n + 4 (10, 16, 22, 28, 40)")
            if 16 % self.norm_groups:
                raise ValueError(f"model.norm_groups = {self.norm_groups}: must divide 16 (the stem's channels)")
        if (self.kind == "custom") != (self.factory is not None):
            raise ValueError(
                f"model.factory = {self.factory!r}: give it exactly when model.kind is 'custom' "
                f"(model.kind = {self.kind!r})"
            )
        if self.options and self.kind != "custom":
            raise ValueError(f"model.options = {self.options}: only for model.kind: custom")
        if self.inputs != "auto" and self.kind != "custom":
            raise ValueError(f"model.inputs = {self.inputs!r}: only for model.kind: custom")
        if self.factory is not None:
            load_factory(self.factory)
        return self


class TrainSettings(Section):
    """The optimiser loop, common to every trainer (``train:``). ``algorithm`` names the trainer
    (:data:`dpml.train.registry.TRAINERS`); each trainer's module subclasses this with the keys it
    alone reads, and ``train.algorithm`` selects which subclass validates the section. ``loss``:
    cross-entropy, the squared loss ½‖z − e_y‖² on the logits, or one of the Lipschitz losses
    (τ-cross-entropy CE(τz)/τ with τ = ``loss_tau``; multiclass hinge; Kantorovich–Rubinstein and
    hinge-KR with α = ``loss_alpha``). ``seed`` fixes the initialisation only (public): batches and
    noise use a secret seed."""

    algorithm: str = "dpsgd"
    loss: Literal[
        "cross_entropy",
        "squared",
        "tau_cross_entropy",
        "multiclass_hinge",
        "kantorovich_rubinstein",
        "hinge_kantorovich_rubinstein",
    ] = "cross_entropy"
    loss_tau: float = Field(1.0, gt=0)
    loss_alpha: float = Field(1.0, gt=0)
    epochs: float = Field(20.0, gt=0)
    sample_rate: float = Field(0.05, gt=0, le=1)
    optimizer: Literal["sgd", "adam"] = "sgd"
    learning_rate: float = Field(0.5, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    physical_batch_size: int = Field(1024, gt=0)
    world_size: int = Field(1, ge=1, le=1024)  # processes of a distributed run (dpml.train.distributed)
    autocast: Literal["none", "bf16"] = "none"  # bf16 forward pass (dpml.train.clipping.engine_pass)


class DpConfig(Section):
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


class AuditConfig(Section):
    """Membership-inference audit of the trained model, its positive control and one-run audits.

    The positive control is the same model trained without DP on the same split, with its own
    (non-private) optimiser settings ``control_*`` so that it is trained the way a non-private
    model would be; its reference models use the same settings.

    Candidates: up to ``max_records`` members (training records) and as many non-members (audit
    population); the rest of the audit population is RMIA's population z. ``references``
    reference models per target (DP and non-private control) train on random halves of train ∪
    audit population. Empirical ε lower bounds are computed at ``confidence`` (Bonferroni-split
    over the bounds the gate uses). For a ``random_features`` model the audit also runs the
    reconstruction attack on the target and the control, when the training set has at most
    ``reconstruction_max_train`` records (``reconstruction_restarts`` random starts of
    ``reconstruction_steps`` projected Adam steps each).

    ``mode: tight`` reads the one-run canary guesses through the certified mechanism's own trade-off curve
    (:func:`dpml.audit.one_run_fdp.one_run_mechanism_bound`) instead of one (ε, δ) point, and gates on that
    reading: tighter and as rigorous, at the cost of a few privacy-loss distributions per audit (seconds to a
    minute). It needs a mechanism of Gaussian steps; for another the standard reading is used and says why.
    How close one run can come to the certificate is set by the number of canaries and guesses
    (``benchmarks/one_run_ceiling.py``; Fashion-MNIST at ε = 3, at the pipeline's per-bound confidence: with 1,000
    canaries and a fifth of them guessed, a trainer that is exactly its certificate reads as ε ≈ 1.0 on average;
    with 40,000 canaries and 800 guesses, as ε ≈ 1.64). So the tight white-box audit observes
    ``tight_white_box_canaries`` canaries (at most one per trainable coordinate) and makes at most
    ``tight_guesses`` guesses (and, as in the standard mode, on at most ``one_run_guess_fraction`` of the
    canaries). ``white_box_canaries: 0`` still switches the white-box audit off.
    """

    reconstruction_max_train: int = Field(300, gt=0)
    reconstruction_restarts: int = Field(8, gt=0)
    reconstruction_steps: int = Field(500, gt=0)
    attacks: list[str] = Field(
        default_factory=lambda: ["loss", "lira-online", "lira-offline", "rmia-online", "rmia-offline"]
    )
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
    mode: Literal["standard", "tight"] = "standard"
    tight_white_box_canaries: int = Field(40_000, ge=64)
    tight_guesses: int = Field(800, ge=2)
    white_box_scoring: Literal["likelihood_ratio", "sum"] = "likelihood_ratio"
    conformance: bool = True
    conformance_false_alarm: float = Field(1e-6, gt=0, lt=0.5)
    conformance_tolerance: float = Field(0.05, ge=0, lt=0.5)
    canary_gradient_norm: float = Field(5.0, gt=1)
    workers: int = Field(2, ge=1)
    dask_address: str | None = None

    @field_validator("attacks")
    @classmethod
    def _registered_attacks(cls, names: list[str]) -> list[str]:
        """Each name is a registered attack (:data:`dpml.audit.attacks.ATTACKS`: the built-in ones and any a plugin
        registered)."""
        for index, name in enumerate(names):
            if name not in ATTACKS:
                raise ValueError(
                    f"{name!r} (item {index}): unknown attack; registered: {', '.join(ATTACKS)} "
                    "(an attack of your own: register it in a module listed under plugins:)"
                )
        return names

    @model_validator(mode="after")
    def _attacks_have_references(self) -> "AuditConfig":
        if not self.attacks:
            raise ValueError("audit.attacks: name at least one attack")
        needing = [a for a in self.attacks if ATTACKS[a].needs_references]
        if needing and self.references < 1:
            alone = [name for name, kind in ATTACKS.items() if not kind.needs_references]
            raise ValueError(
                f"audit.references = 0 but attacks {needing} need reference models (use ≥ 1, or only "
                f"{', '.join(alone)})"
            )
        return self


TUNABLE_KEYS = (
    "train.learning_rate",
    "train.momentum",
    "train.optimizer",
    "model.hidden",
    "model.activation",
    "model.gates",
)


class TuneConfig(Section):
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
                raise ValueError(
                    f"tune.space key {key!r}: not tunable; allowed: {', '.join(TUNABLE_KEYS)} "
                    "(the others change the privacy mechanism or the data)"
                )
            if not isinstance(values, list) or not values:
                raise ValueError(f"tune.space[{key!r}] = {values!r}: must be a non-empty list of values")
        return self


class GateConfig(Section):
    """Release gate: the model becomes ``champion`` only when certified ε ≤ ``epsilon_budget``.

    A KL-private model (``train.algorithm: noisygd``) has no finite ε; it passes only when
    ``kl_budget`` is set and its certified KL ≤ ``kl_budget`` (the report says it is not (ε, δ)-DP).
    """

    epsilon_budget: float = Field(4.0, gt=0)
    kl_budget: float | None = Field(None, gt=0)
