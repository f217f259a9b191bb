"""The stage contract (which files each stage reads and writes) is written once, in
``dpml.stages.layout.CONTRACT``; ``dvc.yaml`` must declare the same files, and ``run_stage`` must refuse
a stage whose inputs are missing and fail a stage that did not write what it promises. The parameters each
stage depends on are part of the contract too: dvc.yaml lists exactly those, each one present in params.yaml."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import REPO, small_params
from dpml.config import load, validate
from dpml.stages import STAGES, records, run_stage
from dpml.stages.layout import CONTRACT, Layout, check_outputs, producer_of
from dpml.train import dpsgd

DVC = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
PARAMS = yaml.safe_load((REPO / "params.yaml").read_text())


def _default_layout() -> Layout:
    return Layout(load(REPO / "params.yaml"))


def _relative(path: Path) -> str:
    return path.as_posix()


def _entries(stage: dict, *keys: str) -> list[str]:
    """dvc.yaml paths of a stage (entries are strings or one-key mappings carrying options)."""
    paths = []
    for key in keys:
        for entry in stage.get(key, []):
            paths.append(entry if isinstance(entry, str) else next(iter(entry)))
    return paths


def _covered(path: str, declared: list[str]) -> bool:
    """``path`` is declared itself or lies in a declared directory."""
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in declared)


def _data_paths(declared: list[str]) -> list[str]:
    """Declared paths that are pipeline files (not the code a stage depends on)."""
    return [d for d in declared if d.startswith(("data/", "artifacts/", "metrics/"))]


def test_every_stage_in_the_contract_is_a_dvc_stage_and_a_pipeline_stage() -> None:
    assert list(CONTRACT) == list(STAGES)
    assert list(DVC) == list(STAGES)


@pytest.mark.parametrize("stage", list(CONTRACT))
def test_dvc_declares_every_file_the_contract_names(stage: str) -> None:
    layout, files, dvc = _default_layout(), CONTRACT[stage], DVC[stage]
    deps, outs = _entries(dvc, "deps"), _entries(dvc, "outs", "metrics", "plots")
    for name in files.reads:
        assert _covered(_relative(layout.path(name)), deps), f"dvc.yaml stage {stage} lacks dep {layout.path(name)}"
    for name in files.writes:
        assert _covered(_relative(layout.path(name)), outs), f"dvc.yaml stage {stage} lacks out {layout.path(name)}"


@pytest.mark.parametrize("stage", list(CONTRACT))
def test_dvc_declares_no_file_the_contract_does_not_name(stage: str) -> None:
    layout, files, dvc = _default_layout(), CONTRACT[stage], DVC[stage]
    reads = [_relative(layout.path(n)) for n in files.reads]
    writes = [_relative(layout.path(n)) for n in files.writes + files.optional]
    for dep in _data_paths(_entries(dvc, "deps")):
        assert any(_covered(r, [dep]) for r in reads), f"dvc.yaml stage {stage} depends on {dep}, which it never reads"
    for out in _entries(dvc, "outs", "metrics", "plots"):
        assert any(_covered(w, [out]) for w in writes), f"dvc.yaml stage {stage} declares {out}, which it never writes"


@pytest.mark.parametrize("stage", list(CONTRACT))
def test_dvc_declares_exactly_the_parameters_the_contract_names(stage: str) -> None:
    assert DVC[stage].get("params", []) == list(CONTRACT[stage].params)


@pytest.mark.parametrize("stage", list(CONTRACT))
def test_every_declared_parameter_is_in_params_yaml(stage: str) -> None:
    """DVC refuses a stage whose parameter is missing from params.yaml (an optional key too)."""
    for key in CONTRACT[stage].params:
        section, _, name = key.partition(".")
        assert section in PARAMS and (not name or name in PARAMS[section]), f"stage {stage}: {key} not in params.yaml"


def test_no_budget_retrains_and_every_budget_reaches_the_gate() -> None:
    for budget in (
        "gate.epsilon_budget",
        "gate.kl_budget",
        "ledger.epsilon_budget",
        "ledger.kl_budget",
        "ledger.delta",
    ):
        section = budget.partition(".")[0]
        assert budget not in CONTRACT["train"].params and section not in CONTRACT["train"].params, budget
        assert budget in CONTRACT["gate"].params or section in CONTRACT["gate"].params, budget


def test_summary_metrics_are_the_only_dvc_metrics_and_live_outside_the_ignored_folders() -> None:
    declared = [path for stage in DVC.values() for path in _entries(stage, "metrics")]
    assert declared == [_relative(_default_layout().summary)] == ["metrics/summary.json"]
    ignored = subprocess.run(["git", "check-ignore", "-q", "metrics/summary.json"], cwd=REPO)
    assert ignored.returncode == 1, "metrics/summary.json must be tracked by git, not ignored"
    assert DVC["gate"]["metrics"][0]["metrics/summary.json"]["cache"] is False


def test_every_plot_has_a_title_and_axis_labels() -> None:
    for stage in DVC.values():
        for entry in stage.get("plots", []):
            options = next(iter(entry.values())) if isinstance(entry, dict) else {}
            assert {"title", "x_label", "y_label"} <= set(options), entry


def test_every_read_is_written_by_an_earlier_stage() -> None:
    order = list(CONTRACT)
    for stage, files in CONTRACT.items():
        for name in files.reads:
            assert order.index(producer_of(name)) < order.index(stage), (stage, name)


def test_run_stage_refuses_missing_inputs_naming_the_producer(workdir: Path) -> None:
    config = validate(small_params(workdir))
    with pytest.raises(FileNotFoundError, match=r"stage certify needs .*mechanism\.json, which stage train writes"):
        run_stage("certify", config)
    assert not Layout(config).certificate.exists()
    run_stage("ingest", config)
    with pytest.raises(FileNotFoundError, match=r"stage preprocess needs .*indices\.npz, which stage split writes"):
        run_stage("preprocess", config)


def test_a_stage_that_skips_an_output_is_caught(workdir: Path) -> None:
    config = validate(small_params(workdir))
    run_stage("ingest", config)
    layout = Layout(config)
    layout.raw_meta.unlink()
    with pytest.raises(RuntimeError, match=r"stage ingest finished without writing .*meta\.json"):
        check_outputs("ingest", layout)


@pytest.mark.parametrize("stage", list(CONTRACT))
def test_dvc_declares_the_params_the_contract_names(stage: str) -> None:
    """The parameters each stage's nested MLflow run logs are the ones DVC re-runs it for."""
    assert list(CONTRACT[stage].params) == DVC[stage].get("params", [])


