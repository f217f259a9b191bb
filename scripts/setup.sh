#!/usr/bin/env bash
# Create .venv (if needed) and install dpml with every dependency pinned (requirements.lock).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade "pip==26.3"
.venv/bin/python -m pip install --quiet -r requirements.lock
.venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
# `dvc plots show` offline: vega, vega-lite and vega-embed from npm, inlined in a page template.
if command -v npm >/dev/null 2>&1; then
  mkdir -p build/npm
  (cd build/npm && npm pack --silent vega@5.20.2 vega-lite@5.2.0 vega-embed@6.18.2 >/dev/null)
  .venv/bin/python scripts/build_plots_template.py build/npm build/dvc-plots-offline.html
else
  echo "npm not found: dvc plots show needs a network for its charts (README, Comparing runs with DVC)" >&2
fi
