#!/usr/bin/env bash
# Create .venv (if needed) and install dpml with every dependency pinned (requirements.lock).
# Says what it is doing before each step; the long one (the pinned packages) shows pip's own lines.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
say() { echo "[setup] $*"; }
if [ ! -x .venv/bin/python ]; then
  say "creating the virtual environment .venv ($("$PY" --version 2>&1))"
  "$PY" -m venv .venv
fi
say "pinning pip"
.venv/bin/python -m pip install --quiet --upgrade "pip==26.3"
packages=$(grep -cE '^[A-Za-z0-9]' requirements.lock)
say "installing ${packages} pinned packages from requirements.lock (a few minutes the first time, seconds afterwards)"
# pip's "Collecting"/"Downloading"/"Installing" lines for what is missing; nothing for what is already there
.venv/bin/python -m pip install --progress-bar off -r requirements.lock | { grep -vE '^Requirement already satisfied' || true; }
say "installing dpml itself (editable)"
.venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
# `dvc plots show` offline: vega, vega-lite and vega-embed from npm, inlined in a page template.
if command -v npm >/dev/null 2>&1; then
  say "fetching vega, vega-lite and vega-embed (npm) for dvc plots show offline"
  mkdir -p build/npm
  (cd build/npm && npm pack --silent vega@5.20.2 vega-lite@5.2.0 vega-embed@6.18.2 >/dev/null)
  .venv/bin/python scripts/build_plots_template.py build/npm build/dvc-plots-offline.html
  # and DVC told to use it (this checkout only: .dvc/config.local is not committed), so that a plain
  # `dvc plots show` renders offline; the path is relative to .dvc/
  .venv/bin/dvc config --local plots.html_template ../build/dvc-plots-offline.html
else
  echo "npm not found: dvc plots show needs a network for its charts (README, Comparing runs with DVC)" >&2
fi
say "done: $(.venv/bin/dpml --version)"
