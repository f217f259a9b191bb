"""The code passes the linter the project pins (ruff, ``[tool.ruff]`` in pyproject.toml: pyflakes and syntax
errors) — what a reviewer would otherwise find by hand: an unused import, an undefined name, an f-string without
a placeholder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["dpml", "tests", "examples", "benchmarks", "flows", "tasks", "scripts"]


def test_the_code_passes_the_linter() -> None:
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *CHECKED], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def test_the_linter_finds_a_planted_unused_import(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("import os\n")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config",
                           str(ROOT / "pyproject.toml"), str(planted)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "F401" in done.stdout, done.stdout + done.stderr
