"""``dpml compare`` (dpml/cli_compare.py): a real DVC project with a pipeline shaped like dpml's (params.yaml, a
stage writing ``metrics/summary.json``), commits and ``dvc exp run`` experiments, read back through the command
line. The table fits the width asked for, shows each experiment's ε and verdict, and names exactly the
parameters that differ from the commit it was run from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dpml.cli_compare import Row, as_record, changes, experiment_rows, render, shown_experiments
from dpml.formatting import format_epsilon

STAGE = """\
import json, pathlib, yaml
p = yaml.safe_load(open("params.yaml"))
eps = p["dp"]["target_epsilon"] - 3e-6
words = {"certificate": "within budget", "implementation": "conforms",
         "attacks": "evidence" if p["train"]["epochs"] > 3 else "no demonstrated power"}
summary = {"epsilon": eps, "test_accuracy": 0.5 + p["train"]["epochs"] / 100, "gate_passed": True,
           **{f"verdict_{k}": v for k, v in words.items()}}
pathlib.Path("metrics").mkdir(exist_ok=True)
pathlib.Path("metrics/summary.json").write_text(json.dumps(summary))
"""

PARAMS = {
    "train": {"epochs": 3, "learning_rate": 0.5, "optimizer": "sgd"},
    "dp": {"target_epsilon": 2.0, "delta": 1e-5},
    "audit": {"attacks": ["loss", "lira-online"], "references": 4},
}


def run(root: Path, *args: str) -> str:
    env = os.environ | {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org"}
    done = subprocess.run(args, cwd=root, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def dvc(root: Path, *args: str) -> str:
    return run(root, sys.executable, "-m", "dvc", *args)


def compare(root: Path, *args: str) -> list[str]:
    return run(root, sys.executable, "-m", "dpml", "compare", *args).splitlines()


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two commits (ε 2 then 3, epochs 3 then 5), and from the second two experiments."""
    root = tmp_path_factory.mktemp("compare")
    run(root, "git", "init", "-q")
    dvc(root, "init", "-q")
    (root / "stage.py").write_text(STAGE)
    (root / "params.yaml").write_text(yaml.safe_dump(PARAMS, sort_keys=False))
    stage = {"cmd": f"{sys.executable} stage.py", "deps": ["stage.py"], "params": ["train", "dp", "audit"]}
    stage["metrics"] = [{"metrics/summary.json": {"cache": False}}]
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"summary": stage}}))
    dvc(root, "repro", "-q")
    run(root, "git", "add", "-A")
    run(root, "git", "commit", "-qm", "first")
    later = {**PARAMS, "train": {**PARAMS["train"], "epochs": 5}, "dp": {**PARAMS["dp"], "target_epsilon": 3.0}}
    (root / "params.yaml").write_text(yaml.safe_dump(later, sort_keys=False))
    dvc(root, "repro", "-q")
    run(root, "git", "add", "-A")
    run(root, "git", "commit", "-qm", "second")
    dvc(root, "exp", "run", "-q", "-S", "train.learning_rate=0.25", "--name", "slower")
    run(root, "git", "checkout", "-q", "--", ".")  # (an experiment leaves its parameters in the workspace)
    flags = ["-S", "train.epochs=2", "-S", "dp.target_epsilon=8", "-S", "audit.attacks=[loss]"]
    dvc(root, "exp", "run", "-q", *flags, "-S", "train.optimizer=adam", "--name", "many-changes")
    run(root, "git", "checkout", "-q", "--", ".")  # the workspace as the last commit left it
    return root


def line_of(lines: list[str], name: str) -> str:
    [line] = [line for line in lines if line.split()[:1] == [name]]
    return line


def changes_shown(lines: list[str], name: str) -> list[str]:
    """The ``key=value`` items of a row: beside it, and on the lines that continue it (indented by 4 or more)."""
    start = lines.index(line_of(lines, name))
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("    "):
            break
        block.append(line)
    return sorted(item.strip() for line in block for item in line.split("  ") if "=" in item)


MANY = ['audit.attacks=["loss"]', "dp.target_epsilon=8", "train.epochs=2", "train.optimizer=adam"]


def test_each_experiment_shows_its_epsilon_verdict_and_exactly_what_it_changed(project: Path) -> None:
    lines = compare(project, "--width", "120")
    assert lines[0].split()[:4] == ["experiment", "created", "ε", "accuracy"]
    slower = line_of(lines, "slower")
    assert format_epsilon(3.0 - 3e-6) in slower.split() and "0.550" in slower.split() and "evidence" in slower
    assert changes_shown(lines, "slower") == ["train.learning_rate=0.25"]
    many = line_of(lines, "many-changes")
    assert format_epsilon(8.0 - 3e-6) in many.split() and "no demonstrated power" in many
    assert changes_shown(lines, "many-changes") == MANY
    assert changes_shown(lines, "workspace") == []  # the workspace holds the last commit again


