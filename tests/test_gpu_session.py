"""The prepared GPU session (``scripts/gpu_session.sh``) asks only for what its scripts take.

A lent GPU comes for minutes at a time; a step whose command names an option a benchmark no longer has, a model it
does not build or a test that was renamed costs that step's share of them. Dry (``SESSION_DRY``), the session
writes down each step's command and runs nothing; here each benchmark's own argument parser reads it (in a
subprocess, stopped right after the parse: nothing is measured, and no GPU is needed), and pytest collects the test
step's tests with its own options.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PARSE_THEN_STOP = """
import argparse, os, runpy, sys
parse = argparse.ArgumentParser.parse_args
def parse_then_stop(self, args=None, namespace=None):
    parse(self, args, namespace)
    print("ARGUMENTS TAKEN", flush=True)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_then_stop
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""Runs a script until its first argument parse, which ends it: exit 0 and the words ARGUMENTS TAKEN if the parser
took the arguments, argparse's exit 2 and its message if not."""


def session_commands(
    tmp_path: Path, steps: str = "pool tests families keep speed profile grouped peft moe layers"
) -> list[list[str]]:
    """The session's steps' commands, as a dry run writes them, each without its ``timeout N``."""
    written = tmp_path / "commands"
    env = {**os.environ, "SESSION_DRY": str(written), "SESSION_STEPS": steps}
    done = subprocess.run(
        ["bash", "scripts/gpu_session.sh", "--out", str(tmp_path / "out")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    commands = [shlex.split(line) for line in written.read_text().splitlines() if line.strip()]
    for command in commands:
        assert command[0] == "timeout" and float(command[1]) > 0, command
    return [command[2:] for command in commands]


def arguments_taken(command: list[str]) -> subprocess.CompletedProcess[str]:
    """``python3 SCRIPT ARGS…`` run up to its argument parse (:data:`PARSE_THEN_STOP`)."""
    assert command[0] == "python3" and command[1].endswith(".py"), command
    return subprocess.run(
        [sys.executable, "-c", PARSE_THEN_STOP, *command[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_dry_session_writes_every_step_and_runs_none_of_them(tmp_path: Path) -> None:
    commands = session_commands(tmp_path)
    scripts = [command[1] if command[1] != "-m" else command[2] for command in commands]
    assert scripts == [
        "benchmarks/graph_pool.py",
        "pytest",
        "benchmarks/families.py",
        "benchmarks/families.py",
        "benchmarks/speed.py",
        "benchmarks/speed.py",
        "benchmarks/speed.py",
        "benchmarks/speed.py",
        "benchmarks/speed.py",
        "benchmarks/speed.py",
        "benchmarks/speed_profile.py",
        "benchmarks/speed_profile.py",
        "benchmarks/grouped_conv_ways.py",
        "benchmarks/families.py",
        "benchmarks/families.py",
        "benchmarks/families.py",
    ]
    assert not list((tmp_path / "out").glob("*.md")), "a dry session measured something"
    assert [c[1] for c in session_commands(tmp_path, "speed")] == ["benchmarks/speed.py"] * 4


def test_each_benchmark_step_takes_its_arguments(tmp_path: Path) -> None:
    benchmarks = [command for command in session_commands(tmp_path) if command[1] != "-m"]
    for command in benchmarks:
        done = arguments_taken(command)
        assert done.returncode == 0 and "ARGUMENTS TAKEN" in done.stdout, (command, done.stdout, done.stderr[-2000:])


@pytest.mark.parametrize(
    "wrong",
    [
        ["--warm-up-rounds", "1"],  # an option the script does not have
        ["--models", "wrm"],  # a model it does not build
    ],
)
def test_a_wrong_argument_is_caught_before_the_session(tmp_path: Path, wrong: list[str]) -> None:
    """The check itself: the speed step with one argument wrong is refused, naming it."""
    speed = session_commands(tmp_path, "speed")[0]
    done = arguments_taken([*speed, *wrong])
    assert done.returncode == 2 and "ARGUMENTS TAKEN" not in done.stdout, done.stdout
    assert wrong[-1] in done.stderr or wrong[0] in done.stderr, done.stderr


def test_the_test_step_collects_its_tests_and_leaves_out_the_cpu_memory_one(tmp_path: Path) -> None:
    (pytest_step,) = session_commands(tmp_path, "tests")
    assert pytest_step[:3] == ["python3", "-m", "pytest"]
    files = [arg for arg in pytest_step if arg.startswith("tests/")]  # (a file, or one test of it: file::test)
    assert files and all((ROOT / f.split("::")[0]).is_file() for f in files), files
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *(arg for arg in pytest_step[3:] if arg != "-q")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    for file in files:
        asked = file if "::" in file else file + "::"
        assert any(line.startswith(asked) for line in collected), (file, done.stdout[-2000:])
    assert not any("wide_resnet_peaks" in line for line in collected)
    assert "(1 deselected)" in done.stdout, "the test step's -k leaves out no test, or more than one: renamed?"
