"""The pipeline stages: one module per stage, each a plain function over files.

ingest → split → preprocess → train → certify → audit → gate → register

``dpml tune`` replaces ``train`` by :func:`~dpml.stages.train.tune` (a private hyperparameter
search); it writes the same files plus ``artifacts/tune/``, and the later stages apply the released
candidate's hyperparameters (:func:`~dpml.stages.train.release_config`).

Each stage reads the previous stages' files and writes its own (atomically) under ``paths.data`` /
``paths.artifacts``; which files is the contract in :mod:`dpml.stages.layout`, checked by
:func:`run_stage`. The DVC stages (``dpml stage NAME``), the Prefect tasks and ``dpml run --engine
local`` all go through :func:`run_stage`, so every driver runs the same functions and produces the
same files.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dpml.config import check_tunable
from dpml.faults import fault_point
from dpml.stages.checkout_lock import outputs_locked
from dpml.preflight import preflight
from dpml.stages.audit import audit, audit_context, audit_reference_jobs, train_audit_reference
from dpml.stages.certify import certify
from dpml.stages.gate import gate, total_variation_violations
from dpml.stages.ingest import ingest
from dpml.stages.layout import CONTRACT, PARTS, Layout, check_inputs, check_outputs, load_model, load_part
from dpml.stages.preprocess import preprocess
from dpml.stages.records import record_stage
from dpml.stages.reaudit import audit_registered_model
from dpml.stages.register import register
from dpml.stages.split import split
from dpml.stages.train import accuracy, check_delta, release_config, train, tune

if TYPE_CHECKING:
    from dpml.config import Config

__all__ = [
    "CONTRACT",
    "PARTS",
    "STAGES",
    "Layout",
    "accuracy",
    "audit",
    "audit_context",
    "audit_reference_jobs",
    "audit_registered_model",
    "certify",
    "check_delta",
    "gate",
    "ingest",
    "load_model",
    "load_part",
    "outputs_locked",
    "preprocess",
    "register",
    "release_config",
    "run_all",
    "run_stage",
    "split",
    "total_variation_violations",
    "train",
    "train_audit_reference",
    "tune",
]

STAGES: dict[str, Callable[..., dict[str, Any]]] = {
    "ingest": ingest,
    "split": split,
    "preprocess": preprocess,
    "train": train,
    "certify": certify,
    "audit": audit,
    "gate": gate,
    "register": register,
}


def run_stage(name: str, config: Config, progress: bool = False, search: bool = False) -> dict[str, Any]:
    """Run one stage under its contract: its inputs must exist before, its outputs after; then record its
    times, parameters and metrics (:mod:`dpml.stages.records`) for the register stage's nested MLflow runs.

    ``search``: run ``dpml tune``'s search in place of the train stage (same contract).
    """
    layout = Layout(config)
    with outputs_locked(config, f"dpml stage {name}"):  # re-entrant: a whole run already holds it
        check_inputs(name, layout)
        fault_point(f"before:{name}")
        started = time.time()
        if name == "train":
            result = (tune if search else train)(config, progress=progress)
        else:
            result = STAGES[name](config)
        check_outputs(name, layout)
        record_stage(config, name, started, time.time(), result)
    fault_point(f"after:{name}")
    return result


def run_all(
    config: Config, progress: bool = False, echo: Callable[[str], None] = print, search: bool = False
) -> dict[str, Any]:
    """Run every stage in order (the CLI's ``dpml run``/``dpml tune`` without Prefect)."""
    results: dict[str, Any] = {}
    if search:
        check_tunable(config)
    with outputs_locked(config, "dpml tune" if search else "dpml run"):  # one run at a time in these folders
        preflight(config)
        for name in STAGES:
            start = time.perf_counter()
            echo(f"[dpml] {'tune' if search and name == 'train' else name} …")
            results[name] = run_stage(name, config, progress=progress, search=search)
            echo(f"[dpml] {name} done in {time.perf_counter() - start:.1f}s")
    return results
