"""dpml as a library that installs beside others: ``pyproject.toml`` declares compatible ranges (the versions the
suite runs on, up to the next major release), ``requirements.lock`` pins the application's environment inside
them, and the built wheel resolves beside an unrelated package set (a notebook's, with another torch than the
lock's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
BESIDE = ["requests", "rich", "polars", "seaborn", "statsmodels", "httpx"]  # a notebook's packages


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return [Requirement(text) for text in project["dependencies"]]


def locked() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text(encoding="utf-8").splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split(";")[0].split("==")
            pins[canonicalize_name(name.split("[")[0])] = Version(version.strip())
    return pins


def test_dependencies_are_ranges_with_a_ceiling_and_the_lock_lies_inside_them() -> None:
    """Each direct dependency has a floor and a ceiling (never one exact version), and the lock's version of it
    satisfies them: the environment the README's commands build is one the ranges allow."""
    pins = locked()
    for requirement in declared():
        operators = {spec.operator for spec in requirement.specifier}
        assert "==" not in operators and ">=" in operators and "<" in operators, str(requirement)
        version = pins.get(canonicalize_name(requirement.name))
        assert version is not None, f"{requirement.name} is not in requirements.lock"
        assert requirement.specifier.contains(version, prereleases=True), f"lock {version} outside {requirement}"


def test_python_is_a_floor_only() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["requires-python"] == ">=3.11"


def _wheel(out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(ROOT), "-w", str(out)],
        check=True,
        timeout=600,
    )
    (wheel,) = out.glob("dpml-*.whl")
    return wheel


def _resolve(environment: Path, *requirements: str) -> subprocess.CompletedProcess[str]:
    """pip's resolver in a fresh virtual environment, without installing (``--dry-run``): it succeeds only when
    every requirement of every package it would install is met, what ``pip check`` checks after an install."""
    clean = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # the checkout is no install
    return subprocess.run(
        [
            str(environment / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--dry-run",
            "-q",
            "--report",
            str(environment / "report.json"),
            *requirements,
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        env=clean,
    )


@pytest.mark.exhaustive
def test_the_wheel_resolves_beside_an_unrelated_package_set(tmp_path: Path) -> None:
    """The built wheel and a notebook's packages (another torch than the lock's among them) resolve together in a
    fresh virtual environment; and the same resolution fails where a package asks for a version outside dpml's
    ranges (pandas 2), so the check can fail."""
    wheel = _wheel(tmp_path / "dist")
    environment = tmp_path / "env"
    venv.create(environment, with_pip=True)
    locked_torch = str(locked()["torch"]).split("+")[0]
    done = _resolve(environment, str(wheel), *BESIDE, f"torch!={locked_torch}")
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads((environment / "report.json").read_text())["install"]
    }
    assert chosen["dpml"] == "0.1.0" and chosen["torch"].split("+")[0] != locked_torch
    refused = _resolve(environment, str(wheel), "pandas<3")
    assert refused.returncode != 0 and "dpml" in refused.stderr and "pandas" in refused.stderr, refused.stderr[-3000:]
