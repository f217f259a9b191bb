"""The terminal side of the CLI: --version, help examples, the progress helper, warnings from elsewhere."""

from __future__ import annotations

import fcntl
import json
import importlib.metadata
import logging
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from conftest import REPO
from dpml.cli import build_parser, main
from dpml.cli_help import EXAMPLES
from dpml.progress import progress_over, progress_range
from dpml.terminal import from_dpml, warning_line

COMMANDS = (
    "run",
    "tune",
    "stage",
    "audit",
    "reproduce",
    "certificate",
    "schema",
    "calibrate",
    "ledger",
    "epsilon",
    "compare",
    "completion",
)


def test_version_is_the_installed_packages(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"dpml {importlib.metadata.version('dpml')}"


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_help_ends_with_its_examples(command: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"] if command else ["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    examples = text[text.index("\nexamples:\n") :]
    for line, what in EXAMPLES[command or "dpml"]:
        assert f"\n  {line}\n      {what}" in examples
    assert set(EXAMPLES) == {"dpml", *COMMANDS}


def test_verbose_is_accepted_before_and_after_the_command() -> None:
    parser = build_parser()
    assert parser.parse_args(["--verbose", "run"]).verbose and parser.parse_args(["run", "--verbose"]).verbose
    assert not parser.parse_args(["run"]).verbose and not parser.parse_args(["--verbose", "stage", "train"]).debug


def test_progress_off_the_terminal_is_silent_and_untouched(capsys: pytest.CaptureFixture[str]) -> None:
    assert list(progress_range(7, "train", "step", True)) == list(range(7))
    assert progress_range(7, "train", "step", False) == range(7)  # no wrapper at all when not asked for
    assert capsys.readouterr().err == ""


def test_progress_in_a_terminal_is_a_tqdm_bar(tmp_path: Path) -> None:
    script = "from dpml.progress import progress_range\nfor _ in progress_range(40, 'train', 'step', True): pass\n"
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    assert child.wait(timeout=60) == 0
    assert b"\rtrain:   0%|" in seen and b"| 0/40 [" in seen  # drawn, then cleared (leave=False)


def test_progress_in_a_prefect_run_is_a_few_lines_of_its_log(prefect_harness: None) -> None:
    from prefect import flow, get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    @flow(name="progress-lines")
    def counting() -> int:
        return sum(1 for _ in progress_over(iter(range(750)), 750, "train", "step"))

    runs_log = logging.getLogger("prefect.flow_runs")
    level = runs_log.level
    runs_log.setLevel(logging.INFO)  # the tests run Prefect at PREFECT_LOGGING_LEVEL=WARNING (conftest)
    try:
        state = counting(return_state=True)
    finally:
        runs_log.setLevel(level)
    assert state.result() == 750
    APILogHandler().flush()  # send the batched log lines before reading them back
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    lines = [log.message for log in logs if log.message.startswith("train: ")]
    assert [line.split(" s)")[0].rsplit(",", 1)[0] for line in lines] == [
        "train: 20% (150/750 steps",
        "train: 40% (300/750 steps",
        "train: 60% (450/750 steps",
        "train: 80% (600/750 steps",
        "train: 100% (750/750 steps",
    ]


def test_other_libraries_warnings_are_shown_only_when_verbose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert from_dpml(str(REPO / "dpml" / "preflight.py")) and from_dpml(str(REPO / "flows" / "pipeline.py"))
    assert not from_dpml(logging.__file__) and not from_dpml(str(tmp_path / "dpml" / "x.py"))
    warning_line("from elsewhere", UserWarning, logging.__file__, 1)
    warning_line("from dpml", UserWarning, str(REPO / "dpml" / "preflight.py"), 1)
    warning_line("from elsewhere, verbose", UserWarning, logging.__file__, 1, verbose=True)
    assert capsys.readouterr().err.splitlines() == [
        "dpml: warning: from dpml",
        "dpml: warning: from elsewhere, verbose",
    ]


PREFECT_RUN = """
import sys
from dpml.terminal import quiet_third_party_output
if sys.argv[1] == "quiet":
    quiet_third_party_output()  # as `dpml run` does without --verbose, before Prefect is imported
from prefect import flow, task
from prefect.testing.utilities import prefect_test_harness
from dpml.progress import progress_over

@task(name="count-task")
def count() -> int:
    return sum(1 for _ in progress_over(iter(range(50)), 50, "train", "step"))

@flow(name="quiet-check")
def pipeline() -> int:
    return count()

with prefect_test_harness(server_startup_timeout=120):  # a loaded machine starts the server slowly
    print("result", pipeline())
"""


@pytest.mark.parametrize("mode", ["quiet", "verbose"])
def test_prefects_own_lines_leave_the_console_unless_verbose_and_dpmls_stay(mode: str, tmp_path: Path) -> None:
    """A real flow run with a task in a child process: quietened as the CLI does, Prefect's own INFO lines (a run
    began, "Finished in state Completed()") are gone from the console and dpml's progress lines are there; without
    it (``--verbose``) both are."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_LOGGING")}
    env.update(PREFECT_LOGGING_LEVEL="INFO", PREFECT_HOME=str(tmp_path / "prefect"))
    done = subprocess.run(
        [sys.executable, "-c", PREFECT_RUN, mode], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "result 50" in done.stdout, done.stderr[-3000:]
    progress = [line for line in done.stderr.splitlines() if "train: " in line]
    assert len(progress) == 5 and progress[-1].split(" - ", 1)[1].startswith("train: 100% (50/50 steps")
    prefects_own = [
        line for line in done.stderr.splitlines() if "Finished in state" in line or "Beginning flow run" in line
    ]
    assert (prefects_own == []) == (mode == "quiet"), done.stderr[-3000:]


def test_run_and_audit_with_json_print_only_their_record(tmp_path: Path) -> None:
    """``--json`` on the commands that report a run: stdout is one JSON document (a script reads it whole) whose
    numbers are the run's own files', and the progress lines go to stderr. A real pipeline run and re-audit."""
    from conftest import small_params, write_params

    audit = {"attacks": ["loss"], "references": 0, "white_box_canaries": 0, "black_box_canaries": 100, "control": False}
    write_params(tmp_path / "params.yaml", small_params(tmp_path, audit=audit))
    env = {**os.environ, "DPML_NOISE_SEED": "7"}
    done = subprocess.run(
        [sys.executable, "-m", "dpml", "run", "--engine", "local", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout)
    assert "[dpml] train …" in done.stderr and "dpml run summary" not in done.stdout + done.stderr
    certificate = json.loads((tmp_path / "artifacts" / "certify" / "certificate.json").read_text())
    assert record["epsilon"] == certificate["epsilon"] and record["delta"] == 1e-5
    assert record["model_uri"] == "models:/dpml-test-model/1" and record["verdict"]["title"].startswith(
        ("PASSED", "FAILED")
    )
    assert set(record["verdict"]) >= {"title"} and record["lineage"] and record["run_id"]

    again = subprocess.run(
        [sys.executable, "-m", "dpml", "audit", "--model", record["model_uri"], "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert again.returncode in (0, 3), again.stderr[-3000:]
    audited = json.loads(again.stdout)
    assert audited["model_uri"] == record["model_uri"] and audited["certified_epsilon"] == record["epsilon"]
    assert set(audited["attacks"]) == {"loss"} and audited["consistent"] == (again.returncode == 0)
