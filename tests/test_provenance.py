"""Provenance tags, fast: the git state of a working directory and when a run counts as the DVC pipeline."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dpml.config import load
from dpml.provenance import code_state, is_dvc_pipeline_run
from tests.conftest import small_params, write_params

GIT_ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.org",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.org",
}


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True, env=GIT_ENV).stdout


def test_code_state_names_the_commit_and_counts_every_change_but_the_logged_files(tmp_path: Path) -> None:
    assert code_state(tmp_path) == {"code.commit": "none", "code.dirty": "unknown"}
    git(tmp_path, "init", "-q")
    for name in ("code.py", "params.yaml", "dvc.lock"):
        (tmp_path / name).write_text("v1\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "one")
    head = git(tmp_path, "rev-parse", "HEAD").strip()
    assert code_state(tmp_path) == {"code.commit": head, "code.dirty": "false"}
    (tmp_path / "params.yaml").write_text("v2\n")  # logged with the run: not a code change
    (tmp_path / "dvc.lock").write_text("v2\n")
    (tmp_path / "metrics").mkdir()  # the run's summary metrics, kept in git: an output, not code
    (tmp_path / "metrics" / "summary.json").write_text("{}\n")
    assert code_state(tmp_path)["code.dirty"] == "false"
    (tmp_path / "helper.py").write_text("new\n")  # an untracked file the run may import
    assert code_state(tmp_path)["code.dirty"] == "true"
    (tmp_path / "helper.py").unlink()
    (tmp_path / "code.py").write_text("v2\n")
    assert code_state(tmp_path) == {"code.commit": head, "code.dirty": "true"}


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / ".dvc").mkdir()
    params = small_params(tmp_path)
    params["paths"]["data"] = str(tmp_path / "data")
    write_params(tmp_path / "params.yaml", params)
    return tmp_path


def test_only_params_yaml_as_it_stands_is_the_dvc_pipeline(
    workspace: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load(workspace / "params.yaml")
    assert is_dvc_pipeline_run(config, workspace) is None
    # as `dpml run` and `dvc repro` load it: the file named relative to the workspace (where each destination
    # came from, tracking.origins, names the file as given; it is a record, not a parameter)
    monkeypatch.chdir(workspace)
    assert is_dvc_pipeline_run(load("params.yaml"), workspace) is None
    assert "a hyperparameter search" in str(is_dvc_pipeline_run(config, workspace, searched=True))
    changed = load(workspace / "params.yaml", ["train.epochs=1"])
    assert "not params.yaml as it stands" in str(is_dvc_pipeline_run(changed, workspace))
    elsewhere = tmp_path_factory.mktemp("plain")
    assert "not a DVC workspace" in str(is_dvc_pipeline_run(config, elsewhere))
    (workspace / "params.yaml").write_text("train: [unclosed\n")
    assert "params.yaml in the working directory does not load" in str(is_dvc_pipeline_run(config, workspace))


def test_a_temporary_experiment_copy_with_relative_stores_is_refused(
    workspace: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dvc exp run --temp/--queue`` runs stages in a copy (DVC_ROOT names the real repository): relative
    stores would be new, empty ones there. The workspace itself, or absolute stores, are fine."""
    from dpml.provenance import refuse_temporary_experiment_copy

    copy = tmp_path_factory.mktemp("exp-copy")
    relative = load(workspace / "params.yaml", ["ledger.path=ledger.db", "tracking.uri=sqlite:///mlflow.db"])
    absolute = load(workspace / "params.yaml")  # small_params: both stores absolute
    monkeypatch.setenv("DVC_ROOT", str(workspace))
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    refuse_temporary_experiment_copy(relative, copy)  # plain dvc repro: not an experiment
    monkeypatch.setenv("DVC_EXP_NAME", "sweep-1")
    refuse_temporary_experiment_copy(relative, workspace)  # dvc exp run in the workspace
    refuse_temporary_experiment_copy(absolute, copy)
    with pytest.raises(
        ValueError,
        match=r"ledger.path = 'ledger.db', tracking.uri = 'mlflow.db': relative to a "
        r"temporary copy .* run experiments in the workspace",
    ):
        refuse_temporary_experiment_copy(relative, copy)
    split = load(
        workspace / "params.yaml", ["tracking.registry_uri=sqlite:///registry.db"]
    )  # only the registry relative
    with pytest.raises(ValueError, match=r"^tracking.registry_uri = 'registry.db': relative to a temporary copy"):
        refuse_temporary_experiment_copy(split, copy)
