"""Seed 002's random-features model through the pipeline: DP-GD release, certificate, and the reconstruction audit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpml import io
from dpml.config import load
from dpml.stages import STAGES, Layout
from tests.conftest import small_params, write_params


@pytest.mark.exhaustive
def test_random_features_release_is_audited_by_reconstruction(workdir: Path) -> None:
    rng = np.random.default_rng(0)
    d = 20
    x = rng.normal(size=(150, d))
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(d)]).assign(label=(x[:, 0] > 0).astype(int))
    frame.to_csv(workdir / "records.csv", index=False)
    params = small_params(
        workdir,
        data={
            "source": f"csv:{workdir / 'records.csv'}",
            "label_column": "label",
            "feature_columns": [f"f{i}" for i in range(d)],
            "classes": [0, 1],
        },
        preprocess={"lower": -4.0, "upper": 4.0, "clip_norm": d**0.5, "clip_mode": "sphere"},
        model={"kind": "random_features", "features": 4000, "feature_activation": "tanh"},
        train={"algorithm": "dpgd", "loss": "squared", "sample_rate": 1.0, "epochs": 30, "learning_rate": 0.5},
        dp={
            "noise_multiplier": None,
            "target_epsilon": 1.0,
            "delta": 1e-5,
            "clip_norm": 1.0,
            "neighbouring": "replace-one",
        },
        audit={
            "control_optimizer": "sgd",
            "control_learning_rate": 0.0005,
            "control_epochs": 300,
            "black_box_canaries": 0,
            "white_box_canaries": 0,
            "max_records": 40,
            "references": 1,
            "reconstruction_restarts": 3,
            "reconstruction_steps": 300,
        },
    )
    config = load(write_params(workdir / "rf.yaml", params))
    for name in ("ingest", "split", "preprocess", "train", "certify", "audit", "gate"):
        STAGES[name](config)
    layout = Layout(config)
    certificate = io.read_json(layout.certificate)
    assert certificate["mechanism"]["trainer"] == "dpgd" and certificate["epsilon"] <= 1.0 + 1e-9
    spec = io.read_json(layout.model_spec)
    assert spec["kind"] == "random_features" and spec["n_features"] == 4000
    reconstruction = io.read_json(layout.audit)["reconstruction"]
    control, target = reconstruction["control"], reconstruction["target"]
    assert control["p_over_dn"] > 2
    # Without DP the weights give the training inputs away; with DP (ε = 1) they do not.
    assert control["summary"]["fraction_above_0.9"] >= 0.8
    assert target["summary"]["mean"] < control["summary"]["mean"] - 0.2
    assert target["summary"]["mean"] < control["chance_summary"]["mean"] + 0.15
    assert "Reconstruction attack" in layout.report.read_text()
