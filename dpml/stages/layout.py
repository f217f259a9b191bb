"""Every file a run reads or writes, and which stage reads and writes which: the stage contract.

The contract is written once, here (:data:`CONTRACT`), and checked twice: :func:`run_stage` refuses
to start a stage whose inputs are missing (naming the stage that makes them) and fails a stage that
did not write its outputs; ``tests/test_stage_contract.py`` checks that ``dvc.yaml`` declares the
same dependencies, outputs and parameters, so DVC and the Prefect flow agree on what each stage does.

The parameters (:attr:`StageFiles.params`) are the ``params.yaml`` keys a stage's outputs depend on: a
whole section (``train``) where it reads the section, ``section.key`` where it reads a few keys of
it — so that ``dvc repro`` re-runs exactly the stages a changed key concerns (``gate.epsilon_budget`` or
``ledger.epsilon_budget``: the gate and registration, never training). Pre-flight checks that only
refuse to start (a writable MLflow store) are not dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from dpml import io
from dpml.models import build_model, spec_from_dict

if TYPE_CHECKING:
    from dpml.config import Config

PARTS = ("train", "test", "audit")


class Layout:
    """Every file a run reads or writes, in one place."""

    def __init__(self, config: Config) -> None:
        data, art = Path(config.paths.data), Path(config.paths.artifacts)
        self.raw = data / "raw" / "records.npz"
        self.raw_meta = data / "raw" / "meta.json"
        self.split = data / "split" / "indices.npz"
        self.prepared = {part: data / "prepared" / f"{part}.npz" for part in PARTS}
        self.prepared_meta = data / "prepared" / "meta.json"
        self.model = art / "train" / "model.pt"
        self.model_spec = art / "train" / "model.json"
        self.model_source = art / "train" / "model_source.py"  # model.kind: custom — the factory's module
        self.mechanism = art / "train" / "mechanism.json"
        self.spend = art / "train" / "spend.json"
        self.excluded = art / "train" / "excluded.npz"
        self.train_metrics = art / "train" / "metrics.json"
        self.certificate = art / "certify" / "certificate.json"
        self.certify_metrics = art / "certify" / "metrics.json"
        self.audit = art / "audit" / "audit.json"
        self.audit_metrics = art / "audit" / "metrics.json"
        self.roc_png = art / "audit" / "roc.png"
        self.roc_csv = art / "audit" / "roc.csv"
        self.roc_limit_csv = art / "audit" / "roc_limit.csv"
        self.roc_control_png = art / "audit" / "roc_control.png"
        self.histograms_png = art / "audit" / "histograms.png"
        self.scores = art / "audit" / "scores.json"
        self.gate = art / "gate" / "gate.json"
        self.report = art / "gate" / "privacy_report.md"
        self.release = art / "register" / "release.json"
        self.release_card = art / "register" / "release_card.html"  # dpml.report.release_card
        self.summary = Path(config.paths.metrics_folder()) / "summary.json"  # kept in git: dvc metrics diff
        self.tuning = art / "tune" / "tuning.json"
        self.validation = art / "tune" / "validation.npz"
        self.stage_records = (
            art / "stages"
        )  # one <stage>.json per stage run: times, params, metrics (dpml.stages.records)

    def path(self, name: str) -> Path:
        """The file a contract name stands for: an attribute (``model``) or a prepared part (``prepared.train``)."""
        attribute, _, part = name.partition(".")
        value = getattr(self, attribute)
        return value[part] if part else value


@dataclass(frozen=True)
class StageFiles:
    """What one stage reads and writes (names of :class:`Layout` files); ``optional`` outputs are written
    only in some configurations (the control's ROC without a control, a search's files without a search);
    ``params``: the configuration sections (or keys) it depends on, as ``dvc.yaml`` declares them."""

    reads: tuple[str, ...]
    writes: tuple[str, ...]
    optional: tuple[str, ...] = ()
    params: tuple[str, ...] = ()


PREPARED = tuple(f"prepared.{part}" for part in PARTS)

TRAINING = ("plugins", "model", "train", "dp", "noisycgd", "noisygd", "onepass")  # what a trainer reads
LEDGER_LOCATION = ("ledger.path", "ledger.url", "ledger.unit_key", "ledger.dataset")  # which account
AUDIT_ONLY = tuple(
    f"audit.{key}"
    for key in (
        "attacks",
        "references",
        "max_records",
        "seed",
        "rmia_a",
        "rmia_gamma",
        "confidence",
        "bound_correction",
        "bootstrap",
        "control",
        "control_optimizer",
        "control_learning_rate",
        "control_epochs",
        "white_box_canaries",
        "black_box_canaries",
        "one_run_guess_fraction",
        "mode",
        "tight_white_box_canaries",
        "tight_guesses",
        "white_box_scoring",
        "conformance",
        "conformance_false_alarm",
        "conformance_tolerance",
        "canary_gradient_norm",
        "reconstruction_max_train",
        "reconstruction_restarts",
        "reconstruction_steps",
    )
)  # not the gate's control_min_tpr_at_1pct_fpr/require_control_power, nor Prefect's workers
EVERY_SECTION = (
    "plugins",
    "data",
    "split",
    "preprocess",
    "model",
    "train",
    "dp",
    "noisycgd",
    "noisygd",
    "onepass",
    "audit",
    "tune",
    "gate",
    "ledger",
    "tracking",
)

CONTRACT: dict[str, StageFiles] = {
    "ingest": StageFiles(reads=(), writes=("raw", "raw_meta"), params=("data",)),
    "split": StageFiles(reads=("raw", "raw_meta"), writes=("split",), params=("data", "split")),
    "preprocess": StageFiles(
        reads=("raw", "raw_meta", "split"), writes=(*PREPARED, "prepared_meta"), params=("data", "preprocess")
    ),
    # The ledger's budget is not here: a run over budget is refused before it trains, and a budget
    # lowered afterwards fails the gate, which re-runs; training does not (it would spend ε again).
    "train": StageFiles(
        reads=(*PREPARED, "prepared_meta"),
        writes=("model", "model_spec", "mechanism", "spend", "excluded", "train_metrics"),
        optional=("tuning", "validation", "model_source"),
        params=(*TRAINING, "data.source", "preprocess.clip_norm", *LEDGER_LOCATION, "ledger.on_exhausted"),
    ),
    "certify": StageFiles(
        reads=("mechanism", "train_metrics"),
        writes=("certificate", "certify_metrics"),
        params=("plugins", "train.algorithm", "dp.delta"),
    ),
    "audit": StageFiles(
        reads=("model", "model_spec", "mechanism", "train_metrics", *PREPARED, "prepared_meta", "raw_meta", "excluded"),
        writes=("audit", "scores", "roc_png", "roc_csv", "roc_limit_csv", "histograms_png", "audit_metrics"),
        optional=("roc_control_png",),
        params=(*TRAINING, "split", "preprocess", *AUDIT_ONLY),
    ),
    "gate": StageFiles(
        reads=("certificate", "audit", "scores", "train_metrics", "prepared_meta", "raw_meta"),
        writes=("gate", "report", "summary"),
        params=(
            "data",
            "preprocess",
            "gate",
            "audit.control_min_tpr_at_1pct_fpr",
            "audit.require_control_power",
            *LEDGER_LOCATION,
            "ledger.epsilon_budget",
            "ledger.kl_budget",
            "ledger.delta",
        ),
    ),
    # Registration logs every parameter with the release (MLflow params, config.json).
    "register": StageFiles(
        reads=(
            "certificate",
            "audit",
            "scores",
            "roc_png",
            "histograms_png",
            "gate",
            "report",
            "train_metrics",
            "model",
            "model_spec",
            "mechanism",
            "spend",
            "raw_meta",
            "prepared_meta",
        ),
        writes=("release", "release_card"),
        params=EVERY_SECTION,
    ),
}


def producer_of(name: str) -> str:
    """The stage that writes file ``name``."""
    return next(stage for stage, files in CONTRACT.items() if name in files.writes + files.optional)


def check_inputs(stage: str, layout: Layout) -> None:
    """Refuse to start ``stage`` when a file it reads is missing, naming the stage that writes it."""
    for name in CONTRACT[stage].reads:
        path = layout.path(name)
        if not path.exists():
            raise FileNotFoundError(
                f"stage {stage} needs {path}, which stage {producer_of(name)} writes: run "
                f"`dpml stage {producer_of(name)}` (or the whole pipeline) first"
            )


def check_outputs(stage: str, layout: Layout) -> None:
    """A stage that returned without writing every output it promises is a bug: say which file is missing."""
    missing = [str(layout.path(name)) for name in CONTRACT[stage].writes if not layout.path(name).exists()]
    if missing:
        raise RuntimeError(f"stage {stage} finished without writing {', '.join(missing)}")


def load_part(layout: Layout, part: str) -> tuple[np.ndarray, np.ndarray]:
    """The prepared records of one part (train, test or audit) as (x, y)."""
    arrays = io.read_npz(layout.prepared[part])
    return arrays["x"], arrays["y"]


def load_units(layout: Layout) -> np.ndarray:
    """The privacy-unit digests of the prepared training part, row by row (:mod:`dpml.data.units`)."""
    return io.read_npz(layout.prepared["train"])["units"]


def load_trained_part(layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """The training part less the rows the ledger's filter excluded: the records the model saw."""
    x, y = load_part(layout, "train")
    if layout.excluded.exists():
        keep = np.ones(y.size, dtype=bool)
        keep[io.read_npz(layout.excluded)["rows"]] = False
        x, y = x[keep], y[keep]
    return x, y


def load_model(layout: Layout) -> torch.nn.Module:
    """The trained model, rebuilt from its spec and weights."""
    model = build_model(spec_from_dict(io.read_json(layout.model_spec)))
    model.load_state_dict(torch.load(layout.model, weights_only=True))
    return model.eval()
