"""The code passes the linter the project pins (ruff, ``[tool.ruff]`` in pyproject.toml: pyflakes, pycodestyle,
bugbear and flake8-pie) — what a reviewer would otherwise find by hand: an unused import, an undefined name, an
f-string without a placeholder, a mutable default, a loop variable never used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["dpml", "tests", "examples", "benchmarks", "flows", "tasks", "scripts", "docs"]


def test_the_code_passes_the_linter() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", *CHECKED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


@pytest.mark.parametrize(
    "code, rule",
    [("import os\n", "F401"), ("def f(x=[]):\n    return x\n", "B006"), ("for i in range(3):\n    print(0)\n", "B007")],
)
def test_the_linter_finds_a_planted_mistake(code: str, rule: str, tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(code)
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(planted)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and rule in done.stdout, done.stdout + done.stderr


def test_the_code_is_laid_out_by_the_formatter() -> None:
    """``ruff format`` (``[tool.ruff.format]``): one layout, so a diff shows what changed, not who wrote it."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", *CHECKED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def test_the_formatter_check_finds_a_planted_layout(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("x = { 'a':1 }\n")
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "--config", str(ROOT / "pyproject.toml")]
        + [str(planted)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "planted.py" in done.stdout, done.stdout + done.stderr


# the type checker's strict mode holds here ([tool.mypy] in pyproject.toml)
STRICTLY_TYPED = ["dpml/accounting", "dpml/ledger", "dpml/train"]


def _mypy(*arguments: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--cache-dir",
            str(cache),
            "--config-file",
            str(ROOT / "pyproject.toml"),
            *arguments,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_privacy_packages_pass_the_type_checker_in_strict_mode(tmp_path: Path) -> None:
    done = _mypy(*STRICTLY_TYPED, cache=tmp_path / "cache")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def test_the_type_checker_finds_a_planted_type_error(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("def epsilon(delta: float) -> float:\n    return str(delta)\n")
    done = _mypy(str(planted), cache=tmp_path / "cache")
    assert done.returncode == 1 and "[return-value]" in done.stdout, done.stdout + done.stderr
