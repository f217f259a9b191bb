"""DVC that compares, in a fresh git checkout of the project: ``dvc repro``, then one parameter changed
and ``dvc repro`` again — which stages re-ran, what the ledger was charged, what ``dvc metrics diff``
shows — and ``dvc exp run --set-param`` landing its release in the MLflow store of params.yaml."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from dpml.formatting import format_epsilon
from dpml.ledger.ledger import Ledger
from tests.conftest import REPO
from tests.test_drivers import checkout, dvc

MODEL = "dpml-digits"


def set_params(root: Path, **changes: object) -> None:
    """Write ``section.key`` values (``gate__epsilon_budget=1``) into the checkout's params.yaml."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        params[section][key] = value
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def git_commit(root: Path, message: str) -> None:
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", "commit", "-qm", message], cwd=root, check=True
    )


def ran(output: str) -> set[str]:
    """The stages ``dvc repro`` ran (not the ones it skipped as unchanged)."""
    return set(re.findall(r"Running stage '([a-z]+)'", output))


def spends(root: Path) -> int:
    return len(Ledger(root / "ledger.db", 1e-5).spends(counted_only=False))


def versions(root: Path) -> int:
    return len(MlflowClient(f"sqlite:///{root / 'mlflow.db'}").search_model_versions(f"name = '{MODEL}'"))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A checkout with a quick configuration, reproduced once and committed (dvc.lock and metrics/)."""
    root = checkout(tmp_path / "repo")
    set_params(
        root,
        train__epochs=2,
        audit__references=1,
        audit__bootstrap=20,
        audit__control_epochs=3,
        audit__white_box_canaries=0,
        audit__black_box_canaries=0,
    )
    first = dvc(root, "repro")
    assert ran(first) == {"ingest", "split", "preprocess", "train", "certify", "audit", "gate", "register"}, first
    assert subprocess.run(["git", "check-ignore", "-q", "metrics/summary.json"], cwd=root).returncode == 1
    git_commit(root, "quick configuration, reproduced")
    return root


def offline_template(path: Path) -> Path:
    """scripts/build_plots_template.py's page, with a stand-in script where the inlined libraries go."""
    spec = importlib.util.spec_from_file_location("build_plots_template", REPO / "scripts" / "build_plots_template.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path.write_text(module.page(["window.inlinedLibraries = true;"]))
    return path


@pytest.mark.slow
@pytest.mark.exhaustive  # ≈170 s (five dvc repro and one dvc exp run): CI runs it; the default suite stays near 20 min
def test_budgets_re_run_the_gate_never_training_metrics_diff_compares_and_exp_run_registers(repo: Path) -> None:
    summary = json.loads((repo / "metrics" / "summary.json").read_text())
    assert {"test_accuracy", "epsilon", "delta", "max_epsilon_lower_bound", "gate_passed"} <= set(summary)
    assert summary["gate_passed"] is True and summary["epsilon"] <= 3.0
    shown = dvc(repo, "metrics", "show")
    assert "metrics/summary.json" in shown and "test_accuracy" in shown and "!" not in shown
    charged, registered = spends(repo), versions(repo)

    # The plots page, without flags: our template as scripts/setup.sh configures it (no CDN scripts); the ROC
    # with its title and axis labels, against the DP limit at the certified ε.
    (repo / "build").mkdir(exist_ok=True)
    template = offline_template(repo / "build" / "dvc-plots-offline.html")
    dvc(repo, "config", "--local", "plots.html_template", "../build/dvc-plots-offline.html")
    assert (
        template.exists()
        and "html_template = ../build/dvc-plots-offline.html" in (repo / ".dvc" / "config.local").read_text()
    )
    dvc(repo, "plots", "show", "-o", str(repo.parent / "plots"))
    html = (repo.parent / "plots" / "index.html").read_text()
    assert "window.inlinedLibraries = true;" in html and not re.search(r"<script[^>]*src=", html)
    assert "Membership inference ROC" in html and "false positive rate" in html and "true positive rate" in html
    assert "roc_limit.csv" in html and "against the DP limit" in html

    # The gate's budget below the certified ε: the gate (and registration) re-run, training does not.
    set_params(repo, gate__epsilon_budget=round(summary["epsilon"] / 2, 3))
    again = dvc(repo, "repro")
    assert ran(again) == {"gate", "register"}, again
    # One spend, one version: registration re-runs on the same outputs and gives that version the new verdict.
    assert spends(repo) == charged and versions(repo) == registered
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    released = json.loads((repo / "artifacts" / "register" / "release.json").read_text())["model_version"]
    # (MLflow gives a version number as an int from a SQLite store, as a str from a server)
    [judged] = [v for v in client.search_model_versions(f"name = '{MODEL}'") if str(v.version) == released]
    assert (
        judged.tags["gate.passed"] == "false" and "exceeds the budget gate.epsilon_budget" in judged.tags["gate.reason"]
    )
    assert str(client.get_registered_model(MODEL).aliases.get("champion")) != released
    decision = json.loads((repo / "artifacts" / "gate" / "gate.json").read_text())
    assert decision["passed"] is False and any(
        "exceeds the budget gate.epsilon_budget" in r for r in decision["reasons"]
    )
    diff = json.loads(dvc(repo, "metrics", "diff", "HEAD", "--json"))["metrics/summary.json"]
    assert diff["gate_passed"] == {"old": True, "new": False, "diff": -1}  # DVC counts a verdict as 1 or 0
    changed = json.loads(dvc(repo, "params", "diff", "HEAD", "--json"))["params.yaml"]
    halved = round(summary["epsilon"] / 2, 3)
    assert changed == {"gate.epsilon_budget": {"old": 3.0, "new": halved, "diff": pytest.approx(halved - 3.0)}}
    git_commit(repo, "gate budget halved")

    # The ledger's budget lowered below what was spent: the gate re-runs and says so; nothing is retrained.
    set_params(repo, ledger__epsilon_budget=round(summary["epsilon"] / 4, 3))
    lowered = dvc(repo, "repro")
    assert ran(lowered) == {"gate", "register"}, lowered
    assert spends(repo) == charged
    decision = json.loads((repo / "artifacts" / "gate" / "gate.json").read_text())
    assert any("over ledger.epsilon_budget" in r for r in decision["reasons"]), decision["reasons"]
    set_params(repo, ledger__epsilon_budget=10.0)

    # A training parameter: train and everything after it re-run, charged once more; diff shows the deltas.
    set_params(repo, train__epochs=3)
    retrained = dvc(repo, "repro")
    assert ran(retrained) == {"train", "certify", "audit", "gate", "register"}, retrained
    assert spends(repo) == charged + 1
    diff = json.loads(dvc(repo, "metrics", "diff", "HEAD", "--all", "--json"))["metrics/summary.json"]
    accuracy = diff["test_accuracy"]
    assert isinstance(accuracy["old"], float) and isinstance(accuracy["new"], float)
    assert accuracy["diff"] == pytest.approx(accuracy["new"] - accuracy["old"])
    table = dvc(repo, "metrics", "diff", "HEAD")
    assert "epsilon" in table and "!" not in table
    assert "Data and pipelines are up to date." in dvc(repo, "repro")
    git_commit(repo, "three epochs")

    # An experiment (workspace mode) with one parameter set: charged and registered like any run.
    charged, registered = spends(repo), versions(repo)
    dvc(repo, "exp", "run", "--set-param", "train.epochs=4", "--name", "four-epochs")
    assert spends(repo) == charged + 1 and versions(repo) == registered + 1
    shown = json.loads(dvc(repo, "exp", "show", "--json"))
    experiments = [e for entry in shown for e in (entry.get("experiments") or [])]
    [four] = [e for e in experiments if e.get("name") == "four-epochs"]
    data = four["revs"][0]["data"]
    assert data["params"]["params.yaml"]["data"]["train"]["epochs"] == 4
    assert isinstance(data["metrics"]["metrics/summary.json"]["data"]["test_accuracy"], float)

    # dpml compare: the experiment in one line of 120 columns at most, its ε as dpml writes it, its one change.
    done = subprocess.run(
        [sys.executable, "-m", "dpml", "compare", "--width", "120"], cwd=repo, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(map(len, lines)) <= 120, done.stdout
    [row] = [line for line in lines if line.split()[:1] == ["four-epochs"]]
    epsilon = data["metrics"]["metrics/summary.json"]["data"]["epsilon"]
    assert row.split()[2] == format_epsilon(epsilon) and row.endswith("train.epochs=4"), done.stdout