def test_run_stage_records_times_params_and_metrics(workdir: Path) -> None:
    from dpml import io
    from dpml.stages.records import stage_records

    config = validate(small_params(workdir, split={"seed": 7}))
    run_stage("ingest", config)
    result = run_stage("split", config)
    [ingest, split] = stage_records(Layout(config), ["ingest", "split", "preprocess"])
    assert ingest["stage"] == "ingest" and ingest["started"] <= ingest["ended"] <= split["started"] <= split["ended"]
    assert split["params"]["split.seed"] == "7" and all(k.startswith(("split.", "data.")) for k in split["params"])
    assert split["metrics"]["n_train"] == result["n_train"] > 0
    assert (
        "data.source" in ingest["params"]
        and "None" not in io.read_json(Layout(config).stage_records / "ingest.json")["params"].values()
    )


def test_the_train_metrics_reproduce_whichever_chunk_the_timing_picks(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``metrics.json`` is what ``dvc repro`` compares: two runs of the train stage with the same seeds, whose
    tuner (timed on a loaded machine) picks different chunks, write the same bytes; the chunk each picked is on
    the stage's record (its nested MLflow run)."""
    monkeypatch.setenv("DPML_NOISE_SEED", "11")
    config = validate(small_params(workdir, train={"algorithm": "dpsgd", "tune_physical_batch": True}))
    for stage in ("ingest", "split", "preprocess"):
        run_stage(stage, config)
    layout, written = Layout(config), []
    for chunk in (16, 111):
        monkeypatch.setattr(dpsgd, "physical_chunk", lambda *args, chunk=chunk: chunk)  # what the timing chose
        run_stage("train", config)
        written.append(layout.train_metrics.read_bytes())
        (record,) = records.stage_records(layout, ["train"])
        assert record["metrics"]["train_physical_chunk"] == chunk
    assert b"physical_chunk" not in written[0]
    assert written[0] == written[1]