def test_the_table_fits_the_width_asked_for_and_wraps_changes_without_losing_any(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No line is wider than asked, except a row's fixed columns where they alone are wider (about 100 here);
    the changes sit beside their row where the longest fits, else on the lines under it, whole either way."""
    monkeypatch.chdir(project)
    rows = experiment_rows(shown_experiments([]))
    for width in (160, 120, 100, 60):
        lines = render(rows, width)
        fixed = max(len(line) for line in lines if not line.startswith("    "))
        assert all(len(line) <= width for line in lines if line.startswith("    ")), width
        assert fixed <= max(width, len(line_of(lines, "many-changes").rstrip())), width
        assert changes_shown(lines, "many-changes") == MANY and changes_shown(lines, "slower") == [
            "train.learning_rate=0.25"
        ]
    beside, under = render(rows, 160), render(rows, 100)
    assert line_of(beside, "slower").endswith("train.learning_rate=0.25")
    assert line_of(under, "slower").endswith("evidence") and len(under) > len(beside)


def test_json_gives_each_row_its_numbers_verdict_and_changes_as_values(project: Path) -> None:
    """``--json``: the rows of the table, for scripts — every experiment with its commit, ε and accuracy as
    numbers, the verdict's parts by name, and the changed parameters as values, not text."""
    records = json.loads("\n".join(compare(project, "--json")))
    by_name = {record["experiment"]: record for record in records}
    slower, many = by_name["slower"], by_name["many-changes"]
    assert slower["changed"] == {"train.learning_rate": 0.25} and slower["commit"] == many["commit"] is not None
    assert slower["epsilon"] == pytest.approx(3.0 - 3e-6) and slower["test_accuracy"] == pytest.approx(0.55)
    assert slower["verdict"] == {"certificate": "within budget", "implementation": "conforms", "attacks": "evidence"}
    assert many["changed"] == {
        "audit.attacks": ["loss"],
        "dp.target_epsilon": 8,
        "train.epochs": 2,
        "train.optimizer": "adam",
    }
    assert by_name["workspace"]["commit"] is None and by_name["workspace"]["changed"] == {}
    assert slower["created"] and many["created"]  # DVC's timestamp, as it gives it


def test_older_commits_are_compared_with_the_newest(project: Path) -> None:
    """``-A``: every commit; the first commit differs from the newest in ε's target and the epochs."""
    lines = compare(project, "-A", "--width", "160")
    first = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=project, capture_output=True, text=True)
    [older] = [line for line in lines if line.split()[:1] == [first.stdout.strip()[:7]]]
    assert older.rstrip().endswith("dp.target_epsilon=2.0  train.epochs=3")
    assert format_epsilon(2.0 - 3e-6) in older.split()


def test_a_dvc_error_is_one_line_naming_it(project: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dpml", "compare", "--rev", "no-such-commit"],
        cwd=project,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert done.stderr.startswith("dpml: error: dvc exp show failed") and "no-such-commit" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_rows_compare_with_their_own_baseline_and_missing_values_show_as_dashes() -> None:
    """DVC's JSON shape (``dvc exp show --json``): a commit whose metrics file is missing shows ``-``; a removed
    parameter shows ``key=∅``; an experiment is compared with its commit, not with the first commit."""
    base = {"params": {"params.yaml": {"data": {"a": {"x": 1, "y": [1, 2]}}}}, "metrics": {}, "timestamp": None}
    exp = {"params": {"params.yaml": {"data": {"a": {"x": 1}}}}, "metrics": {}, "timestamp": None}
    other = {"params": {"params.yaml": {"data": {"a": {"x": 2, "y": [1, 2]}}}}, "timestamp": "2020-01-02T03:04:05"}
    shown = [
        {"rev": "workspace", "data": base},
        {"rev": "a" * 40, "name": "main", "data": other, "experiments": [{"revs": [{"rev": "b" * 40, "data": exp}]}]},
        {"rev": "c" * 40, "data": base},
    ]
    rows = experiment_rows(shown)
    assert [(r.name, r.parent) for r in rows] == [
        ("workspace", None),
        ("main", None),
        ("bbbbbbb", "main"),
        ("ccccccc", None),
    ]
    assert [changes(r) for r in rows] == [["a.x=1"], [], ["a.x=1", "a.y=∅"], ["a.x=1"]]
    table = render(rows, 120)
    assert table[3].split()[:4] == ["bbbbbbb", "-", "-", "-"]
    assert table[2].split()[:3] == ["main", "Jan", "02"]
    assert as_record(rows[2])["changed"] == {"a.x": 1, "a.y": None} and as_record(rows[2])["commit"] == "main"
    assert changes(Row("r", None, {}, {"k": 1}, None, None)) == []
    assert changes(Row("failed", None, {}, {}, "r", {"k": 1})) == []  # nothing read: no list of removals
