"""Every release rebuildable: provenance on each version, its data on the DVC remote, ``dpml reproduce --verify``.

In a git checkout of the project (its default DVC remote is a folder beside the checkout), the pipeline runs
on a table, the table is then rewritten and the pipeline runs again. Version 1 still rebuilds:
``dpml reproduce models:/NAME/1 --verify`` checks out its commit in a clean worktree, pulls *its* records
from the remote and finds both hashes and the certificate as released, spending no ε;
``dpml reproduce models:/NAME/1`` retrains it there through ``dvc repro``, says first that it charges the
ledger, is charged, and — with the operator's secret noise seed the release ran with — gets the identical
certificate and test accuracy. A corrupted object on the remote is caught and named. A run that is not the
workspace's DVC pipeline (``--set``) is tagged as not recorded and refused by ``reproduce`` with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from tests.test_drivers import checkout, environment
from tests.test_tables import SCHEMA, census

MODEL = "census-release"


def dpml(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dpml", *args],
        cwd=root,
        capture_output=True,
        text=True,
        env=environment() | {"PYTHONHASHSEED": "0", "DPML_NOISE_SEED": "8675309"},
        timeout=900,
    )


def pipeline_params(root: Path, table: Path) -> None:
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["data"] = {"source": f"csv:{table}", **SCHEMA, "id_column": "id"}
    params["preprocess"] = {k: v for k, v in params["preprocess"].items() if k not in ("lower", "upper")} | {
        "clip_norm": 3.0
    }
    params["train"]["epochs"] = 2
    params["audit"] |= {"references": 1, "bootstrap": 20, "white_box_canaries": 0, "black_box_canaries": 0}
    params["tracking"]["model_name"] = MODEL
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def checkout_with_table(tmp_path: Path, rows: int, seed: int) -> tuple[Path, Path]:
    """A git checkout of the project whose params.yaml reads a generated census table beside it."""
    root = checkout(tmp_path / "repo")
    table = tmp_path / "census.csv"
    census(rows, seed=seed).to_csv(table, index=False)
    pipeline_params(root, table)
    return root, table


def version_tags(root: Path, number: str) -> dict[str, str]:
    return dict(MlflowClient(f"sqlite:///{root / 'mlflow.db'}").get_model_version(MODEL, number).tags)


@pytest.mark.slow
# ≈120 s (a release, its verification and its retraining in a worktree): CI runs it; the default suite stays near 20 min
@pytest.mark.exhaustive
def test_a_release_rebuilds_from_its_commit_and_remote_after_the_data_changed(tmp_path: Path) -> None:
    root, table = checkout_with_table(tmp_path, 900, seed=1)
    first = dpml(root, "run", "--engine", "local")
    assert first.returncode == 0, first.stderr[-3000:]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    v1 = version_tags(root, "1")
    assert v1["code.commit"] == head and v1["code.dirty"] == "false" and v1["data.dvc"] == "pushed"
    assert v1["dvc.lock_scope"] == "ingest..gate"
    remote = tmp_path / "dpml-dvc-remote"
    assert v1["data.dvc_remote"] == str(remote) and any(p.is_file() for p in remote.rglob("*"))
    assert v1["data.dvc_md5"] == yaml.safe_load((root / "dvc.lock").read_text())["stages"]["ingest"]["outs"][0]["md5"]
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    logged = {a.path for a in client.list_artifacts(client.get_model_version(MODEL, "1").run_id)}
    assert {"params.yaml", "dvc.lock"} <= logged

    census(900, seed=2).to_csv(table, index=False)  # the input file changes; the next run commits to DVC
    second = dpml(root, "run", "--engine", "local")
    assert second.returncode == 0, second.stderr[-3000:]
    v2 = version_tags(root, "2")
    assert v2["data.version"] != v1["data.version"] and v2["data.dvc_md5"] != v1["data.dvc_md5"]

    spends_before = dpml(root, "ledger", "--json").stdout
    verified = dpml(root, "reproduce", f"models:/{MODEL}/1", "--verify")
    assert verified.returncode == 0, verified.stdout + verified.stderr[-3000:]
    assert f"models:/{MODEL}/1: verified" in verified.stdout and v1["data.dvc_md5"] in verified.stdout
    assert dpml(root, "ledger", "--json").stdout == spends_before  # no training, no ε
    as_json = dpml(root, "reproduce", f"models:/{MODEL}/1", "--verify", "--json")  # stdout: the result alone
    assert as_json.returncode == 0 and f"models:/{MODEL}/1: verified" in as_json.stderr, as_json.stderr[-3000:]
    result = json.loads(as_json.stdout)
    assert result["verified"] is True and result["model"] == f"models:/{MODEL}/1" and result["problems"] == []
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=root, capture_output=True, text=True).stdout
    assert len(worktrees.strip().splitlines()) == 1, worktrees  # the temporary worktree is gone

    # Retraining from the commit and the pulled records: charged, announced, the same release.
    from dpml.ledger.ledger import Ledger

    spends = len(Ledger(root / "ledger.db", 1e-5).spends(counted_only=False))
    retrained = dpml(root, "reproduce", f"models:/{MODEL}/1", "--accuracy-band", "0")
    assert retrained.returncode == 0, retrained.stdout + retrained.stderr[-3000:]
    said = retrained.stdout
    assert said.index("retraining is a private run: it charges the ledger") < said.index("train     dvc repro")
    assert "certificate identical" in said and f"models:/{MODEL}/1: verified: retrained" in said
    assert len(Ledger(root / "ledger.db", 1e-5).spends(counted_only=False)) == spends + 1
    assert len(MlflowClient(f"sqlite:///{root / 'mlflow.db'}").search_model_versions(f"name = '{MODEL}'")) == 2

    # A corrupted object on the remote: the records' bytes no longer match the release.
    digest = v1["data.dvc_md5"].removesuffix(".dir")
    manifest = json.loads((remote / "files" / "md5" / digest[:2] / (digest[2:] + ".dir")).read_text())
    records = next(entry["md5"] for entry in manifest if entry["relpath"] == "records.npz")
    stored = remote / "files" / "md5" / records[:2] / records[2:]
    stored.chmod(0o644)
    stored.write_bytes(stored.read_bytes()[:-1] + bytes([stored.read_bytes()[-1] ^ 1]))
    corrupted = dpml(root, "reproduce", f"models:/{MODEL}/1", "--verify")
    assert corrupted.returncode == 3, corrupted.stdout + corrupted.stderr[-3000:]
    assert "NOT verified" in corrupted.stdout and "data/raw/records.npz: MD5" in corrupted.stdout
    assert "Traceback" not in corrupted.stderr


@pytest.mark.exhaustive  # CI runs it after the default suite, which stays near 20 min on 2 cores
@pytest.mark.slow
def test_a_run_outside_the_dvc_pipeline_says_so_and_cannot_be_reproduced(tmp_path: Path) -> None:
    root, _ = checkout_with_table(tmp_path, 600, seed=3)
    run = dpml(root, "run", "--engine", "local", "--set", "train.epochs=1")
    assert run.returncode == 0, run.stderr[-3000:]
    tags = version_tags(root, "1")
    assert tags["data.dvc"].startswith("not recorded: the run's configuration is not params.yaml")
    assert tags["code.commit"] and tags["code.dirty"] == "false"
    refused = dpml(root, "reproduce", f"models:/{MODEL}/1", "--verify")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    [line] = [line for line in refused.stderr.splitlines() if line.startswith("dpml: error:")]
    assert "its data was not recorded in DVC (not recorded: the run's configuration is not params.yaml" in line
